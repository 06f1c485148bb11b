"""Progress of a whole benchmark job: run k of n, regime, epoch e of E, and an ETA.

With one run at a time, tqdm installed and a terminal, :class:`JobProgress` draws one bar
for the job above the per-epoch bar of the training loop; otherwise (``--jobs > 1``, no
tqdm, stderr to a file, ``--no-progress``) it writes one log line per event (an epoch or a run finished), so
lines of parallel runs never interleave on one terminal line.
"""

from __future__ import annotations

import logging
import queue
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["EpochProgress", "EpochRelay", "JobProgress", "format_duration", "relay_events"]

log = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    """``"45 s"``, ``"12 min"``, ``"1 h 05 min"``."""
    if seconds < 90:
        return f"{max(0, round(seconds))} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


class JobProgress:
    """Counts the epochs of a job of ``total_runs`` runs of up to ``epochs`` epochs each.

    The ETA is the job's remaining epochs times the wall time per epoch trained so far
    (evaluation and Monte-Carlo scoring included; runs trained side by side under
    ``--jobs`` count each of their epochs); before the first epoch it is
    ``estimate_seconds`` scaled by the share left of the ``estimate_epochs`` it counted
    (default: every epoch of every run). Runs in worker processes report their epochs
    through an :class:`EpochRelay`.
    """

    def __init__(self, total_runs: int, epochs: int, *, bar: bool,
                 estimate_seconds: float | None = None, estimate_epochs: int | None = None) -> None:
        self.total_runs, self.epochs = total_runs, epochs
        self.done_epochs = 0  # epochs trained in this job
        self.runs_started = 0
        self.runs_done = 0
        self.runs_trained = 0  # runs that trained (not reused)
        self.active: dict[str, int] = {}  # label of a running run -> its next epoch
        self.finished: set[str] = set()  # labels of the runs done
        self.run_label = ""  # of the run this process trains
        self.start = time.perf_counter()
        self.estimate = estimate_seconds
        self.estimate_epochs = max(1, epochs * total_runs if estimate_epochs is None else estimate_epochs)
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

    def remaining_epochs(self) -> int:
        active = sum(max(0, self.epochs - n + 1) for n in self.active.values())
        return active + self.epochs * (self.total_runs - self.runs_started)

    def total_epochs(self) -> int:
        return max(1, self.done_epochs + self.remaining_epochs())

    def eta_seconds(self) -> float | None:
        elapsed = time.perf_counter() - self.start
        if self.done_epochs:
            return self.remaining_epochs() * elapsed / self.done_epochs
        if self.runs_trained:
            return (self.total_runs - self.runs_done) * elapsed / self.runs_trained
        if self.estimate is not None:
            return self.estimate * min(1.0, self.remaining_epochs() / self.estimate_epochs)
        return None

    def _eta_text(self) -> str:
        eta = self.eta_seconds()
        return "ETA unknown" if eta is None else f"job ETA {format_duration(eta)}"

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

    def start_run(self, label: str, first_epoch: int = 1) -> None:
        """A run begins (or resumes at ``first_epoch``); ``label`` names it
        (``"run 2/3 tied ... seed 1"``)."""
        self.runs_started += 1
        self.run_label = label
        self.active[label] = first_epoch
        self._refresh()

    def epoch_done(self, epoch: int, record: Mapping[str, Any], label: str | None = None) -> None:
        """``epoch`` of the run ``label`` (default: the one this process trains) ended."""
        label = self.run_label if label is None else label
        self.done_epochs += 1
        self.active[label] = epoch + 1
        if self.bar is not None:
            self._refresh()
        else:
            log.info("%s: epoch %d/%d done (valid ppl %.2f); job %d%%, %s",
                     label, epoch, self.epochs,
                     record["valid_ppl"], 100 * self.done_epochs // self.total_epochs(), self._eta_text())

    def run_done(self, label: str, result: Mapping[str, Any], *, reused: bool = False) -> None:
        """A run ended: trained (here or in a worker), or ``reused`` from an earlier job."""
        if self.active.pop(label, None) is None:  # not announced by start_run
            self.runs_started += 1
        self.finished.add(label)
        self.runs_done += 1
        self.runs_trained += not reused
        if self.bar is not None:
            self._refresh()
        else:
            what = "reused (finished earlier)" if reused else "finished"
            log.info("%s %s: best valid ppl %.2f, test ppl %.2f; %d of %d runs done, %s",
                     label, what, result["best_valid_ppl"], result["test_ppl"], self.runs_done,
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
    :class:`rnndrop.lm.run.progress.JobProgress`, if one is drawn), else a log line every
    tenth of the loop (e.g. when stderr goes to a file, or in a worker process of ``--jobs``
    whose bars would overwrite each other)."""

    def __init__(self, total: int, desc: str, enabled: bool, *, bar: bool = True) -> None:
        self.total, self.desc, self.count = total, desc, 0
        self.bar = None
        self.enabled = enabled
        if enabled and bar and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
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
            log.info("%s %d/%d %s", self.desc, self.count, self.total,
                     " ".join(f"{k}={v}" for k, v in text.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
