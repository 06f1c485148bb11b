"""Drawing noise: the one place where rnndrop draws random masks.

A mask is a tensor that multiplies an activation. Bernoulli masks hold 0 or
``1 / (1 - p)`` (inverted dropout, so the expected value is 1); Gaussian masks
hold ``1 + sqrt(alpha) * eps`` with ``eps ~ N(0, 1)`` and ``alpha = p / (1 - p)``,
the Gaussian dropout of the same variance (Srivastava et al. 2014, Kingma et al. 2015).

:func:`bernoulli_mask`, :func:`gaussian_mask` and :func:`sample_mask` check their
arguments; :func:`draw_mask`, the recurrent layers' one sampling function, draws the
mask of a :class:`MaskSite` with arguments the layer's constructor checked. Which
sites a stack of layers has, and how long its masks live: :mod:`rnndrop.masks`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rnndrop.distributed import ensure_noise_per_rank
from rnndrop.tracing import traced_cache
from rnndrop.validation import check_choice, check_nonnegative_float, check_probability

__all__ = ["NOISES", "MaskSite", "bernoulli_mask", "draw_mask", "draw_masks", "gaussian_mask", "sample_mask"]

NOISES: tuple[str, ...] = ("bernoulli", "gaussian")


def _draw(sampler: Callable[..., Tensor], shape: tuple, generator: torch.Generator | None,
          **options: Any) -> Tensor:
    """``sampler(shape, **options)`` (``torch.rand``, ``torch.randn``) from ``generator``, or from
    the global one where None: then without the keyword, whose overload torch.compile can trace
    with a symbolic shape (a batch or a length that changes from call to call)."""
    if generator is None:
        return sampler(shape, **options)
    return sampler(shape, generator=generator, **options)


def bernoulli_mask(
    shape: Sequence[int],
    p: float,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """A tensor of ``shape`` holding 0 with probability ``p`` and ``1 / (1 - p)`` otherwise.

    An entry is kept where a float32 uniform from ``generator`` (default: torch's default
    generator of ``device``) is at least ``p``: the mask depends on the seed alone, the same
    entries are kept in every dtype, and ``p`` is resolved to ``2**-24``.
    """
    return _bernoulli(shape, check_probability("p", p), device, dtype, generator)


def _bernoulli(
    shape: Sequence[int],
    p: float,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
    generator: torch.Generator | None,
) -> Tensor:
    """:func:`bernoulli_mask` for a ``p`` already checked.

    Uniforms compared with ``p`` rather than ``torch.bernoulli``: the same distribution from the
    same generator, a factory that ``torch.export`` and ``vmap(randomness="different")`` handle,
    and on the CPU torch fills uniforms several times faster than it draws Bernoulli values
    (docs/speed.md, "Bernoulli masks").
    """
    dtype = _mask_dtype(dtype)
    scale = _kept_value(p, dtype)
    if generator is None:
        ensure_noise_per_rank()
    uniform = _draw(torch.rand, tuple(shape), generator, dtype=torch.float32, device=device)
    return _kept(uniform, p, scale, dtype)


def _kept(uniform: Tensor, p: float, scale: float, dtype: torch.dtype) -> Tensor:
    """``scale`` where ``uniform >= p``, else 0, in ``dtype``: two ops (that vmap and export know)
    in torch's default dtype, where a bool tensor times a float lands; three in another."""
    if dtype == torch.get_default_dtype():
        return (uniform >= p) * scale
    return (uniform >= p).to(dtype).mul_(scale)


def _kept_value(p: float, dtype: torch.dtype) -> float:
    """``1 / (1 - p)``, checked to be finite in ``dtype``."""
    scale = 1.0 / (1.0 - p)
    if scale > torch.finfo(dtype).max:
        largest = torch.finfo(dtype).max
        raise ValueError(
            f"p={p} scales the kept values by 1 / (1 - p) = {scale:.4g}, beyond the largest {dtype} "
            f"({largest:.6g}): every kept value would be inf; "
            f"use p <= {1.0 - 1.0 / largest:.7f} or a wider dtype"
        )
    return scale


def _mask_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a mask (default: torch's default dtype), which must be floating-point."""
    dtype = dtype or torch.get_default_dtype()
    if not dtype.is_floating_point:
        raise TypeError(
            f"dropout masks need a floating-point dtype (that of the values they multiply), got {dtype}"
        )
    return dtype


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
    result is then differentiable with respect to it. A float ``alpha`` must be finite and
    ``>= 0``; a tensor's values are not checked (that would wait for the device at every draw).
    """
    if isinstance(alpha, Tensor):
        device = device or alpha.device
        dtype = dtype or alpha.dtype
    else:
        alpha = check_nonnegative_float("alpha", alpha)
    dtype = _mask_dtype(dtype)
    if generator is None:
        ensure_noise_per_rank()
    eps = _draw(torch.randn, tuple(shape), generator, device=device, dtype=dtype)
    if isinstance(alpha, Tensor):
        return 1.0 + alpha.sqrt() * eps
    return eps.mul_(math.sqrt(alpha)).add_(1.0)


#: Learned ``log_alpha`` above this draws the noise of this value: ``alpha = e^20`` (a noise sd of
#: 22,000) already drowns any signal, and ``e^(log_alpha / 2)`` must stay finite in float16 too.
MAX_NOISE_LOG_ALPHA = 20.0


def learned_gaussian_mask(
    shape: Sequence[int],
    log_alpha: Tensor,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``1 + e^(log_alpha / 2) * eps``: :func:`gaussian_mask` for a learned ``log_alpha``.

    The sd is computed from ``log_alpha`` in its own dtype, before any cast to ``dtype``, and
    without a square root: a tiny ``alpha`` (``log_alpha`` very negative, or below float16's
    range) gives the gradient 0, not NaN; ``log_alpha`` above :data:`MAX_NOISE_LOG_ALPHA` is
    capped there (no gradient beyond), so the mask stays finite.
    """
    device = device or log_alpha.device
    dtype = dtype or log_alpha.dtype
    return scaled_gaussian_noise(log_alpha, standard_normal_noise(shape, device=device, dtype=dtype,
                                                                  generator=generator))


def standard_normal_noise(
    shape: Sequence[int], *, device: torch.device | str, dtype: torch.dtype,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The draw ``eps ~ N(0, 1)`` of :func:`learned_gaussian_mask` (the same random numbers)."""
    if generator is None:
        ensure_noise_per_rank()
    return _draw(torch.randn, tuple(shape), generator, device=device, dtype=dtype)


def scaled_gaussian_noise(log_alpha: Tensor, eps: Tensor) -> Tensor:
    """``1 + e^(log_alpha / 2) * eps`` in ``eps``'s dtype and device (see :func:`learned_gaussian_mask`);
    in float16 clamped to its range (the sd e^10 of the cap times an ``eps`` over 3 overflows it:
    an infinite mask times a dropped 0 is NaN)."""
    std = (0.5 * log_alpha.clamp(max=MAX_NOISE_LOG_ALPHA)).exp().to(device=eps.device, dtype=eps.dtype)
    mask = 1.0 + std * eps
    if eps.dtype == torch.float16:
        limit = torch.finfo(torch.float16).max
        mask = mask.clamp(-limit, limit)
    return mask


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
    check_choice("noise", noise, NOISES)
    p = check_probability("p", p)
    if p == 0:
        return None
    if noise == "bernoulli":
        return _bernoulli(shape, p, device, dtype, generator)
    return gaussian_mask(shape, p / (1.0 - p), device=device, dtype=dtype, generator=generator)


@dataclass(frozen=True)
class MaskSite:
    """One place of a recurrent stack where a mask multiplies an activation.

    Attributes:
        name: ``input_l{k}`` (the input of layer ``k``), ``hidden_l{k}`` / ``hidden_l{k}_reverse``
            (``h_{t-1}`` of layer ``k``, one direction) or ``output`` (the last layer's output).
        shape: the mask's shape (see :func:`rnndrop.masks.stack_mask_shapes`).
        p: the dropout probability there (0: no mask).
    """

    name: str
    shape: tuple[int, ...]
    p: float


def draw_mask(
    site: MaskSite,
    noise: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    generator: torch.Generator | None,
) -> Tensor | None:
    """The mask of ``site``, None where ``site.p == 0``: the recurrent layers' one sampling function.

    Draws what :func:`sample_mask` draws, without checking again what the layer's
    constructor checked (``p`` and ``noise``).
    """
    if site.p == 0:
        return None
    if noise == "bernoulli":
        return _bernoulli(site.shape, site.p, device, dtype, generator)
    return gaussian_mask(site.shape, site.p / (1.0 - site.p), device=device, dtype=dtype, generator=generator)


def draw_masks(
    sites: Sequence[MaskSite],
    noise: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    generator: torch.Generator | None,
) -> list[Tensor | None]:
    """:func:`draw_mask` of every site, with the Bernoulli float32 masks of a stack drawn together:
    one tensor of uniforms for all of them, and one comparison and one scaling per run of
    consecutive sites with the same ``p`` (three launches instead of three per site on a GPU).
    The masks are views of one tensor, with the distribution of separate draws."""
    if noise != "bernoulli" or _mask_dtype(dtype) != torch.float32:
        return [draw_mask(site, noise, device=device, dtype=dtype, generator=generator) for site in sites]
    plan = _draw_plan(tuple(sites))
    if not plan.runs:
        return [None] * len(plan.sites)
    if generator is None:
        ensure_noise_per_rank()
    uniform = _draw(torch.rand, (plan.total,), generator, dtype=torch.float32, device=device)
    masks: list[Tensor | None] = [None] * len(plan.sites)
    for run in plan.runs:
        kept = _kept(uniform if len(plan.runs) == 1 else uniform[run.start : run.end], run.p, run.scale,
                     torch.float32)
        parts = kept.split(run.sizes) if len(run.sizes) > 1 else (kept,)
        for index, part in zip(run.sites, parts):
            masks[index] = part.view(plan.sites[index].shape)
    return masks


@dataclass(frozen=True)
class _Run:
    """Consecutive sites of one ``p``: their uniforms ``[start, end)``, their indices and sizes."""

    start: int
    end: int
    p: float
    scale: float
    sites: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class _DrawPlan:
    """How :func:`draw_masks` cuts one tensor of uniforms into the masks of ``sites``."""

    sites: tuple[MaskSite, ...]
    total: int
    runs: tuple[_Run, ...]


@traced_cache(256)
def _draw_plan(sites: tuple[MaskSite, ...]) -> _DrawPlan:
    """The :class:`_DrawPlan` of ``sites`` (a layer draws the same sites at every forward pass:
    worked out once)."""
    runs: list[_Run] = []
    start = 0
    drawn = [(index, site) for index, site in enumerate(sites) if site.p > 0]
    for p, group in itertools.groupby(drawn, key=lambda pair: pair[1].p):
        members = list(group)
        sizes = tuple(math.prod(site.shape) for _, site in members)
        end = start + sum(sizes)
        runs.append(_Run(start, end, p, _kept_value(p, torch.float32), tuple(i for i, _ in members), sizes))
        start = end
    return _DrawPlan(sites, start, tuple(runs))
