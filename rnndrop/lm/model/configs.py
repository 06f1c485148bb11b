"""Training configurations, as plain data.

A *config* fixes the model size and the optimisation (the published settings of
Zaremba et al. 2014 and Gal & Ghahramani 2016, plus ``mini`` / ``cpu-200`` for the
small offline corpora and ``sparse-vd-*`` for sparse variational dropout), the dropout
probability of every site (``TrainConfig.dropout``) and the grid searched on the
validation split (``TrainConfig.grid``). Where dropout goes is the *regime*'s
business (:mod:`rnndrop.lm.model.regimes`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from torch import nn

from rnndrop.lm.model.regimes import REGIMES, Regime, get_hook, regime_probabilities

__all__ = [
    "CELLS",
    "CONFIGS",
    "OPTIMIZERS",
    "SELECTIONS",
    "TrainConfig",
    "build_model",
    "build_optimizer",
    "get_config",
    "trainable_parameters",
]

CELLS: tuple[str, ...] = ("lstm", "gru")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam")
#: What picks a run's best epoch: its validation perplexity, or its validation objective
#: (the validation NLL per word plus ``kl_weight`` times the regime's regularizer).
SELECTIONS: tuple[str, ...] = ("perplexity", "objective")


@dataclass(frozen=True)
class TrainConfig:
    """Model size and optimisation of one benchmark setting.

    The learning rate starts at ``lr``. Schedule ``"fixed"`` (Zaremba): epoch ``e``
    (1-based) runs at ``lr / lr_decay ** max(0, e - decay_after)``. Schedule
    ``"plateau"``: the rate is divided by ``lr_decay`` after every epoch whose
    validation perplexity does not beat the best so far. Training stops at ``epochs``
    (the cap) or, once converged, as soon as the next epoch's rate would fall below
    ``min_lr`` (0: never). Test perplexity is always measured with the parameters of
    the best validation epoch: the epoch of the lowest validation perplexity
    (``select="perplexity"``), or of the lowest validation objective
    (``select="objective"``: validation NLL per word plus ``kl_weight`` times the regime's
    regularizer at full weight). Sparse VD selects on its objective: perplexity alone
    would pick the epoch before the KL pruned anything.

    ``kl_weight`` multiplies the regime's regularizer (the KL term of variational regimes,
    already divided by the training words): 1 is the ELBO, below 1 a tempered posterior
    that prunes less. Regimes without a regularizer ignore it.

    ``freeze`` names parameters by prefix that keep their initial (or ``init_from``)
    values: the optimiser never sees them. The sparse-VD fine-tune freezes the embedding
    and the decoder, which Adam would otherwise overfit while the KL prunes the LSTM.

    ``optimizer`` is ``"sgd"`` (with ``weight_decay``) or ``"adam"`` (with
    ``adam_betas``, ``adam_eps`` and ``weight_decay``); ``clip`` is the threshold of
    the gradient-norm clipping. ``cell`` is ``"lstm"`` or ``"gru"``.
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
    optimizer: str = "sgd"
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    cell: str = "lstm"
    eval_batch_size: int = 10
    tie_weights: bool = False
    dropout: Mapping[str, float] = field(default_factory=dict)
    #: Dropout probabilities searched per regime on the validation split.
    grid: Mapping[str, tuple[Mapping[str, float], ...]] = field(default_factory=dict)
    mc_samples: int = 100
    reference: str = ""
    kl_weight: float = 1.0
    select: str = "perplexity"
    #: Parameter-name prefixes that are not trained (e.g. ``("embedding.", "decoder.")``).
    freeze: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def positive_number(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

        if self.schedule not in ("fixed", "plateau"):
            raise ValueError(f"schedule must be 'fixed' or 'plateau', got {self.schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.select not in SELECTIONS:
            raise ValueError(f"select must be one of {', '.join(SELECTIONS)}, got {self.select!r}")
        if self.cell not in CELLS:
            raise ValueError(f"cell must be one of {', '.join(CELLS)}, got {self.cell!r}")
        for name in ("embedding_size", "hidden_size", "num_layers", "batch_size", "bptt", "epochs",
                     "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        positive_number("lr", self.lr)
        positive_number("clip", self.clip)
        positive_number("lr_decay", self.lr_decay)
        positive_number("adam_eps", self.adam_eps)
        if self.init_scale is not None:
            positive_number("init_scale", self.init_scale)
        if isinstance(self.kl_weight, bool) or not isinstance(self.kl_weight, (int, float)) \
                or not (math.isfinite(self.kl_weight) and self.kl_weight >= 0):
            raise ValueError(f"kl_weight must be a finite number >= 0, got {self.kl_weight!r}")
        if isinstance(self.weight_decay, bool) or not isinstance(self.weight_decay, (int, float)) \
                or not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        betas = tuple(self.adam_betas) if isinstance(self.adam_betas, (tuple, list)) else None
        if betas is None or len(betas) != 2 or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
            raise ValueError(f"adam_betas must be two numbers in [0, 1), got {self.adam_betas!r}")
        object.__setattr__(self, "adam_betas", (float(betas[0]), float(betas[1])))
        if isinstance(self.freeze, str) or not all(isinstance(p, str) and p for p in self.freeze):
            raise ValueError(f"freeze must be a tuple of parameter-name prefixes, got {self.freeze!r}")
        object.__setattr__(self, "freeze", tuple(self.freeze))
        if not (isinstance(self.min_lr, (int, float)) and 0 <= self.min_lr < self.lr):
            raise ValueError(f"min_lr must be a number in [0, lr = {self.lr}), got {self.min_lr!r}")
        regime_probabilities(REGIMES["tied"], self.dropout)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["dropout"] = dict(self.dropout)
        out["adam_betas"] = list(self.adam_betas)
        out["freeze"] = list(self.freeze)
        out["grid"] = {k: [dict(p) for p in v] for k, v in self.grid.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """The inverse of :meth:`to_dict` (unknown keys, e.g. of older versions, are an error)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"config has unknown fields {unknown}; expected among {sorted(known)}")
        values = dict(data)
        if "adam_betas" in values:
            values["adam_betas"] = tuple(values["adam_betas"])
        if "grid" in values:
            values["grid"] = {k: tuple(dict(p) for p in v) for k, v in values["grid"].items()}
        return cls(**values)


def trainable_parameters(model: nn.Module, config: TrainConfig) -> list[nn.Parameter]:
    """The parameters of ``model`` that ``config.freeze`` does not name; the named ones get
    ``requires_grad=False``. Raises ValueError for a prefix that names no parameter."""
    names = [name for name, _ in model.named_parameters()]
    unmatched = [p for p in config.freeze if not any(n.startswith(p) for n in names)]
    if unmatched:
        raise ValueError(f"freeze: the prefixes {unmatched} name no parameter of the model; its "
                         f"parameters are {', '.join(names)}")
    trainable = []
    for name, param in model.named_parameters():
        if name.startswith(tuple(config.freeze)):
            param.requires_grad_(False)
        else:
            trainable.append(param)
    return trainable


def build_optimizer(parameters: Any, config: TrainConfig) -> Any:
    """The optimiser ``config.optimizer`` names, with the config's hyper-parameters."""
    import torch

    if config.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=config.lr, betas=config.adam_betas,
                                eps=config.adam_eps, weight_decay=config.weight_decay)
    return torch.optim.SGD(parameters, lr=config.lr, weight_decay=config.weight_decay)


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
#: A grid whose best point was at one of its ends got one more point beyond that end
#: (naive: 0.75; untied, batch, gaussian, weight_drop: a lighter point).
_SMALL_GRID: dict[str, tuple[Mapping[str, float], ...]] = {
    "none": ({},),
    "naive": tuple(_zaremba(p) for p in (0.3, 0.5, 0.65, 0.75)),
    "tied": _tied_grid(0.1, (0.1, 0.2, 0.3), (0.3, 0.5, 0.65)),
    "untied": _tied_grid(0.1, (0.05, 0.1, 0.2, 0.3), (0.2, 0.3, 0.5, 0.65)),
    "batch": _tied_grid(0.1, (0.05, 0.1, 0.2, 0.3), (0.2, 0.3, 0.5, 0.65)),
    "gaussian": _tied_grid(0.1, (0.05, 0.1, 0.2, 0.3), (0.2, 0.3, 0.5, 0.65)),
    # DropConnect on W_hh drops single weights, not whole units: AWD-LSTM uses 0.5.
    "weight_drop": _tied_grid(0.1, (0.1, 0.2, 0.35, 0.5), (0.2, 0.3, 0.5, 0.65)),
}

CONFIGS: dict[str, TrainConfig] = {
    # Sized for ptb-mini (57k training words) on one CPU thread: a few minutes a run.
    "mini": TrainConfig(
        name="mini", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20, bptt=35,
        epochs=20, lr=20.0, lr_decay=4.0, decay_after=0, clip=0.25, init_scale=0.1,
        schedule="plateau", eval_batch_size=10,
        dropout={"embedding": 0.1, "hidden": 0.2, "input": 0.5, "between": 0.5, "output": 0.5},
        grid=_SMALL_GRID, mc_samples=50,
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
        grid=_SMALL_GRID, mc_samples=50,
        reference="the mini model trained to convergence on validation perplexity (plateau "
        "decay down to a learning-rate floor)",
    ),
    # Sparse variational dropout on the mini model (Lobacheva et al. 2017): Adam at a
    # constant rate, looser clipping, KL warm-up from the regime. Train it with regime
    # sparse_vd, from scratch or fine-tuning a dense run (train_run(init_from=...)).
    "sparse-vd-mini": TrainConfig(
        name="sparse-vd-mini", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20,
        bptt=35, epochs=8, lr=2e-3, lr_decay=1.0, decay_after=0, clip=5.0, init_scale=0.1,
        optimizer="adam", eval_batch_size=10, mc_samples=0, select="objective",
        reference="Lobacheva, Chirkova & Vetrov 2017, Bayesian sparsification of recurrent "
        "neural networks (Adam, KL warm-up), sized as the mini config",
    ),
    # The sparse-VD recipe for ptb-144k (docs/sparse-vd-results.md): fine-tune a converged
    # cpu-200 tied run (--init-from) with Adam at a constant rate, the embedding and decoder
    # frozen, the KL at weight 0.5 (chosen on validation) warmed up over the first 3 epochs,
    # tied dropout kept on the other sites, the epoch of the lowest validation objective
    # kept. --kl-weight trades compression for perplexity.
    "sparse-vd-cpu-200": TrainConfig(
        name="sparse-vd-cpu-200", embedding_size=200, hidden_size=200, num_layers=2,
        batch_size=20, bptt=35, epochs=15, lr=1e-3, lr_decay=1.0, decay_after=0, clip=5.0,
        init_scale=0.1, optimizer="adam", eval_batch_size=10, mc_samples=0, select="objective",
        kl_weight=0.5, freeze=("embedding.", "decoder."),
        dropout={"embedding": 0.1, "input": 0.5, "between": 0.5, "output": 0.5},
        reference="fine-tuning a dense tied model with sparse variational dropout (Lobacheva, "
        "Chirkova & Vetrov 2017: Adam, KL warm-up), sized as cpu-200",
    ),
    "zaremba-small": TrainConfig(
        name="zaremba-small", embedding_size=200, hidden_size=200, num_layers=2, batch_size=20,
        bptt=20, epochs=13, lr=1.0, lr_decay=2.0, decay_after=4, clip=5.0, init_scale=0.1,
        dropout={}, reference=_ZAREMBA_REF + " (small, no dropout)",
    ),
    "zaremba-medium": TrainConfig(
        name="zaremba-medium", embedding_size=650, hidden_size=650, num_layers=2, batch_size=20,
        bptt=35, epochs=39, lr=1.0, lr_decay=1.2, decay_after=6, clip=5.0, init_scale=0.05,
        dropout=_zaremba(0.5),
        reference=_ZAREMBA_REF + " (medium)",
    ),
    "zaremba-large": TrainConfig(
        name="zaremba-large", embedding_size=1500, hidden_size=1500, num_layers=2, batch_size=20,
        bptt=35, epochs=55, lr=1.0, lr_decay=1.15, decay_after=14, clip=10.0, init_scale=0.04,
        dropout=_zaremba(0.65),
        reference=_ZAREMBA_REF + " (large)",
    ),
    "gal-medium": TrainConfig(
        name="gal-medium", embedding_size=650, hidden_size=650, num_layers=2, batch_size=20,
        bptt=35, epochs=39, lr=1.0, lr_decay=1.2, decay_after=6, clip=5.0, init_scale=0.05,
        weight_decay=1e-7, dropout=_gal(0.2, 0.35),
        reference=_GAL_REF + " (medium: 0.2 embedding/recurrent, 0.35 input/output)",
    ),
    "gal-large": TrainConfig(
        name="gal-large", embedding_size=1500, hidden_size=1500, num_layers=2, batch_size=20,
        bptt=35, epochs=55, lr=1.0, lr_decay=1.15, decay_after=10, clip=10.0, init_scale=0.04,
        weight_decay=1e-7, dropout=_gal(0.3, 0.5),
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
    """The language model of ``config`` (its ``cell``) with ``regime``'s dropout at
    ``probabilities``."""
    from rnndrop.lm.model.language_model import RNNLanguageModel

    p = regime_probabilities(regime, probabilities)
    common = {
        "dropout_embedding": p["embedding"],
        "embedding_scope": regime.embedding_scope,
        "tie_weights": config.tie_weights,
        "init_scale": config.init_scale,
        "cell": config.cell,
    }
    if regime.rnn_factory is not None:
        factory = get_hook(regime.rnn_factory)
        rnn = factory(config.embedding_size, config.hidden_size, config.num_layers, p, cell=config.cell)
        return RNNLanguageModel(
            vocab_size, config.embedding_size, config.hidden_size, config.num_layers,
            rnn=rnn, **common,
        )
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
