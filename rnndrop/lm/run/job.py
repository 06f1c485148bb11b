"""A job of runs: the language-model benchmark, planned, run (here or in worker processes),
timed in advance and summarised.

``rnndrop-lm ptb --data sample`` (:mod:`rnndrop.lm.cli`) trains each regime once with
the config's dropout probabilities; ``--grid`` first searches each regime's small
grid (``TrainConfig.grid``) with the first seed, keeps the candidate with the best
*validation* perplexity, trains it again with the other ``--seeds``, and adds the
Monte-Carlo test perplexity of the chosen runs. The test split plays no part in any
choice; a grid's choices carried to another corpus (``--dropout-from``) are refused where
the grid's validation lines are in that corpus' test split (:func:`tuning_fingerprints`,
:mod:`rnndrop.lm.data.overlap`).

Outputs in ``--out``: one folder per run (checkpoint, best model, results.json,
metrics.csv, curve.png), ``results.md`` (tables, :func:`rnndrop.lm.run.report.benchmark_markdown`),
``summary.json`` and ``learning_curves.png``.

In this module, in order: the job (:func:`run_benchmark`: plan, estimate, run, summary);
one run of it (:class:`RunSpec`, :func:`execute`: reuse a finished run, resume an
interrupted one, or train it with :func:`rnndrop.lm.run.train.train_run`); several runs at
once in worker processes (:func:`run_all`, ``--jobs N``: Ctrl-C reaches the main process
alone, which stops the workers); how long a job should take (:func:`estimate_seconds`);
and which dropout a run gets, as text (``--dropout``, ``--dropout-from``, run folder names).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import shlex
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rnndrop.atomic import atomic_write
from rnndrop.lm.data.corpus import Corpus, CorpusError, batchify, cached_corpus, sample_dir
from rnndrop.lm.data.overlap import split_fingerprints
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.regimes import SITES, get_regime, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import (
    BEST,
    CHECKPOINT,
    LEARNING_CURVES,
    METRICS,
    RESULTS,
    RESULTS_TABLE,
    SUMMARY,
    CheckpointError,
    JobLock,
    ResultsError,
    best_of_another_run,
    file_sha256,
    files_on_main,
    finished_result,
    has_checkpoint,
    identity_differences,
    load_latest,
    read_verified_result,
    run_identity,
    text_sha256,
    write_json_atomic,
)
from rnndrop.lm.run.evaluate import CALIBRATION_BINS, has_noise, score_sums
from rnndrop.lm.run.process_group import current
from rnndrop.lm.run.report import (
    EpochLog,
    EpochRelay,
    JobProgress,
    RunCost,
    benchmark_markdown,
    format_duration,
    metrics_text,
    plot_learning_curves,
    relay_events,
)
from rnndrop.lm.run.train import RunInterrupted, add_mc_result, resolve_device, train_run
from rnndrop.mc import mc_language_model_loss

__all__ = [
    "RUN_OVERHEAD_SECONDS",
    "JobInterrupted",
    "RunSpec",
    "WorkerDied",
    "chosen_dropout",
    "epochs_done",
    "estimate_seconds",
    "execute",
    "execute_mc",
    "format_tag",
    "parse_dropout",
    "reusable_result",
    "run_all",
    "run_benchmark",
    "run_costs",
    "run_tag",
    "worker_logging",
]

log = logging.getLogger(__name__)


# -- the job ---------------------------------------------------------------------------------------

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
    #: train under torch.compile (rnndrop.compile_model); None: where it is faster
    compile: bool | None = None

    def spec(self, regime: str, probabilities: Mapping[str, float], seed: int, mc_samples: int) -> RunSpec:
        p = regime_probabilities(get_regime(regime), probabilities)
        folder = self.out / regime / f"{run_tag(p)}-seed{seed}"
        return RunSpec(self.corpus_dir, self.dataset, self.config, regime, p, seed, str(folder), mc_samples,
                       self.resume, self.device, self.threads, self.progress, init_from=self.init_from,
                       compile=self.compile)


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
        # the later seeds, numbered as _run_grid numbers them (their dropout is chosen later:
        # the first candidate of the regime stands in for it)
        first_of = {c.regime: (c.regime, c.dropout) for c in reversed(candidates)}
        planned += [first_of[r] for r in regimes for _ in seeds[1:]]
        return _Plan(candidates, total, planned, mc * len(regimes) * len(seeds) / max(1, total))
    default = config.dropout if dropout is None else dropout
    by_regime = dict(dropout_by_regime or {})
    finals = [job.spec(r, by_regime.get(r, default), s, mc) for r in regimes for s in seeds]
    return _Plan(finals, len(finals), [(f.regime, f.dropout) for f in finals], mc)


def _estimate(job: _Job, plan: _Plan) -> list[RunCost | None] | None:
    """What each run of the job should cost at the speed timed on this machine just now
    (:func:`run_costs`), in run order; None for a run it will reuse, and None in all when
    every run is reused (said in a log line).

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
    if not to_train:
        log.info("all %d run%s of this job finished earlier: reusing their results", plan.total,
                 "s" * (plan.total != 1))
        return None
    costs = iter(run_costs(corpus, job.config, [run for run, _ in to_train], round(plan.mc_per_run),
                           threads=job.threads, device=job.device, epochs_left=[n for _, n in to_train]))
    return [None if n is None else next(costs) for n in left]


def _announce(job: _Job, progress: JobProgress, jobs: int) -> float | None:
    """Log how long the job should take: :meth:`JobProgress.eta_seconds` before it starts,
    the number its bar starts from (returns it)."""
    eta = progress.eta_seconds()
    if eta is None:
        return None
    corpus = cached_corpus(job.corpus_dir)
    n_runs = len(progress.pending)
    n_reused = progress.total_runs - n_runs
    reused = f" ({n_reused} more finished earlier: reused)" if n_reused else ""
    cap = job.config.epochs + job.config.finetune_epochs
    left = progress.remaining_epochs()
    epochs = (f"{left} epoch{'s' * (left != 1)} in all" if left == n_runs * cap
              else f"{left} epoch{'s' * (left != 1)} left in all")
    early = "; less if runs stop early at the learning-rate floor" if job.config.min_lr > 0 else ""
    log.info("this job trains %d run%s%s, %s at most (up to %d a run), on %s training words; at the "
             "speed timed on this machine just now it should take about %s%s%s. The bar's ETA starts "
             "from this and follows the measured speed from the first epoch on. Ctrl-C stops it "
             "(finished epochs are kept; rerun with --resume)", n_runs, "s" * (n_runs != 1), reused,
             epochs, cap, f"{corpus.train.numel():,}", format_duration(eta),
             f" ({jobs} runs at a time)" if jobs > 1 else "", early)
    return eta


def _report_estimate(eta: float | None, seconds: float, progress: JobProgress) -> None:
    """Log how far the up-front estimate was from the time the job took (when it trained a
    run: the estimate counts what is left to train, see :func:`_estimate`)."""
    if eta is None or not progress.runs_trained:
        return
    off = 100 * (eta - seconds) / max(seconds, 1e-9)
    log.info("the job took %s; its estimate was %s (%.0f%% too %s)", format_duration(seconds),
             format_duration(eta), abs(off), "high" if off > 0 else "low")


def _chosen_by_validation(grid_results: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each regime's grid run of the best validation perplexity (the first of equals); the test
    split plays no part in the choice."""
    chosen: dict[str, Mapping[str, Any]] = {}
    for r in grid_results:
        best = chosen.get(r["regime"])
        if best is None or r["best_valid_ppl"] < best["best_valid_ppl"]:
            chosen[r["regime"]] = r
    return chosen


def _run_grid(
    job: _Job, plan: _Plan, regimes: Sequence[str], seeds: Sequence[int], mc: int, jobs: int,
    progress: JobProgress,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The grid with the first seed, its choice (best validation perplexity) with the other
    seeds, then the Monte-Carlo test perplexity of the chosen runs; returns (final results,
    grid results)."""
    grid_results = run_all(_numbered(plan.first, 1, plan.total), jobs, progress)
    chosen = _chosen_by_validation(grid_results)
    more = [job.spec(r, chosen[r]["dropout"], s, 0) for r in regimes for s in seeds[1:]]
    run_all(_numbered(more, len(plan.first) + 1, plan.total), jobs, progress)
    finals = [job.spec(r, chosen[r]["dropout"], s, mc) for r in regimes for s in seeds]
    return run_all(finals, jobs, progress, execute_mc), grid_results


def _summary(
    job: _Job, regimes: Sequence[str], seeds: Sequence[int], grid: bool, command: str,
    final_results: list[dict[str, Any]], grid_results: list[dict[str, Any]],
) -> dict[str, Any]:
    """The job's summary; rank 0 writes results.md, learning_curves.png and summary.json. It
    covers every finished run the folder holds: this job's, and those of earlier jobs in it
    that this one did not run (``--resume`` with fewer ``--regimes`` or ``--seeds``)."""
    more_final, more_grid = files_on_main(
        functools.partial(_other_runs, job, [*final_results, *grid_results]), current(),
        "reading the other runs of the output folder")
    final_results, grid_results = [*final_results, *more_final], [*grid_results, *more_grid]
    regimes = list(dict.fromkeys([*regimes, *(r["regime"] for r in final_results)]))
    seeds = list(dict.fromkeys([*seeds, *sorted(r["seed"] for r in final_results)]))
    markdown = benchmark_markdown(job.dataset, job.config.name, final_results, grid_results,
                                  command=command, grid_seed=seeds[0])
    first_seed = _one_seed_each(final_results, seeds[0])

    def write_files() -> Path | None:
        with atomic_write(job.out / RESULTS_TABLE, "w", encoding="utf-8") as f:
            f.write(markdown)
        return plot_learning_curves(first_seed, job.out / LEARNING_CURVES)

    ctx = current()
    plot = files_on_main(write_files, ctx, "writing results.md")
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
    if grid:  # what the choices were made on, for --dropout-from's check against a test split
        summary["tuned_on"] = files_on_main(functools.partial(_tuned_on, job.corpus_dir), ctx,
                                            "reading the validation split")
    files_on_main(functools.partial(write_json_atomic, summary, job.out / SUMMARY), ctx,
                  "writing summary.json")
    return summary


def _tuned_on(corpus_dir: str) -> dict[str, Any]:
    return {"data": corpus_dir, "valid_lines": sorted(split_fingerprints(corpus_dir, "valid"))}


def _run_key(result: Mapping[str, Any]) -> str:
    return json.dumps([result["regime"], result["dropout"], result["seed"]], sort_keys=True)


def _finished_runs(job: _Job, *, warn: bool) -> Iterator[tuple[Path, str, dict[str, Any]]]:
    """``(path, run key, result)`` of every finished run in the job's folder trained on its corpus,
    read from a verified results.json naming its regime, dropout and seed; the others are skipped
    (``warn``: saying so, as the report leaves them out)."""
    for path in sorted(job.out.glob(f"*/*/{RESULTS}")):
        try:
            result = read_verified_result(path)
            key = _run_key(result)
        except (ResultsError, KeyError, TypeError) as e:
            if warn:
                log.warning("%s; it is left out of the job's report", e)
            continue
        if result.get("dataset") == job.dataset:
            yield path, key, result


def _other_runs(
    job: _Job, results: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The finished runs in the job's folder that ``results`` (this job's) do not cover, as
    (final runs, grid candidates): an earlier job's, read from their verified results.json; the
    previous summary.json says which were grid candidates."""
    ours = {_run_key(r) for r in results}
    try:
        previous = json.loads((job.out / SUMMARY).read_text(encoding="utf-8"))
        grid_keys = {_run_key(r) for r in previous.get("grid_runs", [])}
        final_keys = {_run_key(r) for r in previous.get("runs", [])}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        grid_keys, final_keys = set(), set()
    finals: list[dict[str, Any]] = []
    grids: list[dict[str, Any]] = []
    for _, key, result in _finished_runs(job, warn=True):
        if key in ours:
            continue
        if key in grid_keys:
            grids.append(result)
        if key in final_keys or key not in grid_keys:
            finals.append(result)
    if finals or grids:
        log.info("the report also covers %d earlier run%s of %s", len(finals) + len(grids),
                 "s" * (len(finals) + len(grids) != 1), job.out)
    return finals, grids


#: How to bring a run of another epoch cap to this job's: the job continues the runs it names.
_CONTINUE_IT = " (or name its regime and seed in --regimes and --seeds: this job then continues it)"


def _refuse_runs_of_other_settings(job: _Job, regimes: Sequence[str], seeds: Sequence[int]) -> None:
    """Refuse, before anything trains, a folder holding finished runs trained otherwise than this
    job trains (another config but for the dropout and seed, corpus, starting weights; and, for a
    run this job does not continue, another epoch cap): the folder's report puts every run of a
    regime and dropout in one row, mean and sd over its seeds, which would then mix settings. A
    run this job continues would be refused anyway, but only when the job reached it."""
    corpus = cached_corpus(job.corpus_dir)
    for path, _, result in _finished_runs(job, warn=False):  # the report warns of the others
        try:
            ours = run_identity(corpus, job.config, result["regime"], result["dropout"], result["seed"],
                                job.init_from)
        except (ValueError, TypeError):  # a regime (or site) this version does not know
            continue
        differences = [d for d in identity_differences(ours, result.get("identity", {}))
                       if not d.startswith("regime_settings")]  # a regime's description may change
        continued = result["regime"] in regimes and result["seed"] in seeds
        cap = result.get("config", {}).get("epochs")
        if not continued and cap != job.config.epochs:
            differences.append(f"epochs: {job.config.epochs!r} here vs {cap!r} there")
        if differences:
            run = path.parent.relative_to(job.out)
            raise ValueError(
                f"the run {str(run)!r} in {str(job.out)!r} was trained with other settings than this job's "
                f"({'; '.join(differences[:4])}{'; ...' if len(differences) > 4 else ''}), and the folder's "
                "report would average them with this job's runs: resume with the settings it was trained "
                f"with{_CONTINUE_IT if cap != job.config.epochs else ''}, or train into another --out")


def _one_seed_each(results: Sequence[Mapping[str, Any]], seed: int) -> list[Mapping[str, Any]]:
    """One run of each (regime, dropout): the one of ``seed``, else the one of the lowest seed."""
    chosen: dict[str, Mapping[str, Any]] = {}
    for r in results:
        key = json.dumps([r["regime"], r["dropout"]], sort_keys=True)
        best = chosen.get(key)
        if best is None or (best["seed"] != seed and (r["seed"] == seed or r["seed"] < best["seed"])):
            chosen[key] = r
    return list(chosen.values())


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
    compile: bool | None = None,
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
        estimate: log up front how long the job should take (:func:`run_costs`); the
            bar's ETA starts from the same number, then follows the measured speed.
        init_from: a finished run (its folder or ``best.pt``) every run starts from, e.g.
            a dense ``tied`` run that regime ``sparse_vd`` fine-tunes.
        compile: train every run under torch.compile (True), eagerly (False), or (None) where
            it is faster (``train_run(compile=None)``).
    """
    if not regimes:
        raise ValueError("regimes must name at least one regime, got none")
    for r in regimes:
        get_regime(r)
    if not seeds:
        raise ValueError("seeds must name at least one seed, got none")
    mc = config.mc_samples if mc_samples is None else mc_samples
    job = _Job(str(corpus_dir), dataset, config, Path(out_dir), resume, device, threads,
               progress and jobs <= 1, None if init_from is None else str(init_from), compile)
    with ExitStack() as claim:  # one job per folder (the command line took it already: re-entrant)
        files_on_main(functools.partial(_claim, job.out, claim), current(),
                      f"taking the output folder {str(job.out)!r}")
        return _run_job(job, regimes, seeds, mc, grid=grid, dropout=dropout,
                        dropout_by_regime=dropout_by_regime, jobs=jobs, progress=progress,
                        estimate=estimate, command=command)


def _claim(out: Path, claim: ExitStack) -> None:
    out.mkdir(parents=True, exist_ok=True)
    claim.enter_context(JobLock(out))


def _run_job(
    job: _Job, regimes: Sequence[str], seeds: Sequence[int], mc: int, *, grid: bool,
    dropout: Mapping[str, float] | None, dropout_by_regime: Mapping[str, Mapping[str, float]] | None,
    jobs: int, progress: bool, estimate: bool, command: str,
) -> dict[str, Any]:
    config = job.config
    plan = _plan(job, regimes, seeds, mc, grid=grid, dropout=dropout, dropout_by_regime=dropout_by_regime)
    if job.resume:
        files_on_main(functools.partial(_refuse_runs_of_other_settings, job, regimes, seeds), current(),
                      "reading the finished runs of the output folder")
    costs = _estimate(job, plan) if estimate else None
    job_progress = JobProgress(plan.total, config.epochs + config.finetune_epochs, bar=progress and jobs <= 1,
                               costs=costs, jobs=jobs)
    eta = _announce(job, job_progress, jobs)
    start = job_progress.start
    try:
        if grid:
            final_results, grid_results = _run_grid(job, plan, regimes, seeds, mc, jobs, job_progress)
        else:
            specs = _numbered(plan.first, 1, plan.total)
            if jobs <= 1:  # one run after the other, in this process
                final_results = [execute(spec, job_progress) for spec in specs]
            else:
                final_results = run_all(specs, jobs, job_progress)
            grid_results = []
    finally:
        job_progress.close()
    _report_estimate(eta, time.perf_counter() - start, job_progress)
    return _summary(job, regimes, seeds, grid, command, final_results, grid_results)


# -- one run of a job ------------------------------------------------------------------------------

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
    #: train under torch.compile (rnndrop.compile_model); None: where it is faster
    compile: bool | None = None


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


def reusable_result(spec: RunSpec) -> dict[str, Any] | None:
    """The verified results.json that ``--resume`` reuses instead of training ``spec``
    (:func:`rnndrop.lm.run.checkpoint.finished_result`), or None."""
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
    if result is None:
        return None
    damage = best_of_another_run(Path(spec.folder) / BEST, result["identity"])
    if damage is not None and damage.startswith("belongs to another run"):
        log.warning("%s: %s %s; its results are reused (results.json is this run's), but the weights "
                    "there are not this run's: evaluate and generate refuse them. Put back this run's "
                    "own best.pt, or train the run anew with another --out", spec.folder, BEST, damage)
    elif damage is not None:  # the numbers stand; say that the weights behind them are gone
        log.warning("%s: %s %s; its results are reused, but the trained weights are gone (evaluate, "
                    "generate and --init-from need them): to have them again, train the run anew "
                    "with another --out", spec.folder, BEST, damage)
    _check_metrics(Path(spec.folder), result)
    return result


def _check_metrics(folder: Path, result: Mapping[str, Any]) -> None:
    """Make a finished run's metrics.csv the one its results imply: a deleted one is written
    again from them, one changed after the run wrote it (its SHA-256 is not the one results.json
    records) is set aside as ``metrics.edited.csv`` and written again, with a warning."""
    path = folder / METRICS
    expected = metrics_text(result["epochs"])
    recorded = (result.get("files") or {}).get(METRICS) or text_sha256(expected)
    if path.is_file():
        try:
            if file_sha256(path) == recorded:
                return
        except OSError:
            pass
        edited = path.with_name("metrics.edited.csv")
        os.replace(path, edited)
        log.warning("%s: %s was changed after the run wrote it (its SHA-256 is not the one %s records); "
                    "kept it as %s and wrote the run's own metrics again", folder, METRICS, RESULTS,
                    edited.name)
    else:
        log.info("%s: %s was missing; wrote it again from the run's %s", folder, METRICS, RESULTS)
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(expected)


def _restore_metrics(folder: Path) -> None:
    """A run to resume whose metrics.csv is gone gets it back from its checkpoint's history
    (else it would hold only the epochs trained from now on until the run finishes)."""
    if (folder / METRICS).exists() or not has_checkpoint(folder):
        return
    try:
        history = (load_latest(folder / CHECKPOINT) or {}).get("progress", {}).get("history")
        text = metrics_text(history)
    except (CheckpointError, OSError, KeyError, TypeError, AttributeError):
        return  # resuming says what is wrong with the checkpoint
    with atomic_write(folder / METRICS, "w", encoding="utf-8") as f:
        f.write(text)
    log.info("%s: %s was missing; wrote it again from the checkpoint's history", folder, METRICS)


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
        done = files_on_main(functools.partial(_finished, spec), ctx, f"reading {spec.folder!r}")
        if done is not None:
            log.info("%s: finished earlier, reusing its results", spec.folder)
            done = _with_mc(spec, done)
            if progress is not None:
                progress.run_done(spec.label, done, reused=True)
            return done
    if spec.resume and ctx.is_main:
        _restore_metrics(Path(spec.folder))
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
            init_from=spec.init_from, compile=spec.compile,
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
    done = files_on_main(functools.partial(_finished, spec), current(), f"reading {spec.folder!r}")
    if done is None:
        done = {"test_ppl_mc": None, "mc_samples": 0}  # unreadable results: add_mc_result says why
    return _with_mc(spec, done)


def _with_mc(spec: RunSpec, done: dict[str, Any]) -> dict[str, Any]:
    """A finished run's result with the Monte-Carlo test perplexity of ``spec.mc_samples``
    samples: reused when it has it, added when it was made without it or with another count."""
    if spec.mc_samples == 0 or done.get("mc_samples") == spec.mc_samples:
        return done
    return add_mc_result(cached_corpus(spec.data_dir), spec.config, spec.folder, spec.mc_samples, spec.device,
                         label=spec.label or spec.folder)



# -- several runs at once, in worker processes (--jobs N) ------------------------------------------

class WorkerDied(RuntimeError):
    """A worker process of ``--jobs`` ended without a result (killed, out of memory)."""

    def __init__(self, label: str) -> None:
        super().__init__(
            f"a worker process died while it ran {label} (killed, or out of memory); every finished "
            "epoch is saved: run the same command with --resume to continue"
        )


#: in a worker process: the queue its runs report their epochs on (see :class:`EpochRelay`)
_events: Any = None


def _worker_init(events: Any) -> None:
    """Workers leave Ctrl-C to the main process, which stops them with SIGTERM; SIGTERM then
    unwinds the worker's run, so its run folder's lock is released and no half-written
    file is left (checkpoints are atomic either way). Their runs report to ``events``. A
    worker whose main process dies without stopping it (kill -9) sends itself SIGTERM: it
    would otherwise wait for work forever."""
    global _events
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _events = events
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_end_with_parent, args=(parent.sentinel,), daemon=True,
                         name="rnndrop-parent-watch").start()


def _end_with_parent(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # ready once the main process is gone
    os.kill(os.getpid(), signal.SIGTERM)


class _Terminated(BaseException):
    """SIGTERM in a worker: unwinds the run (its lock released), then the worker ends."""


_running = False  # whether this worker is inside a run (SIGTERM unwinds it) or waiting for one


def _exit_on_sigterm(signum: int, frame: object) -> None:
    if not _running:
        os._exit(128 + signal.SIGTERM)  # between runs: nothing to unwind
    raise _Terminated


def _in_worker(fn: Callable[[RunSpec, Any], dict[str, Any]], spec: RunSpec) -> dict[str, Any]:
    global _running
    _running = True
    worker_logging(spec.label)
    try:
        return fn(spec, EpochRelay(_events))
    except _Terminated:
        os._exit(128 + signal.SIGTERM)  # unwound: the run folder is released; nothing to report
    finally:
        _running = False


def run_all(
    specs: Sequence[RunSpec], jobs: int, progress: JobProgress | None,
    fn: Callable[[RunSpec, JobProgress | None], dict[str, Any]] = execute,
) -> list[dict[str, Any]]:
    """``fn`` on every spec, ``jobs`` at a time; the results in the order of ``specs``.
    Ctrl-C stops every worker and raises :class:`JobInterrupted`."""
    if jobs <= 1 or len(specs) <= 1:
        return [fn(s, progress) for s in specs]
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=context,
                               initializer=_worker_init, initargs=(events,))
    try:
        # Workers start while SIGINT is ignored, and keep ignoring it (the disposition is
        # inherited): a Ctrl-C at the terminal reaches the main process alone, which stops them.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            futures = {pool.submit(_in_worker, fn, s): i for i, s in enumerate(specs)}
        finally:
            signal.signal(signal.SIGINT, previous)
        results: dict[int, dict[str, Any]] = {}
        pending, reused = set(futures), set()
        while pending:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            if progress is not None:
                relay_events(events, progress, reused)
            for future in done:
                i = futures[future]
                try:
                    results[i] = future.result()
                except BrokenProcessPool:
                    raise WorkerDied(specs[i].label or specs[i].folder) from None
                if progress is not None and fn is execute:
                    progress.run_done(specs[i].label, results[i], reused=specs[i].label in reused)
        return [results[i] for i in range(len(specs))]
    except KeyboardInterrupt:
        _stop(pool)
        raise JobInterrupted(None, None) from None
    except BaseException:
        _stop(pool)
        raise
    finally:
        pool.shutdown(wait=True)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the running workers (checkpoints are atomic)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()


# -- how long a job should take on this machine, from a few timed steps ----------------------------

def estimate_seconds(
    corpus: Corpus, config: TrainConfig, runs: Sequence[tuple[str, Mapping[str, float]]],
    mc_samples: int, *, jobs: int = 1, threads: int | None = None, device: str = "auto",
    epochs_left: Sequence[int] | None = None,
) -> float:
    """Wall seconds a job of ``runs`` (regime, dropout) should take on this machine if no run
    stops early: the sum of :func:`run_costs`, shared by ``jobs`` runs at a time."""
    costs = run_costs(corpus, config, runs, mc_samples, threads=threads, device=device,
                      epochs_left=epochs_left)
    return sum(c.seconds() for c in costs) / max(1, min(jobs, len(runs)))


def run_costs(
    corpus: Corpus, config: TrainConfig, runs: Sequence[tuple[str, Mapping[str, float]]],
    mc_samples: int, *, threads: int | None = None, device: str = "auto",
    epochs_left: Sequence[int] | None = None,
) -> list[RunCost]:
    """What each of ``runs`` (regime, dropout) should cost on this machine (the prior of
    :class:`rnndrop.lm.run.report.JobProgress`).

    Times, on the corpus's first batches, with the code the job runs: a training step
    (clipping included), a validation pass, a test pass (with the calibration bins) and a
    Monte-Carlo pass of each distinct regime, each repeated until it has run a few tenths
    of a second (the median counts: a busy moment of a shared machine does not), then scales
    them to ``config.epochs`` (plus ``finetune_epochs``) epochs of the training split and a
    validation pass per epoch, and a test pass and ``mc_samples`` Monte-Carlo passes per run,
    plus the checkpoint writes of an epoch and :data:`RUN_OVERHEAD_SECONDS` a run.
    ``epochs_left`` (one per run) counts fewer epochs for runs that resume part-way.
    """
    if epochs_left is not None and len(epochs_left) != len(runs):
        raise ValueError(f"epochs_left: expected one count per run ({len(runs)}), got {len(epochs_left)}")
    device_obj = resolve_device(device)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    rng = torch.get_rng_state()
    cost: dict[str, tuple[float, float, float, float]] = {}
    saves: dict[str, float] = {}
    try:
        train = batchify(corpus.train, config.batch_size, split="the train split")[: config.bptt + 1]
        valid = batchify(corpus.valid, config.eval_batch_size, split="the valid split",
                         size_name="eval_batch_size")[: config.bptt + 1]
        train, valid = train.to(device_obj), valid.to(device_obj)
        for regime_name, probabilities in runs:
            key = json.dumps([regime_name, dict(probabilities)], sort_keys=True)
            if key in cost:
                continue
            regime = get_regime(regime_name)
            model = build_model(len(corpus.vocab), config, regime, probabilities).to(device_obj)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
            clip, samples = config.clip, max(1, min(mc_samples, 8))
            saves[key] = _save_seconds(model, optimizer)
            cost[key] = (
                _seconds_per_word(lambda m=model, o=optimizer, c=clip: _train_step(m, o, train, c), train),
                _seconds_per_word(lambda m=model: _score(m, valid, config.bptt, None), valid),
                _seconds_per_word(lambda m=model: _score(m, valid, config.bptt, CALIBRATION_BINS), valid),
                _seconds_per_word(lambda m=model, s=samples: _mc(m, valid, s), valid) / samples
                if mc_samples and has_noise(model) else 0.0,
            )
    finally:
        torch.set_rng_state(rng)
        torch.set_num_threads(old_threads)
    n_train, n_valid, n_test = (corpus.split(s).numel() for s in ("train", "valid", "test"))
    all_epochs = config.epochs + config.finetune_epochs
    out = []
    for (regime_name, probabilities), epochs in zip(runs, epochs_left or [all_epochs] * len(runs)):
        key = json.dumps([regime_name, dict(probabilities)], sort_keys=True)
        (train_w, valid_w, test_w, sample_w), save = cost[key], saves[key]
        out.append(RunCost(epochs, n_train * train_w + n_valid * valid_w + save,
                           n_test * test_w + mc_samples * n_test * sample_w + RUN_OVERHEAD_SECONDS))
    return out


#: What a run costs besides its passes over the data: building the model, writing results.json
#: and drawing its plots (matplotlib), about a second on a 2-core CPU.
RUN_OVERHEAD_SECONDS = 1.0


def _save_seconds(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """About how long an epoch's checkpoint writes take: the model and the optimiser state
    serialised (twice: checkpoint.pt, and best.pt when the epoch improves)."""
    start = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, io.BytesIO())
    return 2 * (time.perf_counter() - start)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batched: torch.Tensor,
                clip: float = 0.0) -> None:
    model.train()
    logits, _ = model(batched[:-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batched[1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def _score(model: torch.nn.Module, batched: torch.Tensor, bptt: int, bins: int | None) -> None:
    score_sums(model, batched, bptt, bins)


def _mc(model: torch.nn.Module, batched: torch.Tensor, samples: int) -> None:
    mc_language_model_loss(model, [(batched[:-1], batched[1:])], samples, calibration_bins=CALIBRATION_BINS)


def _seconds_per_word(step: Callable[[], None], batched: torch.Tensor, *, at_least: float = 0.3,
                      most: int = 10) -> float:
    """Seconds per predicted word of ``step`` on ``batched``: the median of 3 to ``most`` timed
    runs, repeated until they have taken ``at_least`` seconds, after a warm-up run."""
    step()  # warm-up: allocations, kernel selection
    times: list[float] = []
    while len(times) < 3 or (sum(times) < at_least and len(times) < most):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / ((batched.shape[0] - 1) * batched.shape[1])


# -- which dropout a job's runs get, as text -------------------------------------------------------

_SHORT = {"embedding": "emb", "input": "in", "between": "mid", "hidden": "rec", "output": "out"}


def run_tag(probabilities: Mapping[str, float]) -> str:
    """A folder name for dropout probabilities, e.g. ``in0.5-mid0.5-out0.5``."""
    parts = [f"{_SHORT[s]}{probabilities[s]:g}" for s in SITES if probabilities.get(s)]
    return "-".join(parts) or "p0"


def format_tag(probabilities: Mapping[str, float]) -> str:
    """``"in 0.5, rec 0.2"`` for logs, or ``"no dropout"``."""
    parts = [f"{_SHORT[s]} {probabilities[s]:g}" for s in SITES if probabilities.get(s)]
    return ", ".join(parts) or "no dropout"


def parse_dropout(text: str) -> dict[str, float]:
    """``"input=0.5,hidden=0.2"`` -> ``{"input": 0.5, "hidden": 0.2}``."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        site, sep, value = item.partition("=")
        if not sep or site not in SITES:
            raise ValueError(
                f"--dropout takes site=p pairs with sites among {', '.join(SITES)}, got {item!r}"
            )
        if site in out:
            raise ValueError(f"--dropout names site {site!r} more than once, got {text!r}")
        try:
            out[site] = float(value)
        except ValueError:
            raise ValueError(f"--dropout takes site=p pairs with p a number, got {item!r}") from None
        if not 0 <= out[site] < 1:  # also NaN
            raise ValueError(f"--dropout {site}: expected a probability in [0, 1), got {value}")
    return out


def tuning_fingerprints(summary_path: str | Path) -> tuple[set[str], str] | None:
    """The line fingerprints (:mod:`rnndrop.lm.data.overlap`) of the validation split a grid run
    chose its dropout on, and where they come from: its ``summary.json``'s ``tuned_on``, or for a
    summary written before it recorded them, the corpus its command's ``--data`` names where that
    folder is still there; None where neither is."""
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    tuned_on = summary.get("tuned_on")
    if isinstance(tuned_on, dict) and isinstance(tuned_on.get("valid_lines"), list):
        return set(tuned_on["valid_lines"]), f"the validation split of {tuned_on.get('data', '?')}"
    words = shlex.split(str(summary.get("command", "")))
    data = words[words.index("--data") + 1] if "--data" in words[:-1] else None
    try:
        if data == "sample":
            data = str(sample_dir(str(summary.get("dataset", ""))))
        if data is None or not Path(data).is_dir():
            return None
        return split_fingerprints(data, "valid"), f"the validation split of {data}"
    except (CorpusError, ValueError):
        return None


def chosen_dropout(summary_path: str | Path) -> dict[str, dict[str, float]]:
    """The dropout each regime's grid chose, from a grid run's ``summary.json``."""
    path = Path(summary_path)
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        if not isinstance(summary, dict) or not summary.get("grid"):
            raise ValueError("it is not the summary of a --grid run")
        return {run["regime"]: dict(run["dropout"]) for run in summary["runs"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--dropout-from {str(path)!r}: cannot read the grid's choices ({e})") from None
