"""Issue 25 (reliability, second round), the language-model half: no finished work lost, no
result reported that was not computed. Every test here trains, so all are slow."""

import json
from dataclasses import replace

import pytest
import torch

from rnndrop.lm import cli
from rnndrop.lm.run.train import train_run
from tests.lm_helpers import TINY, one_thread, write_corpus  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.slow

ONE = replace(TINY, epochs=1, mc_samples=0)


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _strip_checkpoints(folder):
    for path in folder.glob("checkpoint*.pt"):
        path.unlink()


def test_a_finished_run_without_its_checkpoints_is_never_trained_over(corpus, tmp_path):
    run = tmp_path / "run"
    train_run(corpus, ONE, "tied", run, seed=1, progress=False)
    _strip_checkpoints(run)  # to free disk: best.pt and results.json kept
    kept = _snapshot(run)
    other = replace(ONE, hidden_size=ONE.hidden_size + 4)
    for config, resume in ((other, False), (other, True), (ONE, False), (ONE, True)):
        with pytest.raises(FileExistsError, match=r"holds files of a run \(best.pt, results.json"):
            train_run(corpus, config, "tied", run, seed=1, resume=resume, progress=False)
    assert _snapshot(run) == kept


def test_a_run_stopped_between_its_first_best_and_checkpoint_starts_again_with_resume(corpus, tmp_path):
    run = tmp_path / "run"
    expected = train_run(corpus, ONE, "tied", tmp_path / "whole", seed=1, progress=False)
    train_run(corpus, ONE, "tied", run, seed=1, progress=False)
    for name in ("results.json", "metrics.csv", "curve.png"):
        (run / name).unlink(missing_ok=True)
    _strip_checkpoints(run)  # best.pt alone: the moment between the two writes of epoch 1
    with pytest.raises(FileExistsError):
        train_run(corpus, ONE, "tied", run, seed=1, progress=False)
    result = train_run(corpus, ONE, "tied", run, seed=1, resume=True, progress=False)
    assert result["test_ppl"] == expected["test_ppl"]
    with pytest.raises(FileExistsError):  # another run's best.pt is not taken for this one's
        _strip_checkpoints(run)
        (run / "results.json").unlink()
        train_run(corpus, replace(ONE, lr=ONE.lr / 2), "tied", run, seed=1, resume=True, progress=False)


def _job(data, out, *extra):
    argv = ["ptb", "--data", str(data), "--regimes", "tied", "--epochs", "1", "--hidden-size", "12",
            "--emb-size", "10", "--batch-size", "4", "--bptt", "6", "--out", str(out), "--no-progress",
            *extra]
    threads = torch.get_num_threads()
    try:
        return cli.main(argv)
    finally:
        torch.set_num_threads(threads)


def test_the_command_refuses_a_folder_whose_runs_lost_their_checkpoints(tmp_path, capsys):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0") == 0
    for folder in out.glob("*/*/"):
        _strip_checkpoints(folder)
    capsys.readouterr()
    assert _job(data, out, "--mc-samples", "0", "--hidden-size", "16") == 2
    assert "already holds runs of a job" in capsys.readouterr().err
    assert _job(data, out, "--mc-samples", "0", "--resume") == 0  # the finished runs are reused


def test_resume_with_mc_samples_adds_mc_to_a_run_finished_without_it(tmp_path):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0") == 0
    (results,) = out.glob("tied/*/results.json")
    assert json.loads(results.read_text())["test_ppl_mc"] is None
    assert _job(data, out, "--mc-samples", "3", "--resume") == 0
    result = json.loads(results.read_text())
    assert result["mc_samples"] == 3 and result["test_ppl_mc"] > 1
