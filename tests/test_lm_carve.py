"""rnndrop-lm carve: the result pages' corpora from the official files, line for line."""

import pytest

from rnndrop.lm.data.carve import CARVINGS, CarveError, carve
from tests.lm_helpers import run_cli


def _official(folder, name, count):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(f" {name} line {i} \n" for i in range(1, count + 1)), encoding="utf-8")


@pytest.fixture
def official(tmp_path):
    folder = tmp_path / "official"
    _official(folder, "ptb.train.txt", 42068)
    _official(folder, "ptb.valid.txt", 3370)
    _official(folder, "wiki.valid.tokens", 3760)
    return folder


def test_each_corpus_is_its_slices_of_the_official_files(official, tmp_path):
    for corpus, files in CARVINGS.items():
        written = carve(corpus, official, tmp_path / corpus)
        assert [p.name for p in written] == list(files)
        for path in written:
            (source, *_), first, last = files[path.name]
            lines = path.read_text(encoding="utf-8").splitlines()
            assert lines[0] == f" {source} line {first} " and lines[-1] == f" {source} line {last} "
            assert len(lines) == last - first + 1
    # ptb-mini's three splits are the whole official validation file, in order
    mini = "".join((tmp_path / "ptb-mini" / n).read_text() for n in CARVINGS["ptb-mini"])
    assert mini == (official / "ptb.valid.txt").read_text()


def test_wrong_missing_or_taken_files_are_refused(official, tmp_path):
    with pytest.raises(CarveError, match="corpus must be one of ptb-mini, ptb-144k, wikitext-2-mini"):
        carve("ptb-full", official, tmp_path / "x")
    _official(tmp_path / "short", "ptb.valid.txt", 3000)
    with pytest.raises(CarveError, match="has 3,000 lines; the official file has 3,370"):
        carve("ptb-mini", tmp_path / "short", tmp_path / "x")
    with pytest.raises(CarveError, match="holds no ptb.train.txt"):
        carve("ptb-144k", tmp_path / "short", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    carve("ptb-mini", official, tmp_path / "done")
    before = (tmp_path / "done" / "ptb.train.txt").read_bytes()
    with pytest.raises(CarveError, match="already holds ptb.train.txt"):
        carve("ptb-mini", official, tmp_path / "done")
    assert (tmp_path / "done" / "ptb.train.txt").read_bytes() == before


def test_the_command_writes_the_corpus_or_says_why_not_in_one_line(official, tmp_path, capsys):
    out = tmp_path / "ptb-144k"
    assert run_cli(["carve", "ptb-144k", "--from", str(official), "--out", str(out)]) == 0
    assert "ptb-144k: wrote" in capsys.readouterr().out and (out / "ptb.test.txt").is_file()
    assert run_cli(["carve", "ptb-144k", "--from", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: carve: ") and "ptb.train.txt" in err
