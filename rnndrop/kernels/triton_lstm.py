r"""The LSTM recurrence of the "triton" kernel. Each pass runs the persistent loop
(:mod:`rnndrop.kernels.persistent`: every step in one launch) where :func:`~rnndrop.kernels.persistent.plan`
allows, else the per-step loop below: per step one recurrent product (cuBLAS) and one fused Triton
kernel, forward and backward, as cuDNN does. Both save the same tensors for backward.

The equations are those of :mod:`rnndrop.kernels.lstm`; per step ``t`` (rows and the masked state
``m_t = h_{t-1} * M_t`` as in :mod:`rnndrop.kernels.triton_common`)::

    forward   product  p_t = W_hh m_t                       (torch.mm; per gate one bmm)
              kernel   i, f, g, o = σ(x̂_i + p_i), σ(x̂_f + p_f), tanh(x̂_g + p_g), σ(x̂_o + p_o)
                       c_t = f c_{t-1} + i g,   r_t = o tanh(c_t)
                       saves (i, f, g, o) and c_t; writes h_t = r_t and m_{t'} = h_t * M_{t'}
    backward  kernel   dh_t gathered (dm_{t'} * M_{t'} + carry + d_out_t),  dr = dh_t
                       tc = tanh(c_t),  dc = dc_t + dr o (1 - tc²)
                       dz_i = dc g i (1 - i),  dz_f = dc c_{t-1} f (1 - f)
                       dz_g = dc i (1 - g²),   dz_o = dr tc o (1 - o),   dc_{t-1} = dc f
              product  dm_t = W_hh^T dz_t

Two launches per step and direction each way. With a projection (``h_t = W_hr r_t``) the kernel
writes ``r_t``, a product gives ``h_t`` and :func:`~rnndrop.kernels.triton_common.next_state` the
masked state; backward, :func:`~rnndrop.kernels.triton_common.state_grad` gathers ``dh_t`` and a
product gives ``dr = W_hr^T dh_t`` before the kernel: four launches each way. ``dW_hh``,
``dW_hr`` and the mask's gradient are products over all steps after the loop, as in the manual
kernel. ``tanh(c_t)`` is recomputed in backward rather than kept.
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
from rnndrop.kernels.matmul import matmul
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

__all__ = ["backward_saved", "forward_saving", "lstm_recurrence", "saved_like"]


@triton.jit
def _preactivation(x_ptr, p_ptr, rows, acc):
    return tl.load(x_ptr, mask=rows, other=0.0).to(acc) + tl.load(p_ptr, mask=rows, other=0.0).to(acc)


@triton.jit
def _forward_step(
    gx_ptr, p_ptr, p_row, p_gate, c_prev_ptr, c0_ptr, acts_ptr, cells_ptr, h_ptr,
    h0_ptr, mask_ptr, mask_row, mask_gate, m_ptr, m_row, m_gate, b, carried, b_next, H, n,
    MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_NEXT: tl.constexpr, BLOCK: tl.constexpr,
):
    k, j, lanes, rows = lanes_of(b, H, n, BLOCK)
    acc = cells_ptr.dtype.element_ty
    x = gx_ptr + k * 4 * H + j
    p = p_ptr + k * p_row + j
    i = sigmoid(_preactivation(x, p, rows, acc))
    f = sigmoid(_preactivation(x + H, p + p_gate, rows, acc))
    g = tanh(_preactivation(x + 2 * H, p + 2 * p_gate, rows, acc))
    o = sigmoid(_preactivation(x + 3 * H, p + 3 * p_gate, rows, acc))
    c = f * load_previous(c_prev_ptr, c0_ptr, k, j, H, carried, rows, acc) + i * g
    h = o * tanh(c)
    a = acts_ptr + k * 4 * H + j
    tl.store(a, i, mask=rows)
    tl.store(a + H, f, mask=rows)
    tl.store(a + 2 * H, g, mask=rows)
    tl.store(a + 3 * H, o, mask=rows)
    tl.store(cells_ptr + k * H + j, c, mask=rows)
    tl.store(h_ptr + k * H + j, h, mask=rows)
    if WRITE_NEXT:
        store_next_state(h, k, j, H, b, b_next, lanes, h0_ptr, mask_ptr, mask_row, mask_gate,
                         m_ptr, m_row, m_gate, MASK_GATES, HAS_MASK)


@triton.jit
def _backward_step(
    d_out_ptr, dm_ptr, dm_row, dm_gate, mask_ptr, mask_row, mask_gate, dh_state_ptr, dr_ptr,
    acts_ptr, cells_ptr, c_prev_ptr, c0_ptr, dc_state_ptr, dz_ptr, b, carried, b_next, H, n,
    MASK_GATES: tl.constexpr, HAS_DOUT: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_MASK: tl.constexpr,
    PROJ: tl.constexpr, BLOCK: tl.constexpr,
):
    k, j, lanes, rows = lanes_of(b, H, n, BLOCK)
    acc = dc_state_ptr.dtype.element_ty
    if PROJ:  # dr = W_hr^T dh_t came from a product
        dr = tl.load(dr_ptr + k * H + j, mask=rows, other=0.0).to(acc)
    else:
        dr = gather_state_grad(d_out_ptr, dm_ptr, dm_row, dm_gate, mask_ptr, mask_row, mask_gate,
                               dh_state_ptr,
                               k, j, H, b, b_next, lanes, acc, MASK_GATES, HAS_DOUT, HAS_NEXT, HAS_MASK)
        tl.store(dh_state_ptr + k * H + j, tl.zeros_like(dr), mask=rows)  # the LSTM sends nothing directly
    a = acts_ptr + k * 4 * H + j
    i = tl.load(a, mask=rows, other=0.0).to(acc)
    f = tl.load(a + H, mask=rows, other=0.0).to(acc)
    g = tl.load(a + 2 * H, mask=rows, other=0.0).to(acc)
    o = tl.load(a + 3 * H, mask=rows, other=0.0).to(acc)
    tc = tanh(tl.load(cells_ptr + k * H + j, mask=rows, other=0.0))
    c_prev = load_previous(c_prev_ptr, c0_ptr, k, j, H, carried, rows, acc)
    dc = tl.load(dc_state_ptr + k * H + j, mask=rows, other=0.0) + dr * o * (1 - tc * tc)
    dz = dz_ptr + k * 4 * H + j
    tl.store(dz, dc * g * i * (1 - i), mask=rows)
    tl.store(dz + H, dc * c_prev * f * (1 - f), mask=rows)
    tl.store(dz + 2 * H, dc * i * (1 - g * g), mask=rows)
    tl.store(dz + 3 * H, dr * tc * o * (1 - o), mask=rows)
    tl.store(dc_state_ptr + k * H + j, dc * f, mask=rows)


class _Saved(NamedTuple):
    acts: Tensor  # [N, 4H]: i, f, g, o (compute dtype)
    cells: Tensor  # [N, H]: c_t (accumulation dtype)
    out: Tensor  # [N, P]: h_t
    r: Tensor | None  # [N, H]: o * tanh(c_t), with a projection
    masked: Tensor | None  # [N, (G,) P]: m_t, with a mask
    h0: Tensor
    c0: Tensor
    w_hh: Tensor
    w_hr: Tensor | None
    mask: Tensor | None


def _forward(schedule: Schedule, gates_x, h0, c0, w_hh, w_hr, mask):
    """``(out, h_n, c_n)`` and what backward needs besides the inputs: ``acts, cells, r, masked``."""
    N, H, (B, P), device = gates_x.shape[0], c0.shape[1], h0.shape, gates_x.device
    G = mask.shape[2] if mask is not None and mask.dim() == 4 else 1
    acts = gates_x.new_empty(N, 4 * H)
    cells = torch.empty(N, H, dtype=accumulation_dtype(gates_x.dtype), device=device)
    out = gates_x.new_empty(N, P)
    r = out if w_hr is None else gates_x.new_empty(N, H)
    masked = None if mask is None else gates_x.new_empty(N, *mask.shape[2:])
    scratch = gates_x.new_empty(B, P)
    products = StepProducts(w_hh, 4, G, B)
    steps = plan_steps(schedule)
    flags = dict(MASK_GATES=G, HAS_MASK=mask is not None)
    m, m_row, m_gate = state_rows(masked, scratch, steps[0].offset, steps[0].size)
    launch(next_state, steps[0].size * P, device, h0, h0, *mask_rows(mask, steps[0].t, h0), m, m_row, m_gate,
           0, steps[0].size, P, **flags, F64=cells.dtype == torch.float64)
    for step in steps:
        b, rows = step.size, step.rows
        p, p_row, p_gate = products.forward(m)
        target, m_row, m_gate = next_state_target(step, masked, scratch)
        write_next = target is not None and w_hr is None
        lanes = max(b, step.next_size) if write_next else b
        mask_next = mask_rows(mask, step.next_t, h0)
        launch(_forward_step, lanes * H, device, gates_x[rows], p, p_row, p_gate, cells[step.prev_offset :],
               c0, acts[rows], cells[rows], r[rows], h0, *mask_next, scratch if target is None else target,
               m_row, m_gate, b, step.carried, step.next_size, H, **flags, WRITE_NEXT=write_next)
        if w_hr is not None:
            torch.mm(r[rows], w_hr.t(), out=out[rows])
            if target is not None:
                launch(next_state, max(b, step.next_size) * P, device, out[rows], h0, *mask_next, target,
                       m_row, m_gate, b, step.next_size, P, **flags, F64=cells.dtype == torch.float64)
        m = target if target is not None else out[step.offset : step.offset + step.next_size]
    final = schedule.final_rows(device)
    h_n, c_n = out.index_select(0, final), cells.index_select(0, final).to(c0.dtype)
    return out, h_n, c_n, acts, cells, None if w_hr is None else r, masked


def _backward(schedule: Schedule, needs: Sequence[bool], *tensors):
    """The gradients of ``(gates_x, h0, c0, w_hh, w_hr, mask)``, None where not needed, from the
    fields of :class:`_Saved` and ``d_out, d_hn, d_cn``."""
    s, (d_out, d_hn, d_cn) = _Saved(*tensors[:-3]), tensors[-3:]
    (N, H), (B, P), device = s.cells.shape, s.h0.shape, s.cells.device
    G = s.mask.shape[2] if s.mask is not None and s.mask.dim() == 4 else 1
    d_gates = s.acts.new_empty(N, 4 * H)
    dh_state = initial_grad(d_hn, s.h0, s.cells.dtype)  # then dh_0
    dc_state = initial_grad(d_cn, s.c0, s.cells.dtype)  # then dc_0
    d_masked = s.masked.new_empty(s.masked.shape) if needs[5] and s.masked is not None else None
    d_h = dr = None
    if s.w_hr is not None:
        d_h, dr = s.out.new_empty(N, P), s.acts.new_empty(B, H)
    d_out = None if d_out is None else d_out.contiguous()
    products = StepProducts(s.w_hh, 4, G, B)
    flags = dict(MASK_GATES=G, HAS_DOUT=d_out is not None, HAS_MASK=s.mask is not None)
    dm, dm_row, dm_gate = dh_state, 0, 0
    for step in reversed(plan_steps(schedule)):
        b, rows = step.size, step.rows
        grad_in = (dh_state if d_out is None else d_out[rows], dm, dm_row, dm_gate,
                   *mask_rows(s.mask, step.next_t, dh_state), dh_state)
        lanes = max(b, step.next_size)
        if s.w_hr is not None:
            launch(state_grad, lanes * P, device, *grad_in, d_h[rows], b, step.next_size, P, **flags,
                   HAS_NEXT=step.next_t >= 0)
            torch.mm(d_h[rows], s.w_hr, out=dr[:b])
            lanes = b
        launch(_backward_step, lanes * H, device, *grad_in, dh_state if dr is None else dr, s.acts[rows],
               s.cells[rows], s.cells[step.prev_offset :], s.c0, dc_state, d_gates[rows], b, step.carried,
               step.next_size, H, **flags, HAS_NEXT=step.next_t >= 0, PROJ=s.w_hr is not None)
        dm, dm_row, dm_gate = products.backward(d_gates[rows])
        if d_masked is not None:
            d_masked[rows].copy_(dm if G == 1 else dm.transpose(0, 1))
    first = schedule.steps[0]
    launch(state_grad, first.size * P, device, dh_state, dm, dm_row, dm_gate,
           *mask_rows(s.mask, first.t, dh_state), dh_state, dh_state, 0, first.size, P,
           **dict(flags, HAS_DOUT=False), HAS_NEXT=True)
    return (d_gates if needs[0] else None, as_dtype(dh_state, s.h0.dtype) if needs[1] else None,
            as_dtype(dc_state, s.c0.dtype) if needs[2] else None,
            *_whole_sequence_grads(s, d_gates, d_h, d_masked, schedule, needs))


def _persistent_backward(how: persistent.Launch, schedule: Schedule, needs: Sequence[bool], *tensors):
    """:func:`_backward` by the persistent loop (:mod:`rnndrop.kernels.persistent`); None where a
    launch failed (the device is then marked, and the step kernel runs)."""
    s, (d_out, d_hn, d_cn) = _Saved(*tensors[:-3]), tensors[-3:]
    result = persistent.lstm_backward(how, schedule, needs, s, d_out, d_hn, d_cn)
    if result is None:  # the device is marked: the step kernel runs
        return None
    d_gates, dh0, dc0, d_masked = result
    return (d_gates if needs[0] else None, as_dtype(dh0, s.h0.dtype) if needs[1] else None,
            as_dtype(dc0, s.c0.dtype) if needs[2] else None,
            *_whole_sequence_grads(s, d_gates, None, d_masked, schedule, needs))


def _whole_sequence_grads(s: _Saved, d_gates, d_h, d_masked, schedule: Schedule, needs: Sequence[bool]):
    """``dW_hh``, ``dW_hr`` and ``dM``: products over all steps (as the manual kernel)."""
    h_prev = None
    if (needs[3] and s.masked is None) or d_masked is not None:
        h_prev = gather_previous(s.out, s.h0, schedule.previous_blocks())
    d_w_hh = mp.weight_grad(d_gates, h_prev if s.masked is None else s.masked) if needs[3] else None
    d_w_hr = matmul(d_h.t(), s.r) if needs[4] and s.w_hr is not None else None
    d_mask = None
    if d_masked is not None:
        d_mask = as_dtype(mp.mask_grad(schedule, s.mask, d_masked, h_prev), s.mask.dtype)
    return d_w_hh, d_w_hr, d_mask


def _forward_pass(schedule: Schedule, inputs: tuple, keep: bool):
    """The forward pass by the persistent loop or the step kernel: ``(result of _forward, the
    launch that ran or None)``; the persistent loop keeps what backward reads only if ``keep``."""
    gates_x, h0, c0, w_hh, w_hr, mask = inputs
    how = persistent.plan(gates_x, c0.shape[1], c0.shape[0], w_hr is not None, mask, cell="lstm")
    return persistent.first_or_step(
        how, gates_x,
        lambda how: persistent.lstm_forward(how, schedule, gates_x, h0, c0, w_hh, mask, keep=keep),
        lambda: GRAPHS(("lstm forward", *loop_key(schedule)), functools.partial(_forward, schedule), inputs),
    )


def _backward_pass(schedule: Schedule, how: persistent.Launch | None, needs: Sequence[bool], saved: Sequence,
                   d_out, d_hn, d_cn):
    """The gradients of ``(gates_x, h0, c0, w_hh, w_hr, mask)`` from the fields of :class:`_Saved`, by
    the persistent loop where ``how`` plans it and the device has not given it up, else by the step
    kernel."""
    run = functools.partial(_backward, schedule, needs)
    grads, _ = persistent.first_or_step(
        how, saved[0],
        lambda how: _persistent_backward(how, schedule, needs, *saved, d_out, d_hn, d_cn),
        lambda: GRAPHS(  # a mask's gradient copies an index from the host: not capturable
            ("lstm backward", *loop_key(schedule), needs), run, (*saved, d_out, d_hn, d_cn),
            capturable=not needs[5],
        ),
    )
    return grads


class _LSTMRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, gates_x, h0, c0, w_hh, w_hr, mask, schedule: Schedule):
        result, how = _forward_pass(schedule, (gates_x, h0, c0, w_hh, w_hr, mask), keep=True)
        out, h_n, c_n, acts, cells, r, masked = result
        ctx.schedule, ctx.how = schedule, how
        ctx.save_for_backward(*_Saved(acts, cells, out, r, masked, h0, c0, w_hh, w_hr, mask))
        ctx.set_materialize_grads(False)
        return out, h_n, c_n

    @staticmethod
    @first_order_backward("triton")
    def backward(ctx, d_out, d_hn, d_cn):
        needs = tuple(ctx.needs_input_grad[:6])
        return (*_backward_pass(ctx.schedule, ctx.how, needs, ctx.saved_tensors, d_out, d_hn, d_cn), None)


def _prepare(gates_x: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor, w_hr: Tensor | None,
             hidden_mask: Tensor | None) -> tuple:
    """The arguments as the loops read them: contiguous, the products' operands in the compute
    dtype (autocast's, under autocast)."""
    check_device(gates_x)
    dtype = compute_dtype(gates_x)
    return (as_dtype(gates_x, dtype).contiguous(), h0.contiguous(), c0.contiguous(),
            as_dtype(w_hh, dtype).contiguous(),
            None if w_hr is None else as_dtype(w_hr, dtype).contiguous(),
            None if hidden_mask is None else hidden_mask.contiguous())


def lstm_recurrence(
    gates_x: Tensor,
    batch_sizes: Sequence[int],
    h0: Tensor,
    c0: Tensor,
    w_hh: Tensor,
    w_hr: Tensor | None,
    hidden_mask: Tensor | None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The LSTM recurrence of one layer and direction (contract in :mod:`rnndrop.kernels`).

    Under autocast the products run in autocast's dtype: ``gates_x``, ``W_hh``, ``W_hr`` and the
    outputs ``out``, ``h_n`` in it, ``c_n`` in float32."""
    inputs = _prepare(gates_x, h0, c0, w_hh, w_hr, hidden_mask)
    schedule = Schedule.of(batch_sizes, reverse)
    if not will_differentiate(*inputs):  # no autograd Function, nothing kept for a backward
        out, h_n, c_n = _forward_pass(schedule, inputs, keep=False)[0][:3]
        return out, h_n, c_n
    out, h_n, c_n = _LSTMRecurrence.apply(*inputs, schedule)
    return out, h_n, c_n


# ---------------------------------------- the same passes as torch operators (rnndrop.kernels.ops)


def forward_saving(
    gates_x: Tensor, batch_sizes: list[int], h0: Tensor, c0: Tensor, w_hh: Tensor, w_hr: Tensor | None,
    hidden_mask: Tensor | None, reverse: bool, keep: bool,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """``(out, h_n, c_n, saved)``: the forward pass, with ``keep`` what backward reads besides the
    arguments and ``out`` as :func:`saved_like` lays it out: ``[acts, cells, masked]`` and ``r``
    with a projection. ``masked`` is kept even without a mask (then ``h_{t-1}`` of every row, which
    the persistent loop keeps anyway), so that the list's layout does not depend on which loop ran."""
    inputs = _prepare(gates_x, h0, c0, w_hh, w_hr, hidden_mask)
    schedule = Schedule.of(batch_sizes, reverse)
    (out, h_n, c_n, acts, cells, r, masked), _ = _forward_pass(schedule, inputs, keep)
    if not keep:
        return out, h_n, c_n, []
    if masked is None:
        masked = gather_previous(out, inputs[1], schedule.previous_blocks())
    return out, h_n, c_n, [acts, cells, masked, *([] if r is None else [r])]


def saved_like(gates_x: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor, w_hr: Tensor | None,
               hidden_mask: Tensor | None) -> list[Tensor]:
    """Empty tensors shaped as :func:`forward_saving`'s ``saved`` (for torch.compile's tracing):
    ``acts [N, 4H]``, ``cells [N, H]`` (accumulation dtype), ``masked [N, (G,) P]``, ``r [N, H]``."""
    N, H, P = gates_x.shape[0], c0.shape[1], h0.shape[1]
    masked = (N, P) if hidden_mask is None else (N, *hidden_mask.shape[2:])
    saved = [gates_x.new_empty(N, 4 * H), gates_x.new_empty(N, H, dtype=accumulation_dtype(gates_x.dtype)),
             gates_x.new_empty(masked)]
    return saved if w_hr is None else [*saved, gates_x.new_empty(N, H)]


def backward_saved(
    batch_sizes: list[int], reverse: bool, needs: Sequence[bool], h0: Tensor, c0: Tensor, w_hh: Tensor,
    w_hr: Tensor | None, hidden_mask: Tensor | None, out: Tensor, saved: Sequence[Tensor],
    d_out: Tensor | None, d_hn: Tensor | None, d_cn: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """The gradients of ``(gates_x, h0, c0, w_hh, w_hr, hidden_mask)`` (None where not ``needs``)
    from :func:`forward_saving`'s ``out`` and ``saved``; the loop is planned again as forward
    planned it."""
    acts, cells, masked, *projected = saved
    _, h0, c0, w_hh, w_hr, mask = _prepare(acts, h0, c0, w_hh, w_hr, hidden_mask)
    schedule = Schedule.of(batch_sizes, reverse)
    how = persistent.plan(acts, c0.shape[1], c0.shape[0], w_hr is not None, mask, cell="lstm")
    s = _Saved(acts, cells, out, projected[0] if projected else None, masked, h0, c0, w_hh, w_hr, mask)
    return _backward_pass(schedule, how, needs, s, d_out, d_hn, d_cn)
