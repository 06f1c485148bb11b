"""Download Penn Treebank and WikiText-2 once into a local cache.

Sources, in the order tried by ``source="auto"``:

1. the official archive: Mikolov's ``simple-examples.tgz`` for Penn Treebank (the
   files of Zaremba et al. 2014 and Gal & Ghahramani 2016) and Merity et al.'s
   ``wikitext-2-v1.zip``; the URL is ``base_url + archive name``, where ``base_url``
   is the argument, else the environment variable ``RNNDROP_DATA_MIRROR``, else the
   official location (a mirror only needs to serve the archive under the same name);
2. the Hugging Face hub, when the optional ``datasets`` package is installed.

The three split files land in ``cache_dir/<name>/`` (default ``~/.cache/rnndrop``,
or ``RNNDROP_CACHE``), written atomically, and are reused by later calls.

Integrity: the archive streams to a temporary file beside the cache in chunks, hashed as it
arrives, and is refused unless it has every digest pinned in :data:`DATASETS`
(:attr:`RemoteCorpus.digests`), whatever the source (official, mirror). The pins are the MD5s
published for these archives (PaddlePaddle's and torchtext's dataset loaders, which download the
same files); their SHA-256s were not known when the pins were written (no network): a download
logs the archive's SHA-256, and adding it as ``"sha256"`` in :data:`DATASETS` verifies it too. An
archive without any pin is used with a warning that gives its SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tarfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rnndrop.atomic import atomic_write
from rnndrop.lm.data.corpus import SPLITS

__all__ = ["DATASETS", "DownloadError", "RemoteCorpus", "default_cache_dir", "download_corpus"]

log = logging.getLogger(__name__)

MIRROR_ENV = "RNNDROP_DATA_MIRROR"
CACHE_ENV = "RNNDROP_CACHE"


class DownloadError(RuntimeError):
    """No source could deliver the corpus (offline, blocked, or a broken archive)."""


@dataclass(frozen=True)
class RemoteCorpus:
    """Where a corpus lives and how its archive maps to split files.

    Attributes:
        base_url: the official directory of the archive (ends with ``/``).
        archive: file name of the ``.tgz`` / ``.zip`` archive.
        members: archive member path -> split name (``train`` / ``valid`` / ``test``).
        file_pattern: local file name of a split, with ``{split}``.
        hub: ``(dataset path, config name or None, text field)`` on the Hugging Face hub.
        digests: the archive's pinned digests, ``hashlib`` algorithm name -> hex digest
            (``{"md5": ..., "sha256": ...}``); a downloaded archive must match every one.
    """

    base_url: str
    archive: str
    members: dict[str, str]
    file_pattern: str
    hub: tuple[str, str | None, str]
    digests: dict[str, str] = field(default_factory=dict)

    def files(self) -> dict[str, str]:
        return {split: self.file_pattern.format(split=split) for split in SPLITS}


DATASETS: dict[str, RemoteCorpus] = {
    "ptb": RemoteCorpus(
        base_url="http://www.fit.vutbr.cz/~imikolov/rnnlm/",
        archive="simple-examples.tgz",
        members={f"./simple-examples/data/ptb.{s}.txt": s for s in SPLITS},
        file_pattern="ptb.{split}.txt",
        hub=("ptb-text-only/ptb_text_only", None, "sentence"),
        digests={"md5": "30177ea32e27c525793142b6bf2c8e2d"},  # as published by PaddlePaddle's loader
    ),
    "wikitext-2": RemoteCorpus(
        base_url="https://wikitext.smerity.com/",
        archive="wikitext-2-v1.zip",
        members={f"wikitext-2/wiki.{s}.tokens": s for s in SPLITS},
        file_pattern="{split}.txt",
        hub=("Salesforce/wikitext", "wikitext-2-v1", "text"),
        digests={"md5": "542ccefacc6c27f945fb54453812b3cd"},  # as published by torchtext's loader
    ),
}


def default_cache_dir() -> Path:
    """``$RNNDROP_CACHE`` or ``~/.cache/rnndrop``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rnndrop").expanduser()


def _write_atomic(path: Path, data: bytes) -> None:
    with atomic_write(path) as f:
        f.write(data)


def _normalise(member: str) -> str:
    return member[2:] if member.startswith("./") else member


def _extract(archive: Path, name: str, members: dict[str, str]) -> dict[str, bytes]:
    """The bytes of each wanted member of a ``.tgz`` / ``.zip`` archive file, by split."""
    wanted = {_normalise(m): split for m, split in members.items()}
    found: dict[str, bytes] = {}
    try:
        if name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                for zinfo in zf.infolist():
                    split = wanted.get(_normalise(zinfo.filename))
                    if split is not None:
                        found[split] = zf.read(zinfo)
        else:
            with tarfile.open(archive, mode="r:*") as tf:
                for info in tf:
                    split = wanted.get(_normalise(info.name))
                    if split is not None and info.isfile():
                        f = tf.extractfile(info)
                        if f is not None:
                            found[split] = f.read()
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise DownloadError(f"archive {name} is not a readable .tgz/.zip file: {e}") from e
    missing = [m for m, split in members.items() if split not in found]
    if missing:
        raise DownloadError(f"archive {name} lacks {', '.join(missing)}")
    return found


CHUNK = 1 << 20  # bytes read from the connection and written at a time


def _fetch_url(url: str, dest: Path, timeout: float, algorithms: list[str]) -> dict[str, str]:
    """Stream ``url`` into ``dest`` in chunks; return the hex digest of each of ``algorithms``."""
    log.info("downloading %s", url)
    hashes = {a: hashlib.new(a) for a in algorithms}
    with urllib.request.urlopen(url, timeout=timeout) as response, open(dest, "wb") as f:
        while chunk := response.read(CHUNK):
            f.write(chunk)
            for h in hashes.values():
                h.update(chunk)
    return {a: h.hexdigest() for a, h in hashes.items()}


def _verify(remote: RemoteCorpus, url: str, got: dict[str, str]) -> None:
    """Raise DownloadError unless the archive has every pinned digest; warn when none is pinned."""
    if not remote.digests:
        log.warning("%s has no pinned digest: not verified (sha256 %s)", remote.archive, got["sha256"])
        return
    for algorithm, expected in remote.digests.items():
        if got[algorithm] != expected.lower():
            raise DownloadError(
                f"{url} is not the archive rnndrop knows: its {algorithm} is {got[algorithm]}, "
                f"expected {expected} (a corrupted or altered download, or another file under that "
                "name); it was not used"
            )
    log.info("%s verified (%s); sha256 %s", remote.archive, ", ".join(remote.digests), got["sha256"])


def _from_archive(remote: RemoteCorpus, base_url: str, timeout: float, scratch: Path) -> dict[str, bytes]:
    """Download the archive to a temporary file in ``scratch``, verify it, extract the splits."""
    url = base_url.rstrip("/") + "/" + remote.archive
    scratch.mkdir(parents=True, exist_ok=True)
    part = scratch / f".{remote.archive}.{os.getpid()}.part"
    try:
        try:
            got = _fetch_url(url, part, timeout, sorted({"sha256", *remote.digests}))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise DownloadError(f"could not download {url}: {e}") from e
        _verify(remote, url, got)
        return _extract(part, remote.archive, remote.members)
    finally:
        part.unlink(missing_ok=True)


def _from_hub(remote: RemoteCorpus) -> dict[str, bytes]:
    try:
        import datasets  # optional dependency, imported only here
    except ImportError as e:
        raise DownloadError(
            "the Hugging Face hub needs the optional package 'datasets' "
            "(pip install 'rnndrop[hub]')"
        ) from e
    path, config, field = remote.hub
    hub_splits = {"train": "train", "valid": "validation", "test": "test"}
    out: dict[str, bytes] = {}
    try:
        for split, hub_split in hub_splits.items():
            rows = datasets.load_dataset(path, config, split=hub_split)[field]
            # PTB rows are sentences without newline; WikiText rows are lines with it.
            text = "".join(r if r.endswith("\n") else r + "\n" for r in rows)
            out[split] = text.encode("utf-8")
    except Exception as e:  # network, hub or format errors from a third-party package
        raise DownloadError(f"could not load {path} from the Hugging Face hub: {e}") from e
    return out


def download_corpus(
    name: str,
    cache_dir: str | Path | None = None,
    *,
    base_url: str | None = None,
    source: str = "auto",
    timeout: float = 60.0,
) -> Path:
    """The directory of ``name`` (``"ptb"`` or ``"wikitext-2"``) in the cache, downloaded if needed.

    Args:
        name: a key of :data:`DATASETS`.
        cache_dir: where corpora are kept; default :func:`default_cache_dir`.
        base_url: where the archive is served (``base_url/<archive>``); default
            ``$RNNDROP_DATA_MIRROR`` or the official location.
        source: ``"auto"`` (the archive, then the hub if ``datasets`` is installed),
            ``"url"`` (the archive only) or ``"hub"`` (the hub only).
        timeout: seconds before a stalled connection gives up.

    Raises:
        DownloadError: every source failed; the message says what to do offline.
    """
    if name not in DATASETS:
        raise ValueError(f"name must be one of {', '.join(map(repr, DATASETS))}, got {name!r}")
    if source not in ("auto", "url", "hub"):
        raise ValueError(f"source must be 'auto', 'url' or 'hub', got {source!r}")
    remote = DATASETS[name]
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = target / name
    files = remote.files()
    if all((target / f).is_file() for f in files.values()):
        return target
    base = base_url or os.environ.get(MIRROR_ENV) or remote.base_url

    attempts: list[tuple[str, Callable[[], dict[str, bytes]]]] = []
    if source in ("auto", "url"):
        url = f"{base.rstrip('/')}/{remote.archive}"
        attempts.append((url, lambda: _from_archive(remote, base, timeout, target.parent)))
    if source == "hub" or (source == "auto" and _datasets_installed()):
        attempts.append((f"the Hugging Face hub ({remote.hub[0]})", lambda: _from_hub(remote)))
    errors: list[str] = []
    for label, attempt in attempts:
        try:
            contents = attempt()
        except DownloadError as e:
            log.warning("%s", e)
            errors.append(str(e))
            continue
        target.mkdir(parents=True, exist_ok=True)
        for split, data in contents.items():
            _write_atomic(target / files[split], data)
        log.info("%s: saved %s from %s", name, ", ".join(files.values()), label)
        return target
    raise DownloadError(
        f"could not get the {name} corpus.\n  "
        + "\n  ".join(errors)
        + "\nTo run offline on the small real sample shipped with rnndrop, pass --data sample. "
        + f"For the full corpus on an offline machine: fetch {remote.base_url}{remote.archive} "
        "on a machine "
        f"with internet, unpack it and pass its folder holding {', '.join(files.values())} "
        f"as --data DIR (or copy those files into {target}); or serve the archive from a "
        f"mirror and set {MIRROR_ENV}=<url of its folder>; or install 'datasets' "
        "(pip install 'rnndrop[hub]') to use the Hugging Face hub."
    )


def _datasets_installed() -> bool:
    return importlib.util.find_spec("datasets") is not None

