"""A run's per-epoch metrics: ``metrics.csv`` and, when the optional ``tensorboard``
package is installed, TensorBoard scalars in ``tensorboard/``."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rnndrop.lm.atomic import atomic_write
from rnndrop.lm.run.folder import METRICS

__all__ = ["METRICS_COLUMNS", "EpochLog"]

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


def _write_metrics(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=METRICS_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(buffer.getvalue())


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

