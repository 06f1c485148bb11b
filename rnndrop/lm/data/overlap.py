"""Whether two splits share text: dropout chosen on one corpus' validation split must not be
reported on another's test split that holds the same lines.

Carved corpora can overlap without their names saying so: the offline ``ptb-mini`` and
``ptb-144k`` are both cut from the official PTB validation file (``../shared/data/README.md``),
and ``ptb-mini``'s validation lines are a fifth of ``ptb-144k``'s test split. A grid run
(``--grid``) records a fingerprint of every line of the validation split it chose on
(:func:`split_fingerprints`); ``--dropout-from`` compares them with the test split it is about
to report (:func:`tuned_on_test`).

A line is compared by the SHA-256 of its words (whitespace normalised), and only lines of at
least :data:`MIN_WORDS` words: short lines (``N N``, a header) recur in unrelated text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from rnndrop.lm.data.corpus import EOS, find_split_files, read_words

__all__ = ["MIN_WORDS", "MOST", "line_fingerprints", "shared_lines", "split_fingerprints", "tuned_on_test"]

#: Lines shorter than this many words are not compared.
MIN_WORDS = 5


def line_fingerprints(lines: Iterable[list[str]]) -> set[str]:
    """The fingerprints (16 hex digits of a SHA-256) of the lines of at least :data:`MIN_WORDS`
    words; each line a list of words."""
    return {hashlib.sha256(" ".join(words).encode("utf-8")).hexdigest()[:16]
            for words in lines if len(words) >= MIN_WORDS}


def _lines(path: Path) -> list[list[str]]:
    lines, current = [], []
    for word in read_words(path):  # the corpus reader's words: <eos> ends every line
        if word == EOS:
            lines.append(current)
            current = []
        else:
            current.append(word)
    return lines


def split_fingerprints(directory: str | Path, split: str) -> set[str]:
    """:func:`line_fingerprints` of split ``split`` (``"valid"``, ``"test"``...) of the corpus in
    ``directory``."""
    return line_fingerprints(_lines(find_split_files(directory)[split]))


def shared_lines(tuned: set[str], reported: set[str]) -> int:
    """How many of the lines ``reported`` (a test split's fingerprints) the tuning text holds."""
    return len(tuned & reported)


#: The share of the tuning split's lines in a test split from which it counts as tuned on test
#: text. A split carved out of the same text lies there whole (ptb-mini's validation split in
#: ptb-144k's test split: all of it); sentences that merely recur (short stock phrases, a small
#: grammar) stay far below.
MOST = 0.5


def tuned_on_test(tuned: set[str], reported: set[str]) -> bool:
    """Whether most of the tuning split's lines (:data:`MOST`) are lines of the test split."""
    return bool(tuned) and shared_lines(tuned, reported) > MOST * len(tuned)
