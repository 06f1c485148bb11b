"""KL terms of variational dropout and the loss that uses them.

Gaussian dropout with multiplicative noise ``N(1, alpha)`` on a weight ``w`` is the
posterior ``q(w) = N(theta, alpha * theta^2)``; with the scale-invariant log-uniform
prior ``p(|w|) ∝ 1 / |w|`` its KL divergence depends on ``alpha`` alone and has no
closed form. Two published approximations, both elementwise in ``log_alpha``:

- :func:`kl_kingma` (Kingma, Salimans & Welling 2015), fitted for ``alpha <= 1``:
  ``-KL ≈ const + 0.5 log α + c1 α + c2 α² + c3 α³``. The constant is left at 0, so
  only differences and gradients are meaningful (the value can be negative).
- :func:`kl_molchanov` (Molchanov, Ashukha & Vetrov 2017), for any ``alpha``:
  ``-KL ≈ k1 σ(k2 + k3 log α) − 0.5 log(1 + 1/α) − k1``, with the constant chosen so
  that ``KL → 0`` as ``α → ∞``; it is positive and decreasing in ``alpha``.

Modules with a KL term inherit :class:`KLRegularized` and implement ``kl()``;
:func:`model_kl` sums them over a model and :func:`negative_elbo` /
:class:`KLRegularizer` turn the sum into a training loss.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rnndrop.validation import (
    check_choice,
    check_fraction,
    check_instance,
    check_nonnegative_float,
    check_positive_float,
    check_positive_int,
)

__all__ = [
    "KINGMA_COEFFICIENTS",
    "KL_APPROXIMATIONS",
    "MOLCHANOV_COEFFICIENTS",
    "KLRegularized",
    "KLRegularizer",
    "check_max_alpha",
    "clip_log_alpha",
    "kl_divergence",
    "kl_kingma",
    "kl_molchanov",
    "kl_warmup",
    "model_kl",
    "negative_elbo",
]

#: (c1, c2, c3) of Kingma et al. (2015).
KINGMA_COEFFICIENTS = (1.16145124, -1.50204118, 0.58629921)
#: (k1, k2, k3) of Molchanov et al. (2017).
MOLCHANOV_COEFFICIENTS = (0.63576, 1.87320, 1.48695)


def kl_kingma(log_alpha: Tensor) -> Tensor:
    """Kingma et al.'s approximation of ``KL(q || p)`` per weight, valid for ``alpha <= 1``.

    Args:
        log_alpha: any shape.

    Returns:
        ``-(0.5 log α + c1 α + c2 α² + c3 α³)``, the shape of ``log_alpha``.
    """
    c1, c2, c3 = KINGMA_COEFFICIENTS
    alpha = log_alpha.exp()
    return -(0.5 * log_alpha + alpha * (c1 + alpha * (c2 + alpha * c3)))


def kl_molchanov(log_alpha: Tensor) -> Tensor:
    """Molchanov et al.'s approximation of ``KL(q || p)`` per weight, for any ``alpha``.

    Args:
        log_alpha: any shape.

    Returns:
        ``k1 − k1 σ(k2 + k3 log α) + 0.5 log(1 + 1/α)`` (``> 0``, ``→ 0`` as ``α → ∞``),
        the shape of ``log_alpha``.
    """
    k1, k2, k3 = MOLCHANOV_COEFFICIENTS
    return k1 - k1 * torch.sigmoid(k2 + k3 * log_alpha) + 0.5 * F.softplus(-log_alpha)


KL_APPROXIMATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "molchanov": kl_molchanov,
    "kingma": kl_kingma,
}


def kl_divergence(log_alpha: Tensor, approximation: str = "molchanov") -> Tensor:
    """The approximation named ``approximation`` (``"molchanov"`` or ``"kingma"``), elementwise."""
    check_choice("approximation", approximation, tuple(KL_APPROXIMATIONS))
    return KL_APPROXIMATIONS[approximation](log_alpha)


def check_max_alpha(max_alpha: float | None, kl_approximation: str) -> float | None:
    """``max_alpha`` checked (None or positive), and checked against ``kl_approximation``'s range."""
    check_choice("kl_approximation", kl_approximation, tuple(KL_APPROXIMATIONS))
    if max_alpha is not None:
        max_alpha = check_positive_float("max_alpha", max_alpha)
    if kl_approximation == "kingma" and (max_alpha is None or max_alpha > 1):
        raise ValueError(
            "kl_approximation='kingma' is fitted for alpha <= 1 only: it needs max_alpha <= 1, "
            f"got max_alpha={max_alpha!r}"
        )
    return max_alpha


def initial_log_alpha(p: float, max_alpha: float | None) -> float:
    """``log(p / (1 - p))``, the Gaussian noise of dropout probability ``p``, at most
    ``log(max_alpha)``: a learned alpha starts inside its bound, where it can move."""
    init = math.log(p / (1.0 - p))
    return init if max_alpha is None else min(init, math.log(max_alpha))


def checked_fan_out(module: str, argument: str, fan_out: int | None, *, noisy: bool = True,
                    stacklevel: int = 1) -> int:
    """``fan_out`` (the weights each output unit scales in the layer it feeds) checked; when not
    given, 1, with a warning if the site has noise (``noisy``): once per unit is too weak a KL
    term to keep that noise. ``stacklevel`` counts from the caller, as for ``warnings.warn``."""
    if fan_out is None:
        if noisy:
            warnings.warn(
                f"{module}: {argument} not given, so the KL term counts each output alpha once per "
                f"unit, too weak a term to keep that noise (its alpha falls towards 0 in training); "
                f"pass {argument}=<width of the layer it feeds> (a language model: its vocabulary "
                f"size), or {argument}=1 to keep this count", UserWarning, stacklevel=stacklevel + 1)
        fan_out = 1
    return check_positive_int(argument, fan_out)


class _ClipFromAbove(torch.autograd.Function):
    """``min(x, bound)`` whose gradient reaches an ``x`` beyond ``bound`` only when it points
    back inside (a gradient step would lower ``x``): a parameter pushed past the bound by
    one step stays free to come back instead of sitting where its gradient is zero forever."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, bound: float) -> Tensor:
        ctx.save_for_backward(x)
        ctx.bound = bound
        return x.clamp(max=bound)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * ((x <= ctx.bound) | (grad > 0)).to(grad.dtype), None


def clip_log_alpha(log_alpha: Tensor, max_alpha: float | None) -> Tensor:
    """``log_alpha`` clipped at ``log(max_alpha)``; unchanged for None.

    Beyond the bound only a gradient that lowers ``log_alpha`` passes, so the KL term
    (which favours larger alpha) cannot push it further out, and the data term can
    always bring it back.
    """
    if max_alpha is None:
        return log_alpha
    return _ClipFromAbove.apply(log_alpha, math.log(max_alpha))


class KLRegularized(ABC):
    """Mixin for modules whose parameters carry a KL term (learned dropout rates, weight noise).

    ``kl()`` returns the KL divergence of *this module's own* variational parameters
    (not of its submodules) as a scalar tensor, so that :func:`model_kl` can sum
    ``kl()`` over ``model.modules()`` without counting anything twice.
    """

    @abstractmethod
    def kl(self) -> Tensor:
        """KL divergence of this module's own variational posterior from its prior (scalar)."""


def model_kl(model: nn.Module) -> Tensor:
    """Sum of ``kl()`` over every :class:`KLRegularized` module in ``model`` (itself included).

    Returns a scalar tensor (zero, on the model's device, when there is none).
    """
    check_instance("model", model, nn.Module, "an nn.Module")
    terms = [m.kl() for m in model.modules() if isinstance(m, KLRegularized)]
    if terms:
        return torch.stack(terms).sum()
    param = next(model.parameters(), None)
    return torch.zeros((), device=None if param is None else param.device)


def kl_warmup(progress: float, warmup: float) -> float:
    """Linear KL warm-up: the weight of the KL term at ``progress`` in [0, 1] of training.

    The weight rises linearly from 0 to 1 over the first ``warmup`` fraction of
    training and stays at 1 after; ``warmup=0`` gives 1 from the start.
    """
    warmup = check_fraction("warmup", warmup, "a fraction of training")
    if warmup == 0:
        return 1.0
    return float(min(1.0, max(0.0, progress) / warmup))


def negative_elbo(nll: Tensor, kl: Tensor, dataset_size: int, kl_weight: float = 1.0) -> Tensor:
    """The negative ELBO per data point: ``nll + kl_weight * kl / dataset_size``.

    The ELBO of ``N = dataset_size`` data points is ``N * E[log p(y|x, w)] − KL``; a
    mini-batch estimates the data term by ``N`` times its mean log-likelihood.
    Dividing by ``N`` keeps the loss on the scale of ``nll`` (and learning rates
    unchanged).

    Args:
        nll: mean negative log-likelihood per data point of the mini-batch (scalar;
            for a language model, per token, and ``dataset_size`` counts tokens).
        kl: scalar, e.g. :func:`model_kl`.
        dataset_size: number of data points in the training set.
        kl_weight: factor on the KL term, e.g. :func:`kl_warmup`.
    """
    if not isinstance(kl_weight, Tensor):  # a tensor's value is not read: it would wait for the device
        check_nonnegative_float("kl_weight", kl_weight)
    return nll + kl_weight * kl / check_positive_int("dataset_size", dataset_size)


@dataclass(frozen=True)
class KLRegularizer:
    """A loss hook ``(model, progress, dataset_size) -> kl_warmup(progress, warmup) * model_kl(model) / N``.

    Added to the mean NLL per data point it gives :func:`negative_elbo` with linear
    KL warm-up; ``progress`` is the fraction of training done, in [0, 1]. The
    signature of ``Regime.regularizer`` in :mod:`rnndrop.lm.model.regimes`, whose training
    loop passes the number of training tokens as ``dataset_size``.

    Attributes:
        dataset_size: ``N``, data points (tokens) in the training set; None to take the
            one the caller passes (the language-model training loop does).
        warmup: fraction of training over which the KL weight rises from 0 to 1.
    """

    dataset_size: int | None = None
    warmup: float = 0.0

    def __post_init__(self) -> None:
        if self.dataset_size is not None:
            check_positive_int("dataset_size", self.dataset_size)
        kl_warmup(0.0, self.warmup)  # checks warmup

    def __call__(self, model: nn.Module, progress: float, dataset_size: int | None = None) -> Tensor:
        n = self.dataset_size if self.dataset_size is not None else dataset_size
        if n is None:
            raise ValueError(
                "dataset_size: KLRegularizer needs the number of training data points, "
                "at construction or at the call, got None for both"
            )
        weight = kl_warmup(progress, self.warmup)
        return model_kl(model) * (weight / check_positive_int("dataset_size", n))
