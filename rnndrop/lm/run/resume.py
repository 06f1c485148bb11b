"""Where a run starts from: its own checkpoint (resume), another run's weights
(``init_from``), or its initialisation; every check done before training."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import load_checkpoint, load_latest
from rnndrop.lm.run.folder import BEST, CHECKPOINT, has_checkpoint, run_files
from rnndrop.lm.run.identity import best_file, file_sha256, identity_differences
from rnndrop.lm.run.process_group import Distributed
from rnndrop.lm.run.state import RunState

__all__ = ["load_initial_weights", "read_checkpoint"]

log = logging.getLogger(__name__)


def read_checkpoint(
    out: Path, identity: dict[str, Any], config: TrainConfig, model: nn.Module, *, resume: bool,
    init_from: str | Path | None, vocab: Sequence[str], ctx: Distributed,
) -> tuple[dict[str, Any] | None, RunState | None, dict[str, Any] | None]:
    """(the checkpoint in ``out`` to resume from and its verified progress, or None, None;
    what ``init_from`` loaded into ``model``, or None), every check done: a checkpoint there
    needs ``resume``, belongs to this run, has not trained past the epoch cap, was written
    by as many processes, and its ``best.pt`` verifies."""
    ckpt_path, best_path = out / CHECKPOINT, out / BEST
    resumable = has_checkpoint(out)
    if resumable and not resume:
        raise FileExistsError(
            f"{str(out)!r} already holds a checkpoint; pass resume=True (--resume) to "
            "continue that run, or choose another output folder"
        )
    if not resumable:
        _refuse_to_overwrite(out, identity, resume)
    ckpt = load_latest(ckpt_path) if resumable else None
    if ckpt is None:
        return None, None, None if init_from is None else load_initial_weights(model, init_from, vocab)
    differences = identity_differences(identity, ckpt.get("identity", {}))
    if differences:
        raise ValueError(
            f"the checkpoint in {str(out)!r} belongs to another run; what differs (this "
            f"call vs the checkpoint): {'; '.join(differences)}. Choose another output folder"
        )
    state = RunState.from_dict(ckpt.get("progress"), f"the checkpoint in {str(out)!r}")
    trained = state.epoch if state.finetune_from is None else state.finetune_from  # fine-tuning aside
    if trained > config.epochs:
        raise ValueError(
            f"epochs must be >= {trained}, the epochs the run in {str(out)!r} "
            f"has already trained, got {config.epochs} (the epoch cap of a run may grow, not shrink)"
        )
    world_size = int(ckpt.get("distributed", {}).get("world_size", 1))
    if world_size != ctx.world_size:
        raise ValueError(
            f"the checkpoint in {str(out)!r} was written by {world_size} "
            f"process(es); resume it with as many (torchrun --nproc_per_node), got {ctx.world_size}"
        )
    if state.best_epoch:
        load_checkpoint(best_path)  # verify it now rather than after training
    return ckpt, state, None


def _refuse_to_overwrite(out: Path, identity: dict[str, Any], resume: bool) -> None:
    """A folder without a checkpoint may still hold a run (its checkpoints deleted to free
    disk, or another run's): training there would overwrite it, so refuse. The one folder
    let through is this very run stopped between its first ``best.pt`` and its first
    checkpoint, with ``resume``: it starts again."""
    present = run_files(out)
    if not present:
        return
    best_identity = load_checkpoint(out / BEST).get("identity", {}) if present == [BEST] else None
    if resume and best_identity is not None and not identity_differences(identity, best_identity):
        log.warning("%s holds this run's best.pt but no checkpoint (stopped while writing its first "
                    "one): starting the run again", out)
        return
    raise FileExistsError(
        f"{str(out)!r} holds files of a run ({', '.join(present)}) but no checkpoint to continue "
        "it from; nothing there is overwritten: choose another output folder"
    )


def load_initial_weights(model: nn.Module, init_from: str | Path, vocab: Sequence[str]) -> dict[str, Any]:
    """Copy into ``model`` every tensor of another run's best.pt that it has (same name and
    shape); the others keep their initialisation. Returns what was loaded, for the results.
    That run's vocabulary must be ``vocab`` word for word: its embedding and decoder rows
    belong to its words, in its order."""
    best = best_file(init_from)
    checkpoint = load_checkpoint(best)
    _check_same_vocabulary(best, checkpoint.get("vocab"), vocab)
    source = checkpoint["model"]
    own = model.state_dict()
    mismatched = [f"{k}: {list(v.shape)} there vs {list(own[k].shape)} here"
                  for k, v in source.items() if k in own and v.shape != own[k].shape]
    if mismatched:
        raise ValueError(f"init_from {str(best)!r}: tensors of other shapes: {'; '.join(mismatched)}")
    loaded = sorted(k for k in source if k in own)
    kept = sorted(k for k in own if k not in source)
    ignored = sorted(k for k in source if k not in own)
    model.load_state_dict({k: source[k] for k in loaded}, strict=False)
    log.info("init_from %s: loaded %d tensors (%s); kept the initialisation of %s; ignored %s",
             best, len(loaded), ", ".join(loaded), ", ".join(kept) or "none", ", ".join(ignored) or "none")
    return {"path": str(best), "sha256": file_sha256(best), "loaded": loaded, "kept_init": kept,
            "ignored": ignored}


def _check_same_vocabulary(best: Path, theirs: Sequence[str] | None, ours: Sequence[str]) -> None:
    if theirs is None or list(theirs) == list(ours):
        return
    if sorted(theirs) == sorted(ours):
        what = "the same words in another order"
    else:
        what = f"{len(set(theirs) ^ set(ours))} words that only one of them has"
    raise ValueError(
        f"init_from {str(best)!r}: its vocabulary is not this corpus' ({what}), so its embedding and "
        "decoder rows would belong to other words; start from a run trained on this corpus"
    )
