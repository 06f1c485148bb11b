"""The progress of a training run: what the checkpoint's ``progress`` entry holds.

:class:`RunState` is written as plain data (:meth:`RunState.to_dict`, the keys the
checkpoint has always held) and read back verified (:meth:`RunState.from_dict`): a
``progress`` entry with a field of the wrong type, a missing required field or an
unknown one is a :class:`~rnndrop.lm.run.checkpoint.CheckpointError`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rnndrop.lm.run.checkpoint import CheckpointError

__all__ = ["RunState"]

#: Fields every checkpoint of format 2 holds; the others were added later and get their
#: default when absent (``best_criterion`` then falls back to ``best_valid_ppl``; the
#: NT-ASGD fields are None).
_REQUIRED = ("epoch", "lr", "best_valid_ppl", "best_epoch", "history")
_NUMBER = (int, float)
_TYPES: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "lr": _NUMBER, "best_valid_ppl": _NUMBER, "best_epoch": (int,),
    "best_criterion": _NUMBER, "history": (list,), "train_seconds": _NUMBER, "train_words": (int,),
    "wall_seconds": _NUMBER, "stopped": (str, type(None)), "init_from": (dict, type(None)),
    "averaging_since": (int, type(None)), "finetune_from": (int, type(None)),
    "finetune_stopped": (str, type(None)),
}


@dataclass
class RunState:
    """Where a run stands after its last finished epoch.

    Attributes:
        epoch: epochs finished (0 before the first).
        lr: the learning rate the next epoch starts from (the plateau rule's carry).
        best_valid_ppl: validation perplexity of the best epoch; ``best_epoch`` its number
            (0: none yet); ``best_criterion`` what the selection minimised there.
        history: one record per finished epoch (lr, train and validation perplexity, speed).
        train_seconds, train_words: time and words of the training passes, all epochs.
        wall_seconds: wall-clock time of the run, setup and evaluation included.
        stopped: why training stopped before the epoch cap (``"lr_floor"``), or None.
        init_from: what ``init_from`` loaded into the model (path, SHA-256, tensors), or None.
        averaging_since: NT-ASGD (:mod:`rnndrop.lm.run.averaging`): the epoch after which the
            weights are averaged, or None.
        finetune_from: the epoch after which the fine-tuning stage began, or None;
            ``finetune_stopped`` why it stopped before its cap, or None.
    """

    epoch: int = 0
    lr: float = 0.0
    best_valid_ppl: float = math.inf
    best_epoch: int = 0
    best_criterion: float = math.inf
    history: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    train_words: int = 0
    wall_seconds: float = 0.0
    stopped: str | None = None
    init_from: dict[str, Any] | None = None
    averaging_since: int | None = None
    finetune_from: int | None = None
    finetune_stopped: str | None = None

    def keep_if_best(self, epoch: int, valid_ppl: float, criterion: float) -> bool:
        """Make ``epoch`` the best one when its ``criterion`` is below the best so far;
        returns whether it was."""
        if not criterion < self.best_criterion:
            return False
        self.best_valid_ppl, self.best_epoch, self.best_criterion = valid_ppl, epoch, criterion
        return True

    def end_epoch(self, record: dict[str, Any], next_lr: float, seconds: float, words: int) -> None:
        """Count the epoch of ``record`` as finished; the next one starts from ``next_lr``."""
        self.history = [*self.history, record]
        self.epoch = record["epoch"]
        self.lr = next_lr
        self.train_seconds += seconds
        self.train_words += words

    def stop_stage(self, reason: str) -> None:
        """End the stage the run is in (training, or fine-tuning once it began) for ``reason``."""
        if self.finetune_from is None:
            self.stopped = reason
        else:
            self.finetune_stopped = reason

    def add_wall_time(self, since: float) -> float:
        """Add the wall-clock time since ``since`` (a ``time.perf_counter()``); returns now."""
        now = time.perf_counter()
        self.wall_seconds += now - since
        return now

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint (``torch.load(weights_only=True)`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, progress: Any, where: str) -> RunState:
        """The state a checkpoint's ``progress`` entry holds, verified; ``where`` names the
        checkpoint in the error.

        Raises:
            CheckpointError: not a dict, a required field missing, an unknown field, or a
                field of the wrong type.
        """
        if not isinstance(progress, Mapping):
            raise CheckpointError(f"{where}: its progress is a {type(progress).__name__}, expected a dict")
        missing = [k for k in _REQUIRED if k not in progress]
        unknown = sorted(set(progress) - {f.name for f in fields(cls)})
        if missing or unknown:
            raise CheckpointError(f"{where}: its progress lacks {missing or 'nothing'} and has unknown "
                                  f"fields {unknown or 'none'}")
        for key, value in progress.items():
            if isinstance(value, bool) or not isinstance(value, _TYPES[key]):
                raise CheckpointError(f"{where}: progress field {key} must be of type "
                                      f"{' or '.join(t.__name__ for t in _TYPES[key])}, got {value!r}")
        values = dict(progress)
        values.setdefault("best_criterion", values["best_valid_ppl"])
        return cls(**values)
