"""Reliability of the language-model command: no finished work lost, no result reported that
was not computed, one line for every user error."""

import errno
import json
import os
from dataclasses import replace

import pytest
import torch

from rnndrop.atomic import atomic_write, write_json_atomic
from rnndrop.lm import cli
from rnndrop.lm.data.corpus import Vocabulary, load_corpus
from rnndrop.lm.model.language_model import RNNLanguageModel
from rnndrop.lm.run import train
from rnndrop.lm.run.evaluate import generate
from rnndrop.lm.run.train import resolve_device, train_run
from tests.lm_helpers import TINY, Killed, kill_after_first_epoch, run_cli, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

ONE = replace(TINY, epochs=1, mc_samples=0)


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _strip_checkpoints(folder):
    for path in folder.glob("checkpoint*.pt"):
        path.unlink()


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_run_stopped_between_its_first_best_and_checkpoint_starts_again_with_resume(corpus, tmp_path):
    run = tmp_path / "run"
    expected = train_run(corpus, ONE, "tied", tmp_path / "whole", seed=1, progress=False)
    train_run(corpus, ONE, "tied", run, seed=1, progress=False)
    for name in ("results.json", "metrics.csv", "curve.png"):
        (run / name).unlink(missing_ok=True)
    _strip_checkpoints(run)  # best.pt alone: the moment between the two writes of epoch 1
    holds = r"holds files of a run \(best.pt.*\) but no checkpoint to continue it from"
    with pytest.raises(FileExistsError, match=holds):
        train_run(corpus, ONE, "tied", run, seed=1, progress=False)
    result = train_run(corpus, ONE, "tied", run, seed=1, resume=True, progress=False)
    assert result["test_ppl"] == expected["test_ppl"]
    _strip_checkpoints(run)
    (run / "results.json").unlink()
    with pytest.raises(FileExistsError, match=holds):  # another run's best.pt is not taken for this one's
        train_run(corpus, replace(ONE, lr=ONE.lr / 2), "tied", run, seed=1, resume=True, progress=False)


def _job(data, out, *extra):
    argv = ["ptb", "--data", str(data), "--regimes", "tied", "--epochs", "1", "--hidden-size", "12",
            "--emb-size", "10", "--batch-size", "4", "--bptt", "6", "--out", str(out), "--no-progress",
            *extra]
    return run_cli(argv)


@pytest.mark.slow
def test_the_command_refuses_a_folder_whose_runs_lost_their_checkpoints(tmp_path, capsys):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0") == 0
    for folder in out.glob("*/*/"):
        _strip_checkpoints(folder)
    capsys.readouterr()
    assert _job(data, out, "--mc-samples", "0", "--hidden-size", "16") == 2
    assert "already holds runs of a job" in capsys.readouterr().err
    assert _job(data, out, "--mc-samples", "0", "--resume") == 0  # the finished runs are reused


@pytest.mark.slow
def test_resume_with_mc_samples_adds_mc_to_a_run_finished_without_it(tmp_path):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0") == 0
    (results,) = out.glob("tied/*/results.json")
    assert json.loads(results.read_text())["test_ppl_mc"] is None
    assert _job(data, out, "--mc-samples", "3", "--resume") == 0
    result = json.loads(results.read_text())
    assert result["mc_samples"] == 3 and result["test_ppl_mc"] > 1


@pytest.mark.slow
def test_resume_refuses_a_folder_whose_runs_were_trained_with_other_settings(tmp_path, capsys):
    """A new seed with another hidden size (or epoch cap) beside a finished run: the report put both
    in one row, mean and sd over seeds trained differently. Refused before anything trains; the
    same settings, or a cap that grows for the runs the job continues, go on."""
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0") == 0
    capsys.readouterr()
    for extra, differs in ((["--hidden-size", "16"], "config.hidden_size: 16 here vs 12 there"),
                           (["--epochs", "2"], "epochs: 2 here vs 1 there")):
        assert _job(data, out, "--mc-samples", "0", "--resume", "--seeds", "2", *extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "was trained with other settings than this job's" in err, err
        assert differs in err and "train into another --out" in err
        assert ("name its regime and seed in --regimes and --seeds" in err) == ("epochs" in differs)
        assert not list(out.glob("tied/*seed2"))  # refused before it trained
    assert _job(data, out, "--mc-samples", "0", "--resume", "--seeds", "1,2", "--epochs", "2") == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(r["seed"] for r in summary["runs"]) == [1, 2]


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:7"])
def test_a_device_this_machine_lacks_is_a_value_error_that_says_so(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"CPU-only build|no CUDA GPU is visible"):
        resolve_device(device)
    with pytest.raises(ValueError, match="device must be"):
        resolve_device("gpu")


@pytest.mark.slow
def test_evaluate_and_generate_on_a_missing_device_are_one_line(tmp_path, capsys, monkeypatch):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0") == 0
    (run,) = out.glob("tied/*/")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    for argv in (["evaluate", str(run), "--device", "cuda"], ["generate", str(run), "--device", "cuda"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--device 'cuda'" in err
    assert _job(data, tmp_path / "other", "--device", "cuda") == 2
    assert capsys.readouterr().err.count("\n") == 1
    for folder in (out, out / "tied"):  # a job's or a regime's folder: says so and names the run
        assert cli.main(["evaluate", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds runs, not one run" in err and str(run).rstrip("/") in err


@pytest.mark.slow
def test_evaluate_from_another_folder_never_scores_another_corpus_as_the_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "data")
    assert _job("data", "out", "--mc-samples", "0", "--regimes", "none") == 0  # a relative --data
    (run,) = (tmp_path / "out").glob("none/*/")
    elsewhere = tmp_path / "elsewhere"
    write_corpus(elsewhere / "data", sizes=(60, 20, 20))  # another corpus under the same relative name
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli.main(["evaluate", str(run)]) == 0  # the run recorded its corpus' absolute path
    assert "the run reported" in capsys.readouterr().out
    assert cli.main(["evaluate", str(run), "--data", "data", "--mc-samples", "4"]) == 0
    text = capsys.readouterr().out
    assert "not the corpus the run was trained on" in text and "the run reported" not in text
    assert "draws no dropout noise" in text  # MC of a run without dropout: said, not a traceback
    result = json.loads((run / "results.json").read_text())
    assert os.path.isabs(result["corpus"]["source"])


@pytest.mark.slow
def test_evaluate_knows_the_corpus_of_a_run_that_has_not_finished(tmp_path, capsys):
    """An interrupted run has best.pt but no results.json yet: its corpus is known by the
    fingerprint best.pt holds, so its own corpus is scored without "not the corpus the run was
    trained on", another one with it, and without --data the error says what to pass."""
    data = write_corpus(tmp_path / "data")
    other = write_corpus(tmp_path / "other", sizes=(60, 20, 20))
    run = tmp_path / "run"
    with pytest.raises(Killed):
        train_run(load_corpus(data), replace(ONE, epochs=2), "tied", run, progress=False,
                  on_epoch_end=kill_after_first_epoch)
    assert (run / "best.pt").is_file() and not (run / "results.json").exists()
    capsys.readouterr()
    assert cli.main(["evaluate", str(run), "--data", str(data)]) == 0
    assert "not the corpus" not in capsys.readouterr().out
    assert cli.main(["evaluate", str(run), "--data", str(other)]) == 0
    assert "not the corpus the run was trained on" in capsys.readouterr().out
    assert cli.main(["evaluate", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has not finished" in err and "--data DIR" in err


@pytest.mark.slow
def test_an_intact_checkpoint_written_for_another_model_is_one_line(corpus, tmp_path, capsys):
    from rnndrop.lm.run.checkpoint import CheckpointError, load_checkpoint, load_model, save_checkpoint

    run = tmp_path / "run"
    train_run(corpus, ONE, "tied", run, seed=1, progress=False)
    for name in ("best.pt", "checkpoint.pt"):
        state = load_checkpoint(run / name)
        state["model"] = {k: v[:-1] if v.dim() and v.shape[0] > 1 else v for k, v in state["model"].items()}
        save_checkpoint(state, run / name)  # a valid file: the right checksum over the wrong tensors
    with pytest.raises(CheckpointError, match="intact but its model state does not fit"):
        load_model(run)
    with pytest.raises(CheckpointError, match="checkpoint.pt' is intact but"):
        train_run(corpus, replace(ONE, epochs=2), "tied", run, seed=1, resume=True, progress=False)
    capsys.readouterr()
    assert cli.main(["evaluate", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not fit" in err


def test_a_full_disk_names_the_file_and_keeps_what_was_there(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    target.write_text("finished")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"cannot write '.*results.json': No space left on device; its "
                                      r"previous version is intact") as error, atomic_write(target, "w") as f:
        f.write("new")
    assert error.value.errno == errno.ENOSPC
    assert target.read_text() == "finished" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_write_that_fails_in_the_writer_leaves_no_temporary_file(tmp_path):
    """An error inside the block (a value json cannot write) leaves the previous file and no
    stray temporary file beside it."""
    target = tmp_path / "summary.json"
    target.write_text("finished")
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_json_atomic({"run": object()}, target)
    assert target.read_text() == "finished" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.slow
def test_generate_says_which_prompt_words_the_model_does_not_know(tmp_path, capsys, caplog):
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0", "--regimes", "none") == 0
    (run,) = out.glob("none/*/")
    capsys.readouterr()
    assert cli.main(["generate", str(run), "--prompt", "zzqq the cat zzqq", "--words", "2"]) == 0
    assert "read as <unk>: zzqq" in caplog.text and caplog.text.count("zzqq") == 1
    assert capsys.readouterr().out.startswith("zzqq the cat zzqq")


@pytest.mark.parametrize("temperature", [1e-30, 1e-320, float("inf")])
def test_generate_at_an_extreme_temperature_samples_instead_of_failing(temperature):
    """Any temperature > 0 samples words, a tiny one the greedy choice (logits / T must not
    overflow into NaN probabilities and a traceback from torch.multinomial)."""
    torch.manual_seed(0)
    vocab = Vocabulary.from_words(["a", "b", "c", "d", "e", "f"])
    model = RNNLanguageModel(len(vocab), 8, 8, 1)

    def sample(t, seed):
        return generate(model, vocab, ["a"], 5, temperature=t, generator=torch.Generator().manual_seed(seed))

    words = sample(temperature, 1)
    assert len(words) == 5 and all(w in vocab.stoi for w in words)
    if temperature < 1:
        assert words == sample(1e-9, 2)  # greedy: the generator plays no part


@pytest.mark.slow
def test_resume_with_init_from_never_reuses_a_run_that_did_not_start_from_those_weights(tmp_path, capsys):
    """``init_from`` is part of a run's identity: ``--resume --init-from RUN`` never reports a
    run trained from scratch as if fine-tuned from RUN."""
    data = write_corpus(tmp_path / "data")
    assert _job(data, tmp_path / "dense", "--mc-samples", "0") == 0
    (dense,) = (tmp_path / "dense").glob("tied/*/")
    out = tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0") == 0  # from scratch
    capsys.readouterr()
    assert _job(data, out, "--mc-samples", "0", "--resume", "--init-from", str(dense)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was trained with other settings" in err and "init_from" in err, err
    fine_tuned = tmp_path / "fine-tuned"  # a run that did start from them is reused as it is
    assert _job(data, fine_tuned, "--mc-samples", "0", "--init-from", str(dense)) == 0
    (result,) = fine_tuned.glob("tied/*/results.json")
    before = result.read_bytes()
    assert json.loads(before)["init_from"] is not None
    assert _job(data, fine_tuned, "--mc-samples", "0", "--resume", "--init-from", str(dense)) == 0
    assert result.read_bytes() == before


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_resume_says_when_a_reused_run_has_lost_its_weights(tmp_path, capsys, caplog, damage):
    """A finished run whose best.pt is damaged or deleted is reused with a warning that its
    weights are gone, not in silence (the job would report success and `evaluate` fail later)."""
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"
    assert _job(data, out, "--mc-samples", "0") == 0
    (best,) = out.glob("tied/*/best.pt")
    if damage == "truncated":
        best.write_bytes(best.read_bytes()[:1000])
    else:
        best.unlink()
    caplog.clear()
    assert _job(data, out, "--mc-samples", "0", "--resume") == 0  # the numbers stand
    warning = [r.getMessage() for r in caplog.records if "best.pt" in r.getMessage()]
    assert len(warning) == 1 and "the trained weights are gone" in warning[0], caplog.text
    assert ("truncated" if damage == "truncated" else "is missing") in warning[0]


@pytest.mark.slow
def test_ctrl_c_while_the_test_split_is_scored_is_not_called_an_epoch(tmp_path, capsys, monkeypatch):
    """Ctrl-C / SIGTERM during the test (or Monte-Carlo) scoring after the last epoch of a
    1-epoch run says so, not "interrupted in epoch 2"."""
    data, out = write_corpus(tmp_path / "data"), tmp_path / "out"

    validate = train.score_split

    def ctrl_c_when_testing(model, batched, bptt, calibration_bins, *args, **kwargs):
        if calibration_bins is None:  # validation, inside the epoch loop
            return validate(model, batched, bptt, calibration_bins, *args, **kwargs)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(train, "score_split", ctrl_c_when_testing)
        assert _job(data, out, "--mc-samples", "0") == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "after the last epoch of run 1/1 tied" in err, err
    assert "epoch 2" not in err
    assert _job(data, out, "--mc-samples", "0", "--resume") == 0
    assert len(list(out.glob("tied/*/results.json"))) == 1


def test_a_misspelt_regime_leaves_no_empty_run_folder(corpus, tmp_path):
    with pytest.raises(ValueError, match="regime must be one of .*got 'tide'"):
        train_run(corpus, ONE, "tide", tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_that_fails_before_writing_removes_the_folder_it_made_and_keeps_one_it_did_not(
        corpus, tmp_path):
    too_wide = replace(ONE, eval_batch_size=10_000)  # more columns than the valid split has words
    with pytest.raises(ValueError, match="too short for eval_batch_size=10000"):
        train_run(corpus, too_wide, "tied", tmp_path / "made" / "run", progress=False)
    assert not (tmp_path / "made" / "run").exists()
    (tmp_path / "mine").mkdir()  # the user's folder: left where it was, empty
    with pytest.raises(ValueError, match="too short"):
        train_run(corpus, too_wide, "tied", tmp_path / "mine", progress=False)
    assert (tmp_path / "mine").is_dir() and not any((tmp_path / "mine").iterdir())


def test_resume_without_a_dataset_name_keeps_the_name_the_results_were_written_with(corpus, tmp_path):
    run = tmp_path / "run"
    train_run(corpus, ONE, "tied", run, seed=1, progress=False, dataset="my corpus")
    assert train_run(corpus, ONE, "tied", run, seed=1, resume=True, progress=False)["dataset"] == "my corpus"
    assert json.loads((run / "results.json").read_text())["dataset"] == "my corpus"
    renamed = train_run(corpus, ONE, "tied", run, seed=1, resume=True, progress=False, dataset="renamed")
    assert renamed["dataset"] == "renamed"  # a name given is the name written
