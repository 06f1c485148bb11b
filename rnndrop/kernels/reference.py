"""The reference recurrence (the "autograd" kernel): a Python loop over time steps,
differentiated by autograd.

Only the recurrent matmul and the gate arithmetic run inside the loop, with the
very functions the cells use (:mod:`rnndrop.kernels.gates`); the input projection of all
steps was done by the caller in one matmul. It is the oracle the hand-written
kernels (:mod:`rnndrop.kernels.lstm`, :mod:`rnndrop.kernels.gru`) are tested
against, and the one kernel that is twice differentiable. See :mod:`rnndrop.kernels`
for the contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from rnndrop.kernels.gates import gru_pointwise, lstm_pointwise, masked_linear
from rnndrop.kernels.schedule import step_offsets


def mask_at(mask: Tensor | None, t: int, batch: int) -> Tensor | None:
    """The hidden mask for step ``t``, cut to the ``batch`` rows still running."""
    if mask is None:
        return None
    m = mask[t] if mask.shape[0] > 1 else mask[0]
    return m[:batch] if m.shape[0] > 1 else m


def _run(step, gates_x, batch_sizes, state0, reverse):
    """Drive ``step(gates_t, state, t, batch) -> state`` over time; state[0] is the output.

    Rows of finished sequences leave the state as the batch shrinks (forward) and
    rows of sequences not started yet join it from ``state0`` (reverse).
    """
    offsets = step_offsets(batch_sizes)
    steps = range(len(batch_sizes) - 1, -1, -1) if reverse else range(len(batch_sizes))
    first = batch_sizes[steps[0]]
    state = tuple(s[:first] for s in state0)
    finished: list[tuple[Tensor, ...]] = []
    outputs: list[Tensor] = [gates_x] * len(batch_sizes)
    for t in steps:
        b = batch_sizes[t]
        running = state[0].shape[0]
        if b < running:
            finished.append(tuple(s[b:] for s in state))
            state = tuple(s[:b] for s in state)
        elif b > running:
            state = tuple(torch.cat([s, s0[running:b]]) for s, s0 in zip(state, state0))
        state = step(gates_x[offsets[t] : offsets[t] + b], state, t, b)
        outputs[t] = state[0]
    final = tuple(torch.cat([s, *reversed(done)]) for s, *done in zip(state, *finished))
    return torch.cat(outputs), final


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
    def step(gates_t, state, t, b):
        h, c = state
        gates = gates_t + masked_linear(h, mask_at(hidden_mask, t, b), w_hh)
        h, c = lstm_pointwise(gates, c)
        return (h if w_hr is None else F.linear(h, w_hr)), c

    out, (h_n, c_n) = _run(step, gates_x, batch_sizes, (h0, c0), reverse)
    return out, h_n, c_n


def gru_recurrence(
    gates_x: Tensor,
    batch_sizes: Sequence[int],
    h0: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    hidden_mask: Tensor | None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor]:
    def step(gates_t, state, t, b):
        (h,) = state
        gates_h = masked_linear(h, mask_at(hidden_mask, t, b), w_hh, b_hh)
        return (gru_pointwise(gates_t, gates_h, h),)

    out, (h_n,) = _run(step, gates_x, batch_sizes, (h0,), reverse)
    return out, h_n
