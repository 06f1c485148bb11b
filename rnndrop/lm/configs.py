"""Training configurations and dropout regimes, as plain data.

A *config* fixes the model size and the optimisation (the published settings of
Zaremba et al. 2014 and Gal & Ghahramani 2016, plus ``mini`` for the small offline
corpora). A *regime* says where dropout goes and how its masks live; the dropout
probabilities come from the config (``TrainConfig.dropout``, one per *site*), or
from a grid searched on the validation split (``TrainConfig.grid``).

Sites: ``embedding`` (word types), ``input`` (first layer's input), ``between``
(input of later layers), ``hidden`` (the recurrent state ``h_{t-1}``, or ``W_hh``
for weight-dropped regimes), ``output`` (before the decoder). A regime uses only the
sites it lists; the others get probability 0.

Adding a regime (e.g. learned Gaussian dropout)::

    from rnndrop.lm.configs import REGIMES, Regime
    REGIMES["gaussian"] = Regime(
        "tied Gaussian noise", sites=("input", "hidden", "between", "output"),
        noise="gaussian", regularizer=my_term)   # my_term(model, progress, n_train) -> Tensor

``regularizer(model, progress, train_tokens)`` returns a scalar added to the training
loss (the mean cross-entropy per word); ``progress`` runs from 0 to 1 over training (for
annealing) and ``train_tokens`` is the size of the training stream (the N of an ELBO).
``rnn_factory(input_size, hidden_size, num_layers, probabilities)``
builds a recurrent stack of one's own (``nn.LSTM``'s call contract) in place of the
VariationalLSTM; it then applies every dropout site but ``embedding`` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from torch import Tensor, nn

from rnndrop.kl import KLRegularizer
from rnndrop.masks import check_probability

__all__ = [
    "CONFIGS",
    "REGIMES",
    "SITES",
    "Regime",
    "TrainConfig",
    "build_model",
    "get_config",
    "get_regime",
    "regime_probabilities",
]

SITES: tuple[str, ...] = ("embedding", "input", "between", "hidden", "output")

Regularizer = Callable[[nn.Module, float], Tensor]
RNNFactory = Callable[[int, int, int, Mapping[str, float]], nn.Module]


@dataclass(frozen=True)
class Regime:
    """Where dropout goes and how its masks live (see the module docstring).

    Attributes:
        description: one line for tables and logs.
        sites: the dropout sites this regime uses (a subset of :data:`SITES`).
        mask_scope: ``"sequence"`` (tied, Gal), ``"step"`` (naive, Zaremba) or
            ``"batch"`` (recurrent mask shared by the batch, folded into ``W_hh``).
        per_gate_masks: one mask per gate (Gal's untied variant).
        noise: ``"bernoulli"`` or ``"gaussian"``.
        weight_drop: the ``hidden`` probability drops ``W_hh`` entries (WeightDrop,
            AWD-LSTM) instead of masking ``h_{t-1}``.
        embedding_scope: ``"sequence"`` or ``"batch"`` for the word-type dropout.
        regularizer: optional extra loss term
            ``regularizer(model, progress, train_tokens) -> Tensor``.
        rnn_factory: optional builder of the recurrent stack.
    """

    description: str
    sites: tuple[str, ...] = ()
    mask_scope: str = "sequence"
    per_gate_masks: bool = False
    noise: str = "bernoulli"
    weight_drop: bool = False
    embedding_scope: str = "sequence"
    regularizer: Regularizer | None = None
    rnn_factory: RNNFactory | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.sites if s not in SITES]
        if unknown:
            raise ValueError(f"sites must be among {SITES}, got {unknown}")

    def settings(self) -> dict[str, Any]:
        """The regime as JSON-friendly data (hooks by name)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("regularizer", "rnn_factory")}
        out["sites"] = list(self.sites)
        for hook in ("regularizer", "rnn_factory"):
            fn = getattr(self, hook)
            out[hook] = None if fn is None else getattr(fn, "__qualname__", repr(fn))
        return out


_ALL_SITES = ("embedding", "input", "between", "hidden", "output")

#: The regimes the benchmark knows; add entries to extend it.
REGIMES: dict[str, Regime] = {
    "none": Regime("no dropout"),
    "naive": Regime(
        "naive dropout (Zaremba): fresh masks every step, non-recurrent connections only",
        sites=("input", "between", "output"),
        mask_scope="step",
    ),
    "tied": Regime(
        "variational dropout (Gal), tied: one mask per sequence shared by the gates, "
        "recurrent state and word-type embedding dropout",
        sites=_ALL_SITES,
    ),
    "untied": Regime(
        "variational dropout (Gal), untied: one mask per sequence and gate",
        sites=_ALL_SITES,
        per_gate_masks=True,
    ),
    "batch": Regime(
        "fast path: recurrent mask shared by the batch and folded into W_hh (fused kernel)",
        sites=_ALL_SITES,
        mask_scope="batch",
        embedding_scope="batch",
    ),
    "weight_drop": Regime(
        "AWD-LSTM style: DropConnect on W_hh (WeightDrop) plus tied masks elsewhere",
        sites=_ALL_SITES,
        weight_drop=True,
        embedding_scope="batch",
    ),
}


def _gaussian_lstm(
    input_size: int, hidden_size: int, num_layers: int, p: Mapping[str, float]
) -> nn.Module:
    """GaussianLSTM: learned per-unit alpha on every site, initialised at p / (1 - p)."""
    from rnndrop.gaussian import GaussianLSTM

    return GaussianLSTM(
        input_size, hidden_size, num_layers, dropout=p["between"], dropout_input=p["input"],
        dropout_hidden=p["hidden"], dropout_output=p["output"], granularity="unit",
    )


def _sparse_lstm(
    input_size: int, hidden_size: int, num_layers: int, p: Mapping[str, float]
) -> nn.Module:
    """SparseLSTM: sparse variational dropout on every LSTM weight matrix."""
    from rnndrop.sparse import SparseLSTM

    return SparseLSTM(input_size, hidden_size, num_layers)


# The KL term of these regimes is divided by the training tokens the loop passes in.
REGIMES["gaussian"] = Regime(
    "Gaussian dropout N(1, alpha), tied, learned per-unit alpha (Kingma et al.), KL warm-up; "
    "Bernoulli word-type embedding dropout",
    sites=("embedding", "input", "between", "hidden", "output"),
    noise="gaussian",
    regularizer=KLRegularizer(warmup=0.2),
    rnn_factory=_gaussian_lstm,
)
REGIMES["sparse_vd"] = Regime(
    "sparse variational dropout on the LSTM weights (Molchanov et al.; Lobacheva et al.)",
    regularizer=KLRegularizer(warmup=0.2),
    rnn_factory=_sparse_lstm,
)


def get_regime(name: str) -> Regime:
    try:
        return REGIMES[name]
    except KeyError:
        raise ValueError(f"regime must be one of {', '.join(REGIMES)}, got {name!r}") from None


def regime_probabilities(regime: Regime, probabilities: Mapping[str, float]) -> dict[str, float]:
    """The probability of every site under ``regime``: given ones on its sites, 0 elsewhere."""
    unknown = [s for s in probabilities if s not in SITES]
    if unknown:
        raise ValueError(f"dropout sites must be among {SITES}, got {unknown}")
    return {
        site: check_probability(f"dropout[{site!r}]", float(probabilities.get(site, 0.0)))
        if site in regime.sites else 0.0
        for site in SITES
    }


@dataclass(frozen=True)
class TrainConfig:
    """Model size and optimisation of one benchmark setting.

    The learning rate starts at ``lr``. Schedule ``"fixed"`` (Zaremba): epoch ``e``
    (1-based) runs at ``lr / lr_decay ** max(0, e - decay_after)``. Schedule
    ``"plateau"``: the rate is divided by ``lr_decay`` after every epoch whose
    validation perplexity does not beat the best so far. Training stops at ``epochs``
    (the cap) or, once converged, as soon as the next epoch's rate would fall below
    ``min_lr`` (0: never). Test perplexity is always measured with the parameters of
    the best validation epoch.
    """

    name: str
    embedding_size: int
    hidden_size: int
    num_layers: int
    batch_size: int
    bptt: int
    epochs: int
    lr: float
    lr_decay: float
    decay_after: int
    clip: float
    init_scale: float | None
    weight_decay: float = 0.0
    schedule: str = "fixed"
    min_lr: float = 0.0
    eval_batch_size: int = 10
    tie_weights: bool = False
    dropout: Mapping[str, float] = field(default_factory=dict)
    #: Dropout probabilities searched per regime on the validation split.
    grid: Mapping[str, tuple[Mapping[str, float], ...]] = field(default_factory=dict)
    mc_samples: int = 100
    default_regime: str = "tied"
    reference: str = ""

    def __post_init__(self) -> None:
        if self.schedule not in ("fixed", "plateau"):
            raise ValueError(f"schedule must be 'fixed' or 'plateau', got {self.schedule!r}")
        for name in ("embedding_size", "hidden_size", "num_layers", "batch_size", "bptt", "epochs",
                     "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (isinstance(self.min_lr, (int, float)) and 0 <= self.min_lr < self.lr):
            raise ValueError(f"min_lr must be a number in [0, lr = {self.lr}), got {self.min_lr!r}")
        regime_probabilities(REGIMES["tied"], self.dropout)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["dropout"] = dict(self.dropout)
        out["grid"] = {k: [dict(p) for p in v] for k, v in self.grid.items()}
        return out

    def with_overrides(self, **changes: Any) -> TrainConfig:
        return replace(self, **changes)


def _zaremba(p: float) -> dict[str, float]:
    return {"input": p, "between": p, "output": p} if p else {}


def _gal(p_embedding_hidden: float, p_input_output: float) -> dict[str, float]:
    # Gal & Ghahramani tie the embedding and recurrent probabilities, and the
    # input and output ones (their grid search).
    return {
        "embedding": p_embedding_hidden, "hidden": p_embedding_hidden,
        "input": p_input_output, "between": p_input_output, "output": p_input_output,
    }


_ZAREMBA_REF = "Zaremba, Sutskever & Vinyals 2014, Recurrent neural network regularization"
_GAL_REF = (
    "Gal & Ghahramani 2016, A theoretically grounded application of dropout in RNNs "
    "(their LM code, yaringal/BayesianRNN): Zaremba's settings + weight decay 1e-7 and "
    "grid-searched probabilities"
)

def _tied_grid(embedding: float, hidden: tuple[float, ...], rest: tuple[float, ...]):
    return tuple(
        {"embedding": embedding, "hidden": h, "input": r, "between": r, "output": r}
        for h, r in zip(hidden, rest)
    )


#: Small grids: three points per regime (none has nothing to search), chosen on validation.
#: The recurrent probability and the others grow together, from light to heavy dropout.
_SMALL_GRID: dict[str, tuple[Mapping[str, float], ...]] = {
    "none": ({},),
    "naive": tuple(_zaremba(p) for p in (0.3, 0.5, 0.65)),
    "tied": _tied_grid(0.1, (0.1, 0.2, 0.3), (0.3, 0.5, 0.65)),
    "untied": _tied_grid(0.1, (0.1, 0.2, 0.3), (0.3, 0.5, 0.65)),
    "batch": _tied_grid(0.1, (0.1, 0.2, 0.3), (0.3, 0.5, 0.65)),
    "gaussian": _tied_grid(0.1, (0.1, 0.2, 0.3), (0.3, 0.5, 0.65)),
    # DropConnect on W_hh drops single weights, not whole units: AWD-LSTM uses 0.5.
    "weight_drop": _tied_grid(0.1, (0.2, 0.35, 0.5), (0.3, 0.5, 0.65)),
}

CONFIGS: dict[str, TrainConfig] = {
    # Sized for ptb-mini (57k training words) on one CPU thread: a few minutes a run.
    "mini": TrainConfig(
        name="mini", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20, bptt=35,
        epochs=20, lr=20.0, lr_decay=4.0, decay_after=0, clip=0.25, init_scale=0.1,
        schedule="plateau", eval_batch_size=10,
        dropout={"embedding": 0.1, "hidden": 0.2, "input": 0.5, "between": 0.5, "output": 0.5},
        grid=_SMALL_GRID, mc_samples=50, default_regime="tied",
        reference="small offline setting of this project (SGD and plateau decay as in "
        "pytorch/examples word_language_model)",
    ),
    # The mini model trained to convergence (for ptb-144k): the rate is divided by 4 after
    # every epoch that does not improve validation perplexity, and the run ends when it
    # would fall below 0.1 (after the fourth such epoch) or at the cap of 60 epochs.
    "cpu-200": TrainConfig(
        name="cpu-200", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20, bptt=35,
        epochs=60, lr=20.0, lr_decay=4.0, decay_after=0, clip=0.25, init_scale=0.1,
        schedule="plateau", min_lr=0.1, eval_batch_size=10,
        dropout={"embedding": 0.1, "hidden": 0.2, "input": 0.5, "between": 0.5, "output": 0.5},
        grid=_SMALL_GRID, mc_samples=50, default_regime="tied",
        reference="the mini model trained to convergence on validation perplexity (plateau "
        "decay down to a learning-rate floor)",
    ),
    "zaremba-small": TrainConfig(
        name="zaremba-small", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20,
        bptt=20, epochs=13, lr=1.0, lr_decay=2.0, decay_after=4, clip=5.0, init_scale=0.1,
        dropout={}, default_regime="none", reference=_ZAREMBA_REF + " (small, no dropout)",
    ),
    "zaremba-medium": TrainConfig(
        name="zaremba-medium", embedding_size=650, hidden_size=650, num_layers=2, batch_size=20,
        bptt=35, epochs=39, lr=1.0, lr_decay=1.2, decay_after=6, clip=5.0, init_scale=0.05,
        dropout=_zaremba(0.5), default_regime="naive",
        reference=_ZAREMBA_REF + " (medium)",
    ),
    "zaremba-large": TrainConfig(
        name="zaremba-large", embedding_size=1500, hidden_size=1500, num_layers=2, batch_size=20,
        bptt=35, epochs=55, lr=1.0, lr_decay=1.15, decay_after=14, clip=10.0, init_scale=0.04,
        dropout=_zaremba(0.65), default_regime="naive",
        reference=_ZAREMBA_REF + " (large)",
    ),
    "gal-medium": TrainConfig(
        name="gal-medium", embedding_size=650, hidden_size=650, num_layers=2, batch_size=20,
        bptt=35, epochs=39, lr=1.0, lr_decay=1.2, decay_after=6, clip=5.0, init_scale=0.05,
        weight_decay=1e-7, dropout=_gal(0.2, 0.35), default_regime="untied",
        reference=_GAL_REF + " (medium: 0.2 embedding/recurrent, 0.35 input/output)",
    ),
    "gal-large": TrainConfig(
        name="gal-large", embedding_size=1500, hidden_size=1500, num_layers=2, batch_size=20,
        bptt=35, epochs=55, lr=1.0, lr_decay=1.15, decay_after=10, clip=10.0, init_scale=0.04,
        weight_decay=1e-7, dropout=_gal(0.3, 0.5), default_regime="untied",
        reference=_GAL_REF + " (large: 0.3 embedding/recurrent, 0.5 input/output; decay "
        "after epoch 10 as in main_new_dropout_SOTA_v3.lua)",
    ),
}


def get_config(name: str) -> TrainConfig:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"config must be one of {', '.join(CONFIGS)}, got {name!r}") from None


def build_model(
    vocab_size: int, config: TrainConfig, regime: Regime, probabilities: Mapping[str, float]
) -> nn.Module:
    """The language model of ``config`` with ``regime``'s dropout at ``probabilities``."""
    from rnndrop.lm.model import RNNLanguageModel

    p = regime_probabilities(regime, probabilities)
    common = {
        "dropout_embedding": p["embedding"],
        "embedding_scope": regime.embedding_scope,
        "tie_weights": config.tie_weights,
        "init_scale": config.init_scale,
    }
    if regime.rnn_factory is not None:
        rnn = regime.rnn_factory(config.embedding_size, config.hidden_size, config.num_layers, p)
        model = RNNLanguageModel(
            vocab_size, config.embedding_size, config.hidden_size, config.num_layers,
            rnn=rnn, **common,
        )
        return model
    return RNNLanguageModel(
        vocab_size, config.embedding_size, config.hidden_size, config.num_layers,
        dropout_input=p["input"],
        dropout_between=p["between"],
        dropout_hidden=0.0 if regime.weight_drop else p["hidden"],
        dropout_output=p["output"],
        weight_drop=p["hidden"] if regime.weight_drop else 0.0,
        mask_scope=regime.mask_scope,
        per_gate_masks=regime.per_gate_masks,
        noise=regime.noise,
        **common,
    )
