"""A trained language model in a folder, saved and loaded in one call each, readable without
rnndrop's checkpoint code.

:func:`save_pretrained` writes::

    config.json        what rebuilds the model: the TrainConfig, the regime (name and settings),
                       the dropout probability of every site, the vocabulary size
    vocab.json         the words, in id order
    model.safetensors  the weights (safetensors, when it is installed), or
    model.pt           the weights as a state dict that ``torch.load(path, weights_only=True)`` reads
    manifest.json      the SHA-256 of every file above, written last

:func:`from_pretrained` checks the manifest (a file missing, changed or foreign is a
:class:`PretrainedError` naming it), rebuilds the model and loads the weights (``weights_only``:
plain tensors, never pickled code)::

    rnndrop.lm.save_pretrained("my-lm", run.model, vocab=run.vocab, config=run.config,
                               regime=run.regime_settings, dropout=run.dropout)
    lm = rnndrop.lm.from_pretrained("my-lm")       # lm.model (eval mode), lm.vocab, lm.config
"""

from __future__ import annotations

import copy
import json
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rnndrop.atomic import atomic_path, atomic_write, file_sha256, write_json_atomic
from rnndrop.lm.data.corpus import Vocabulary
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.regimes import REGIMES, Regime, get_regime, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.validation import check_instance

__all__ = ["FORMAT", "PretrainedError", "PretrainedModel", "from_pretrained", "save_pretrained"]

#: What config.json's ``format`` says.
FORMAT = "rnndrop.lm.pretrained/1"
CONFIG, VOCAB, MANIFEST = "config.json", "vocab.json", "manifest.json"
SAFETENSORS, TORCH_WEIGHTS = "model.safetensors", "model.pt"
#: The files a manifest may list.
_FILES = (CONFIG, VOCAB, SAFETENSORS, TORCH_WEIGHTS)


class PretrainedError(ValueError):
    """A pretrained-model folder that is incomplete, changed after it was written, or not one."""


@dataclass(frozen=True)
class PretrainedModel:
    """What :func:`from_pretrained` returns: ``model`` (eval mode) and what it was built from."""

    model: nn.Module
    vocab: Vocabulary
    config: TrainConfig
    regime: str
    regime_settings: dict[str, Any]
    dropout: dict[str, float]
    path: Path


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        return None
    return safetensors.torch


def _safetensors_errors() -> tuple[type[BaseException], ...]:
    """The error safetensors raises for a file it cannot read (none without the package)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return ()
    return (SafetensorError,)


def save_pretrained(
    folder: str | os.PathLike[str],
    model: nn.Module,
    *,
    vocab: Vocabulary | Sequence[str],
    config: TrainConfig,
    regime: str | Regime | Mapping[str, Any],
    dropout: Mapping[str, float] | None = None,
    safetensors: bool | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write ``model`` (built by :func:`rnndrop.lm.build_model` from ``config``, ``regime`` and
    ``dropout``) with its vocabulary into ``folder``; returns the files written.

    Args:
        regime: a regime's name, a :class:`Regime`, or its settings (``Regime.settings()``,
            as :class:`rnndrop.lm.LoadedModel` holds them).
        dropout: probability per site (default ``config.dropout``).
        safetensors: the weights as ``model.safetensors`` (needs the package) or ``model.pt``;
            None: safetensors when it is installed.
        overwrite: replace the files of a pretrained model already in ``folder``; without it such
            a folder is an error (nothing is overwritten).
    """
    folder = Path(folder)
    rules = get_regime(regime) if isinstance(regime, str) else (
        regime if isinstance(regime, Regime) else Regime.from_settings(regime))
    probabilities = regime_probabilities(rules, config.dropout if dropout is None else dropout)
    words = list(vocab.itos if isinstance(vocab, Vocabulary) else vocab)
    repeated = sorted({w for w in words if words.count(w) > 1}) if len(set(words)) < len(words) else []
    if repeated:  # two ids for one word: text would encode to the first, the model predicts both
        raise PretrainedError(f"vocab lists {len(repeated)} word(s) more than once, e.g. {repeated[0]!r}")
    try:  # as from_pretrained reads it back: a folder written is a folder that loads
        Vocabulary(words)
    except (TypeError, ValueError) as e:
        raise PretrainedError(f"vocab is not a vocabulary from_pretrained could read back: {e}") from None
    decoder = getattr(model, "decoder", None)
    if isinstance(decoder, nn.Linear) and decoder.out_features != len(words):
        raise PretrainedError(f"vocab has {len(words)} words, the model predicts {decoder.out_features}")
    _check_fits(model, len(words), config, rules, probabilities)
    st = _safetensors()
    if safetensors and st is None:
        raise PretrainedError("safetensors=True needs the safetensors package (pip install safetensors)")
    use_st = st is not None if safetensors is None else safetensors
    ours = (CONFIG, VOCAB, MANIFEST, SAFETENSORS, TORCH_WEIGHTS)
    taken = [name for name in ours if (folder / name).exists()]
    if taken and not overwrite:
        raise PretrainedError(f"{str(folder)!r} already holds {', '.join(taken)}; pass overwrite=True "
                              "or choose another folder")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).unlink(missing_ok=True)  # until it is written again the folder is incomplete
    for stale in (SAFETENSORS, TORCH_WEIGHTS):
        (folder / stale).unlink(missing_ok=True)
    name = next((n for n, r in REGIMES.items() if r == rules), None)
    config_data = {"format": FORMAT, "config": config.to_dict(), "regime": name,
                   "regime_settings": rules.settings(), "dropout": probabilities, "vocab_size": len(words)}
    write_json_atomic(config_data, folder / CONFIG)
    write_json_atomic(words, folder / VOCAB)
    weights = folder / (SAFETENSORS if use_st else TORCH_WEIGHTS)
    if use_st:
        with atomic_path(weights) as tmp:  # save_model writes a file by name (shared weights once)
            st.save_model(_cpu_copy(model), str(tmp), metadata={"format": FORMAT})
    else:
        with atomic_write(weights) as f:
            torch.save({k: v.detach().to("cpu") for k, v in model.state_dict().items()}, f)
    written = [folder / CONFIG, folder / VOCAB, weights]
    manifest = {"format": FORMAT, "sha256": {p.name: file_sha256(p) for p in written}}
    write_json_atomic(manifest, folder / MANIFEST)
    return [*written, folder / MANIFEST]


def _check_fits(model: nn.Module, n_words: int, config: TrainConfig, rules: Regime,
                probabilities: Mapping[str, float]) -> None:
    """PretrainedError unless ``model``'s state dict has the names and shapes of the model that
    ``config`` and the regime build (what :func:`from_pretrained` will build and load into)."""
    check_instance("model", model, nn.Module, "an nn.Module")
    built = build_model(n_words, config, rules, dict(probabilities))
    expected = {k: tuple(v.shape) for k, v in built.state_dict().items()}
    actual = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if expected != actual:
        differences = sorted(set(expected) ^ set(actual)) or sorted(
            k for k in expected if expected[k] != actual[k])
        more = " ..." if len(differences) > 3 else ""
        raise PretrainedError("model is not the model config and regime describe (from_pretrained could "
                              f"not load it): {', '.join(differences[:3])}{more} differ")


def _cpu_copy(model: nn.Module) -> nn.Module:
    """The model itself when it is on the CPU, else a CPU copy (safetensors saves what it is given)."""
    if all(t.device.type == "cpu" for t in model.state_dict().values()):
        return model
    return copy.deepcopy(model).to("cpu")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PretrainedError(f"{str(path)!r} cannot be read ({type(e).__name__}: {e})") from None


def from_pretrained(folder: str | os.PathLike[str], device: str | torch.device = "cpu") -> PretrainedModel:
    """The model :func:`save_pretrained` wrote into ``folder``, verified, in eval mode on ``device``.

    Raises:
        PretrainedError: no manifest (not a pretrained-model folder, or one whose writing was
            cut short), a file missing or changed after it was written (its SHA-256), weights
            that do not fit the config, or a safetensors file without the package.
    """
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        why = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PretrainedError(f"device must name a torch device ('cpu', 'cuda:0', ...), got {device!r}: "
                              f"{why}") from None
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        raise PretrainedError(f"{str(folder)!r} holds no {MANIFEST}: it is not a folder save_pretrained "
                              "wrote (or its writing was cut short)")
    manifest = _read_json(folder / MANIFEST)
    hashes = manifest.get("sha256") if isinstance(manifest, dict) else None
    if not isinstance(hashes, dict) or manifest.get("format") != FORMAT:
        raise PretrainedError(f"{str(folder / MANIFEST)!r} is not a manifest of format {FORMAT!r}")
    for name in (CONFIG, VOCAB):
        if name not in hashes:
            raise PretrainedError(f"{str(folder / MANIFEST)!r} lists no {name}")
    foreign = sorted(str(name) for name in hashes if name not in _FILES)
    if foreign:  # (a path it names would be read and hashed, wherever it leads)
        raise PretrainedError(f"{str(folder / MANIFEST)!r} lists files a pretrained model does not hold: "
                              f"{', '.join(map(repr, foreign))} (its files: {', '.join(_FILES)})")
    for name, expected in hashes.items():
        path = folder / name
        if not path.is_file():
            if path.is_symlink():
                raise PretrainedError(f"{str(path)!r} is a symlink that leads to no file (broken, or a "
                                      "loop; the manifest lists it)")
            raise PretrainedError(f"{str(path)!r} is missing (the manifest lists it)")
        if file_sha256(path) != expected:
            raise PretrainedError(f"{str(path)!r} was changed after it was written: its SHA-256 is not "
                                  f"the one {MANIFEST} records")
    data = _read_json(folder / CONFIG)
    words = _read_json(folder / VOCAB)
    try:
        vocab = Vocabulary(list(words))
    except (TypeError, ValueError) as e:
        raise PretrainedError(f"{str(folder / VOCAB)!r} is not a vocabulary ({e})") from None
    try:
        config = TrainConfig.from_dict(data["config"])
        rules = Regime.from_settings(data["regime_settings"])
        dropout = dict(data["dropout"])
        if data.get("vocab_size", len(vocab)) != len(vocab):
            raise ValueError(f"vocab_size {data['vocab_size']!r}, but {VOCAB} holds {len(vocab)} words")
        model = build_model(len(vocab), config, rules, dropout)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PretrainedError(f"{str(folder / CONFIG)!r} does not describe a model ({e})") from None
    weights = next((folder / n for n in (SAFETENSORS, TORCH_WEIGHTS) if n in hashes), None)
    if weights is None:
        raise PretrainedError(f"{str(folder / MANIFEST)!r} lists no weights ({SAFETENSORS} or "
                              f"{TORCH_WEIGHTS})")
    try:
        if weights.name == SAFETENSORS:
            st = _safetensors()
            if st is None:
                raise PretrainedError(f"{str(weights)!r} needs the safetensors package (pip install "
                                      "safetensors)")
            st.load_model(model, str(weights), strict=True)
        else:
            try:
                state = torch.load(weights, map_location="cpu", weights_only=True)
            except (pickle.UnpicklingError, EOFError, OSError) as e:
                why = f"({type(e).__name__}); not weights save_pretrained wrote"
                raise PretrainedError(f"{str(weights)!r} holds data that cannot be loaded as plain "
                                      f"tensors {why}") from None
            if not isinstance(state, Mapping):
                raise TypeError(f"it holds a {type(state).__name__}, not a state dict")
            model.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError, *_safetensors_errors()) as e:
        if isinstance(e, PretrainedError):
            raise
        first = str(e).strip().splitlines()
        detail = first[1].strip() if len(first) > 1 else (first[0] if first else type(e).__name__)
        raise PretrainedError(f"{str(weights)!r} does not fit the model {CONFIG} describes "
                              f"({detail})") from None
    model.to(device).eval()
    return PretrainedModel(model, vocab, config, data.get("regime") or "", rules.settings(), dropout, folder)
