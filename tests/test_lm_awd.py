"""The AWD-LSTM recipe in rnndrop-lm: the config fields and flags, the ``awd`` preset, AR / TAR
and variable BPTT in the loop, NT-ASGD's switch and the fine-tuning stage, resume bit for bit
on both sides of the switch."""

import json
from dataclasses import replace

import pytest
import torch

from rnndrop import WeightDrop
from rnndrop.lm.cli.checks import config_from_args
from rnndrop.lm.cli.errors import UsageError
from rnndrop.lm.cli.parser import build_parser
from rnndrop.lm.data.corpus import batchify, bptt_batches
from rnndrop.lm.model.build import build_model, build_optimizer
from rnndrop.lm.model.presets import get_config
from rnndrop.lm.model.regimes import REGIMES
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import CheckpointError, load_checkpoint, run_identity, save_checkpoint
from rnndrop.lm.run.evaluate import score
from rnndrop.lm.run.recipe import epoch_segments, lengths_seed
from rnndrop.lm.run.train import train_run
from tests.lm_helpers import TINY, Killed, run_cli, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

#: TINY with the whole recipe; lr 16 makes validation stall early: with seed 1 the switch to
#: averaging comes after epoch 5 of 8, then 3 epochs of fine-tuning.
RECIPE = replace(TINY, epochs=8, schedule="fixed", lr_decay=1.0, lr=16.0, ar=1.0, tar=1.0,
                 variable_bptt=True, nt_asgd=True, nonmono=1, finetune_epochs=3, mc_samples=2)


@pytest.mark.parametrize("change, message", [
    ({"ar": -1.0}, "ar must be a finite number >= 0"),
    ({"tar": float("inf")}, "tar must be a finite number >= 0"),
    ({"variable_bptt": 1}, "variable_bptt must be True or False"),
    ({"nonmono": 0}, "nonmono must be a positive int"),
    ({"finetune_epochs": -1}, "finetune_epochs must be an int >= 0"),
    ({"nt_asgd": True, "optimizer": "adam"}, "nt_asgd averages SGD's iterates"),
    ({"nt_asgd": True, "select": "objective"}, "needs select 'perplexity'"),
    ({"finetune_epochs": 2}, "finetune_epochs restarts the weight averaging of NT-ASGD"),
])
def test_recipe_fields_are_checked(change, message):
    with pytest.raises(ValueError, match=message):
        replace(TINY, **change)


def test_runs_of_other_dropout_probabilities_are_other_runs(corpus):
    """A finished run is reused, and a checkpoint resumed, only under the same identity: one of
    another dropout setting (a grid's candidates) is another run."""
    low, high = ({**TINY.dropout, "hidden": p} for p in (0.2, 0.5))
    assert run_identity(corpus, TINY, "tied", low) != run_identity(corpus, TINY, "tied", high)
    assert run_identity(corpus, TINY, "tied", low) == run_identity(corpus, TINY, "tied", dict(low))


def test_the_optimizer_takes_the_configs_weight_decay():
    weights = [torch.nn.Parameter(torch.zeros(2))]
    for optimizer in ("sgd", "adam"):
        config = replace(TINY, optimizer=optimizer, weight_decay=1.2e-6)
        assert build_optimizer(weights, config).param_groups[0]["weight_decay"] == 1.2e-6


def test_recipe_fields_off_keep_a_runs_identity_and_round_trip(corpus):
    identity = run_identity(corpus, TINY, "tied")
    for field in ("ar", "tar", "variable_bptt", "nt_asgd", "nonmono", "finetune_epochs"):
        assert field not in identity["config"]  # runs made before the recipe keep their identity
    assert run_identity(corpus, replace(TINY, ar=2.0), "tied")["config"]["ar"] == 2.0
    assert TrainConfig.from_dict(RECIPE.to_dict()) == RECIPE


def test_the_awd_preset_is_awd_lstm_scaled_down():
    config = get_config("awd")
    assert (config.num_layers, config.embedding_size, config.tie_weights) == (3, config.hidden_size, True)
    assert (config.ar, config.tar, config.variable_bptt, config.nt_asgd, config.nonmono) == (2.0, 1.0, True,
                                                                                           True, 5)
    assert (config.lr, config.clip, config.bptt, config.optimizer, config.schedule) == (30.0, 0.25, 35, "sgd",
                                                                                        "fixed")
    assert config.lr_decay == 1.0 and config.finetune_epochs > 0 and config.weight_decay == 1.2e-6
    assert set(config.grid) >= {"weight_drop", "tied"}
    for regime in ("weight_drop", "tied"):
        grid = config.grid[regime]
        assert [p["hidden"] for p in grid] == sorted(p["hidden"] for p in grid)  # light to heavy
        assert all(p.keys() == config.dropout.keys() for p in grid)
    small = replace(config, hidden_size=16, embedding_size=16)
    dropconnect = build_model(50, small, REGIMES["weight_drop"], config.dropout)
    assert isinstance(dropconnect.rnn, WeightDrop) and dropconnect.rnn.p == config.dropout["hidden"]
    assert dropconnect.rnn.module.dropout_hidden == 0.0
    masks = build_model(50, small, REGIMES["tied"], config.dropout)
    assert masks.rnn.dropout_hidden == config.dropout["hidden"] and not isinstance(masks.rnn, WeightDrop)
    for model in (dropconnect, masks):  # everything else equal
        assert model.decoder.weight is model.embedding.embedding.weight
        assert model.embedding.p == 0.1
    assert dropconnect.rnn.module.dropout_output == masks.rnn.dropout_output == config.dropout["output"]


def test_the_recipe_flags_reach_the_config():
    parser = build_parser()

    def config(*flags: str) -> TrainConfig:
        return config_from_args(parser.parse_args(["ptb", *flags]))

    ablation = config("--config", "awd", "--no-tie-weights", "--ar", "0", "--tar", "0", "--no-nt-asgd",
                      "--finetune-epochs", "0", "--no-variable-bptt", "--schedule", "plateau",
                      "--lr-decay", "4", "--min-lr", "0.1", "--weight-decay", "0")
    assert not ablation.tie_weights and ablation.ar == ablation.tar == 0.0 and not ablation.nt_asgd
    assert not ablation.variable_bptt and ablation.finetune_epochs == 0 and ablation.schedule == "plateau"
    assert (ablation.lr_decay, ablation.min_lr, ablation.weight_decay) == (4.0, 0.1, 0.0)
    assert config("--config", "awd") == get_config("awd")
    plateau = next(name for name in ("mini", "zaremba-medium", "gal-medium")
                   if get_config(name).schedule == "plateau" and get_config(name).min_lr)
    preset = get_config(plateau)  # --lr moves the floor with it: as many decays below the start
    moved = config("--config", plateau, "--lr", str(preset.lr * 2))
    assert moved.min_lr == pytest.approx(preset.min_lr * 2)
    assert config("--config", plateau, "--lr", str(preset.lr * 2), "--min-lr", "0.5").min_lr == 0.5
    assert config("--tie-weights").tie_weights and not config().tie_weights  # mini: untied
    on = config("--ar", "2", "--tar", "1", "--variable-bptt", "--nt-asgd", "--nonmono", "3",
                "--finetune-epochs", "4")
    assert (on.ar, on.tar, on.variable_bptt, on.nt_asgd, on.nonmono, on.finetune_epochs) == (
        2.0, 1.0, True, True, 3, 4)
    with pytest.raises(UsageError, match="needs nt_asgd=True.*--finetune-epochs 2"):
        config("--finetune-epochs", "2")


def test_epoch_segments_are_fixed_or_awds_random_lengths():
    stream = batchify(torch.arange(2000), 4)
    fixed = epoch_segments(stream, TINY, seed=1, epoch=1)
    expected = list(bptt_batches(stream, TINY.bptt))
    items = list(fixed.items)
    assert fixed.count == len(expected) == len(items)
    assert all(torch.equal(s.inputs, x) and torch.equal(s.targets, y) for s, (x, y) in zip(items, expected))
    assert [s.done for s in items] == [i / len(items) for i in range(len(items))]
    assert {s.lr_scale for s in items} == {1.0}
    config = replace(TINY, variable_bptt=True, bptt=20)
    first = epoch_segments(stream, config, seed=1, epoch=1)
    items = list(first.items)
    assert first.count == len(items) and sum(s.inputs.shape[0] for s in items) == stream.shape[0] - 1
    assert all(s.lr_scale == s.inputs.shape[0] / 20 for s in items)
    again = [s.inputs.shape[0] for s in epoch_segments(stream, config, seed=1, epoch=1).items]
    assert again == [s.inputs.shape[0] for s in items]  # an epoch's lengths: its seed and number
    assert again != [s.inputs.shape[0] for s in epoch_segments(stream, config, seed=1, epoch=2).items]
    assert lengths_seed(1, 2) != lengths_seed(2, 1)


@pytest.mark.slow
def test_ar_and_tar_shrink_the_last_layers_activations(corpus, tmp_path):
    config = replace(TINY, epochs=1, mc_samples=0, schedule="fixed", lr_decay=1.0)
    train_run(corpus, config, "tied", tmp_path / "plain", seed=1, progress=False)
    train_run(corpus, replace(config, ar=20.0, tar=20.0), "tied", tmp_path / "penalised", seed=1,
              progress=False)
    tokens = batchify(corpus.valid, 2)[:20]
    sizes = {}
    for name in ("plain", "penalised"):
        model = build_model(len(corpus.vocab), config, REGIMES["tied"], config.dropout)
        model.load_state_dict(load_checkpoint(tmp_path / name / "checkpoint.pt")["model"])
        model.eval()
        _, _, outputs = model(tokens, return_outputs=True)
        raw = outputs.raw
        sizes[name] = (raw.pow(2).mean().item(), (raw[1:] - raw[:-1]).pow(2).mean().item())
    assert sizes["penalised"][0] < 0.5 * sizes["plain"][0]  # AR
    assert sizes["penalised"][1] < 0.5 * sizes["plain"][1]  # TAR


def _kill_at(epoch_to_stop):
    def callback(epoch, record):
        if epoch == epoch_to_stop:
            raise Killed

    return callback


def _untimed(progress):
    timing = ("seconds", "words_per_second", "train_seconds", "wall_seconds")
    out = {k: v for k, v in progress.items() if k not in timing}
    out["history"] = [{k: v for k, v in r.items() if k not in timing} for r in progress["history"]]
    return out


def _same_state(a, b):
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert _untimed(a["progress"]) == _untimed(b["progress"])
    avg_a, avg_b = a["averaging"], b["averaging"]
    assert avg_a["trigger"] == avg_b["trigger"] and avg_a["switches"] == avg_b["switches"]
    assert avg_a["averaged"].keys() == avg_b["averaged"].keys()
    assert all(torch.equal(avg_a["averaged"][k], avg_b["averaged"][k]) for k in avg_a["averaged"])


@pytest.mark.slow
def test_the_recipe_switches_to_averaging_fine_tunes_and_resumes_bit_for_bit(corpus, tmp_path):
    full = train_run(corpus, RECIPE, "weight_drop", tmp_path / "full", seed=1, progress=False)
    switch = full["nt_asgd"]["averaging_after_epoch"]
    assert switch == 5, "the fixture no longer switches where the kills below expect it"
    records = full["epochs"]
    assert [r["averaged"] for r in records] == [False] * switch + [True] * (len(records) - switch)
    assert [r.get("phase") for r in records] == [None] * 8 + ["finetune"] * 3
    assert full["nt_asgd"]["finetune"] == {"from_epoch": 8, "epochs_run": 3,
                                           "stop_reason": full["nt_asgd"]["finetune"]["stop_reason"]}
    assert full["epochs_run"] == 11 and full["test_ppl_mc"] is not None
    final = load_checkpoint(tmp_path / "full" / "checkpoint.pt")
    assert final["averaging"]["switches"] == 2  # the switch, then the fine-tuning restart

    # What is validated (and kept as best) is the average: score it again from the checkpoint.
    model = build_model(len(corpus.vocab), RECIPE, REGIMES["weight_drop"], RECIPE.dropout)
    model.load_state_dict({k.removeprefix("module."): v for k, v in final["averaging"]["averaged"].items()
                           if k.startswith("module.")})
    assert score(model, batchify(corpus.valid, RECIPE.eval_batch_size), RECIPE.bptt).perplexity == \
        pytest.approx(records[-1]["valid_ppl"], rel=1e-12)
    best = load_checkpoint(tmp_path / "full" / "best.pt")
    assert best["epoch"] == full["best_epoch"]

    # Killed on the epoch of the switch, one epoch into averaging, at the end of training (before
    # fine-tuning began) and in fine-tuning: every resume ends where the uninterrupted run did.
    for kill in (switch, switch + 1, 8, 9):
        cut = tmp_path / f"cut{kill}"
        with pytest.raises(Killed):
            train_run(corpus, RECIPE, "weight_drop", cut, seed=1, progress=False, on_epoch_end=_kill_at(kill))
        resumed = train_run(corpus, RECIPE, "weight_drop", cut, seed=1, progress=False, resume=True)
        _same_state(load_checkpoint(cut / "checkpoint.pt"), final)
        for key in ("test_ppl", "test_ppl_mc", "best_epoch", "nt_asgd"):
            assert resumed[key] == full[key], (kill, key)
        assert [r["valid_ppl"] for r in resumed["epochs"]] == [r["valid_ppl"] for r in records]


@pytest.mark.slow
def test_the_tied_regime_runs_the_same_recipe(corpus, tmp_path):
    config = replace(RECIPE, epochs=3, finetune_epochs=1, mc_samples=0, nonmono=5)
    result = train_run(corpus, config, "tied", tmp_path / "tied", seed=2, progress=False)
    assert result["config"]["ar"] == 1.0 and result["epochs_run"] == 4
    assert result["nt_asgd"]["finetune"]["from_epoch"] == 3
    assert result["best_valid_ppl"] < len(corpus.vocab)


@pytest.mark.slow
def test_a_recipe_checkpoint_without_its_averaging_state_is_refused(corpus, tmp_path):
    config = replace(RECIPE, epochs=2, finetune_epochs=0, mc_samples=0)
    with pytest.raises(Killed):
        train_run(corpus, config, "weight_drop", tmp_path / "run", seed=1, progress=False,
                  on_epoch_end=_kill_at(1))
    path = tmp_path / "run" / "checkpoint.pt"
    ckpt = load_checkpoint(path)
    del ckpt["averaging"]
    save_checkpoint(ckpt, path)
    with pytest.raises(CheckpointError, match="needs its averaging state"):
        train_run(corpus, config, "weight_drop", tmp_path / "run", seed=1, progress=False, resume=True)


@pytest.mark.slow
def test_the_awd_config_trains_both_recurrent_regimes_from_the_command_line(tmp_path, capsys):
    data = write_corpus(tmp_path / "data")
    out = tmp_path / "out"
    code = run_cli(["ptb", "--data", str(data), "--config", "awd", "--regimes", "weight_drop,tied",
                    "--hidden-size", "12", "--emb-size", "12", "--batch-size", "4", "--bptt", "8",
                    "--epochs", "2", "--finetune-epochs", "1", "--mc-samples", "0", "--out", str(out),
                    "--no-progress"])
    assert code == 0, capsys.readouterr().err
    for regime in ("weight_drop", "tied"):
        result = json.loads(next(out.glob(f"{regime}/*/results.json")).read_text())
        config = result["config"]
        assert (config["num_layers"], config["tie_weights"], config["ar"], config["tar"]) == (3, True, 2.0,
                                                                                              1.0)
        assert config["variable_bptt"] and config["nt_asgd"] and result["epochs_run"] == 3
        assert result["nt_asgd"]["finetune"]["from_epoch"] == 2
        assert result["epochs"][-1]["phase"] == "finetune" and result["epochs"][-1]["averaged"]
    assert run_cli(["ptb", "--data", str(data), "--finetune-epochs", "2", "--out", str(tmp_path / "x")]) == 2
    assert "needs nt_asgd=True" in capsys.readouterr().err
