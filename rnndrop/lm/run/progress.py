"""Progress of a whole benchmark job: run k of n, regime, epoch e of E, and an ETA.

With one run at a time, tqdm installed and a terminal, :class:`JobProgress` draws one bar
for the job above the per-epoch bar of the training loop; otherwise (``--jobs > 1``, no
tqdm, stderr to a file, ``--no-progress``) it writes one log line per event (an epoch or a run finished), so
lines of parallel runs never interleave on one terminal line.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["EpochProgress", "JobProgress", "format_duration"]

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

    The ETA is the job's remaining epochs times the wall time per epoch trained so far in
    this process (evaluation and Monte-Carlo scoring included); before the first epoch it
    is ``estimate_seconds`` scaled by the share of the job left. When only whole runs are
    seen (runs in worker processes), runs take the place of epochs.
    """

    def __init__(self, total_runs: int, epochs: int, *, bar: bool,
                 estimate_seconds: float | None = None) -> None:
        self.total_runs, self.epochs = total_runs, epochs
        self.done_epochs = 0  # epochs trained in this process
        self.runs_started = 0
        self.runs_done = 0
        self.runs_trained = 0  # runs that trained here (not reused)
        self.next_epoch: int | None = None  # of the active run
        self.run_label = ""
        self.start = time.perf_counter()
        self.estimate = estimate_seconds
        self.bar = None
        if bar and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.total_epochs(), position=0, leave=True, dynamic_ncols=True,
                                bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
                                "epochs{postfix}")
            except ImportError:
                pass

    def remaining_epochs(self) -> int:
        active = 0 if self.next_epoch is None else max(0, self.epochs - self.next_epoch + 1)
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
            planned = max(1, self.epochs * self.total_runs)
            return self.estimate * self.remaining_epochs() / planned
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
        """A run begins (or resumes at ``first_epoch``) in this process; ``label`` names it
        (``"run 2/3 tied ... seed 1"``)."""
        self.runs_started += 1
        self.run_label = label
        self.next_epoch = first_epoch
        self._refresh()

    def epoch_done(self, epoch: int, record: Mapping[str, Any]) -> None:
        self.done_epochs += 1
        self.next_epoch = epoch + 1
        if self.bar is not None:
            self._refresh()
        else:
            log.info("%s: epoch %d/%d done (valid ppl %.2f); job %d%%, %s",
                     self.run_label, epoch, self.epochs,
                     record["valid_ppl"], 100 * self.done_epochs // self.total_epochs(), self._eta_text())

    def run_done(self, label: str, result: Mapping[str, Any], *, reused: bool = False) -> None:
        """A run ended: trained (here or in a worker), or ``reused`` from an earlier job."""
        if self.next_epoch is None:  # not announced by start_run (a worker's, or reused)
            self.runs_started += 1
        self.next_epoch = None
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


class EpochProgress:
    """A tqdm bar on a terminal when tqdm is installed (below the job's bar of
    :class:`rnndrop.lm.run.progress.JobProgress`, if one is drawn), else a log line every
    tenth of the loop (e.g. when stderr goes to a file)."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.count = total, desc, 0
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
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
