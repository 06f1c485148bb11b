"""The step equations of the LSTM and GRU cells: the masked gate product and the gate math.

One copy of the arithmetic of a time step, used by the public cells
(:mod:`rnndrop.cells`), by the reference kernel (:mod:`rnndrop.kernels.reference`)
and by the whole-sequence input projection (:func:`rnndrop.kernels.matmul.input_projection`),
so that all of them compute the very same thing. Gate orders are nn.LSTM's
(i, f, g, o) and nn.GRU's (r, z, n).

The in-place nonlinearities the hand-written kernels use (:func:`tanh`, :func:`sigmoid_tanh_`)
are written for what is fast on each device: on CPU, ATen's float32 ``sigmoid`` is several times
faster per element than its ``tanh`` (docs/speed.md, "tanh through sigmoid"), so
``tanh(x) = 2 σ(2x) - 1`` pays for its two extra cheap ops; the identity holds to float rounding
(2e-7 in float32, 4e-16 in float64). On other devices ``tanh`` is called directly.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "GRU_GATES", "LSTM_GATES", "gru_pointwise", "lstm_pointwise", "masked_linear", "sigmoid_tanh_", "tanh",
]

LSTM_GATES = 4  # (i, f, g, o), the order of nn.LSTM
GRU_GATES = 3  # (r, z, n), the order of nn.GRU


def masked_linear(x: Tensor, mask: Tensor | None, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``(x * mask) @ weight.T + bias``.

    Args:
        x: ``[..., in]``.
        mask: ``None``; a tensor broadcastable to ``x`` (one mask for all gates);
            or ``[..., gates, in]`` (one more dimension than ``x``: one mask per gate,
            ``weight`` is then read as ``gates`` blocks of rows).
        weight: ``[gates * out, in]``.
        bias: ``[gates * out]`` or None.

    Returns:
        ``[..., gates * out]``.
    """
    if mask is None:
        return F.linear(x, weight, bias)
    if mask.dim() <= x.dim():
        return F.linear(x * mask, weight, bias)
    # One product per gate, side by side: a batched product over the gates would first copy
    # x * mask gate-major and its result back, the slower way (docs/speed.md, "Per-gate masks").
    gates = mask.shape[-2]
    biases = bias.chunk(gates) if bias is not None else (None,) * gates
    return torch.cat([F.linear(x * mask[..., g, :], w, b)
                      for g, (w, b) in enumerate(zip(weight.chunk(gates), biases))], -1)


def lstm_pointwise(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """LSTM gate nonlinearities: pre-activations ``[..., 4 * H]`` (i, f, g, o) and
    ``c_{t-1}`` ``[..., H]`` -> ``(h_t, c_t)``, both ``[..., H]``."""
    i, f, g, o = gates.chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def gru_pointwise(gates_x: Tensor, gates_h: Tensor, h: Tensor) -> Tensor:
    """GRU update from the input part ``W_ih x + b_ih`` and the recurrent part
    ``W_hh h + b_hh`` (both ``[..., 3 * H]``, order r, z, n) and ``h_{t-1}``
    ``[..., H]`` (unmasked) -> ``h_t`` ``[..., H]``."""
    xr, xz, xn = gates_x.chunk(3, -1)
    hr, hz, hn = gates_h.chunk(3, -1)
    r = torch.sigmoid(xr + hr)
    z = torch.sigmoid(xz + hz)
    n = torch.tanh(xn + r * hn)
    return n + z * (h - n)


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
