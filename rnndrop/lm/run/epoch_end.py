"""What an epoch of a training run leaves behind: the criterion its best epoch minimises,
``best.pt``, ``checkpoint.pt``, and the line that says why a stage stopped."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from rnndrop.distributed import check_parameters_agree
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.averaging import CHECKPOINT_KEY as AVERAGING_KEY
from rnndrop.lm.run.checkpoint import get_rng_state
from rnndrop.lm.run.checkpoint import save_checkpoint as write_checkpoint
from rnndrop.lm.run.evaluate import Score
from rnndrop.lm.run.process_group import all_gather_objects, run_on_main
from rnndrop.lm.run.schedule import LR_FLOOR
from rnndrop.lm.run.setup import ExtraLoss, Training

__all__ = ["save_best", "save_checkpoint", "selection_criterion", "stop_message"]


def selection_criterion(config: TrainConfig, valid: Score, extra_loss: ExtraLoss | None) -> float:
    """What the best epoch minimises: the validation perplexity, or (``select="objective"``)
    the validation NLL per word plus the extra loss at the end of training (full weight)."""
    if config.select == "perplexity":
        return valid.perplexity
    if extra_loss is None:
        return valid.nll
    with torch.no_grad():
        return valid.nll + float(extra_loss(1.0))


def save_best(run: Training, epoch: int, evaluated: nn.Module) -> None:
    """best.pt: the weights of ``epoch`` that were validated (``evaluated``: the model, or the
    average of NT-ASGD) with what rebuilds the model (:func:`rnndrop.lm.load_model`)."""
    best = {
        "model": evaluated.state_dict(), "epoch": epoch, "config": run.config.to_dict(),
        "regime": run.regime, "regime_settings": run.rules.settings(), "dropout": run.dropout,
        "vocab": list(run.corpus.vocab.itos), "identity": run.identity,
    }
    run_on_main(partial(write_checkpoint, best, run.best_path), run.ctx, "writing best.pt")


def save_checkpoint(run: Training) -> None:
    """checkpoint.pt: model, optimiser, progress, NT-ASGD's averaging state (when on) and every
    rank's RNG state (the one before it is kept as checkpoint.prev.pt until this one is verified)."""
    checkpoint = {"identity": run.identity, "model": run.model.state_dict(),
                  "optimizer": run.optimizer.state_dict(), "progress": run.state.to_dict(),
                  "rng": get_rng_state()}
    if run.averaging is not None:
        checkpoint[AVERAGING_KEY] = run.averaging.state_dict()
    if run.ctx.enabled:
        check_parameters_agree(run.model)
        checkpoint["distributed"] = {"world_size": run.ctx.world_size, "backend": run.ctx.backend,
                                     "rng": all_gather_objects(get_rng_state(), run.ctx)}
    run_on_main(partial(write_checkpoint, checkpoint, run.checkpoint_path, keep_previous=True), run.ctx,
                "writing checkpoint.pt")


def stop_message(run: Training, epoch: int, stop: str, next_lr: float) -> str:
    """Why the stage the run is in stopped after ``epoch``, in one line."""
    stage = "fine-tuning" if run.state.finetune_from is not None else "training"
    if stop == LR_FLOOR:
        return (f"{run.regime}: {stage} converged after epoch {epoch} (the next learning rate "
                f"{next_lr:g} is below min_lr {run.config.min_lr:g})")
    return (f"{run.regime}: {stage} converged after epoch {epoch} (the averaged weights' validation "
            f"perplexity has not improved for {run.config.nonmono} epochs)")
