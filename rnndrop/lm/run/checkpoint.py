"""What a training run reads and writes: its folder, checkpoints, progress, identity and results.

A run folder (one regime, one seed) holds::

    checkpoint.pt        the newest training state (model, optimizer, RNG, progress)
    checkpoint.prev.pt   the state before it, kept while the newest is written
    best.pt              the weights of the best validation epoch, with what rebuilds the model
    results.json         the finished run's numbers, signed (SHA-256 of the content)
    metrics.csv          one row per epoch
    curve.png            the run's learning curve (alphas.png: learned noise, when there is some)
    run.lock             held while a process trains in the folder

Every file names the run it belongs to: the checkpoints hold its identity (:func:`run_identity`)
and its id (:func:`run_id`); results.json holds both, and the SHA-256 of the ``best.pt`` and the
``metrics.csv`` it vouches for (``files``). ``--resume`` and ``evaluate`` check what they read
against them: a ``best.pt`` of another run is refused (flagged, in a finished run whose numbers
stand), a deleted ``metrics.csv`` is written again from the run's history, an edited one is set
aside as ``metrics.edited.csv`` and written again.

A job folder (``rnndrop-lm ptb``: several regimes and seeds) holds the run folders and
``summary.json``, ``results.md`` and ``learning_curves.png``, which cover every finished run in
it; ``job.lock`` is held while a job runs there (:class:`JobLock`: one job per folder).

``checkpoint.pt`` and ``best.pt`` share one format (3): what :func:`torch.save` writes, a dict
of tensors and plain data that ``torch.load(path, weights_only=True)`` reads as it is, with one
more entry, ``"rnndrop_checkpoint"`` (:data:`INTEGRITY`)::

    {"format": 3, "sha256": <SHA-256 of the other entries' content>, "run_id": <the run's id>}

Files of format 2, written by earlier versions (a text header ``RNNDROP-CHECKPOINT``, ``format 2``,
``sha256``, ``size``, then the payload) are read and verified as before, never written.

:func:`load_checkpoint` loads with ``weights_only=True`` (state dicts and plain data only, never
pickled code) and checks the SHA-256 of the content (format 2: of the payload, before loading).
A zero-byte, truncated, corrupted or foreign file is a
:class:`CheckpointError` that names the file. :func:`save_checkpoint` writes through a
temporary file, reads it back and verifies it, and only then moves the previous version
aside (``checkpoint.prev.pt``) and the new one into place, so a verified checkpoint exists
at every moment.

What makes two runs the same run is :func:`run_identity`: a checkpoint resumes
(:func:`read_checkpoint`), and a results.json is reused (:func:`finished_result`), only
under an equal identity. One writer per folder: :class:`RunLock` (a lock file created with
``O_EXCL``; a stale one, left by a dead process on this host, is taken over with a warning).

Under ``torchrun`` rank 0 alone touches the files: the functions that take a ``ctx``
(:func:`claim_folder`, :func:`read_checkpoint`, :func:`read_best_weights`,
:func:`save_checkpoint`, :func:`files_on_main`) are the seam where the other ranks receive
what rank 0 read, or the error it met (:func:`rnndrop.lm.run.process_group.run_on_main`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import pickle
import random
import shutil
import socket
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from rnndrop.atomic import (
    atomic_write,
    file_sha256,
    fsync_folder,
    remove_stale_temporaries,
    write_json_atomic,
)
from rnndrop.lm.data.corpus import Corpus, Vocabulary
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.regimes import Regime, get_regime, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.process_group import ONE_PROCESS, Distributed, run_on_main

__all__ = [
    "ALPHAS",
    "BEST",
    "CHECKPOINT",
    "CURVE",
    "FILE_FORMAT",
    "FORMAT_VERSION",
    "INTEGRITY",
    "JOB_LOCK",
    "LEARNING_CURVES",
    "LOCK",
    "METRICS",
    "REQUIRED_KEYS",
    "RESULTS",
    "RESULTS_TABLE",
    "RUN_OUTPUTS",
    "SCHEMA",
    "SUMMARY",
    "CheckpointError",
    "JobLock",
    "LoadedModel",
    "ResultsError",
    "RunLock",
    "RunLocked",
    "RunState",
    "best_file",
    "best_of_another_run",
    "claim_folder",
    "content_sha256",
    "corpus_fingerprint",
    "describe_differences",
    "file_sha256",
    "files_on_main",
    "finished_result",
    "get_rng_state",
    "has_checkpoint",
    "identity_differences",
    "keep_finished_run",
    "load_checkpoint",
    "load_initial_weights",
    "load_latest",
    "load_model",
    "load_state",
    "previous_path",
    "read_best_weights",
    "read_checkpoint",
    "read_result",
    "read_verified_result",
    "run_files",
    "run_id",
    "run_identity",
    "save_checkpoint",
    "set_rng_state",
    "text_sha256",
    "validate_result",
    "write_json_atomic",
    "write_signed_result",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


# -- the files of a run folder and a job folder ----------------------------------------------------

CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"
RESULTS = "results.json"
METRICS = "metrics.csv"
CURVE = "curve.png"
ALPHAS = "alphas.png"
LOCK = "run.lock"
#: held in a job's folder (``--out``) while the job runs (:class:`JobLock`)
JOB_LOCK = "job.lock"

#: What a run leaves besides its checkpoints: a folder holding any of these holds a run.
RUN_OUTPUTS = (BEST, RESULTS, METRICS, CURVE, ALPHAS)

SUMMARY = "summary.json"
RESULTS_TABLE = "results.md"
LEARNING_CURVES = "learning_curves.png"


def run_files(folder: str | Path) -> list[str]:
    """The names of the files a run wrote that are in ``folder`` (checkpoints included)."""
    folder = Path(folder)
    names = (CHECKPOINT, previous_path(CHECKPOINT).name, *RUN_OUTPUTS)
    return [name for name in names if (folder / name).exists()]


def has_checkpoint(folder: str | Path) -> bool:
    """Whether ``folder`` holds a checkpoint to resume from (the newest or the previous one)."""
    path = Path(folder) / CHECKPOINT
    return path.exists() or previous_path(path).exists()


def previous_path(path: str | Path) -> Path:
    """Where a checkpoint's previous version is kept: ``checkpoint.pt`` -> ``checkpoint.prev.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


# -- the checkpoint format ----------------------------------------------------------------------------

#: The version of what a run's files hold (the payload's keys, results.json's identity); part of
#: a run's identity, so it changes only with them.
FORMAT_VERSION = 2
#: The layout of checkpoint.pt and best.pt on disk: 3 is what :func:`torch.save` writes, a dict
#: with an integrity entry (:data:`INTEGRITY`); 2 (read, never written) put a text header
#: before that payload.
FILE_FORMAT = 3
#: The entry of a format-3 file that proves it whole and names its run: ``{"format": 3,
#: "sha256": <content_sha256 of the other entries>, "run_id": <run_id of its identity>}``.
INTEGRITY = "rnndrop_checkpoint"
_MAGIC = b"RNNDROP-CHECKPOINT\n"
_RESTART_HINT = (
    "the run can restart from its previous good state: resume=True (--resume) falls back "
    "to checkpoint.prev.pt when that one is intact; otherwise start the run again in an "
    "empty folder"
)


class CheckpointError(ValueError):
    """A checkpoint file that is missing, empty, truncated, corrupted or not ours; ``what``
    says which, after the file's name."""

    what: str = ""


def run_id(identity: Mapping[str, Any]) -> str:
    """A short name of the run ``identity`` describes (:func:`run_identity`): the first 16 hex
    digits of the SHA-256 of its JSON. Every file a run writes carries it."""
    text = json.dumps(identity, sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def content_sha256(obj: Any) -> str:
    """SHA-256 of a checkpoint's content, tensors (dtype, shape, bytes) and plain data alike,
    independent of how :func:`torch.save` laid it out: the same before saving and after loading."""
    digest = hashlib.sha256()
    _hash_into(digest, obj)
    return digest.hexdigest()


def _hash_into(digest: Any, obj: Any) -> None:
    if isinstance(obj, Tensor):
        t = obj.detach().to("cpu").contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, Mapping):
        digest.update(f"D{len(obj)}:".encode())
        for key in sorted(obj, key=repr):
            _hash_into(digest, key)
            _hash_into(digest, obj[key])
    elif isinstance(obj, (list, tuple)):  # one kind: a tuple may come back as a list
        digest.update(f"L{len(obj)}:".encode())
        for item in obj:
            _hash_into(digest, item)
    elif obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        text = f"{type(obj).__name__}:{obj!r}".encode()
        digest.update(f"S{len(text)}:".encode() + text)
    else:
        raise TypeError(f"a checkpoint holds tensors and plain data, got a {type(obj).__name__}")


def _encode(obj: Mapping[str, Any]) -> bytes:
    content = {k: v for k, v in obj.items() if k != INTEGRITY}
    record: dict[str, Any] = {"format": FILE_FORMAT, "sha256": content_sha256(content)}
    if isinstance(content.get("identity"), Mapping):
        record["run_id"] = run_id(content["identity"])
    buffer = io.BytesIO()
    torch.save({**content, INTEGRITY: record}, buffer)
    return buffer.getvalue()


def _bad(path: Path, what: str) -> CheckpointError:
    error = CheckpointError(f"checkpoint {str(path)!r} {what}; {_RESTART_HINT}")
    error.what = what
    return error


def _is_torch_file(data: bytes) -> bool:
    """Whether ``data`` starts as :func:`torch.save` starts its zip archive (``<name>/data.pkl``)."""
    if not data.startswith(b"PK\x03\x04") or len(data) < 30:
        return False
    name = data[30:30 + int.from_bytes(data[26:28], "little")]
    return name.endswith(b"/data.pkl")


def _unpickled(path: Path, data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused it: written so by someone else
        raise _bad(path, f"holds data that cannot be loaded as plain tensors and data "
                         f"({type(e).__name__})") from None
    except Exception as e:  # whatever torch's reader meets in a damaged archive
        lines = str(e).strip().splitlines()
        first = textwrap.shorten(lines[0], 120, placeholder=" ...") if lines else ""
        detail = f"{type(e).__name__}: {first}" if first else type(e).__name__
        if b"PK\x05\x06" not in data[-65558:]:  # a zip archive ends with this record
            raise _bad(path, f"is truncated: the end of its zip archive is missing ({detail})") from None
        raise _bad(path, f"is corrupted: torch cannot read it ({detail})") from None


def _verified(path: Path, data: bytes) -> dict[str, Any]:
    """The content of a checkpoint file's bytes, verified; format 3 or the older format 2."""
    if not data:
        raise _bad(path, "is empty (0 bytes)")
    if data.startswith(_MAGIC):
        obj = _unpickled(path, _verified_payload(path, data))
        if not isinstance(obj, dict):
            raise _bad(path, f"holds a {type(obj).__name__}, expected a dict")
        return obj
    if not _is_torch_file(data):
        raise _bad(path, "is not an rnndrop checkpoint (neither a file torch.save wrote nor one "
                         "with the RNNDROP-CHECKPOINT header of older versions; written by another program)")
    obj = _unpickled(path, data)
    record = obj.pop(INTEGRITY, None) if isinstance(obj, dict) else None
    if not isinstance(record, dict):
        raise _bad(path, f"is not an rnndrop checkpoint (a file torch.save wrote, without rnndrop's "
                         f"{INTEGRITY!r} entry; written by another program)")
    if record.get("format") != FILE_FORMAT:
        raise _bad(path, f"has format {record.get('format')!r}, this version of rnndrop reads formats 2 "
                         f"and {FILE_FORMAT}")
    if record.get("sha256") != content_sha256(obj):
        raise _bad(path, "is corrupted: the SHA-256 of its content does not match the one written "
                         "with it")
    return obj


def _verified_payload(path: Path, data: bytes) -> bytes:
    """The payload of a format-2 file (a text header, then what torch.save wrote), verified."""
    lines = data[len(_MAGIC):].split(b"\n", 3)
    try:
        version = int(lines[0].removeprefix(b"format "))
        digest = lines[1].removeprefix(b"sha256 ").decode("ascii")
        size = int(lines[2].removeprefix(b"size "))
        payload = lines[3]
    except (IndexError, ValueError, UnicodeDecodeError):
        raise _bad(path, "has a damaged header") from None
    if version != 2:
        raise _bad(path, f"has format {version}, this version of rnndrop reads formats 2 and {FILE_FORMAT}")
    if len(payload) != size:
        raise _bad(path, f"is truncated or padded: the payload has {len(payload)} bytes, "
                         f"the header promises {size}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise _bad(path, "is corrupted: the SHA-256 of its payload does not match the one "
                         "written with it")
    return payload


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint written by :func:`save_checkpoint` (or by an older version, format 2),
    verified, tensors on the CPU; without its integrity entry.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is empty, truncated, corrupted or not a checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return _verified(path, path.read_bytes())


def save_checkpoint(
    obj: dict[str, Any], path: str | Path, *, keep_previous: bool = False, ctx: Distributed = ONE_PROCESS
) -> None:
    """Write ``obj`` to ``path`` in the checkpoint format, atomically, and verify it.

    The file is written beside ``path``, read back and checked; only then is it moved
    into place. With ``keep_previous`` the file it replaces is first moved to
    :func:`previous_path` (``checkpoint.prev.pt``), so a verified older state survives
    until the new one is known good. Under DDP (``ctx``) rank 0 alone writes; every rank
    learns whether it could.
    """
    if ctx.enabled:
        run_on_main(partial(save_checkpoint, obj, path, keep_previous=keep_previous), ctx,
                    f"writing {Path(path).name}")
        return
    path = Path(path)
    staged = path.with_name(f".{path.name}.new.tmp")
    with atomic_write(staged) as f:
        f.write(_encode(obj))
    try:
        _verified(staged, staged.read_bytes())
    except CheckpointError:
        staged.unlink(missing_ok=True)
        raise
    if keep_previous and path.exists():
        os.replace(path, previous_path(path))
    os.replace(staged, path)
    fsync_folder(path.parent)


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


@dataclass(frozen=True)
class LoadedModel:
    """A trained language model as :func:`load_model` returns it.

    Attributes:
        model: the :class:`rnndrop.lm.RNNLanguageModel` in eval mode, weights of the best
            validation epoch.
        vocab: the vocabulary (``vocab.itos[i]`` is word ``i``; ``vocab.encode(words)``).
        config: the :class:`rnndrop.lm.TrainConfig` it was trained with.
        regime: the regime's name; ``regime_settings`` its settings as plain data.
        dropout: the probability per site.
        epoch: the epoch whose weights these are.
        path: the ``best.pt`` read.
        identity: the :func:`run_identity` of the run that wrote it (None: written without one).
    """

    model: nn.Module
    vocab: Vocabulary
    config: TrainConfig
    regime: str
    regime_settings: dict[str, Any]
    dropout: dict[str, float]
    epoch: int
    path: Path
    identity: dict[str, Any] | None = None


def load_model(path: str | Path, device: str | torch.device = "cpu") -> LoadedModel:
    """The best model of a finished (or running) training run, ready for prediction.

    Args:
        path: a run folder (its ``best.pt`` is read) or a ``best.pt`` file.
        device: where to put the model.

    Example::

        run = rnndrop.lm.load_model("runs/ptb/tied")
        ids = run.vocab.encode("the cat sees".split())[:, None]   # [T, 1]
        logits, _ = run.model(ids)                                 # [T, 1, V]

    Raises:
        FileNotFoundError: no ``best.pt`` there.
        CheckpointError: the file is corrupt, or is a ``best.pt`` without the config
            and vocabulary (written by an older version).
    """
    path = Path(path)
    if path.is_dir():
        path = path / BEST
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as error:  # without the hint to resume a run: it was asked for none
        raise (CheckpointError(f"checkpoint {str(path)!r} {error.what}") if error.what else error) from None
    missing = [k for k in ("model", "config", "regime", "regime_settings", "dropout", "vocab")
               if k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks {', '.join(missing)}: it is not "
                              "the best.pt of a language-model run")
    config = TrainConfig.from_dict(ckpt["config"])
    regime = Regime.from_settings(ckpt["regime_settings"])
    vocab = Vocabulary(list(ckpt["vocab"]))
    model = build_model(len(vocab), config, regime, ckpt["dropout"])
    load_state(model, ckpt["model"], path)
    model.to(device).eval()
    return LoadedModel(model, vocab, config, ckpt["regime"], dict(ckpt["regime_settings"]),
                       dict(ckpt["dropout"]), int(ckpt.get("epoch", 0)), path, ckpt.get("identity"))


def load_latest(ckpt_path: Path) -> dict[str, Any] | None:
    """The newest verified checkpoint of a run, or None when it has none.

    A corrupt ``checkpoint.pt`` is set aside (``checkpoint.corrupt.pt``) and the run
    continues from ``checkpoint.prev.pt`` with a logged warning; with no intact
    previous one the :class:`CheckpointError` is raised.
    """
    prev = previous_path(ckpt_path)
    if ckpt_path.exists():
        try:
            return load_checkpoint(ckpt_path)
        except CheckpointError as e:
            if not prev.exists():
                raise _nothing_to_resume_from(ckpt_path, e, f"no {prev.name} beside it") from None
            corrupt = ckpt_path.with_name(f"{ckpt_path.stem}.corrupt{ckpt_path.suffix}")
            ckpt_path.replace(corrupt)
            log.warning("%s; moved it to %s and resuming from the previous checkpoint %s",
                        e, corrupt.name, prev)
    elif prev.exists():
        log.warning("%s is missing; resuming from the previous checkpoint %s", ckpt_path, prev)
    else:
        return None
    try:
        return load_checkpoint(prev)
    except CheckpointError as e:
        raise _nothing_to_resume_from(prev, e, "the newest one unreadable too") from None


def _nothing_to_resume_from(path: Path, error: CheckpointError, why: str) -> CheckpointError:
    """The error of a run that cannot resume (``path`` damaged, ``why`` no other is intact), with
    what to do instead of the hint to resume, which the caller was doing."""
    what = error.what or str(error)
    stuck = CheckpointError(f"checkpoint {str(path)!r} {what}; {why}, the run cannot resume: start "
                            "it again in another folder (or move this one away first)")
    stuck.what = what
    return stuck


def load_state(target: Any, state: Any, path: str | Path, what: str = "model") -> None:
    """``target.load_state_dict(state)`` (a model or an optimizer); a state that passed its
    checksum but does not fit (other shapes, other names: written for another model) is a
    :class:`CheckpointError` naming the file, not torch's multi-line RuntimeError."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, KeyError, TypeError, ValueError) as e:
        first = str(e).strip().splitlines()
        detail = first[1].strip() if len(first) > 1 else (first[0] if first else type(e).__name__)
        raise CheckpointError(
            f"checkpoint {str(path)!r} is intact but its {what} state does not fit this model ({detail}): "
            "it was written for another model"
        ) from None


# -- the progress a checkpoint holds ---------------------------------------------------------------

#: Fields every checkpoint of format 2 holds; the others were added later and get their
#: default when absent (``best_criterion`` then falls back to ``best_valid_ppl``; the
#: NT-ASGD fields are None).
_REQUIRED = ("epoch", "lr", "best_valid_ppl", "best_epoch", "history")
_NUMBER = (int, float)
_TYPES: dict[str, tuple[type, ...]] = {
    "epoch": (int,), "lr": _NUMBER, "best_valid_ppl": _NUMBER, "best_epoch": (int,),
    "best_criterion": _NUMBER, "history": (list,), "train_seconds": _NUMBER, "train_words": (int,),
    "wall_seconds": _NUMBER, "stopped": (str, type(None)), "init_from": (dict, type(None)),
    "averaging_since": (int, type(None)), "finetune_from": (int, type(None)),
    "finetune_stopped": (str, type(None)),
}


@dataclass
class RunState:
    """Where a run stands after its last finished epoch.

    Attributes:
        epoch: epochs finished (0 before the first).
        lr: the learning rate the next epoch starts from (the plateau rule's carry).
        best_valid_ppl: validation perplexity of the best epoch; ``best_epoch`` its number
            (0: none yet); ``best_criterion`` what the selection minimised there.
        history: one record per finished epoch (lr, train and validation perplexity, speed).
        train_seconds, train_words: time and words of the training passes, all epochs.
        wall_seconds: wall-clock time of the run, setup and evaluation included.
        stopped: why training stopped before the epoch cap (``"lr_floor"``), or None.
        init_from: what ``init_from`` loaded into the model (path, SHA-256, tensors), or None.
        averaging_since: NT-ASGD (:mod:`rnndrop.lm.run.recipe`): the epoch after which the
            weights are averaged, or None.
        finetune_from: the epoch after which the fine-tuning stage began, or None;
            ``finetune_stopped`` why it stopped before its cap, or None.
    """

    epoch: int = 0
    lr: float = 0.0
    best_valid_ppl: float = math.inf
    best_epoch: int = 0
    best_criterion: float = math.inf
    history: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    train_words: int = 0
    wall_seconds: float = 0.0
    stopped: str | None = None
    init_from: dict[str, Any] | None = None
    averaging_since: int | None = None
    finetune_from: int | None = None
    finetune_stopped: str | None = None

    def keep_if_best(self, epoch: int, valid_ppl: float, criterion: float) -> bool:
        """Make ``epoch`` the best one when its ``criterion`` is below the best so far;
        returns whether it was."""
        if not criterion < self.best_criterion:
            return False
        self.best_valid_ppl, self.best_epoch, self.best_criterion = valid_ppl, epoch, criterion
        return True

    def end_epoch(self, record: dict[str, Any], next_lr: float, seconds: float, words: int) -> None:
        """Count the epoch of ``record`` as finished; the next one starts from ``next_lr``."""
        self.history = [*self.history, record]
        self.epoch = record["epoch"]
        self.lr = next_lr
        self.train_seconds += seconds
        self.train_words += words

    def stop_stage(self, reason: str) -> None:
        """End the stage the run is in (training, or fine-tuning once it began) for ``reason``."""
        if self.finetune_from is None:
            self.stopped = reason
        else:
            self.finetune_stopped = reason

    def add_wall_time(self, since: float) -> float:
        """Add the wall-clock time since ``since`` (a ``time.perf_counter()``); returns now."""
        now = time.perf_counter()
        self.wall_seconds += now - since
        return now

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the checkpoint (``torch.load(weights_only=True)`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, progress: Any, where: str) -> RunState:
        """The state a checkpoint's ``progress`` entry holds, verified; ``where`` names the
        checkpoint in the error.

        Raises:
            CheckpointError: not a dict, a required field missing, an unknown field, or a
                field of the wrong type.
        """
        if not isinstance(progress, Mapping):
            raise CheckpointError(f"{where}: its progress is a {type(progress).__name__}, expected a dict")
        missing = [k for k in _REQUIRED if k not in progress]
        unknown = sorted(set(progress) - {f.name for f in fields(cls)})
        if missing or unknown:
            raise CheckpointError(f"{where}: its progress lacks {missing or 'nothing'} and has unknown "
                                  f"fields {unknown or 'none'}")
        for key, value in progress.items():
            if isinstance(value, bool) or not isinstance(value, _TYPES[key]):
                raise CheckpointError(f"{where}: progress field {key} must be of type "
                                      f"{' or '.join(t.__name__ for t in _TYPES[key])}, got {value!r}")
        values = dict(progress)
        values.setdefault("best_criterion", values["best_valid_ppl"])
        return cls(**values)


# -- what makes two runs the same run; results.json, signed ----------------------------------------

class ResultsError(ValueError):
    """A results.json that cannot be read or whose checksum does not match its content."""


def corpus_fingerprint(corpus: Corpus) -> str:
    """SHA-256 of the vocabulary (in id order) and the three token streams: two corpora
    with the same fingerprint train the same model."""
    digest = hashlib.sha256()
    digest.update("\n".join(corpus.vocab.itos).encode("utf-8"))
    for split in (corpus.train, corpus.valid, corpus.test):
        digest.update(b"\0split\0")
        digest.update(split.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def text_sha256(text: str) -> str:
    """SHA-256 of ``text`` in UTF-8 (how results.json records the metrics.csv it implies)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def describe_differences(differences: Sequence[str], limit: int = 3) -> str:
    """The first ``limit`` lines of :func:`identity_differences`, joined (and how many more)."""
    more = len(differences) - limit
    return "; ".join(differences[:limit]) + (f"; and {more} more" if more > 0 else "")


def best_of_another_run(path: Path, identity: Mapping[str, Any]) -> str | None:
    """What is wrong with the ``best.pt`` at ``path`` for the run ``identity``: missing, damaged
    (empty, truncated, corrupted: loaded with ``weights_only=True``, its checksum checked), or
    written by another run (what differs), or None."""
    if not path.is_file():
        return "is missing"
    try:
        best = _verified(path, path.read_bytes())
    except CheckpointError as error:
        return error.what
    differences = identity_differences(identity, best.get("identity", {}))
    if differences:
        return f"belongs to another run ({describe_differences(differences)})"
    return None


def best_file(path: str | Path) -> Path:
    path = Path(path)
    return path / BEST if path.is_dir() else path


def run_identity(
    corpus: Corpus,
    config: TrainConfig,
    regime: str,
    dropout: Mapping[str, float] | None = None,
    seed: int = 1,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """What makes two runs the same run: a checkpoint resumes, and a finished result is
    reused, only under an equal identity.

    It holds the format version of the files, the corpus fingerprint, the full config
    but the epoch cap, the grid and ``mc_samples``, the regime (name and settings), the
    dropout probability of every site (``dropout`` default ``config.dropout``), the seed
    and the SHA-256 of the ``best.pt`` the run started from (``init_from``).
    """
    regime_obj = get_regime(regime)
    probabilities = regime_probabilities(regime_obj, config.dropout if dropout is None else dropout)
    cfg = config.to_dict()
    for key in ("epochs", "grid", "mc_samples"):
        cfg.pop(key)
    for key, default in _LATER_FIELDS.items():
        if cfg.get(key) == default:  # runs made before the field existed keep their identity
            cfg.pop(key)
    start = None
    if init_from is not None:
        best = best_file(init_from)
        if not best.is_file():
            raise FileNotFoundError(f"init_from: {str(best)!r} does not exist (expected a run folder "
                                    "holding best.pt, or a best.pt file)")
        start = file_sha256(best)
    return json.loads(json.dumps({
        "format": FORMAT_VERSION, "corpus": corpus_fingerprint(corpus), "config": cfg,
        "regime": regime, "regime_settings": regime_obj.settings(), "dropout": probabilities,
        "seed": seed, "init_from": start,
    }))


#: TrainConfig fields added after FORMAT_VERSION, with the value they had in effect before.
_LATER_FIELDS: dict[str, Any] = {
    "kl_weight": 1.0, "select": "perplexity", "freeze": [],
    "ar": 0.0, "tar": 0.0, "variable_bptt": False, "nt_asgd": False, "nonmono": 5, "finetune_epochs": 0,
}


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: data}


def identity_differences(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """The fields where two identities differ, as ``"field: mine vs theirs"`` lines
    (empty when they are the same run)."""
    a, b = _flatten(mine), _flatten(theirs)
    missing = object()
    return [f"{key}: {a.get(key, '(absent)')!r} here vs {b.get(key, '(absent)')!r} there"
            for key in sorted(set(a) | set(b)) if a.get(key, missing) != b.get(key, missing)]


def _result_checksum(result: Mapping[str, Any]) -> str:
    body = {k: v for k, v in result.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode("utf-8")).hexdigest()


def write_signed_result(result: dict[str, Any], path: Path) -> None:
    """Add ``result["checksum"]`` (SHA-256 of the rest) and write it atomically."""
    result["checksum"] = _result_checksum(result)
    write_json_atomic(result, path)


def read_verified_result(path: Path) -> dict[str, Any]:
    """results.json, verified against its checksum (written by :func:`write_signed_result`).

    Raises:
        ResultsError: unreadable, not JSON, no checksum, or a checksum that does not match.
    """
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ResultsError(f"results {str(path)!r} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(result, dict) or "checksum" not in result:
        raise ResultsError(f"results {str(path)!r} carry no checksum (written by an older version "
                           "or by hand)")
    if result["checksum"] != _result_checksum(result):
        raise ResultsError(f"results {str(path)!r} do not match their checksum: the file was "
                           "changed after the run wrote it")
    return result


def finished_result(
    folder: str | Path, identity: Mapping[str, Any], *, epochs: int | None = None
) -> dict[str, Any] | None:
    """The verified results.json of the finished run ``identity`` (see :func:`run_identity`)
    in ``folder``, or None when there is none to reuse.

    None when the folder has no results.json, when the file is damaged or does not
    match its checksum (logged as a warning: resuming the run rewrites it from the
    checkpoints), when it belongs to another run, or when ``epochs`` is given and the
    run was made with another epoch cap.
    """
    path = Path(folder) / RESULTS
    if not path.is_file():
        return None
    try:
        result = read_verified_result(path)
    except ResultsError as e:
        log.warning("%s; not reusing it (resume rewrites it from the run's checkpoints)", e)
        return None
    if result.get("identity") != json.loads(json.dumps(identity)):
        return None
    if epochs is not None and result.get("config", {}).get("epochs") != epochs:
        return None
    return result


SCHEMA = "rnndrop.lm.result/1"

#: Keys every results.json has.
REQUIRED_KEYS: tuple[str, ...] = (
    "schema", "dataset", "config", "regime", "dropout", "seed", "epochs", "best_epoch",
    "best_valid_ppl", "test_ppl", "test_ppl_mc", "mc_samples", "words_per_second",
    "wall_seconds", "peak_memory_bytes", "versions",
)


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


# -- one writer per run folder ---------------------------------------------------------------------

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

    #: the lock file's name, and what the messages call the folder
    name = LOCK
    what = "run folder"

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / self.name
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
                f"{self.what} {str(self.folder)!r} is in use by pid {holder['pid']} on "
                f"{holder.get('host')} since {holder.get('since')} ({self.path}); wait for that "
                f"{'job' if self.name == JOB_LOCK else 'run'} to end, or choose another output folder "
                "(delete the lock file only if that process is really gone)"
            )
        raise RunLocked(f"{self.what} {str(self.folder)!r}: could not take {self.path}")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class JobLock(RunLock):
    """``with JobLock(out):`` holds ``out/job.lock``, the output folder of a job (``--out``), from
    before the folder is checked until the job's summary is written, so that two jobs started at
    once on one folder never both go ahead (a check, then an act, would let them). Re-entrant in
    one process: the command line takes it before its checks, :func:`run_benchmark` again."""

    name = JOB_LOCK
    what = "output folder"
    _held: dict[Path, int] = {}  # noqa: RUF012 - the locks this process holds, and how often

    def acquire(self) -> None:
        key = self.path.resolve()
        if JobLock._held.get(key):
            JobLock._held[key] += 1
        else:
            super().acquire()
            JobLock._held[key] = 1
        self.held = True

    def release(self) -> None:
        if not self.held:
            return
        key = self.path.resolve()
        JobLock._held[key] -= 1
        if JobLock._held[key] == 0:
            del JobLock._held[key]
            super().release()
        self.held = False


def claim_folder(out: Path, stack: ExitStack, ctx: Distributed) -> None:
    """Create ``out``, lock it until ``stack`` closes, and remove what a killed write left
    (rank 0 alone; the others learn whether it could). A folder made here that is still
    empty when ``stack`` closes (the run failed before writing anything: a split too short,
    a model too large) is removed again."""
    run_on_main(partial(_claim_folder, out, stack), ctx, f"taking the run folder {str(out)!r}")


def _claim_folder(out: Path, stack: ExitStack) -> None:
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except PermissionError as e:
        raise PermissionError(f"output folder {str(out)!r} cannot be created ({e.strerror})") from None
    if made:  # registered first, so it runs after the lock is released
        stack.callback(_remove_if_empty, out)
    stack.enter_context(RunLock(out))
    removed = remove_stale_temporaries(out)
    if removed:
        log.warning("%s: removed %d temporary files left by a killed write: %s", out, len(removed),
                    ", ".join(p.name for p in removed))


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()  # refused unless empty: nothing a run wrote is removed


# -- where a run starts from: its own checkpoint, another run's weights, or its initialisation -----

def read_checkpoint(
    out: Path, identity: dict[str, Any], config: TrainConfig, model: nn.Module, *, resume: bool,
    init_from: str | Path | None, vocab: Sequence[str], ctx: Distributed,
) -> tuple[dict[str, Any] | None, RunState | None, dict[str, Any] | None]:
    """(the checkpoint in ``out`` to resume from and its verified progress, or None, None;
    what ``init_from`` loaded into ``model``, or None), every check done: a checkpoint there
    needs ``resume``, belongs to this run, has not trained past the epoch cap, was written
    by as many processes, and its ``best.pt`` verifies. Rank 0 reads; every rank gets the
    checkpoint (``init_from`` weights reach the other ranks through DDP's broadcast of rank
    0's parameters)."""
    return run_on_main(
        partial(_read_checkpoint, out, identity, config, model, resume=resume, init_from=init_from,
                vocab=vocab, ctx=ctx),
        ctx, f"reading the checkpoint in {str(out)!r}",
    )


def _read_checkpoint(
    out: Path, identity: dict[str, Any], config: TrainConfig, model: nn.Module, *, resume: bool,
    init_from: str | Path | None, vocab: Sequence[str], ctx: Distributed,
) -> tuple[dict[str, Any] | None, RunState | None, dict[str, Any] | None]:
    ckpt_path, best_path = out / CHECKPOINT, out / BEST
    resumable = has_checkpoint(out)
    if resumable and not resume:
        raise FileExistsError(
            f"{str(out)!r} already holds a checkpoint; pass resume=True (--resume) to "
            "continue that run, or choose another output folder"
        )
    if not resumable:
        _refuse_to_overwrite(out, identity, resume)
    ckpt = load_latest(ckpt_path) if resumable else None
    if ckpt is None:
        return None, None, None if init_from is None else load_initial_weights(model, init_from, vocab)
    differences = identity_differences(identity, ckpt.get("identity", {}))
    if differences:
        raise ValueError(
            f"the checkpoint in {str(out)!r} belongs to another run; what differs (this "
            f"call vs the checkpoint): {'; '.join(differences)}. Choose another output folder"
        )
    state = RunState.from_dict(ckpt.get("progress"), f"the checkpoint in {str(out)!r}")
    trained = state.epoch if state.finetune_from is None else state.finetune_from  # fine-tuning aside
    if trained > config.epochs:
        raise ValueError(
            f"epochs must be >= {trained}, the epochs the run in {str(out)!r} "
            f"has already trained, got {config.epochs} (the epoch cap of a run may grow, not shrink)"
        )
    world_size = int(ckpt.get("distributed", {}).get("world_size", 1))
    if world_size != ctx.world_size:
        raise ValueError(
            f"the checkpoint in {str(out)!r} was written by {world_size} "
            f"process(es); resume it with as many (torchrun --nproc_per_node), got {ctx.world_size}"
        )
    if state.best_epoch:  # verify it now rather than after training
        best = load_checkpoint(best_path)
        differences = identity_differences(identity, best.get("identity", {}))
        if differences:  # put there by hand (swapped between seed folders, copied over)
            raise ValueError(
                f"{str(best_path)!r} belongs to another run than the checkpoint beside it "
                f"({describe_differences(differences)}); nothing was trained: put back this run's "
                "own best.pt, or start the run again in another folder"
            )
    return ckpt, state, None


def keep_finished_run(out: Path) -> Path | None:
    """Before a finished run trains on (its epoch cap raised, ``--resume``), what it finished with
    is kept: its files (:data:`RUN_OUTPUTS`: results.json, best.pt, metrics.csv, plots) are linked
    (copied where the file system has no hard links; every one of them is replaced, never
    rewritten in place) into ``finished-after-N-epochs/`` beside them, which ``rnndrop-lm
    evaluate`` reads as a run, and results.json leaves the run folder: the run is unfinished until
    it ends again. Returns that folder, or None where the run had not finished."""
    results = out / RESULTS
    if not results.is_file():
        return None
    try:
        epochs = int(read_verified_result(results)["epochs_run"])
    except (ResultsError, KeyError, TypeError, ValueError) as e:
        raise ResultsError(f"{str(results)!r} cannot be kept before the run trains on ({e}); nothing "
                           "was trained: move it away by hand, or start the run again in another "
                           "folder") from None
    kept = out / f"finished-after-{epochs}-epochs"
    if not kept.exists():  # else kept already by a call stopped before results.json was removed
        staged = out / (kept.name + ".partial")
        if staged.exists():
            for leftover in staged.iterdir():
                leftover.unlink()
        staged.mkdir(exist_ok=True)
        for name in RUN_OUTPUTS:
            if (out / name).is_file():
                try:
                    os.link(out / name, staged / name)
                except OSError:
                    shutil.copy2(out / name, staged / name)
        fsync_folder(staged)
        os.replace(staged, kept)
        fsync_folder(out)
    results.unlink()
    fsync_folder(out)
    log.warning("%s: the run had finished after %d epoch%s and trains on to its new epoch cap; what "
                "it finished with is kept in %s", out, epochs, "" if epochs == 1 else "s", kept)
    return kept


def _refuse_to_overwrite(out: Path, identity: dict[str, Any], resume: bool) -> None:
    """A folder without a checkpoint may still hold a run (its checkpoints deleted to free
    disk, or another run's): training there would overwrite it, so refuse. The one folder
    let through is this very run stopped between its first ``best.pt`` and its first
    checkpoint, with ``resume``: it starts again."""
    present = run_files(out)
    if not present:
        return
    best_identity = load_checkpoint(out / BEST).get("identity", {}) if present == [BEST] else None
    if resume and best_identity is not None and not identity_differences(identity, best_identity):
        log.warning("%s holds this run's best.pt but no checkpoint (stopped while writing its first "
                    "one): starting the run again", out)
        return
    raise FileExistsError(
        f"{str(out)!r} holds files of a run ({', '.join(present)}) but no checkpoint to continue "
        "it from; nothing there is overwritten: choose another output folder"
    )


def load_initial_weights(model: nn.Module, init_from: str | Path, vocab: Sequence[str]) -> dict[str, Any]:
    """Copy into ``model`` every tensor of another run's best.pt that it has (same name and
    shape); the others keep their initialisation. Returns what was loaded, for the results.
    That run's vocabulary must be ``vocab`` word for word: its embedding and decoder rows
    belong to its words, in its order."""
    best = best_file(init_from)
    checkpoint = load_checkpoint(best)
    _check_same_vocabulary(best, checkpoint.get("vocab"), vocab)
    source = checkpoint["model"]
    own = model.state_dict()
    mismatched = [f"{k}: {list(v.shape)} there vs {list(own[k].shape)} here"
                  for k, v in source.items() if k in own and v.shape != own[k].shape]
    if mismatched:
        raise ValueError(f"init_from {str(best)!r}: tensors of other shapes: {'; '.join(mismatched)}")
    loaded = sorted(k for k in source if k in own)
    kept = sorted(k for k in own if k not in source)
    ignored = sorted(k for k in source if k not in own)
    model.load_state_dict({k: source[k] for k in loaded}, strict=False)
    log.info("init_from %s: loaded %d tensors (%s); kept the initialisation of %s; ignored %s",
             best, len(loaded), ", ".join(loaded), ", ".join(kept) or "none", ", ".join(ignored) or "none")
    return {"path": str(best), "sha256": file_sha256(best), "loaded": loaded, "kept_init": kept,
            "ignored": ignored}


def _check_same_vocabulary(best: Path, theirs: Sequence[str] | None, ours: Sequence[str]) -> None:
    if theirs is None or list(theirs) == list(ours):
        return
    if sorted(theirs) == sorted(ours):
        what = "the same words in another order"
    else:
        what = f"{len(set(theirs) ^ set(ours))} words that only one of them has"
    raise ValueError(
        f"init_from {str(best)!r}: its vocabulary is not this corpus' ({what}), so its embedding and "
        "decoder rows would belong to other words; start from a run trained on this corpus"
    )



# -- rank 0 reads and writes, every rank gets the answer -------------------------------------------

def read_best_weights(path: Path, ctx: Distributed) -> dict[str, Tensor]:
    """The model state of the ``best.pt`` at ``path``, verified (rank 0 reads it, every rank gets it)."""
    return run_on_main(lambda: load_checkpoint(path)["model"], ctx, "reading best.pt")


def files_on_main(work: Callable[[], T], ctx: Distributed, what: str) -> T:
    """``work()``, which reads or writes a run's or a job's files, on rank 0 alone; its value
    on every rank. ``what`` names it in the error the other ranks raise when it fails there."""
    return run_on_main(work, ctx, what)
