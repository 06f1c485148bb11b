import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rnndrop.deploy import prune
from rnndrop.kl import kl_molchanov, model_kl, negative_elbo
from rnndrop.sparse import (
    INIT_LOG_SIGMA2,
    SparseEmbedding,
    SparseGRU,
    SparseLinear,
    SparseLSTM,
    sparsity_report,
)
from tests.oracle import assert_close, plain_twin


def randomize_log_sigma2(model, low=-8.0, high=2.0):
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "log_sigma2" in name:
                param.uniform_(low, high)


class TinyLM(nn.Module):
    def __init__(self, vocab=30, size=8):
        super().__init__()
        self.embedding = SparseEmbedding(vocab, size)
        self.rnn = SparseLSTM(size, size, num_layers=2, dropout_output=0.3)
        self.decoder = SparseLinear(size, vocab)

    def forward(self, tokens):
        out, _ = self.rnn(self.embedding(tokens))
        return self.decoder(out)


@pytest.mark.parametrize("cls", [SparseLSTM, SparseGRU])
def test_vanishing_variance_gives_the_plain_layer_in_training(cls):
    layer = cls(5, 6, num_layers=2, bidirectional=True)
    randomize_log_sigma2(layer, -40.0, -40.0)
    plain = plain_twin(layer)
    x = torch.randn(7, 3, 5)
    assert_close(layer.train()(x), plain(x), atol=1e-6, rtol=1e-5)
    assert_close(layer.eval()(x), plain(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cls", [SparseLSTM, SparseGRU])
def test_one_weight_sample_per_call_shared_by_batch_and_steps(cls):
    layer = cls(5, 6, num_layers=2)
    randomize_log_sigma2(layer)
    x = torch.randn(7, 1, 5).expand(7, 3, 5).contiguous()  # three identical sequences
    torch.manual_seed(1)
    sampled = {name: layer.sampled_weight(name).detach() for name in layer.sparse_weight_names()}
    torch.manual_seed(1)
    out, _ = layer(x)
    expected, _ = plain_twin(layer, sampled)(x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(out[:, 0], out[:, 2])
    out2, _ = layer(x)
    assert not torch.allclose(out, out2)


def test_weights_over_the_threshold_are_exactly_zero_in_eval_and_after_pruning():
    layer = SparseLSTM(5, 6, num_layers=2)
    randomize_log_sigma2(layer)
    pruned_weights = {}
    for name in layer.sparse_weight_names():
        over = layer.log_alpha(name) >= layer.threshold
        assert 0 < int(over.sum()) < over.numel(), name
        weight = layer.pruned_weight(name)
        assert torch.all(weight[over] == 0)
        assert torch.equal(weight[~over], getattr(layer, name)[~over])
        pruned_weights[name] = weight.detach()
    x = torch.randn(7, 3, 5)
    layer.eval()
    assert_close(layer(x), plain_twin(layer, pruned_weights)(x), atol=1e-6, rtol=1e-5)
    dense = prune(layer)
    assert type(dense) is nn.LSTM
    for name, weight in pruned_weights.items():
        assert torch.equal(getattr(dense, name), weight)
    assert_close(dense(x), layer(x), atol=0, rtol=0)


@pytest.mark.slow
def test_pruned_model_has_the_eval_models_perplexity_and_accuracy():
    torch.manual_seed(0)
    model = TinyLM()
    randomize_log_sigma2(model)
    tokens = torch.randint(0, 30, (12, 4))
    targets = torch.randint(0, 30, (12, 4))
    pruned = prune(model).eval()
    model.eval()
    assert [type(m) for m in pruned.children()] == [nn.Embedding, nn.LSTM, nn.Linear]
    assert not any("log_sigma2" in n for n, _ in pruned.named_parameters())
    with torch.no_grad():
        logits, pruned_logits = model(tokens), pruned(tokens)
    ppl = math.exp(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item())
    pruned_ppl = math.exp(F.cross_entropy(pruned_logits.flatten(0, 1), targets.flatten()).item())
    assert pruned_ppl == ppl
    assert torch.equal(logits.argmax(-1), pruned_logits.argmax(-1))
    assert model.training is False and isinstance(model.rnn, SparseLSTM)  # model unchanged


def test_sparsity_report_counts_the_zeros():
    model = TinyLM()
    randomize_log_sigma2(model)
    report = sparsity_report(model)
    names = [layer.name for layer in report.layers]
    assert names == ["embedding.weight", "rnn.weight_ih_l0", "rnn.weight_hh_l0",
                     "rnn.weight_ih_l1", "rnn.weight_hh_l1", "decoder.weight"]
    pruned = prune(model)
    zeros = sum(int((getattr(pruned.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]) == 0)
                    .sum()) for n in names)
    assert report.zeros == zeros
    assert report.total == 30 * 8 * 2 + 2 * (32 * 8 * 2)
    assert report.compression == pytest.approx(report.total / (report.total - report.zeros))
    biases = sum(p.numel() for n, p in model.named_parameters() if "bias" in n)
    assert report.dense_params == biases
    assert "compression" in str(report)


def test_local_reparameterization_moments():
    layer = SparseLinear(3, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.0, 1.0]]))
        layer.bias.copy_(torch.tensor([0.1, -0.1]))
        layer.log_sigma2_weight.copy_(torch.log(torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.01, 1.0]])))
    x = torch.tensor([1.0, 2.0, -1.0]).expand(50000, 3)
    out = layer(x)
    torch.testing.assert_close(out.mean(0), torch.tensor([-3.4, 0.9]), atol=0.02, rtol=0)
    torch.testing.assert_close(out.var(0), torch.tensor([1.2, 1.54]), atol=0, rtol=0.04)
    per_call = SparseLinear(3, 2, local_reparameterization=False)
    randomize_log_sigma2(per_call, 0.0, 0.0)
    y = per_call(x[:4])
    assert torch.equal(y[0], y[3])  # one weight for all rows


@pytest.mark.parametrize("make", [
    lambda: SparseLSTM(6, 5), lambda: SparseGRU(6, 5),
    lambda: SparseLinear(6, 5, local_reparameterization=False), lambda: SparseEmbedding(6, 5),
], ids=["lstm", "gru", "linear-per-call", "embedding"])
def test_weight_noise_has_the_standard_deviation_sigma(make):
    """A training draw of a weight is ``θ + σ ε``, ``σ = exp(log σ² / 2)``, ε ~ N(0, 1): with
    log σ² = log 0.04 the draws sit 0.2 from θ in standard deviation (σ², 0.04, passed the
    other tests: only the local reparameterisation's moments were checked)."""
    torch.manual_seed(0)
    module = make().train()
    name = "weight" if isinstance(module, (SparseLinear, SparseEmbedding)) else "weight_hh_l0"
    with torch.no_grad():
        getattr(module, "log_sigma2_" + name).fill_(math.log(0.04))
    theta = getattr(module, name).detach()
    if isinstance(module, SparseEmbedding):  # a draw of the rows of the words looked up
        ids = torch.arange(6)
        draws = torch.stack([module(ids).detach() for _ in range(400)]) - theta
    else:
        draws = torch.stack([module.sampled_weight(name).detach() for _ in range(400)]) - theta
    assert abs(float(draws.mean())) < 0.01
    assert abs(float(draws.std()) - 0.2) < 0.01


def test_sparse_embedding_ties_a_word_within_the_batch():
    embedding = SparseEmbedding(10, 4)
    randomize_log_sigma2(embedding, 0.0, 0.0)
    tokens = torch.tensor([[3, 5], [3, 3]])
    out = embedding(tokens)
    assert torch.equal(out[0, 0], out[1, 1]) and torch.equal(out[0, 0], out[1, 0])
    assert not torch.allclose(out[0, 0], embedding.weight[3])
    assert torch.equal(embedding.eval()(tokens), F.embedding(tokens, embedding.pruned_weight("weight")))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("bad", [-1, 10])
def test_sparse_embedding_refuses_ids_outside_the_vocabulary(training, bad):
    """An id outside the vocabulary is an error, not a wrap-around: id -1 would take the last word's row."""
    embedding = SparseEmbedding(10, 4).train(training)
    with pytest.raises(ValueError, match=rf"input must be word ids in \[0, 10\) .*got id {bad}"):
        embedding(torch.tensor([[3, bad]]))
    with pytest.raises(TypeError, match="input must be an int64 or int32 tensor of word ids, got torch"):
        embedding(torch.tensor([[3.0]]))


def test_kl_and_log_alpha():
    layer = SparseLinear(4, 3)
    log_alpha = layer.log_sigma2_weight - torch.log(layer.weight**2 + 1e-8)
    torch.testing.assert_close(layer.log_alpha("weight"), log_alpha.clamp(-10, 10))
    torch.testing.assert_close(layer.kl(), kl_molchanov(log_alpha.clamp(-10, 10)).sum())
    layer.kl().backward()
    assert torch.all(layer.log_sigma2_weight.grad <= 0)  # the KL wants more noise


@pytest.mark.parametrize("threshold", [12.0, 3.0, -10.0])
def test_the_threshold_prunes_by_log_alpha_as_it_is_not_as_the_kl_clips_it(threshold):
    """log alpha 13.8, -28.6 and -10.6: the KL's clip to [-10, 10] made a threshold of 12 prune
    nothing and one of -10 everything; each weight is now pruned where its log alpha is at or
    over the threshold (Molchanov et al. clip log alpha in the KL alone)."""
    layer = SparseLinear(3, 1, bias=False, threshold=threshold)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[1e-3, 0.5, 0.5]]))
        layer.log_sigma2_weight.copy_(torch.tensor([[0.0, -30.0, -12.0]]))
    log_alpha = layer.log_sigma2_weight - torch.log(layer.weight**2 + 1e-8)
    assert torch.equal(layer.log_alpha("weight", clipped=False), log_alpha)
    assert layer.keep_mask("weight").tolist() == (log_alpha < threshold).tolist() == [[False, True, True]]
    layer.threshold = float(log_alpha[0, 2].detach())  # at the threshold exactly: pruned, as the docs say
    assert layer.keep_mask("weight").tolist() == [[False, True, False]]
    layer.threshold = threshold
    assert sparsity_report(layer).zeros == 1
    assert torch.equal(prune(layer).weight, layer.pruned_weight("weight"))


@pytest.mark.slow
def test_training_prunes_weights_of_useless_inputs_only():
    torch.manual_seed(0)
    layer = SparseLinear(6, 1)
    opt = torch.optim.Adam(layer.parameters(), lr=0.02)
    # Adam at a fixed rate keeps a useless weight jittering around 0; decay it to 0.
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / 300)
    true_weight = torch.tensor([[2.0, -1.5, 1.0, 0.0, 0.0, 0.0]])
    for _ in range(300):
        x = torch.randn(64, 6)
        y = x @ true_weight.T + 0.1 * torch.randn(64, 1)
        loss = negative_elbo(F.mse_loss(layer(x), y), model_kl(layer), dataset_size=200)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    keep = layer.keep_mask("weight")[0]
    assert keep.tolist() == [True, True, True, False, False, False]


def test_state_dict_and_reset():
    layer = SparseLSTM(5, 6)
    plain = nn.LSTM(5, 6)
    result = layer.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(result.missing_keys) == ["log_sigma2_weight_hh_l0", "log_sigma2_weight_ih_l0"]
    assert torch.equal(layer.weight_ih_l0, plain.weight_ih_l0)
    layer.reset_parameters()
    assert torch.all(layer.log_sigma2_weight_hh_l0 == INIT_LOG_SIGMA2)
    linear = SparseLinear(3, 2)
    linear.reset_parameters()
    assert torch.all(linear.log_sigma2_weight == INIT_LOG_SIGMA2)
    assert layer.is_stochastic()


def test_sparsity_report_of_a_model_without_sparse_layers_claims_no_compression():
    """No sparse layer: compression 1, not 0 / 0 read as "every weight removed" (inf)."""
    report = sparsity_report(nn.Sequential(nn.Linear(3, 3), nn.LSTM(3, 4)))
    assert report.total == 0 and report.sparsity == 0.0
    assert report.compression == 1.0 and report.model_compression == 1.0
    assert "inf" not in str(report)


def test_bad_arguments():
    with pytest.raises(TypeError, match="threshold"):
        SparseLSTM(5, 6, threshold="3")
    with pytest.raises(TypeError, match="model must be"):
        sparsity_report("model")


@pytest.mark.parametrize("threshold", [float("nan"), float("inf"), -float("inf")])
def test_threshold_must_be_finite(threshold):
    with pytest.raises(ValueError, match=r"threshold must be a finite number .*got"):
        SparseLSTM(4, 6, threshold=threshold)


@pytest.mark.parametrize("make", [lambda: SparseLinear(3, 2), lambda: SparseLSTM(3, 4)])
def test_the_threshold_is_checked_whenever_it_is_set(make):
    """NaN pruned every weight (nothing is < NaN), a string failed at the next call: now both are
    the constructor's errors; a finite threshold may change (how much to prune)."""
    layer = make().eval()
    with pytest.raises(ValueError, match=r"threshold must be a finite number .*got nan"):
        layer.threshold = float("nan")
    with pytest.raises(TypeError, match="threshold must be a float .*got str '3'"):
        layer.threshold = "3"
    layer.threshold = 2
    assert layer.threshold == 2.0 and isinstance(layer.threshold, float)


def test_a_report_of_a_model_with_nothing_left_or_nothing_at_all_divides_by_no_zero():
    gone = SparseLinear(3, 2, bias=False)
    with torch.no_grad():
        gone.log_sigma2_weight.fill_(10.0)  # every log alpha over the threshold
    report = sparsity_report(gone)
    assert report.compression == report.model_compression == math.inf and "xinf" in str(report)
    empty = sparsity_report(nn.Sequential())
    assert empty.compression == empty.model_compression == 1.0 and "x1.00" in str(empty)


def test_a_sparse_weight_tied_to_a_plain_module_is_counted_dense(caplog):
    """An embedding tied to its decoder: the decoder reads the whole weight, so pruning it saves
    nothing (the report said x8.41 where the pruned model kept every weight)."""
    embedding, decoder = SparseEmbedding(100, 8), nn.Linear(8, 100)
    decoder.weight = embedding.weight
    with torch.no_grad():
        embedding.log_sigma2_weight.fill_(5.0)  # nearly every weight over the threshold
    model = nn.ModuleDict({"embedding": embedding, "decoder": decoder})
    report = sparsity_report(model)
    assert report.layers == () and "embedding.weight is also a parameter of a plain module" in caplog.text
    assert report.dense_params == 800 + 100  # the tied weight, the decoder's bias (log_sigma2: training's)
    assert report.model_compression == 1.0
