"""The divergence check of a training epoch: one class for every place a run can blow up.

A training step diverges when its loss (with the regime's extra term) is NaN or infinite,
when its NLL per word is so large that the perplexity overflows (:data:`MAX_NLL`), or
when the gradient norm is not finite; an epoch diverges when its validation perplexity
is not finite. Under DDP every rank learns every rank's loss before any of them enters
the backward pass (and its all-reduce), so all ranks stop together. The error says
where it happened and whether the checkpoint of the last finished epoch verifies.
"""

from __future__ import annotations

import math
from pathlib import Path

from torch import Tensor

from rnndrop.lm.run.checkpoint import CheckpointError, load_checkpoint
from rnndrop.lm.run.evaluate import MAX_NLL
from rnndrop.lm.run.process_group import ONE_PROCESS, Distributed, all_gather_floats

__all__ = ["DivergenceCheck", "TrainingDiverged"]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became NaN or infinite (or the perplexity overflowed)."""


class DivergenceCheck:
    """The checks of one epoch.

    Args:
        epoch: the epoch being trained; ``n_batches`` its truncated-BPTT segments and
            ``lr`` its learning rate (for the message).
        checkpoint_path: the run's ``checkpoint.pt``; ``last_good_epoch`` the epoch it
            holds (0: none yet).
        ctx: the process group (the loss check is decided over every rank).
    """

    def __init__(self, epoch: int, n_batches: int, lr: float, checkpoint_path: Path,
                 last_good_epoch: int, ctx: Distributed = ONE_PROCESS) -> None:
        self.epoch, self.n_batches, self.lr = epoch, n_batches, lr
        self.checkpoint_path, self.last_good_epoch, self.ctx = checkpoint_path, last_good_epoch, ctx

    def losses(self, objective: Tensor, loss: Tensor, batch: int) -> None:
        """The step's objective (NLL + extra term) must be finite and its NLL per word at most
        :data:`MAX_NLL`, on every rank."""
        if not self.ctx.enabled:
            self._check_loss(objective.item(), loss.item(), "", batch)
            return
        values = all_gather_floats([objective.item(), loss.item()], self.ctx)
        for rank, (rank_objective, rank_loss) in enumerate(values):
            self._check_loss(rank_objective, rank_loss, f" on rank {rank}", batch)

    def gradient_norm(self, norm: Tensor, batch: int) -> None:
        """The clipped gradient's norm (before clipping) must be finite."""
        if not math.isfinite(norm.item()):
            self.stop(f"the gradient norm is {norm.item()}", batch)

    def validation(self, perplexity: float) -> None:
        """The epoch's validation perplexity must be finite."""
        if not math.isfinite(perplexity):
            self.stop(f"the validation perplexity is {perplexity}", self.n_batches - 1)

    def _check_loss(self, objective: float, loss: float, on_rank: str, batch: int) -> None:
        if not math.isfinite(objective):
            self.stop(f"the training loss is {objective}{on_rank}", batch)
        if loss > MAX_NLL:
            self.stop(f"the training loss is {loss:.4g} nats per word{on_rank} (the perplexity "
                      "overflows)", batch)

    def stop(self, what: str, batch: int) -> None:
        """Raise :class:`TrainingDiverged`: ``what`` happened at ``batch`` (0-based)."""
        raise TrainingDiverged(
            f"training stopped: {what} at epoch {self.epoch}, batch {batch + 1}/{self.n_batches} "
            f"(lr {self.lr:g}); {self._checkpoint_note()}. Lower the learning rate or the clipping "
            "threshold and start again."
        )

    def _checkpoint_note(self) -> str:
        if not self.last_good_epoch:
            return "no epoch had finished, so there is no checkpoint"
        if not self.ctx.is_main:
            return f"rank 0 keeps the checkpoint of epoch {self.last_good_epoch}"
        try:
            load_checkpoint(self.checkpoint_path)
        except (OSError, CheckpointError) as e:
            return f"the checkpoint of epoch {self.last_good_epoch} failed verification: {e}"
        return (f"the checkpoint {str(self.checkpoint_path)!r} of epoch {self.last_good_epoch} was "
                "verified (SHA-256) and is kept")
