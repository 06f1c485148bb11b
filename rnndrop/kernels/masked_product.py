"""The masked recurrent product that every cell kernel shares, and its gradients.

Forward: ``W_hh m_t`` of the masked state ``m_t = h_{t-1} * M_t``, whose multiply each
kernel writes in its step loop (``M_t`` ``[b or 1, P]``, one mask for all gates; or
``[b or 1, G, P]``, one per gate, when gate ``k`` sees ``W_hh^k (h_{t-1} * M^k_t)``).
Backward: ``dm_t = W_hh^T dz_t``, ``dh_{t-1} += dm_t * M_t``, ``dM_t += dm_t * h_{t-1}``,
``dW_hh = Σ_t dz_t m_tᵀ``. ``z`` is the pre-activation of
the gates, ``[b, G * H]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rnndrop.kernels.matmul import StepWeight, matmul
from rnndrop.kernels.schedule import Schedule, add_product, add_rows


def recurrent_gates(
    w_hh_step: StepWeight, w_hh: Tensor, m: Tensor, add: Tensor | None = None, bias: Tensor | None = None
) -> Tensor:
    """``W_hh m + add + bias`` -> a new ``[b, G * H]``.

    ``m``: ``[b, P]`` (one product through ``w_hh_step``, the prepared ``w_hh``) or
    ``[b, G, P]`` (per gate: a batched product); ``add``: ``[b, G * H]``; ``bias``: ``[G * H]``.
    """
    if m.dim() == 2:
        return w_hh_step(m, add, bias)
    gates = m.shape[1]
    w = w_hh.view(gates, -1, w_hh.shape[1]).transpose(1, 2)  # [G, P, H]
    z = torch.bmm(m.transpose(0, 1), w).transpose(0, 1).reshape(m.shape[0], -1)  # [b, G * H]
    if add is not None:
        z += add
    if bias is not None:
        z += bias
    return z


def add_state_grad(
    targets: list[tuple[Tensor, int, int]],
    d_z: Tensor,
    w_hh_t_step: StepWeight,
    w_hh: Tensor,
    mask: Tensor | None,
    d_masked: Tensor | None,
) -> None:
    """Add ``dh_{t-1}`` from one step's gate gradients ``d_z`` ``[b, G * H]`` to ``targets``
    (see :func:`rnndrop.kernels.schedule.previous_targets`).

    ``w_hh_t_step``: ``W_hh^T`` prepared; ``d_masked`` (``[b, P]`` or ``[b, G, P]``), when
    not None, receives ``dm_t`` (for the mask's gradient).
    """
    if mask is None or mask.dim() == 2:
        d_m = w_hh_t_step(d_z)
        if mask is None:
            add_rows(targets, d_m)
            return
        if d_masked is not None:
            d_masked.copy_(d_m)
        add_product(targets, d_m, mask)
        return
    gates = mask.shape[1]
    w = w_hh.view(gates, -1, w_hh.shape[1])  # [G, H, P]
    b = d_z.shape[0]
    per_gate = torch.bmm(d_z.view(b, gates, -1).transpose(0, 1), w)  # [G, b, P]
    if d_masked is not None:
        d_masked.copy_(per_gate.transpose(0, 1))
    add_rows(targets, (per_gate * mask.transpose(0, 1)).sum(0))


def masked_state_grad_buffer(need_mask: bool, masked: Tensor | None) -> Tensor | None:
    """Where the backward loop writes ``dm_t`` of every row: a buffer shaped like the masked
    states when the mask's gradient is wanted, else None."""
    return masked.new_empty(masked.shape) if need_mask else None


def weight_grad(d_z: Tensor, m: Tensor) -> Tensor:
    """``dW_hh = Σ_t dz_t m_tᵀ`` ``[G * H, P]`` from all gate gradients ``[N, G * H]`` and
    masked states ``[N, P]`` / ``[N, G, P]``."""
    if m.dim() == 2:
        return matmul(d_z.t(), m)
    gates = m.shape[1]
    n = d_z.shape[0]
    per_gate = torch.bmm(d_z.view(n, gates, -1).permute(1, 2, 0), m.transpose(0, 1))
    return per_gate.reshape(-1, m.shape[2])


def mask_grad(schedule: Schedule, mask: Tensor, d_masked: Tensor, h_prev: Tensor) -> Tensor:
    """``dM``, shaped like ``mask`` ``[T', B', (G,) P]``, from ``dm_t`` of every row and
    the unmasked previous states ``h_prev`` ``[N, P]``."""
    product = d_masked * (h_prev.unsqueeze(1) if d_masked.dim() == 3 else h_prev)
    flat = product.new_zeros(mask.shape[0] * mask.shape[1], *mask.shape[2:])
    flat.index_add_(0, schedule.mask_index(mask), product)
    return flat.view(mask.shape)


def output_grad(d_out: Tensor | None, out: Tensor, final: Tensor, d_hn: Tensor | None) -> Tensor:
    """``dh`` ``[N, P]`` of every row before the recurrence adds to it: the gradient of the
    output plus that of ``h_n`` on the final rows (a fresh contiguous buffer)."""
    d_h = out.new_zeros(out.shape) if d_out is None else d_out.clone(memory_format=torch.contiguous_format)
    if d_hn is not None:
        d_h.index_add_(0, final, d_hn)
    return d_h

