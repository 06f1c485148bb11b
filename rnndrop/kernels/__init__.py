"""Recurrence kernels: the time loop of one layer in one direction.

A kernel never samples and never changes the layer's contract; it computes the
same function as the reference loop in :mod:`rnndrop.kernels.autograd`:

``lstm(gates_x, batch_sizes, h0, c0, w_hh, w_hr, hidden_mask, reverse) -> (out, h_n, c_n)``
``gru(gates_x, batch_sizes, h0, w_hh, b_hh, hidden_mask, reverse) -> (out, h_n)``

Shapes (``N = sum(batch_sizes)`` rows in packed, time-major order, ``B = batch_sizes[0]``,
``batch_sizes`` non-increasing):

- ``gates_x``: ``[N, G * H]``, the input projection of every step (for the LSTM it
  already holds both biases; for the GRU only ``b_ih``);
- ``h0``: ``[B, P]`` (``P = proj_size or H``), ``c0``: ``[B, H]``;
- ``w_hh``: ``[G * H, P]``, ``w_hr``: ``[P, H]`` or None, ``b_hh``: ``[G * H]`` or None;
- ``hidden_mask``: None or ``[T' , B', P]`` / per gate ``[T', B', G, P]`` with
  ``T'`` in ``{1, T}`` (1: the same mask at every step) and ``B'`` in ``{1, B}``;
- ``out``: ``[N, P]`` in the rows of ``gates_x``; ``h_n``: ``[B, P]``; ``c_n``: ``[B, H]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from rnndrop.kernels import autograd, manual


class Kernel(NamedTuple):
    """A pair of recurrence functions with the signatures above."""

    lstm: Callable
    gru: Callable


KERNELS: dict[str, Kernel] = {
    "autograd": Kernel(autograd.lstm_recurrence, autograd.gru_recurrence),
    "manual": Kernel(manual.lstm_recurrence, manual.gru_recurrence),
}

#: The loop kernel that ``kernel="auto"`` uses when the fused kernel cannot run
#: ("manual": a hand-written backward pass, see :mod:`rnndrop.kernels.manual`; "autograd",
#: the reference loop, is about 2x slower on CPU).
DEFAULT_LOOP_KERNEL = "manual"


def get_kernel(name: str) -> Kernel:
    """The kernel registered under ``name``."""
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(
            f"kernel must be 'auto' or one of {', '.join(map(repr, KERNELS))}, got {name!r}"
        ) from None
