"""What a job shows and leaves for people to read: progress, metrics.csv, tables and plots.

- **Progress** of a job (run k of n, epoch e of E, ETA; :class:`JobProgress`) and of a loop
  (:class:`EpochProgress`). With one run at a time, tqdm installed and a terminal, the job's
  bar is drawn above the per-epoch bar of the training loop; otherwise (``--jobs > 1``, no
  tqdm, stderr to a file, ``--no-progress``) one log line per event (an epoch or a run
  finished), so lines of parallel runs never interleave on one terminal line. Worker
  processes report through an :class:`EpochRelay`.
- **Metrics** of a run, per epoch: ``metrics.csv`` and, when the optional ``tensorboard``
  package is installed, TensorBoard scalars in ``tensorboard/`` (:class:`EpochLog`).
- **Tables**: a job's results as Markdown: the run table, the paired comparison, the grid
  (:func:`benchmark_markdown`).
- **Plots**: learning curves and learned alphas as PNGs (matplotlib, optional: imported
  where used).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import logging
import queue
import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rnndrop.atomic import atomic_write
from rnndrop.lm.run.checkpoint import METRICS

__all__ = [
    "FEW_PREDICTIONS",
    "METRICS_COLUMNS",
    "EpochLog",
    "EpochProgress",
    "EpochRelay",
    "JobProgress",
    "RunCost",
    "alpha_figure",
    "benchmark_markdown",
    "comparison_table",
    "format_dropout",
    "format_duration",
    "learning_curve_figure",
    "lr_drops",
    "markdown_table",
    "metrics_text",
    "noise_series",
    "paired_differences",
    "plot_alphas",
    "plot_learning_curves",
    "regime_colour",
    "relay_events",
    "reliability_axes",
    "run_number",
]

log = logging.getLogger(__name__)


# -- progress --------------------------------------------------------------------------------------

def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"12 min"``, ``"1 h 05 min"``."""
    if seconds < 90:
        return f"{max(0, round(seconds))} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


@dataclass(frozen=True)
class RunCost:
    """What one run of a job should cost, in seconds at the speed timed before the job
    (:func:`rnndrop.lm.run.job.estimate_seconds`): the prior of :class:`JobProgress`."""

    #: epochs left to train (at most: a run may stop early at the learning-rate floor)
    epochs: int
    #: one epoch: the training pass and the validation pass
    epoch_seconds: float
    #: after the last epoch: the test pass and the Monte-Carlo passes
    end_seconds: float

    def seconds(self, epochs: int | None = None) -> float:
        return (self.epochs if epochs is None else epochs) * self.epoch_seconds + self.end_seconds


def run_number(label: str) -> int | None:
    """k of a run label ``"run k/n ..."`` (None for another label)."""
    match = re.match(r"run (\d+)/\d+\b", label)
    return int(match.group(1)) if match else None


class JobProgress:
    """Counts the epochs of a job of ``total_runs`` runs of up to ``epochs`` epochs each, and
    its ETA: the one source of the job's time, for the up-front line and the bar alike.

    ``costs`` (one per run, in run order, None for a run reused from an earlier job) is the
    prior: what each run's epochs and end (test, Monte-Carlo passes) should take at the speed
    timed before the job. The ETA is the prior of the work left times the speed factor:
    ``1 / jobs`` before the first epoch ends (the runs share the wall time), then the wall
    time so far over the prior of the work done, so the measured speed replaces the timed
    one from the first epoch on (on a loaded machine the ETA grows, on a quiet one it shrinks).
    A run that stops early (learning-rate floor) drops its epochs left. Without ``costs``
    every epoch weighs the same and the ETA is unknown until one has ended. Runs in worker
    processes report their epochs through an :class:`EpochRelay`.
    """

    def __init__(self, total_runs: int, epochs: int, *, bar: bool,
                 costs: Sequence[RunCost | None] | None = None, jobs: int = 1) -> None:
        self.total_runs, self.epochs = total_runs, epochs
        if costs is not None and len(costs) != total_runs:
            raise ValueError(f"costs: expected one per run ({total_runs}), got {len(costs)}")
        self.known = costs is not None
        planned = costs if costs is not None else [RunCost(epochs, 1.0, 0.0)] * total_runs
        #: run number -> prior of the runs not started yet (reused runs are not planned)
        self.pending: dict[int, RunCost] = {k: c for k, c in enumerate(planned, 1) if c is not None}
        self.jobs = max(1, jobs)
        self.done_epochs = 0  # epochs trained in this job
        self.runs_done = 0
        self.runs_trained = 0  # runs that trained (not reused)
        self.active: dict[str, int] = {}  # label of a running run -> its next epoch
        self.active_cost: dict[str, RunCost] = {}
        self.finished: set[str] = set()  # labels of the runs done
        self.run_label = ""  # of the run this process trains
        self.start = time.perf_counter()
        self.prior_done = 0.0  # the prior of the work done so far
        self.last_event = self.start  # when the last epoch or run ended
        self.bar = None
        if bar and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.total_epochs(), position=0, leave=True, dynamic_ncols=True,
                                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                "epochs{postfix}")
            except ImportError:
                pass

    @property
    def next_epoch(self) -> int | None:
        """The next epoch of the run this process trains (None between runs)."""
        return self.active.get(self.run_label)

    def _left(self, label: str) -> int:
        return max(0, self.epochs - self.active[label] + 1)

    def remaining_epochs(self) -> int:
        """Epochs left to train, at most (runs that stop early train fewer)."""
        return sum(map(self._left, self.active)) + sum(c.epochs for c in self.pending.values())

    def total_epochs(self) -> int:
        return max(1, self.done_epochs + self.remaining_epochs())

    def prior_left(self) -> float:
        """The prior (seconds at the timed speed) of the work left."""
        return (sum(self.active_cost[label].seconds(self._left(label)) for label in self.active)
                + sum(c.seconds() for c in self.pending.values()))

    def speed(self) -> float | None:
        """Wall seconds per prior second: measured once work is done, else the prior's."""
        if self.prior_done > 0:
            return (self.last_event - self.start) / self.prior_done
        return 1 / min(self.jobs, max(1, len(self.pending) + len(self.active))) if self.known else None

    def eta_seconds(self) -> float | None:
        speed = self.speed()
        if speed is None:
            return None
        return max(0.0, speed * self.prior_left() - (time.perf_counter() - self.last_event))

    def _eta_text(self) -> str:
        eta = self.eta_seconds()
        return "ETA unknown" if eta is None else f"job ETA {format_duration(eta)}"

    def _event(self, prior: float) -> None:
        self.prior_done += prior
        self.last_event = time.perf_counter()

    def _refresh(self) -> None:
        if self.bar is None:
            return
        epoch = min(self.next_epoch or self.epochs, self.epochs)
        self.bar.set_description_str(
            f"{self.run_label} · epoch {epoch}/{self.epochs}",
            refresh=False)
        self.bar.set_postfix_str(self._eta_text(), refresh=False)
        self.bar.total = self.total_epochs()
        self.bar.n = self.done_epochs
        self.bar.refresh()

    def _take(self, label: str) -> RunCost:
        """The prior of the run ``label`` (its number's, else the first one planned), no
        longer pending."""
        number = run_number(label)
        if number not in self.pending:
            number = next(iter(self.pending), None)
        if number is not None:
            return self.pending.pop(number)
        known = list(self.active_cost.values()) or [RunCost(self.epochs, 1.0, 0.0)]
        return RunCost(self.epochs, sum(c.epoch_seconds for c in known) / len(known),
                       sum(c.end_seconds for c in known) / len(known))

    def start_run(self, label: str, first_epoch: int = 1) -> None:
        """A run begins (or resumes at ``first_epoch``); ``label`` names it
        (``"run 2/3 tied ... seed 1"``)."""
        self.run_label = label
        self.active[label] = first_epoch
        self.active_cost[label] = self._take(label)
        self._refresh()

    def epoch_done(self, epoch: int, record: Mapping[str, Any], label: str | None = None) -> None:
        """``epoch`` of the run ``label`` (default: the one this process trains) ended."""
        label = self.run_label if label is None else label
        if label not in self.active:  # a worker's epoch whose start was not relayed
            self.start_run(label, epoch)
        self.done_epochs += 1
        self.active[label] = epoch + 1
        self._event(self.active_cost[label].epoch_seconds)
        if self.bar is not None:
            self._refresh()
        else:
            log.info("%s: epoch %d/%d done (valid ppl %.2f); job %d%%, %s",
                     label, epoch, self.epochs,
                     record["valid_ppl"], 100 * self.done_epochs // self.total_epochs(), self._eta_text())

    def run_done(self, label: str, result: Mapping[str, Any], *, reused: bool = False) -> None:
        """A run ended: trained (here or in a worker), or ``reused`` from an earlier job; its
        epochs left (when it stopped early) are dropped."""
        if self.active.pop(label, None) is None:  # not announced by start_run
            cost = self._take(label) if not reused or run_number(label) in self.pending else None
        else:
            cost = self.active_cost.pop(label)
        self.finished.add(label)
        self.runs_done += 1
        self.runs_trained += not reused
        if not reused and cost is not None:
            self._event(cost.end_seconds)
        self._refresh()
        # One line per run, with or without bars (above them on a terminal).
        what = "reused (finished earlier)" if reused else "finished"
        mc = result.get("test_ppl_mc")
        mc_text = f", MC {mc:.2f} ({result.get('mc_samples')} samples)" if isinstance(mc, float) else ""
        log.info("%s %s: best valid ppl %.2f, test ppl %.2f%s; %d of %d runs done, %s",
                 label, what, result["best_valid_ppl"], result["test_ppl"], mc_text, self.runs_done,
                 self.total_runs, self._eta_text())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class EpochRelay:
    """What a worker process of ``--jobs`` has in place of the :class:`JobProgress` of the
    main process: it puts the run's events on ``events`` (a multiprocessing queue), which
    the main process passes on with :func:`relay_events`."""

    def __init__(self, events: Any) -> None:
        self.events = events
        self.run_label = ""
        self.next_epoch: int | None = None

    def start_run(self, label: str, first_epoch: int = 1) -> None:
        self.run_label, self.next_epoch = label, first_epoch
        self.events.put(("start", label, first_epoch))

    def epoch_done(self, epoch: int, record: Mapping[str, Any]) -> None:
        self.next_epoch = epoch + 1
        self.events.put(("epoch", self.run_label, epoch, {"valid_ppl": record["valid_ppl"]}))

    def run_done(self, label: str, result: Mapping[str, Any], *, reused: bool = False) -> None:
        # The main process counts the run when its result arrives; it only needs to know this.
        if reused:
            self.events.put(("reused", label))


def relay_events(events: Any, progress: JobProgress, reused: set[str]) -> None:
    """Pass the events waiting on ``events`` to ``progress``; labels of reused runs go to
    ``reused``."""
    while True:
        try:
            event = events.get_nowait()
        except queue.Empty:
            return
        if event[1] in progress.finished:
            continue  # a late event of a run whose result has arrived
        if event[0] == "start":
            progress.start_run(event[1], event[2])
        elif event[0] == "epoch":
            progress.epoch_done(event[2], event[3], label=event[1])
        else:
            reused.add(event[1])


class EpochProgress:
    """A tqdm bar on a terminal when tqdm is installed and ``bar`` (below the job's bar of
    :class:`rnndrop.lm.run.report.JobProgress`, if one is drawn), else a log line every
    tenth of the loop (e.g. when stderr goes to a file, or in a worker process of ``--jobs``
    whose bars would overwrite each other). ``unit`` names what the loop counts
    (``"MC test, 50 samples: 2/21 test segments"``)."""

    def __init__(self, total: int, desc: str, enabled: bool, *, bar: bool = True, unit: str = "") -> None:
        self.total, self.desc, self.count, self.unit = total, desc, 0, unit
        self.bar = None
        self.enabled = enabled
        if enabled and bar and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True,
                                **({"unit": f" {unit}"} if unit else {}))
            except ImportError:
                pass
        self.every = max(1, total // 10)

    def update(self, **stats: float) -> None:
        self.count += 1
        text = {k: f"{v:,.0f}" if v >= 100 else f"{v:.2f}" for k, v in stats.items()}
        if self.bar is not None:
            self.bar.set_postfix(text, refresh=False)
            self.bar.update(1)
        elif self.enabled and (self.count % self.every == 0 or self.count == self.total):
            where = f": {self.count}/{self.total} {self.unit}" if self.unit else f" {self.count}/{self.total}"
            log.info("%s%s %s", self.desc, where, " ".join(f"{k}={v}" for k, v in text.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# -- metrics.csv -----------------------------------------------------------------------------------

#: Its columns; ``elapsed_seconds`` is the training time so far (the sum of the epochs'
#: ``seconds``, evaluation excluded), so it survives an interrupted and resumed run.
METRICS_COLUMNS: tuple[str, ...] = (
    "epoch", "lr", "train_ppl", "valid_ppl", "words_per_second", "seconds", "elapsed_seconds",
)


def _metrics_row(record: Mapping[str, Any], elapsed: float) -> dict[str, Any]:
    return {
        "epoch": record["epoch"], "lr": record["lr"], "train_ppl": record["train_ppl"],
        "valid_ppl": record["valid_ppl"], "words_per_second": record["words_per_second"],
        "seconds": record["seconds"], "elapsed_seconds": elapsed,
    }


def _metrics_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=METRICS_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def metrics_text(records: Sequence[Mapping[str, Any]]) -> str:
    """The metrics.csv of a run whose epoch records (``result["epochs"]``) are ``records``: what
    :meth:`EpochLog.finish` writes, and what results.json's ``files`` entry hashes."""
    elapsed, rows = 0.0, []
    for record in records:
        elapsed += record["seconds"]
        rows.append(_metrics_row(record, elapsed))
    return _metrics_csv(rows)


def _write_metrics(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    text = _metrics_csv(rows)
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)


class EpochLog:
    """Per-epoch metrics of one run: ``metrics.csv`` (rewritten atomically after every
    epoch) and TensorBoard scalars (``tensorboard/``) when ``tensorboard`` is installed.

    Use it as ``train_run(..., on_epoch_end=log)``; after the run, :meth:`finish` with
    the result rewrites the CSV from the result's history (the authority after a resume).
    """

    def __init__(self, folder: str | Path, *, tensorboard: bool = True) -> None:
        self.folder = Path(folder)
        self.path = self.folder / METRICS
        self.rows: list[dict[str, Any]] = []
        if self.path.is_file():
            try:
                with open(self.path, encoding="utf-8", newline="") as f:
                    self.rows = [{k: float(v) if k != "epoch" else int(v) for k, v in row.items()}
                                 for row in csv.DictReader(f)]
            except (ValueError, TypeError, OSError):
                self.rows = []  # rebuilt from the result's history when the run ends
        self._tensorboard = tensorboard
        self._writer: Any = None

    def __call__(self, epoch: int, record: Mapping[str, Any]) -> None:
        rows = [r for r in self.rows if r["epoch"] < epoch]
        elapsed = sum(r["seconds"] for r in rows) + record["seconds"]
        self.rows = [*rows, _metrics_row(record, elapsed)]
        _write_metrics(self.rows, self.path)
        if self._tensorboard:
            self._scalars(epoch, record)

    def _scalars(self, epoch: int, record: Mapping[str, Any]) -> None:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional: no scalars, no message
                self._tensorboard = False
                return
            self._writer = SummaryWriter(log_dir=str(self.folder / "tensorboard"))
        self._writer.add_scalar("perplexity/train", record["train_ppl"], epoch)
        self._writer.add_scalar("perplexity/valid", record["valid_ppl"], epoch)
        self._writer.add_scalar("lr", record["lr"], epoch)
        self._writer.add_scalar("words_per_second", record["words_per_second"], epoch)
        self._writer.flush()

    def finish(self, result: Mapping[str, Any]) -> None:
        elapsed, rows = 0.0, []
        for record in result["epochs"]:
            elapsed += record["seconds"]
            rows.append(_metrics_row(record, elapsed))
        self.rows = rows
        _write_metrics(rows, self.path)
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# -- tables ----------------------------------------------------------------------------------------

def format_dropout(probabilities: Mapping[str, float]) -> str:
    """``"emb 0.1 · in 0.5 · ..."`` for the sites with p > 0, or ``"—"``."""
    short = {"embedding": "emb", "input": "in", "between": "mid", "hidden": "rec", "output": "out"}
    parts = [f"{short.get(k, k)} {v:g}" for k, v in probabilities.items() if v]
    return " · ".join(parts) if parts else "—"


def _mean_sd(values: Sequence[float], digits: int = 1, *, signed: bool = False) -> str:
    sign = "+" if signed else ""
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def markdown_table(results: Sequence[Mapping[str, Any]], *, group: bool = True) -> str:
    """A Markdown table comparing runs.

    With ``group`` runs of the same regime and dropout probabilities (different seeds)
    share a row: perplexities are ``mean ± sd`` over the seeds, which are listed.
    """
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in results:
        key = (r["regime"], json.dumps(r["dropout"], sort_keys=True)) if group else (id(r),)
        groups.setdefault(key, []).append(r)
    lines = [
        "| regime | dropout | seeds | best epoch | valid ppl | test ppl | test ppl, MC | words/s "
        "| wall (min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for runs in groups.values():
        first = runs[0]
        mc = [r["test_ppl_mc"] for r in runs if r.get("test_ppl_mc") is not None]
        samples = ", ".join(str(n) for n in dict.fromkeys(r["mc_samples"] for r in runs))  # each S, once
        mc_text = f"{_mean_sd(mc)} (S={samples})" if len(mc) == len(runs) else "—"
        lines.append(
            "| {regime} | {dropout} | {seeds} | {epoch} | {valid} | {test} | {mc} | {wps} | {wall} |".format(
                regime=first["regime"],
                dropout=format_dropout(first["dropout"]),
                seeds=", ".join(str(r["seed"]) for r in runs),
                epoch=", ".join(str(r["best_epoch"]) for r in runs),
                valid=_mean_sd([r["best_valid_ppl"] for r in runs]),
                test=_mean_sd([r["test_ppl"] for r in runs]),
                mc=mc_text,
                wps=_words_per_second(runs),
                wall=f"{statistics.mean(r['wall_seconds'] for r in runs) / 60:.1f}",
            )
        )
    return "\n".join(lines) + "\n"


def _words_per_second(runs: Sequence[Mapping[str, Any]]) -> str:
    """The runs' mean words/s, marked where they trained under torch.compile (``rnndrop-lm``'s
    default for some regimes on CUDA: a table beside eager runs says which were); for compiled
    runs also their words/s after the first epoch, which compiles and records a CUDA graph per
    truncated-BPTT length: the speed they train at, where the whole run's average of a short run
    is mostly the compile's."""
    text = f"{statistics.mean(r['words_per_second'] for r in runs):,.0f}"
    compiled = sum(bool(r.get("compiled")) and not r.get("compile_failure") for r in runs)
    if compiled == len(runs):
        later = [w for w in map(_after_first_epoch, runs) if w is not None]
        if len(later) == len(runs):
            return f"{text} (compiled; {statistics.mean(later):,.0f} after epoch 1)"
        return f"{text} (compiled)"
    return f"{text} ({compiled} of {len(runs)} compiled)" if compiled else text


def _after_first_epoch(result: Mapping[str, Any]) -> float | None:
    """A run's training words/s over its epochs after the first (``result["epochs"]``' words over
    their seconds); None for a run of one epoch or records without their timing."""
    later = [r for r in result["epochs"][1:] if "seconds" in r and "words_per_second" in r]
    seconds = sum(r["seconds"] for r in later)
    if not later or seconds <= 0:
        return None
    return sum(r["words_per_second"] * r["seconds"] for r in later) / seconds


def paired_differences(
    results: Sequence[Mapping[str, Any]], baseline: str, key: str = "test_ppl"
) -> dict[str, list[float]]:
    """Per regime, ``run[key] - baseline_run[key]`` over the seeds both ran.

    Runs of one seed share the initialisation seed and the order of the data, so the
    paired difference removes what the seed does to both and shows what the regime does.
    """
    base = {r["seed"]: r[key] for r in results if r["regime"] == baseline and r.get(key) is not None}
    out: dict[str, list[float]] = {}
    for r in results:
        if r["regime"] != baseline and r["seed"] in base and r.get(key) is not None:
            out.setdefault(r["regime"], []).append(r[key] - base[r["seed"]])
    return out


def comparison_table(results: Sequence[Mapping[str, Any]], baseline: str = "naive") -> str:
    """One row per regime: test perplexity and its paired difference to ``baseline``
    (standard and Monte-Carlo), next-word calibration (ECE, NLL per token), and each
    seed's best epoch out of the epochs it ran ("cap" marks a run stopped by the epoch
    cap while validation was still improving: not converged). Values are mean ± sd."""
    by_regime: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        by_regime.setdefault(r["regime"], []).append(r)
    diff = paired_differences(results, baseline)
    diff_mc = paired_differences(results, baseline, "test_ppl_mc")
    lines = [
        f"| regime | best epoch / run | test ppl | Δ vs {baseline} | test ppl, MC | Δ MC vs {baseline} "
        "| ECE % | ECE %, MC | NLL | NLL, MC |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for regime, runs in by_regime.items():
        runs = sorted(runs, key=lambda r: r["seed"])

        def column(key: str, scale: float = 1.0, digits: int = 1, runs=runs) -> str:
            values = [r[key] * scale for r in runs if r.get(key) is not None]
            return _mean_sd(values, digits) if values and len(values) == len(runs) else "—"

        def delta(diffs: dict[str, list[float]], key: str, regime: str = regime) -> str:
            if regime == baseline:  # its own difference: 0 where it has the value (no MC without noise)
                return "0" if column(key) != "—" else "—"
            return _mean_sd(diffs[regime], signed=True) if regime in diffs else "—"

        epochs = ", ".join(
            f"{r['best_epoch']}/{r.get('epochs_run', len(r['epochs']))}"
            + ("" if r.get("converged", True) else " cap")
            for r in runs
        )
        lines.append(
            f"| {regime} | {epochs} | {column('test_ppl')} | {delta(diff, 'test_ppl')} | "
            f"{column('test_ppl_mc')} | {delta(diff_mc, 'test_ppl_mc')} | {column('test_ece', 100, 2)} | "
            f"{column('test_ece_mc', 100, 2)} | {column('test_nll', 1, 3)} | {column('test_nll_mc', 1, 3)} |"
        )
    return "\n".join(lines) + "\n"

def benchmark_markdown(
    dataset: str,
    config_name: str,
    final_results: Sequence[Mapping[str, Any]],
    grid_results: Sequence[Mapping[str, Any]] = (),
    *,
    command: str = "",
    grid_seed: int | None = None,
) -> str:
    """The benchmark's report: command, corpus, the comparison table and the grid."""
    lines = [f"# {dataset} language-model benchmark, config `{config_name}`", ""]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    corpus_info = final_results[0].get("corpus", {}) if final_results else {}
    lines += [
        f"Corpus: `{corpus_info.get('source', '?')}` "
        f"({corpus_info.get('train_tokens', '?')} / {corpus_info.get('valid_tokens', '?')} / "
        f"{corpus_info.get('test_tokens', '?')} train / valid / test tokens with `<eos>`, "
        f"vocabulary {corpus_info.get('vocab_size', '?')}).",
        "",
        "Perplexities are mean ± sd over seeds; test perplexity uses the parameters of the "
        "best validation epoch; MC = Monte-Carlo dropout with S samples.",
        "",
        markdown_table(final_results),
    ]
    regimes = {r["regime"] for r in final_results}
    if len(regimes) > 1:
        baseline = "naive" if "naive" in regimes else final_results[0]["regime"]
        lines += [
            f"Paired against `{baseline}` (same seed: same initialisation seed and data order), "
            "next-word calibration on the test split (ECE with 15 bins, NLL in nats per token), "
            "and convergence (best epoch / epochs run; `cap`: stopped by the epoch cap while "
            "validation was still improving):",
            "",
            comparison_table(final_results, baseline),
        ]
    if grid_results:
        lines += [
            f"Grid (seed {grid_seed}); the dropout of each regime was chosen by validation "
            "perplexity only:",
            "",
            "| regime | dropout | best epoch | valid ppl | chosen |",
            "|---|---|---|---|---|",
        ]
        chosen = {f["regime"]: f["dropout"] for f in final_results}
        for r in sorted(grid_results, key=lambda r: (r["regime"], r["best_valid_ppl"])):
            mark = "✓" if r["dropout"] == chosen.get(r["regime"]) else ""
            lines.append(f"| {r['regime']} | {format_dropout(r['dropout'])} | {r['best_epoch']} | "
                         f"{r['best_valid_ppl']:.1f} | {mark} |")
        lines.append("")
    return "\n".join(lines)


# -- plots -----------------------------------------------------------------------------------------

def noise_series(epochs: list[dict[str, Any]], key: str = "alpha") -> dict[str, list[tuple[int, float]]]:
    """Per site, ``(epoch, value)`` of ``key`` (``"alpha"`` or ``"kl"``) over a run's epochs."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in epochs:
        for site, value in record.get("noise", {}).get(key, {}).items():
            series.setdefault(site, []).append((record["epoch"], value))
    return series


def _config_text(cfg: Mapping[str, Any]) -> str:
    cell = str(cfg.get("cell", "lstm")).upper()
    model = (f"{cfg.get('num_layers', '?')}×{cfg.get('hidden_size', '?')} {cell}, "
             f"emb {cfg.get('embedding_size', '?')}")
    train = (f"{cfg.get('optimizer', 'sgd')} lr {cfg.get('lr', '?'):g}, batch {cfg.get('batch_size', '?')}, "
             f"bptt {cfg.get('bptt', '?')}") if isinstance(cfg.get("lr"), (int, float)) else ""
    return f"config {cfg.get('name', '?')}: {model}" + (f"\n{train}" if train else "")


def _shared_config(results: Sequence[Mapping[str, Any]]) -> bool:
    return len({_config_text(r.get("config", {})) for r in results}) <= 1


def _plot_title(results: Sequence[Mapping[str, Any]]) -> str:
    """The corpus, and the config when every run has the same one (else each legend entry names its own)."""
    first = results[0]
    source = Path(str(first.get("corpus", {}).get("source", ""))).name
    what = first.get("dataset") or "corpus"
    if source:
        what += f" ({source})"
    if not _shared_config(results):
        return f"{what}, configs in the legend"
    return f"{what}, {_config_text(first.get('config', {}))}"


#: A colour per regime, the same in every plot (a run's curve.png and the job's learning_curves.png).
_REGIME_COLOURS = ("none", "naive", "tied", "untied", "batch", "weight_drop", "gaussian", "sparse_vd",
                   "gaussian_fixed", "gaussian_kingma")


def regime_colour(regime: str) -> str:
    """The matplotlib colour of ``regime``: one of tab10 keyed by the regime's name, so a regime
    has the same colour in every plot (other regimes: by a stable hash of the name)."""
    if regime in _REGIME_COLOURS:
        return f"C{_REGIME_COLOURS.index(regime)}"
    return f"C{sum(map(ord, regime)) % 10}"


def lr_drops(epochs: Sequence[Mapping[str, Any]]) -> list[int]:
    """The epochs that began at a lower learning rate than the one before."""
    rates = [(e["epoch"], e.get("lr")) for e in epochs]
    return [epoch for (_, before), (epoch, lr) in itertools.pairwise(rates)
            if isinstance(before, (int, float)) and isinstance(lr, (int, float)) and lr < before]


def _valid_range(results: Sequence[Mapping[str, Any]]) -> tuple[float, float] | None:
    """The perplexity range that answers "which regime is best": from just below the lowest
    validation perplexity to a third above the worst run's best (early epochs, far above,
    are cut off; the axis says so)."""
    valid = [e["valid_ppl"] for r in results for e in r["epochs"]]
    finite = [v for v in valid if isinstance(v, (int, float)) and 0 < v < float("inf")]
    if not finite:
        return None
    bests = [min(v for v in (e["valid_ppl"] for e in r["epochs"]) if v in finite) for r in results
             if any(e["valid_ppl"] in finite for e in r["epochs"])]
    low, high = min(finite), min(max(finite), max(bests) * 1.35)
    pad = max(high - low, 0.02 * low, 1e-9)
    return low - 0.12 * pad, high + 0.08 * pad


def learning_curve_figure(results: Sequence[Mapping[str, Any]]):
    """A matplotlib figure that answers "which regime is best, and when did it stop improving":
    validation (solid, ●) and training (dashed, ×) perplexity per epoch of every run, on a
    linear axis fitted to the validation curves (early epochs above it are cut off, and a
    note says so), each run's best epoch starred and its value written beside it (labels
    moved apart so none overlaps another), the learning-rate drops as dotted vertical lines,
    one colour per regime (:func:`regime_colour`, the same in every plot), and two legends:
    the runs (with test perplexity) and the line styles. Titled with the corpus and the config
    (when the runs' configs differ, each legend entry names its own; matplotlib required)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 6), layout="constrained")
    shared_config = _shared_config(results)
    markers = ("o", "s", "^", "D", "v")
    seen: dict[str, int] = {}
    bests: list[tuple[float, float, str]] = []
    drops: dict[int, list[str]] = {}
    for r in results:
        color = regime_colour(r["regime"])
        marker = markers[seen.get(r["regime"], 0) % len(markers)]  # a second run of a regime
        seen[r["regime"]] = seen.get(r["regime"], 0) + 1
        epochs = [e["epoch"] for e in r["epochs"]]
        valid = [e["valid_ppl"] for e in r["epochs"]]
        ax.plot(epochs, valid, color=color, marker=marker, markersize=4,
                label=_legend_label(r, shared_config))
        ax.plot(epochs, [e["train_ppl"] for e in r["epochs"]], color=color, marker="x",
                markersize=4, linestyle="--", alpha=0.6)
        if r.get("best_epoch") in epochs:
            best = epochs.index(r["best_epoch"])
            bests.append((epochs[best], valid[best], color))
        for epoch in lr_drops(r["epochs"]):
            drops.setdefault(epoch, []).append(color)
    for epoch, colors in sorted(drops.items()):
        for k, color in enumerate(colors):  # runs dropping at the same epoch: side by side
            ax.axvline(epoch - 0.5 + 0.06 * (k - (len(colors) - 1) / 2), color=color, linestyle=":",
                       linewidth=1.2, alpha=0.8)
    ax.set_xlabel("epoch")
    last = max((e["epoch"] for r in results for e in r["epochs"]), default=1)
    ax.set_xlim(0.5, last + 0.5)  # a range of at least one epoch, so every tick is an epoch
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylabel("perplexity")
    span = _valid_range(results)
    if span is not None:
        ax.set_ylim(*span)
        above = [e["valid_ppl"] for r in results for e in r["epochs"] if e["valid_ppl"] > span[1]]
        if above:
            ax.text(0.99, 0.99, f"axis fitted to validation: {len(above)} early point"
                    f"{'s' * (len(above) != 1)} above {span[1]:.0f} cut off", transform=ax.transAxes,
                    ha="right", va="top", fontsize=7, color="0.35", zorder=6,
                    bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "0.8"})
    _mark_bests(ax, bests)
    ax.set_title(_plot_title(results), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    runs = ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.1), title="runs (colour: regime)",
                     title_fontsize=7, frameon=False)
    ax.add_artist(runs)
    styles = [Line2D([], [], color="0.3", marker="o", markersize=4, label="validation"),
              Line2D([], [], color="0.3", marker="x", markersize=4, linestyle="--", label="training"),
              Line2D([], [], color="0.3", marker="*", markersize=10, linestyle="none",
                     markeredgecolor="black", markeredgewidth=0.6, label="best validation epoch"),
              Line2D([], [], color="0.3", linestyle=":", label="learning rate lowered")]
    ax.legend(handles=styles, fontsize=7, loc="upper right", bbox_to_anchor=(1, -0.1), title="lines",
              title_fontsize=7, frameon=False)
    return fig


def _mark_bests(ax: Any, bests: Sequence[tuple[float, float, str]]) -> None:
    """A star at each run's best epoch, moved a few pixels sideways where it would cover
    another star, and its value and epoch above it, the labels stacked apart (in screen space)
    so that none overlaps another."""
    if not bests:
        return
    fig = ax.figure
    fig.canvas.draw()  # the layout, so screen positions hold
    renderer = fig.canvas.get_renderer()
    # the data lines on screen (not the vertical learning-rate lines), for the labels to avoid
    curves = [line.get_transform().transform_path(line.get_path()) for line in ax.lines
              if len(line.get_xdata()) > 1 and line.get_linestyle() != ":"]
    from matplotlib.transforms import Bbox

    stars: list[tuple[float, float]] = []  # screen positions of the stars so far
    placed: list[tuple[str, tuple[float, float], str]] = []
    for x, y, color in sorted(bests, key=lambda b: (b[1], b[0])):
        px0, py = ax.transData.transform((x, y))
        px = px0
        for step in (0, -14, 14, -28, 28, -42, 42):  # screen pixels sideways
            px = px0 + step
            if all(abs(px - sx) > 12 or abs(py - sy) > 12 for sx, sy in stars):
                break
        stars.append((px, py))
        shift = ax.transData.inverted().transform((px, py))[0] - x
        ax.plot([x + shift], [y], color=color, marker="*", markersize=13, markeredgecolor="black",
                markeredgewidth=0.6, linestyle="none", zorder=4)
        placed.append((f"{y:.1f} (epoch {x:g})", (x + shift, y), color))
    # the labels' extents so far, the stars' first: no label covers a star
    labels: list[Any] = [Bbox.from_extents(px - 9, py - 9, px + 9, py + 9) for px, py in stars]
    for text, xy, color in placed:
        _place_label(ax, renderer, text, xy, color, labels, curves)


def _place_label(ax: Any, renderer: Any, text: str, xy: tuple[float, float], color: str, labels: list[Any],
                 curves: Sequence[Any]) -> None:
    """``text`` tied to ``xy`` by a thin line, at the first offset (below, above, further out,
    then sideways) where it lies inside the axes and overlaps no label placed before and,
    where possible, no curve; its extent joins ``labels``."""
    from matplotlib.text import Text

    inside = ax.get_window_extent(renderer)
    offsets = [(dx, dy) for dy in (16, 28, 40, 52, 64) for dx in (0, -30, 30) for dy in (-dy, dy)]
    fallback = None
    for dx, dy in offsets:
        label = ax.annotate(text, xy, xytext=(dx, dy), textcoords="offset points", ha="center",
                            va="top" if dy < 0 else "bottom", fontsize=8, color=color, fontweight="bold",
                            bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                                  "alpha": 0.8},
                            arrowprops={"arrowstyle": "-", "color": color, "lw": 0.6}, zorder=5)
        label.update_positions(renderer)  # where the offset puts it, before it is drawn
        box = Text.get_window_extent(label, renderer).expanded(1.05, 1.2)
        free = (inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
                and not any(box.overlaps(other) for other in labels))
        if free and not any(curve.intersects_bbox(box, filled=False) for curve in curves):
            labels.append(box)
            return
        label.remove()
        if free and fallback is None:
            fallback = (dx, dy)
    dx, dy = fallback or offsets[0]
    label = ax.annotate(text, xy, xytext=(dx, dy), textcoords="offset points", ha="center",
                        va="top" if dy < 0 else "bottom", fontsize=8, color=color, fontweight="bold",
                        bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                              "alpha": 0.8},
                        arrowprops={"arrowstyle": "-", "color": color, "lw": 0.6}, zorder=5)
    label.update_positions(renderer)
    labels.append(Text.get_window_extent(label, renderer).expanded(1.05, 1.2))


def _legend_label(result: Mapping[str, Any], shared_config: bool = True) -> str:
    """``"tied (in 0.5 · out 0.5, seed 1): test 152.3"``; "dropout none" where there is none
    (not "—", a line symbol in a legend)."""
    dropout = format_dropout(result["dropout"]) if any(result["dropout"].values()) else "dropout none"
    label = f"{result['regime']} ({dropout}, seed {result['seed']})"
    if not shared_config:
        label = _config_text(result.get("config", {})).replace("\n", " · ") + "\n" + label
    if isinstance(result.get("test_ppl"), (int, float)):
        label += f": test {result['test_ppl']:.1f}"
    return label


def plot_learning_curves(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """:func:`learning_curve_figure` as a PNG at ``path`` (written atomically); every epoch
    is a marker, so a one-epoch run shows too.

    Returns the path, or None when matplotlib is not installed or there is nothing to plot.
    """
    return _save_png(learning_curve_figure, results, path) if results else None


def alpha_figure(results: Sequence[Mapping[str, Any]]):
    """A matplotlib figure of the mean learned ``alpha`` of every site per epoch (log axis;
    one colour per site, one line style per run), with ``p = alpha / (1 + alpha)``, the
    Bernoulli dropout of the same variance, on the right axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    styles = ("-", "--", ":", "-.")
    for i, r in enumerate(results):
        for j, (site, points) in enumerate(sorted(noise_series(r["epochs"]).items())):
            ax.plot([e for e, _ in points], [a for _, a in points], color=f"C{j % 10}",
                    linestyle=styles[i % len(styles)], marker="o", markersize=3,
                    label=f"{site} (seed {r['seed']})" if len(results) > 1 else site)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean alpha of the site (noise variance)")
    right = ax.secondary_yaxis("right", functions=(lambda a: a / (1 + a), lambda p: p / (1 - p).clip(1e-9)))
    right.set_ylabel("p of the same variance")
    ax.set_title(_plot_title(results) + f"\nregime {results[0]['regime']}: learned alpha per site",
                 fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def plot_alphas(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """:func:`alpha_figure` as a PNG at ``path`` (written atomically); None when no run
    learned its noise or matplotlib is not installed."""
    if not any(noise_series(r["epochs"]) for r in results):
        return None
    return _save_png(alpha_figure, results, path)


#: Bins with fewer predictions than this are drawn faded: their accuracy says little.
FEW_PREDICTIONS = 10


def reliability_axes(top: Any, bottom: Any, diagram: Any, title: str) -> None:
    """A reliability diagram (:class:`rnndrop.calibration.ReliabilityDiagram`) on two axes:
    accuracy per confidence bin (bars) against the bin's mean confidence (red ticks) and the
    diagonal on ``top``, the predictions per bin on ``bottom`` (log). A bin of fewer than
    :data:`FEW_PREDICTIONS` predictions is faded and hatched, its count written over its bar
    (``n=2``), so a bar of 100% from one prediction is not read as a finding."""
    edges = diagram.bin_edges.numpy()
    width = edges[1] - edges[0]
    centres = edges[:-1] + width / 2
    counts = diagram.count.numpy()
    accuracy, confidence = diagram.accuracy.numpy(), diagram.confidence.numpy()
    shown_few = False
    for i in (i for i in range(len(counts)) if counts[i] > 0):
        few = counts[i] < FEW_PREDICTIONS
        shown_few |= bool(few)
        top.bar(centres[i], accuracy[i], width=width * 0.9, color="tab:blue", alpha=0.3 if few else 1.0,
                hatch="//" if few else None, edgecolor="tab:blue",
                label=("accuracy" if not few else f"accuracy, < {FEW_PREDICTIONS} predictions"))
        if few:  # the others' counts are in the panel below
            top.annotate(f"n={counts[i]:,}", (centres[i], accuracy[i]), xytext=(0, 3),
                         textcoords="offset points", ha="center", va="bottom", fontsize=7, color="tab:red")
    filled = counts > 0
    top.scatter(centres[filled], confidence[filled], marker="_", s=300, color="tab:red",
                label="mean confidence", zorder=3)
    top.plot([0, 1], [0, 1], color="grey", ls="--", lw=1)
    top.set_xlim(0, 1)
    top.set_ylim(0, 1.15)  # room for the counts over full bars
    top.set_title(f"{title}\nECE {100 * diagram.ece:.2f}%" + (
        f"; faded: bins of < {FEW_PREDICTIONS} predictions" if shown_few else ""))
    bottom.bar(centres, counts, width=width * 0.9, color="grey")
    bottom.set_yscale("log")
    bottom.set_xlim(0, 1)
    bottom.set_xlabel("confidence (top-1 probability)")


def _save_png(figure: Any, results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot at %s (pip install 'rnndrop[bench]')", path)
        return None
    fig = figure(results)
    path = Path(path)
    try:
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path
