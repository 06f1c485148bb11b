"""DistributedDataParallel under torchrun: 2 CPU processes, gloo (issue 14).

Two launches of ``python -m torch.distributed.run --standalone --nproc_per_node=2`` run
this file as a script (``_worker``), each rank writing what it saw as JSON; the tests
read it. The first launch checks one step of every regime, trains a one-step run with
p = 0, a full run and the same run killed (SIGKILL, both ranks) in the middle of its
second epoch; the second launch resumes the killed run. Each launch has a timeout, the
process group one of 60 s, and torchrun picks a free port itself.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script by torchrun
    sys.path.insert(0, str(ROOT))

from rnndrop.lm.data.corpus import load_corpus  # noqa: E402
from rnndrop.lm.model.build import build_model  # noqa: E402
from rnndrop.lm.model.regimes import REGIMES, get_hook, get_regime, registered  # noqa: E402
from rnndrop.lm.run.checkpoint import load_checkpoint, read_verified_result  # noqa: E402
from rnndrop.lm.run.train import TrainingDiverged, add_mc_result, train_run  # noqa: E402
from tests.lm_helpers import TINY, write_corpus  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 2
LAUNCH_TIMEOUT = 150
REGIME_NAMES = ("tied", "untied", "naive", "batch", "weight_drop", "gaussian", "sparse_vd")
#: The regimes that are deterministic with every p = 0 (sparse_vd's weight noise has no p).
DETERMINISTIC_AT_ZERO = ("tied", "untied", "naive", "batch", "weight_drop", "gaussian")
NO_DROPOUT = dict.fromkeys(("embedding", "input", "between", "hidden", "output"), 0.0)
ONE_STEP = replace(TINY, bptt=1000, epochs=1, mc_samples=0)  # one segment: one step per epoch
FULL = replace(TINY, schedule="fixed", decay_after=1, lr_decay=2.0, epochs=3)
#: AWD-LSTM's recipe: AR / TAR, variable BPTT (the same lengths on every rank), NT-ASGD, fine-tuning.
RECIPE = replace(TINY, schedule="fixed", lr_decay=1.0, epochs=3, ar=1.0, tar=1.0, variable_bptt=True,
                 nt_asgd=True, nonmono=1, finetune_epochs=1, mc_samples=0)
#: The "tied" regime plus a loss hook that adds 0 and can kill the process mid-epoch.
KILLABLE = replace(REGIMES["tied"], regularizer="zero_or_kill")
#: The "tied" regime plus a loss hook that makes rank 1's loss NaN in the middle of epoch 1.
NAN_ON_RANK_1 = replace(REGIMES["tied"], regularizer="nan_on_rank_1")
_kill_at: list[float | None] = [None]


def _nan_on_rank_1(model, progress: float, train_tokens: int) -> torch.Tensor:
    rank = torch.distributed.get_rank()
    return torch.tensor(math.nan if rank == 1 and progress >= 0.5 / FULL.epochs else 0.0)


def _zero_or_kill(model, progress: float, train_tokens: int) -> torch.Tensor:
    if _kill_at[0] is not None and progress >= _kill_at[0]:
        os.kill(os.getpid(), signal.SIGKILL)
    return torch.zeros(())


# ---------------------------------------------------------------------------------------
# The worker (one per rank, under torchrun)


def _digest(tensors) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _step_checks(vocab: int, ctx) -> dict:
    """Per regime: one DDP step at p = 0 against one process with the whole batch; at p > 0
    the logits of the same input on every rank, three DDP steps, gradients, parameters."""
    from torch.nn.parallel import DistributedDataParallel

    from rnndrop.distributed import check_noise_independent, seed_noise_per_rank
    from rnndrop.lm.run.process_group import shard_columns

    tokens = torch.randint(vocab, (13, 4), generator=torch.Generator().manual_seed(5))
    inputs, targets = tokens[:-1], tokens[1:]
    report: dict = {}

    def step(net, model, x, y, optimizer, regularizer):
        logits, _ = net(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        if regularizer is not None:
            loss = loss + regularizer(model, 0.5, 1000)
        optimizer.zero_grad()
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        return missing

    cases = [(name, "lstm", False) for name in REGIME_NAMES] + [("tied", "lstm", True)]
    cases += [(name, "gru", False) for name in ("tied", "weight_drop", "gaussian", "sparse_vd")]
    for name, cell, tie in cases:
        regime = get_regime(name)
        regularizer = None if regime.regularizer is None else get_hook(regime.regularizer)
        config = replace(TINY, tie_weights=tie, cell=cell)
        key = name + ("+tie_weights" if tie else "") + ("+gru" if cell == "gru" else "")
        entry: dict = {}
        x, y = shard_columns(inputs, ctx.rank, WORLD), shard_columns(targets, ctx.rank, WORLD)
        if name in DETERMINISTIC_AT_ZERO:
            torch.manual_seed(3)
            model = build_model(vocab, config, regime, NO_DROPOUT)
            initial = [p.detach().clone() for p in model.parameters()]
            reference = build_model(vocab, config, regime, NO_DROPOUT)
            reference.load_state_dict(model.state_dict())
            step(reference, reference, inputs, targets, torch.optim.SGD(reference.parameters(), lr=1.0),
                 regularizer)
            net = DistributedDataParallel(model)
            entry["missing_grad_p0"] = step(net, model, x, y, torch.optim.SGD(model.parameters(), lr=1.0),
                                            regularizer)
            entry["max_diff_p0"] = max((a - b).abs().max().item() for a, b in
                                       zip(model.parameters(), reference.parameters()))
            entry["moved_p0"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), initial))
        torch.manual_seed(3)
        model = build_model(vocab, config, regime, TINY.dropout)
        net = DistributedDataParallel(model)
        seed_noise_per_rank(3)
        check_noise_independent()
        model.train()
        with torch.no_grad():
            entry["logits"] = _digest([model(inputs)[0]])
        if key == "tied":
            masks = model.rnn.sample_masks(4)
            entry["hidden_masks"] = _digest([m for m in masks.hidden])
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        entry["missing_grad"] = sorted({n for _ in range(3)
                                        for n in step(net, model, x, y, optimizer, regularizer)})
        entry["parameters"] = _digest(model.parameters())
        with torch.no_grad():
            entry["logits_after"] = _digest([model(inputs)[0]])
        report[key] = entry
    # Negative control: seeded alike, the ranks draw the same masks.
    torch.manual_seed(3)
    model = build_model(vocab, TINY, get_regime("tied"), TINY.dropout).train()
    with torch.no_grad():
        report["control_same_seed_logits"] = _digest([model(inputs)[0]])
    return report


def _worker(scenario: str, folder: Path) -> None:
    import torch.distributed as dist

    from rnndrop.lm.run.process_group import RankFailed, end_worker, init_from_env

    ctx, _ = init_from_env("cpu", timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    corpus = load_corpus(folder / "data")
    report: dict = {"rank": ctx.rank, "world_size": ctx.world_size, "backend": ctx.backend}
    out = folder / f"{scenario}.rank{ctx.rank}.json"

    def save() -> None:
        out.write_text(json.dumps(report))

    try:
        with registered(regimes={"tied_killable": KILLABLE, "tied_nan": NAN_ON_RANK_1},
                        hooks={"zero_or_kill": _zero_or_kill, "nan_on_rank_1": _nan_on_rank_1}):
            if scenario == "first":
                report["steps"] = _step_checks(len(corpus.vocab), ctx)
                save()
                try:
                    train_run(corpus, FULL, "tied_nan", folder / "nan", seed=7, progress=False)
                except TrainingDiverged as e:
                    report["diverged"] = str(e)
                cut_short = corpus if ctx.rank == 0 else replace(corpus, train=corpus.train[:-8])
                try:  # a node's copy of the corpus cut short: failed in a collective, gloo's error
                    train_run(cut_short, FULL, "tied", folder / "other_corpus", seed=7, progress=False)
                except ValueError as e:
                    report["other_corpus"] = str(e)
                train_run(corpus, ONE_STEP, "tied", folder / "one_step", dropout=NO_DROPOUT, seed=4,
                          progress=False)
                report["recipe"] = train_run(corpus, RECIPE, "weight_drop", folder / "recipe", seed=2,
                                             progress=False)
                full = train_run(corpus, FULL, "tied_killable", folder / "full", seed=7, progress=False)
                report["full_result"] = full
                save()
                _kill_at[0] = 1.5 / FULL.epochs  # the middle of epoch 2
                train_run(corpus, FULL, "tied_killable", folder / "cut", seed=7, progress=False)
                report["not_killed"] = True
            else:
                try:
                    train_run(corpus, FULL, "tied_killable", folder / "cut", seed=7, progress=False)
                except (FileExistsError, RankFailed) as e:
                    report["without_resume"] = f"{type(e).__name__}: {e}"
                report["resumed"] = train_run(corpus, FULL, "tied_killable", folder / "cut", seed=7,
                                              progress=False, resume=True)
                report["mc_added"] = add_mc_result(corpus, FULL, folder / "full", 2, "cpu")
        save()
    except BaseException:
        dist.destroy_process_group()
        raise
    end_worker(0)


# ---------------------------------------------------------------------------------------
# The tests


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=2 ARGS`` (a free port of its own), killed with
    its workers after LAUNCH_TIMEOUT seconds; stdout and stderr apart."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
               "--max-restarts=0", *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"torchrun {args} did not finish in {LAUNCH_TIMEOUT} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _launch(scenario: str, folder: Path) -> subprocess.CompletedProcess:
    launched = _torchrun(__file__, scenario, str(folder))
    launched.stdout += launched.stderr
    return launched


def _reports(folder: Path, scenario: str, launched: subprocess.CompletedProcess) -> list[dict]:
    files = [folder / f"{scenario}.rank{r}.json" for r in range(WORLD)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"{missing} not written; torchrun said:\n{launched.stdout[-4000:]}"
    return [json.loads(f.read_text()) for f in files]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    write_corpus(folder / "data")
    first = _launch("first", folder)
    reports = {"first": _reports(folder, "first", first), "first_output": first.stdout,
               "cut_epoch": load_checkpoint(folder / "cut" / "checkpoint.pt")["progress"]["epoch"]}
    resumed = _launch("resume", folder)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    reports["resume"] = _reports(folder, "resume", resumed)
    reports["folder"] = folder
    return reports


@pytest.mark.slow
def test_every_regime_at_p0_one_ddp_step_equals_one_process_with_the_whole_batch(runs):
    for report in runs["first"]:
        assert report["world_size"] == WORLD and report["backend"] == "gloo"
        for key, entry in report["steps"].items():
            if key.split("+")[0] not in DETERMINISTIC_AT_ZERO:
                continue
            assert entry["missing_grad_p0"] == [], key
            assert entry["moved_p0"] > 1e-3, key  # the step changed the parameters
            assert entry["max_diff_p0"] < 1e-6, (key, entry["max_diff_p0"])


@pytest.mark.slow
def test_every_regime_draws_its_own_noise_per_rank_and_keeps_parameters_equal(runs):
    rank0, rank1 = (r["steps"] for r in runs["first"])
    gru = {f"{name}+gru" for name in ("tied", "weight_drop", "gaussian", "sparse_vd")}
    assert set(rank0) == {*REGIME_NAMES, "tied+tie_weights", *gru, "control_same_seed_logits"}
    for key in rank0:
        if key == "control_same_seed_logits":
            continue
        assert rank0[key]["logits"] != rank1[key]["logits"], f"{key}: the same noise on both ranks"
        assert rank0[key]["missing_grad"] == [], key  # DDP needs no find_unused_parameters
        assert rank0[key]["parameters"] == rank1[key]["parameters"], f"{key}: replicas differ"
        # Same parameters, same input: the outputs differ only by the noise.
        assert rank0[key]["logits_after"] != rank1[key]["logits_after"], key
    assert rank0["tied"]["hidden_masks"] != rank1["tied"]["hidden_masks"]
    # The control: ranks seeded alike draw the same masks (what the per-rank seed prevents).
    assert rank0["control_same_seed_logits"] == rank1["control_same_seed_logits"]


@pytest.mark.slow
def test_one_ddp_step_of_train_run_matches_one_process(runs, tmp_path):
    corpus = load_corpus(runs["folder"] / "data")
    single = train_run(corpus, ONE_STEP, "tied", tmp_path / "single", dropout=NO_DROPOUT, seed=4,
                       progress=False)
    ddp_folder = runs["folder"] / "one_step"
    ddp = json.loads((ddp_folder / "results.json").read_text())
    assert ddp["world_size"] == WORLD and ddp["backend"] == "gloo"
    assert single["world_size"] == 1 and single["backend"] is None
    a = load_checkpoint(tmp_path / "single" / "checkpoint.pt")
    b = load_checkpoint(ddp_folder / "checkpoint.pt")
    assert len(a["progress"]["history"]) == 1
    for name, tensor in a["model"].items():
        assert torch.allclose(tensor, b["model"][name], rtol=0, atol=1e-6), name
    # Validation and test perplexities are over the whole split, summed over the ranks.
    for key in ("best_valid_ppl", "test_ppl", "test_ece"):
        assert math.isclose(single[key], ddp[key], rel_tol=1e-5), key
    assert single["epochs"][0]["train_ppl"] == pytest.approx(ddp["epochs"][0]["train_ppl"], rel=1e-5)


@pytest.mark.slow
def test_the_awd_recipe_trains_under_torchrun(runs):
    rank0, rank1 = (r["recipe"] for r in runs["first"])
    assert rank0 == rank1 and rank0["world_size"] == WORLD
    assert rank0["epochs_run"] == 4 and rank0["nt_asgd"]["finetune"]["from_epoch"] == 3
    assert rank0["epochs"][-1]["averaged"] and math.isfinite(rank0["test_ppl"])
    averaged = load_checkpoint(runs["folder"] / "recipe" / "checkpoint.pt")["averaging"]["averaged"]
    assert int(averaged["n_averaged"]) > 0


@pytest.mark.slow
def test_a_run_killed_mid_epoch_resumes_under_torchrun_and_matches_the_uninterrupted_run(runs):
    folder = runs["folder"]
    for report in runs["first"]:
        assert "not_killed" not in report, "the cut run was not killed"
    assert runs["cut_epoch"] == 1  # killed during epoch 2
    rank0, rank1 = runs["resume"]
    assert "FileExistsError" in rank0["without_resume"] and "RankFailed" in rank1["without_resume"]
    full, resumed = runs["first"][0]["full_result"], rank0["resumed"]
    assert rank1["resumed"] == resumed  # every rank returns rank 0's result
    a = load_checkpoint(folder / "full" / "checkpoint.pt")
    b = load_checkpoint(folder / "cut" / "checkpoint.pt")
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert [e["valid_ppl"] for e in full["epochs"]] == [e["valid_ppl"] for e in resumed["epochs"]]
    assert full["test_ppl"] == resumed["test_ppl"] and full["test_ppl_mc"] == resumed["test_ppl_mc"]
    assert resumed["world_size"] == WORLD and resumed["backend"] == "gloo"
    # The Monte-Carlo perplexity added afterwards: every rank scores its share.
    added = [r["mc_added"] for r in runs["resume"]]
    assert added[0] == added[1] and added[0]["mc_samples"] == 2
    assert math.isfinite(added[0]["test_ppl_mc"]) and added[0]["test_ppl_mc"] != full["test_ppl_mc"]
    assert read_verified_result(folder / "full" / "results.json") == added[0]
    # Each rank's generator state is saved, and they differ (independent noise).
    states = b["distributed"]["rng"]
    assert len(states) == WORLD and not torch.equal(states[0]["torch"], states[1]["torch"])


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_only_with_as_many_processes(runs, tmp_path):
    import shutil

    corpus = load_corpus(runs["folder"] / "data")
    shutil.copytree(runs["folder"] / "full", tmp_path / "full")
    (tmp_path / "full" / "results.json").unlink()
    with registered(regimes={"tied_killable": KILLABLE}, hooks={"zero_or_kill": _zero_or_kill}), \
            pytest.raises(ValueError, match=r"written by 2 process\(es\); resume it with as many"):
        train_run(corpus, FULL, "tied_killable", tmp_path / "full", seed=7, progress=False, resume=True)


@pytest.mark.slow
def test_the_command_trains_under_torchrun_and_rank_0_alone_reports(tmp_path):
    data = write_corpus(tmp_path / "data")
    flags = ["-m", "rnndrop.lm", "ptb", "--data", str(data), "--regimes", "tied", "--epochs", "1",
             "--emb-size", "16", "--hidden-size", "16", "--batch-size", "4", "--bptt", "8",
             "--mc-samples", "2", "--no-progress", "--out", str(tmp_path / "job")]
    done = _torchrun(*flags)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(re.findall(r"^tied\s", done.stdout, re.M)) == 1  # the table, printed by rank 0 only
    assert done.stdout.count("Written to") == 1
    (result,) = (tmp_path / "job" / "tied").glob("*/results.json")
    result = read_verified_result(result)
    assert result["world_size"] == WORLD and result["backend"] == "gloo" and result["test_ppl_mc"]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_jobs_above_1_under_torchrun_is_a_one_line_usage_error_from_rank_0(rank, monkeypatch, capsys):
    from rnndrop.lm.cli import EXIT_DATA, main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    assert main(["ptb", "--data", "sample", "--jobs", "2"]) == EXIT_DATA
    expected = "error: --jobs must be 1 under torchrun (its processes train each run together), got 2\n"
    assert capsys.readouterr().err == (expected if rank == "0" else "")


def test_an_error_one_rank_meets_alone_is_written_by_that_rank(tmp_path, monkeypatch, capsys):
    """A rank's own data missing (or a step failing there) was written nowhere: rank 0 alone
    reports, and rank 0 only saw its peer go (a gloo traceback). The rank now writes its line, and
    a rank whose peer went writes one line too."""
    from rnndrop.lm import cli
    from rnndrop.lm.cli import commands
    from rnndrop.lm.data.corpus import CorpusError

    def missing_on_this_rank(*args, **kwargs):
        raise CorpusError("data directory '/data' does not exist (on this node)")

    monkeypatch.setenv("RANK", "1")  # one process (no WORLD_SIZE): the rank's own step, as on rank 1
    monkeypatch.setattr(commands, "run_benchmark", missing_on_this_rank)
    data = write_corpus(tmp_path / "data")
    argv = ["ptb", "--data", str(data), "--out", str(tmp_path / "out"), "--no-progress"]
    assert cli.main(argv) == cli.EXIT_DATA
    assert capsys.readouterr().err == "error (rank 1): data directory '/data' does not exist (on this node)\n"

    def peer_gone(*args, **kwargs):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:16001. This is typically caused by a remote worker crashing.\nmore")

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(commands, "run_benchmark", peer_gone)
    assert cli.main(argv) == cli.EXIT_DATA
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: another process of the job stopped ([") and (
        "its error is in the lines above or in torchrun's report" in err)


@pytest.mark.slow
def test_a_corpus_that_differs_on_one_rank_stops_every_rank_before_training(runs):
    messages = [r.get("other_corpus") for r in runs["first"]]
    assert messages[0] == messages[1], messages
    assert messages[0].startswith("the corpus read by rank 1 is not the one rank 0 read")


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_with_the_same_message(runs):
    messages = [r["diverged"] for r in runs["first"]]
    assert messages[0] == messages[1]
    assert messages[0].startswith("training stopped: the training loss is nan on rank 1 at epoch 1, batch")
    assert "no epoch had finished" in messages[0]


# ---------------------------------------------------------------------------------------
# One process: the helpers


def test_rank_seeds_differ_from_the_seed_and_between_ranks():
    from rnndrop.distributed import rank_seed, seed_noise_per_rank

    seeds = {rank_seed(1, r) for r in range(64)} | {rank_seed(2, r) for r in range(64)}
    assert len(seeds) == 128 and 1 not in seeds and all(0 <= s < 2**63 for s in seeds)
    assert seed_noise_per_rank(1, rank=3) == rank_seed(1, 3)
    first = torch.rand(4)
    seed_noise_per_rank(1)  # no process group: rank 0
    assert not torch.equal(first, torch.rand(4))
    torch.manual_seed(rank_seed(1, 3))
    assert torch.equal(first, torch.rand(4))
    with pytest.raises(ValueError, match="rank must be >= 0, got -1"):
        rank_seed(1, -1)
    with pytest.raises(TypeError, match="seed must be an int, got float"):
        rank_seed(1.0, 0)


def test_helpers_are_no_ops_for_one_process():
    from rnndrop.distributed import check_noise_independent, check_parameters_agree
    from rnndrop.lm.run.process_group import ONE_PROCESS, all_reduce_sums, current, init_from_env

    check_noise_independent()
    check_parameters_agree(torch.nn.Linear(2, 3))
    with pytest.raises(TypeError, match="module must be an nn.Module, got str"):
        check_parameters_agree("model")
    assert current() == ONE_PROCESS and all_reduce_sums([1.5, 2.0], ONE_PROCESS) == [1.5, 2.0]
    assert "WORLD_SIZE" not in os.environ and init_from_env("cpu") == (ONE_PROCESS, torch.device("cpu"))


def test_shards_of_the_streams_are_contiguous_and_cover_the_batch():
    from rnndrop.lm.run.process_group import shard_columns

    batched = torch.arange(30).view(3, 10)
    shards = [shard_columns(batched, r, 4) for r in range(4)]
    assert [s.shape[1] for s in shards] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(shards, dim=1), batched)
    with pytest.raises(ValueError, match="a batch of 10 streams cannot be shared by 11 processes"):
        shard_columns(batched, 0, 11)


def test_batch_sizes_that_do_not_divide_among_processes_are_refused():
    from rnndrop.lm.run.process_group import Distributed, check_batch_split

    three = Distributed(rank=0, world_size=3, backend="gloo")
    with pytest.raises(ValueError, match=r"batch_size must be a multiple of the number of processes \(3\)"):
        check_batch_split(TINY.batch_size, TINY.eval_batch_size, three)
    with pytest.raises(ValueError, match=r"eval_batch_size must be >= the number of processes \(3\)"):
        check_batch_split(6, TINY.eval_batch_size, three)
    check_batch_split(6, 3, three)


def test_torchrun_variables_are_checked(monkeypatch):
    from rnndrop.lm.run.process_group import init_from_env

    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer .* got 'two'"):
        init_from_env("cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK must be in \[0, 2\) under torchrun, got 2"):
        init_from_env("cpu")


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
