"""Gaussian dropout with a learned variance, tied over time (Kingma, Salimans & Welling 2015).

Multiplicative noise ``N(1, alpha)`` drawn once per sequence, like Gal's masks, whose
``alpha`` is a parameter stored as ``log_alpha`` and learned with the data term
plus the KL term of :mod:`rnndrop.kl` (see :func:`rnndrop.kl.negative_elbo`).
With ``alpha`` fixed, ``VariationalLSTM(..., noise="gaussian")`` is the same noise.

:class:`GaussianLSTM` / :class:`GaussianGRU` subclass :class:`~rnndrop.VariationalLSTM` /
:class:`~rnndrop.VariationalGRU` and only change how masks are sampled: every site
whose dropout probability ``p`` is positive (``dropout_input``, ``dropout`` between
layers, ``dropout_hidden``, ``dropout_output``) gets a ``log_alpha`` parameter
initialised to ``log(p / (1 - p))``, the Gaussian dropout of the same variance (at most
``log(max_alpha)`` when ``max_alpha`` is given).

``granularity``:

``"layer"``   one ``alpha`` per site (shape ``[1]``);
``"unit"``    one per unit of the site (``[size]``);
``"weight"``  one per unit and gate (``[gates, size]``, with per-gate masks), i.e. one per
              column block of ``W_ih`` / ``W_hh`` that the unit feeds; the output site has
              no gates and falls back to ``"unit"``.

KL term (:meth:`kl`): noise ``ξ_i`` on a unit that feeds weights ``w_ji`` is read as the
weight posterior ``w_ji ~ N(θ_ji, α_i θ_ji²)``, so each ``alpha`` counts once per weight
it scales: ``gates * hidden_size`` weights per input unit (twice for a bidirectional
layer's shared input mask), ``gates * hidden_size`` per recurrent unit. The output site
feeds a layer outside this module: ``output_fan_out`` says how many weights each output
unit scales there (a language model's decoder: the vocabulary size). Without it the output
counts once per unit (with a warning), a KL term so small beside the data term that the
output's alpha falls towards 0 (no output dropout) during training.

:class:`GaussianLockedDropout` is the same noise as a stand-alone locked-dropout layer, for a
tensor between any two layers: one ``N(1, alpha)`` vector per sequence, reused at every step.

State dicts: the base weights keep ``nn.LSTM``'s names, the ``log_alpha_*`` entries
are extra. Load an ``nn.LSTM`` state dict with ``load_state_dict(sd, strict=False)``
(``log_alpha`` keeps its value) and give ``nn.LSTM`` :func:`rnn_state_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from rnndrop.masks import RecurrentMasks
from rnndrop.noise import MaskSite, learned_gaussian_mask, scaled_gaussian_noise, standard_normal_noise
from rnndrop.recurrent import VariationalGRU, VariationalLSTM
from rnndrop.stochastic import Stochastic
from rnndrop.validation import (
    check_bool,
    check_choice,
    check_positive_int,
    check_probability,
    checked_setting,
    fix_settings,
)

__all__ = [
    "GRANULARITIES", "GaussianGRU", "GaussianLSTM", "GaussianLockedDropout", "LearnedGaussianMasks",
    "rnn_state_dict",
]

GRANULARITIES: tuple[str, ...] = ("layer", "unit", "weight")


def rnn_state_dict(layer: nn.RNNBase) -> dict[str, Tensor]:
    """The entries of ``layer.state_dict()`` that a plain ``nn.LSTM`` / ``nn.GRU`` has."""
    names = set(layer._flat_weights_names)
    return {k: v for k, v in layer.state_dict().items() if k in names}


def _alpha_shape(granularity: str, size: int, gates: int | None) -> tuple[int, ...]:
    if granularity == "layer":
        return (1,)
    if granularity == "weight" and gates:
        return (gates, size)
    return (size,)


def _as_given(name: str, value: Any) -> Any:
    """No check of its own: the constructor checks these settings together."""
    return value


#: Why a Gaussian layer's noise settings cannot change once it is built.
_SITES_MADE = "the constructor built its noise sites, their learned log alpha and KL terms from it"


def _fixed(name: str, check: Callable[[str, Any], Any] = _as_given) -> property:
    return checked_setting(name, check, fixed=_SITES_MADE)


@dataclass(frozen=True)
class LearnedGaussianMasks(RecurrentMasks):
    """The masks a learned-``alpha`` layer's :meth:`sample_masks` draws: ``1 + sqrt(alpha) * eps``
    at every site, and the standard normal draws ``eps`` themselves (``draws``, in the order of
    ``site_names``: every layer's input, every layer's and direction's state, the output). The
    layer's ``forward`` rebuilds the masks from the draws with its ``alpha`` of that call (a
    ``map`` of them is a plain :class:`RecurrentMasks`, used as it is)."""

    draws: tuple[Tensor | None, ...] = ()
    site_names: tuple[str, ...] = ()


class _LearnedAlphaMixin(KLRegularized):
    """Learned ``log_alpha`` per mask site; placed before VariationalLSTM / VariationalGRU."""

    # Fixed once built (a change would be ignored: the sites and their alphas are parameters).
    dropout = _fixed("dropout", check_probability)
    dropout_input = _fixed("dropout_input", check_probability)
    dropout_hidden = _fixed("dropout_hidden", check_probability)
    dropout_output = _fixed("dropout_output", check_probability)
    noise = _fixed("noise")
    per_gate_masks = _fixed("per_gate_masks", check_bool)
    granularity = _fixed("granularity")
    max_alpha = _fixed("max_alpha")
    kl_approximation = _fixed("kl_approximation")
    output_fan_out = _fixed("output_fan_out")

    def __init__(
        self,
        *args: Any,
        granularity: str = "unit",
        max_alpha: float | None = 1.0,
        kl_approximation: str = "kingma",
        output_fan_out: int | None = None,
        **kwargs: Any,
    ) -> None:
        if "noise" in kwargs:
            raise TypeError(
                f"{type(self).__name__} always draws Gaussian noise: noise must not be given, "
                f"got noise={kwargs['noise']!r}"
            )
        if granularity == "weight" and kwargs.get("per_gate_masks") is False:
            raise ValueError(f"{type(self).__name__}: granularity='weight' learns one alpha per gate and "
                             "input unit, so its masks are per gate: per_gate_masks=False contradicts it "
                             "(leave per_gate_masks out)")
        super().__init__(*args, noise="gaussian", **kwargs)
        self._init_learned_alpha(granularity, max_alpha, kl_approximation, output_fan_out)
        fix_settings(self)

    def _init_learned_alpha(
        self, granularity: str, max_alpha: float | None, kl_approximation: str, output_fan_out: int | None
    ) -> None:
        self.granularity = check_choice("granularity", granularity, GRANULARITIES)
        self.output_fan_out = checked_fan_out(type(self).__name__, "output_fan_out", output_fan_out,
                                              noisy=self.dropout_output > 0, stacklevel=3)
        self.max_alpha = check_max_alpha(max_alpha, kl_approximation)
        self.kl_approximation = kl_approximation
        if granularity == "weight":
            self.per_gate_masks = True
        D, H, gates = self._num_directions, self.hidden_size, self._cell.gates
        width = D * self._out_size
        # site name -> (initial log alpha, shape, weights counted per element in kl())
        self._alpha_sites: dict[str, tuple[float, tuple[int, ...], float]] = {}

        def add(name: str, p: float, size: int, site_gates: int | None, fan_out: int) -> None:
            if p == 0:
                return
            shape = _alpha_shape(granularity, size, site_gates)
            count = size * fan_out / math.prod(shape)
            self._alpha_sites[name] = (initial_log_alpha(p, self.max_alpha), shape, count)

        for layer in range(self.num_layers):
            p = self.dropout_input if layer == 0 else self.dropout
            size = self.input_size if layer == 0 else width
            add(f"log_alpha_input_l{layer}", p, size, gates, D * gates * H)
            for d in range(D):
                suffix = f"_l{layer}" + ("_reverse" if d else "")
                add("log_alpha_hidden" + suffix, self.dropout_hidden, self._out_size, gates, gates * H)
        add("log_alpha_output", self.dropout_output, width, None, self.output_fan_out)
        weight = self.weight_ih_l0
        for name, (init, shape, _) in self._alpha_sites.items():
            param = torch.full(shape, init, device=weight.device, dtype=weight.dtype)
            self.register_parameter(name, nn.Parameter(param))

    def reset_parameters(self) -> None:
        super().reset_parameters()  # nn.RNNBase draws every parameter uniformly...
        with torch.no_grad():  # ...so put log_alpha back to its initial value
            for name, (init, _, _) in getattr(self, "_alpha_sites", {}).items():
                getattr(self, name).fill_(init)

    def _log_alpha(self, name: str) -> Tensor | None:
        """The site's ``log_alpha``, clipped at ``log(max_alpha)``; None for a site without noise."""
        if name not in self._alpha_sites:
            return None
        return clip_log_alpha(getattr(self, name), self.max_alpha)

    def alphas(self) -> dict[str, Tensor]:
        """``alpha`` (after clipping) of every site with noise, by parameter name, detached."""
        return {name: self._log_alpha(name).detach().exp() for name in self._alpha_sites}

    def site_kl(self) -> dict[str, Tensor]:
        """The KL term of every site with noise (scalars), by parameter name; they sum to :meth:`kl`."""
        approx = KL_APPROXIMATIONS[self.kl_approximation]
        return {name: approx(self._log_alpha(name)).sum() * count
                for name, (_, _, count) in self._alpha_sites.items()}

    def kl(self) -> Tensor:
        """KL term of all sites (scalar); see the module docstring for what is counted."""
        terms = list(self.site_kl().values())
        return torch.stack(terms).sum() if terms else self.weight_ih_l0.new_zeros(())

    def _draw_sites(
        self, sites: list[MaskSite], scope: str, device: torch.device | str, dtype: torch.dtype,
        generator: torch.Generator | None,
    ) -> RecurrentMasks:
        """The layer's draw (:class:`~rnndrop.recurrent.VariationalRNNStack`): ``1 + e^(log_alpha / 2)
        * eps`` at every site with noise, differentiable in ``log_alpha``, as
        :class:`LearnedGaussianMasks`, which keep the standard normal draws ``eps``: a forward call
        *given* them (:meth:`VariationalLSTM.sample_masks`) scales the draws by each site's ``alpha``
        of that moment, so one set of masks serves several calls and backward passes (truncated
        BPTT) while ``alpha`` learns."""
        names = tuple(site.name for site in sites)
        draws = tuple(
            None if f"log_alpha_{site.name}" not in self._alpha_sites
            else standard_normal_noise(site.shape, device=device, dtype=dtype, generator=generator)
            for site in sites
        )
        masks = self._assembled(self._scaled(names, draws), scope)
        return LearnedGaussianMasks(masks.inputs, masks.hidden, masks.output, masks.scope, masks.per_gate,
                                    draws=draws, site_names=names)

    def _scaled(self, names: tuple[str, ...], draws: tuple[Tensor | None, ...]) -> list[Tensor | None]:
        return [None if eps is None else scaled_gaussian_noise(self._log_alpha(f"log_alpha_{name}"), eps)
                for name, eps in zip(names, draws)]

    def _given_masks(self, masks: RecurrentMasks, layout: Any, x: Tensor) -> RecurrentMasks:
        if isinstance(masks, LearnedGaussianMasks):  # the draws scaled by alpha now: a graph of this call's
            masks = self._assembled(self._scaled(masks.site_names, masks.draws), masks.scope)
        return super()._given_masks(masks, layout, x)  # type: ignore[misc]

    def extra_repr(self) -> str:
        s = super().extra_repr() + f", granularity={self.granularity!r}"
        if self.max_alpha != 1.0:
            s += f", max_alpha={self.max_alpha}"
        if self.kl_approximation != "kingma":
            s += f", kl_approximation={self.kl_approximation!r}"
        if self.output_fan_out != 1:
            s += f", output_fan_out={self.output_fan_out}"
        return s


_GAUSSIAN_ARGS_DOC = """
    Takes the arguments of the parent class except ``noise`` (always Gaussian).
    The dropout probabilities (``dropout``, ``dropout_input``, ``dropout_hidden``,
    ``dropout_output``) choose the sites with noise and its initial variance
    ``alpha = p / (1 - p)``; ``mask_scope`` and ``kernel`` are those of the parent.

    Extra keyword arguments:
        granularity: ``"layer"``, ``"unit"`` (default) or ``"weight"`` (module docstring).
        max_alpha: upper bound on ``alpha``; default ``1.0``, Kingma et al.'s constraint. A
            larger ``log_alpha`` is clipped and gets no gradient only outwards. None: unbounded
            (with ``kl_approximation="molchanov"``).
        kl_approximation: ``"kingma"`` (default; needs ``max_alpha <= 1``) or
            ``"molchanov"`` (any alpha), see :mod:`rnndrop.kl`. The defaults are Kingma et
            al.'s constrained setting, the best of the learned settings in
            ``docs/gaussian-results.md`` (per unit, ``alpha <= 1``).
        output_fan_out: weights each output unit scales in the layer it feeds (the
            decoder's vocabulary size in a language model); the output site's KL counts
            each alpha that many times per unit. Not given: counted once per unit, with a
            warning when the output site has noise (module docstring).

    ``kl()`` returns the KL term; ``alphas()`` the learned variances by site.
"""


class GaussianLSTM(_LearnedAlphaMixin, VariationalLSTM):
    __doc__ = (
        """:class:`~rnndrop.VariationalLSTM` with Gaussian noise ``N(1, alpha)`` of learned ``alpha``.

    Example::

        lstm = GaussianLSTM(200, 200, dropout_input=0.5, dropout_hidden=0.2,
                            dropout_output=0.5, granularity="unit", output_fan_out=vocab_size)
        loss = negative_elbo(nll, model_kl(lstm), dataset_size=n_tokens)
"""
        + _GAUSSIAN_ARGS_DOC
    )


class GaussianGRU(_LearnedAlphaMixin, VariationalGRU):
    __doc__ = (
        """:class:`~rnndrop.VariationalGRU` with Gaussian noise ``N(1, alpha)`` of learned ``alpha``.
"""
        + _GAUSSIAN_ARGS_DOC
    )


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

    # Fixed once built (``log_alpha`` and the KL term were made from them); batch_first may
    # change, checked.
    size = _fixed("size")
    p = _fixed("p")
    granularity = _fixed("granularity")
    max_alpha = _fixed("max_alpha")
    kl_approximation = _fixed("kl_approximation")
    fan_out = _fixed("fan_out")
    batch_first = checked_setting("batch_first", check_bool)

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
        self.batch_first = batch_first
        shape = (1,) if granularity == "layer" else (size,)
        self.log_alpha = nn.Parameter(torch.full(shape, initial_log_alpha(p, self.max_alpha)))
        fix_settings(self)

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
        layout = f"[B, T, {self.size}]" if self.batch_first else f"[T, B, {self.size}]"
        if not isinstance(data, Tensor):
            raise TypeError(f"x must be a Tensor {layout} or a PackedSequence, got {type(data).__name__}")
        if not data.is_floating_point():
            raise TypeError(f"x must hold floating-point values (the noise scales them), got {data.dtype}")
        # checked in eval mode too: a wrong input is found before training starts, not when it does
        if data.dim() != (2 if isinstance(x, PackedSequence) else 3) or data.shape[-1] != self.size:
            raise ValueError(f"x must be 3-D {layout} or a PackedSequence of [*, {self.size}], got shape "
                             f"{list(data.shape)}")
        if not self.training:
            return x
        log_alpha = self._clipped_log_alpha()
        if isinstance(x, PackedSequence):
            shape = (int(x.batch_sizes[0]), self.size)
            noise = learned_gaussian_mask(shape, log_alpha, device=data.device, dtype=data.dtype)
            return mask_packed_sequence(x, noise)
        shape = (data.shape[0], 1, self.size) if self.batch_first else (1, data.shape[1], self.size)
        return x * learned_gaussian_mask(shape, log_alpha, device=data.device, dtype=data.dtype)

    def extra_repr(self) -> str:
        return f"{self.size}, p={self.p}, granularity={self.granularity!r}, fan_out={self.fan_out}"
