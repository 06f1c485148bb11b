r"""The LSTM recurrence with a hand-written backward pass (the "manual" kernel).

Forward, for every step ``t`` on the rows of the sequences still running
(``x̂_t`` = ``gates_x`` rows = ``W_ih x_t + b_ih + b_hh``, hoisted by the layer;
``M`` the hidden mask, ``M^k`` the mask of gate ``k`` when there is one per gate)::

    m_t  = h_{t-1} * M_t                                  (per gate: m^k_t = h_{t-1} * M^k_t)
    z_t  = x̂_t + W_hh m_t  =  (z_i, z_f, z_g, z_o)        (per gate: z_k = x̂_k + W_hh^k m^k_t)
    i = σ(z_i),  f = σ(z_f),  g = tanh(z_g),  o = σ(z_o)
    c_t  = f * c_{t-1} + i * g
    r_t  = o * tanh(c_t)
    h_t  = r_t,   or  W_hr r_t  with a projection

Backward, running the steps in reverse; ``dh_t`` and ``dc_t`` start as the gradient
of the outputs and of ``h_n`` / ``c_n`` and collect what later steps send back::

    dr_t  = dh_t,  or  W_hr^T dh_t
    dc_t += dr_t * o * (1 - tanh²(c_t))
    dz_i  = dc_t * g * i (1 - i)            dz_f = dc_t * c_{t-1} * f (1 - f)
    dz_g  = dc_t * i * (1 - g²)             dz_o = dr_t * tanh(c_t) * o (1 - o)
    dc_{t-1} += dc_t * f
    dm_t  = W_hh^T dz_t                     (per gate: dm^k_t = W_hh^k^T dz_k)
    dh_{t-1} += dm_t * M_t                  (per gate: Σ_k dm^k_t * M^k_t)
    dM_t += dm_t * h_{t-1}                  (summed over the rows a mask is shared by)
    dx̂_t = dz_t,   dW_hh = Σ_t dz_t m_tᵀ,   dW_hr = Σ_t dh_t r_tᵀ

The factors that multiply ``dc_t`` and ``dr_t`` depend on the forward pass only and
are computed for all steps at once before the loop; inside the loop each step
costs five ops and one small matrix product (see :mod:`rnndrop.kernels.matmul`).
``dW_hh`` and ``dW_hr`` are one large product each over all steps, as cuDNN does.
Where rows live and where each finds its previous state: :mod:`rnndrop.kernels.schedule`.

The function is once differentiable: a double backward raises an error. Results
equal the reference kernel (:mod:`rnndrop.kernels.reference`) up to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from rnndrop.kernels import masked_product as mp
from rnndrop.kernels.first_order import first_order_backward, refuse_transforms
from rnndrop.kernels.gates import sigmoid_tanh_, tanh
from rnndrop.kernels.matmul import StepWeight, matmul
from rnndrop.kernels.schedule import (
    Schedule,
    add_product,
    gather_previous,
    mul_previous_,
    previous,
    previous_targets,
)


class _Inputs(NamedTuple):
    """The inputs of :class:`_LSTMRecurrence` in ``apply`` order (for ``needs_input_grad``)."""

    gates_x: bool
    h0: bool
    c0: bool
    w_hh: bool
    w_hr: bool
    mask: bool
    schedule: bool


class _Saved(NamedTuple):
    """What the forward pass keeps for the backward pass (``N`` rows)."""

    acts: Tensor  # [N, 4H]: i, f, g, o (after their nonlinearities)
    cells: Tensor  # [N, H]: c_t
    tanh_cells: Tensor  # [N, H]: tanh(c_t)
    out: Tensor  # [N, P]: h_t
    r: Tensor  # [N, H]: o * tanh(c_t), the state before the projection (``out`` without one)
    masked: Tensor | None  # [N, P] or [N, 4, P]: m_t, when there is a mask
    h0: Tensor
    c0: Tensor
    w_hh: Tensor
    w_hr: Tensor | None
    mask: Tensor | None
    final: Tensor  # [B]: the row of h_n / c_n of every sequence


class _LSTMRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, gates_x, h0, c0, w_hh, w_hr, mask, schedule: Schedule):
        N, H = gates_x.shape[0], c0.shape[1]
        acts = gates_x.new_empty(N, 4 * H)
        cells = gates_x.new_empty(N, H)
        tanh_cells = gates_x.new_empty(N, H)
        out = gates_x.new_empty(N, h0.shape[1])
        r = out if w_hr is None else gates_x.new_empty(N, H)
        masked = None if mask is None else gates_x.new_empty(N, *mask.shape[2:])

        at = schedule.by_step
        out_at, r_at, cell_at, acts_at = at(out), at(r), at(cells), at(acts)
        i_at, f_at, g_at, o_at = (at(a) for a in acts.split(H, 1))
        mask_at = schedule.step_masks(mask)
        masked_at = at(masked) if masked is not None else mask_at
        # Everything a step reads and writes, as views of the buffers above, in running
        # order. h_{t-1} and c_{t-1} are None where they must be assembled as the step
        # runs (see `previous`).
        plan = zip(
            schedule.steps, schedule.previous_views(out_at, h0), schedule.previous_views(cell_at, c0),
            *map(schedule.in_running_order, (
                at(gates_x), mask_at, masked_at, acts_at, i_at, f_at, g_at, o_at,
                cell_at, at(tanh_cells), r_at, out_at,
            )),
        )
        w_hh_step = StepWeight(w_hh)
        w_hr_step = None if w_hr is None else StepWeight(w_hr)
        for step, h_prev, c_prev, gx, mask_t, m, a, i, f, g, o, c, tanh_c, r_t, out_t in plan:
            if h_prev is None:
                h_prev, c_prev = previous(out_at, h0, step), previous(cell_at, c0, step)
            if mask_t is None:
                m = h_prev
            else:  # the mask's multiply, m_t = h_{t-1} * M_t (per gate [b, G, P]: once per gate)
                m = torch.mul(h_prev if mask_t.dim() == 2 else h_prev.unsqueeze(1), mask_t, out=m)
            z = mp.recurrent_gates(w_hh_step, w_hh, m, gx)
            sigmoid_tanh_(z, a, 2 * H, 3 * H)  # i, f, g, o
            torch.mul(f, c_prev, out=c).addcmul_(i, g)
            torch.mul(o, tanh(c, out=tanh_c), out=r_t)
            if w_hr_step is not None:
                out_t.copy_(w_hr_step(r_t))
        final = schedule.final_rows(gates_x.device)
        ctx.schedule = schedule
        ctx.save_for_backward(
            *_Saved(acts, cells, tanh_cells, out, r, masked, h0, c0, w_hh, w_hr, mask, final)
        )
        ctx.set_materialize_grads(False)
        return out, out.index_select(0, final), cells.index_select(0, final)

    @staticmethod
    @first_order_backward("manual")
    def backward(ctx, d_out, d_hn, d_cn):
        s = _Saved(*ctx.saved_tensors)
        needs = _Inputs(*ctx.needs_input_grad)
        schedule: Schedule = ctx.schedule
        N, H = s.cells.shape
        blocks = schedule.previous_blocks()

        # dz = (dc * the factors of i, f, g; dr * the factor of o), dc += dr * dc_from_dr
        # (equations above). The factors are written into the buffer of dz, which the loop
        # then multiplies in place: its memory is touched here in bulk, not step by step.
        i, f, g, o = s.acts.split(H, 1)
        d_gates = torch.addcmul(s.acts, s.acts, s.acts, value=-1)  # σ' = a (1 - a)
        torch.addcmul(s.acts.new_ones(()), g, g, value=-1, out=d_gates[:, 2 * H : 3 * H])  # tanh' = 1 - g²
        d_gates[:, :H].mul_(g)
        mul_previous_(d_gates[:, H : 2 * H], s.cells, s.c0, blocks)
        d_gates[:, 2 * H : 3 * H].mul_(i)
        d_gates[:, 3 * H :].mul_(s.tanh_cells)
        dc_from_dr = torch.addcmul(o, o, s.tanh_cells * s.tanh_cells, value=-1)

        d_h = mp.output_grad(d_out, s.out, s.final, d_hn)
        d_c = s.cells.new_zeros(N, H)
        if d_cn is not None:
            d_c.index_add_(0, s.final, d_cn)
        d_h0 = s.h0.new_zeros(s.h0.shape)
        d_c0 = s.c0.new_zeros(s.c0.shape)
        d_masked = mp.masked_state_grad_buffer(needs.mask, s.masked)

        at = schedule.by_step
        d_h_at, d_c_at = at(d_h), at(d_c)
        mask_at = schedule.step_masks(s.mask)
        plan = zip(
            [previous_targets(d_h_at, d_h0, step) for step in schedule.steps],
            [previous_targets(d_c_at, d_c0, step) for step in schedule.steps],
            *map(schedule.in_running_order, (
                d_h_at, d_c_at, at(d_c.view(N, 1, H)), at(dc_from_dr), at(f),
                at(d_gates[:, : 3 * H].view(N, 3, H)), at(d_gates[:, 3 * H :]), at(d_gates),
                mask_at, [None] * schedule.seq_len if d_masked is None else at(d_masked),
            )),
        )
        w_hh_t_step = StepWeight(s.w_hh.t(), pack=False)
        w_hr_t_step = None if s.w_hr is None else StepWeight(s.w_hr.t(), pack=False)
        for (
            h_targets, c_targets, dh, dc, dc3, dc_from_dr_t, f_t, d_ifg, d_o, d_z, mask_t, d_masked_t,
        ) in reversed(list(plan)):
            dr = dh if w_hr_t_step is None else w_hr_t_step(dh)
            dc.addcmul_(dr, dc_from_dr_t)
            d_ifg.mul_(dc3)
            d_o.mul_(dr)
            add_product(c_targets, dc, f_t)
            mp.add_state_grad(h_targets, d_z, w_hh_t_step, s.w_hh, mask_t, d_masked_t)

        d_w_hh = d_w_hr = d_mask = None
        h_prev = None
        if (needs.w_hh and s.masked is None) or needs.mask:
            h_prev = gather_previous(s.out, s.h0, blocks)
        if needs.w_hh:
            d_w_hh = mp.weight_grad(d_gates, h_prev if s.masked is None else s.masked)
        if needs.mask:
            d_mask = mp.mask_grad(schedule, s.mask, d_masked, h_prev)
        if s.w_hr is not None and needs.w_hr:
            d_w_hr = matmul(d_h.t(), s.r)
        return d_gates, d_h0, d_c0, d_w_hh, d_w_hr, d_mask, None


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
    """The LSTM recurrence of one layer and direction (contract in :mod:`rnndrop.kernels`)."""
    refuse_transforms("manual", gates_x)
    out, h_n, c_n = _LSTMRecurrence.apply(
        gates_x.contiguous(), h0.contiguous(), c0.contiguous(), w_hh, w_hr, hidden_mask,
        Schedule(batch_sizes, reverse),
    )
    return out, h_n, c_n
