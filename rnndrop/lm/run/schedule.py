"""The learning rate of every epoch and when training stops, in one place.

Two rate rules (``TrainConfig.schedule``):

- ``"fixed"`` (Zaremba et al.): ``lr / lr_decay ** max(0, epoch - decay_after)``;
- ``"plateau"``: the rate is carried from epoch to epoch and divided by ``lr_decay``
  after every epoch whose validation did not improve on the best.

Training stops at the epoch cap (``epochs``), or earlier once the rate the next epoch
would start from is below ``min_lr`` (the run has converged: ``stopped = "lr_floor"``), or,
with NT-ASGD, once the averaged weights stop improving (``"average_converged"``,
:mod:`rnndrop.lm.run.averaging`). The fine-tuning stage (``finetune_epochs``) follows with
epochs of its own (:meth:`Schedule.finetune_epochs`).
"""

from __future__ import annotations

from collections.abc import Iterator

from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.state import RunState

__all__ = ["AVERAGE_CONVERGED", "CONVERGED", "EPOCH_CAP", "LR_FLOOR", "Schedule"]

LR_FLOOR = "lr_floor"
EPOCH_CAP = "epoch_cap"
#: NT-ASGD: the averaged weights' validation perplexity fired the non-monotone trigger.
AVERAGE_CONVERGED = "average_converged"
#: Reasons that mean the run converged (rather than hitting its cap).
CONVERGED: tuple[str, ...] = (LR_FLOOR, AVERAGE_CONVERGED)


class Schedule:
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
