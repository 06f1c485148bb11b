"""What makes two training runs the same run, and whether a finished one can be reused.

:func:`run_identity` is the one definition: the checkpoint of a run resumes, and its
results.json is reused (:func:`finished_result`), only under an equal identity. It holds
the format version of the files, a fingerprint of the corpus, the full config but the
epoch cap, the grid and ``mc_samples``, the regime, the dropout of every site, the seed
and the checksum of the weights the run started from. results.json carries a SHA-256 of
its own content, verified before it is reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rnndrop.lm.data.corpus import Corpus
from rnndrop.lm.model.regimes import get_regime, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import FORMAT_VERSION
from rnndrop.lm.run.folder import BEST, RESULTS
from rnndrop.lm.run.result_file import write_json_atomic

__all__ = [
    "ResultsError",
    "best_file",
    "corpus_fingerprint",
    "file_sha256",
    "finished_result",
    "identity_differences",
    "read_verified_result",
    "run_identity",
    "write_signed_result",
]

log = logging.getLogger(__name__)



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


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


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
