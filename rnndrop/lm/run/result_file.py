"""A run's result file (``results.json``): its schema, writing it atomically, reading
and checking it, and the machine facts it records (library versions, peak memory).

A run's JSON (schema :data:`SCHEMA`) holds the configuration, regime, dropout
probabilities, seed, per-epoch train / validation perplexity, test perplexity
(standard and Monte-Carlo), words per second, wall time, peak memory and library
versions.
"""

from __future__ import annotations

import json
import math
import platform
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import rnndrop
from rnndrop.lm.atomic import atomic_write

__all__ = ["REQUIRED_KEYS", "SCHEMA", "peak_memory", "read_result", "validate_result", "versions",
           "write_json_atomic"]

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
