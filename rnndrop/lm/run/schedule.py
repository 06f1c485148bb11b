"""The learning rate of every epoch and when training stops, in one place.

Two rate rules (``TrainConfig.schedule``):

- ``"fixed"`` (Zaremba et al.): ``lr / lr_decay ** max(0, epoch - decay_after)``;
- ``"plateau"``: the rate is carried from epoch to epoch and divided by ``lr_decay``
  after every epoch whose validation did not improve on the best.

Training stops at the epoch cap (``epochs``), or earlier once the rate the next epoch
would start from is below ``min_lr`` (the run has converged: ``stopped = "lr_floor"``).
"""

from __future__ import annotations

from collections.abc import Iterator

from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.state import RunState

__all__ = ["Schedule"]

LR_FLOOR = "lr_floor"
EPOCH_CAP = "epoch_cap"


class Schedule:
    """The rate and stopping rules of ``config``."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    def epochs(self, state: RunState) -> Iterator[int]:
        """The epochs still to train: from the one after ``state.epoch`` up to the cap, until
        ``state.stopped`` is set (it is read again before every epoch)."""
        for epoch in range(state.epoch + 1, self.config.epochs + 1):
            if state.stopped:
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
