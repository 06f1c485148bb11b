import math
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from rnndrop.gaussian import GaussianGRU, GaussianLockedDropout, GaussianLSTM, rnn_state_dict
from rnndrop.kl import kl_kingma, kl_molchanov, model_kl, negative_elbo
from tests.oracle import assert_close, plain_twin

SITES = dict(dropout=0.3, dropout_input=0.5, dropout_hidden=0.2, dropout_output=0.4, output_fan_out=3)
#: Molchanov's unconstrained setting (the defaults are Kingma's: alpha <= 1, his KL approximation).
UNBOUNDED = dict(max_alpha=None, kl_approximation="molchanov")


def twins(cls, plain_cls, **kwargs):
    layer = cls(5, 6, num_layers=2, bidirectional=True, **SITES, **kwargs)
    plain = plain_twin(layer)
    assert isinstance(plain, plain_cls)
    return layer, plain


@pytest.mark.parametrize("granularity", ["layer", "unit", "weight"])
@pytest.mark.parametrize(("cls", "plain_cls"), [(GaussianLSTM, nn.LSTM), (GaussianGRU, nn.GRU)])
def test_vanishing_alpha_gives_the_plain_layer_in_training(cls, plain_cls, granularity):
    layer, plain = twins(cls, plain_cls, granularity=granularity)
    with torch.no_grad():
        for name in layer.alphas():
            getattr(layer, name).fill_(-40.0)
    x = torch.randn(7, 3, 5)
    layer.train()
    assert_close(layer(x), plain(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("cls", "plain_cls"), [(GaussianLSTM, nn.LSTM), (GaussianGRU, nn.GRU)])
def test_eval_mode_is_the_plain_layer(cls, plain_cls):
    layer, plain = twins(cls, plain_cls)
    x = torch.randn(7, 3, 5)
    assert_close(layer.eval()(x), plain(x), atol=1e-6, rtol=1e-5)


def test_training_output_is_noisy_and_differentiable_in_log_alpha():
    layer = GaussianLSTM(5, 6, num_layers=2, **SITES)
    x = torch.randn(7, 3, 5)
    out1, _ = layer(x)
    out2, _ = layer(x)
    assert not torch.allclose(out1, out2)
    out1.pow(2).sum().backward()
    for name in ("log_alpha_input_l0", "log_alpha_hidden_l0", "log_alpha_output"):
        grad = getattr(layer, name).grad
        assert grad is not None and grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    ("granularity", "input_shape", "hidden_shape"),
    [("layer", (1,), (1,)), ("unit", (5,), (6,)), ("weight", (4, 5), (4, 6))],
)
def test_parameter_shapes_by_granularity(granularity, input_shape, hidden_shape):
    layer = GaussianLSTM(5, 6, num_layers=2, **SITES, granularity=granularity)
    assert layer.log_alpha_input_l0.shape == input_shape
    assert layer.log_alpha_hidden_l1.shape == hidden_shape
    assert layer.log_alpha_output.shape == ((1,) if granularity == "layer" else (6,))
    assert layer.per_gate_masks == (granularity == "weight")
    # initial variance is the Gaussian dropout of the same p
    assert layer.alphas()["log_alpha_input_l0"].flatten()[0].item() == pytest.approx(1.0)
    assert layer.alphas()["log_alpha_input_l1"].flatten()[0].item() == pytest.approx(0.3 / 0.7)


def test_sites_without_dropout_have_no_parameter_and_no_noise():
    layer = GaussianLSTM(5, 6, dropout_hidden=0.2)
    names = [n for n, _ in layer.named_parameters() if n.startswith("log_alpha")]
    assert names == ["log_alpha_hidden_l0"]
    masks = layer.sample_masks(3)
    assert masks.inputs == (None,) and masks.output is None
    assert masks.hidden[0].shape == (3, 6)


def test_masks_are_tied_over_time_with_mean_one_and_variance_alpha():
    layer = GaussianLSTM(5, 6, dropout_input=0.5, granularity="unit", **UNBOUNDED)
    with torch.no_grad():
        layer.log_alpha_input_l0.copy_(torch.log(torch.tensor([0.01, 0.1, 0.5, 1.0, 4.0])))
    mask = layer.sample_masks(40000).inputs[0]
    assert mask.shape == (40000, 5)  # one per sequence, reused at every step
    torch.testing.assert_close(mask.mean(0), torch.ones(5), atol=0.05, rtol=0)  # 5 sd of the mean at alpha 4
    torch.testing.assert_close(mask.var(0), torch.tensor([0.01, 0.1, 0.5, 1.0, 4.0]), atol=0, rtol=0.05)


@pytest.mark.parametrize("cls", [GaussianLSTM, GaussianGRU])
def test_sampled_masks_serve_several_backward_passes_with_the_alpha_of_each_call(cls):
    """Truncated BPTT with one set of masks (sample_masks' documented use): the second backward
    failed ("backward through the graph a second time": the masks kept a graph to log_alpha), and
    the masks kept the alpha of their draw after the optimiser changed it."""
    torch.manual_seed(0)
    layer = cls(6, 5, num_layers=2, dropout=0.3, dropout_input=0.4, dropout_hidden=0.2, output_fan_out=1)
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.5)
    masks = layer.sample_masks(3)
    x, state = torch.randn(7, 3, 6), None
    for _ in range(3):
        out, state = layer(x, state, masks=masks)
        state = tuple(s.detach() for s in state) if isinstance(state, tuple) else state.detach()
        (out.pow(2).mean() + 1e-3 * layer.kl()).backward()
        optimiser.step()
        optimiser.zero_grad()
    # the draws scaled by today's alpha: what a layer with these alphas gives for the same draws
    torch.manual_seed(5)
    drawn = layer.sample_masks(3)
    torch.manual_seed(5)
    assert torch.equal(layer(x, masks=drawn)[0], layer(x)[0])  # forward's own draw: the same numbers
    site = "log_alpha_hidden_l0"
    with torch.no_grad():
        getattr(layer, site).fill_(math.log(0.01))
    torch.manual_seed(5)
    expected = layer(x)[0]  # a fresh draw with the new alpha
    torch.testing.assert_close(layer(x, masks=drawn)[0], expected)


def test_batch_scope_shares_the_recurrent_noise():
    layer = GaussianLSTM(5, 6, dropout_hidden=0.3, mask_scope="batch")
    assert layer.sample_masks(4).hidden[0].shape == (1, 6)
    out, _ = layer(torch.randn(7, 4, 5))
    assert out.shape == (7, 4, 6)


def test_packed_input_runs():
    layer = GaussianGRU(5, 6, num_layers=2, **SITES)
    x = torch.randn(7, 3, 5)
    packed = pack_padded_sequence(x, [7, 4, 2], enforce_sorted=False)
    out, h = layer(packed)
    assert out.data.shape == (13, 6) and h.shape == (2, 3, 6)


@pytest.mark.parametrize("granularity", ["layer", "unit", "weight"])
def test_kl_counts_each_alpha_once_per_weight_it_scales(granularity):
    layer = GaussianLSTM(5, 6, dropout_input=0.5, dropout_hidden=0.2, dropout_output=0.4,
                         granularity=granularity, output_fan_out=1)
    per_weight = lambda p: kl_kingma(torch.tensor(math.log(p / (1 - p))))  # noqa: E731
    expected = per_weight(0.5) * 5 * 24 + per_weight(0.2) * 6 * 24 + per_weight(0.4) * 6
    torch.testing.assert_close(layer.kl(), expected)
    # the output site counts the weights of the layer it feeds (a decoder of 11 words)
    feeding = GaussianLSTM(5, 6, dropout_input=0.5, dropout_hidden=0.2, dropout_output=0.4,
                           granularity=granularity, output_fan_out=11)
    torch.testing.assert_close(feeding.kl(), expected + per_weight(0.4) * 6 * 10)
    torch.testing.assert_close(feeding.site_kl()["log_alpha_output"], per_weight(0.4) * 6 * 11)
    assert "output_fan_out=11" in repr(feeding)
    with pytest.warns(UserWarning, match="output_fan_out not given") as caught:
        GaussianLSTM(5, 6, dropout_output=0.4)
    assert caught[0].filename == __file__  # points at the caller
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GaussianLSTM(5, 6, dropout_hidden=0.4)  # no output noise, nothing to count
        GaussianLSTM(5, 6, dropout_output=0.4, output_fan_out=1)
        GaussianLockedDropout(4, 0.5, fan_out=1)
    with pytest.warns(UserWarning, match="fan_out not given") as caught:
        GaussianLockedDropout(4, 0.5)
    assert caught[0].filename == __file__
    # like the recurrent sites, a stand-alone one starts inside its bound, where alpha can move
    assert torch.all(GaussianLockedDropout(4, 0.8, fan_out=1).log_alpha == 0.0)
    assert torch.allclose(GaussianLockedDropout(4, 0.8, fan_out=1, **UNBOUNDED).log_alpha,
                          torch.full((4,), math.log(4.0)))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="output_fan_out"):
            GaussianLSTM(5, 6, dropout_output=0.4, output_fan_out=bad)


@pytest.mark.parametrize("granularity", ["layer", "unit", "weight"])
def test_kl_of_a_bidirectional_stack_counts_both_directions_weights(granularity):
    """Bidirectional, 2 layers: layer 0's input noise scales both directions' W_ih (2 x 24 x 5
    weights), layer 1's input (the 12 outputs of both directions) 2 x 24 x 12, each direction's
    recurrent noise its own W_hh (24 x 6), the output noise the 12 outputs once (fan-out 1)."""
    layer = GaussianLSTM(5, 6, num_layers=2, bidirectional=True, dropout=0.3, dropout_input=0.5,
                         dropout_hidden=0.2, dropout_output=0.4, granularity=granularity, output_fan_out=1)
    per_weight = lambda p: kl_kingma(torch.tensor(math.log(p / (1 - p))))  # noqa: E731
    expected = {"log_alpha_input_l0": per_weight(0.5) * 2 * 24 * 5,
                "log_alpha_input_l1": per_weight(0.3) * 2 * 24 * 12,
                "log_alpha_output": per_weight(0.4) * 12}
    for suffix in ("_l0", "_l0_reverse", "_l1", "_l1_reverse"):
        expected["log_alpha_hidden" + suffix] = per_weight(0.2) * 24 * 6
    kl = layer.site_kl()
    assert sorted(kl) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(kl[name], value, msg=name)


def test_max_alpha_clips_and_kingma_needs_it():
    layer = GaussianLSTM(5, 6, dropout_input=0.5, max_alpha=1.0, kl_approximation="kingma")
    with torch.no_grad():
        layer.log_alpha_input_l0.fill_(2.0)
    assert torch.all(layer.alphas()["log_alpha_input_l0"] == 1.0)
    assert torch.isfinite(layer.kl())
    with pytest.raises(ValueError, match="max_alpha"):
        GaussianLSTM(5, 6, dropout_input=0.5, max_alpha=None)  # Kingma's KL, the default, needs it
    default = GaussianLSTM(5, 6, dropout_input=0.5)
    assert (default.max_alpha, default.kl_approximation) == (1.0, "kingma")
    with pytest.raises(ValueError, match="max_alpha"):
        GaussianLSTM(5, 6, dropout_input=0.5, max_alpha=-1.0)
    with pytest.raises(ValueError, match="granularity"):
        GaussianGRU(5, 6, dropout_input=0.5, granularity="gate")


def test_state_dicts_interchange_with_nn_lstm():
    layer = GaussianLSTM(5, 6, dropout_input=0.5)
    plain = nn.LSTM(5, 6)
    result = layer.load_state_dict(plain.state_dict(), strict=False)
    assert result.missing_keys == ["log_alpha_input_l0"] and not result.unexpected_keys
    assert torch.equal(layer.weight_hh_l0, plain.weight_hh_l0)
    assert torch.all(layer.log_alpha_input_l0 == 0.0)
    nn.LSTM(5, 6).load_state_dict(rnn_state_dict(layer))  # strict
    layer.reset_parameters()
    assert torch.all(layer.log_alpha_input_l0 == 0.0)


@pytest.mark.slow
def test_learned_alpha_rises_on_a_useless_input_and_stays_low_on_a_useful_one():
    torch.manual_seed(0)
    lstm = GaussianLSTM(2, 8, dropout_input=0.2, granularity="unit", **UNBOUNDED)
    head = nn.Linear(8, 1)
    opt = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=0.03)
    for _ in range(100):
        x = torch.randn(8, 16, 2)
        target = x[:, :, :1].cumsum(0) * 0.3  # channel 0 carries the signal, channel 1 none
        out, _ = lstm(x)
        nll = (head(out) - target).pow(2).mean()
        loss = negative_elbo(nll, model_kl(lstm), dataset_size=500)
        opt.zero_grad()
        loss.backward()
        opt.step()
    signal, noise = lstm.alphas()["log_alpha_input_l0"].tolist()
    initial = 0.2 / 0.8
    assert noise > 4 * initial
    assert signal < initial
    assert noise > 10 * signal


def test_gaussian_locked_dropout_is_tied_over_time_and_learned():
    drop = GaussianLockedDropout(4, 0.5, fan_out=1, **UNBOUNDED)
    x = torch.ones(6, 3, 4)
    y = drop(x)
    assert torch.equal(y, y[:1].expand_as(y))  # the same noise at every step
    assert not torch.equal(y[:, 0], y[:, 1])  # but not across sequences
    y.sum().backward()
    assert drop.log_alpha.grad.shape == (4,)
    assert torch.equal(drop.eval()(x), x)
    torch.testing.assert_close(drop.kl(), kl_molchanov(torch.zeros(4)).sum())
    torch.testing.assert_close(GaussianLockedDropout(4, 0.5, fan_out=7, **UNBOUNDED).kl(), 7 * drop.kl())
    batch_first = GaussianLockedDropout(4, 0.5, batch_first=True, granularity="layer")
    y = batch_first(torch.ones(3, 6, 4))
    assert torch.equal(y, y[:, :1].expand_as(y))
    with pytest.raises(ValueError, match="x must be"):
        drop.train()(torch.ones(6, 3, 5))
    with pytest.raises(ValueError, match="p must be"):
        GaussianLockedDropout(4, 0.0)


@pytest.mark.parametrize("log_alpha", [-200.0, -60.0, 60.0, 200.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_learned_alpha_at_its_extremes_gives_finite_outputs_and_gradients(log_alpha, dtype):
    """alpha that underflows (its sqrt had an infinite derivative: NaN gradients with a finite
    loss) or overflows (infinite noise: NaN outputs) leaves the loss and every gradient finite."""
    layer = GaussianLSTM(3, 4, num_layers=2, dropout=0.3, dropout_input=0.3, dropout_hidden=0.3,
                         dropout_output=0.3).to(dtype)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if name.startswith("log_alpha"):
                parameter.fill_(log_alpha)
    out, _ = layer(torch.randn(5, 2, 3, dtype=dtype))
    loss = out.sum() + layer.kl()
    loss.backward()
    assert torch.isfinite(out).all() and torch.isfinite(loss)
    for name, parameter in layer.named_parameters():
        assert torch.isfinite(parameter.grad).all(), name


def test_learned_alpha_below_half_precision_has_a_zero_gradient_not_nan():
    layer = GaussianLSTM(3, 4, dropout_hidden=0.3).half()
    with torch.no_grad():
        layer.log_alpha_hidden_l0.fill_(-40.0)  # alpha = e^-40: 0 in float16
    out, _ = layer(torch.randn(5, 2, 3).half())
    out.float().sum().backward()
    assert torch.isfinite(layer.log_alpha_hidden_l0.grad).all()


def test_max_alpha_starts_inside_and_a_clipped_alpha_can_come_back():
    layer = GaussianLSTM(5, 6, dropout_input=0.8, max_alpha=1.0, kl_approximation="kingma")
    assert torch.all(layer.log_alpha_input_l0 == 0.0)  # p 0.8 would be alpha 4: starts at the bound
    with torch.no_grad():
        layer.log_alpha_input_l0.fill_(0.5)  # one step past the bound
    # the KL term favours a larger alpha: beyond the bound its pull does not pass...
    layer.kl().backward()
    assert torch.all(layer.log_alpha_input_l0.grad == 0)
    # ...but a gradient that lowers log_alpha does, so the data term can bring it back
    layer.zero_grad()
    (-layer.kl()).backward()
    assert torch.all(layer.log_alpha_input_l0.grad > 0)


def test_site_kl_sums_to_kl():
    layer = GaussianLSTM(5, 6, num_layers=2, dropout_input=0.5, dropout=0.3, dropout_hidden=0.2,
                         dropout_output=0.4)
    per_site = layer.site_kl()
    assert set(per_site) == set(layer.alphas())
    torch.testing.assert_close(torch.stack(list(per_site.values())).sum(), layer.kl())


@pytest.mark.parametrize(("name", "value"), [
    ("dropout_input", 0.0), ("dropout_hidden", 0.3), ("dropout_output", 0.5), ("dropout", 0.2),
    ("noise", "bernoulli"), ("granularity", "layer"), ("max_alpha", 100.0), ("kl_approximation", "molchanov"),
    ("output_fan_out", -10),
])
def test_a_noise_setting_of_a_built_gaussian_layer_cannot_change(name, value):
    """Its noise sites and their log alpha are parameters the constructor made: a change after it
    was ignored (p 0 still drew noise, max_alpha 100 gave a KL of -5.8e6 under kingma); now it
    is an error naming the setting. The same value set again, and the loop's settings, may change."""
    layer = GaussianLSTM(4, 5, 2, dropout=0.1, dropout_input=0.5, dropout_hidden=0.2)
    before = getattr(layer, name)
    with pytest.raises(AttributeError, match=f"GaussianLSTM.{name} cannot change after construction .*got "):
        setattr(layer, name, value)
    assert getattr(layer, name) == before
    setattr(layer, name, before)
    layer.mask_scope, layer.kernel = "step", "manual"
    assert layer(torch.randn(3, 2, 4))[0].shape == (3, 2, 5)


def test_a_built_gaussian_locked_dropout_keeps_its_noise_settings():
    drop = GaussianLockedDropout(4, 0.5, fan_out=3)
    for name, value in (("max_alpha", -1.0), ("fan_out", 0), ("p", 0.1), ("granularity", "layer")):
        with pytest.raises(AttributeError, match=f"GaussianLockedDropout.{name} cannot change"):
            setattr(drop, name, value)
    drop.batch_first = True  # how it reads its input: checked, and free to change
    with pytest.raises(TypeError, match="batch_first must be True or False"):
        drop.batch_first = 1


def test_weight_granularity_refuses_masks_not_per_gate_and_float16_masks_stay_finite():
    """per_gate_masks=False was silently turned on; a float16 mask at the alpha cap overflowed
    to inf wherever |eps| > 3 (inf times a dropped 0 is NaN)."""
    with pytest.raises(ValueError, match="granularity='weight' .* per_gate_masks=False contradicts it"):
        GaussianLSTM(4, 5, dropout_hidden=0.3, granularity="weight", per_gate_masks=False)
    assert GaussianLSTM(4, 5, dropout_hidden=0.3, granularity="weight").per_gate_masks
    from rnndrop.noise import learned_gaussian_mask
    torch.manual_seed(0)
    mask = learned_gaussian_mask((100_000,), torch.tensor([100.0]), dtype=torch.float16)
    assert torch.isfinite(mask).all() and mask.abs().max() == torch.finfo(torch.float16).max


def test_gaussian_locked_dropout_names_the_layout_it_expects():
    """The message follows batch_first; a non-tensor is a TypeError, as LockedDropout's."""
    drop = GaussianLockedDropout(4, 0.5, fan_out=1, batch_first=True)
    for mode in (drop.train, drop.eval):  # eval mode checks as training does: found before training
        mode()
        for shape in ([2, 3, 5], [2, 3, 1, 4], [6, 4]):
            expected = f"x must be 3-D [B, T, 4] or a PackedSequence of [*, 4], got shape {shape}"
            with pytest.raises(ValueError, match=re.escape(expected)):
                drop(torch.randn(*shape))
        with pytest.raises(TypeError, match="x must hold floating-point values .* got torch.int64"):
            drop(torch.ones(2, 3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"x must be a Tensor \[T, B, 4\] or a PackedSequence, got list"):
        GaussianLockedDropout(4, 0.5, fan_out=1)([[0.0] * 4])
