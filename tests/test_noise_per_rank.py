"""Per-rank noise by default: under an initialised process group whose ranks share a generator
state, rnndrop's first draw gives each rank its own stream (reproducible from the seed and the
rank) and warns once; ranks seeded apart, or after seed_noise_per_rank, are left alone."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from rnndrop import VariationalLSTM, bernoulli_mask
from rnndrop import distributed as rd


@pytest.fixture
def fake_group(monkeypatch):
    """A process group of 2 as rank 1 sees it, whose all_gather returns ``gathered[0]``."""
    gathered: list[list[str] | None] = [None]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(rd, "_gather_digests", lambda d: gathered[0] or [d, d])  # default: alike
    monkeypatch.setattr(rd, "_settled", False)
    monkeypatch.setattr(rd, "_auto", True)
    return gathered


def test_ranks_sharing_a_state_are_reseeded_per_rank_once_with_a_warning(fake_group):
    torch.manual_seed(7)
    with pytest.warns(UserWarning, match=r"held the same random generator state.*rank_seed\(7, rank\)"):
        first = bernoulli_mask((4, 50), 0.5)
    torch.manual_seed(rd.rank_seed(7, 1))
    assert torch.equal(first, bernoulli_mask((4, 50), 0.5))  # reproducible from seed and rank
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(7)
        again = bernoulli_mask((4, 50), 0.5)  # settled: no second check, no reseed
    torch.manual_seed(7)
    assert torch.equal(again, bernoulli_mask((4, 50), 0.5))


def test_layers_draws_go_through_the_check(fake_group):
    torch.manual_seed(3)
    layer = VariationalLSTM(3, 4, dropout_hidden=0.5)
    with pytest.warns(UserWarning, match="each rank now draws its own"):
        layer(torch.randn(2, 5, 3))


def test_ranks_seeded_apart_are_left_alone(fake_group):
    fake_group[0] = ["a", "b"]
    torch.manual_seed(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mask = bernoulli_mask((4, 50), 0.5)
    torch.manual_seed(5)
    assert torch.equal(mask, bernoulli_mask((4, 50), 0.5))


def test_some_of_three_ranks_sharing_a_state_are_reseeded(fake_group, monkeypatch):
    """Three ranks, two of which share a state: those two would draw the same masks; every rank
    is reseeded (one collective decision, as with two ranks)."""
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 3)
    fake_group[0] = ["a", "a", "b"]
    torch.manual_seed(7)
    with pytest.warns(UserWarning, match="2 of the 3 ranks of the process group held the same"):
        first = bernoulli_mask((4, 50), 0.5)
    torch.manual_seed(rd.rank_seed(7, 1))
    assert torch.equal(first, bernoulli_mask((4, 50), 0.5))


def test_seed_noise_per_rank_or_turning_it_off_skips_the_check(fake_group, monkeypatch):
    def fail(digest):
        raise AssertionError("no collective expected")

    monkeypatch.setattr(rd, "_gather_digests", fail)
    rd.auto_noise_per_rank(False)
    bernoulli_mask((2, 2), 0.5)
    rd.auto_noise_per_rank(True)
    rd.seed_noise_per_rank(0)
    bernoulli_mask((2, 2), 0.5)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        rd.auto_noise_per_rank(1)


def test_a_draw_without_autograd_neither_checks_nor_settles(fake_group, monkeypatch):
    """Evaluation or Monte-Carlo prediction on one rank alone would wait forever in a collective:
    the check waits for the first draw under autograd (a training step)."""
    monkeypatch.setattr(rd, "_gather_digests", lambda d: pytest.fail("no collective under no_grad"))
    with torch.no_grad():
        bernoulli_mask((2, 2), 0.5)
    assert not rd._settled
    monkeypatch.setattr(rd, "_gather_digests", lambda d: [d, d])
    with pytest.warns(UserWarning, match="each rank now draws its own"):
        bernoulli_mask((2, 2), 0.5)
    assert rd._settled


def test_compile_model_checks_before_the_graph_runs(fake_group):
    """Inside a graph the check cannot run; rnndrop.compile_model makes it before each call."""
    import rnndrop
    torch.manual_seed(3)
    compiled = rnndrop.compile_model(VariationalLSTM(3, 4, dropout_hidden=0.5), mode=None, backend="eager")
    with pytest.warns(UserWarning, match="each rank now draws its own"):
        compiled(torch.randn(5, 2, 3))


@pytest.mark.parametrize("env", [None, "3"])
def test_seed_noise_per_rank_before_the_group_settles_only_where_the_rank_is_known(env, monkeypatch):
    monkeypatch.setattr(rd, "_settled", False)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    if env is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", env)
    chosen = rd.seed_noise_per_rank(11)
    assert chosen == rd.rank_seed(11, 0 if env is None else 3)
    assert rd._settled is (env is not None)  # every rank taking 0 is caught by the later check


def test_no_process_group_no_check(monkeypatch):
    monkeypatch.setattr(rd, "_settled", False)
    monkeypatch.setattr(rd, "_gather_digests", lambda d: pytest.fail("no collective without a group"))
    bernoulli_mask((2, 2), 0.5)
    assert not rd._settled


def _worker(rank: int, world: int, folder: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{folder}/init", rank=rank, world_size=world
    )
    out = {}
    try:
        for mode in ("default", "off", "apart"):
            rd._settled, rd._auto = False, mode != "off"
            torch.manual_seed(rank if mode == "apart" else 0)
            layer = VariationalLSTM(3, 4, dropout_hidden=0.5)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mask = layer.sample_masks(2).hidden[0]
            gathered = [None] * world
            torch.distributed.all_gather_object(gathered, mask.tolist())
            try:
                rd.check_noise_independent()
                independent = True
            except RuntimeError:
                independent = False
            out[mode] = {"mask": mask.tolist(), "all": gathered, "independent": independent,
                         "warnings": [str(w.message) for w in caught]}
    finally:
        torch.distributed.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_gloo_group_of_two_processes_seeded_alike_draws_different_masks(tmp_path):
    torch.multiprocessing.spawn(_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    default, off, apart = ([s[m] for s in seen] for m in ("default", "off", "apart"))
    assert default[0]["all"][0] != default[0]["all"][1]
    assert all(r["independent"] for r in default)
    assert all(any("each rank now draws its own" in w for w in r["warnings"]) for r in default)
    layer = VariationalLSTM(3, 4, dropout_hidden=0.5)
    for rank, r in enumerate(default):  # reproducible from the seed and the rank, in one process
        torch.manual_seed(rd.rank_seed(0, rank))
        assert torch.equal(torch.tensor(r["mask"]), layer.sample_masks(2).hidden[0])
    assert off[0]["all"][0] == off[0]["all"][1] and not any(r["warnings"] for r in off)
    assert not any(r["warnings"] for r in apart) and all(r["independent"] for r in apart)
    for rank, r in enumerate(apart):  # untouched: what torch.manual_seed(rank) draws after the weights
        torch.manual_seed(rank)
        VariationalLSTM(3, 4, dropout_hidden=0.5)
        assert torch.equal(torch.tensor(r["mask"]), layer.sample_masks(2).hidden[0])
