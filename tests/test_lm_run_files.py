"""Every file of a run names the run it belongs to, and what --resume and `evaluate` read is
checked against it (issue 44, "Files of one run accepted as another's"); the job's report covers
every run its folder holds and one folder is one job's (issue 44, "Lost results in a race")."""

import json
import shutil

import pytest
import torch

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
        plain = torch.load(seed1 / name, weights_only=True)  # issue 42 item 6: plain torch reads it
        assert plain["rnndrop_checkpoint"]["run_id"] == result["run_id"] and "model" in plain
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


def test_a_job_refuses_an_output_folder_another_job_holds(tmp_path, capsys):
    import os
    import socket

    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    out.mkdir()
    holder = {"pid": os.getppid(), "host": socket.gethostname(), "since": "now"}  # a live process
    (out / "job.lock").write_text(json.dumps(holder))
    for extra in ((), ("--resume",)):
        assert _job(data, out, *extra) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert "Traceback" not in err and len(lines) == 1, err
        assert "output folder" in lines[0] and f"is in use by pid {os.getppid()}" in lines[0]
    assert (out / "job.lock").exists() and not list(out.glob("*/*/"))


def test_the_job_lock_is_reentrant_in_one_process_and_released(tmp_path):
    from rnndrop.lm.run.checkpoint import JobLock

    with JobLock(tmp_path) as outer:
        with JobLock(tmp_path):
            assert (tmp_path / "job.lock").exists()
        assert (tmp_path / "job.lock").exists() and outer.held
    assert not (tmp_path / "job.lock").exists()


_RACER = """
import sys, time
from pathlib import Path
from rnndrop.lm import cli
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.001)
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_two_jobs_started_at_once_on_one_empty_folder_one_goes_ahead(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    data, out, go = write_corpus(tmp_path / "data"), tmp_path / "out", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    racers = [subprocess.Popen(
        [sys.executable, "-c", _RACER, str(go), "ptb", "--data", str(data), "--regimes", regime,
         "--epochs", "1", "--hidden-size", "12", "--emb-size", "10", "--batch-size", "4", "--bptt", "6",
         "--mc-samples", "0", "--out", str(out), "--no-progress"],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for regime in ("none", "tied")]
    import time

    time.sleep(8)  # both have imported rnndrop and wait for the signal
    go.touch()
    done = [(p.wait(timeout=300), p.communicate()) for p in racers]
    codes = sorted(code for code, _ in done)
    assert codes == [0, 2], done
    (err,) = [e for code, (_, e) in done if code == 2]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1 and "in use by pid" in lines[0], err
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 1 and len(list(out.glob("*/*/results.json"))) == 1


@pytest.mark.slow
def test_resume_restores_an_unfinished_runs_metrics_from_its_checkpoint(finished, monkeypatch, capsys):
    from rnndrop.lm.run import job

    data, out, seed1, seed2 = finished
    original = (seed1 / "metrics.csv").read_text()
    for folder in (seed1, seed2):  # stopped after epoch 1 of 2: a checkpoint, no results
        (folder / "results.json").unlink()
    (seed1 / "metrics.csv").unlink()

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "train_run", stopped)  # Ctrl-C as the run resumes
    assert _job(data, out, "--resume", epochs="2") == 130
    assert (seed1 / "metrics.csv").read_text() == original
