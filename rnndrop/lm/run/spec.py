"""One run of a job: its picklable spec, and executing it (reuse a finished run, resume
an interrupted one, or train it; add the Monte-Carlo test perplexity to a chosen one).

:func:`execute` and :func:`execute_mc` are top-level so that worker processes can call them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rnndrop.lm.data.corpus import Corpus, load_corpus
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import checkpoint_damage
from rnndrop.lm.run.folder import BEST, RESULTS, has_checkpoint
from rnndrop.lm.run.identity import finished_result, run_identity
from rnndrop.lm.run.metrics import EpochLog
from rnndrop.lm.run.process_group import current, run_on_main
from rnndrop.lm.run.progress import EpochRelay, JobProgress
from rnndrop.lm.run.train import RunInterrupted, add_mc_result, train_run

__all__ = [
    "JobInterrupted", "RunSpec", "cached_corpus", "epochs_done", "execute", "execute_mc", "reusable_result",
    "worker_logging",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    """One run of the benchmark (picklable, for worker processes)."""

    data_dir: str
    dataset: str
    config: TrainConfig
    regime: str
    dropout: Mapping[str, float]
    seed: int
    folder: str
    mc_samples: int
    resume: bool
    device: str
    threads: int | None
    progress: bool = True
    #: how logs and progress name the run, e.g. ``"run 2/3 tied seed 1"``
    label: str = ""
    #: a finished run (folder or best.pt) whose weights the run starts from
    init_from: str | None = None


class JobInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the job; every finished epoch is in its run's checkpoint.

    Attributes:
        epoch: the epoch that was running (None when several runs were, or after the last one).
        folder: that run's folder (None when several runs were).
        label: that run's name in the job (``"run 2/3 tied ... seed 1"``).
        testing: it stopped after the run's last epoch, while its test split was scored.
    """

    def __init__(self, epoch: int | None, folder: str | None, label: str = "", testing: bool = False) -> None:
        super().__init__(epoch, folder, label, testing)
        self.epoch, self.folder, self.label, self.testing = epoch, folder, label, testing


@functools.lru_cache(maxsize=2)
def cached_corpus(data_dir: str) -> Corpus:
    """The corpus in ``data_dir``, read once per process (the command line checks it with
    this too, so a job reads its corpus once)."""
    return load_corpus(data_dir)


def reusable_result(spec: RunSpec) -> dict[str, Any] | None:
    """The verified results.json that ``--resume`` reuses instead of training ``spec``
    (:func:`rnndrop.lm.run.identity.finished_result`), or None."""
    if not (Path(spec.folder) / RESULTS).is_file():
        return None  # nothing to reuse: skip reading the corpus
    identity = run_identity(cached_corpus(spec.data_dir), spec.config, spec.regime, spec.dropout, spec.seed,
                            spec.init_from)  # a run started from other weights is another run
    return finished_result(spec.folder, identity, epochs=spec.config.epochs)


def epochs_done(folder: str | Path) -> int:
    """The epochs a run in ``folder`` resumes after: the last one ``metrics.csv`` holds, when
    a checkpoint is there to resume from (else 0). For estimates; resuming reads the checkpoint."""
    if not has_checkpoint(folder):
        return 0
    return max((row["epoch"] for row in EpochLog(folder, tensorboard=False).rows), default=0)


def _finished(spec: RunSpec) -> dict[str, Any] | None:
    result = reusable_result(spec)
    damage = checkpoint_damage(Path(spec.folder) / BEST) if result is not None else None
    if damage is not None:  # the numbers stand; say that the weights behind them are gone
        log.warning("%s: %s %s; its results are reused, but the trained weights are gone (evaluate, "
                    "generate and --init-from need them): to have them again, train the run anew "
                    "with another --out", spec.folder, BEST, damage)
    return result


def worker_logging(label: str) -> None:
    """Log lines of a worker process, each prefixed with the run it trains."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{label}] %(message)s", datefmt="%H:%M:%S",
                        force=True)


def execute(spec: RunSpec, progress: JobProgress | EpochRelay | None = None) -> dict[str, Any]:
    """Run (or reuse, or resume) one spec; top-level so worker processes can call it."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    ctx = current()
    if spec.resume:
        # Under torchrun rank 0 reads the folder and tells the others (who never touch it).
        done = run_on_main(functools.partial(_finished, spec), ctx, f"reading {spec.folder!r}")
        if done is not None:
            log.info("%s: finished earlier, reusing its results", spec.folder)
            done = _with_mc(spec, done)
            if progress is not None:
                progress.run_done(spec.label, done, reused=True)
            return done
    epoch_log = EpochLog(spec.folder) if ctx.is_main else None

    def on_epoch_end(epoch: int, record: Mapping[str, Any]) -> None:
        if epoch_log is not None:
            epoch_log(epoch, record)
        if progress is not None:
            progress.epoch_done(epoch, record)

    rows = epoch_log.rows if epoch_log is not None else []
    first = 1 + max((r["epoch"] for r in rows), default=0) if spec.resume else 1
    if progress is not None:
        progress.start_run(spec.label, first)
    try:
        result = train_run(
            cached_corpus(spec.data_dir), spec.config, spec.regime, spec.folder, dropout=spec.dropout,
            seed=spec.seed, resume=spec.resume, device=spec.device, mc_samples=spec.mc_samples,
            progress=spec.progress, dataset=spec.dataset, on_epoch_end=on_epoch_end,
            init_from=spec.init_from,
        )
    except KeyboardInterrupt as e:
        if isinstance(e, RunInterrupted) and e.epoch is None:  # not "epoch N + 1" of N epochs
            raise JobInterrupted(None, spec.folder, spec.label, testing=True) from None
        epoch = getattr(e, "epoch", None)
        if epoch is None:
            epoch = progress.next_epoch if progress is not None and progress.next_epoch else first
        raise JobInterrupted(epoch, spec.folder, spec.label) from None
    if epoch_log is not None:
        epoch_log.finish(result)
    if progress is not None:
        progress.run_done(spec.label, result)
    return result


def execute_mc(spec: RunSpec, progress: JobProgress | EpochRelay | None = None) -> dict[str, Any]:
    """Add the Monte-Carlo test perplexity to a finished run (the grid's chosen ones)."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    done = run_on_main(functools.partial(_finished, spec), current(), f"reading {spec.folder!r}")
    if done is None:
        done = {"test_ppl_mc": None, "mc_samples": 0}  # unreadable results: add_mc_result says why
    return _with_mc(spec, done)


def _with_mc(spec: RunSpec, done: dict[str, Any]) -> dict[str, Any]:
    """A finished run's result with the Monte-Carlo test perplexity of ``spec.mc_samples``
    samples: reused when it has it, added when it was made without it or with another count."""
    if spec.mc_samples == 0 or done.get("mc_samples") == spec.mc_samples:
        return done
    log.info("%s: Monte-Carlo test perplexity (%d samples)", spec.label or spec.folder, spec.mc_samples)
    return add_mc_result(cached_corpus(spec.data_dir), spec.config, spec.folder, spec.mc_samples, spec.device)
