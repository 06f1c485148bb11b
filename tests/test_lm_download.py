import dataclasses
import hashlib
import http.server
import io
import logging
import socket
import tarfile
import threading
import zipfile
from functools import partial

import pytest

from rnndrop.lm.data import download
from rnndrop.lm.data.corpus import load_corpus
from rnndrop.lm.data.download import DATASETS, MIRROR_ENV, DownloadError, download_corpus

TEXT = {"train": "a b c\nb c a\n", "valid": "a b\n", "test": "c a\n"}
PINNED = dict(DATASETS)  # as shipped


@pytest.fixture(autouse=True)
def _unpinned(monkeypatch):
    """The archives served here are fakes: the tests run without the real pins unless they pin."""
    for name, remote in PINNED.items():
        monkeypatch.setitem(DATASETS, name, dataclasses.replace(remote, digests={}))


def _pin(monkeypatch, name, path, **override):
    data = path.read_bytes()
    digests = {"sha256": hashlib.sha256(data).hexdigest(), "md5": hashlib.md5(data).hexdigest(), **override}
    monkeypatch.setitem(DATASETS, name, dataclasses.replace(PINNED[name], digests=digests))


def _tgz(path):
    with tarfile.open(path, "w:gz") as tf:
        for split, text in TEXT.items():
            data = text.encode()
            info = tarfile.TarInfo(f"./simple-examples/data/ptb.{split}.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def _zip(path):
    with zipfile.ZipFile(path, "w") as zf:
        for split, text in TEXT.items():
            zf.writestr(f"wikitext-2/wiki.{split}.tokens", text)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/www; yields its base URL and a hit log."""
    root = tmp_path / "www"
    root.mkdir()
    hits = []

    class Handler(_QuietHandler):
        def do_GET(self):
            hits.append(self.path)
            super().do_GET()

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/mirror/", root, hits
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_ptb_download_from_a_local_mirror_then_cached(server, tmp_path):
    base, root, hits = server
    (root / "mirror").mkdir()
    _tgz(root / "mirror" / "simple-examples.tgz")
    cache = tmp_path / "cache"
    folder = download_corpus("ptb", cache, base_url=base, source="url")
    assert folder == cache / "ptb"
    assert (folder / "ptb.valid.txt").read_text() == TEXT["valid"]
    assert hits == ["/mirror/simple-examples.tgz"]
    corpus = load_corpus(folder)
    assert corpus.vocab.decode(corpus.valid) == ["a", "b", "<eos>"]
    # A second call finds the cache and does not download again.
    assert download_corpus("ptb", cache, base_url=base, source="url") == folder
    assert len(hits) == 1
    assert not list(folder.glob(".*part"))  # no temporary files left behind


def test_wikitext2_download_through_the_mirror_env_var(server, tmp_path, monkeypatch):
    base, root, hits = server
    (root / "mirror").mkdir()
    _zip(root / "mirror" / "wikitext-2-v1.zip")
    monkeypatch.setenv(MIRROR_ENV, base)
    folder = download_corpus("wikitext-2", tmp_path / "cache", source="url")
    assert sorted(p.name for p in folder.iterdir()) == ["test.txt", "train.txt", "valid.txt"]
    assert (folder / "train.txt").read_text() == TEXT["train"]
    assert hits == ["/mirror/wikitext-2-v1.zip"]


def test_missing_archive_on_the_server_says_what_to_do(server, tmp_path):
    base, _, _ = server
    with pytest.raises(DownloadError) as err:
        download_corpus("ptb", tmp_path / "cache", base_url=base, source="url")
    message = str(err.value)
    assert "404" in message and "simple-examples.tgz" in message
    assert "--data DIR" in message and MIRROR_ENV in message
    assert not (tmp_path / "cache" / "ptb").exists()


def test_offline_machine_gets_clear_instructions(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DownloadError, match=r"(?s)could not download.*offline.*--data DIR"):
        download_corpus("ptb", tmp_path, base_url=f"http://127.0.0.1:{port}/", source="url", timeout=5)


def test_broken_archive_is_reported(server, tmp_path):
    base, root, _ = server
    (root / "mirror").mkdir()
    (root / "mirror" / "wikitext-2-v1.zip").write_bytes(b"not a zip")
    with pytest.raises(DownloadError, match="wikitext-2-v1.zip is not a readable"):
        download_corpus("wikitext-2", tmp_path / "cache", base_url=base, source="url")


def test_archive_without_the_split_files(server, tmp_path):
    base, root, _ = server
    (root / "mirror").mkdir()
    with zipfile.ZipFile(root / "mirror" / "wikitext-2-v1.zip", "w") as zf:
        zf.writestr("wikitext-2/wiki.train.tokens", "a\n")
    with pytest.raises(DownloadError, match="lacks wikitext-2/wiki.valid.tokens"):
        download_corpus("wikitext-2", tmp_path / "cache", base_url=base, source="url")


def test_bad_arguments():
    with pytest.raises(ValueError, match="name must be one of 'ptb', 'wikitext-2'"):
        download_corpus("ptb2")
    with pytest.raises(ValueError, match="source must be"):
        download_corpus("ptb", source="ftp")


def test_every_archive_has_a_pinned_digest():
    for name, remote in PINNED.items():
        assert remote.digests, name
        for algorithm, digest in remote.digests.items():
            assert algorithm in ("md5", "sha256") and len(digest) == hashlib.new(algorithm).digest_size * 2
            assert int(digest, 16) >= 0


def test_a_pinned_archive_is_streamed_in_chunks_verified_and_used(server, tmp_path, monkeypatch):
    base, root, _ = server
    (root / "mirror").mkdir()
    _tgz(root / "mirror" / "simple-examples.tgz")
    _pin(monkeypatch, "ptb", root / "mirror" / "simple-examples.tgz")
    reads = []
    fetch = download._fetch_url

    def spy(url, dest, timeout, algorithms):
        result = fetch(url, dest, timeout, algorithms)
        reads.append(dest.stat().st_size)  # the archive went to a file, not to memory
        return result

    monkeypatch.setattr(download, "CHUNK", 16)  # many chunks for a small archive
    monkeypatch.setattr(download, "_fetch_url", spy)
    folder = download_corpus("ptb", tmp_path / "cache", base_url=base, source="url")
    assert (folder / "ptb.train.txt").read_text() == TEXT["train"]
    assert reads == [(root / "mirror" / "simple-examples.tgz").stat().st_size]
    assert not list((tmp_path / "cache").glob(".*part"))


@pytest.mark.parametrize("algorithm", ["sha256", "md5"])
def test_an_archive_that_does_not_match_its_pin_is_refused(server, tmp_path, monkeypatch, algorithm):
    base, root, _ = server
    (root / "mirror").mkdir()
    _zip(root / "mirror" / "wikitext-2-v1.zip")
    wrong = "0" * (64 if algorithm == "sha256" else 32)
    _pin(monkeypatch, "wikitext-2", root / "mirror" / "wikitext-2-v1.zip", **{algorithm: wrong})
    message = rf"is not the archive rnndrop knows: its {algorithm} is [0-9a-f]+, expected {wrong}"
    with pytest.raises(DownloadError, match=message):
        download_corpus("wikitext-2", tmp_path / "cache", base_url=base, source="url")
    assert not (tmp_path / "cache" / "wikitext-2").exists()
    assert not list((tmp_path / "cache").glob(".*part"))


def test_an_unpinned_archive_is_used_with_a_warning_giving_its_sha256(server, tmp_path, caplog):
    base, root, _ = server
    (root / "mirror").mkdir()
    _zip(root / "mirror" / "wikitext-2-v1.zip")
    sha256 = hashlib.sha256((root / "mirror" / "wikitext-2-v1.zip").read_bytes()).hexdigest()
    with caplog.at_level(logging.WARNING, logger=download.__name__):
        download_corpus("wikitext-2", tmp_path / "cache", base_url=base, source="url")
    assert f"no pinned digest: not verified (sha256 {sha256})" in caplog.text
