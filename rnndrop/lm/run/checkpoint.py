"""The checkpoint file format of a training run, verified on load.

``checkpoint.pt`` (everything needed to resume) and ``best.pt`` (the weights of the
best validation epoch, with the config, regime, dropout and vocabulary that rebuild
the model) share one format: a short text header, then the payload written by
``torch.save``::

    RNNDROP-CHECKPOINT
    format 2
    sha256 <hex digest of the payload>
    size <bytes of the payload>
    <payload>

:func:`load_checkpoint` checks the header, the size and the SHA-256 before it
unpickles anything, then loads with ``weights_only=True`` (state dicts and plain
data only, never pickled code). A zero-byte, truncated, corrupted or foreign file is
a :class:`CheckpointError` that names the file. :func:`save_checkpoint` writes through
a temporary file, reads it back and verifies it, and only then moves the previous
version aside (``checkpoint.prev.pt``) and the new one into place, so a verified
checkpoint exists at every moment.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rnndrop.lm.atomic import atomic_write, fsync_folder
from rnndrop.lm.data.corpus import Vocabulary
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.regimes import Regime
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.folder import BEST, previous_path

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "LoadedModel",
    "checkpoint_damage",
    "get_rng_state",
    "load_checkpoint",
    "load_latest",
    "load_model",
    "load_state",
    "save_checkpoint",
    "set_rng_state",
]

log = logging.getLogger(__name__)

#: Bumped whenever the header or the payload's keys change; part of a run's identity.
FORMAT_VERSION = 2
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




def _encode(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    header = (f"format {FORMAT_VERSION}\nsha256 {hashlib.sha256(payload).hexdigest()}\n"
              f"size {len(payload)}\n").encode("ascii")
    return _MAGIC + header + payload


def _bad(path: Path, what: str) -> CheckpointError:
    error = CheckpointError(f"checkpoint {str(path)!r} {what}; {_RESTART_HINT}")
    error.what = what
    return error


def checkpoint_damage(path: str | Path) -> str | None:
    """What is wrong with the checkpoint file at ``path`` (missing, empty, truncated, corrupted),
    or None when its header and checksum hold; the payload is not unpickled."""
    path = Path(path)
    if not path.is_file():
        return "is missing"
    try:
        _verified_payload(path, path.read_bytes())
    except CheckpointError as error:
        return error.what
    return None


def _verified_payload(path: Path, data: bytes) -> bytes:
    if not data:
        raise _bad(path, "is empty (0 bytes)")
    if not data.startswith(_MAGIC):
        raise _bad(path, f"is not an rnndrop checkpoint of format {FORMAT_VERSION} (no "
                         "RNNDROP-CHECKPOINT header; written by another program or an older version)")
    lines = data[len(_MAGIC):].split(b"\n", 3)
    try:
        version = int(lines[0].removeprefix(b"format "))
        digest = lines[1].removeprefix(b"sha256 ").decode("ascii")
        size = int(lines[2].removeprefix(b"size "))
        payload = lines[3]
    except (IndexError, ValueError, UnicodeDecodeError):
        raise _bad(path, "has a damaged header") from None
    if version != FORMAT_VERSION:
        raise _bad(path, f"has format {version}, this version of rnndrop reads format {FORMAT_VERSION}")
    if len(payload) != size:
        raise _bad(path, f"is truncated or padded: the payload has {len(payload)} bytes, "
                         f"the header promises {size}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise _bad(path, "is corrupted: the SHA-256 of its payload does not match the one "
                         "written with it")
    return payload


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint written by :func:`save_checkpoint`, verified, tensors on the CPU.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is empty, truncated, corrupted or not a checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    payload = _verified_payload(path, path.read_bytes())
    try:
        obj = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:  # the checksum matched: written so by someone else
        raise _bad(path, f"holds data that cannot be loaded as plain tensors and data "
                         f"({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise _bad(path, f"holds a {type(obj).__name__}, expected a dict")
    return obj


def save_checkpoint(obj: dict[str, Any], path: str | Path, *, keep_previous: bool = False) -> None:
    """Write ``obj`` to ``path`` in the checkpoint format, atomically, and verify it.

    The file is written beside ``path``, read back and checked; only then is it moved
    into place. With ``keep_previous`` the file it replaces is first moved to
    :func:`previous_path` (``checkpoint.prev.pt``), so a verified older state survives
    until the new one is known good.
    """
    path = Path(path)
    staged = path.with_name(f".{path.name}.new.tmp")
    with atomic_write(staged) as f:
        f.write(_encode(obj))
    try:
        _verified_payload(staged, staged.read_bytes())
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
    """

    model: nn.Module
    vocab: Vocabulary
    config: TrainConfig
    regime: str
    regime_settings: dict[str, Any]
    dropout: dict[str, float]
    epoch: int
    path: Path


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
                       dict(ckpt["dropout"]), int(ckpt.get("epoch", 0)), path)


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
                raise
            corrupt = ckpt_path.with_name(f"{ckpt_path.stem}.corrupt{ckpt_path.suffix}")
            ckpt_path.replace(corrupt)
            log.warning("%s; moved it to %s and resuming from the previous checkpoint %s",
                        e, corrupt.name, prev)
    elif prev.exists():
        log.warning("%s is missing; resuming from the previous checkpoint %s", ckpt_path, prev)
    else:
        return None
    return load_checkpoint(prev)


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
