"""Gate nonlinearities for the loop kernels, written for what is fast on each device.

On CPU, ATen's float32 ``sigmoid`` is several times faster per element than its
``tanh`` (docs/speed.md, "tanh through sigmoid"), so
``tanh(x) = 2 σ(2x) - 1`` pays for its two extra cheap ops; the identity holds to
float rounding (2e-7 in float32, 4e-16 in float64). On other devices ``tanh`` is
called directly.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor


@functools.cache
def _minus_one(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((), -1.0, dtype=dtype, device=device)


def _twice_minus_one_(x: Tensor) -> Tensor:
    """``x = 2 x - 1`` in one op."""
    return torch.add(_minus_one(x.dtype, x.device), x, alpha=2, out=x)


def tanh(x: Tensor, out: Tensor) -> Tensor:
    """``out = tanh(x)`` (``out`` may be ``x``)."""
    if x.device.type != "cpu":
        return torch.tanh(x, out=out)
    return _twice_minus_one_(torch.mul(x, 2, out=out).sigmoid_())


def sigmoid_tanh_(z: Tensor, out: Tensor, lo: int, hi: int) -> Tensor:
    """``out = σ(z)`` except columns ``lo:hi``, where ``out = tanh(z)``; ``z`` ``[b, n]``
    is overwritten (CPU) and ``out`` is a ``[b, n]`` buffer."""
    if z.device.type != "cpu":
        torch.sigmoid(z, out=out)
        return torch.tanh(z[:, lo:hi], out=out[:, lo:hi])
    z[:, lo:hi].mul_(2)
    torch.sigmoid(z, out=out)
    _twice_minus_one_(out[:, lo:hi])
    return out
