"""The names of the files in a run folder and a job folder, defined once.

A run folder (one regime, one seed) holds::

    checkpoint.pt        the newest training state (model, optimizer, RNG, history)
    checkpoint.prev.pt   the state before it, kept while the newest is written
    best.pt              the model with the best validation perplexity so far
    results.json         the finished run's numbers, signed (see :mod:`rnndrop.lm.run.identity`)
    metrics.csv          one row per epoch
    curve.png            the run's learning curve
    run.lock             held while a process trains in the folder

A job folder (``rnndrop-lm ptb``: several regimes and seeds) holds the run folders
and ``summary.json``, ``results.md`` and ``learning_curves.png``.
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"
RESULTS = "results.json"
METRICS = "metrics.csv"
CURVE = "curve.png"
ALPHAS = "alphas.png"
LOCK = "run.lock"

#: What a run leaves besides its checkpoints: a folder holding any of these holds a run.
RUN_OUTPUTS = (BEST, RESULTS, METRICS, CURVE, ALPHAS)

SUMMARY = "summary.json"
RESULTS_TABLE = "results.md"
LEARNING_CURVES = "learning_curves.png"


def run_files(folder: str | Path) -> list[str]:
    """The names of the files a run wrote that are in ``folder`` (checkpoints included)."""
    folder = Path(folder)
    names = (CHECKPOINT, previous_path(CHECKPOINT).name, *RUN_OUTPUTS)
    return [name for name in names if (folder / name).exists()]


def has_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` holds a checkpoint to resume from (the newest or the previous one)."""
    path = Path(folder) / CHECKPOINT
    return path.exists() or previous_path(path).exists()


def previous_path(path: str | Path) -> Path:
    """Where a checkpoint's previous version is kept: ``checkpoint.pt`` -> ``checkpoint.prev.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")
