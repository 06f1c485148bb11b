"""rnndrop.flat_weights.forward_with_weights: a plain RNN's forward pass with weights given, as
the module's own forward pass computes it (the oracle), for every input form torch takes."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from rnndrop import WeightDrop, flat_weights
from tests.helpers import flattened
from tests.oracle import assert_close

T, B, I, H = 5, 3, 4, 6


def _module(kind: str, **kw) -> nn.RNNBase:
    torch.manual_seed(0)
    if kind == "lstm-proj":
        return nn.LSTM(I, H, proj_size=3, **kw)
    if kind == "rnn-relu":
        return nn.RNN(I, H, nonlinearity="relu", **kw)
    return {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](I, H, **kw)


def _states(module: nn.RNNBase, batch: tuple[int, ...]) -> object:
    D = 2 if module.bidirectional else 1
    h = torch.randn(module.num_layers * D, *batch, module.proj_size or module.hidden_size)
    if module.mode == "LSTM":
        return h, torch.randn(module.num_layers * D, *batch, module.hidden_size)
    return h


def _weights(module: nn.RNNBase) -> list[torch.Tensor]:
    return [getattr(module, name) for name in module._flat_weights_names]


@pytest.mark.parametrize("kind", ["lstm", "lstm-proj", "gru", "rnn", "rnn-relu"])
@pytest.mark.parametrize("form", ["tensor", "batch_first", "unbatched", "packed"])
@pytest.mark.parametrize("with_hx", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_forward_with_its_own_weights_is_the_modules_forward(kind, form, with_hx, bidirectional):
    module = _module(kind, num_layers=2, bidirectional=bidirectional, batch_first=form == "batch_first")
    x = torch.randn(T, B, I)
    hx = _states(module, (B,)) if with_hx else None
    if form == "batch_first":
        x = x.transpose(0, 1).contiguous()
    elif form == "unbatched":
        x = x[:, 0]
        hx = None if hx is None else (tuple(h[:, 0] for h in hx) if isinstance(hx, tuple) else hx[:, 0])
    elif form == "packed":
        x = pack_padded_sequence(x, torch.tensor([3, 5, 2]), enforce_sorted=False)
    expected_out, expected_states = module(x, hx)
    out, states = flat_weights.forward_with_weights(module, _weights(module), x, hx)
    if form == "packed":
        assert torch.equal(out.batch_sizes, expected_out.batch_sizes)
        assert torch.equal(out.unsorted_indices, expected_out.unsorted_indices)
        out, expected_out = out.data, expected_out.data
    assert_close(out, expected_out, atol=0, rtol=0)
    assert_close(states, expected_states, atol=0, rtol=0)


def test_other_weights_give_the_module_run_with_them():
    """Weights given replace the module's: the same as the module holding them."""
    module, other = _module("lstm", num_layers=2), nn.LSTM(I, H, num_layers=2)
    x = torch.randn(T, B, I)
    out, _ = flat_weights.forward_with_weights(module, _weights(other), x)
    assert_close(out, other(x)[0], atol=0, rtol=0)
    assert not torch.allclose(out, module(x)[0])


def test_bad_input_gets_torchs_errors():
    module = _module("lstm")
    with pytest.raises(ValueError, match="Expected input to be 2D or 3D, got 4D"):
        flat_weights.forward_with_weights(module, _weights(module), torch.randn(T, B, I, 1))
    with pytest.raises(RuntimeError, match="For batched 3-D input, hx and cx should also be 3-D"):
        flat_weights.forward_with_weights(module, _weights(module), torch.randn(T, B, I),
                                          (torch.zeros(B, H), torch.zeros(B, H)))
    with pytest.raises(RuntimeError, match="Expected hidden"):
        flat_weights.forward_with_weights(module, _weights(module), torch.randn(T, B, I),
                                          (torch.zeros(1, B + 1, H), torch.zeros(1, B + 1, H)))


def test_hooks_are_seen():
    module = _module("gru")
    assert flat_weights.runs_without_hooks(module)
    handle = module.register_forward_hook(lambda *args: None)
    assert not flat_weights.runs_without_hooks(module)
    handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert not flat_weights.runs_without_hooks(module)
    finally:
        handle.remove()
    assert flat_weights.runs_without_hooks(module)


def test_weight_drop_on_a_flattened_rnn_calls_the_op_and_keeps_hooks(monkeypatch):
    """WeightDrop runs a flattened RNN's op with the masked views itself, not through the module's
    forward (which would flatten them again); a module with a hook goes through its forward, and the
    hook runs. Same results both ways."""
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    wd = WeightDrop(flattened(_module("lstm", num_layers=2)), ["weight_hh_l0", "weight_hh_l1"], p=0.5)
    forwards = []
    real_forward = nn.LSTM.forward

    def spy(self, *args, **kwargs):
        forwards.append(1)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(nn.LSTM, "forward", spy)
    masks = wd.sample_masks()
    x = torch.randn(T, B, I)
    direct, _ = wd.forward_with_masks(masks, x)
    assert forwards == []
    calls = []
    wd.module.register_forward_hook(lambda *args: calls.append(1))
    hooked, _ = wd.forward_with_masks(masks, x)
    assert forwards == [1] and calls == [1]
    assert_close(direct, hooked, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_on_cuda_weight_drop_never_flattens_the_weights_again(kind, monkeypatch):
    """cuDNN runs the masked views as they are: torch's flatten (a copy) is never called."""
    wd = WeightDrop(_module(kind, num_layers=2).cuda(), ["weight_hh_l0", "weight_hh_l1"], p=0.5)
    calls = []
    real = torch._cudnn_rnn_flatten_weight
    monkeypatch.setattr(torch, "_cudnn_rnn_flatten_weight", lambda *a: calls.append(1) or real(*a))
    for _ in range(2):
        out, _ = wd(torch.randn(T, B, I, device="cuda"))
        out.sum().backward()
    assert calls == []
