"""Files that are either wholly old or wholly new: write beside, then ``os.replace``.

A run killed at any moment leaves the previous version of a checkpoint, result or
download in place, never a torn file. The temporary file is flushed to disk before
the rename and the folder after it (so the rename itself survives a power cut), and
the new file gets the permissions ``open()`` would give it (``0o666`` less the umask),
not the ``0o600`` of a temporary file. Temporaries left by a killed writer
(``.NAME.*.tmp``) are removed by :func:`remove_stale_temporaries`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_path",
    "atomic_write",
    "file_sha256",
    "fsync_folder",
    "remove_stale_temporaries",
    "unwritable",
    "write_json_atomic",
]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_folder(folder: str | Path) -> None:
    """Flush a folder's entries (renames, new files) to disk; a no-op where folders
    cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary file's path in ``path``'s folder, for a writer that takes a file name (safetensors);
    when the block ends without an error the file is flushed to disk and moved onto ``path``,
    otherwise it is removed."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as e:
        raise _naming(e, path) from None
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise _naming(e, path) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


@contextmanager
def atomic_write(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """Open a temporary file in ``path``'s folder; when the block ends without an error it
    is flushed to disk and moved onto ``path``, otherwise it is removed.

    Example::

        with atomic_write("results.json", "w", encoding="utf-8") as f:
            json.dump(obj, f)
    """
    with atomic_path(path) as tmp, open(tmp, mode, encoding=encoding) as f:
        yield f


def write_json_atomic(obj: Any, path: str | Path) -> None:
    """Write ``obj`` as JSON (indented, no NaN) through :func:`atomic_write`."""
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, allow_nan=False)
        f.write("\n")


def _naming(error: OSError, path: Path) -> OSError:
    """``error`` (disk full, quota, permissions) as an OSError of the same kind whose message
    names the file and says that what was written before is untouched."""
    reason = error.strerror or str(error)
    before = "its previous version is intact" if path.exists() else "no partial file is left"
    return type(error)(error.errno, f"cannot write {str(path)!r}: {reason}; {before}, and so is "
                                    "every file written before it")


def unwritable(path: str | Path, *, folder: bool = False) -> str | None:
    """Why a file (``folder``: a folder) cannot be written at ``path``, or None once shown that it
    can: the folder (a file's parent) is made where missing and a temporary file written there. For
    a command to say so before it measures or trains, not after."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        return f"it is a symbolic link to {os.readlink(path)!r}, which does not exist"
    if folder and path.exists() and not path.is_dir():
        return "it is a file, expected a folder"
    if not folder and path.is_dir():
        return "it is a folder, expected a file"
    where = path if folder else path.parent
    existing = where
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():  # mkdir would say "File exists"
        return f"{str(existing)!r} is a file, not a folder"
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Delete the ``.NAME.*.tmp`` files :func:`atomic_write` leaves when its process is
    killed mid-write; call it only while holding the folder (no writer is running).
    Returns the files removed."""
    removed = []
    for tmp in Path(folder).glob(".*.tmp"):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def file_sha256(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks: how a written file is recorded and
    later checked (checkpoints, pretrained folders)."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
