"""Files that are either wholly old or wholly new: write beside, then ``os.replace``.

A run killed at any moment leaves the previous version of a checkpoint, result or
download in place, never a torn file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["atomic_write"]


@contextmanager
def atomic_write(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """Open a temporary file in ``path``'s folder; when the block ends without an error it
    is flushed to disk and moved onto ``path``, otherwise it is removed.

    Example::

        with atomic_write("results.json", "w", encoding="utf-8") as f:
            json.dump(obj, f)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
