"""Atomic checkpoints of a training run: state dicts, optimizer, RNG states, progress.

Files are written to a temporary file in the same folder and moved into place with
``os.replace``, so a run killed at any moment leaves either the old or the new file,
never a torn one. Only state dicts and plain data are stored (loaded with
``weights_only=True``), never pickled modules.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from rnndrop.lm.atomic import atomic_write

__all__ = ["get_rng_state", "load_checkpoint", "save_atomic", "set_rng_state"]


def save_atomic(obj: Any, path: str | Path) -> None:
    """``torch.save(obj, path)`` through a temporary file and ``os.replace``."""
    with atomic_write(path) as f:
        torch.save(obj, f)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint written by :func:`save_atomic` (tensors on the CPU)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return torch.load(path, map_location="cpu", weights_only=True)


def get_rng_state() -> dict[str, Any]:
    """The states of torch's CPU and CUDA generators and of Python's ``random``."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    python = state["python"]
    # weights_only loading turns the inner tuple into a list; random wants tuples.
    random.setstate((python[0], tuple(python[1]), python[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
