"""What a training configuration builds: the model, the optimiser, the trained parameters.

A *config* fixes the model size and the optimisation (the published settings of
Zaremba et al. 2014 and Gal & Ghahramani 2016, plus ``mini`` / ``cpu-200`` for the
small offline corpora and ``sparse-vd-*`` for sparse variational dropout), the dropout
probability of every site (``TrainConfig.dropout``) and the grid searched on the
validation split (``TrainConfig.grid``). Where dropout goes is the *regime*'s
business (:mod:`rnndrop.lm.model.regimes`).

This module holds what is built from a config (the model, the optimiser, the trained
parameters); the config itself is :class:`~rnndrop.lm.model.train_config.TrainConfig`, the
named presets are :data:`~rnndrop.lm.model.presets.CONFIGS`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from rnndrop.lm.model.language_model import RNNLanguageModel
from rnndrop.lm.model.regimes import Regime, get_hook, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig

__all__ = ["build_model", "build_optimizer", "trainable_parameters"]


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
    if not trainable:
        raise ValueError(f"freeze (--freeze) {', '.join(config.freeze)} names every parameter of the "
                         "model, so nothing would train; leave at least one parameter out of it")
    return trainable


def build_optimizer(parameters: Any, config: TrainConfig) -> Any:
    """The optimiser ``config.optimizer`` names, with the config's hyper-parameters."""
    if config.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=config.lr, betas=config.adam_betas,
                                eps=config.adam_eps, weight_decay=config.weight_decay)
    return torch.optim.SGD(parameters, lr=config.lr, weight_decay=config.weight_decay)


def _takes(fn: Callable[..., object], name: str) -> bool:
    """Whether ``fn`` accepts the keyword ``name`` (factories registered before it existed do not)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def build_model(
    vocab_size: int, config: TrainConfig, regime: Regime, probabilities: Mapping[str, float]
) -> nn.Module:
    """The language model of ``config`` (its ``cell``) with ``regime``'s dropout at
    ``probabilities``."""
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
        extra = {"output_fan_out": vocab_size} if _takes(factory, "output_fan_out") else {}
        rnn = factory(config.embedding_size, config.hidden_size, config.num_layers, p,
                      cell=config.cell, **extra)
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
