import math

import pytest
import torch
from torch import nn

from rnndrop import VariationalLSTM
from rnndrop.embedding_dropout import EmbeddingDropout
from rnndrop.mc import (
    mc_dropout,
    mc_language_model_loss,
    mc_perplexity,
    mc_predict,
    sampling_modules,
)
from rnndrop.sparse import SparseLSTM
from rnndrop.stochastic import Stochastic, noise_per_sequence
from rnndrop.weight_drop import WeightDrop
from tests.helpers import distinct


class Classifier(nn.Module):
    """Batch-first sequence classifier: [B, T, F] -> logits [B, C]."""

    def __init__(self, p=0.3, p_dense=0.3, features=3, hidden=8, classes=4, **lstm_kwargs):
        super().__init__()
        self.lstm = VariationalLSTM(
            features, hidden, batch_first=True, dropout_input=p, dropout_hidden=p,
            dropout_output=p, **lstm_kwargs,
        )
        self.norm = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(p_dense)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(self.drop(self.norm(out[:, -1])))


class TinyLM(nn.Module):
    """The LM protocol: tokens [T, B] -> (logits [T, B, V], hidden)."""

    def __init__(self, vocab=7, hidden=8, p_hidden=0.4, p_input=0.0):
        super().__init__()
        self.embedding = nn.Embedding(vocab, 5)
        self.lstm = VariationalLSTM(5, hidden, dropout_hidden=p_hidden, dropout_input=p_input)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens, hidden=None):
        out, hidden = self.lstm(self.embedding(tokens), hidden)
        return self.decoder(out), hidden


class Wrapper(Stochastic, nn.Module):
    """A stochastic module with a child that must stay in eval mode."""

    def __init__(self, p):
        super().__init__()
        self.p = p
        self.inner = nn.BatchNorm1d(4)

    def is_stochastic(self):
        return self.p > 0

    def forward(self, x):
        return self.inner(x)


def trained_batchnorm(model):
    torch.manual_seed(0)
    model.norm.running_mean.uniform_(-1, 1)
    model.norm.running_var.uniform_(0.5, 2)
    return model


def modes(model):
    return {name: m.training for name, m in model.named_modules()}


def token_batches(seed=0, vocab=7, segments=3, T=4, B=2):
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(vocab, (segments * T + 1, B), generator=g)
    return [(stream[i * T : (i + 1) * T], stream[i * T + 1 : (i + 1) * T + 1]) for i in range(segments)]


# ------------------------------------------------------------------ mc_dropout


def test_modes_are_restored_after_the_context_and_on_error():
    torch.manual_seed(0)
    model = Classifier()
    model.train()
    model.head.eval()  # a mixed state must come back exactly
    before = modes(model)
    with mc_dropout(model):
        assert model.lstm.training and model.drop.training
        assert not model.training and not model.norm.training and not model.head.training
    assert modes(model) == before
    with pytest.raises(RuntimeError, match="boom"), mc_dropout(model):
        raise RuntimeError("boom")
    assert modes(model) == before
    model.eval()
    with pytest.raises(RuntimeError, match="boom"), mc_dropout(model):
        raise RuntimeError("boom")
    assert not any(modes(model).values())


def test_only_sampling_modules_switch_and_not_their_children():
    model = nn.Sequential(Wrapper(0.5), nn.Dropout(0.0), Wrapper(0.0), nn.Dropout2d(0.2))
    model.train()
    assert sampling_modules(model) == [model[0], model[3]]
    with mc_dropout(model):
        assert model[0].training and model[3].training
        assert not model[0].inner.training  # child of a sampling module
        assert not model[1].training and not model[2].training and not model.training


def test_no_sampling_module_is_a_clear_error():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.0), VariationalLSTM(3, 3))
    with pytest.raises(ValueError, match="no stochastic module with p > 0"), mc_dropout(model):
        pass
    with mc_dropout(model, strict=False):
        assert not any(modes(model).values())


def test_batchnorm_stays_in_eval_during_mc_predict():
    model = trained_batchnorm(Classifier()).train()
    stats = model.norm.running_mean.clone(), model.norm.running_var.clone()
    x = torch.randn(5, 6, 3)
    mc_predict(model, x, n_samples=4)
    assert torch.equal(model.norm.running_mean, stats[0])
    assert torch.equal(model.norm.running_var, stats[1])
    assert model.training  # restored


# ------------------------------------------------------------------ mc_predict


def test_with_p_zero_every_sample_is_the_eval_prediction_and_mi_is_zero():
    model = trained_batchnorm(Classifier(p=0.0, p_dense=0.0))
    x = torch.randn(5, 6, 3)
    model.eval()
    with torch.no_grad():
        expected = model(x)
    model.train()
    result = mc_predict(model, x, n_samples=6, return_samples=True, strict=False)
    assert result.samples.shape == (6, 5, 4)
    for sample in result.samples:
        torch.testing.assert_close(sample, expected)
    torch.testing.assert_close(result.mean, expected.softmax(-1))
    torch.testing.assert_close(result.mutual_information, torch.zeros(5), atol=1e-6, rtol=0)
    # the mutual information is never negative, also where rounding puts the expected entropy of
    # equal samples above their predictive entropy (257 of these 2000 rows, by up to 2.4e-7)
    identity = nn.Identity()
    logits = torch.randn(2000, 7, generator=torch.Generator().manual_seed(0)) * 3
    assert (mc_predict(identity, logits, n_samples=5, strict=False).mutual_information >= 0).all()
    torch.testing.assert_close(result.predictive_entropy, result.expected_entropy)
    regression = mc_predict(model, x, n_samples=3, task="regression", strict=False)
    torch.testing.assert_close(regression.mean, expected)
    torch.testing.assert_close(regression.std, torch.zeros_like(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kwargs", [{}, {"method": "loop"}, {"chunk_size": 2}], ids=["auto", "loop", "chunk"])
def test_an_empty_batch_gives_empty_statistics_whatever_the_method(kwargs):
    """The default plan divided by the batch size (a ZeroDivisionError) where loop did not."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5))
    result = mc_predict(model, torch.randn(0, 4), 5, **kwargs)
    assert result.mean.shape == (0, 3) and result.n_samples == 5


class ComplexOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return torch.complex(torch.zeros_like(x), self.drop(x))


@pytest.mark.parametrize("kwargs", [{"method": "loop"}, {"chunk_size": 3}], ids=["loop", "chunk_size=3"])
def test_the_spread_of_complex_outputs_is_real_and_classification_refuses_them(kwargs):
    """std squared ``z - mean`` (imaginary for imaginary outputs); it is ``sqrt(mean |z - mean|^2)``."""
    x = torch.tensor([[1.0, 2.0]])
    torch.manual_seed(3)
    result = mc_predict(ComplexOutput(), x, 7, task="regression", return_samples=True, **kwargs)
    samples = result.samples.imag
    assert not result.std.is_complex()
    torch.testing.assert_close(result.std, samples.std(0, correction=0))
    with pytest.raises(TypeError, match="complex64 tensor; task='classification' averages the softmax"):
        mc_predict(ComplexOutput(), x, 4, **kwargs)


def test_samples_differ_when_p_positive_also_within_one_batched_chunk():
    torch.manual_seed(1)
    model = Classifier(p=0.5).eval()
    x = torch.randn(3, 5, 3)
    result = mc_predict(model, x, n_samples=4, method="batched", chunk_size=4, return_samples=True)
    s = result.samples
    for i in range(4):
        for j in range(i):
            assert not torch.allclose(s[i], s[j])
    assert (result.mutual_information > 0).all()
    # Mutual information is the gap between predictive and expected entropy.
    torch.testing.assert_close(
        result.mutual_information, result.predictive_entropy - result.expected_entropy
    )


class LastStep(nn.Module):
    """Regression on the last step; the recurrent mask is its only noise."""

    def __init__(self):
        super().__init__()
        self.lstm = VariationalLSTM(3, 6, batch_first=True, dropout_hidden=0.5)

    def forward(self, x):
        return self.lstm(x)[0][:, -1]


@pytest.mark.parametrize(
    "plan",
    [{"chunk_size": 10}, {"chunk_size": 3}, {"memory_budget": 200}, {}],
    ids=["one-chunk", "chunks-of-3", "probe-then-chunks-of-2", "default-budget"],
)
def test_batched_and_looped_sampling_agree_exactly_when_draw_order_is_the_same(plan):
    # One mask per forward call: the rows of one batched draw come from the generator
    # in the order of the looped draws (as long as every draw is a whole number of
    # 64-bit words: masks.py cuts each into four 16-bit values, so B * H % 4 == 0).
    model = LastStep()
    x = torch.randn(4, 5, 3)

    def predict(**kwargs):
        torch.manual_seed(7)
        return mc_predict(model, x, n_samples=10, task="regression", return_samples=True, **kwargs)

    looped = predict(method="loop")
    assert not torch.allclose(looped.samples[0], looped.samples[1])
    other = predict(**plan)
    torch.testing.assert_close(other.samples, looped.samples)
    torch.testing.assert_close(other.mean, looped.mean)
    torch.testing.assert_close(other.std, looped.std)
    torch.testing.assert_close(looped.mean, looped.samples.mean(0))
    torch.testing.assert_close(looped.std, looped.samples.std(0, correction=0))


def test_batched_and_looped_sampling_agree_in_distribution():
    torch.manual_seed(2)
    model = Classifier(p=0.3, p_dense=0.2, features=2, hidden=5, classes=3).eval()
    x = torch.randn(2, 4, 2)
    n = 300
    looped = mc_predict(model, x, n_samples=n, method="loop", return_samples=True)
    batched = mc_predict(model, x, n_samples=n, method="batched", return_samples=True)
    assert not torch.equal(looped.samples, batched.samples)
    probs_l, probs_b = looped.samples.softmax(-1), batched.samples.softmax(-1)
    tol = 5 * (probs_l.std(0) / math.sqrt(n)) * math.sqrt(2) + 1e-4
    assert ((looped.mean - batched.mean).abs() < tol).all()
    assert ((probs_l.std(0) - probs_b.std(0)).abs() < 0.25 * probs_l.std(0) + 1e-4).all()


def test_time_major_inputs_tuple_outputs_and_extra_tensor_arguments():
    torch.manual_seed(3)
    lm = TinyLM(p_hidden=0.3).eval()
    tokens = torch.randint(7, (5, 3))  # [T, B]
    h0 = (torch.randn(1, 3, 8), torch.randn(1, 3, 8))  # [layers, B, H], batch on dim 1
    result = mc_predict(lm, (tokens, h0), n_samples=4, batch_dim=1, return_samples=True)
    assert result.mean.shape == (5, 3, 7)
    assert result.samples.shape == (4, 5, 3, 7)
    torch.testing.assert_close(result.mean.sum(-1), torch.ones(5, 3))
    assert result.mutual_information.shape == (5, 3)
    # Each sample of a batched chunk starts from the given state of its own sequence.
    torch.manual_seed(4)
    batched = mc_predict(lm, (tokens, h0), n_samples=4, batch_dim=1, method="batched",
                         chunk_size=4, return_samples=True)
    torch.manual_seed(4)
    looped = mc_predict(lm, (tokens, h0), n_samples=4, batch_dim=1, method="loop",
                        return_samples=True)
    torch.testing.assert_close(batched.samples, looped.samples)


def test_masks_shared_by_the_batch_are_drawn_per_sequence_when_samples_are_stacked():
    """``mask_scope="batch"``: copies stacked in one call (``"batched"``; ``"auto"`` on CUDA) draw
    masks of their own, so that they are independent samples, with the distribution of one sample
    a call (``"loop"``, where the batch shares its masks; ``"auto"`` elsewhere)."""
    torch.manual_seed(5)
    model = Classifier(p=0.3, p_dense=0.2, features=2, hidden=5, classes=3, mask_scope="batch").eval()
    x = torch.randn(2, 4, 2)
    calls = []
    model.lstm.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    n = 300
    batched = mc_predict(model, x, n_samples=n, method="batched", chunk_size=n, return_samples=True)
    assert calls == [2 * n]  # every sample in one call
    assert distinct(batched.samples) == n
    looped = mc_predict(model, x, n_samples=n, method="loop", return_samples=True)
    probs_l, probs_b = looped.samples.softmax(-1), batched.samples.softmax(-1)
    tol = 5 * (probs_l.std(0) / math.sqrt(n)) * math.sqrt(2) + 1e-4
    assert ((looped.mean - batched.mean).abs() < tol).all()
    assert ((probs_l.std(0) - probs_b.std(0)).abs() < 0.25 * probs_l.std(0) + 1e-4).all()
    # the rows of a call share the recurrent mask, unless drawn per sequence (stacked samples)
    layer = VariationalLSTM(2, 5, num_layers=2, dropout=0.5, dropout_hidden=0.5, batch_first=True,
                            mask_scope="batch")
    same = torch.randn(1, 4, 2).expand(6, 4, 2).contiguous()
    with torch.no_grad():
        shared = layer(same)[0]
        with noise_per_sequence(layer):
            apart = layer(same)[0]
    assert all(torch.equal(shared[0], row) for row in shared)
    assert distinct(apart) == 6


def test_auto_stacks_samples_of_masks_shared_by_the_batch_on_cuda_alone():
    """Where one call a sample pays a GPU host's launch path, ``"auto"`` stacks the samples of a
    model whose masks a call shares (drawn per sequence then); on the CPU it loops, as before; noise
    on weights loops everywhere."""
    from rnndrop.mc.sampling import _resolve_method

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    shared_mask = Classifier(mask_scope="batch")
    words = EmbeddingDropout(nn.Embedding(9, 5), 0.5, scope="batch")
    weights = WeightDrop(nn.LSTM(3, 4), ["weight_hh_l0"], p=0.5)
    for model in (shared_mask, words):
        assert _resolve_method(model, "auto", cuda) == "batched"
        assert _resolve_method(model, "auto", cpu) == "loop"
        assert _resolve_method(model, "batched", cpu) == "batched"
    assert _resolve_method(weights, "auto", cuda) == "loop"
    assert _resolve_method(Classifier(), "auto", cpu) == "batched"


def test_batched_calls_on_the_cpu_stack_at_most_a_cache_s_worth():
    """Without ``chunk_size``, a batched call on the CPU stacks at most ``CPU_STACKED_ROWS`` rows
    (copies times the batch) and ``CPU_CHUNK_BYTES`` of outputs as the probe counts them, whatever
    the memory budget allows (measured faster there than larger stacks, and than looping); a GPU's
    calls are bounded by the budget alone."""
    from rnndrop.mc.sampling import CPU_CHUNK_BYTES, CPU_STACKED_ROWS, _plan_chunks

    assert (CPU_STACKED_ROWS, CPU_CHUNK_BYTES) == (128, 64 << 20)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)

    def plan(device, batch, per_sample):
        chunks, probed = _plan_chunks("batched", 40, None, 1 << 40, lambda: per_sample, device, batch)
        return probed, list(chunks)[:3]

    assert plan(cpu, 40, 1000) == (1, [1, 3, 3])  # rows: 128 // 40
    assert plan(cpu, 500, 1000) == (1, [1, 1, 1])
    assert plan(cpu, 4, 16 << 20) == (1, [1, 4, 4])  # bytes: 64 MiB of 16 MiB samples
    assert plan(cuda, 40, 16 << 20) == (1, [1, 39])
    torch.manual_seed(9)
    model = Classifier()
    rows = []
    model.lstm.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    mc_predict(model, torch.randn(40, 4, 3), n_samples=10, memory_budget=1 << 40)
    assert rows == [40, 120, 120, 120]  # the probe's one copy, then three copies a call
    lm, batches = TinyLM(), token_batches(segments=2, T=3, B=50)
    rows.clear()
    lm.lstm.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[1]))
    mc_perplexity(lm, batches, n_samples=5, memory_budget=1 << 40)
    assert rows == [50, 100, 100] * 2  # each segment: the probe's copy, then two copies a call


class Encoder(nn.Module):
    """Time-major [T, B, F] -> last output [B, H] of any recurrent layer."""

    def __init__(self, rnn):
        super().__init__()
        self.rnn = rnn

    def forward(self, x):
        return self.rnn(x)[0][-1]


@pytest.mark.parametrize(
    "make",
    [
        lambda: WeightDrop(nn.LSTM(3, 4), ["weight_hh_l0"], p=0.5),
        lambda: SparseLSTM(3, 4),
    ],
    ids=["WeightDrop", "SparseLSTM"],
)
def test_weight_noise_forces_looping(make):
    torch.manual_seed(13)
    model = Encoder(make())
    x = torch.randn(5, 3, 3)
    with pytest.raises(ValueError, match="method='batched' cannot draw independent samples"):
        mc_predict(model, x, n_samples=3, method="batched", batch_dim=1, output_batch_dim=0)
    torch.manual_seed(14)
    auto = mc_predict(model, x, n_samples=3, batch_dim=1, output_batch_dim=0, return_samples=True)
    torch.manual_seed(14)
    loop = mc_predict(
        model, x, n_samples=3, batch_dim=1, output_batch_dim=0, method="loop", return_samples=True
    )
    torch.testing.assert_close(auto.samples, loop.samples)
    assert not torch.allclose(auto.samples[0], auto.samples[1])


def test_a_wrapped_module_stays_in_eval_and_word_masks_of_either_scope_stack_samples():
    wrapped = WeightDrop(nn.LSTM(3, 4), ["weight_hh_l0"], p=0.5)
    with mc_dropout(wrapped):
        assert wrapped.training and not wrapped.module.training
    with pytest.raises(ValueError, match="WeightDrop"):
        mc_predict(Encoder(wrapped), torch.randn(5, 3, 3), n_samples=2, batch_dim=1, output_batch_dim=0,
                   method="batched")
    torch.manual_seed(8)
    tokens = torch.full((4, 1), 3)  # one sequence of one word: a sample keeps it or drops it
    for scope in ("sequence", "batch"):
        model = EmbeddingDropout(nn.Embedding(9, 5), 0.5, scope=scope)
        result = mc_predict(model, tokens, n_samples=64, batch_dim=1, method="batched", chunk_size=64,
                            task="regression", return_samples=True)
        kept = result.samples.ne(0).all(-1)  # [S, T, B]: the word's every occurrence kept or not
        assert torch.equal(kept.all(1), kept.any(1))  # one draw a sequence, tied over time
        assert 10 < int(kept[:, 0, 0].sum()) < 54  # but drawn apart for each stacked copy


def test_bad_arguments_are_named():
    model = Classifier()
    x = torch.randn(2, 3, 3)
    with pytest.raises(ValueError, match="n_samples"):
        mc_predict(model, x, n_samples=0)
    with pytest.raises(ValueError, match="method"):
        mc_predict(model, x, method="parallel")
    with pytest.raises(ValueError, match="task"):
        mc_predict(model, x, task="ranking")
    with pytest.raises(ValueError, match="output_batch_dim"):
        mc_predict(model, x, n_samples=3, method="batched", output_batch_dim=1)
    with pytest.raises(ValueError, match="output_batch_dim"):
        mc_predict(model, x, n_samples=3, method="loop", output_batch_dim=1)
    with pytest.raises(TypeError, match="inputs must be a Tensor"):
        mc_predict(model, [None], n_samples=3)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        mc_predict(lambda x: x, x)


def test_a_negative_batch_dim_out_of_the_outputs_range_names_batch_dim_not_output_batch_dim():
    """The error names batch_dim, the argument the call gave, and output_batch_dim as the way out."""
    model = Classifier()  # [B, T, F] -> [B, C]: batch_dim=-3 is the input's batch, not the output's
    note = r"\(the output's batch dimension: output_batch_dim is not given\)"
    with pytest.raises(ValueError, match=r"^batch_dim=-3 is out of range .* " + note):
        mc_predict(model, torch.randn(2, 3, 3), n_samples=2, batch_dim=-3)
    result = mc_predict(model, torch.randn(2, 3, 3), n_samples=2, batch_dim=-3, output_batch_dim=0)
    assert result.mean.shape[0] == 2


# ------------------------------------------------------------------ perplexity


def perplexity_in_current_mode(model, batches):
    nll, count, hidden = 0.0, 0, None
    with torch.no_grad():
        for tokens, targets in batches:
            logits, hidden = model(tokens, hidden)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            nll += loss.item()
            count += targets.numel()
    return math.exp(nll / count)


def test_mc_perplexity_with_one_deterministic_sample_is_ordinary_perplexity():
    torch.manual_seed(8)
    lm = TinyLM(p_hidden=0.0)
    batches = token_batches()
    expected = perplexity_in_current_mode(lm.eval(), batches)
    lm.train()
    assert mc_perplexity(lm, batches, n_samples=1, strict=False) == pytest.approx(expected, rel=1e-6)
    # With dropout on and one sample it is the perplexity of one stochastic network.
    lm = TinyLM(p_hidden=0.5)
    torch.manual_seed(9)
    mc = mc_perplexity(lm, batches, n_samples=1)
    torch.manual_seed(9)
    assert mc == pytest.approx(perplexity_in_current_mode(lm.train(), batches), rel=1e-6)


def test_mc_perplexity_of_a_diverged_model_is_infinite_not_an_overflow_error():
    """An NLL over ~709 nats a word (logits of 1e6) overflows exp: a diverged model's perplexity
    is inf, as rnndrop-lm reports it."""
    torch.manual_seed(8)
    lm = TinyLM(p_hidden=0.4)
    with torch.no_grad():
        lm.decoder.weight.mul_(1e6)
    assert mc_perplexity(lm, token_batches(), n_samples=2) == math.inf


def test_a_near_certain_next_word_has_confidence_one_not_an_error():
    """The mean over samples of a near-certain word's probability is 1 within rounding; the
    logsumexp over samples and chunks can round it to 1 + 1 ulp, which the reliability diagram
    refuses: the confidence is at most 1 and the ECE of always-right certainty is 0."""
    torch.manual_seed(8)
    lm = TinyLM(p_hidden=0.4, p_input=0.3)
    with torch.no_grad():
        lm.decoder.bias[3] = 60.0
    tokens = torch.full((6, 2), 3)
    for S in range(1, 25):
        for kwargs in ({"method": "loop"}, {"chunk_size": 2}, {"chunk_size": 7}, {}):
            result = mc_language_model_loss(lm, [(tokens[:-1], tokens[1:])], S, calibration_bins=15, **kwargs)
            assert result.reliability.ece == pytest.approx(0.0, abs=1e-6), (S, kwargs)


def test_mc_perplexity_averages_probabilities_with_a_state_per_sample():
    torch.manual_seed(10)
    lm = TinyLM(p_hidden=0.5, p_input=0.3)
    batches = token_batches(segments=3, T=3, B=2)
    S = 3
    # By hand: the looped order of draws is segment by segment, sample by sample.
    torch.manual_seed(11)
    lm.train()
    states = [None] * S
    nll, per_sample_nll = 0.0, 0.0
    with torch.no_grad():
        for tokens, targets in batches:
            probs = []
            for s in range(S):
                logits, states[s] = lm(tokens, states[s])
                probs.append(logits.softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1))
            probs = torch.stack(probs)  # [S, T, B]
            nll -= probs.mean(0).log().sum().item()
            per_sample_nll -= probs.log().mean(0).sum().item()
    count = 3 * 3 * 2
    torch.manual_seed(11)
    result = mc_language_model_loss(lm, batches, n_samples=S, method="loop")
    assert result.num_tokens == count
    assert result.total_nll == pytest.approx(nll, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert result.total_nll < per_sample_nll - 1e-3  # Jensen: not the mean of log-probabilities
    assert lm.training  # restored
    # Batched sampling draws the recurrent and input masks in another order: compare
    # with a model whose only mask is the recurrent one.
    lm = TinyLM(p_hidden=0.5)
    scores = []
    for kwargs in ({"method": "loop"}, {"chunk_size": 2}, {"memory_budget": 100}, {}):
        torch.manual_seed(12)
        scores.append(mc_perplexity(lm, batches, n_samples=5, **kwargs))
    assert scores == pytest.approx([scores[0]] * 4, rel=1e-5)


class SharedMaskLM(nn.Module):
    """The LM protocol with masks a call shares across its batch: word masks of ``scope="batch"``
    and recurrent masks of ``mask_scope="batch"`` (the LM benchmark's "batch" regime)."""

    def __init__(self, vocab=7, hidden=8):
        super().__init__()
        self.embedding = EmbeddingDropout(nn.Embedding(vocab, 5), 0.3, scope="batch")
        self.lstm = VariationalLSTM(5, hidden, dropout_hidden=0.5, mask_scope="batch")
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens, hidden=None):
        out, hidden = self.lstm(self.embedding(tokens), hidden)
        return self.decoder(out), hidden


def test_mc_perplexity_stacks_samples_of_masks_shared_by_the_batch_when_asked():
    """``method="batched"``: one call a chunk, every copy with masks of its own; the perplexity
    agrees with one call a sample (masks shared by the batch) up to the sampling noise."""
    torch.manual_seed(15)
    lm = SharedMaskLM()
    batches = token_batches(segments=4, T=5, B=1)
    outputs = []
    lm.lstm.register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    torch.manual_seed(16)
    batched = mc_perplexity(lm, batches, n_samples=400, method="batched", chunk_size=400)
    assert [out.shape[1] for out in outputs] == [400] * 4  # each segment: all samples in one call
    distinct = {tuple(row.flatten().tolist()) for row in outputs[0].transpose(0, 1)}
    assert len(distinct) > 200  # the copies of the one sequence drew masks of their own
    torch.manual_seed(16)
    looped = mc_perplexity(lm, batches, n_samples=400, method="loop")
    assert batched == pytest.approx(looped, rel=0.02)
    assert lm.training  # restored


class LogitsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(7, 7)
        self.drop = nn.Dropout(0.5)

    def forward(self, tokens, hidden=None):
        return self.drop(self.embedding(tokens))


def test_mc_perplexity_checks_the_lm_protocol():
    lm = TinyLM()
    with pytest.raises(TypeError, match=r"inputs must be a 2-D int64 or int32 tensor .* got torch.float32"):
        mc_perplexity(lm, [(torch.randn(3, 2), torch.zeros(3, 2, dtype=torch.long))], n_samples=2)
    with pytest.raises(TypeError, match="strict must be True or False, got str 'no'"):
        mc_perplexity(lm, [(torch.zeros(3, 2, dtype=torch.long),) * 2], n_samples=2, strict="no")
    # Word ids of either type nn.Embedding takes: the same perplexity.
    ids = torch.randint(7, (4, 2))
    scores = []
    for dtype in (torch.long, torch.int32):
        torch.manual_seed(5)
        scores.append(mc_perplexity(lm, [(ids[:-1].to(dtype), ids[1:].to(dtype))], n_samples=3))
    assert scores[0] == scores[1]
    with pytest.raises(ValueError, match="same shape"):
        mc_perplexity(lm, [(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long))])
    with pytest.raises(ValueError, match="at least one"):
        mc_perplexity(lm, [], n_samples=2)
    tokens = torch.zeros(3, 2, dtype=torch.long)
    for bad in (-1, 10_000):  # named as word ids out of range, not gather's bare "index out of bounds"
        with pytest.raises(ValueError, match=rf"targets must be word ids in \[0, \d+\) .*got id {bad}"):
            mc_perplexity(lm, [(tokens, torch.full((3, 2), bad))], n_samples=2)
    with pytest.raises(TypeError, match=r"\(logits \[T, B, V\], hidden\)"):
        mc_perplexity(LogitsOnly(), token_batches(), n_samples=2)


def test_a_plan_of_any_number_of_samples_costs_no_memory():
    """The chunk sizes are computed on demand (reliability probe case 444: a list of 10^12 chunk
    sizes was a MemoryError with no message): they add up to the samples asked for."""
    from rnndrop.mc.sampling import ChunkPlan, _plan_chunks

    cpu = torch.device("cpu")
    plan, done = _plan_chunks("batched", 10**12, 1, 0, lambda: 0, cpu, 1)
    assert (len(plan), plan[0], plan[-1], done) == (10**12, 1, 1, 0)
    plan, done = _plan_chunks("batched", 10, None, 300, lambda: 100, cpu, 1)  # a probe, then 3 a chunk
    assert (list(plan), done) == ([1, 3, 3, 3], 1)
    assert list(ChunkPlan(7, 3)) == [3, 3, 1] == ChunkPlan(7, 3)[:] and ChunkPlan(6, 3)[-1] == 3
    assert list(_plan_chunks("loop", 3, None, 0, lambda: 0, cpu, 1)[0]) == [1, 1, 1]
    with pytest.raises(IndexError):
        ChunkPlan(6, 3)[2]


# ------------------------------------------------------------------ inputs of other shapes


NEARLY_ZERO = 1e-12  # a model that samples (strict mc_dropout lets it through), all but deterministic


class PackedTagger(nn.Module):
    """A PackedSequence -> per-word logits ``[N, C]`` (``output.data``) or, with ``per_sequence``,
    per-sequence logits ``[B, C]`` from the last state (in the batch's own order)."""

    def __init__(self, p, per_sequence=False):
        super().__init__()
        self.lstm = VariationalLSTM(4, 8, dropout_hidden=p, dropout_output=p)
        self.head = nn.Linear(8, 3)
        self.per_sequence = per_sequence

    def forward(self, packed):
        out, (h, _) = self.lstm(packed)
        return self.head(h[-1] if self.per_sequence else out.data)


def _packed():
    from torch.nn.utils.rnn import pack_padded_sequence
    torch.manual_seed(0)
    return pack_padded_sequence(torch.randn(7, 3, 4), torch.tensor([7, 5, 2]), enforce_sorted=False)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["per-word", "per-sequence"])
def test_a_packed_sequence_is_sampled_one_copy_a_call_and_never_stacked(per_sequence):
    packed = _packed()
    model = PackedTagger(NEARLY_ZERO, per_sequence).eval()
    expected = model(packed).detach()
    for inputs in (packed, (packed,)):  # alone, or as the one positional argument
        result = mc_predict(model, inputs, n_samples=4, return_samples=True)
        for sample in result.samples:  # every sample the model's own output, not rows of other copies
            torch.testing.assert_close(sample, expected)
    with pytest.raises(ValueError, match="method='batched' cannot stack copies of a PackedSequence"):
        mc_predict(model, packed, n_samples=4, method="batched")
    noisy = mc_predict(PackedTagger(0.5, per_sequence), packed, n_samples=3, return_samples=True)
    assert distinct(noisy.samples) == len(noisy.samples)


def test_statistics_of_half_precision_outputs_are_summed_in_float32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 10)).to(torch.bfloat16)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    result = mc_predict(model, x, n_samples=1000, method="loop", return_samples=True)
    probs = result.samples.double().softmax(-1)
    mean = probs.mean(0)
    torch.testing.assert_close(result.mean.double(), mean, atol=1e-5, rtol=1e-4)
    expected = -torch.special.xlogy(probs, probs).sum(-1).mean(0)
    torch.testing.assert_close(result.expected_entropy.double(), expected, atol=1e-5, rtol=1e-4)
    assert result.mean.dtype == torch.float32 and result.samples.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", ["[B]", "[B, 1]"])
def test_a_binary_classifiers_single_logit_is_refused_for_classification(shape):
    class Binary(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop, self.head = nn.Dropout(0.5), nn.Linear(4, 1)

        def forward(self, x):
            z = self.head(self.drop(x))
            return z.squeeze(-1) if shape == "[B]" else z

    expected = "the classes on the output's last dimension" if shape == "[B]" else "at least two classes"
    with pytest.raises(ValueError, match=expected + r".*torch.stack\(\[torch.zeros_like\(z\), z\], -1\)"):
        mc_predict(Binary(), torch.randn(5, 4), n_samples=3)
    assert mc_predict(Binary(), torch.randn(5, 4), n_samples=3, task="regression").mean.shape[0] == 5


class TimeMajorWithLengths(nn.Module):
    """``(x [T, B, F], lengths [B])`` -> logits ``[B, C]``."""

    def __init__(self, p):
        super().__init__()
        self.lstm = VariationalLSTM(3, 8, dropout_input=p, dropout_hidden=p)
        self.head = nn.Linear(8, 4)

    def forward(self, x, lengths):
        from torch.nn.utils.rnn import pack_padded_sequence
        _, (h, _) = self.lstm(pack_padded_sequence(x, lengths, enforce_sorted=False))
        return self.head(h[-1])


class BatchFirstWithState(nn.Module):
    """``(x [B, T, F], (h0, c0) [1, B, H])`` -> logits ``[B, C]``."""

    def __init__(self, p):
        super().__init__()
        self.lstm = VariationalLSTM(3, 8, batch_first=True, dropout_input=p, dropout_hidden=p)
        self.head = nn.Linear(8, 4)

    def forward(self, x, state):
        out, _ = self.lstm(x, state)
        return self.head(out[:, -1])


def test_one_batch_dimension_per_argument_stacks_copies_of_each_argument_along_its_own():
    torch.manual_seed(1)
    x_tm, lengths = torch.randn(6, 5, 3), torch.tensor([6, 2, 4, 1, 3])
    x_bf, state = torch.randn(5, 6, 3), (torch.randn(1, 5, 8), torch.randn(1, 5, 8))
    cases = [(TimeMajorWithLengths, (x_tm, lengths), (1, 0)), (BatchFirstWithState, (x_bf, state), (0, 1))]
    for make, inputs, dims in cases:
        model = make(NEARLY_ZERO).eval()
        expected = model(*inputs).detach()
        result = mc_predict(model, inputs, n_samples=6, batch_dim=dims, output_batch_dim=0, method="batched",
                            chunk_size=3, return_samples=True)
        for sample in result.samples:  # copy s, row b: the model's row b
            torch.testing.assert_close(sample, expected)
        noisy = mc_predict(make(0.5), inputs, n_samples=4, batch_dim=dims, output_batch_dim=0,
                           method="batched", chunk_size=4, return_samples=True)
        assert distinct(noisy.samples) == len(noisy.samples)


def test_batch_dims_and_untiled_lists_are_checked():
    model = TimeMajorWithLengths(0.5)
    x = torch.randn(6, 5, 3)
    with pytest.raises(ValueError, match=r"batch_dim gives 3 batch dimensions for 2 positional arguments"):
        mc_predict(model, (x, torch.tensor([6, 2, 4, 1, 3])), batch_dim=(1, 0, 0))
    with pytest.raises(TypeError, match="batch_dim must be an int .* one int or None per argument"):
        mc_predict(model, (x, torch.tensor([6, 2, 4, 1, 3])), batch_dim=(1, "0"))
    with pytest.raises(ValueError, match=r"1 dimensions \(in inputs\[1\]\).*batch_dim=\(1, 0\)"):
        mc_predict(model, (x, torch.tensor([6, 2, 4, 1, 3])), batch_dim=1, output_batch_dim=0,
                   method="batched", chunk_size=3)
    with pytest.raises(TypeError, match=r"inputs\[1\] holds a list of 5 numbers, as long as the batch"):
        mc_predict(model, (x, [6, 2, 4, 1, 3]), batch_dim=1, output_batch_dim=0, method="batched")
    looped = mc_predict(model, (x, [6, 2, 4, 1, 3]), n_samples=3, batch_dim=(1, None), output_batch_dim=0,
                        method="loop")  # one copy a call: the list goes as it is
    assert looped.mean.shape == (5, 4)


def test_two_overlapping_monte_carlo_blocks_leave_the_model_as_they_found_it():
    """Two threads' mc_dropout / noise_per_sequence blocks that overlap (A enters, B enters, A
    leaves, B leaves): each saved and restored for itself, so B put back the switched modes A had
    made, and the model stayed in training mode (every later inference stochastic)."""
    lstm = VariationalLSTM(4, 4, dropout_hidden=0.5, mask_scope="batch").eval()
    for block in (lambda: mc_dropout(lstm), lambda: noise_per_sequence(lstm)):
        first, second = block(), block()
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert lstm.training or lstm.__dict__.get("_noise_per_sequence")  # the other still inside
        second.__exit__(None, None, None)
        assert not lstm.training and "_noise_per_sequence" not in lstm.__dict__


def test_a_switch_that_fails_part_way_is_undone_and_the_lock_is_not_held():
    """A user's train() that raises inside mc_dropout's switch: every module gets its mode back,
    and the next block (any model) is not kept waiting."""

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = VariationalLSTM(3, 3, dropout_hidden=0.5)

        def train(self, mode=True):
            if not mode:
                self.lstm.training = False
                raise RuntimeError("a hook of the user's")
            return super().train(mode)

    model = Fails().train()
    with pytest.raises(RuntimeError, match="a hook of the user's"), mc_dropout(model):
        pass
    assert model.training and model.lstm.training
    with mc_dropout(TinyLM()):
        pass
