"""Which dropout a job's runs get, as text: ``--dropout`` parsed, a grid's choices read
back (``--dropout-from``), and the probabilities named in run folders and log lines."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from rnndrop.lm.model.regimes import SITES

__all__ = ["chosen_dropout", "format_tag", "parse_dropout", "run_tag"]

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
    return out


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
