"""The optimisation recipe of a training run: the rate of every epoch and when a stage stops,
the steps of an epoch (fixed or variable-length BPTT), the AR / TAR penalty, and NT-ASGD with
its fine-tuning stage.

**Rate and stopping** (:class:`LRSchedule`, ``TrainConfig.schedule``):

- ``"fixed"`` (Zaremba et al.): ``lr / lr_decay ** max(0, epoch - decay_after)``;
- ``"plateau"``: the rate is carried from epoch to epoch and divided by ``lr_decay``
  after every epoch whose validation did not improve on the best.

Training stops at the epoch cap (``epochs``), or earlier once the rate the next epoch
would start from is below ``min_lr`` (the run has converged: ``stopped = "lr_floor"``), or,
with NT-ASGD, once the averaged weights stop improving (``"average_converged"``). The
fine-tuning stage (``finetune_epochs``) follows with epochs of its own
(:meth:`LRSchedule.finetune_epochs`).

**AWD-LSTM's per-step recipe**: the segments of an epoch (:func:`epoch_segments`: every
``bptt`` rows, or AWD-LSTM's random lengths with the rate scaled) and the AR / TAR penalty
of a step (:func:`forward_with_penalty`). With the recipe off (``variable_bptt=False``,
``ar = tar = 0``) a run's steps are exactly those it took before the recipe existed: the
same segments, the same call of the model.

**NT-ASGD and fine-tuning** (:class:`RunAveraging`, ``nt_asgd``, ``finetune_epochs``, on
:class:`rnndrop.averaging.NTAveraging`). A run with ``nt_asgd`` goes through up to three
stages, one epoch loop each (:func:`rnndrop.lm.run.train.train_run`):

1. **SGD.** The trained weights are validated after every epoch; when the validation
   perplexity has not improved for ``nonmono`` epochs (non-monotone trigger), averaging
   starts with the next step (``RunState.averaging_since`` is that epoch).
2. **Averaging.** The average of the weights after every step since the switch is what is
   validated, kept as best (``best.pt``) and tested. The stage ends at the epoch cap
   (``epochs``) or when the averaged validation perplexity fires the trigger in its turn
   (stop reason :data:`AVERAGE_CONVERGED`).
3. **Fine-tuning** (``finetune_epochs`` > 0): the weights of ``best.pt`` are loaded, the
   optimizer is built anew and averaging restarts from the first step (AWD-LSTM's
   ``finetune.py``); up to ``finetune_epochs`` epochs, until the trigger fires again. The
   best epoch is still the best over the whole run.

Every epoch record says whether its validation was of the averaged weights (``averaged``)
and, in the fine-tuning stage, ``"phase": "finetune"``. The checkpoint holds the trained
weights (``model``) and :meth:`RunAveraging.state_dict` (``averaging``: the trigger's
history and the averaged weights), so a run resumes bit for bit on either side of the
switch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rnndrop.activation_regularization import ActivationRegularization
from rnndrop.averaging import NTAveraging
from rnndrop.bptt import VariableBPTT
from rnndrop.lm.data.corpus import bptt_batches, num_bptt_batches
from rnndrop.lm.model.build import build_optimizer, trainable_parameters
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import CheckpointError, RunState, load_state, read_best_weights
from rnndrop.lm.run.process_group import Distributed

__all__ = [
    "AVERAGE_CONVERGED",
    "AVERAGING_KEY",
    "CONVERGED",
    "EPOCH_CAP",
    "LR_FLOOR",
    "EpochSegments",
    "LRSchedule",
    "RunAveraging",
    "Segment",
    "activation_regularizer",
    "epoch_segments",
    "forward_with_penalty",
    "lengths_seed",
]

log = logging.getLogger(__name__)


# -- the rate of every epoch, and when a stage stops -----------------------------------------------

LR_FLOOR = "lr_floor"
EPOCH_CAP = "epoch_cap"
#: NT-ASGD: the averaged weights' validation perplexity fired the non-monotone trigger.
AVERAGE_CONVERGED = "average_converged"
#: Reasons that mean the run converged (rather than hitting its cap).
CONVERGED: tuple[str, ...] = (LR_FLOOR, AVERAGE_CONVERGED)


class LRSchedule:
    """The rate and stopping rules of ``config``."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    def epochs(self, state: RunState) -> Iterator[int]:
        """The epochs still to train: from the one after ``state.epoch`` up to the cap, until
        ``state.stopped`` is set (it is read again before every epoch)."""
        for epoch in range(state.epoch + 1, self.config.epochs + 1):
            if state.stopped or state.finetune_from is not None:
                return
            yield epoch

    def finetune_epochs(self, state: RunState) -> Iterator[int]:
        """The fine-tuning epochs still to train (``state.finetune_from`` set): up to
        ``finetune_epochs`` after the epoch it began after, until ``state.finetune_stopped``."""
        if state.finetune_from is None:
            return
        for epoch in range(state.epoch + 1, state.finetune_from + self.config.finetune_epochs + 1):
            if state.finetune_stopped:
                return
            yield epoch

    def rate(self, epoch: int, carried: float) -> float:
        """The learning rate of ``epoch``; ``carried`` is the one the previous epoch left."""
        config = self.config
        if config.schedule == "fixed":
            return config.lr / config.lr_decay ** max(0, epoch - config.decay_after)
        return carried

    def after_epoch(self, lr: float, improved: bool) -> tuple[float, str | None]:
        """(the rate the next epoch starts from, :data:`LR_FLOOR` when it is below ``min_lr``
        and training stops, else None) after an epoch at ``lr`` that ``improved`` or not."""
        config = self.config
        next_lr = lr / config.lr_decay if config.schedule == "plateau" and not improved else lr
        return next_lr, LR_FLOOR if next_lr < config.min_lr else None

    @staticmethod
    def stop_reason(state: RunState) -> str:
        """Why the run ended: ``state.stopped``, or :data:`EPOCH_CAP`."""
        return state.stopped or EPOCH_CAP


# -- the steps of an epoch, and the AR / TAR penalty of a step -------------------------------------

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


# -- NT-ASGD and the fine-tuning stage -------------------------------------------------------------

#: Where the checkpoint keeps :meth:`RunAveraging.state_dict`.
AVERAGING_KEY = "averaging"


class RunAveraging:
    """NT-ASGD for the model of one run (``config.nt_asgd``)."""

    def __init__(self, model: nn.Module, config: TrainConfig) -> None:
        self.averaging = NTAveraging(model, config.nonmono)

    @property
    def evaluation_model(self) -> nn.Module:
        """The weights to validate, save as best and test: the average once it is on."""
        return self.averaging.evaluation_model

    def after_step(self) -> None:
        self.averaging.update()

    def after_validation(self, state: RunState, epoch: int, valid_ppl: float, regime: str) -> dict[str, Any]:
        """Feed epoch ``epoch``'s validation perplexity to the trigger; returns what its record
        adds (whether the validated weights were the average, the stage)."""
        averaged = self.averaging.active
        if self.averaging.validation(valid_ppl):
            state.averaging_since = epoch
            log.info("%s: validation has not improved for %d epochs: averaging the weights from "
                     "epoch %d on (NT-ASGD)", regime, self.averaging.trigger.n, epoch + 1)
        record: dict[str, Any] = {"averaged": averaged}
        if state.finetune_from is not None:
            record["phase"] = "finetune"
        return record

    def stop_reason(self) -> str | None:
        """:data:`AVERAGE_CONVERGED` once the averaged weights stopped improving, else None."""
        return AVERAGE_CONVERGED if self.averaging.should_stop else None

    def start_finetune(self, state: RunState, config: TrainConfig, best_path: Path, ctx: Distributed,
                       regime: str) -> torch.optim.Optimizer:
        """Begin the fine-tuning stage after ``state.epoch``: the model gets the weights of
        ``best_path`` (rank 0 reads them, every rank loads them), averaging restarts from the
        next step; returns the new optimizer."""
        model = self.averaging.model
        best = read_best_weights(best_path, ctx)
        load_state(model, best, best_path)
        self.averaging.restart()
        state.finetune_from = state.epoch
        log.info("%s: fine-tuning from the weights of epoch %d (validation perplexity %.2f), averaging "
                 "restarted, up to %d epochs", regime, state.best_epoch, state.best_valid_ppl,
                 config.finetune_epochs)
        return build_optimizer(trainable_parameters(model, config), config)

    def state_dict(self) -> dict[str, Any]:
        return self.averaging.state_dict()

    def load_state_dict(self, state: Mapping[str, Any] | None, where: str) -> None:
        """Restore the checkpoint's entry (``where`` names the checkpoint in the error)."""
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{where}: a run with nt_asgd needs its averaging state, the "
                                  f"checkpoint has {type(state).__name__}")
        try:
            self.averaging.load_state_dict(state)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{where}: its averaging state does not fit this run ({e})") from None
