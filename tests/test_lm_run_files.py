"""Every file of a run names the run it belongs to, and what --resume and `evaluate` read is
checked against it (issue 44, "Files of one run accepted as another's"); the job's report covers
every run its folder holds and one folder is one job's (issue 44, "Lost results in a race")."""

import json
import shutil

import pytest

from rnndrop.lm.run.checkpoint import load_checkpoint, read_verified_result, run_id
from tests.lm_helpers import run_cli, write_corpus


def _job(data, out, *extra, regimes="tied", seeds="1,2", epochs="1"):
    argv = ["ptb", "--data", str(data), "--regimes", regimes, "--seeds", seeds, "--epochs", epochs,
            "--hidden-size", "12", "--emb-size", "10", "--batch-size", "4", "--bptt", "6",
            "--mc-samples", "0", "--out", str(out), "--no-progress", *extra]
    return run_cli(argv)


def _swap(a, b):
    tmp = a.with_name("swap.tmp")
    shutil.move(a, tmp)
    shutil.move(b, a)
    shutil.move(tmp, b)


@pytest.fixture
def finished(tmp_path):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out) == 0
    seed1, seed2 = sorted(out.glob("tied/*-seed1")) + sorted(out.glob("tied/*-seed2"))
    return data, out, seed1, seed2


@pytest.mark.slow
def test_every_file_of_a_run_names_it(finished):
    _, _, seed1, _ = finished
    result = read_verified_result(seed1 / "results.json")
    assert result["run_id"] == run_id(result["identity"])
    for name in ("best.pt", "checkpoint.pt"):
        assert load_checkpoint(seed1 / name)["identity"] == result["identity"]
    import hashlib

    assert result["files"]["metrics.csv"] == hashlib.sha256((seed1 / "metrics.csv").read_bytes()).hexdigest()
    assert result["files"]["best.pt"] == hashlib.sha256((seed1 / "best.pt").read_bytes()).hexdigest()


@pytest.mark.slow
def test_evaluate_refuses_a_best_pt_swapped_between_seed_folders(finished, capsys, caplog):
    data, out, seed1, seed2 = finished
    capsys.readouterr()
    _swap(seed1 / "best.pt", seed2 / "best.pt")
    for command in (["evaluate", "--data", str(data)], ["generate"]):
        assert run_cli([command[0], str(seed1), *command[1:]]) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert "Traceback" not in err and len(lines) == 1, err
        assert "belongs to another run" in lines[0] and "seed: 1" in lines[0] and "2" in lines[0]
    # --resume flags both runs (their numbers stand: results.json is each run's own)
    caplog.clear()
    assert _job(data, out, "--resume") == 0
    flagged = [r.getMessage() for r in caplog.records if "belongs to another run" in r.getMessage()]
    assert len(flagged) == 2, caplog.text
    _swap(seed1 / "best.pt", seed2 / "best.pt")
    assert run_cli(["evaluate", str(seed1), "--data", str(data)]) == 0


@pytest.mark.slow
def test_resume_refuses_a_swapped_best_pt_of_an_unfinished_run(finished, capsys):
    data, out, seed1, seed2 = finished
    for folder in (seed1, seed2):  # as if the runs were stopped: their checkpoints remain
        (folder / "results.json").unlink()
    _swap(seed1 / "best.pt", seed2 / "best.pt")
    capsys.readouterr()
    assert _job(data, out, "--resume", epochs="2") == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1 and "belongs to another run" in lines[0], err


@pytest.mark.slow
def test_resume_restores_a_deleted_metrics_csv_and_flags_an_edited_one(finished, caplog):
    data, out, seed1, seed2 = finished
    original = (seed1 / "metrics.csv").read_text()
    (seed1 / "metrics.csv").unlink()
    edited = original.replace(original.splitlines()[1].split(",")[3], "1.5", 1)
    assert edited != original
    (seed2 / "metrics.csv").write_text(edited)
    caplog.clear()
    assert _job(data, out, "--resume") == 0
    assert (seed1 / "metrics.csv").read_text() == original
    seed2_original = read_verified_result(seed2 / "results.json")["files"]["metrics.csv"]
    import hashlib

    assert hashlib.sha256((seed2 / "metrics.csv").read_bytes()).hexdigest() == seed2_original
    assert (seed2 / "metrics.edited.csv").read_text() == edited  # the edit is kept, set aside
    warnings = [r.getMessage() for r in caplog.records
                if "was changed after the run wrote it" in r.getMessage()]
    assert len(warnings) == 1 and "seed2" in warnings[0], caplog.text


@pytest.mark.slow
def test_resume_with_a_subset_of_the_regimes_keeps_every_run_in_the_report(tmp_path):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, regimes="none,tied", seeds="1") == 0
    before = json.loads((out / "summary.json").read_text())
    assert _job(data, out, "--resume", regimes="tied", seeds="1") == 0
    after = json.loads((out / "summary.json").read_text())
    assert sorted(r["regime"] for r in after["runs"]) == ["none", "tied"]
    assert sorted(after["regimes"]) == ["none", "tied"]
    assert {json.dumps(r, sort_keys=True) for r in after["runs"]} == \
        {json.dumps(r, sort_keys=True) for r in before["runs"]}
    table = (out / "results.md").read_text()
    assert "| none |" in table and "| tied |" in table
