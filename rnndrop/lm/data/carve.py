"""The small real corpora of this project's results, carved from the official files.

The result pages train on ``ptb-mini``, ``ptb-144k`` and ``wikitext-2-mini``: slices of
lines of the official PTB files (Mikolov's ``simple-examples/data``: ``ptb.train.txt``,
``ptb.valid.txt``) and of WikiText-2's tokenised validation file (``wiki.valid.tokens``).
:func:`carve` makes any of them from those files, so that a reader with the official
data gets the same bytes::

    ptb-mini         train / valid / test = lines 1-2700 / 2701-3035 / 3036-3370 of ptb.valid.txt
    ptb-144k         train = lines 1-6778 of ptb.train.txt;
                     valid / test = lines 1-1685 / 1686-3370 of ptb.valid.txt
    wikitext-2-mini  train / valid / test = lines 1-3008 / 3009-3384 / 3385-3760 of wiki.valid.tokens

The official test files play no part.
"""

from __future__ import annotations

import io
from pathlib import Path

from rnndrop.atomic import atomic_write

__all__ = ["CARVINGS", "CarveError", "carve"]

# corpus -> output file -> (the official files it may come from, first line, last line), 1-based
CARVINGS: dict[str, dict[str, tuple[tuple[str, ...], int, int]]] = {
    "ptb-mini": {
        "ptb.train.txt": (("ptb.valid.txt",), 1, 2700),
        "ptb.valid.txt": (("ptb.valid.txt",), 2701, 3035),
        "ptb.test.txt": (("ptb.valid.txt",), 3036, 3370),
    },
    "ptb-144k": {
        "ptb.train.txt": (("ptb.train.txt",), 1, 6778),
        "ptb.valid.txt": (("ptb.valid.txt",), 1, 1685),
        "ptb.test.txt": (("ptb.valid.txt",), 1686, 3370),
    },
    "wikitext-2-mini": {
        "train.txt": (("wiki.valid.tokens", "valid.txt"), 1, 3008),
        "valid.txt": (("wiki.valid.tokens", "valid.txt"), 3009, 3384),
        "test.txt": (("wiki.valid.tokens", "valid.txt"), 3385, 3760),
    },
}

#: lines of the official files a carving reads from (a check that they are the right files)
_OFFICIAL_LINES = {
    "ptb.train.txt": 42068, "ptb.valid.txt": 3370, "wiki.valid.tokens": 3760, "valid.txt": 3760,
}


class CarveError(ValueError):
    """The official files are missing or are not the expected ones, or the output exists."""


def carve(corpus: str, official: str | Path, out: str | Path) -> list[Path]:
    """Write ``corpus`` (a key of :data:`CARVINGS`) into the folder ``out`` from the
    official files in the folder ``official``; returns the files written.

    Raises:
        CarveError: an unknown corpus, an official file missing or of the wrong length,
            or an ``out`` that already holds one of the files (nothing is overwritten).
    """
    if corpus not in CARVINGS:
        raise CarveError(f"corpus must be one of {', '.join(CARVINGS)}, got {corpus!r}")
    official, out = Path(official), Path(out)
    plan = CARVINGS[corpus]
    lines = {name: _official_lines(official, names) for name, (names, _, _) in plan.items()}
    taken = [name for name in plan if (out / name).exists()]
    if taken:
        raise CarveError(f"{out} already holds {', '.join(taken)}; carve into an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (_, first, last) in plan.items():
        with atomic_write(out / name, "w", encoding="utf-8") as f:
            f.writelines(lines[name][first - 1:last])
        written.append(out / name)
    return written


def _official_lines(folder: Path, names: tuple[str, ...]) -> list[str]:
    for name in names:
        path = folder / name
        if path.is_file():
            data = path.read_bytes()
            try:
                lines = io.StringIO(data.decode("utf-8"), newline="").readlines()  # as open() splits
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                raise CarveError(f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}, "
                                 f"line {line}): the official files are UTF-8; is it another version "
                                 "or a converted copy?") from None
            if len(lines) != _OFFICIAL_LINES[name]:
                raise CarveError(f"{path} has {len(lines):,} lines; the official file has "
                                 f"{_OFFICIAL_LINES[name]:,}: is it another version?")
            return lines
    raise CarveError(f"{folder} holds no {' or '.join(names)} (the official file this corpus is "
                     "carved from)")
