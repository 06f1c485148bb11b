r"""The GRU recurrence of the "triton" kernel. Each pass runs the persistent loop
(:mod:`rnndrop.kernels.persistent`: every step in one launch) where :func:`~rnndrop.kernels.persistent.plan`
allows, else the per-step loop below: per step one recurrent product (cuBLAS) and one fused Triton
kernel, forward and backward, as cuDNN does. Both save the same tensors for backward.

The equations are those of :mod:`rnndrop.kernels.gru`; per step ``t`` (rows and the masked state
``m_t = h_{t-1} * M_t`` as in :mod:`rnndrop.kernels.triton_common`)::

    forward   product  p_t = W_hh m_t                       (torch.mm; per gate one bmm)
              kernel   a = p_t + b_hh = (a_r, a_z, a_n)
                       r = σ(x̂_r + a_r),  z = σ(x̂_z + a_z),  n = tanh(x̂_n + r a_n)
                       h_t = n + z (h_{t-1} - n)
                       saves (r, z, n) and a_n; writes h_t and m_{t'} = h_t * M_{t'}
    backward  kernel   dh_t gathered (dm_{t'} * M_{t'} + dh_{t'} z_{t'} + d_out_t)
                       dn_pre = dh_t (1 - z) (1 - n²)
                       da_r = dn_pre a_n r (1 - r),  da_z = dh_t (h_{t-1} - n) z (1 - z),  da_n = dn_pre r
                       sends dh_t z on to the step before
              product  dm_t = W_hh^T da_t

Two launches per step and direction each way; ``dW_hh``, ``db_hh`` and the mask's gradient are
computed over all steps after the loop, as in the manual kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import FunctionCtx

from rnndrop.kernels import masked_product as mp
from rnndrop.kernels import persistent
from rnndrop.kernels.cuda_graphs import GRAPHS
from rnndrop.kernels.first_order import first_order_backward, will_differentiate
from rnndrop.kernels.schedule import Schedule, gather_previous
from rnndrop.kernels.triton_common import (
    gather_state_grad,
    lanes_of,
    load_previous,
    next_state,
    sigmoid,
    state_grad,
    store_next_state,
    tanh,
)
from rnndrop.kernels.triton_plan import (
    StepProducts,
    accumulation_dtype,
    as_dtype,
    check_device,
    compute_dtype,
    initial_grad,
    launch,
    loop_key,
    mask_rows,
    next_state_target,
    plan_steps,
    state_rows,
)

__all__ = ["backward_saved", "forward_saving", "gru_recurrence", "saved_like"]


@triton.jit
def _load(ptr, rows, acc):
    return tl.load(ptr, mask=rows, other=0.0).to(acc)


@triton.jit
def _forward_step(
    gx_ptr, p_ptr, p_row, p_gate, b_hh_ptr, h_prev_ptr, h0_ptr, acts_ptr, a_n_ptr, out_ptr,
    mask_ptr, mask_row, mask_gate, m_ptr, m_row, m_gate, b, carried, b_next, H, n,
    MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_NEXT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k, j, lanes, rows = lanes_of(b, H, n, BLOCK)
    acc = a_n_ptr.dtype.element_ty
    x = gx_ptr + k * 3 * H + j
    p = p_ptr + k * p_row + j
    a_r = _load(p, rows, acc)
    a_z = _load(p + p_gate, rows, acc)
    a_n = _load(p + 2 * p_gate, rows, acc)
    if HAS_BIAS:
        a_r += _load(b_hh_ptr + j, rows, acc)
        a_z += _load(b_hh_ptr + H + j, rows, acc)
        a_n += _load(b_hh_ptr + 2 * H + j, rows, acc)
    r = sigmoid(_load(x, rows, acc) + a_r)
    z = sigmoid(_load(x + H, rows, acc) + a_z)
    cand = tanh(_load(x + 2 * H, rows, acc) + r * a_n)
    h = cand + z * (load_previous(h_prev_ptr, h0_ptr, k, j, H, carried, rows, acc) - cand)
    a = acts_ptr + k * 3 * H + j
    tl.store(a, r, mask=rows)
    tl.store(a + H, z, mask=rows)
    tl.store(a + 2 * H, cand, mask=rows)
    tl.store(a_n_ptr + k * H + j, a_n, mask=rows)
    tl.store(out_ptr + k * H + j, h, mask=rows)
    if WRITE_NEXT:
        store_next_state(h, k, j, H, b, b_next, lanes, h0_ptr, mask_ptr, mask_row, mask_gate,
                         m_ptr, m_row, m_gate, MASK_GATES, HAS_MASK)


@triton.jit
def _backward_step(
    d_out_ptr, dm_ptr, dm_row, dm_gate, mask_ptr, mask_row, mask_gate, dh_state_ptr,
    acts_ptr, a_n_ptr, h_prev_ptr, h0_ptr, da_ptr, dn_ptr, b, carried, b_next, H, n,
    MASK_GATES: tl.constexpr, HAS_DOUT: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k, j, lanes, rows = lanes_of(b, H, n, BLOCK)
    acc = dh_state_ptr.dtype.element_ty
    dh = gather_state_grad(d_out_ptr, dm_ptr, dm_row, dm_gate, mask_ptr, mask_row, mask_gate, dh_state_ptr,
                           k, j, H, b, b_next, lanes, acc, MASK_GATES, HAS_DOUT, HAS_NEXT, HAS_MASK)
    a = acts_ptr + k * 3 * H + j
    r = _load(a, rows, acc)
    z = _load(a + H, rows, acc)
    cand = _load(a + 2 * H, rows, acc)
    h_prev = load_previous(h_prev_ptr, h0_ptr, k, j, H, carried, rows, acc)
    dn_pre = dh * (1 - z) * (1 - cand * cand)
    da = da_ptr + k * 3 * H + j
    tl.store(da, dn_pre * _load(a_n_ptr + k * H + j, rows, acc) * r * (1 - r), mask=rows)
    tl.store(da + H, dh * (h_prev - cand) * z * (1 - z), mask=rows)
    tl.store(da + 2 * H, dn_pre * r, mask=rows)
    tl.store(dn_ptr + k * H + j, dn_pre, mask=rows)
    tl.store(dh_state_ptr + k * H + j, dh * z, mask=rows)


class _Saved(NamedTuple):
    acts: Tensor  # [N, 3H]: r, z, n (compute dtype)
    a_n: Tensor  # [N, H]: the n part of W_hh m + b_hh (accumulation dtype)
    out: Tensor  # [N, H]: h_t
    masked: Tensor | None  # [N, (G,) H]: m_t, with a mask
    h0: Tensor
    w_hh: Tensor
    b_hh: Tensor | None
    mask: Tensor | None


def _forward(schedule: Schedule, gates_x, h0, w_hh, b_hh, mask):
    """``(out, h_n)`` and what backward needs besides the inputs: ``acts, a_n, masked``."""
    N, (B, H), device = gates_x.shape[0], h0.shape, gates_x.device
    G = mask.shape[2] if mask is not None and mask.dim() == 4 else 1
    acts = gates_x.new_empty(N, 3 * H)
    a_n = torch.empty(N, H, dtype=accumulation_dtype(gates_x.dtype), device=device)
    out = gates_x.new_empty(N, H)
    masked = None if mask is None else gates_x.new_empty(N, *mask.shape[2:])
    scratch = gates_x.new_empty(B, H)
    products = StepProducts(w_hh, 3, G, B)
    steps = plan_steps(schedule)
    flags = dict(MASK_GATES=G, HAS_MASK=mask is not None)
    m, m_row, m_gate = state_rows(masked, scratch, steps[0].offset, steps[0].size)
    launch(next_state, steps[0].size * H, device, h0, h0, *mask_rows(mask, steps[0].t, h0), m, m_row, m_gate,
           0, steps[0].size, H, **flags, F64=a_n.dtype == torch.float64)
    for step in steps:
        b, rows = step.size, step.rows
        p, p_row, p_gate = products.forward(m)
        target, m_row, m_gate = next_state_target(step, masked, scratch)
        lanes = b if target is None else max(b, step.next_size)
        launch(_forward_step, lanes * H, device, gates_x[rows], p, p_row, p_gate,
               h0 if b_hh is None else b_hh, out[step.prev_offset :], h0, acts[rows], a_n[rows], out[rows],
               *mask_rows(mask, step.next_t, h0),
               scratch if target is None else target, m_row, m_gate, b, step.carried, step.next_size, H,
               **flags, HAS_BIAS=b_hh is not None, WRITE_NEXT=target is not None)
        m = target if target is not None else out[step.offset : step.offset + step.next_size]
    return out, out.index_select(0, schedule.final_rows(device)), acts, a_n, masked


def _backward(schedule: Schedule, needs: Sequence[bool], *tensors):
    """The gradients of ``(gates_x, h0, w_hh, b_hh, mask)``, None where not needed, from the fields
    of :class:`_Saved` and ``d_out, d_hn``."""
    s, (d_out, d_hn) = _Saved(*tensors[:-2]), tensors[-2:]
    (N, H), device = s.out.shape, s.out.device
    B = s.h0.shape[0]
    G = s.mask.shape[2] if s.mask is not None and s.mask.dim() == 4 else 1
    d_a = s.acts.new_empty(N, 3 * H)
    d_n = s.acts.new_empty(N, H)
    dh_state = initial_grad(d_hn, s.h0, s.a_n.dtype)  # then dh_0
    d_masked = s.masked.new_empty(s.masked.shape) if needs[4] and s.masked is not None else None
    d_out = None if d_out is None else d_out.contiguous()
    products = StepProducts(s.w_hh, 3, G, B)
    flags = dict(MASK_GATES=G, HAS_DOUT=d_out is not None, HAS_MASK=s.mask is not None)
    dm, dm_row, dm_gate = dh_state, 0, 0
    for step in reversed(plan_steps(schedule)):
        b, rows = step.size, step.rows
        launch(_backward_step, max(b, step.next_size) * H, device, dh_state if d_out is None else d_out[rows],
               dm, dm_row, dm_gate, *mask_rows(s.mask, step.next_t, dh_state), dh_state, s.acts[rows],
               s.a_n[rows], s.out[step.prev_offset :], s.h0, d_a[rows], d_n[rows], b, step.carried,
               step.next_size, H, **flags, HAS_NEXT=step.next_t >= 0)
        dm, dm_row, dm_gate = products.backward(d_a[rows])
        if d_masked is not None:
            d_masked[rows].copy_(dm if G == 1 else dm.transpose(0, 1))
    first = schedule.steps[0]
    launch(state_grad, first.size * H, device, dh_state, dm, dm_row, dm_gate,
           *mask_rows(s.mask, first.t, dh_state), dh_state, dh_state, 0, first.size, H,
           **dict(flags, HAS_DOUT=False), HAS_NEXT=True)
    return _all_grads(s, schedule, needs, d_a, d_n, dh_state, d_masked)


def _all_grads(s: _Saved, schedule: Schedule, needs: Sequence[bool], d_a, d_n, dh0, d_masked):
    """The gradients of ``(gates_x, h0, w_hh, b_hh, mask)`` from those of the loop: ``d_a`` ``[N, 3H]``
    (of ``W_hh m + b_hh``), ``d_n`` ``[N, H]`` (of ``x̂_n``), ``dh_0`` and ``dm`` of every row.

    ``d gates_x`` is ``d_a`` with its last gate's block replaced by ``d_n`` (``d a_r = d x̂_r``,
    ``d a_z = d x̂_z``), written into ``d_a`` itself once the products over ``d_a`` are queued: a
    new ``[N, 3H]`` would be the largest buffer alive at backward's peak."""
    H = s.out.shape[1]
    h_prev = None
    if (needs[2] and s.masked is None) or d_masked is not None:
        h_prev = gather_previous(s.out, s.h0, schedule.previous_blocks())
    d_w_hh = mp.weight_grad(d_a, h_prev if s.masked is None else s.masked) if needs[2] else None
    d_b_hh = as_dtype(d_a.sum(0), s.b_hh.dtype) if needs[3] and s.b_hh is not None else None
    d_gates_x = None
    if needs[0]:
        d_gates_x = d_a
        d_gates_x[:, 2 * H :].copy_(d_n)
    return (
        d_gates_x,
        as_dtype(dh0, s.h0.dtype) if needs[1] else None,
        d_w_hh,
        d_b_hh,
        None if d_masked is None else as_dtype(mp.mask_grad(schedule, s.mask, d_masked, h_prev),
                                               s.mask.dtype),
    )


def _persistent_backward(how: persistent.Launch, schedule: Schedule, needs: Sequence[bool], *tensors):
    """:func:`_backward` by the persistent loop (:mod:`rnndrop.kernels.persistent`); None where a
    launch failed (the device is then marked, and the step kernel runs)."""
    s, (d_out, d_hn) = _Saved(*tensors[:-2]), tensors[-2:]
    result = persistent.gru_backward(how, schedule, needs, s, d_out, d_hn)
    if result is None:  # the device is marked: the step kernel runs
        return None
    return _all_grads(s, schedule, needs, *result)


def _forward_pass(schedule: Schedule, inputs: tuple, keep: bool):
    """As :func:`rnndrop.kernels.triton_lstm._forward_pass`, for the GRU."""
    gates_x, h0, w_hh, b_hh, mask = inputs
    how = persistent.plan(gates_x, h0.shape[1], h0.shape[0], False, mask, cell="gru")
    return persistent.first_or_step(
        how, gates_x,
        lambda how: persistent.gru_forward(how, schedule, gates_x, h0, w_hh, b_hh, mask, keep=keep),
        lambda: GRAPHS(("gru forward", *loop_key(schedule)), functools.partial(_forward, schedule), inputs),
    )


def _backward_pass(schedule: Schedule, how: persistent.Launch | None, needs: Sequence[bool], saved: Sequence,
                   d_out, d_hn):
    """As :func:`rnndrop.kernels.triton_lstm._backward_pass`, for the GRU: the gradients of
    ``(gates_x, h0, w_hh, b_hh, mask)`` from the fields of :class:`_Saved`."""
    run = functools.partial(_backward, schedule, needs)
    grads, _ = persistent.first_or_step(
        how, saved[0],
        lambda how: _persistent_backward(how, schedule, needs, *saved, d_out, d_hn),
        lambda: GRAPHS(  # a mask's gradient copies an index from the host: not capturable
            ("gru backward", *loop_key(schedule), needs), run, (*saved, d_out, d_hn),
            capturable=not needs[4],
        ),
    )
    return grads


class _GRURecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, gates_x, h0, w_hh, b_hh, mask, schedule: Schedule):
        result, how = _forward_pass(schedule, (gates_x, h0, w_hh, b_hh, mask), keep=True)
        out, h_n, acts, a_n, masked = result
        ctx.schedule, ctx.how = schedule, how
        ctx.save_for_backward(*_Saved(acts, a_n, out, masked, h0, w_hh, b_hh, mask))
        ctx.set_materialize_grads(False)
        return out, h_n

    @staticmethod
    @first_order_backward("triton")
    def backward(ctx, d_out, d_hn):
        needs = tuple(ctx.needs_input_grad[:5])
        return (*_backward_pass(ctx.schedule, ctx.how, needs, ctx.saved_tensors, d_out, d_hn), None)


def _prepare(gates_x: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
             hidden_mask: Tensor | None) -> tuple:
    """As :func:`rnndrop.kernels.triton_lstm._prepare`, for the GRU."""
    check_device(gates_x)
    dtype = compute_dtype(gates_x)
    return (as_dtype(gates_x, dtype).contiguous(), h0.contiguous(), as_dtype(w_hh, dtype).contiguous(),
            None if b_hh is None else b_hh.contiguous(),
            None if hidden_mask is None else hidden_mask.contiguous())


def gru_recurrence(
    gates_x: Tensor,
    batch_sizes: Sequence[int],
    h0: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    hidden_mask: Tensor | None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor]:
    """The GRU recurrence of one layer and direction (contract in :mod:`rnndrop.kernels`).

    Under autocast the products run in autocast's dtype: ``gates_x``, ``W_hh`` and the outputs in it."""
    inputs = _prepare(gates_x, h0, w_hh, b_hh, hidden_mask)
    schedule = Schedule.of(batch_sizes, reverse)
    if not will_differentiate(*inputs):  # as in triton_lstm.lstm_recurrence
        out, h_n = _forward_pass(schedule, inputs, keep=False)[0][:2]
        return out, h_n
    out, h_n = _GRURecurrence.apply(*inputs, schedule)
    return out, h_n


# ---------------------------------------- the same passes as torch operators (rnndrop.kernels.ops)


def forward_saving(
    gates_x: Tensor, batch_sizes: list[int], h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
    hidden_mask: Tensor | None, reverse: bool, keep: bool,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(out, h_n, saved)``, as :func:`rnndrop.kernels.triton_lstm.forward_saving`: ``saved`` is
    ``[acts, a_n, masked]`` (``masked`` kept even without a mask)."""
    inputs = _prepare(gates_x, h0, w_hh, b_hh, hidden_mask)
    schedule = Schedule.of(batch_sizes, reverse)
    (out, h_n, acts, a_n, masked), _ = _forward_pass(schedule, inputs, keep)
    if not keep:
        return out, h_n, []
    if masked is None:
        masked = gather_previous(out, inputs[1], schedule.previous_blocks())
    return out, h_n, [acts, a_n, masked]


def saved_like(gates_x: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
               hidden_mask: Tensor | None) -> list[Tensor]:
    """Empty tensors shaped as :func:`forward_saving`'s ``saved``: ``acts [N, 3H]``, ``a_n [N, H]``
    (accumulation dtype), ``masked [N, (G,) H]``."""
    N, H = gates_x.shape[0], h0.shape[1]
    masked = (N, H) if hidden_mask is None else (N, *hidden_mask.shape[2:])
    return [gates_x.new_empty(N, 3 * H), gates_x.new_empty(N, H, dtype=accumulation_dtype(gates_x.dtype)),
            gates_x.new_empty(masked)]


def backward_saved(
    batch_sizes: list[int], reverse: bool, needs: Sequence[bool], h0: Tensor, w_hh: Tensor,
    b_hh: Tensor | None, hidden_mask: Tensor | None, out: Tensor, saved: Sequence[Tensor],
    d_out: Tensor | None, d_hn: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """The gradients of ``(gates_x, h0, w_hh, b_hh, hidden_mask)`` (None where not ``needs``) from
    :func:`forward_saving`'s ``out`` and ``saved``; the loop is planned again as forward planned it."""
    acts, a_n, masked = saved
    _, h0, w_hh, b_hh, mask = _prepare(acts, h0, w_hh, b_hh, hidden_mask)
    schedule = Schedule.of(batch_sizes, reverse)
    how = persistent.plan(acts, h0.shape[1], h0.shape[0], False, mask, cell="gru")
    s = _Saved(acts, a_n, out, masked, h0, w_hh, b_hh, mask)
    return _backward_pass(schedule, how, needs, s, d_out, d_hn)
