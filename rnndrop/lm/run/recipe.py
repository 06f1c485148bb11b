"""The per-step half of AWD-LSTM's recipe in a training run: the segments of an epoch
(fixed or variable-length BPTT) and the AR / TAR penalty of a step.

The rest of the recipe, NT-ASGD and the fine-tuning stage, is :mod:`rnndrop.lm.run.averaging`.
With the recipe off (``variable_bptt=False``, ``ar = tar = 0``) a run's steps are exactly
those it took before the recipe existed: the same segments, the same call of the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from rnndrop.activation_regularization import ActivationRegularization
from rnndrop.bptt import VariableBPTT
from rnndrop.lm.data.corpus import bptt_batches, num_bptt_batches
from rnndrop.lm.model.train_config import TrainConfig

__all__ = ["EpochSegments", "Segment", "activation_regularizer", "epoch_segments", "forward_with_penalty",
           "lengths_seed"]


@dataclass(frozen=True)
class Segment:
    """One truncated-BPTT step: ``inputs`` / ``targets`` ``[T, B]``, the share of the epoch
    done before it (``done``, for annealed regularizers) and the factor on its learning rate."""

    inputs: Tensor
    targets: Tensor
    done: float
    lr_scale: float = 1.0


@dataclass(frozen=True)
class EpochSegments:
    """The steps of one epoch, their number known before the first."""

    count: int
    items: Iterator[Segment]


def lengths_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s segment lengths in a run of seed ``seed``: the lengths of an
    epoch depend on the two alone (a resumed run draws the same ones; every DDP rank too)."""
    return (seed * 1_000_003 + epoch) % (2**63)


def epoch_segments(stream: Tensor, config: TrainConfig, seed: int, epoch: int) -> EpochSegments:
    """The segments of epoch ``epoch`` over the batched stream ``[N, B]``: every ``bptt`` rows,
    or (``config.variable_bptt``) AWD-LSTM's random lengths with the rate scaled by
    ``length / bptt`` (:class:`rnndrop.bptt.VariableBPTT`)."""
    if not config.variable_bptt:
        n = num_bptt_batches(stream, config.bptt)
        fixed = enumerate(bptt_batches(stream, config.bptt))
        return EpochSegments(n, (Segment(x, y, i / n) for i, (x, y) in fixed))
    sampler = VariableBPTT(config.bptt, seed=lengths_seed(seed, epoch))
    lengths = sampler.lengths(stream.shape[0])

    def items() -> Iterator[Segment]:
        start = 0
        for i, length in enumerate(lengths):
            yield Segment(stream[start : start + length], stream[start + 1 : start + 1 + length],
                          i / len(lengths), sampler.lr_scale(length))
            start += length

    return EpochSegments(len(lengths), items())


def activation_regularizer(config: TrainConfig) -> ActivationRegularization | None:
    """AR / TAR at the config's weights, or None when both are 0 (the model is then called as
    it always was)."""
    if not (config.ar or config.tar):
        return None
    return ActivationRegularization(alpha=config.ar, beta=config.tar)


def forward_with_penalty(
    net: nn.Module, inputs: Tensor, hidden: Any, regularizer: ActivationRegularization | None
) -> tuple[Tensor, Any, Tensor | None]:
    """``(logits, hidden, AR + TAR or None)`` of one training step; the penalty comes from the
    last layer's raw and dropped outputs (``model(..., return_outputs=True)``)."""
    if regularizer is None:
        logits, hidden = net(inputs, hidden)
        return logits, hidden, None
    logits, hidden, outputs = net(inputs, hidden, return_outputs=True)
    return logits, hidden, regularizer(outputs.raw, outputs.dropped)
