"""Sampling of dropout masks: the one place where rnndrop draws noise.

A mask is a tensor that multiplies an activation. Bernoulli masks hold 0 or
``1 / (1 - p)`` (inverted dropout, so the expected value is 1); Gaussian masks
hold ``1 + sqrt(alpha) * eps`` with ``eps ~ N(0, 1)`` and ``alpha = p / (1 - p)``,
the Gaussian dropout of the same variance (Srivastava et al. 2014, Kingma et al. 2015).

How long a mask lives is its *scope*:

``"sequence"``  one mask per sequence, reused at every time step (Gal & Ghahramani 2016)
``"step"``      a fresh mask at every time step (naive dropout, Zaremba et al. 2014)
``"batch"``     one mask shared by the whole batch (what can be folded into a weight)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

MaskScope = Literal["sequence", "step", "batch"]
Noise = Literal["bernoulli", "gaussian"]

MASK_SCOPES: tuple[str, ...] = ("sequence", "step", "batch")
NOISES: tuple[str, ...] = ("bernoulli", "gaussian")


def check_probability(name: str, p: float) -> float:
    """Return ``p`` as a float if it is a dropout probability in [0, 1), else raise."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(p).__name__} {p!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1), got {p!r}")
    return float(p)


def check_choice(name: str, value: str, choices: Sequence[str]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise a ValueError naming them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def mask_shape(
    scope: str, batch_size: int, size: int, seq_len: int | None = None, gates: int | None = None
) -> tuple[int, ...]:
    """Shape of a mask for ``size`` features.

    ``"sequence"``: ``[batch, size]``; ``"step"``: ``[seq_len, batch, size]``;
    ``"batch"``: ``[1, size]``. With ``gates`` (one mask per gate, Gal's untied
    variant) a gate dimension is inserted before ``size``: ``[..., gates, size]``.
    """
    check_choice("scope", scope, MASK_SCOPES)
    if scope == "step":
        if seq_len is None:
            raise ValueError("seq_len is required for masks with scope 'step', got None")
        lead: tuple[int, ...] = (seq_len, batch_size)
    elif scope == "sequence":
        lead = (batch_size,)
    else:
        lead = (1,)
    return (*lead, gates, size) if gates else (*lead, size)


def bernoulli_mask(
    shape: Sequence[int],
    p: float,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """A tensor of ``shape`` holding 0 with probability ``p`` and ``1 / (1 - p)`` otherwise.

    ``p`` is resolved to a multiple of 2**-16: each element compares 16 random bits
    with a threshold. Cutting 64-bit random integers into four 16-bit draws costs
    about half of ``torch.rand(shape) >= p`` (and a fifth of ``bernoulli_``) on CPU,
    which matters for weight-sized masks (DropConnect on ``W_hh``).
    """
    dtype = dtype or torch.get_default_dtype()
    numel = math.prod(shape)
    words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)  # all 64 bits random
    bits = words.view(torch.int16)[:numel].view(tuple(shape))
    keep = bits >= round(p * 65536) - 32768
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


def gaussian_mask(
    shape: Sequence[int],
    alpha: float | Tensor,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``1 + sqrt(alpha) * eps``, ``eps ~ N(0, 1)``: multiplicative noise of mean 1, variance alpha.

    ``alpha`` may be a tensor (a learned variance) broadcastable to ``shape``; the
    result is then differentiable with respect to it.
    """
    if isinstance(alpha, Tensor):
        device = device or alpha.device
        dtype = dtype or alpha.dtype
    dtype = dtype or torch.get_default_dtype()
    eps = torch.randn(tuple(shape), device=device, dtype=dtype, generator=generator)
    if isinstance(alpha, Tensor):
        return 1.0 + alpha.sqrt() * eps
    return eps.mul_(math.sqrt(alpha)).add_(1.0)


def sample_mask(
    shape: Sequence[int],
    p: float,
    noise: str = "bernoulli",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor | None:
    """A mask of ``shape`` for dropout probability ``p``, or ``None`` when ``p == 0``.

    ``noise="gaussian"`` draws Gaussian noise of the same variance as Bernoulli
    dropout with probability ``p``: ``alpha = p / (1 - p)``.
    """
    if p == 0:
        return None
    if noise == "bernoulli":
        return bernoulli_mask(shape, p, device=device, dtype=dtype, generator=generator)
    if noise == "gaussian":
        return gaussian_mask(shape, p / (1.0 - p), device=device, dtype=dtype, generator=generator)
    raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")


@dataclass(frozen=True)
class RecurrentMasks:
    """All the masks one forward call of a recurrent layer uses.

    Sampled by :meth:`VariationalLSTM.sample_masks` (or built by hand) and passed
    as ``forward(..., masks=...)`` to reuse them over several calls (truncated
    BPTT, Monte-Carlo evaluation). ``None`` anywhere means "no dropout there".

    Attributes:
        inputs: one mask per layer on that layer's input (layer 0: ``dropout_input``,
            later layers: ``dropout``), shared by both directions.
        hidden: one mask per layer and direction (index ``layer * num_directions +
            direction``) on the recurrent state ``h_{t-1}``.
        output: mask on the last layer's output (``dropout_output``).
        scope: ``"sequence"``, ``"step"`` or ``"batch"``; shapes follow
            :func:`mask_shape`. With ``"batch"`` only ``hidden`` masks are shared by
            the batch; ``inputs`` and ``output`` are per sequence.
        per_gate: whether masks carry a gate dimension ``[..., gates, size]``
            (``inputs`` and ``hidden`` only).
    """

    inputs: tuple[Tensor | None, ...]
    hidden: tuple[Tensor | None, ...]
    output: Tensor | None
    scope: str = "sequence"
    per_gate: bool = False

    def map(self, fn) -> RecurrentMasks:
        """Apply ``fn`` to every mask that is not None (e.g. ``lambda m: m.to(device)``)."""

        def one(m: Tensor | None) -> Tensor | None:
            return None if m is None else fn(m)

        return RecurrentMasks(
            inputs=tuple(map(one, self.inputs)),
            hidden=tuple(map(one, self.hidden)),
            output=one(self.output),
            scope=self.scope,
            per_gate=self.per_gate,
        )

    def is_empty(self) -> bool:
        """True when no mask is set anywhere."""
        return self.output is None and all(m is None for m in (*self.inputs, *self.hidden))
