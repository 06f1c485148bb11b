"""Activation regularization (AR) and temporal activation regularization (TAR).

Merity, McCann & Socher (2017, "Revisiting activation regularization for language RNNs")
and AWD-LSTM (Merity, Keskar & Socher 2017) add two penalties on the output of the last
recurrent layer to the training loss:

- **AR** ``alpha * mean(m_t ** 2)`` on the *dropped* output ``m_t`` (after the output
  dropout, what the decoder sees): it keeps activations small;
- **TAR** ``beta * mean((h_t - h_{t-1}) ** 2)`` on the *raw* output ``h_t`` (before the
  output dropout): it penalises large changes between consecutive time steps.

The means run over every element (time, batch and units), as in AWD-LSTM's code (its
defaults: ``alpha = 2``, ``beta = 1``). They are training-loss terms: nothing here looks at
train or eval mode, so add them to the training loss only.

Where the two outputs come from:

- :class:`rnndrop.VariationalLSTM` / :class:`rnndrop.VariationalGRU` (and the stacks
  built on them) return the last layer's output before its ``dropout_output`` as a third
  value with ``return_raw_output=True``: ``dropped, h_n, raw = lstm(x, return_raw_output=True)``;
- with a separate output dropout (``raw, h_n = lstm(x)``; ``dropped = LockedDropout(p)(raw)``)
  both are at hand.

Example::

    reg = ActivationRegularization(alpha=2.0, beta=1.0)
    dropped, hidden, raw = lstm(x, hidden, return_raw_output=True)     # [T, B, H] each
    loss = criterion(decoder(dropped), targets) + reg(raw, dropped)

For padded batches pass ``mask`` (``[T, B]``, True where a step is real): AR then averages
over real steps only and TAR over pairs of consecutive real steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from rnndrop.validation import check_nonnegative_float

__all__ = [
    "ActivationRegularization",
    "RecurrentOutputs",
    "activation_regularization",
    "temporal_activation_regularization",
]


class RecurrentOutputs(NamedTuple):
    """The last recurrent layer's output before (``raw``) and after (``dropped``) its dropout."""

    raw: Tensor
    dropped: Tensor


def _check_output(name: str, x: Any, time_dim: int) -> Tensor:
    if not isinstance(x, Tensor):
        hint = " (unpack a PackedSequence with pad_packed_sequence and pass mask)" if (
            type(x).__name__ == "PackedSequence") else ""
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}{hint}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name} must be at least 2-D (time and features), got shape {list(x.shape)}")
    if isinstance(time_dim, bool) or time_dim not in (0, 1):
        raise ValueError(f"time_dim must be 0 ([T, B, H]) or 1 ([B, T, H]), got {time_dim!r}")
    return x


def _check_mask(mask: Any, x: Tensor) -> Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = f"dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"mask must be a bool tensor (True where a step is real), got {got}")
    expected = list(x.shape[: x.dim() - 1])
    if list(mask.shape) != expected:
        raise ValueError(f"mask must have the output's shape without its last dimension, "
                         f"{expected}, got {list(mask.shape)}")
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device}, the output on {x.device}")
    return mask


def _masked_mean_square(values: Tensor, mask: Tensor | None) -> Tensor:
    """Mean of ``values ** 2`` over every element, or over the rows ``mask`` keeps; 0 when
    nothing is left."""
    if mask is None:
        return values.pow(2).mean() if values.numel() else values.new_zeros(())
    kept = (mask.sum() * values.shape[-1]).clamp(min=1).to(values.dtype)
    return (values.pow(2) * mask.unsqueeze(-1).to(values.dtype)).sum() / kept


def activation_regularization(
    dropped: Tensor, alpha: float = 2.0, *, mask: Tensor | None = None, time_dim: int = 0
) -> Tensor:
    """AR: ``alpha * mean(dropped ** 2)``, a scalar to add to the loss.

    Args:
        dropped: the last layer's output after its dropout, ``[T, B, H]`` (``[B, T, H]``
            with ``time_dim=1``), or any ``[..., H]`` tensor with a time dimension.
        alpha: the weight (AWD-LSTM: 2); 0 gives a zero tensor without computing anything.
        mask: optional bool ``[T, B]`` (the output's shape without ``H``): True where a step
            is real; padding is left out of the mean.
        time_dim: where the time dimension is (0 or 1).
    """
    alpha = check_nonnegative_float("alpha", alpha)
    dropped = _check_output("dropped", dropped, time_dim)
    mask = _check_mask(mask, dropped)
    if alpha == 0.0:
        return dropped.new_zeros(())
    return alpha * _masked_mean_square(dropped, mask)


def temporal_activation_regularization(
    raw: Tensor, beta: float = 1.0, *, mask: Tensor | None = None, time_dim: int = 0
) -> Tensor:
    """TAR: ``beta * mean((raw[t] - raw[t - 1]) ** 2)`` over consecutive steps, a scalar.

    Args:
        raw: the last layer's output *before* its dropout, ``[T, B, H]`` (``[B, T, H]`` with
            ``time_dim=1``). A single step (``T = 1``) has no pair: the penalty is 0.
        beta: the weight (AWD-LSTM: 1); 0 gives a zero tensor without computing anything.
        mask: optional bool ``[T, B]``: only pairs of two real steps count.
        time_dim: where the time dimension is (0 or 1).
    """
    beta = check_nonnegative_float("beta", beta)
    raw = _check_output("raw", raw, time_dim)
    mask = _check_mask(mask, raw)
    if beta == 0.0 or raw.shape[time_dim] < 2:
        return raw.new_zeros(())
    steps = raw.shape[time_dim]
    diff = raw.narrow(time_dim, 1, steps - 1) - raw.narrow(time_dim, 0, steps - 1)
    pairs = None
    if mask is not None:
        pairs = mask.narrow(time_dim, 1, steps - 1) & mask.narrow(time_dim, 0, steps - 1)
    return beta * _masked_mean_square(diff, pairs)


class ActivationRegularization(nn.Module):
    """AR + TAR as a module: ``reg(raw, dropped) -> alpha * AR + beta * TAR`` (a scalar).

    Args:
        alpha: weight of AR on the dropped output (AWD-LSTM: 2; 0 switches it off).
        beta: weight of TAR on the raw output (AWD-LSTM: 1; 0 switches it off).
        time_dim: 0 for ``[T, B, H]`` (default), 1 for ``[B, T, H]``.

    ``forward(raw, dropped, mask=None)``: ``raw`` and ``dropped`` have the same shape
    (``dropped`` may be ``raw`` itself when there is no output dropout). The module has no
    parameters and behaves the same in train and eval mode: add its value to the training
    loss only.
    """

    def __init__(self, alpha: float = 2.0, beta: float = 1.0, *, time_dim: int = 0) -> None:
        super().__init__()
        self.alpha = check_nonnegative_float("alpha", alpha)
        self.beta = check_nonnegative_float("beta", beta)
        if isinstance(time_dim, bool) or time_dim not in (0, 1):
            raise ValueError(f"time_dim must be 0 ([T, B, H]) or 1 ([B, T, H]), got {time_dim!r}")
        self.time_dim = time_dim

    @property
    def enabled(self) -> bool:
        """Whether either penalty has a non-zero weight."""
        return self.alpha > 0 or self.beta > 0

    def forward(self, raw: Tensor, dropped: Tensor, mask: Tensor | None = None) -> Tensor:
        raw = _check_output("raw", raw, self.time_dim)
        dropped = _check_output("dropped", dropped, self.time_dim)
        if raw.shape != dropped.shape:
            raise ValueError(f"raw and dropped must have the same shape, got {list(raw.shape)} and "
                             f"{list(dropped.shape)}")
        ar = activation_regularization(dropped, self.alpha, mask=mask, time_dim=self.time_dim)
        tar = temporal_activation_regularization(raw, self.beta, mask=mask, time_dim=self.time_dim)
        return ar + tar

    def extra_repr(self) -> str:
        s = f"alpha={self.alpha}, beta={self.beta}"
        if self.time_dim:
            s += f", time_dim={self.time_dim}"
        return s

