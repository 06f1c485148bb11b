"""Result files of language-model runs: JSON per run, per-epoch metrics, Markdown, plots.

A run's JSON (``results.json``, schema :data:`SCHEMA`) holds the configuration,
regime, dropout probabilities, seed, per-epoch train / validation perplexity, test
perplexity (standard and Monte-Carlo), words per second, wall time, peak memory and
library versions. It is written atomically. Beside it, :class:`EpochLog` keeps
``metrics.csv`` (one row per epoch) and, when the optional ``tensorboard`` package is
installed, TensorBoard scalars in ``tensorboard/``. A benchmark's tables
(:func:`benchmark_markdown`) and learning curves (:func:`plot_learning_curves`) are
made from the runs' results.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import platform
import resource
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rnndrop.lm.run.atomic import atomic_write
from rnndrop.lm.run.folder import METRICS

log = logging.getLogger(__name__)

__all__ = [
    "METRICS_COLUMNS",
    "SCHEMA",
    "EpochLog",
    "benchmark_markdown",
    "comparison_table",
    "format_dropout",
    "learning_curve_figure",
    "markdown_table",
    "paired_differences",
    "peak_memory",
    "plot_learning_curves",
    "read_result",
    "validate_result",
    "versions",
    "write_json_atomic",
]

SCHEMA = "rnndrop.lm.result/1"

#: File name of a run's per-epoch metrics.
#: Its columns; ``elapsed_seconds`` is the training time so far (the sum of the epochs'
#: ``seconds``, evaluation excluded), so it survives an interrupted and resumed run.
METRICS_COLUMNS: tuple[str, ...] = (
    "epoch", "lr", "train_ppl", "valid_ppl", "words_per_second", "seconds", "elapsed_seconds",
)

#: Keys every results.json has.
REQUIRED_KEYS: tuple[str, ...] = (
    "schema", "dataset", "config", "regime", "dropout", "seed", "epochs", "best_epoch",
    "best_valid_ppl", "test_ppl", "test_ppl_mc", "mc_samples", "words_per_second",
    "wall_seconds", "peak_memory_bytes", "versions",
)


def write_json_atomic(obj: Any, path: str | Path) -> None:
    """Write ``obj`` as JSON through a temporary file and ``os.replace``."""
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, allow_nan=False)
        f.write("\n")


def read_result(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return validate_result(json.load(f))


def validate_result(result: Mapping[str, Any]) -> dict[str, Any]:
    """Check the shape of a run's result; return it as a dict or raise ValueError."""
    missing = [k for k in REQUIRED_KEYS if k not in result]
    if missing:
        raise ValueError(f"result lacks {', '.join(missing)}")
    if result["schema"] != SCHEMA:
        raise ValueError(f"result schema must be {SCHEMA!r}, got {result['schema']!r}")
    epochs = result["epochs"]
    if not isinstance(epochs, list) or not epochs:
        raise ValueError("result['epochs'] must be a non-empty list of per-epoch records")
    for record in epochs:
        for key in ("epoch", "lr", "train_ppl", "valid_ppl"):
            if key not in record:
                raise ValueError(f"epoch record lacks {key!r}: {record}")
    for key in ("best_valid_ppl", "test_ppl", "words_per_second"):
        value = result[key]
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"result[{key!r}] must be a positive finite number, got {value!r}")
    return dict(result)


def versions() -> dict[str, str]:
    import rnndrop

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "rnndrop": rnndrop.__version__,
        "platform": platform.platform(),
        "processor": platform.machine(),
    }


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak memory in bytes and what it measures (CUDA allocations, or the process's RSS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return int(rss * scale), "peak resident set size of the process (ru_maxrss)"


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
        mc_text = f"{_mean_sd(mc)} (S={first['mc_samples']})" if len(mc) == len(runs) else "—"
        lines.append(
            "| {regime} | {dropout} | {seeds} | {epoch} | {valid} | {test} | {mc} | {wps} | {wall} |".format(
                regime=first["regime"],
                dropout=format_dropout(first["dropout"]),
                seeds=", ".join(str(r["seed"]) for r in runs),
                epoch=", ".join(str(r["best_epoch"]) for r in runs),
                valid=_mean_sd([r["best_valid_ppl"] for r in runs]),
                test=_mean_sd([r["test_ppl"] for r in runs]),
                mc=mc_text,
                wps=f"{statistics.mean(r['words_per_second'] for r in runs):,.0f}",
                wall=f"{statistics.mean(r['wall_seconds'] for r in runs) / 60:.1f}",
            )
        )
    return "\n".join(lines) + "\n"


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

        def delta(diffs: dict[str, list[float]], regime: str = regime) -> str:
            if regime == baseline:
                return "0"
            return _mean_sd(diffs[regime], signed=True) if regime in diffs else "—"

        epochs = ", ".join(
            f"{r['best_epoch']}/{r.get('epochs_run', len(r['epochs']))}"
            + ("" if r.get("converged", True) else " cap")
            for r in runs
        )
        lines.append(
            f"| {regime} | {epochs} | {column('test_ppl')} | {delta(diff)} | {column('test_ppl_mc')} | "
            f"{delta(diff_mc)} | {column('test_ece', 100, 2)} | {column('test_ece_mc', 100, 2)} | "
            f"{column('test_nll', 1, 3)} | {column('test_nll_mc', 1, 3)} |"
        )
    return "\n".join(lines) + "\n"


def _plot_title(results: Sequence[Mapping[str, Any]]) -> str:
    first = results[0]
    cfg = first.get("config", {})
    corpus = first.get("corpus", {})
    source = Path(str(corpus.get("source", ""))).name
    what = first.get("dataset") or "corpus"
    if source:
        what += f" ({source})"
    cell = str(cfg.get("cell", "lstm")).upper()
    model = (f"{cfg.get('num_layers', '?')}×{cfg.get('hidden_size', '?')} {cell}, "
             f"emb {cfg.get('embedding_size', '?')}")
    train = (f"{cfg.get('optimizer', 'sgd')} lr {cfg.get('lr', '?'):g}, batch {cfg.get('batch_size', '?')}, "
             f"bptt {cfg.get('bptt', '?')}") if isinstance(cfg.get("lr"), (int, float)) else ""
    return f"{what}, config {cfg.get('name', '?')}: {model}" + (f"\n{train}" if train else "")


def learning_curve_figure(results: Sequence[Mapping[str, Any]]):
    """A matplotlib figure of train (dashed, ×) and validation (solid, ●) perplexity per
    epoch of every run, titled with the corpus and the config (matplotlib required)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.8))
    for i, r in enumerate(results):
        epochs = [e["epoch"] for e in r["epochs"]]
        label = f"{r['regime']} ({format_dropout(r['dropout'])}, seed {r['seed']})"
        color = f"C{i % 10}"
        ax.plot(epochs, [e["valid_ppl"] for e in r["epochs"]], color=color, marker="o",
                markersize=4, label=label)
        ax.plot(epochs, [e["train_ppl"] for e in r["epochs"]], color=color, marker="x",
                markersize=4, linestyle="--")
    ax.set_xlabel("epoch")
    last = max((e["epoch"] for r in results for e in r["epochs"]), default=1)
    ax.set_xlim(0.5, last + 0.5)  # a range of at least one epoch, so every tick is an epoch
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylabel("perplexity (solid ●: valid, dashed ×: train)")
    ax.set_yscale("log")
    ax.set_title(_plot_title(results), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_learning_curves(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """:func:`learning_curve_figure` as a PNG at ``path`` (written atomically); every epoch
    is a marker, so a one-epoch run shows too.

    Returns the path, or None when matplotlib is not installed or there is nothing to plot.
    """
    if not results:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no learning curves at %s "
                    "(pip install 'rnndrop[bench]')", path)
        return None
    fig = learning_curve_figure(results)
    path = Path(path)
    try:
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path


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
