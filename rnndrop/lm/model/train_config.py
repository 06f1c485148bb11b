"""The training configuration of one run: model size, optimisation, dropout, grid.

:class:`TrainConfig` is plain, frozen data checked on construction; the published
settings are in :mod:`rnndrop.lm.model.presets` and building a model or an optimiser
from a config in :mod:`rnndrop.lm.model.build`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rnndrop.lm.model.regimes import REGIMES, regime_probabilities
from rnndrop.validation import check_nonnegative_float, check_nonnegative_int, check_positive_int

__all__ = ["CELLS", "OPTIMIZERS", "SELECTIONS", "TrainConfig"]

#: The largest float32 (``torch.finfo(torch.float32).max``): a learning rate above it overflows
#: in the optimiser's update of float32 parameters.
_FLOAT32_MAX = 3.4028234663852886e38

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

    AWD-LSTM's training recipe (Merity et al. 2017; all off by default, the ``awd`` preset
    turns it on):

    - ``ar`` / ``tar``: weights of activation regularization (``ar * mean(m ** 2)`` on the
      last layer's dropped output) and temporal activation regularization (``tar *
      mean((h_t - h_{t-1}) ** 2)`` on its raw output), added to the training loss
      (:mod:`rnndrop.activation_regularization`; AWD-LSTM: 2 and 1).
    - ``variable_bptt``: every segment's length drawn around ``bptt`` and the step's rate
      scaled by ``length / bptt`` (:class:`rnndrop.bptt.VariableBPTT`).
    - ``nt_asgd``: SGD until the validation perplexity has not improved for ``nonmono``
      epochs (the non-monotone trigger), then the average of the weights after every step
      (:class:`rnndrop.averaging.NTAveraging`), which is validated, kept as best and tested
      from then on; the averaging stage ends at the epoch cap or when the averaged
      validation perplexity fires the same trigger.
    - ``finetune_epochs``: then a fine-tuning stage of up to that many epochs: the best
      averaged weights, averaging restarted from the first step, until the trigger fires
      (needs ``nt_asgd``).
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
    ar: float = 0.0
    tar: float = 0.0
    variable_bptt: bool = False
    nt_asgd: bool = False
    nonmono: int = 5
    finetune_epochs: int = 0

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
            check_positive_int(name, getattr(self, name))
        positive_number("lr", self.lr)
        if self.lr > _FLOAT32_MAX:  # the optimisers scale float32 gradients by it: it must be one
            raise ValueError(f"lr must be at most {_FLOAT32_MAX:.4g} (the largest float32), got {self.lr!r}")
        positive_number("clip", self.clip)
        positive_number("lr_decay", self.lr_decay)
        positive_number("adam_eps", self.adam_eps)
        if self.init_scale is not None:
            positive_number("init_scale", self.init_scale)
        check_nonnegative_float("kl_weight", self.kl_weight)
        check_nonnegative_float("weight_decay", self.weight_decay)
        betas = tuple(self.adam_betas) if isinstance(self.adam_betas, (tuple, list)) else None
        if betas is None or len(betas) != 2 or not all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
            raise ValueError(f"adam_betas must be two numbers in [0, 1), got {self.adam_betas!r}")
        object.__setattr__(self, "adam_betas", (float(betas[0]), float(betas[1])))
        if isinstance(self.freeze, str) or not all(isinstance(p, str) and p for p in self.freeze):
            raise ValueError(f"freeze must be a tuple of parameter-name prefixes, got {self.freeze!r}")
        object.__setattr__(self, "freeze", tuple(self.freeze))
        for name in ("name", "reference"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.tie_weights, bool):
            raise ValueError(f"tie_weights must be True or False, got {self.tie_weights!r}")
        for name in ("decay_after", "mc_samples"):  # decay_after: the last epoch at the full rate
            check_nonnegative_int(name, getattr(self, name))
        if self.lr_decay < 1:  # the rate is divided by it: below 1 it would grow
            raise ValueError(f"lr_decay must be >= 1 (the rate is divided by it), got {self.lr_decay!r}")
        self._own_dropout()
        self._check_recipe()
        min_lr = self.min_lr
        if isinstance(min_lr, bool) or not (isinstance(min_lr, (int, float)) and 0 <= min_lr < self.lr):
            raise ValueError(f"min_lr must be a number in [0, lr = {self.lr}), got {self.min_lr!r}")

    def _own_dropout(self) -> None:
        """``dropout`` and ``grid`` as this config's own copies, checked: a config made from a preset
        (``dataclasses.replace``) shared the preset's dicts, so that changing its dropout changed
        the preset's for everyone after."""
        regime_probabilities(REGIMES["tied"], self.dropout)
        object.__setattr__(self, "dropout", dict(self.dropout))
        grid: dict[str, tuple[dict[str, float], ...]] = {}
        for regime, candidates in self.grid.items():
            if regime not in REGIMES:
                raise ValueError(f"grid: regime must be one of {', '.join(REGIMES)}, got {regime!r}")
            for candidate in candidates:
                regime_probabilities(REGIMES["tied"], candidate)
            grid[regime] = tuple(dict(candidate) for candidate in candidates)
        object.__setattr__(self, "grid", grid)

    def _check_recipe(self) -> None:
        """The AWD-LSTM fields (see the class docstring)."""
        for name in ("ar", "tar"):
            check_nonnegative_float(name, getattr(self, name))
        for name in ("variable_bptt", "nt_asgd"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_positive_int("nonmono", self.nonmono)
        check_nonnegative_int("finetune_epochs", self.finetune_epochs)
        if self.nt_asgd and self.optimizer != "sgd":
            raise ValueError(f"nt_asgd averages SGD's iterates (NT-ASGD): it needs optimizer 'sgd', "
                             f"got {self.optimizer!r}")
        if self.nt_asgd and self.select != "perplexity":
            raise ValueError("nt_asgd selects the best epoch on the (averaged) validation perplexity: "
                             f"it needs select 'perplexity', got {self.select!r}")
        if self.finetune_epochs and not self.nt_asgd:
            raise ValueError("finetune_epochs restarts the weight averaging of NT-ASGD from the best "
                             "averaged weights: it needs nt_asgd=True")

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
