import json
import math
import re
import warnings
from dataclasses import replace

import pytest
import torch

from rnndrop.compiling import CompiledModel, compile_model
from rnndrop.lm.cli import train_main
from rnndrop.lm.model.presets import CONFIGS
from rnndrop.lm.model.regimes import Regime, registered
from rnndrop.lm.run import job, train
from rnndrop.lm.run.checkpoint import load_checkpoint, read_result, validate_result
from rnndrop.lm.run.report import markdown_table
from rnndrop.lm.run.train import TrainingDiverged, train_run
from tests.helpers import failing_backend
from tests.lm_helpers import TINY, Killed, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_training_lowers_perplexity_and_writes_valid_results(corpus, tmp_path):
    result = train_run(corpus, TINY, "tied", tmp_path / "run", seed=1, progress=False)
    valid = [e["valid_ppl"] for e in result["epochs"]]
    vocab = len(corpus.vocab)
    assert valid[0] < vocab  # better than uniform after one epoch
    assert result["best_valid_ppl"] < valid[0] < vocab
    assert result["best_valid_ppl"] < 6  # the grammar is nearly deterministic
    assert result["test_ppl"] < 8 and result["test_ppl_mc"] is not None
    assert math.isfinite(result["test_ppl_mc"]) and result["mc_samples"] == TINY.mc_samples
    on_disk = read_result(tmp_path / "run" / "results.json")
    assert on_disk == json.loads(json.dumps(result))
    assert on_disk["regime"] == "tied" and on_disk["seed"] == 1
    assert on_disk["dropout"]["hidden"] == 0.2 and on_disk["words_per_second"] > 0
    assert on_disk["peak_memory_bytes"] > 0 and on_disk["versions"]["torch"] == torch.__version__
    assert (tmp_path / "run" / "curve.png").read_bytes()[:4] == b"\x89PNG"
    table = markdown_table([on_disk])
    assert table.count("\n") == 3 and "| tied |" in table and f"{on_disk['test_ppl']:.1f}" in table
    with pytest.raises(ValueError, match="result lacks test_ppl"):
        validate_result({k: v for k, v in on_disk.items() if k != "test_ppl"})


@pytest.mark.slow
def test_resume_after_a_kill_matches_an_uninterrupted_run_bit_for_bit(corpus, tmp_path):
    config = replace(TINY, schedule="fixed", decay_after=1, lr_decay=2.0)
    full = train_run(corpus, config, "tied", tmp_path / "full", seed=7, progress=False)

    def kill_after_first_epoch(epoch, record):
        if epoch == 1:
            raise Killed

    with pytest.raises(Killed):
        train_run(corpus, config, "tied", tmp_path / "cut", seed=7, progress=False,
                  on_epoch_end=kill_after_first_epoch)
    assert load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["progress"]["epoch"] == 1
    with pytest.raises(FileExistsError, match="--resume"):
        train_run(corpus, config, "tied", tmp_path / "cut", seed=7, progress=False)
    resumed = train_run(corpus, config, "tied", tmp_path / "cut", seed=7, progress=False, resume=True)

    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert [e["valid_ppl"] for e in full["epochs"]] == [e["valid_ppl"] for e in resumed["epochs"]]
    assert [e["lr"] for e in resumed["epochs"]] == [8.0, 4.0, 2.0]
    assert full["test_ppl"] == resumed["test_ppl"] and full["test_ppl_mc"] == resumed["test_ppl_mc"]
    # Another seed really gives other parameters (the comparison above can fail).
    other = train_run(corpus, config, "tied", tmp_path / "other", seed=8, progress=False, mc_samples=0)
    assert other["test_ppl"] != full["test_ppl"]


@pytest.mark.slow
def test_checkpoint_of_another_run_is_refused(corpus, tmp_path):
    config = replace(TINY, epochs=1)
    train_run(corpus, config, "naive", tmp_path / "run", seed=1, progress=False, mc_samples=0)
    with pytest.raises(ValueError, match="belongs to another run"):
        train_run(corpus, config, "tied", tmp_path / "run", seed=1, progress=False, resume=True)


def _nan_after(threshold):
    def regularizer(model, progress, train_tokens):
        return torch.tensor(float("nan") if progress >= threshold else 0.0)

    return regularizer


@pytest.mark.slow
def test_nan_loss_stops_with_a_clear_message_and_keeps_the_checkpoint(corpus, tmp_path):
    config = replace(TINY, epochs=2)
    regimes = {"nan-at-once": Regime("diverges at once", sites=("input",), regularizer="nan0"),
               "nan-later": Regime("diverges in epoch 2", sites=("input",), regularizer="nan05")}
    with registered(regimes, hooks={"nan0": _nan_after(0.0), "nan05": _nan_after(0.5)}):
        with pytest.raises(TrainingDiverged, match=r"training loss is nan at epoch 1, batch 1/.*"
                           r"no epoch had finished"):
            train_run(corpus, config, "nan-at-once", tmp_path / "a", progress=False)
        with pytest.raises(TrainingDiverged, match=r"loss is nan at epoch 2, batch 1/.*the checkpoint "
                           r"'.*checkpoint.pt' of epoch 1 was verified \(SHA-256\) and is kept"):
            train_run(corpus, config, "nan-later", tmp_path / "b", progress=False)
    assert not (tmp_path / "a" / "checkpoint.pt").exists()
    ckpt = load_checkpoint(tmp_path / "b" / "checkpoint.pt")
    assert ckpt["progress"]["epoch"] == 1 and len(ckpt["progress"]["history"]) == 1
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert not (tmp_path / "b" / "results.json").exists()


@pytest.mark.slow
def test_regularizer_hook_is_added_to_the_loss(corpus, tmp_path):
    seen = []

    def l2(model, progress, train_tokens):
        assert train_tokens > 0
        seen.append(progress)
        return 10.0 * sum(p.square().sum() for p in model.parameters())

    with registered({"l2-test": Regime("tied + strong L2", sites=("input",), regularizer="l2")},
                    hooks={"l2": l2}):
        config = replace(TINY, epochs=1)
        plain = train_run(corpus, config, "naive", tmp_path / "a", dropout={"input": 0.2}, seed=1,
                          progress=False, mc_samples=0)
        shrunk = train_run(corpus, config, "l2-test", tmp_path / "b", dropout={"input": 0.2}, seed=1,
                           progress=False, mc_samples=0)
    assert seen[0] == 0.0 and 0 < seen[-1] < 1 and seen == sorted(seen)
    a = load_checkpoint(tmp_path / "a" / "checkpoint.pt")["model"]["decoder.weight"]
    b = load_checkpoint(tmp_path / "b" / "checkpoint.pt")["model"]["decoder.weight"]
    assert b.norm() < 0.5 * a.norm()
    assert shrunk["regime_settings"]["regularizer"] == "l2"
    assert plain["test_ppl"] != shrunk["test_ppl"]


def test_the_grid_chooses_each_regimes_candidate_by_validation_never_by_test():
    """Candidates whose validation and test perplexities disagree: the one of the lowest
    validation perplexity is chosen (the first of equals), whatever the test split says."""
    def run(regime, hidden, valid, test):
        return {"regime": regime, "dropout": {"hidden": hidden}, "best_valid_ppl": valid, "test_ppl": test}

    grid = [run("naive", 0.1, 90.0, 80.0), run("naive", 0.3, 85.0, 95.0), run("tied", 0.2, 70.0, 60.0),
            run("tied", 0.5, 70.0, 50.0), run("naive", 0.5, 88.0, 70.0)]
    chosen = job._chosen_by_validation(grid)
    assert {regime: r["dropout"]["hidden"] for regime, r in chosen.items()} == {"naive": 0.3, "tied": 0.2}


@pytest.mark.slow
def test_benchmark_cli_grid_selects_on_validation(tmp_path, monkeypatch):
    data = write_corpus(tmp_path / "data")
    monkeypatch.setitem(CONFIGS, "tiny", replace(TINY, epochs=2))
    out = tmp_path / "out"
    argv = ["--data", str(data), "--config", "tiny", "--regimes", "none,naive", "--grid",
            "--seeds", "1,2", "--out", str(out), "--no-progress"]
    text = train_main(argv, "ptb")
    summary = json.loads((out / "summary.json").read_text())
    grid = [r for r in summary["grid_runs"] if r["regime"] == "naive"]
    assert len(grid) == 2
    best = min(grid, key=lambda r: r["best_valid_ppl"])
    finals = [r for r in summary["runs"] if r["regime"] == "naive"]
    assert [r["seed"] for r in finals] == [1, 2]
    assert all(r["dropout"] == best["dropout"] for r in finals)
    assert all(r["test_ppl_mc"] is not None for r in finals)
    none = [r for r in summary["runs"] if r["regime"] == "none"]
    assert all(r["test_ppl_mc"] is None for r in none)  # nothing to sample
    assert re.search(r"^naive\s", text, re.M) and "|" not in text and "✓" in text
    assert (out / "learning_curves.png").is_file()
    # --resume reuses every finished run.
    results = sorted(out.rglob("results.json"))
    assert len(results) == 5  # naive: 2 grid points (seed 1, the best reused) + seed 2; none: 2 seeds
    before = {p: p.stat().st_mtime_ns for p in results}
    train_main([*argv, "--resume"], "ptb")
    assert {p: p.stat().st_mtime_ns for p in results} == before


def test_benchmark_cli_data_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_main(["--data", str(tmp_path / "missing")], "ptb")
    assert exit_info.value.code == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--data", str(tmp_path), "--regimes", "nonsense"], "ptb")
    assert "regime must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_min_lr_stops_a_converged_run_and_resume_keeps_it_stopped(corpus, tmp_path):
    # lr 8 divided by 4 after every non-improving epoch; below 1 means two such epochs.
    config = replace(TINY, epochs=40, lr=8.0, min_lr=1.0, mc_samples=0)
    result = train_run(corpus, config, "none", tmp_path / "run", seed=3, progress=False)
    lrs = [e["lr"] for e in result["epochs"]]
    assert result["stop_reason"] == "lr_floor" and result["converged"]
    assert result["epochs_run"] == len(lrs) < 40
    assert sorted(set(lrs), reverse=True) == [8.0, 2.0]  # stopped before an epoch at lr 0.5
    assert result["best_epoch"] <= result["epochs_run"]
    again = train_run(corpus, config, "none", tmp_path / "run", seed=3, progress=False, resume=True)
    assert again["epochs"] == result["epochs"]  # nothing more was trained


def test_schedule_holds_the_rate_rules_and_the_stopping_rule():
    from rnndrop.lm.run.checkpoint import RunState
    from rnndrop.lm.run.recipe import LRSchedule

    fixed = LRSchedule(replace(TINY, schedule="fixed", lr=8.0, lr_decay=2.0, decay_after=2, min_lr=1.5))
    assert [fixed.rate(epoch, carried=123.0) for epoch in (1, 2, 3, 4)] == [8.0, 8.0, 4.0, 2.0]
    assert fixed.after_epoch(2.0, improved=False) == (2.0, None)  # fixed: no plateau decay
    assert fixed.after_epoch(1.0, improved=True) == (1.0, "lr_floor")
    plateau = LRSchedule(replace(TINY, lr=8.0, lr_decay=4.0, min_lr=1.0))
    assert plateau.rate(5, carried=2.0) == 2.0
    assert plateau.after_epoch(8.0, improved=True) == (8.0, None)
    assert plateau.after_epoch(8.0, improved=False) == (2.0, None)
    assert plateau.after_epoch(2.0, improved=False) == (0.5, "lr_floor")
    assert plateau.after_epoch(4.0, improved=False) == (1.0, None)  # at the floor: not below it yet
    assert list(plateau.epochs(RunState(epoch=1))) == [2, 3]  # up to TINY's cap of 3
    state, seen = RunState(epoch=0), []
    for epoch in plateau.epochs(state):
        seen.append(epoch)
        state.stopped = "lr_floor" if epoch == 2 else None
    assert seen == [1, 2] and LRSchedule.stop_reason(state) == "lr_floor"
    assert LRSchedule.stop_reason(RunState()) == "epoch_cap"


@pytest.mark.slow
def test_a_run_whose_best_epoch_is_its_cap_is_not_converged(corpus, tmp_path):
    config = replace(TINY, epochs=1, mc_samples=0)
    result = train_run(corpus, config, "none", tmp_path / "run", seed=1, progress=False)
    assert result["stop_reason"] == "epoch_cap" and result["best_epoch"] == 1
    assert result["converged"] is False


@pytest.mark.slow
def test_results_hold_test_nll_and_calibration_standard_and_mc(corpus, tmp_path):
    result = train_run(corpus, TINY, "tied", tmp_path / "run", seed=2, progress=False)
    assert math.isclose(math.exp(result["test_nll"]), result["test_ppl"], rel_tol=1e-9)
    assert math.isclose(math.exp(result["test_nll_mc"]), result["test_ppl_mc"], rel_tol=1e-9)
    for key in ("test_ece", "test_ece_mc"):
        assert 0.0 <= result[key] <= 1.0


@pytest.mark.slow
def test_dropout_from_a_grid_summary_sets_each_regimes_dropout(corpus, tmp_path):
    data = write_corpus(tmp_path / "data2")
    grid = job.run_benchmark(data, "ptb", TINY, ["naive"], [1], tmp_path / "grid", grid=True,
                                   mc_samples=0, progress=False)
    chosen = job.chosen_dropout(tmp_path / "grid" / "summary.json")
    assert chosen["naive"] == grid["runs"][0]["dropout"]
    from rnndrop.lm.data.overlap import split_fingerprints
    assert set(grid["tuned_on"]["valid_lines"]) == split_fingerprints(data, "valid")  # what it chose on
    assert job.tuning_fingerprints(tmp_path / "grid" / "summary.json")[0] == split_fingerprints(data, "valid")
    summary = job.run_benchmark(data, "ptb", TINY, ["naive"], [2], tmp_path / "final",
                                      dropout_by_regime=chosen, mc_samples=0, progress=False)
    assert summary["runs"][0]["dropout"] == chosen["naive"]
    with pytest.raises(ValueError, match="--dropout-from .*not the summary of a --grid run"):
        job.chosen_dropout(tmp_path / "final" / "summary.json")


@pytest.mark.slow
def test_adam_and_gru_train_through_the_one_loop_and_resume_bit_for_bit(corpus, tmp_path):
    config = replace(TINY, optimizer="adam", lr=0.01, adam_betas=(0.8, 0.99), cell="gru",
                     epochs=2, mc_samples=0)
    full = train_run(corpus, config, "tied", tmp_path / "full", seed=2, progress=False)
    assert full["config"]["optimizer"] == "adam" and full["config"]["cell"] == "gru"
    ckpt = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    assert "rnn.weight_hh_l0" in ckpt["model"] and ckpt["model"]["rnn.weight_hh_l0"].shape[0] == 3 * 16
    assert ckpt["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.99)
    assert all("exp_avg" in s for s in ckpt["optimizer"]["state"].values())  # really Adam
    assert full["best_valid_ppl"] < len(corpus.vocab) / 2

    def stop(epoch, record):
        if epoch == 1:
            raise Killed

    with pytest.raises(Killed):
        train_run(corpus, config, "tied", tmp_path / "cut", seed=2, progress=False, on_epoch_end=stop)
    resumed = train_run(corpus, config, "tied", tmp_path / "cut", seed=2, progress=False, resume=True)
    assert resumed["test_ppl"] == full["test_ppl"]
    with pytest.raises(ValueError, match="optimizer must be one of sgd, adam, got 'rmsprop'"):
        replace(TINY, optimizer="rmsprop")
    with pytest.raises(ValueError, match="cell must be one of lstm, gru, got 'rnn'"):
        replace(TINY, cell="rnn")
    with pytest.raises(ValueError, match=r"adam_betas must be two numbers in \[0, 1\), got \(0.9, 1.5\)"):
        replace(TINY, adam_betas=(0.9, 1.5))


@pytest.mark.slow
def test_init_from_starts_sparse_vd_from_a_dense_run_and_records_what_it_loaded(corpus, tmp_path):
    from rnndrop.lm.model.build import build_model
    from rnndrop.lm.model.regimes import REGIMES
    from rnndrop.lm.run.checkpoint import load_initial_weights

    config = replace(TINY, epochs=1, mc_samples=0)
    train_run(corpus, config, "tied", tmp_path / "dense", seed=1, progress=False)
    dense = load_checkpoint(tmp_path / "dense" / "best.pt")["model"]
    sparse = build_model(len(corpus.vocab), config, REGIMES["sparse_vd"], {})
    before = {k: v.clone() for k, v in sparse.state_dict().items()}
    info = load_initial_weights(sparse, tmp_path / "dense", corpus.vocab.itos)
    after = sparse.state_dict()
    assert info["loaded"] == sorted(dense) and all(torch.equal(after[k], dense[k]) for k in dense)
    assert info["kept_init"] == sorted(k for k in after if "log_sigma2" in k)
    assert all(torch.equal(after[k], before[k]) for k in info["kept_init"])
    shuffled = [*corpus.vocab.itos[1:], corpus.vocab.itos[0]]  # the same words in another order
    with pytest.raises(ValueError, match="same words in another order"):
        load_initial_weights(sparse, tmp_path / "dense", shuffled)
    with pytest.raises(ValueError, match="2 words that only one of them has"):
        load_initial_weights(sparse, tmp_path / "dense", [*corpus.vocab.itos[:-1], "zebra-never-seen"])

    adam = replace(config, optimizer="adam", lr=0.01)
    result = train_run(corpus, adam, "sparse_vd", tmp_path / "sparse", seed=1, progress=False,
                       init_from=tmp_path / "dense")
    assert result["init_from"]["path"].endswith("best.pt") and result["init_from"]["loaded"] == info["loaded"]
    scratch = train_run(corpus, adam, "sparse_vd", tmp_path / "scratch", seed=1, progress=False)
    assert scratch["init_from"] is None and scratch["test_ppl"] != result["test_ppl"]
    # Resuming needs the same starting weights (they are part of the run's identity).
    with pytest.raises(ValueError, match="init_from"):
        train_run(corpus, replace(adam, epochs=2), "sparse_vd", tmp_path / "sparse", seed=1,
                  progress=False, resume=True)


def test_regimes_are_read_only_and_registrations_do_not_leak():
    from rnndrop.lm.model.regimes import REGIMES, get_regime, register_regime

    with pytest.raises(TypeError):
        REGIMES["mine"] = Regime("mine")  # type: ignore[index]
    with pytest.raises(TypeError, match="Regime.regularizer must be the name of a registered hook"):
        Regime("callable hook", regularizer=lambda m, p, n: 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hook must be one of .*got 'unknown'"):
        register_regime("mine", Regime("mine", regularizer="unknown"))
    with registered({"mine": Regime("mine", sites=("input",))}):
        assert get_regime("mine").sites == ("input",)
        with pytest.raises(ValueError, match="regime 'tied' is already registered"):
            register_regime("tied", Regime("other"))
    assert "mine" not in REGIMES
    assert Regime.from_settings(REGIMES["gaussian"].settings()) == REGIMES["gaussian"]


def test_the_divergence_check_reads_steps_in_batches_and_names_the_step_that_diverged(tmp_path):
    """Steps are recorded as tensors and read every READ_EVERY steps and at the epoch's last (no
    host wait for the GPU at every step); a step that diverged is named exactly when it is read."""
    from rnndrop.lm.run.train import DivergenceCheck

    every = DivergenceCheck.READ_EVERY
    check = DivergenceCheck(3, 2 * every + 3, 0.5, tmp_path / "checkpoint.pt", 2)
    one, two, norm = torch.tensor(1.0), torch.tensor(2.0), torch.tensor(0.5)
    read = [check.step(one, one, norm, b, 10 + b) for b in range(every)]
    assert read[:-1] == [[]] * (every - 1) and read[-1] == [(1.0, 10 + b) for b in range(every)]
    read = [check.step(one, two if b == every else one, norm, b, 7) for b in range(every, 2 * every)]
    assert read[:-1] == [[]] * (every - 1) and read[-1] == [(2.0, 7)] + [(1.0, 7)] * (every - 1)  # in order
    last = [check.step(one, one, norm, b, 7) for b in range(2 * every, 2 * every + 3)]
    assert last == [[], [], [(1.0, 7)] * 3]
    check.step(one, one, norm, 3, 7)
    check.step(one, one, torch.tensor(float("inf")), 4, 7)
    check.step(torch.tensor(float("nan")), one, norm, 5, 7)
    with pytest.raises(TrainingDiverged, match=r"the gradient norm is inf at epoch 3, batch 5/35 \(lr 0.5\)"):
        check.read()


def test_a_backward_failing_compiled_goes_on_eagerly_and_the_result_says_why(corpus, tmp_path, monkeypatch):
    """``compile=None`` asks :func:`speeds_up_under_compile` with the model (False on the CPU: the
    run trains eagerly); where it says yes the run trains under ``compile_model``, and a backward
    whose compiler fails (at the first backward, after the compiled forward ran) is run again
    eagerly: the run finishes with one warning, and its result names the failure. torch's warning
    of a CUDA graph per truncated-BPTT length is off while a run with CUDA graphs trains."""
    config = replace(TINY, epochs=1)
    eager = train_run(corpus, config, "tied", tmp_path / "eager", seed=1, progress=False, mc_samples=0)
    assert eager["compiled"] is False and eager["compile_failure"] is None
    asked = []
    monkeypatch.setattr(train, "speeds_up_under_compile", lambda model: asked.append(model) or True)

    def compiled_as_on_cuda(net, **kwargs):  # CUDA graphs' bookkeeping too: state copied, torch's warning off
        compiled = compile_model(net, mode=None, backend=failing_backend("backward"), **kwargs)
        compiled.cuda_graphs = True
        return compiled

    monkeypatch.setattr(train, "compile_model", compiled_as_on_cuda)
    from torch._inductor import config as inductor_config

    triton_config = inductor_config.triton
    limit, during = triton_config.cudagraph_dynamic_shape_warn_limit, []
    with pytest.warns(RuntimeWarning, match=r"compile_model: the compiled model failed") as caught:
        result = train_run(
            corpus, config, "tied", tmp_path / "run", seed=1, progress=False, mc_samples=0,
            on_epoch_end=lambda *_: during.append(triton_config.cudagraph_dynamic_shape_warn_limit))
    # torch's warning of a CUDA graph a length is off while the run trains, and only then
    assert during == [None] and triton_config.cudagraph_dynamic_shape_warn_limit == limit
    assert len([w for w in caught if "compile_model" in str(w.message)]) == 1
    assert [type(m).__name__ for m in asked] == ["RNNLanguageModel"]
    assert result["compiled"] is True and "no lowering for the backward graph" in result["compile_failure"]
    assert [e["epoch"] for e in result["epochs"]] == [1] and math.isfinite(result["best_valid_ppl"])
    assert read_result(tmp_path / "run" / "results.json")["compile_failure"] == result["compile_failure"]


def test_a_step_failing_eagerly_too_raises_its_eager_error_and_stays_compiled(corpus, tmp_path, monkeypatch):
    """The LM loop's retry: a compiled step that fails and then fails eagerly too is not the
    compiler's failure: the eager error is raised, without the fallback's warning."""
    monkeypatch.setattr(train, "speeds_up_under_compile", lambda model: True)
    monkeypatch.setattr(train, "compile_model",
                        lambda net, **kwargs: compile_model(net, mode=None, backend="eager", **kwargs))
    nets = []

    def failing_step(run, net, *args):
        nets.append(net)
        raise RuntimeError("out of memory (compiled)" if len(nets) == 1 else "out of memory (eager too)")

    monkeypatch.setattr(train, "_forward_backward", failing_step)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="compile_model")
        with pytest.raises(RuntimeError, match=r"out of memory \(eager too\)"):
            train_run(corpus, replace(TINY, epochs=1), "tied", tmp_path / "run", seed=1, progress=False,
                      mc_samples=0)
    assert isinstance(nets[0], CompiledModel) and nets[1] is nets[0].module and nets[0].compiled
