"""One writer per run folder: a lock file created with ``O_EXCL``.

The lock file ``run.lock`` holds the holder's pid, host and start time. A second
writer is refused with :class:`RunLocked`, which names the holder. A lock left by a
process that died (same host, pid no longer alive) is stale and taken over with a
logged warning; a lock from another host is never broken automatically.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rnndrop.lm.atomic import remove_stale_temporaries
from rnndrop.lm.run.folder import LOCK

__all__ = ["RunLock", "RunLocked", "claim_folder"]

log = logging.getLogger(__name__)



class RunLocked(RuntimeError):
    """Another process is writing into the run folder."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


#: An unreadable lock younger than this may be one whose writer has not yet filled it in.
_UNREADABLE_GRACE_SECONDS = 10.0


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _read_holder(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int):
        return None
    return holder


class RunLock:
    """``with RunLock(folder):`` holds ``folder/run.lock`` for the block.

    Acquiring it also proves the folder is writable before any work starts.

    Raises:
        RunLocked: a live process (or one on another host) holds the lock.
        PermissionError: the folder cannot be written.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.held = False

    def _try_create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            return False
        except OSError as e:  # read-only folder or file system, full disk...
            raise PermissionError(
                f"output folder {str(self.folder)!r} is not writable ({e.strerror}); "
                "choose another folder or fix its permissions"
            ) from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
        return True

    def acquire(self) -> None:
        for _ in range(2):
            if self._try_create():
                self.held = True
                return
            holder = _read_holder(self.path)
            same_host = holder is not None and holder.get("host") == socket.gethostname()
            if holder is None and _age(self.path) < _UNREADABLE_GRACE_SECONDS:
                holder = {"pid": "(starting)", "host": "?", "since": "a moment ago"}
            elif holder is None or (same_host and not _alive(holder["pid"])):
                log.warning("%s: removing a stale lock %s", self.folder, holder or "(unreadable)")
                self.path.unlink(missing_ok=True)
                continue
            raise RunLocked(
                f"run folder {str(self.folder)!r} is in use by pid {holder['pid']} on "
                f"{holder.get('host')} since {holder.get('since')} ({self.path}); wait for that "
                "run to end, or choose another output folder (delete the lock file only if "
                "that process is really gone)"
            )
        raise RunLocked(f"run folder {str(self.folder)!r}: could not take {self.path}")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_folder(out: Path, stack: ExitStack) -> None:
    """Create ``out``, lock it until ``stack`` closes, and remove what a killed write left."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except PermissionError as e:
        raise PermissionError(f"output folder {str(out)!r} cannot be created ({e.strerror})") from None
    stack.enter_context(RunLock(out))
    removed = remove_stale_temporaries(out)
    if removed:
        log.warning("%s: removed %d temporary files left by a killed write: %s", out, len(removed),
                    ", ".join(p.name for p in removed))
