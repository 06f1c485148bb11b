"""Dropout regimes, as plain data: where dropout goes and how its masks live.

Sites: ``embedding`` (word types), ``input`` (first layer's input), ``between``
(input of later layers), ``hidden`` (the recurrent state ``h_{t-1}``, or ``W_hh``
for weight-dropped regimes), ``output`` (before the decoder). A regime uses only the
sites it lists; the others get probability 0. The probabilities come from the config
(:class:`rnndrop.lm.model.train_config.TrainConfig`) or from a grid searched on validation.

Regimes are frozen and :data:`REGIMES` is a read-only mapping; a regime names its
code hooks (an extra loss term, a recurrent stack of its own), which live in a
registry of hooks. Adding a regime (e.g. learned Gaussian dropout with another
warm-up)::

    from rnndrop.lm.model.regimes import Regime, register_hook, register_regime
    register_hook("kl_warmup_half", KLRegularizer(warmup=0.5))
    register_regime("gaussian_slow", Regime(
        "tied Gaussian noise, slow KL warm-up", sites=("input", "hidden", "between", "output"),
        regularizer="kl_warmup_half", rnn_factory="gaussian_rnn"))

or, for the duration of a block only (tests), ``with registered(regimes={...}, hooks={...}):``.
Registrations live in the process that makes them (worker processes started with
``spawn`` do not see them).

``regularizer(model, progress, train_tokens)`` returns a scalar added to the training
loss (the mean cross-entropy per word), times the config's ``kl_weight``; ``progress``
runs from 0 to 1 over training (for annealing) and ``train_tokens`` is the size of the
training stream (the N of an ELBO). ``rnn_factory(input_size, hidden_size, num_layers,
probabilities, cell=...)`` builds a recurrent stack of one's own (``nn.LSTM``'s /
``nn.GRU``'s call contract, ``cell`` is ``"lstm"`` or ``"gru"``) in place of the
VariationalLSTM / VariationalGRU; it then applies every dropout site but ``embedding``
itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any

from rnndrop.kl import KLRegularizer
from rnndrop.lm.model.rnn_factories import learned_gaussian, sparse_variational
from rnndrop.validation import check_probability

__all__ = [
    "REGIMES",
    "SITES",
    "Regime",
    "get_hook",
    "get_regime",
    "regime_probabilities",
    "register_hook",
    "register_regime",
    "registered",
]

SITES: tuple[str, ...] = ("embedding", "input", "between", "hidden", "output")

@dataclass(frozen=True)
class Regime:
    """Where dropout goes and how its masks live (see the module docstring).

    Attributes:
        description: what the regime is, in one line; recorded with every run's settings
            (``results.json``).
        sites: the dropout sites this regime uses (a subset of :data:`SITES`).
        mask_scope: ``"sequence"`` (tied, Gal), ``"step"`` (naive, Zaremba) or
            ``"batch"`` (recurrent and between-layer masks shared by the batch, folded into
            ``W_hh`` / ``W_ih``).
        per_gate_masks: one mask per gate (Gal's untied variant).
        noise: ``"bernoulli"`` or ``"gaussian"``.
        weight_drop: the ``hidden`` probability drops ``W_hh`` entries (WeightDrop,
            AWD-LSTM) instead of masking ``h_{t-1}``.
        embedding_scope: ``"sequence"`` or ``"batch"`` for the word-type dropout.
        regularizer: name of a registered hook
            ``regularizer(model, progress, train_tokens) -> Tensor``, or None.
        rnn_factory: name of a registered builder of the recurrent stack, or None.
    """

    description: str
    sites: tuple[str, ...] = ()
    mask_scope: str = "sequence"
    per_gate_masks: bool = False
    noise: str = "bernoulli"
    weight_drop: bool = False
    embedding_scope: str = "sequence"
    regularizer: str | None = None
    rnn_factory: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sites", tuple(self.sites))
        unknown = [s for s in self.sites if s not in SITES]
        if unknown:
            raise ValueError(f"sites must be among {SITES}, got {unknown}")
        for hook in ("regularizer", "rnn_factory"):
            value = getattr(self, hook)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"Regime.{hook} must be the name of a registered hook (str) or "
                                f"None, got {type(value).__name__}; register the callable with "
                                "register_hook(name, fn)")

    def settings(self) -> dict[str, Any]:
        """The regime as JSON-friendly data (hooks by name)."""
        out = asdict(self)
        out["sites"] = list(self.sites)
        return out

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> Regime:
        """The inverse of :meth:`settings`."""
        return cls(**{k: v for k, v in settings.items() if k in {f.name for f in fields(cls)}})


_HOOKS: dict[str, Callable[..., Any]] = {
    # The KL term is divided by the training tokens the loop passes in.
    "kl_warmup_0.2": KLRegularizer(warmup=0.2),
    # The output site's KL counts the decoder weights each unit scales (its vocabulary).
    "learned_alpha": learned_gaussian("unit"),
    "learned_alpha_kingma": learned_gaussian("unit", max_alpha=1.0, kl_approximation="kingma"),
    "learned_alpha_kingma_layer": learned_gaussian("layer", max_alpha=1.0, kl_approximation="kingma"),
    # The output KL counted once per unit: kept so that the regimes of the Gaussian runs trained
    # that way (results/gaussian/, docs/gaussian-results.md) still build, evaluate and resume.
    "gaussian_rnn": learned_gaussian("unit", decoder_kl=False),
    "gaussian_kingma_rnn": learned_gaussian("unit", max_alpha=1.0, kl_approximation="kingma",
                                            decoder_kl=False),
    "gaussian_kingma_layer_rnn": learned_gaussian("layer", max_alpha=1.0, kl_approximation="kingma",
                                                  decoder_kl=False),
    "sparse_rnn": sparse_variational,
}

_REGIMES: dict[str, Regime] = {
    "none": Regime("no dropout"),
    "naive": Regime(
        "naive dropout (Zaremba): fresh masks every step, non-recurrent connections only",
        sites=("input", "between", "output"),
        mask_scope="step",
    ),
    "tied": Regime(
        "variational dropout (Gal), tied: one mask per sequence shared by the gates, "
        "recurrent state and word-type embedding dropout",
        sites=SITES,
    ),
    "untied": Regime(
        "variational dropout (Gal), untied: one mask per sequence and gate",
        sites=SITES,
        per_gate_masks=True,
    ),
    "batch": Regime(
        "fast path: recurrent and between-layer masks shared by the batch, folded into W_hh / W_ih "
        "(fused kernel, every layer in one call)",
        sites=SITES,
        mask_scope="batch",
        embedding_scope="batch",
    ),
    "weight_drop": Regime(
        "AWD-LSTM style: DropConnect on W_hh (WeightDrop) plus tied masks elsewhere",
        sites=SITES,
        weight_drop=True,
        embedding_scope="batch",
    ),
    "gaussian": Regime(
        "Gaussian dropout N(1, alpha), tied, learned per-unit alpha, any alpha (Molchanov et al.'s "
        "KL approximation), KL warm-up; "
        "Bernoulli word-type embedding dropout",
        sites=SITES,
        noise="gaussian",
        regularizer="kl_warmup_0.2",
        rnn_factory="learned_alpha",
    ),
    "gaussian_fixed": Regime(
        "Gaussian dropout N(1, alpha), tied, alpha = p / (1 - p) fixed (the baseline of learned alpha); "
        "Bernoulli word-type embedding dropout",
        sites=SITES,
        noise="gaussian",
    ),
    "gaussian_kingma": Regime(
        "Gaussian dropout, tied, learned per-unit alpha <= 1 with Kingma et al.'s KL approximation "
        "(their constrained setting), KL warm-up; Bernoulli word-type embedding dropout",
        sites=SITES,
        noise="gaussian",
        regularizer="kl_warmup_0.2",
        rnn_factory="learned_alpha_kingma",
    ),
    "gaussian_kingma_layer": Regime(
        "as gaussian_kingma with one learned alpha per site and layer (Kingma et al.'s per-layer "
        "variant)",
        sites=SITES,
        noise="gaussian",
        regularizer="kl_warmup_0.2",
        rnn_factory="learned_alpha_kingma_layer",
    ),
    "sparse_vd": Regime(
        "sparse variational dropout on the recurrent weights (Molchanov et al.; Lobacheva et al.), "
        "tied Bernoulli dropout on the other sites",
        sites=("embedding", "input", "between", "output"),
        regularizer="kl_warmup_0.2",
        rnn_factory="sparse_rnn",
    ),
}

#: The regimes the benchmark knows (read-only; extend with :func:`register_regime`).
REGIMES: Mapping[str, Regime] = MappingProxyType(_REGIMES)


def register_hook(name: str, fn: Callable[..., Any], *, replace: bool = False) -> None:
    """Make ``fn`` available to regimes as ``regularizer=name`` or ``rnn_factory=name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"hook name must be a non-empty str, got {name!r}")
    if not callable(fn):
        raise TypeError(f"hook {name!r} must be callable, got {type(fn).__name__}")
    if name in _HOOKS and not replace and _HOOKS[name] is not fn:
        raise ValueError(f"hook {name!r} is already registered; pass replace=True to replace it")
    _HOOKS[name] = fn


def register_regime(name: str, regime: Regime, *, replace: bool = False) -> None:
    """Add ``regime`` to :data:`REGIMES` under ``name`` (its hooks must be registered)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"regime name must be a non-empty str, got {name!r}")
    if not isinstance(regime, Regime):
        raise TypeError(f"regime must be a Regime, got {type(regime).__name__}")
    for hook in (regime.regularizer, regime.rnn_factory):
        if hook is not None:
            get_hook(hook)
    if name in _REGIMES and not replace and _REGIMES[name] != regime:
        raise ValueError(f"regime {name!r} is already registered; pass replace=True to replace it")
    _REGIMES[name] = regime


@contextmanager
def registered(
    regimes: Mapping[str, Regime] | None = None, hooks: Mapping[str, Callable[..., Any]] | None = None
) -> Iterator[None]:
    """Register ``hooks`` and ``regimes`` for the duration of a ``with`` block, then
    restore the registries exactly as they were."""
    saved_hooks, saved_regimes = dict(_HOOKS), dict(_REGIMES)
    try:
        for name, fn in (hooks or {}).items():
            register_hook(name, fn, replace=True)
        for name, regime in (regimes or {}).items():
            register_regime(name, regime, replace=True)
        yield
    finally:
        _HOOKS.clear()
        _HOOKS.update(saved_hooks)
        _REGIMES.clear()
        _REGIMES.update(saved_regimes)


def get_hook(name: str) -> Callable[..., Any]:
    try:
        return _HOOKS[name]
    except KeyError:
        raise ValueError(f"hook must be one of {', '.join(_HOOKS)}, got {name!r} "
                         "(register it with register_hook)") from None


def get_regime(name: str) -> Regime:
    try:
        return _REGIMES[name]
    except KeyError:
        raise ValueError(f"regime must be one of {', '.join(_REGIMES)}, got {name!r}") from None


def regime_probabilities(regime: Regime, probabilities: Mapping[str, float]) -> dict[str, float]:
    """The probability of every site under ``regime``: given ones on its sites, 0 elsewhere."""
    unknown = [s for s in probabilities if s not in SITES]
    if unknown:
        raise ValueError(f"dropout sites must be among {SITES}, got {unknown}")
    for site, p in probabilities.items():
        if isinstance(p, (str, bytes, bool)):  # float() would take "0.2"
            raise TypeError(f"dropout[{site!r}] must be a float in [0, 1), got {type(p).__name__} {p!r}")
    return {
        site: check_probability(f"dropout[{site!r}]", float(probabilities.get(site, 0.0)))
        if site in regime.sites else 0.0
        for site in SITES
    }
