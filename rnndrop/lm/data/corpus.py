"""Word-level corpora for language modelling: reading, vocabulary, batching.

A corpus directory holds three split files in one of the standard layouts:

- Penn Treebank (Mikolov's ``simple-examples``): ``ptb.train.txt``, ``ptb.valid.txt``,
  ``ptb.test.txt``;
- WikiText-2 (tokenised): ``train.txt`` / ``valid.txt`` / ``test.txt`` or
  ``wiki.train.tokens`` / ``wiki.valid.tokens`` / ``wiki.test.tokens``.

Every line is split on white space and ends with ``<eos>``. The vocabulary is
built from the training split only; words of the validation and test splits that
never occur in training become ``<unk>``.

Batching follows Zaremba et al. (2014): a split is one long stream of word ids cut
into ``B`` contiguous columns (``[N, B]``), and truncated BPTT walks down the rows,
so the hidden state at the end of one segment is the right start for the next.
"""

from __future__ import annotations

import errno
import functools
import io
import logging
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rnndrop.validation import check_positive_int

__all__ = [
    "EOS",
    "SPLITS",
    "SPLIT_LAYOUTS",
    "UNK",
    "Corpus",
    "CorpusError",
    "Vocabulary",
    "batchify",
    "bptt_batches",
    "cached_corpus",
    "check_words",
    "encode_split",
    "find_split_files",
    "load_corpus",
    "num_bptt_batches",
    "read_words",
    "sample_dir",
]

#: The bundled samples (package data, see ``rnndrop/lm/data/NOTICE.md``) by corpus name.
SAMPLES: dict[str, str] = {"ptb": "ptb-sample", "wikitext-2": "wikitext-2-sample"}

#: A validation or test split with more than this share of ``<unk>`` gets a warning:
#: its vocabulary hardly overlaps the training split's (a wrong file, or another corpus).
UNK_WARNING_SHARE = 0.5

log = logging.getLogger(__name__)

EOS = "<eos>"
UNK = "<unk>"
SPLITS: tuple[str, ...] = ("train", "valid", "test")

#: File name patterns of the known layouts, tried in this order.
SPLIT_LAYOUTS: tuple[str, ...] = ("ptb.{split}.txt", "{split}.txt", "wiki.{split}.tokens")


class CorpusError(ValueError):
    """A corpus directory or file that cannot be used (missing, incomplete, empty)."""


def find_split_files(directory: str | Path) -> dict[str, Path]:
    """The train / valid / test files of the first layout in ``directory`` that has any.

    Raises:
        CorpusError: the directory does not exist, holds no known layout, or lacks
            some split of the layout it holds.
    """
    directory = Path(directory).expanduser()
    if not directory.exists():
        raise CorpusError(
            f"data directory {str(directory)!r} does not exist; expected a folder holding "
            "ptb.{train,valid,test}.txt (Penn Treebank) or {train,valid,test}.txt / "
            "wiki.{train,valid,test}.tokens (WikiText-2)"
        )
    if not directory.is_dir():
        raise CorpusError(f"data directory {str(directory)!r} is a file, expected a folder")
    complete: list[dict[str, Path]] = []
    for layout in SPLIT_LAYOUTS:
        paths = {split: directory / layout.format(split=split) for split in SPLITS}
        for path in paths.values():
            _check_link(path)
        present = [split for split, path in paths.items() if path.exists()]
        if not present:
            continue
        not_files = [paths[split].name for split in present if not paths[split].is_file()]
        if not_files:
            raise CorpusError(f"data directory {str(directory)!r}: {', '.join(not_files)} is not a file")
        missing = [paths[split].name for split in SPLITS if split not in present]
        if missing:
            raise CorpusError(
                f"data directory {str(directory)!r} lacks {', '.join(missing)} "
                f"(found {', '.join(paths[s].name for s in present)}); all three splits are needed"
            )
        complete.append(paths)
    if len(complete) > 1:  # which corpus it is would be a guess (a wikitext2 job read PTB's files)
        found = " and ".join(", ".join(p.name for p in paths.values()) for paths in complete)
        raise CorpusError(f"data directory {str(directory)!r} holds the splits of two corpora ({found}); "
                          "keep one corpus in a folder")
    if complete:
        return complete[0]
    listing = sorted(p.name for p in directory.iterdir())[:10]
    raise CorpusError(
        f"data directory {str(directory)!r} holds no corpus split files: expected "
        "ptb.{train,valid,test}.txt, {train,valid,test}.txt or wiki.{train,valid,test}.tokens, "
        f"found {listing or 'nothing'}"
    )


def _check_link(path: Path) -> None:
    """CorpusError for a split file that is a symbolic link going nowhere: one that loops (to
    itself, or through other links) or one whose target does not exist, said as such rather
    than as a missing file."""
    if not path.is_symlink() or path.exists():
        return
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorpusError(f"corpus file {str(path)!r} is a symbolic link loop (it points to "
                              f"{os.readlink(path)!r}, which leads back to itself); replace it with the "
                              "file or a link to it") from None
    raise CorpusError(f"corpus file {str(path)!r} is a symbolic link to {os.readlink(path)!r}, which "
                      "does not exist; replace it with the file or a link to it")


def read_words(path: str | Path) -> list[str]:
    """The words of a UTF-8 text file, with ``<eos>`` at the end of every line.

    A byte-order mark at the start of the file is dropped (it is not a word).

    Raises:
        CorpusError: the file is not valid UTF-8 (the message names the file and the
            position of the first bad byte).
    """
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise CorpusError(
            f"corpus file {str(path)!r} is not UTF-8 text: byte 0x{data[e.start]:02x} on line {line}; "
            "convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    words: list[str] = []
    for line in io.StringIO(text, newline=None):  # universal newlines, as open() reads
        words.extend(line.split())
        words.append(EOS)
    return words


class Vocabulary:
    """A bijection between words and ids 0..V-1.

    Built by :meth:`from_words`: the most frequent words get the smallest ids (ties
    broken alphabetically, so the same text gives the same ids); ``<eos>`` and
    ``<unk>`` are always present.
    """

    def __init__(self, words: Sequence[str]) -> None:
        if len(set(words)) != len(words):
            raise ValueError("words must not repeat")
        if UNK not in words:
            raise ValueError(f"words must contain the unknown-word token {UNK!r}")
        self.itos: list[str] = list(words)
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        self.unk_id = self.stoi[UNK]

    @classmethod
    def from_words(cls, words: Sequence[str]) -> Vocabulary:
        counts = Counter(words)
        counts.setdefault(EOS, 0)
        counts.setdefault(UNK, 0)
        return cls(sorted(counts, key=lambda w: (-counts[w], w)))

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, words: Sequence[str]) -> Tensor:
        """Word ids ``[len(words)]`` (int64); unknown words map to ``<unk>``."""
        check_words("words", words)
        unk = self.unk_id
        return torch.tensor([self.stoi.get(w, unk) for w in words], dtype=torch.long)

    def decode(self, ids: Sequence[int] | Tensor) -> list[str]:
        """The words of ``ids``, each in ``[0, len(self))``."""
        ids = [int(i) for i in ids]
        wrong = [i for i in ids if not 0 <= i < len(self.itos)]
        if wrong:
            raise ValueError(f"ids must be in [0, {len(self.itos)}) (the vocabulary's size), got {wrong[:5]}")
        return [self.itos[i] for i in ids]


def check_words(name: str, words: Any) -> None:
    """TypeError for a string where a sequence of words is expected: iterated, it would be read as
    one word per character."""
    if isinstance(words, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of words, got a string {words[:40]!r}: split it "
                        f"first ({name}.split())")


@dataclass
class Corpus:
    """The three splits of a corpus as word-id streams ``[N]`` (int64)."""

    vocab: Vocabulary
    train: Tensor
    valid: Tensor
    test: Tensor
    source: str = ""
    #: Words of valid / test that were not in the training vocabulary (mapped to <unk>).
    unseen: dict[str, int] | None = None

    def split(self, name: str) -> Tensor:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return getattr(self, name)

    def summary(self) -> dict[str, int | str]:
        """Sizes for logs and result files."""
        out: dict[str, int | str] = {"source": self.source, "vocab_size": len(self.vocab)}
        for split in SPLITS:
            out[f"{split}_tokens"] = int(self.split(split).numel())
        for split, n in (self.unseen or {}).items():
            out[f"{split}_unseen_words"] = n
        return out


def load_corpus(directory: str | Path, *, warn: bool = True) -> Corpus:
    """Read the three splits of ``directory`` (see :func:`find_split_files`); a valid or test split
    mostly ``<unk>`` for the training split's vocabulary is said in a log warning unless not ``warn``
    (a folder read only to tell whether it holds some corpus).

    Raises:
        CorpusError: missing directory or files, or a split with no words.
    """
    paths = find_split_files(directory)
    words = {split: read_words(path) for split, path in paths.items()}
    for split, ws in words.items():
        if not any(w != EOS for w in ws):
            raise CorpusError(f"{split} split file {str(paths[split])!r} holds no words")
    vocab = Vocabulary.from_words(words["train"])
    unseen = {
        split: sum(w not in vocab.stoi for w in words[split]) for split in ("valid", "test")
    }
    for split, n in unseen.items():
        if warn:
            _warn_if_mostly_unknown(paths[split], words[split], vocab, n)
    return Corpus(
        vocab=vocab,
        train=vocab.encode(words["train"]),
        valid=vocab.encode(words["valid"]),
        test=vocab.encode(words["test"]),
        source=str(Path(directory).expanduser().resolve()),  # absolute: readable from anywhere
        unseen=unseen,
    )


@functools.lru_cache(maxsize=2)
def cached_corpus(data_dir: str) -> Corpus:
    """:func:`load_corpus` of ``data_dir``, read once per process: the command line checks the
    corpus with it before a job starts, and the job's runs then find it read."""
    return load_corpus(data_dir)


def _warn_if_mostly_unknown(path: Path, words: Sequence[str], vocab: Vocabulary, unseen: int) -> None:
    unknown = unseen + sum(w == UNK for w in words)
    share = unknown / max(1, sum(w != EOS for w in words))
    if share > UNK_WARNING_SHARE:
        log.warning(
            "%s: %.0f%% of its words are <unk> for a vocabulary of %d words from the training "
            "split; is it a split of the same corpus?", path, 100 * share, len(vocab),
        )


def encode_split(directory: str | Path, split: str, vocab: Vocabulary) -> Tensor:
    """The ``split`` of the corpus in ``directory`` as word ids of ``vocab`` (a trained
    model's vocabulary; words it lacks become ``<unk>``, with a warning when most do)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = find_split_files(directory)[split]
    words = read_words(path)
    if not any(w != EOS for w in words):
        raise CorpusError(f"{split} split file {str(path)!r} holds no words")
    _warn_if_mostly_unknown(path, words, vocab, sum(w not in vocab.stoi for w in words))
    return vocab.encode(words)


def sample_dir(name: str) -> Path:
    """The folder of the small real sample of ``name`` (``"ptb"`` or ``"wikitext-2"``)
    shipped with the package (see ``NOTICE.md`` beside it for its source and licence)."""
    if name not in SAMPLES:
        raise ValueError(f"name must be one of {', '.join(map(repr, SAMPLES))}, got {name!r}")
    return Path(__file__).resolve().parent / SAMPLES[name]


def batchify(data: Tensor, batch_size: int, *, split: str = "a split",
             size_name: str = "batch_size") -> Tensor:
    """Cut a stream ``[N]`` into ``batch_size`` contiguous columns: ``[N // batch_size, B]``.

    Column ``b`` holds words ``b * rows ... (b + 1) * rows - 1``; the last
    ``N % batch_size`` words are dropped. ``split`` and ``size_name`` name the stream and the
    setting in the error of a stream too short.
    """
    check_positive_int(size_name, batch_size)
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D stream of word ids, got shape {list(data.shape)}")
    rows = data.numel() // batch_size
    if rows < 2:
        setting = f"{size_name}={batch_size}"
        if size_name == "eval_batch_size":  # a setting of the config, no command-line flag
            setting += " (the config's evaluation batch, not --batch-size)"
        raise CorpusError(
            f"{split} of {data.numel()} words is too short for {setting}: {batch_size} columns of at "
            f"least 2 words need {2 * batch_size}"
        )
    return data[: rows * batch_size].view(batch_size, rows).t().contiguous()


def bptt_batches(batched: Tensor, bptt: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Truncated-BPTT segments of a batched stream ``[N, B]``, top to bottom.

    Yields ``(inputs, targets)``, both ``[T, B]`` with ``T <= bptt`` (the last segment
    may be shorter); ``targets`` are ``inputs`` shifted one word ahead.
    """
    check_positive_int("bptt", bptt)
    n = batched.shape[0]
    for start in range(0, n - 1, bptt):
        length = min(bptt, n - 1 - start)
        yield batched[start : start + length], batched[start + 1 : start + 1 + length]


def num_bptt_batches(batched: Tensor, bptt: int) -> int:
    """How many segments :func:`bptt_batches` yields."""
    return -(-(batched.shape[0] - 1) // bptt)
