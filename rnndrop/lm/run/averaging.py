"""NT-ASGD and the fine-tuning stage in a training run (``TrainConfig.nt_asgd``,
``finetune_epochs``), on :class:`rnndrop.averaging.NTAveraging`.

A run with ``nt_asgd`` goes through up to three stages, one epoch loop each
(:func:`rnndrop.lm.run.train._train_epochs`):

1. **SGD.** The trained weights are validated after every epoch; when the validation
   perplexity has not improved for ``nonmono`` epochs (non-monotone trigger), averaging
   starts with the next step (``RunState.averaging_since`` is that epoch).
2. **Averaging.** The average of the weights after every step since the switch is what is
   validated, kept as best (``best.pt``) and tested. The stage ends at the epoch cap
   (``epochs``) or when the averaged validation perplexity fires the trigger in its turn
   (stop reason :data:`~rnndrop.lm.run.schedule.AVERAGE_CONVERGED`).
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rnndrop.averaging import NTAveraging
from rnndrop.lm.model.build import build_optimizer, trainable_parameters
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import CheckpointError, load_checkpoint, load_state
from rnndrop.lm.run.process_group import Distributed, run_on_main
from rnndrop.lm.run.schedule import AVERAGE_CONVERGED
from rnndrop.lm.run.state import RunState

__all__ = ["CHECKPOINT_KEY", "RunAveraging"]

log = logging.getLogger(__name__)

#: Where the checkpoint keeps :meth:`RunAveraging.state_dict`.
CHECKPOINT_KEY = "averaging"


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
        best = run_on_main(lambda: load_checkpoint(best_path)["model"], ctx, "reading best.pt")
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
