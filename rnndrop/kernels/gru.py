r"""The GRU recurrence with a hand-written backward pass (the "manual" kernel).

Forward, for every step ``t`` on the rows of the sequences still running
(``x̂_t`` = ``gates_x`` rows = ``W_ih x_t + b_ih``, hoisted by the layer; ``b_hh``
cannot be hoisted since ``b_hn`` sits inside ``r * (W_hn m + b_hn)``)::

    m_t = h_{t-1} * M_t                        (per gate: m^k_t = h_{t-1} * M^k_t)
    a_t = W_hh m_t + b_hh  =  (a_r, a_z, a_n)
    r = σ(x̂_r + a_r),   z = σ(x̂_z + a_z)
    n = tanh(x̂_n + r * a_n)
    h_t = (1 - z) * n + z * h_{t-1}  =  n + z * (h_{t-1} - n)

Backward, running the steps in reverse; ``dh_t`` starts as the gradient of the
output and of ``h_n`` and collects what later steps send back::

    dn_pre = dh_t * (1 - z) * (1 - n²)         the gradient of n's pre-activation
    da_r = dn_pre * a_n * r (1 - r)            da_z = dh_t * (h_{t-1} - n) * z (1 - z)
    da_n = dn_pre * r
    dx̂_t = (da_r, da_z, dn_pre)
    dm_t = W_hh^T da_t
    dh_{t-1} += dh_t * z + dm_t * M_t          (per gate: Σ_k dm^k_t * M^k_t)
    dM_t += dm_t * h_{t-1}
    dW_hh = Σ_t da_t m_tᵀ,   db_hh = Σ_t da_t

``da_t`` is ``dh_t`` times factors that depend on the forward pass only; they are
computed for all steps at once before the loop, which then costs four ops and one
small matrix product per step (see :mod:`rnndrop.kernels.matmul`).

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
from rnndrop.kernels.gates import tanh
from rnndrop.kernels.matmul import StepWeight
from rnndrop.kernels.schedule import Schedule, add_product, gather_previous, previous, previous_targets


class _Inputs(NamedTuple):
    """The inputs of :class:`_GRURecurrence` in ``apply`` order (for ``needs_input_grad``)."""

    gates_x: bool
    h0: bool
    w_hh: bool
    b_hh: bool
    mask: bool
    schedule: bool


class _Saved(NamedTuple):
    """What the forward pass keeps for the backward pass (``N`` rows)."""

    acts: Tensor  # [N, 3H]: r, z, n (after their nonlinearities)
    a_n: Tensor  # [N, H]: the n part of W_hh m + b_hh
    out: Tensor  # [N, H]: h_t
    masked: Tensor | None  # [N, H] or [N, 3, H]: m_t, when there is a mask
    h0: Tensor
    w_hh: Tensor
    mask: Tensor | None
    final: Tensor  # [B]: the row of h_n of every sequence


class _GRURecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, gates_x, h0, w_hh, b_hh, mask, schedule: Schedule):
        N, H = gates_x.shape[0], h0.shape[1]
        acts = gates_x.new_empty(N, 3 * H)
        out = gates_x.new_empty(N, H)
        masked = None if mask is None else gates_x.new_empty(N, *mask.shape[2:])

        at = schedule.by_step
        out_at = at(out)
        mask_at = schedule.step_masks(mask)
        a_n_at: list[Tensor] = [gates_x] * schedule.seq_len  # W_hh m + b_hh, n part, by t
        plan = zip(
            schedule.steps, schedule.previous_views(out_at, h0),
            *map(schedule.in_running_order, (
                at(gates_x[:, : 2 * H]), at(gates_x[:, 2 * H :]), mask_at,
                mask_at if masked is None else at(masked),
                at(acts[:, : 2 * H]), at(acts[:, :H]), at(acts[:, H : 2 * H]), at(acts[:, 2 * H :]), out_at,
            )),
        )
        w_hh_step = StepWeight(w_hh)
        for step, h_prev, x_rz, x_n, mask_t, m, rz, r, z, n, h in plan:
            if h_prev is None:
                h_prev = previous(out_at, h0, step)
            if mask_t is None:
                m = h_prev
            else:  # the mask's multiply, m_t = h_{t-1} * M_t (per gate [b, G, P]: once per gate)
                m = torch.mul(h_prev if mask_t.dim() == 2 else h_prev.unsqueeze(1), mask_t, out=m)
            a = mp.recurrent_gates(w_hh_step, w_hh, m, bias=b_hh)
            a_n_at[step.t] = a_n = a[:, 2 * H :]
            torch.add(x_rz, a[:, : 2 * H], out=rz).sigmoid_()
            tanh(torch.addcmul(x_n, r, a_n, out=n), out=n)
            torch.sub(h_prev, n, out=h)
            torch.addcmul(n, z, h, out=h)
        final = schedule.final_rows(gates_x.device)
        ctx.schedule = schedule
        ctx.save_for_backward(*_Saved(acts, torch.cat(a_n_at), out, masked, h0, w_hh, mask, final))
        ctx.set_materialize_grads(False)
        return out, out.index_select(0, final)

    @staticmethod
    @first_order_backward("manual")
    def backward(ctx, d_out, d_hn):
        s = _Saved(*ctx.saved_tensors)
        needs = _Inputs(*ctx.needs_input_grad)
        schedule: Schedule = ctx.schedule
        N, H = s.out.shape
        h_prev = gather_previous(s.out, s.h0, schedule.previous_blocks())

        # da = dh * the factors of r, z, n (equations above); dn_pre = dh * dn_pre_from_dh. The factors are
        # written into the buffer of da, which the loop then multiplies in place: its memory
        # is touched here in bulk, not step by step.
        r, z, n = s.acts.split(H, 1)
        dn_pre_from_dh = torch.addcmul(s.acts.new_ones(()), n, n, value=-1)  # tanh' = 1 - n²
        dn_pre_from_dh.addcmul_(z, dn_pre_from_dh, value=-1)  # times (1 - z)
        d_a = torch.addcmul(s.acts, s.acts, s.acts, value=-1)  # σ' = a (1 - a)
        d_a[:, :H].mul_(dn_pre_from_dh)
        d_a[:, :H].mul_(s.a_n)
        d_a[:, H : 2 * H].mul_(h_prev - n)
        torch.mul(dn_pre_from_dh, r, out=d_a[:, 2 * H :])

        d_h = mp.output_grad(d_out, s.out, s.final, d_hn)
        d_h0 = s.h0.new_zeros(s.h0.shape)
        d_masked = mp.masked_state_grad_buffer(needs.mask, s.masked)

        at = schedule.by_step
        d_h_at = at(d_h)
        plan = zip(
            [previous_targets(d_h_at, d_h0, step) for step in schedule.steps],
            *map(schedule.in_running_order, (
                d_h_at, at(d_h.view(N, 1, H)), at(z), at(d_a.view(N, 3, H)),
                at(d_a), schedule.step_masks(s.mask),
                [None] * schedule.seq_len if d_masked is None else at(d_masked),
            )),
        )
        w_hh_t_step = StepWeight(s.w_hh.t(), pack=False)
        for targets, dh, dh3, z_t, d_a3, d_a_t, mask_t, d_masked_t in reversed(list(plan)):
            d_a3.mul_(dh3)
            add_product(targets, dh, z_t)
            mp.add_state_grad(targets, d_a_t, w_hh_t_step, s.w_hh, mask_t, d_masked_t)

        d_gates_x = d_w_hh = d_b_hh = d_mask = None
        if needs.w_hh:
            d_w_hh = mp.weight_grad(d_a, h_prev if s.masked is None else s.masked)
        if needs.b_hh:
            d_b_hh = d_a.sum(0)
        if needs.mask:
            d_mask = mp.mask_grad(schedule, s.mask, d_masked, h_prev)
        if needs.gates_x:  # the r and z parts are those of d_a: reuse the buffer
            d_gates_x = d_a
            torch.mul(d_h, dn_pre_from_dh, out=d_gates_x[:, 2 * H :])
        return d_gates_x, d_h0, d_w_hh, d_b_hh, d_mask, None


def gru_recurrence(
    gates_x: Tensor,
    batch_sizes: Sequence[int],
    h0: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    hidden_mask: Tensor | None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor]:
    """The GRU recurrence of one layer and direction (contract in :mod:`rnndrop.kernels`)."""
    refuse_transforms("manual", gates_x)
    out, h_n = _GRURecurrence.apply(
        gates_x.contiguous(), h0.contiguous(), w_hh, b_hh, hidden_mask, Schedule(batch_sizes, reverse)
    )
    return out, h_n
