"""The sparse-VD recipe through the one LM loop: KL per token, selection, pruning, resume."""

import math
import re
from dataclasses import replace

import pytest
import torch

from rnndrop.deploy import prune
from rnndrop.kl import MOLCHANOV_COEFFICIENTS
from rnndrop.lm.cli.checks import config_from_args
from rnndrop.lm.cli.errors import UsageError
from rnndrop.lm.cli.parser import corpus_parser
from rnndrop.lm.data.corpus import batchify
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.presets import get_config
from rnndrop.lm.model.regimes import REGIMES, get_hook
from rnndrop.lm.run.checkpoint import load_checkpoint, load_model, read_verified_result
from rnndrop.lm.run.evaluate import score
from rnndrop.lm.run.train import train_run
from rnndrop.sparse import SparseLSTM, sparsity_report
from tests.lm_helpers import (
    TINY,
    Killed,
    kill_after_first_epoch,
    write_corpus,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SPARSE = replace(TINY, optimizer="adam", lr=0.01, clip=5.0, epochs=2, mc_samples=0,
                 schedule="fixed", lr_decay=1.0, select="objective", kl_weight=0.5)


def _molchanov_by_hand(log_alpha: float) -> float:
    k1, k2, k3 = MOLCHANOV_COEFFICIENTS
    return k1 - k1 / (1 + math.exp(-(k2 + k3 * log_alpha))) + 0.5 * math.log1p(math.exp(-log_alpha))


def test_kl_per_token_is_the_molchanov_sum_over_the_lstm_weights_divided_by_the_training_words():
    torch.manual_seed(0)
    model = build_model(7, replace(SPARSE, num_layers=1, embedding_size=2, hidden_size=3),
                        REGIMES["sparse_vd"], {})
    lstm = model.rnn
    assert isinstance(lstm, SparseLSTM)
    with torch.no_grad():
        for name in lstm.sparse_weight_names():
            getattr(lstm, "log_sigma2_" + name).uniform_(-12, 2)
    expected = 0.0
    for name in lstm.sparse_weight_names():
        theta = getattr(lstm, name).detach().double().flatten().tolist()
        log_sigma2 = getattr(lstm, "log_sigma2_" + name).detach().double().flatten().tolist()
        for t, s in zip(theta, log_sigma2):
            log_alpha = min(10.0, max(-10.0, s - math.log(t * t + 1e-8)))
            expected += _molchanov_by_hand(log_alpha)
    # W_ih [12, 2] and W_hh [12, 3]
    assert sum(getattr(lstm, n).numel() for n in lstm.sparse_weight_names()) == 4 * 3 * (2 + 3)
    regularizer = get_hook(REGIMES["sparse_vd"].regularizer)
    train_words = 1234
    per_token = regularizer(model, 1.0, train_words).item()
    assert per_token == pytest.approx(expected / train_words, rel=1e-5)
    # Linear warm-up over the first 20% of training: half-way through it, half the KL.
    assert regularizer(model, 0.1, train_words).item() == pytest.approx(expected / train_words / 2, rel=1e-5)
    # Only the recurrent weights carry a KL: the embedding and decoder stay dense.
    assert [n for n, _ in model.named_parameters() if "log_sigma2" in n] == [
        f"rnn.log_sigma2_{n}" for n in lstm.sparse_weight_names()]


@pytest.mark.slow
def test_the_loop_adds_kl_weight_times_the_kl_and_selects_on_the_validation_objective(corpus, tmp_path):
    result = train_run(corpus, replace(SPARSE, epochs=3), "sparse_vd", tmp_path / "run", seed=3,
                       progress=False)
    history = result["epochs"]
    objectives = [e["valid_objective"] for e in history]
    assert result["best_epoch"] == 1 + objectives.index(min(objectives))
    assert result["best_valid_ppl"] == history[result["best_epoch"] - 1]["valid_ppl"]
    # The objective of the kept epoch, recomputed from best.pt: valid NLL + 0.5 * KL / N.
    run = load_model(tmp_path / "run")
    valid = score(run.model, batchify(corpus.valid, SPARSE.eval_batch_size), SPARSE.bptt)
    kl_per_token = get_hook("kl_warmup_0.2")(run.model, 1.0, corpus.train.numel()).item()
    assert min(objectives) == pytest.approx(valid.nll + 0.5 * kl_per_token, rel=1e-6)
    assert kl_per_token > 0.05  # the objective really differs from the NLL


@pytest.mark.slow
def test_kl_weight_scales_the_training_objective(corpus, tmp_path):
    # kl_weight 0 trains the weight noise without the KL: log sigma^2 falls, nothing is pruned;
    # a large kl_weight prunes.
    free = train_run(corpus, replace(SPARSE, kl_weight=0.0), "sparse_vd", tmp_path / "free", seed=1,
                     progress=False)
    heavy = train_run(corpus, replace(SPARSE, kl_weight=20.0), "sparse_vd", tmp_path / "heavy", seed=1,
                      progress=False)
    assert free["config"]["kl_weight"] == 0.0 and heavy["config"]["kl_weight"] == 20.0
    free_zeros = sparsity_report(load_model(tmp_path / "free").model).sparsity
    heavy_zeros = sparsity_report(load_model(tmp_path / "heavy").model).sparsity
    assert free_zeros < heavy_zeros


def test_pruned_language_model_equals_the_sparse_model_in_eval_mode(corpus, tmp_path):
    probabilities = {"embedding": 0.1, "input": 0.3, "between": 0.3, "output": 0.3}
    model = build_model(len(corpus.vocab), SPARSE, REGIMES["sparse_vd"], probabilities)
    assert model.rnn.dropout_input == 0.3 and model.rnn.dropout_output == 0.3
    with torch.no_grad():  # push about a third of the weights over the threshold
        for name in model.rnn.sparse_weight_names():
            log_sigma2 = getattr(model.rnn, "log_sigma2_" + name)
            log_sigma2.copy_(torch.where(torch.rand_like(log_sigma2) < 0.3, 5.0, -10.0))
    report = sparsity_report(model)
    assert 0.2 < report.sparsity < 0.4
    pruned = prune(model).eval()
    model.eval()
    test = batchify(corpus.test, 2)
    a = score(model, test, 8)
    b = score(pruned, test, 8)
    assert b.nll == pytest.approx(a.nll, abs=1e-5)
    assert not any("log_sigma2" in n for n, _ in pruned.named_parameters())
    inputs = test[:8]
    out_sparse, _ = model(inputs)
    out_pruned, _ = pruned(inputs)
    torch.testing.assert_close(out_pruned, out_sparse, atol=1e-5, rtol=1e-5)
    # ... and the sparse model in training mode is noisy, so the comparison could fail.
    model.train()
    assert not torch.allclose(model(inputs)[0], out_sparse, atol=1e-3)


@pytest.mark.slow
def test_both_stages_of_the_recipe_resume_bit_for_bit(corpus, tmp_path):
    dense_config = replace(TINY, epochs=2, mc_samples=0, schedule="fixed", decay_after=1, lr_decay=2.0)

    def both_stages(root, interrupt):
        callback = kill_after_first_epoch if interrupt else None
        for stage, config, regime, init in (("dense", dense_config, "tied", None),
                                            ("sparse", SPARSE, "sparse_vd", root / "dense")):
            if interrupt:
                with pytest.raises(Killed):
                    train_run(corpus, config, regime, root / stage, seed=5, progress=False,
                              on_epoch_end=callback, init_from=init)
            result = train_run(corpus, config, regime, root / stage, seed=5, progress=False,
                               resume=interrupt, init_from=init)
        return result

    full = both_stages(tmp_path / "full", interrupt=False)
    cut = both_stages(tmp_path / "cut", interrupt=True)
    for stage in ("dense", "sparse"):
        a = load_checkpoint(tmp_path / "full" / stage / "checkpoint.pt")
        b = load_checkpoint(tmp_path / "cut" / stage / "checkpoint.pt")
        assert a["model"].keys() == b["model"].keys()
        for name in a["model"]:
            assert torch.equal(a["model"][name], b["model"][name]), (stage, name)
    assert full["test_ppl"] == cut["test_ppl"]
    assert [e["valid_objective"] for e in full["epochs"]] == [e["valid_objective"] for e in cut["epochs"]]


def test_kl_weight_and_select_are_checked_and_reach_the_config_from_the_command_line(tmp_path):
    with pytest.raises(ValueError, match=r"kl_weight must be a finite number >= 0, got -1"):
        replace(TINY, kl_weight=-1)
    with pytest.raises(ValueError, match="select must be one of perplexity, objective, got 'last'"):
        replace(TINY, select="last")
    parser = corpus_parser("ptb", prog="rnndrop-lm ptb")
    args = parser.parse_args(["--config", "sparse-vd-cpu-200", "--kl-weight", "0.3"])
    config = config_from_args(args)
    assert config.kl_weight == 0.3 and config.select == "objective" and config.optimizer == "adam"
    with pytest.raises(UsageError, match="kl_weight must be a finite number >= 0, got -2.0"):
        config_from_args(parser.parse_args(["--kl-weight", "-2"]))
    assert get_config("cpu-200").kl_weight == 1.0 and get_config("cpu-200").select == "perplexity"


@pytest.mark.slow
def test_the_recipe_runs_from_the_command_line(tmp_path, capsys):
    from rnndrop.lm import cli

    data = write_corpus(tmp_path / "data")
    small = ["--data", str(data), "--hidden-size", "12", "--emb-size", "12", "--layers", "1",
             "--batch-size", "4", "--bptt", "6", "--mc-samples", "0", "--no-progress"]
    threads = torch.get_num_threads()
    try:
        assert cli.main(["ptb", *small, "--regimes", "tied", "--config", "cpu-200", "--epochs", "2",
                         "--lr", "5", "--out", str(tmp_path / "dense")]) == 0
        dense = next((tmp_path / "dense" / "tied").iterdir())
        assert cli.main(["ptb", *small, "--regimes", "sparse_vd", "--config", "sparse-vd-cpu-200",
                         "--epochs", "2", "--kl-weight", "0.3", "--init-from", str(dense),
                         "--out", str(tmp_path / "sparse")]) == 0
    finally:
        torch.set_num_threads(threads)
    assert re.search(r"^sparse_vd\s", capsys.readouterr().out, re.M)
    run = next((tmp_path / "sparse" / "sparse_vd").iterdir())
    result = load_model(run)
    assert result.config.kl_weight == 0.3 and result.config.select == "objective"
    assert isinstance(result.model.rnn, SparseLSTM) and result.model.rnn.dropout_output == 0.5
    recorded = read_verified_result(run / "results.json")["init_from"]
    assert recorded["path"] == str(dense / "best.pt") and "rnn.weight_hh_l0" in recorded["loaded"]


@pytest.mark.slow
def test_frozen_parameters_keep_the_weights_they_started_from(corpus, tmp_path):
    dense = replace(TINY, epochs=1, mc_samples=0)
    train_run(corpus, dense, "tied", tmp_path / "dense", seed=1, progress=False)
    start = load_checkpoint(tmp_path / "dense" / "best.pt")["model"]
    frozen = replace(SPARSE, freeze=("embedding.", "decoder."))
    train_run(corpus, frozen, "sparse_vd", tmp_path / "sparse", seed=1, progress=False,
              init_from=tmp_path / "dense")
    end = load_checkpoint(tmp_path / "sparse" / "best.pt")["model"]
    for name in ("embedding.embedding.weight", "decoder.weight", "decoder.bias"):
        assert torch.equal(end[name], start[name]), name
    assert not torch.equal(end["rnn.weight_hh_l0"], start["rnn.weight_hh_l0"])  # the LSTM trained
    with pytest.raises(ValueError, match=r"freeze: the prefixes \['encoder.'\] name no parameter"):
        train_run(corpus, replace(SPARSE, freeze=("encoder.",)), "sparse_vd", tmp_path / "bad", seed=1,
                  progress=False)
    with pytest.raises(ValueError, match="freeze must be a tuple of parameter-name prefixes, got 'decoder.'"):
        replace(SPARSE, freeze="decoder.")
    from rnndrop.lm.model.train_config import TrainConfig

    assert TrainConfig.from_dict(frozen.to_dict()) == frozen
