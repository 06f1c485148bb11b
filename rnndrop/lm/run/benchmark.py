"""The language-model benchmark: train regimes, choose dropout on validation, report.

``rnndrop-lm ptb --data sample`` (:mod:`rnndrop.lm.cli`) trains each regime once with
the config's dropout probabilities; ``--grid`` first searches each regime's small
grid (``TrainConfig.grid``) with the first seed, keeps the candidate with the best
*validation* perplexity, trains it again with the other ``--seeds``, and adds the
Monte-Carlo test perplexity of the chosen runs. The test split plays no part in any
choice.

Outputs in ``--out``: one folder per run (checkpoint, best model, results.json,
metrics.csv, curve.png), ``results.md`` (tables, :func:`rnndrop.lm.run.tables.benchmark_markdown`),
``summary.json`` and ``learning_curves.png``. This module plans a job and writes its
summary; :mod:`rnndrop.lm.run.spec` runs one run, :mod:`rnndrop.lm.run.pool` runs
several at once. The command line is :mod:`rnndrop.lm.cli`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rnndrop.lm.atomic import atomic_write
from rnndrop.lm.model.regimes import get_regime, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.dropout_choice import chosen_dropout, format_tag, parse_dropout, run_tag
from rnndrop.lm.run.estimate import estimate_seconds
from rnndrop.lm.run.folder import LEARNING_CURVES, RESULTS_TABLE, SUMMARY
from rnndrop.lm.run.plots import plot_learning_curves
from rnndrop.lm.run.pool import run_all
from rnndrop.lm.run.process_group import current
from rnndrop.lm.run.progress import JobProgress, format_duration
from rnndrop.lm.run.result_file import write_json_atomic
from rnndrop.lm.run.spec import (
    JobInterrupted,
    RunSpec,
    cached_corpus,
    epochs_done,
    execute_mc,
    reusable_result,
)
from rnndrop.lm.run.tables import benchmark_markdown

__all__ = ["JobInterrupted", "RunSpec", "chosen_dropout", "parse_dropout", "run_benchmark"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    """What every run of a job shares; :meth:`spec` makes one run of it."""

    corpus_dir: str
    dataset: str
    config: TrainConfig
    out: Path
    resume: bool
    device: str
    threads: int | None
    #: per-epoch bars of the runs (only when one run trains at a time)
    progress: bool
    init_from: str | None

    def spec(self, regime: str, probabilities: Mapping[str, float], seed: int, mc_samples: int) -> RunSpec:
        p = regime_probabilities(get_regime(regime), probabilities)
        folder = self.out / regime / f"{run_tag(p)}-seed{seed}"
        return RunSpec(self.corpus_dir, self.dataset, self.config, regime, p, seed, str(folder), mc_samples,
                       self.resume, self.device, self.threads, self.progress, init_from=self.init_from)


@dataclass(frozen=True)
class _Plan:
    """The runs a job trains first (the grid's candidates, or every run without a grid),
    how many runs it trains in all, the (regime, dropout) of each (for the estimate) and
    the Monte-Carlo samples per run on average."""

    first: list[RunSpec]
    total: int
    planned: list[tuple[str, Mapping[str, float]]]
    mc_per_run: float


def _numbered(specs: list[RunSpec], first: int, total: int) -> list[RunSpec]:
    return [replace(s, label=f"run {first + i}/{total} {s.regime} ({format_tag(s.dropout)}) "
                    f"seed {s.seed}") for i, s in enumerate(specs)]


def _plan(
    job: _Job, regimes: Sequence[str], seeds: Sequence[int], mc: int, *, grid: bool,
    dropout: Mapping[str, float] | None, dropout_by_regime: Mapping[str, Mapping[str, float]] | None,
) -> _Plan:
    config = job.config
    if grid:
        candidates = [job.spec(r, p, seeds[0], 0)
                      for r in regimes for p in config.grid.get(r, (config.dropout,))]
        # One candidate per distinct effective setting (e.g. "none" ignores probabilities).
        candidates = list({c.folder: c for c in candidates}.values())
        total = len(candidates) + len(regimes) * (len(seeds) - 1)
        planned = [(c.regime, c.dropout) for c in candidates]
        planned += [(c.regime, c.dropout) for c in candidates[: len(regimes)]] * (len(seeds) - 1)
        return _Plan(candidates, total, planned, mc * len(regimes) * len(seeds) / max(1, total))
    default = config.dropout if dropout is None else dropout
    by_regime = dict(dropout_by_regime or {})
    finals = [job.spec(r, by_regime.get(r, default), s, mc) for r in regimes for s in seeds]
    return _Plan(finals, len(finals), [(f.regime, f.dropout) for f in finals], mc)


def _estimate(job: _Job, plan: _Plan, jobs: int) -> tuple[float, int] | None:
    """Log how long the job should take (:func:`estimate_seconds`); returns the seconds and
    the epochs they count (None when every run is reused).

    With ``--resume`` the runs it will reuse count nothing and a run under way counts the
    epochs it has not done yet (:func:`epochs_done`); the grid's later seeds, chosen after the
    grid, count whole."""
    corpus = cached_corpus(job.corpus_dir)
    epochs = job.config.epochs + job.config.finetune_epochs
    left: list[int | None] = [epochs] * len(plan.planned)  # None: reused
    if job.resume:
        for i, spec in enumerate(plan.first):
            left[i] = None if reusable_result(spec) is not None else max(0, epochs - epochs_done(spec.folder))
    to_train = [(run, n) for run, n in zip(plan.planned, left) if n is not None]
    n_reused = plan.total - len(to_train)
    reused = f" ({n_reused} more finished earlier: reused)" if n_reused else ""
    if not to_train:
        log.info("all %d run%s of this job finished earlier: reusing their results", plan.total,
                 "s" * (plan.total != 1))
        return None
    eta = estimate_seconds(corpus, job.config, [run for run, _ in to_train], round(plan.mc_per_run),
                           jobs=jobs, threads=job.threads, device=job.device,
                           epochs_left=[n for _, n in to_train])
    early = " if no run converges early" if job.config.min_lr > 0 else ""
    log.info("this job trains %d run%s%s of up to %d epochs on %s training words; at the speed "
             "measured on this machine just now it should take about %s%s%s. Ctrl-C stops it "
             "(finished epochs are kept; rerun with --resume)", len(to_train), "s" * (len(to_train) != 1),
             reused, epochs, f"{corpus.train.numel():,}", format_duration(eta),
             f" ({jobs} runs at a time)" if jobs > 1 else "", early)
    return eta, sum(n for _, n in to_train)


def _report_estimate(eta: float | None, seconds: float, progress: JobProgress) -> None:
    """Log how far the up-front estimate was from the time the job took (when it trained a
    run: the estimate counts what is left to train, see :func:`_estimate`)."""
    if eta is None or not progress.runs_trained:
        return
    off = 100 * (eta - seconds) / max(seconds, 1e-9)
    log.info("the job took %s; its estimate was %s (%.0f%% too %s)", format_duration(seconds),
             format_duration(eta), abs(off), "high" if off > 0 else "low")


def _run_grid(
    job: _Job, plan: _Plan, regimes: Sequence[str], seeds: Sequence[int], mc: int, jobs: int,
    progress: JobProgress,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The grid with the first seed, its choice (best validation perplexity) with the other
    seeds, then the Monte-Carlo test perplexity of the chosen runs; returns (final results,
    grid results)."""
    grid_results = run_all(_numbered(plan.first, 1, plan.total), jobs, progress)
    chosen: dict[str, dict[str, Any]] = {}
    for r in grid_results:
        best = chosen.get(r["regime"])
        if best is None or r["best_valid_ppl"] < best["best_valid_ppl"]:
            chosen[r["regime"]] = r
    more = [job.spec(r, chosen[r]["dropout"], s, 0) for r in regimes for s in seeds[1:]]
    run_all(_numbered(more, len(plan.first) + 1, plan.total), jobs, progress)
    finals = [job.spec(r, chosen[r]["dropout"], s, mc) for r in regimes for s in seeds]
    return run_all(finals, jobs, progress, execute_mc), grid_results


def _summary(
    job: _Job, regimes: Sequence[str], seeds: Sequence[int], grid: bool, command: str,
    final_results: list[dict[str, Any]], grid_results: list[dict[str, Any]],
) -> dict[str, Any]:
    """The job's summary; rank 0 writes results.md, learning_curves.png and summary.json."""
    markdown = benchmark_markdown(job.dataset, job.config.name, final_results, grid_results,
                                  command=command, grid_seed=seeds[0])
    first_seed = [r for r in final_results if r["seed"] == seeds[0]]
    main = current().is_main  # under torchrun rank 0 alone writes the job's files
    if main:
        with atomic_write(job.out / RESULTS_TABLE, "w", encoding="utf-8") as f:
            f.write(markdown)
    plot = plot_learning_curves(first_seed, job.out / LEARNING_CURVES) if main else None
    summary = {
        "dataset": job.dataset, "config": job.config.name, "regimes": list(regimes), "seeds": list(seeds),
        "grid": grid, "command": command,
        "runs": [{"regime": r["regime"], "dropout": r["dropout"], "seed": r["seed"],
                  "best_valid_ppl": r["best_valid_ppl"], "test_ppl": r["test_ppl"],
                  "test_ppl_mc": r["test_ppl_mc"], "words_per_second": r["words_per_second"]}
                 for r in final_results],
        "grid_runs": [{"regime": r["regime"], "dropout": r["dropout"], "seed": r["seed"],
                       "best_valid_ppl": r["best_valid_ppl"]} for r in grid_results],
        "markdown": markdown,
        "files": [RESULTS_TABLE, SUMMARY] + ([plot.name] if plot is not None else []),
    }
    if main:
        write_json_atomic(summary, job.out / SUMMARY)
    return summary


def run_benchmark(
    corpus_dir: str | Path,
    dataset: str,
    config: TrainConfig,
    regimes: Sequence[str],
    seeds: Sequence[int],
    out_dir: str | Path,
    *,
    grid: bool = False,
    dropout: Mapping[str, float] | None = None,
    dropout_by_regime: Mapping[str, Mapping[str, float]] | None = None,
    mc_samples: int | None = None,
    resume: bool = False,
    jobs: int = 1,
    threads: int | None = None,
    device: str = "auto",
    progress: bool = True,
    estimate: bool = False,
    command: str = "",
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """Run the benchmark and write its summary files; returns the summary.

    Args:
        grid: search ``config.grid[regime]`` (default: ``config.dropout`` alone) with
            ``seeds[0]``, choose on validation perplexity, then run the choice with
            the other seeds and add the Monte-Carlo test perplexity.
        dropout: without ``grid``: the probabilities of every regime (default
            ``config.dropout``).
        dropout_by_regime: without ``grid``: the probabilities of each regime, e.g. the
            ones a grid on another corpus chose (:func:`chosen_dropout`); overrides
            ``dropout`` for the regimes it names.
        progress: progress bars (one for the job, one per epoch) when one run trains at a
            time; log lines in any case.
        estimate: log up front how long the job should take (:func:`estimate_seconds`).
        init_from: a finished run (its folder or ``best.pt``) every run starts from, e.g.
            a dense ``tied`` run that regime ``sparse_vd`` fine-tunes.
    """
    if not regimes:
        raise ValueError("regimes must name at least one regime, got none")
    for r in regimes:
        get_regime(r)
    if not seeds:
        raise ValueError("seeds must name at least one seed, got none")
    mc = config.mc_samples if mc_samples is None else mc_samples
    job = _Job(str(corpus_dir), dataset, config, Path(out_dir), resume, device, threads,
               progress and jobs <= 1, None if init_from is None else str(init_from))
    plan = _plan(job, regimes, seeds, mc, grid=grid, dropout=dropout, dropout_by_regime=dropout_by_regime)
    eta, eta_epochs = (_estimate(job, plan, jobs) if estimate else None) or (None, None)
    job_progress = JobProgress(plan.total, config.epochs + config.finetune_epochs, bar=progress and jobs <= 1,
                               estimate_seconds=eta, estimate_epochs=eta_epochs)
    start = time.perf_counter()
    try:
        if grid:
            final_results, grid_results = _run_grid(job, plan, regimes, seeds, mc, jobs, job_progress)
        else:
            final_results = run_all(_numbered(plan.first, 1, plan.total), jobs, job_progress)
            grid_results = []
    finally:
        job_progress.close()
    _report_estimate(eta, time.perf_counter() - start, job_progress)
    return _summary(job, regimes, seeds, grid, command, final_results, grid_results)
