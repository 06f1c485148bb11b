"""The language-model benchmark: train regimes, choose dropout on validation, report.

``rnndrop-lm ptb --data sample`` (:mod:`rnndrop.lm.cli`) trains each regime once with
the config's dropout probabilities; ``--grid`` first searches each regime's small
grid (``TrainConfig.grid``) with the first seed, keeps the candidate with the best
*validation* perplexity, trains it again with the other ``--seeds``, and adds the
Monte-Carlo test perplexity of the chosen runs. The test split plays no part in any
choice.

Outputs in ``--out``: one folder per run (checkpoint, best model, results.json,
metrics.csv, curve.png), ``results.md`` (tables, :func:`rnndrop.lm.run.results.benchmark_markdown`),
``summary.json`` and ``learning_curves.png``. This module runs the jobs; the command
line is :mod:`rnndrop.lm.cli` (``python -m rnndrop.lm.run.benchmark`` runs it too).
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import signal
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rnndrop.lm.data.corpus import Corpus, load_corpus
from rnndrop.lm.model.configs import TrainConfig
from rnndrop.lm.model.regimes import SITES, get_regime, regime_probabilities
from rnndrop.lm.run.atomic import atomic_write
from rnndrop.lm.run.estimate import estimate_seconds
from rnndrop.lm.run.folder import LEARNING_CURVES, RESULTS, RESULTS_TABLE, SUMMARY
from rnndrop.lm.run.identity import finished_result, run_identity
from rnndrop.lm.run.process_group import current, run_on_main
from rnndrop.lm.run.progress import JobProgress, format_duration
from rnndrop.lm.run.results import (
    EpochLog,
    benchmark_markdown,
    plot_learning_curves,
    write_json_atomic,
)
from rnndrop.lm.run.train import add_mc_result, train_run

__all__ = ["JobInterrupted", "RunSpec", "chosen_dropout", "main", "run_benchmark"]

log = logging.getLogger(__name__)

_SHORT = {"embedding": "emb", "input": "in", "between": "mid", "hidden": "rec", "output": "out"}


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
        epoch: the epoch that was running (None when several runs were).
        folder: that run's folder (None when several runs were).
        label: that run's name in the job (``"run 2/3 tied ... seed 1"``).
    """

    def __init__(self, epoch: int | None, folder: str | None, label: str = "") -> None:
        super().__init__(epoch, folder, label)
        self.epoch, self.folder, self.label = epoch, folder, label


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
        out[site] = float(value)
    return out


def chosen_dropout(summary_path: str | Path) -> dict[str, dict[str, float]]:
    """The dropout each regime's grid chose, from a grid run's ``summary.json``."""
    path = Path(summary_path)
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        if not summary.get("grid"):
            raise ValueError("it is not the summary of a --grid run")
        return {run["regime"]: dict(run["dropout"]) for run in summary["runs"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--dropout-from {str(path)!r}: cannot read the grid's choices ({e})") from None


def _finished(spec: RunSpec) -> dict[str, Any] | None:
    if not (Path(spec.folder) / RESULTS).is_file():
        return None  # nothing to reuse: skip reading the corpus
    identity = run_identity(_corpus(spec.data_dir), spec.config, spec.regime, spec.dropout, spec.seed)
    return finished_result(spec.folder, identity, epochs=spec.config.epochs)


@functools.lru_cache(maxsize=2)
def _corpus(data_dir: str) -> Corpus:
    return load_corpus(data_dir)


def _worker_logging(label: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{label}] %(message)s", datefmt="%H:%M:%S",
                        force=True)


def _execute(spec: RunSpec, progress: JobProgress | None = None) -> dict[str, Any]:
    """Run (or reuse, or resume) one spec; top-level so worker processes can call it."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if progress is None:
        _worker_logging(spec.label)
    ctx = current()
    if spec.resume:
        # Under torchrun rank 0 reads the folder and tells the others (who never touch it).
        done = run_on_main(functools.partial(_finished, spec), ctx, f"reading {spec.folder!r}")
        if done is not None:
            log.info("%s: finished earlier, reusing its results", spec.folder)
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
            _corpus(spec.data_dir), spec.config, spec.regime, spec.folder, dropout=spec.dropout,
            seed=spec.seed, resume=spec.resume, device=spec.device, mc_samples=spec.mc_samples,
            progress=spec.progress, dataset=spec.dataset, on_epoch_end=on_epoch_end,
            init_from=spec.init_from,
        )
    except KeyboardInterrupt as e:
        epoch = getattr(e, "epoch", None)
        if epoch is None:
            epoch = progress.next_epoch if progress is not None and progress.next_epoch else first
        raise JobInterrupted(epoch, spec.folder, spec.label) from None
    if epoch_log is not None:
        epoch_log.finish(result)
    if progress is not None:
        progress.run_done(spec.label, result)
    return result


def _execute_mc(spec: RunSpec, progress: JobProgress | None = None) -> dict[str, Any]:
    """Add the Monte-Carlo test perplexity to a finished run (the grid's chosen ones)."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    done = run_on_main(functools.partial(_finished, spec), current(), f"reading {spec.folder!r}")
    if done is not None and (done.get("test_ppl_mc") is not None or spec.mc_samples == 0):
        return done
    log.info("%s: Monte-Carlo test perplexity (%d samples)", spec.label or spec.folder, spec.mc_samples)
    return add_mc_result(_corpus(spec.data_dir), spec.config, spec.folder, spec.mc_samples, spec.device)


def _ignore_sigint() -> None:
    # Workers leave Ctrl-C to the main process, which stops them (their checkpoints are atomic).
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_all(
    specs: Sequence[RunSpec], jobs: int, progress: JobProgress | None,
    fn: Callable[[RunSpec, JobProgress | None], dict[str, Any]] = _execute,
) -> list[dict[str, Any]]:
    if jobs <= 1 or len(specs) <= 1:
        return [fn(s, progress) for s in specs]
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=context,
                               initializer=_ignore_sigint)
    try:
        # Workers start while SIGINT is ignored, and keep ignoring it (the disposition is
        # inherited): a Ctrl-C at the terminal reaches the main process alone, which stops them.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            futures = {pool.submit(fn, s): i for i, s in enumerate(specs)}
        finally:
            signal.signal(signal.SIGINT, previous)
        results: dict[int, dict[str, Any]] = {}
        for future in as_completed(futures):
            i = futures[future]
            results[i] = future.result()
            if progress is not None and fn is _execute:
                progress.run_done(specs[i].label, results[i])
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
    out = Path(out_dir)
    mc = config.mc_samples if mc_samples is None else mc_samples

    def spec(regime: str, probabilities: Mapping[str, float], seed: int, mc_n: int) -> RunSpec:
        p = regime_probabilities(get_regime(regime), probabilities)
        folder = out / regime / f"{run_tag(p)}-seed{seed}"
        return RunSpec(str(corpus_dir), dataset, config, regime, p, seed, str(folder), mc_n,
                       resume, device, threads, progress and jobs <= 1,
                       init_from=None if init_from is None else str(init_from))

    def numbered(specs: list[RunSpec], first: int, total: int) -> list[RunSpec]:
        return [replace(s, label=f"run {first + i}/{total} {s.regime} ({format_tag(s.dropout)}) "
                        f"seed {s.seed}") for i, s in enumerate(specs)]

    if grid:
        candidates = [spec(r, p, seeds[0], 0) for r in regimes for p in config.grid.get(r, (config.dropout,))]
        # One candidate per distinct effective setting (e.g. "none" ignores probabilities).
        candidates = list({c.folder: c for c in candidates}.values())
        total = len(candidates) + len(regimes) * (len(seeds) - 1)
        planned = [(c.regime, c.dropout) for c in candidates]
        planned += [(c.regime, c.dropout) for c in candidates[: len(regimes)]] * (len(seeds) - 1)
        mc_per_run = mc * len(regimes) * len(seeds) / max(1, total)
    else:
        default = config.dropout if dropout is None else dropout
        by_regime = dict(dropout_by_regime or {})
        finals = [spec(r, by_regime.get(r, default), s, mc) for r in regimes for s in seeds]
        total = len(finals)
        planned = [(f.regime, f.dropout) for f in finals]
        mc_per_run = mc

    eta = None
    if estimate:
        eta = estimate_seconds(_corpus(str(corpus_dir)), config, planned, round(mc_per_run), jobs=jobs,
                               threads=threads, device=device)
        log.info("this job trains %d run%s of up to %d epochs on %s training words; at the speed "
                 "measured on this machine just now it should take about %s%s. Ctrl-C stops it "
                 "(finished epochs are kept; rerun with --resume)", total, "s" * (total != 1),
                 config.epochs, f"{_corpus(str(corpus_dir)).train.numel():,}", format_duration(eta),
                 f" ({jobs} runs at a time)" if jobs > 1 else "")
    job = JobProgress(total, config.epochs, bar=progress and jobs <= 1, estimate_seconds=eta)
    grid_results: list[dict[str, Any]] = []
    try:
        if grid:
            grid_results = _run_all(numbered(candidates, 1, total), jobs, job)
            chosen: dict[str, dict[str, Any]] = {}
            for r in grid_results:
                best = chosen.get(r["regime"])
                if best is None or r["best_valid_ppl"] < best["best_valid_ppl"]:
                    chosen[r["regime"]] = r
            more = [spec(r, chosen[r]["dropout"], s, 0) for r in regimes for s in seeds[1:]]
            _run_all(numbered(more, len(candidates) + 1, total), jobs, job)
            finals = [spec(r, chosen[r]["dropout"], s, mc) for r in regimes for s in seeds]
            final_results = _run_all(finals, jobs, job, _execute_mc)
        else:
            final_results = _run_all(numbered(finals, 1, total), jobs, job)
    finally:
        job.close()

    markdown = benchmark_markdown(dataset, config.name, final_results, grid_results, command=command,
                                  grid_seed=seeds[0])
    first_seed = [r for r in final_results if r["seed"] == seeds[0]]
    main = current().is_main  # under torchrun rank 0 alone writes the job's files
    if main:
        with atomic_write(out / RESULTS_TABLE, "w", encoding="utf-8") as f:
            f.write(markdown)
    plot = plot_learning_curves(first_seed, out / LEARNING_CURVES) if main else None
    summary = {
        "dataset": dataset, "config": config.name, "regimes": list(regimes), "seeds": list(seeds),
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
        write_json_atomic(summary, out / SUMMARY)
    return summary


def main(argv: Sequence[str] | None = None, *, dataset: str = "ptb") -> str:
    """The benchmark for one corpus from command-line arguments (those of ``rnndrop-lm
    ptb``, see :mod:`rnndrop.lm.cli`); returns the report. Exits with status 2 on a data
    or usage problem, 3 when training diverged and 130 when interrupted, with one line
    on stderr."""
    from rnndrop.lm.cli import train_main

    return train_main(argv, dataset)


if __name__ == "__main__":
    from rnndrop.lm.cli import main as _cli_main

    raise SystemExit(_cli_main())
