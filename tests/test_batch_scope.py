"""The fast mode: mask_scope="batch" folds one recurrent mask per batch into W_hh (fused kernel)."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence
from torch.overrides import TorchFunctionMode

from rnndrop import VariationalGRU, VariationalLSTM
from tests.oracle import assert_close, plain_twin

I, H, T, B = 5, 6, 7, 4
ALL_P = dict(dropout=0.3, dropout_input=0.2, dropout_hidden=0.5, dropout_output=0.4)


class FusedCalls(TorchFunctionMode):
    """Counts calls of torch's fused LSTM / GRU kernels."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.lstm, torch.gru):
            self.calls.append(func)
        return func(*args, **(kwargs or {}))


def _pair(kind, **kw):
    ours = (VariationalLSTM if kind == "lstm" else VariationalGRU)(I, H, mask_scope="batch", **kw)
    return plain_twin(ours), ours


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_zero_probabilities_or_eval_equal_the_plain_module_exactly(kind):
    x = torch.randn(T, B, I)
    ref, off = _pair(kind, num_layers=2, bidirectional=True)
    assert_close(off(x), ref(x), atol=0, rtol=0)
    _, on = _pair(kind, num_layers=2, bidirectional=True, **ALL_P)
    on.load_state_dict(ref.state_dict())
    on.eval()
    assert_close(on(x), ref(x), atol=0, rtol=0)


def _by_hand(kind, layer, masks, x, hx):
    """Layer by layer with nn.LSTM / nn.GRU: inputs masked per sequence, W_hh's columns
    multiplied by the batch's recurrent mask, output masked per sequence."""
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    states = hx if kind == "lstm" else (hx,)
    finals = []
    inp = x
    for k in range(layer.num_layers):
        if masks.inputs[k] is not None:
            inp = inp * masks.inputs[k]  # [B, size] broadcast over time
        single = cls(inp.shape[-1], H)
        with torch.no_grad():
            for name in ("weight_ih", "bias_ih", "bias_hh"):
                getattr(single, f"{name}_l0").copy_(getattr(layer, f"{name}_l{k}"))
            single.weight_hh_l0.copy_(getattr(layer, f"weight_hh_l{k}") * masks.hidden[k])
        state0 = tuple(s[k : k + 1] for s in states) if kind == "lstm" else states[0][k : k + 1]
        inp, state = single(inp, state0)
        finals.append(state if kind == "lstm" else (state,))
    out = inp * masks.output
    final = tuple(torch.cat(parts) for parts in zip(*finals))
    return out, (final if kind == "lstm" else final[0])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_training_equals_nn_module_with_masked_w_hh_columns(kind):
    _, layer = _pair(kind, num_layers=3, **ALL_P)
    masks = layer.sample_masks(B)
    assert masks.scope == "batch"
    assert all(m.shape == (1, H) for m in masks.hidden)  # one recurrent mask per layer for the batch
    assert masks.inputs[0].shape == (B, I) and masks.output.shape == (B, H)  # per sequence
    x = torch.randn(T, B, I)
    hx = (torch.randn(3, B, H), torch.randn(3, B, H)) if kind == "lstm" else torch.randn(3, B, H)
    with FusedCalls() as mode:
        out, state = layer(x, hx, masks=masks)
    assert mode.calls == [torch.lstm if kind == "lstm" else torch.gru] * 3  # fused, one per layer
    expected_out, expected_state = _by_hand(kind, layer, masks, x, hx)
    assert_close(out, expected_out, atol=1e-6, rtol=1e-6)
    assert_close(state, expected_state, atol=1e-6, rtol=1e-6)


CONFIGS = {
    "2-layers-bidirectional": dict(num_layers=2, bidirectional=True),
    "2-layers-batch-first": dict(num_layers=2, batch_first=True),
    "2-layers-proj": dict(num_layers=2, proj_size=3),
    "1-layer-no-bias": dict(num_layers=1, bias=False),
}
KIND_CONFIGS = [
    pytest.param(kind, config, id=f"{kind}-{name}")
    for kind in ("lstm", "gru")
    for name, config in CONFIGS.items()
    if kind == "lstm" or "proj_size" not in config
]


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("noise", ["bernoulli", "gaussian"])
@pytest.mark.parametrize(("kind", "config"), KIND_CONFIGS)
def test_fused_path_equals_the_loop_kernel_with_the_same_masks(kind, config, noise, layout):
    """Folding the mask into W_hh computes what the reference loop computes, gradients too."""
    cls = VariationalLSTM if kind == "lstm" else VariationalGRU
    p = ALL_P if config["num_layers"] > 1 else {k: v for k, v in ALL_P.items() if k != "dropout"}
    fast = cls(I, H, mask_scope="batch", noise=noise, **p, **config)
    loop = copy.deepcopy(fast)
    loop.kernel = "autograd"
    masks = fast.sample_masks(B)
    if layout == "packed":
        x = pack_sequence([torch.randn(n, I) for n in (3, 7, 1, 5)], False)
    else:
        x = torch.randn(*((B, T, I) if config.get("batch_first") else (T, B, I)))
    out_fast, state_fast = fast(x, masks=masks)
    out_loop, state_loop = loop(x, masks=masks)
    assert_close(out_fast, out_loop)
    assert_close(state_fast, state_loop)
    data_fast = out_fast.data if hasattr(out_fast, "batch_sizes") else out_fast
    data_loop = out_loop.data if hasattr(out_loop, "batch_sizes") else out_loop
    g_fast = torch.autograd.grad(data_fast.square().sum(), list(fast.parameters()))
    g_loop = torch.autograd.grad(data_loop.square().sum(), list(loop.parameters()))
    assert_close(g_fast, g_loop, atol=1e-4, rtol=1e-4)


def test_sequences_of_a_batch_share_the_recurrent_mask():
    """What changes statistically: identical sequences get identical recurrent dropout."""
    x = torch.randn(T, 1, I).expand(T, 8, I)
    batch = VariationalLSTM(I, H, dropout_hidden=0.5, mask_scope="batch")
    out, _ = batch(x)
    assert torch.equal(out[:, 0], out[:, 5])
    sequence = VariationalLSTM(I, H, dropout_hidden=0.5)
    sequence.load_state_dict(batch.state_dict())
    out, _ = sequence(x)
    assert not torch.allclose(out[:, 0], out[:, 5])
    # Input and output masks stay per sequence.
    mixed = VariationalLSTM(I, H, dropout_hidden=0.5, dropout_output=0.5, mask_scope="batch")
    out, _ = mixed(x)
    assert not torch.allclose(out[:, 0], out[:, 5])


def test_each_call_draws_a_new_batch_mask_and_the_raw_weight_learns():
    layer = VariationalLSTM(I, H, dropout_hidden=0.5, mask_scope="batch")
    x = torch.randn(T, B, I)
    a, _ = layer(x)
    b, _ = layer(x)
    assert torch.equal(a[0], b[0])  # h_0 = 0: the recurrent mask cannot act at the first step
    assert not torch.allclose(a[1:], b[1:])
    b.sum().backward()
    assert layer.weight_hh_l0.grad.abs().sum() > 0
