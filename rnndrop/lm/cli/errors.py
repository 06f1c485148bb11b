"""How the command line fails: exit statuses, the usage error, the one line on stderr."""

from __future__ import annotations

import os
import sys

__all__ = ["EXIT_DATA", "EXIT_DIVERGED", "EXIT_INTERRUPTED", "UsageError", "check_seed", "check_threads",
           "fail", "lost_peer", "out_of_memory", "positive"]

EXIT_DATA = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A problem with the command line or the data, reported in one line (exit 2)."""


def fail(message: str, code: int, *, every_rank: bool = False) -> SystemExit:
    """Write ``error: <message>`` (on one line) to stderr; returns the SystemExit to raise.

    Under torchrun rank 0 alone reports what every rank meets (the arguments, the files rank 0
    reads for all); ``every_rank`` for what a rank may meet alone (its own data, a step that failed
    there), which another rank writes as ``error (rank N): <message>``: rank 0 would not know it."""
    rank = os.environ.get("RANK", "0")
    if rank == "0" or (every_rank and message):
        where = "" if rank == "0" else f" (rank {rank})"
        sys.stderr.write(f"error{where}: " + " ".join(str(message).split()) + "\n")
    return SystemExit(code)


#: What gloo and NCCL say on a rank whose peer has gone (its process ended with its own error).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def lost_peer(error: BaseException) -> str | None:
    """The one line for a collective that failed because another process of the job ended, or
    None for any other error: that process wrote its own error; a traceback here hides it."""
    text = str(error).strip()
    if not isinstance(error, RuntimeError) or not any(sign in text for sign in _PEER_LOST):
        return None
    first = " ".join(text.splitlines()[0].split())[:200]
    return (f"another process of the job stopped ({first}); its error is in the lines above or in "
            "torchrun's report")


def positive(name: str, value: int | None, minimum: int = 1, maximum: int | None = None) -> None:
    """Raise UsageError unless ``value`` is None or at least ``minimum`` (and at most ``maximum``)."""
    if value is not None and value < minimum:
        raise UsageError(f"{name} must be >= {minimum}, got {value}")
    if value is not None and maximum is not None and value > maximum:
        raise UsageError(f"{name} must be <= {maximum}, got {value}")


#: The most torch threads a run takes: far more than any machine's cores, and under what makes
#: OpenMP fail to create them (20,000 here) or crash the process (100,000).
MOST_THREADS = 1024


def check_threads(value: int | None) -> None:
    """Raise UsageError unless ``--threads`` is None or in [1, :data:`MOST_THREADS`]."""
    positive("--threads", value, 1, MOST_THREADS)


#: The seeds that give runs of their own: torch's CPU generator keeps the low 32 bits of a seed
#: (``manual_seed(1)`` and ``manual_seed(2**32 + 1)`` draw the same numbers), so a wider range
#: would repeat another seed's run under another name; wider than torch takes overflowed in torch.
SEED_RANGE = (0, 2**32 - 1)


def check_seed(name: str, value: int) -> int:
    """Raise UsageError unless ``value`` is a seed of :data:`SEED_RANGE`; returns it."""
    low, high = SEED_RANGE
    if not low <= value <= high:
        raise UsageError(f"{name} must be seeds in [{low}, {high}] (torch's CPU generator keeps a seed's low "
                         f"32 bits: a wider one repeats another seed's run), got {value}")
    return value


def out_of_memory(error: BaseException) -> str | None:
    """The one line for an allocation that failed (torch's allocator on the CPU or a GPU, or
    Python's), or None for any other error: the sizes asked for, not a bug, so no traceback."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and (
            "out of memory" in text.lower() or "can't allocate memory" in text)):
        return (f"out of memory ({' '.join(text.split())[:200]}): the model or its batches are too large for "
                "this machine; try a smaller --hidden-size, --emb-size, --batch-size or --bptt (finished "
                "epochs are kept)")
    return None
