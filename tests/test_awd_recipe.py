"""AWD-LSTM's training recipe as library parts: AR / TAR, variable-length BPTT, NT-ASGD's
averaging and its fine-tuning restart."""

import io
import random

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from rnndrop import (
    ActivationRegularization,
    NonMonotoneTrigger,
    NTAveraging,
    VariableBPTT,
    VariationalGRU,
    VariationalLSTM,
    WeightDrop,
    activation_regularization,
    scaled_learning_rate,
    temporal_activation_regularization,
    to_torch,
)
from rnndrop.lm.model.language_model import RNNLanguageModel

# -- AR / TAR ----------------------------------------------------------------------------------


def test_ar_and_tar_are_awd_lstms_formulas():
    raw = torch.randn(7, 3, 5, requires_grad=True)
    dropped = raw * torch.bernoulli(torch.full((1, 3, 5), 0.6)) / 0.6
    ar = activation_regularization(dropped, 2.0)
    tar = temporal_activation_regularization(raw, 1.5)
    # AWD-LSTM's main.py: alpha * dropped.pow(2).mean(); beta * (raw[1:] - raw[:-1]).pow(2).mean()
    assert torch.allclose(ar, 2.0 * dropped.pow(2).mean())
    assert torch.allclose(tar, 1.5 * (raw[1:] - raw[:-1]).pow(2).mean())
    reg = ActivationRegularization(alpha=2.0, beta=1.5)
    assert torch.allclose(reg(raw, dropped), ar + tar)
    reg(raw, dropped).backward()
    assert raw.grad is not None and raw.grad.abs().sum() > 0
    assert repr(reg) == "ActivationRegularization(alpha=2.0, beta=1.5)" and reg.enabled
    assert not ActivationRegularization(0.0, 0.0).enabled


def test_ar_tar_batch_first_zero_weights_and_a_single_step():
    raw = torch.randn(6, 4, 3)
    assert torch.allclose(temporal_activation_regularization(raw.transpose(0, 1), 1.0, time_dim=1),
                          temporal_activation_regularization(raw, 1.0))
    assert torch.allclose(activation_regularization(raw.transpose(0, 1), 2.0, time_dim=1),
                          activation_regularization(raw, 2.0))
    assert activation_regularization(raw, 0.0).item() == 0.0
    assert temporal_activation_regularization(raw, 0.0).item() == 0.0
    one_step = temporal_activation_regularization(raw[:1], 1.0)  # no pair of steps: 0, not NaN
    assert one_step.item() == 0.0 and one_step.shape == ()


def test_a_mask_leaves_padding_out_of_both_means():
    lengths = [5, 3, 2]
    raw = torch.randn(5, 3, 4)
    mask = torch.arange(5)[:, None] < torch.tensor(lengths)[None, :]  # [T, B]
    padded = raw.masked_fill(~mask[..., None], 1e3)  # padding must not count
    ar = activation_regularization(padded, 1.0, mask=mask)
    tar = temporal_activation_regularization(padded, 1.0, mask=mask)
    real = torch.cat([raw[:n, b] for b, n in enumerate(lengths)])
    diffs = torch.cat([raw[1:n, b] - raw[: n - 1, b] for b, n in enumerate(lengths)])
    assert torch.allclose(ar, real.pow(2).mean()) and torch.allclose(tar, diffs.pow(2).mean())
    nothing = torch.zeros(5, 3, dtype=torch.bool)
    assert activation_regularization(raw, 1.0, mask=nothing).item() == 0.0


@pytest.mark.parametrize("call, error, message", [
    (lambda: activation_regularization(torch.randn(3, 2, 4), -1.0), ValueError, "alpha must be a finite"),
    (lambda: activation_regularization(torch.randn(3, 2, 4), float("nan")), ValueError, "alpha must be"),
    (lambda: temporal_activation_regularization(torch.randn(3, 2, 4), True), ValueError, "beta must be"),
    (lambda: activation_regularization([1.0, 2.0], 1.0), TypeError, "dropped must be a Tensor"),
    (lambda: activation_regularization(torch.ones(3, 2, dtype=torch.long), 1.0), TypeError, "floating"),
    (lambda: temporal_activation_regularization(torch.randn(5), 1.0), ValueError, "at least 2-D"),
    (lambda: temporal_activation_regularization(torch.randn(3, 2, 4), 1.0, time_dim=2), ValueError,
     "time_dim"),
    (lambda: activation_regularization(torch.randn(3, 2, 4), 1.0, mask=torch.ones(3, 2)), TypeError,
     "mask must be a bool tensor"),
    (lambda: activation_regularization(torch.randn(3, 2, 4), 1.0, mask=torch.ones(2, 3, dtype=torch.bool)),
     ValueError, r"mask must have the output's shape without its last dimension, \[3, 2\]"),
    (lambda: ActivationRegularization()(torch.randn(3, 2, 4), torch.randn(3, 2, 5)), ValueError,
     "raw and dropped must have the same shape"),
    (lambda: ActivationRegularization(time_dim=3), ValueError, "time_dim"),
    (lambda: temporal_activation_regularization(torch.randn(3, 2, 4), 1.0, time_dim=True), ValueError,
     "time_dim"),
])
def test_ar_tar_check_their_input(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_packed_sequence_is_refused_with_what_to_do():
    packed = pack_padded_sequence(torch.randn(4, 2, 3), [4, 2])
    with pytest.raises(TypeError, match="pad_packed_sequence and pass mask"):
        temporal_activation_regularization(packed, 1.0)


@pytest.mark.parametrize("stack", [VariationalLSTM, VariationalGRU])
def test_the_stack_gives_its_output_before_the_output_dropout(stack):
    layer = stack(4, 6, 2, dropout=0.3, dropout_input=0.2, dropout_hidden=0.2, dropout_output=0.5)
    x = torch.randn(5, 3, 4)
    torch.manual_seed(1)
    plain, _ = layer(x)
    torch.manual_seed(1)
    dropped, _, raw = layer(x, return_raw_output=True)
    assert torch.equal(plain, dropped)  # the same masks, the same result
    masks = layer.sample_masks(3)
    dropped, _, raw = layer(x, masks=masks, return_raw_output=True)
    assert torch.allclose(dropped, raw * masks.output.unsqueeze(0))
    layer.eval()
    out, _, raw = layer(x, return_raw_output=True)
    assert raw is out  # no output mask: the same tensor
    # batch_first and a packed batch keep their layout; WeightDrop passes the keyword on.
    layer = stack(4, 6, 1, batch_first=True, dropout_output=0.5).train()
    out, _, raw = layer(x.transpose(0, 1), return_raw_output=True)
    assert raw.shape == out.shape == (3, 5, 6)
    packed = pack_padded_sequence(x, [5, 4, 2])
    out, _, raw = layer.__class__(4, 6, dropout_output=0.5)(packed, return_raw_output=True)
    assert torch.equal(raw.batch_sizes, out.batch_sizes) and raw.data.shape == out.data.shape
    wrapped = WeightDrop(stack(4, 6, 1, dropout_output=0.5), ["weight_hh_l0"], p=0.5)
    assert len(wrapped(x, return_raw_output=True)) == 3


def test_the_language_model_returns_raw_and_dropped_outputs_without_changing_its_result():
    model = RNNLanguageModel(30, 8, 8, 3, dropout_embedding=0.1, dropout_input=0.3, dropout_between=0.2,
                             weight_drop=0.5, dropout_output=0.4, tie_weights=True)
    tokens = torch.randint(0, 30, (6, 4))
    torch.manual_seed(3)
    logits, _ = model(tokens)
    torch.manual_seed(3)
    again, _, outputs = model(tokens, return_outputs=True)
    assert torch.equal(logits, again)
    assert torch.equal(model.decoder(outputs.dropped), logits)  # dropped: what the decoder reads
    assert not torch.equal(outputs.raw, outputs.dropped)
    plain = RNNLanguageModel(30, 8, 8, 1, rnn=nn.LSTM(8, 8), init_scale=None)
    _, _, outputs = plain(tokens, return_outputs=True)
    assert outputs.raw is outputs.dropped

    class Custom(nn.Module):
        def forward(self, x, hidden=None):
            return x, hidden

    with pytest.raises(TypeError, match="Custom does not give"):
        RNNLanguageModel(30, 8, 8, 1, rnn=Custom(), init_scale=None)(tokens, return_outputs=True)


def test_the_training_step_penalises_the_dropped_outputs_by_ar_and_the_raw_ones_by_tar():
    """AWD-LSTM: AR on the last layer's outputs after their dropout, TAR on them before it."""
    from rnndrop.lm.run.recipe import forward_with_penalty

    model = RNNLanguageModel(30, 8, 8, 2, dropout_hidden=0.3, dropout_output=0.5)
    tokens = torch.randint(0, 30, (6, 4))
    torch.manual_seed(3)
    _, _, outputs = model(tokens, return_outputs=True)
    assert not torch.equal(outputs.raw, outputs.dropped)
    for alpha, beta, expected in [
        (2.0, 0.0, 2.0 * outputs.dropped.pow(2).mean()),
        (0.0, 1.5, 1.5 * (outputs.raw[1:] - outputs.raw[:-1]).pow(2).mean()),
    ]:
        torch.manual_seed(3)
        _, _, penalty = forward_with_penalty(model, tokens, None, ActivationRegularization(alpha, beta))
        torch.testing.assert_close(penalty, expected)


# -- variable-length BPTT ----------------------------------------------------------------------


def test_variable_bptt_draws_awd_lengths_from_its_own_generator():
    before = torch.get_rng_state()
    sampler = VariableBPTT(70, seed=5)
    lengths = [sampler.sample() for _ in range(4000)]
    assert torch.equal(torch.get_rng_state(), before)  # dropout masks' generator untouched
    same, other = VariableBPTT(70, seed=5), VariableBPTT(70, seed=6)
    assert lengths == [same.sample() for _ in range(4000)]
    assert lengths != [other.sample() for _ in range(4000)]
    assert min(lengths) >= 5
    halves = sum(1 for n in lengths if n < 52)  # around 35: the 5% of half-length draws
    assert 0.03 < halves / len(lengths) < 0.07
    full = torch.tensor([n for n in lengths if n >= 52], dtype=torch.float)
    assert 69 < full.mean() < 70.5 and 4.5 < full.std() < 5.5  # int() truncates: a little below 70
    assert {VariableBPTT(70, p_full=1.0, std=0.0).sample() for _ in range(10)} == {70}
    assert {VariableBPTT(9, p_full=0.0, std=0.0).sample() for _ in range(10)} == {5}  # int(4.5), min 5
    half = torch.tensor([n for n in lengths if n < 52], dtype=torch.float)
    assert 33 < half.mean() < 36  # bptt / 2 (AWD-LSTM's), a little below 35 as int() truncates
    assert {VariableBPTT(40, p_full=0.0, std=0.0).sample() for _ in range(10)} == {20}
    capped = VariableBPTT(70, max_len=72, seed=1)
    assert max(capped.sample() for _ in range(500)) == 72


def test_variable_bptt_cuts_a_stream_and_scales_the_rate():
    data = torch.arange(1000).reshape(250, 4)
    sampler = VariableBPTT(20, seed=1)
    parts = list(sampler.batches(data))
    assert torch.equal(torch.cat([x for x, _, _ in parts]), data[:-1])
    assert torch.equal(torch.cat([y for _, y, _ in parts]), data[1:])
    assert all(scale == x.shape[0] / 20 for x, _, scale in parts)
    assert len({x.shape[0] for x, _, _ in parts}) > 3
    lengths = VariableBPTT(20, seed=1).lengths(250)
    assert lengths == [x.shape[0] for x, _, _ in parts] and sum(lengths) == 249
    batch_first = list(VariableBPTT(20, seed=1).batches(data.T, time_dim=1))
    assert all(torch.equal(a[0].T, b[0]) for a, b in zip(batch_first, parts))


def test_variable_bptt_resumes_from_its_state_and_checks_its_arguments():
    sampler = VariableBPTT(35, seed=2)
    sampler.lengths(500)
    buffer = io.BytesIO()
    torch.save(sampler.state_dict(), buffer)
    expected = sampler.lengths(500)
    resumed = VariableBPTT(35)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert resumed.lengths(500) == expected
    with pytest.raises(ValueError, match="other settings"):
        VariableBPTT(70).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="bptt must be a positive int"):
        VariableBPTT(0)
    with pytest.raises(ValueError, match=r"p_full must be a probability in \[0, 1\]"):
        VariableBPTT(10, p_full=1.5)
    with pytest.raises(ValueError, match="std must be a finite number >= 0"):
        VariableBPTT(10, std=-1)
    with pytest.raises(ValueError, match="max_len must be >= min_len = 5"):
        VariableBPTT(10, max_len=3)
    with pytest.raises(ValueError, match="seed or generator, not both"):
        VariableBPTT(10, seed=1, generator=torch.Generator())
    assert repr(VariableBPTT(70)) == "VariableBPTT(bptt=70, p_full=0.95, std=5.0, min_len=5)"


def test_scaled_learning_rate_puts_the_exact_rates_back():
    w = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [w], "lr": 0.3}, {"params": [], "lr": 30.0}])
    with scaled_learning_rate(optimizer, 0.7):
        assert [g["lr"] for g in optimizer.param_groups] == [0.3 * 0.7, 30.0 * 0.7]
    assert [g["lr"] for g in optimizer.param_groups] == [0.3, 30.0]
    with pytest.raises(RuntimeError), scaled_learning_rate(optimizer, 1.3):
        raise RuntimeError
    assert [g["lr"] for g in optimizer.param_groups] == [0.3, 30.0]
    with pytest.raises(ValueError, match="factor must be a finite number > 0"), \
            scaled_learning_rate(optimizer, 0.0):
        pass


# -- NT-ASGD -----------------------------------------------------------------------------------


def _awd_trigger(losses, n):
    """AWD-LSTM main.py's check, verbatim in spirit: which checks would switch to ASGD."""
    best_val_loss, fired = [], []
    for val_loss in losses:
        fired.append(len(best_val_loss) > n and val_loss > min(best_val_loss[:-n]))
        best_val_loss.append(val_loss)
    return fired


def test_the_non_monotone_trigger_is_awd_lstms():
    rng = random.Random(0)
    for n in (1, 2, 5):
        for _ in range(50):
            losses = [rng.uniform(0, 1) - 0.02 * i for i in range(20)]
            trigger = NonMonotoneTrigger(n)
            assert [trigger(v) for v in losses] == _awd_trigger(losses, n)
    trigger = NonMonotoneTrigger(2)
    assert [trigger(v) for v in (5.0, 4.0, 4.5, 4.2, 4.1, 3.9, 4.3)] == [False] * 4 + [True, False, True]
    tie = NonMonotoneTrigger(1)  # AWD-LSTM fires on a loss worse than the best, not on one equal to it
    assert [tie(v) for v in (3.0, 4.0, 3.0, 3.0)] == [False] * 4
    state = trigger.state_dict()
    other = NonMonotoneTrigger(2)
    other.load_state_dict(state)
    assert other.history == trigger.history
    with pytest.raises(ValueError, match="n = 2, this one has n = 3"):
        NonMonotoneTrigger(3).load_state_dict(state)
    with pytest.raises(ValueError, match="n must be a positive int"):
        NonMonotoneTrigger(0)
    with pytest.raises(ValueError, match="not NaN"):
        trigger(float("nan"))


def _train_steps(model, optimizer, steps, averaging=None, seed=0, after_step=None):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=gen)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if averaging is not None:
            averaging.update()
        if after_step is not None:
            after_step()


def test_the_average_is_the_mean_of_the_weights_after_every_step_as_in_torch_asgd():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    twin = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    twin.load_state_dict(model.state_dict())
    averaging = NTAveraging(model, start=True)
    snapshots = []
    _train_steps(model, torch.optim.SGD(model.parameters(), lr=0.05), 25, averaging,
                 after_step=lambda: snapshots.append([p.detach().clone() for p in model.parameters()]))
    assert int(averaging.averaged.n_averaged) == 25
    for i, avg in enumerate(averaging.evaluation_model.parameters()):
        assert torch.allclose(avg, torch.stack([s[i] for s in snapshots]).mean(0), atol=1e-6)
    # torch.optim.ASGD(t0=0, lambd=0), AWD-LSTM's optimizer after the switch, takes the same SGD
    # steps; its average `ax` starts one step later (its mu is 1 for the first two steps).
    asgd = torch.optim.ASGD(twin.parameters(), lr=0.05, lambd=0.0, alpha=0.75, t0=0)
    _train_steps(twin, asgd, 25)
    for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
        assert torch.allclose(p, q)
        assert torch.allclose(asgd.state[q]["ax"], torch.stack([s[i] for s in snapshots[1:]]).mean(0),
                              atol=1e-6)


def test_the_average_is_torchs_averaged_model_bit_for_bit_without_reading_its_count():
    """NTAveraging keeps the count on the host (torch's update_parameters reads its count tensor,
    a wait for the GPU every step there) and computes what AveragedModel computes, bit for bit."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    averaging = NTAveraging(model, start=True)
    reference = torch.optim.swa_utils.AveragedModel(model, use_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(9):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        averaging.update()
        reference.update_parameters(model)
    assert int(averaging.averaged.n_averaged) == int(reference.n_averaged) == 9
    for ours, theirs in zip(averaging.evaluation_model.parameters(), reference.module.parameters()):
        assert torch.equal(ours, theirs)


def test_nt_averaging_switches_on_the_trigger_then_says_when_to_stop():
    model = nn.Linear(3, 1)
    averaging = NTAveraging(model, nonmono=2)
    assert averaging.evaluation_model is model and not averaging.active
    averaging.update()  # nothing to average before the switch
    for loss in (5.0, 4.0, 3.0, 3.5):
        assert averaging.validation(loss) is False
    assert averaging.validation(4.5) is True and averaging.active  # 4.5 > min(5, 4): 2 checks stalled
    assert averaging.evaluation_model is not model and averaging.switches == 1
    assert averaging.trigger.history == []  # the averaged weights' losses are a new series
    with torch.no_grad():
        model.weight.add_(1.0)
    averaging.update()
    assert torch.equal(averaging.evaluation_model.weight, model.weight)  # the first update copies
    for loss in (3.0, 2.9, 2.95):
        averaging.validation(loss)
    assert not averaging.should_stop
    averaging.validation(3.1)  # worse than 3.0, the best of all but the last two
    assert averaging.should_stop
    averaging.validation(1.0)  # a better check later does not take the stop back
    assert averaging.should_stop
    assert "active=True" in repr(averaging) and "should_stop=True" in repr(averaging)


def test_restart_is_the_fine_tuning_stage_from_given_weights():
    model = nn.Linear(4, 2)
    averaging = NTAveraging(model, nonmono=1, start=True)
    _train_steps(nn.Sequential(model, nn.Linear(2, 1)), torch.optim.SGD(model.parameters(), lr=0.1), 5,
                 averaging)
    best = {k: v.clone() for k, v in averaging.evaluation_model.state_dict().items()}
    averaging.validation(1.0)
    averaging.validation(2.0)
    averaging.validation(3.0)
    assert averaging.should_stop
    averaging.restart(best)
    assert torch.equal(model.weight, best["weight"]) and not averaging.should_stop
    assert int(averaging.averaged.n_averaged) == 0 and averaging.trigger.history == []
    assert averaging.switches == 2


def test_the_average_keeps_tied_weights_tied():
    model = RNNLanguageModel(20, 6, 6, 2, tie_weights=True, dropout_output=0.3)
    averaging = NTAveraging(model, start=True)
    module = averaging.evaluation_model
    assert module.decoder.weight is module.embedding.embedding.weight
    assert module is not model and module.state_dict().keys() == model.state_dict().keys()


def test_nt_averaging_resumes_bit_for_bit_from_its_state():
    def fresh():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 1))

    model = fresh()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averaging = NTAveraging(model, nonmono=1, start=True)
    _train_steps(model, optimizer, 5, averaging, seed=1)
    averaging.validation(2.0)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "averaging": averaging.state_dict()}, buffer)
    _train_steps(model, optimizer, 5, averaging, seed=2)

    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    again = fresh()
    again.load_state_dict(saved["model"])
    resumed = NTAveraging(again, nonmono=1)
    resumed.load_state_dict(saved["averaging"])
    assert resumed.active and resumed.trigger.history == [2.0]
    _train_steps(again, torch.optim.SGD(again.parameters(), lr=0.05), 5, resumed, seed=2)
    for a, b in zip(averaging.evaluation_model.parameters(), resumed.evaluation_model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown keys"):
        resumed.load_state_dict({**saved["averaging"], "extra": 1})
    with pytest.raises(ValueError, match=r"missing keys \['averaged'\]"):  # was a bare KeyError
        resumed.load_state_dict({k: v for k, v in saved["averaging"].items() if k != "averaged"})
    # a state that fails to load leaves the averaging as it was (it replaced the history and the
    # average before the shapes failed, leaving a count that no longer matched the weights)
    before = [p.clone() for p in resumed.evaluation_model.parameters()], list(resumed.trigger.history)
    misshapen = {k: torch.zeros(7) if v.dim() else v for k, v in saved["averaging"]["averaged"].items()}
    wrong = {**saved["averaging"], "trigger": {"n": 1, "history": [9.0]}, "averaged": misshapen}
    with pytest.raises(RuntimeError, match="size mismatch"):
        resumed.load_state_dict(wrong)
    assert resumed.trigger.history == before[1]
    assert all(torch.equal(a, b) for a, b in zip(resumed.evaluation_model.parameters(), before[0]))
    ddp_like = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp_like)
    with pytest.raises(TypeError, match="pass ddp.module"):
        NTAveraging(ddp_like)


def test_the_averaged_copy_and_the_deployed_copy_put_their_recurrent_weights_in_one_buffer(monkeypatch):
    """A deep copy gives each parameter its own storage, which cuDNN would copy at every call (with a
    warning): NT-ASGD's averaged copy and ``to_torch``'s copy flatten every recurrent layer again."""
    flattened = []
    real = nn.RNNBase.flatten_parameters

    def spy(module):
        flattened.append(type(module).__name__)
        real(module)

    model = nn.Sequential(VariationalLSTM(3, 4, dropout_hidden=0.2), nn.Linear(4, 4), nn.GRU(4, 2))
    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", spy)
    NTAveraging(model, start=True)
    assert flattened == ["VariationalLSTM", "GRU"]
    flattened.clear()
    to_torch(model)
    assert flattened[-2:] == ["LSTM", "GRU"]  # after building the plain LSTM: every layer of the copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
def test_on_cuda_the_averaged_copys_weights_share_one_storage():
    model = VariationalLSTM(3, 4, num_layers=2, dropout_hidden=0.2).cuda()
    averaged = NTAveraging(model, start=True).evaluation_model
    assert len({w.untyped_storage().data_ptr() for w in averaged._flat_weights}) == 1


def test_the_average_evaluates_with_the_models_latest_buffers():
    """BatchNorm's running statistics in the averaged copy were those of the moment averaging
    began (AveragedModel with use_buffers=False copies buffers once): they follow the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    averaging = NTAveraging(model, start=True)
    for _ in range(5):
        model(torch.randn(8, 3) * 3 + 1)  # training mode: the running statistics move
        averaging.update()
    batch_norm = averaging.evaluation_model[1]
    assert torch.equal(batch_norm.running_mean, model[1].running_mean)
    assert torch.equal(batch_norm.num_batches_tracked, model[1].num_batches_tracked)
    assert model[1].running_mean.abs().sum() > 0


def test_the_average_is_handed_out_in_the_modes_its_model_has_now():
    """Switched on in training mode, the copy kept it: model.eval() then validating the
    average ran it with dropout on."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5))
    averaging = NTAveraging(model, start=True)  # the switch, in training mode
    averaging.update()
    model.eval()
    averaged = averaging.evaluation_model
    assert not any(m.training for m in averaged.modules())
    x = torch.randn(5, 3)
    assert torch.equal(averaged(x), averaged(x))  # no dropout
    model.train()
    model[1].eval()  # a mixed setting is mirrored module by module
    assert [m.training for m in averaging.evaluation_model.modules()] == [True, True, False]


def test_recipe_arguments_are_named_as_the_user_wrote_them():
    with pytest.raises(ValueError, match="nonmono must be a positive int, got 0"):
        NTAveraging(nn.Linear(2, 2), nonmono=0)
    with pytest.raises(ValueError, match=r"batched must hold at least 2 rows along time_dim 0 .*\(1, 2\)"):
        next(VariableBPTT(5).batches(torch.zeros(1, 2)))
