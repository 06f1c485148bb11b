"""Result files of language-model runs: JSON per run, a Markdown table, learning curves.

A run's JSON (``results.json``, schema :data:`SCHEMA`) holds the configuration,
regime, dropout probabilities, seed, per-epoch train / validation perplexity, test
perplexity (standard and Monte-Carlo), words per second, wall time, peak memory and
library versions. It is written atomically.
"""

from __future__ import annotations

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

from rnndrop.lm.atomic import atomic_write

log = logging.getLogger(__name__)

__all__ = [
    "SCHEMA",
    "format_dropout",
    "markdown_table",
    "peak_memory",
    "plot_learning_curves",
    "read_result",
    "validate_result",
    "versions",
    "write_json_atomic",
]

SCHEMA = "rnndrop.lm.result/1"

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


def _mean_sd(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


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


def plot_learning_curves(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Train (dashed) and validation (solid) perplexity per epoch of every run, as a PNG.

    Returns the path, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no learning curves at %s "
                    "(pip install 'rnndrop[bench]')", path)
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(results):
        epochs = [e["epoch"] for e in r["epochs"]]
        label = f"{r['regime']} ({format_dropout(r['dropout'])}, seed {r['seed']})"
        color = f"C{i % 10}"
        ax.plot(epochs, [e["valid_ppl"] for e in r["epochs"]], color=color, label=label)
        ax.plot(epochs, [e["train_ppl"] for e in r["epochs"]], color=color, linestyle="--")
    ax.set_xlabel("epoch")
    ax.set_ylabel("perplexity (solid: valid, dashed: train)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path
