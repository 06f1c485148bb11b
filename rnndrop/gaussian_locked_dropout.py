"""Locked dropout with Gaussian noise of learned variance (Kingma, Salimans & Welling 2015),
the stand-alone site of :mod:`rnndrop.gaussian`: one ``N(1, alpha)`` noise vector per
sequence, reused at every step, for a tensor between any two layers."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnndrop.kl import (
    KL_APPROXIMATIONS,
    KLRegularized,
    check_max_alpha,
    checked_fan_out,
    clip_log_alpha,
    initial_log_alpha,
)
from rnndrop.layout import mask_packed_sequence
from rnndrop.noise import learned_gaussian_mask
from rnndrop.stochastic import Stochastic
from rnndrop.validation import check_bool, check_choice, check_positive_int, check_probability

__all__ = ["GaussianLockedDropout"]


class GaussianLockedDropout(KLRegularized, Stochastic, nn.Module):
    """Locked dropout with Gaussian noise ``N(1, alpha)`` and learned ``alpha``.

    One noise vector per sequence, reused at every time step (like
    :class:`~rnndrop.LockedDropout`), with ``alpha`` per feature (``granularity="unit"``)
    or one for all (``"layer"``), stored as the parameter ``log_alpha``.

    Args:
        size: number of features (last dimension of the input).
        p: initial variance as a dropout probability: ``alpha = p / (1 - p)``, ``p`` in (0, 1).
        granularity: ``"unit"`` or ``"layer"``.
        max_alpha, kl_approximation: as for :class:`~rnndrop.GaussianLSTM`.
        fan_out: weights each feature scales in the layer it feeds; ``kl()`` counts each
            ``alpha`` that many times per feature. Not given: once per feature, with a warning
            (a weak KL term, under which alpha drifts towards 0).
        batch_first: input is ``[B, T, size]`` instead of ``[T, B, size]``.

    Shapes:
        input: ``[T, B, size]`` (``[B, T, size]``), or a ``PackedSequence`` of ``[N, size]``.
        returns: like ``input``; unchanged in eval mode.

    """

    def __init__(
        self,
        size: int,
        p: float,
        *,
        granularity: str = "unit",
        max_alpha: float | None = 1.0,
        kl_approximation: str = "kingma",
        fan_out: int | None = None,
        batch_first: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("size", size)
        p = check_probability("p", p)
        if p == 0:
            raise ValueError("p must be in (0, 1) to set a positive initial alpha, got 0.0")
        check_choice("granularity", granularity, ("layer", "unit"))
        self.size = size
        self.p = p
        self.granularity = granularity
        self.max_alpha = check_max_alpha(max_alpha, kl_approximation)
        self.kl_approximation = kl_approximation
        self.fan_out = checked_fan_out(type(self).__name__, "fan_out", fan_out, stacklevel=2)
        self.batch_first = check_bool("batch_first", batch_first)
        shape = (1,) if granularity == "layer" else (size,)
        self.log_alpha = nn.Parameter(torch.full(shape, initial_log_alpha(p, self.max_alpha)))

    def is_stochastic(self) -> bool:
        return True

    def _clipped_log_alpha(self) -> Tensor:
        return clip_log_alpha(self.log_alpha, self.max_alpha)

    def alpha(self) -> Tensor:
        """The present ``alpha`` (after clipping), detached: ``[1]`` or ``[size]``."""
        return self._clipped_log_alpha().detach().exp()

    def kl(self) -> Tensor:
        count = self.size * self.fan_out / self.log_alpha.numel()
        return KL_APPROXIMATIONS[self.kl_approximation](self._clipped_log_alpha()).sum() * count

    def forward(self, x: Tensor | PackedSequence) -> Tensor | PackedSequence:
        data = x.data if isinstance(x, PackedSequence) else x
        if not isinstance(data, Tensor) or data.dim() < 2 or data.shape[-1] != self.size:
            got = list(data.shape) if isinstance(data, Tensor) else type(data).__name__
            raise ValueError(f"x must be [T, B, {self.size}] or a PackedSequence, got {got}")
        if not self.training:
            return x
        log_alpha = self._clipped_log_alpha()
        if isinstance(x, PackedSequence):
            shape = (int(x.batch_sizes[0]), self.size)
            noise = learned_gaussian_mask(shape, log_alpha, device=data.device, dtype=data.dtype)
            return mask_packed_sequence(x, noise)
        if data.dim() != 3:
            raise ValueError(f"x must be 3-D [T, B, {self.size}], got shape {list(data.shape)}")
        shape = (data.shape[0], 1, self.size) if self.batch_first else (1, data.shape[1], self.size)
        return x * learned_gaussian_mask(shape, log_alpha, device=data.device, dtype=data.dtype)

    def extra_repr(self) -> str:
        return f"{self.size}, p={self.p}, granularity={self.granularity!r}, fan_out={self.fan_out}"
