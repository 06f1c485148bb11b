"""The fast mode: mask_scope="batch" folds the masks inside the stack (recurrent and between
layers, one per batch) into W_hh / W_ih, and the fused kernel runs every layer in one call."""

import contextlib
import copy
import dataclasses
import threading
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence
from torch.overrides import TorchFunctionMode

from rnndrop import GaussianLSTM, VariationalGRU, VariationalLSTM, flat_weights
from rnndrop.stochastic import noise_per_sequence
from tests.helpers import distinct, flattened, weights_in
from tests.oracle import assert_close, plain_twin

I, H, T, B = 5, 6, 7, 4
ALL_P = dict(dropout=0.3, dropout_input=0.2, dropout_hidden=0.5, dropout_output=0.4)
GRU_CELL = VariationalGRU._cell


@pytest.fixture(autouse=True)
def gru_folds_on_cpu(monkeypatch):
    """These tests are about folding masks into the weights, which the GRU does on CUDA: here it
    folds on the CPU too (by default it runs the compiled loop kernel there; tested below)."""
    monkeypatch.setattr(VariationalGRU, "_cell", dataclasses.replace(GRU_CELL, fused_on_cpu=True))


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
    """Layer by layer with nn.LSTM / nn.GRU: the first input masked per sequence, the later
    inputs by the batch's mask, W_hh's columns multiplied by the batch's recurrent mask, output
    masked per sequence."""
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    states = hx if kind == "lstm" else (hx,)
    finals = []
    inp = x
    for k in range(layer.num_layers):
        if masks.inputs[k] is not None:
            inp = inp * masks.inputs[k]  # [B or 1, size] broadcast over time
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
    assert all(m.shape == (1, H) for m in masks.inputs[1:])  # one between-layer mask for the batch
    assert masks.inputs[0].shape == (B, I) and masks.output.shape == (B, H)  # per sequence
    x = torch.randn(T, B, I)
    hx = (torch.randn(3, B, H), torch.randn(3, B, H)) if kind == "lstm" else torch.randn(3, B, H)
    with FusedCalls() as mode:
        out, state = layer(x, hx, masks=masks)
    assert mode.calls == [torch.lstm if kind == "lstm" else torch.gru]  # fused, every layer at once
    expected_out, expected_state = _by_hand(kind, layer, masks, x, hx)
    assert_close(out, expected_out, atol=1e-6, rtol=1e-6)
    assert_close(state, expected_state, atol=1e-6, rtol=1e-6)


CONFIGS = {
    "2-layers-bidirectional": dict(num_layers=2, bidirectional=True),
    "2-layers-batch-first": dict(num_layers=2, batch_first=True),
    "2-layers-proj": dict(num_layers=2, proj_size=3),
    "1-layer-no-bias": dict(num_layers=1, bias=False),
    "2-layers-per-gate": dict(num_layers=2, per_gate_masks=True),  # not folded: the loop
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
    # So do the masks between layers; the first input and output masks stay per sequence.
    between = VariationalLSTM(I, H, num_layers=2, dropout=0.5, mask_scope="batch")
    out, _ = between(x)
    assert torch.equal(out[:, 0], out[:, 5])
    for outer in (dict(dropout_output=0.5), dict(dropout_input=0.5)):
        mixed = VariationalLSTM(I, H, dropout_hidden=0.5, mask_scope="batch", **outer)
        out, _ = mixed(x)
        assert not torch.allclose(out[:, 0], out[:, 5])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_weights_in_one_buffer_go_to_the_fused_op_as_views_of_a_masked_copy(kind, bidirectional, monkeypatch):
    """Where the stack's weights live in one flat buffer (cuDNN's), the folded weights are views
    of one masked copy of it at the same offsets: same outputs and gradients, parameters
    untouched."""
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    _, plain = _pair(kind, num_layers=3, bidirectional=bidirectional, **ALL_P)
    flat = flattened(copy.deepcopy(plain))
    assert flat_weights.in_one_buffer(flat._flat_weights)
    assert not flat_weights.in_one_buffer(plain._flat_weights)
    masks = plain.sample_masks(B)
    seen = []
    real = flat_weights.masked_in_one_buffer

    def spy(weights, column_masks):
        views = real(weights, column_masks)
        seen.append({v.untyped_storage().data_ptr() for v in views})
        return views

    monkeypatch.setattr(flat_weights, "masked_in_one_buffer", spy)
    before = [p.detach().clone() for p in flat.parameters()]
    x = torch.randn(T, B, I)
    out, _ = flat(x, masks=masks)
    expected, _ = plain(x, masks=masks)
    assert len(seen) == 1 and len(seen[0]) == 1  # one call, one buffer
    assert_close(out, expected, atol=1e-6, rtol=1e-6)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(flat.parameters()), d_out)
    assert_close(grads, torch.autograd.grad(expected, list(plain.parameters()), d_out))
    assert all(torch.equal(a, b) for a, b in zip(before, flat.parameters()))


def test_only_the_weights_of_a_larger_buffer_are_copied(monkeypatch):
    """Weights inside a larger buffer (a whole model's flat parameters), close together or spread
    apart: the copy holds the weights alone, packed in storage order from offset 0, with the same
    results."""
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    plain = VariationalLSTM(I, H, num_layers=2, mask_scope="batch", dropout=0.3, dropout_hidden=0.3)
    sizes = [w.numel() for w in plain._flat_weights]
    total = sum(sizes)
    close = weights_in(copy.deepcopy(plain), torch.zeros(10 * total), [5 * total + sum(sizes[:k])
                                                                        for k in range(len(sizes))])
    apart = weights_in(copy.deepcopy(plain), torch.zeros(10 * total), [k * total for k in range(len(sizes))])
    masks = plain.sample_masks(B)
    x = torch.randn(T, B, I)
    expected = plain(x, masks=masks)[0]
    for layer in (close, apart):
        assert flat_weights.in_one_buffer(layer._flat_weights)
        views = flat_weights.masked_in_one_buffer(layer._flat_weights, [None] * len(sizes))
        assert views[0].untyped_storage().nbytes() == total * 4
        assert [v.storage_offset() for v in views] == [sum(sizes[:k]) for k in range(len(sizes))]
        assert all(torch.equal(v, w) for v, w in zip(views, layer._flat_weights))
        assert_close(layer(x, masks=masks)[0], expected)


def test_overlapping_or_strided_weights_are_not_taken_as_one_buffer(monkeypatch):
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    storage = torch.zeros(100)
    assert flat_weights.in_one_buffer([storage[0:20].view(4, 5), storage[20:30]])
    assert not flat_weights.in_one_buffer([storage[0:20].view(4, 5), storage[15:30]])  # overlap
    assert not flat_weights.in_one_buffer([storage[0:20].view(4, 5).t(), storage[20:30]])  # strided
    assert not flat_weights.in_one_buffer([storage[0:20], torch.zeros(10)])  # two storages


def test_a_layer_is_laid_out_alone_as_cudnn_lays_out_a_one_layer_buffer(monkeypatch):
    """cuDNN lays a stack out as every matrix, then every bias; a layer called alone wants its
    matrices, then its biases, side by side from offset 0. A whole module's buffer (one run from
    offset 0) is used as it is."""
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    stack = flattened(nn.LSTM(I, H, num_layers=2, bidirectional=True))
    for layer in range(2):
        names = [n for n in stack._flat_weights_names if f"_l{layer}" in n]
        weights = [getattr(stack, n) for n in names]
        alone = flat_weights.masked_weights(weights, [None] * len(weights))
        matrices = [v for v in alone if v.dim() == 2]
        biases = [v for v in alone if v.dim() == 1]
        offsets = [v.storage_offset() for v in matrices + biases]
        sizes = [v.numel() for v in matrices + biases]
        assert offsets == [sum(sizes[:k]) for k in range(len(sizes))]
        assert all(torch.equal(v, w) for v, w in zip(alone, weights))
    own = nn.LSTM(I, H)
    sizes = [w.numel() for w in own._flat_weights]
    one = weights_in(own, torch.zeros(sum(sizes)), [0, sizes[0], sizes[0] + sizes[1], sum(sizes[:3])])
    alone = flat_weights.masked_weights(one._flat_weights, [None] * len(sizes))
    assert all(a is b for a, b in zip(alone, one._flat_weights))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_every_layer_called_alone_gets_a_buffer_of_its_own(kind, monkeypatch):
    """A layer without a recurrent mask runs alone through the fused op (here: masks between layers
    per step); its matrices and biases, apart in the stack's buffer, go in as views of a copy of
    them side by side from offset 0: the same outputs and gradients."""
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    cls = VariationalLSTM if kind == "lstm" else VariationalGRU
    plain = cls(I, H, num_layers=3, bidirectional=True, mask_scope="step", dropout=0.3, dropout_output=0.2)
    flat = flattened(copy.deepcopy(plain))
    copied = []
    real = flat_weights.masked_in_one_buffer

    def spy(weights, masks):
        views = real(weights, masks)
        buffer = views[0].untyped_storage()
        copied.append((weights[0].storage_offset(), views[0].storage_offset(), buffer.nbytes()))
        return views

    monkeypatch.setattr(flat_weights, "masked_in_one_buffer", spy)
    masks = plain.sample_masks(B, T)
    x = torch.randn(T, B, I)
    out, expected = flat(x, masks=masks)[0], plain(x, masks=masks)[0]
    firsts = [getattr(flat, f"weight_ih_l{k}").storage_offset() for k in range(3)]
    sizes = [sum(w.numel() for n, w in flat.named_parameters() if f"_l{k}" in n) for k in range(3)]
    assert copied == [(first, 0, 4 * size) for first, size in zip(firsts, sizes)]
    assert_close(out, expected)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(flat.parameters()), d_out)
    assert_close(grads, torch.autograd.grad(expected, list(plain.parameters()), d_out))


def test_learned_noise_folded_into_one_buffer_gets_its_gradient(monkeypatch):
    """Gaussian noise of learned variance is a differentiable mask: folded into the weights'
    views, log alpha gets the gradient it gets when the weights are multiplied."""
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    torch.manual_seed(0)
    plain = GaussianLSTM(I, H, num_layers=2, dropout=0.3, dropout_hidden=0.3, mask_scope="batch")
    flat = flattened(copy.deepcopy(plain))
    x = torch.randn(T, B, I)
    outs = []
    for layer in (plain, flat):
        torch.manual_seed(1)
        outs.append(layer(x)[0])
    assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)
    alphas = [[p for n, p in layer.named_parameters() if "log_alpha" in n] for layer in (plain, flat)]
    assert len(alphas[0]) == 3  # between layers, hidden of both layers
    d_out = torch.randn_like(outs[0])
    expected, got = (torch.autograd.grad(out, a, d_out) for out, a in zip(outs, alphas))
    assert all(g.abs().sum() > 0 for g in expected)
    assert_close(got, expected)


def test_each_call_draws_a_new_batch_mask_and_the_raw_weight_learns():
    layer = VariationalLSTM(I, H, dropout_hidden=0.5, mask_scope="batch")
    x = torch.randn(T, B, I)
    a, _ = layer(x)
    b, _ = layer(x)
    assert torch.equal(a[0], b[0])  # h_0 = 0: the recurrent mask cannot act at the first step
    assert not torch.allclose(a[1:], b[1:])
    b.sum().backward()
    assert layer.weight_hh_l0.grad.abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("sizes", [(8, 16), (7, 13)])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("scope", ["batch", "step"])
def test_on_cuda_the_fused_calls_run_cudnn_without_compacting_the_weights(kind, sizes, bidirectional, scope,
                                                                         monkeypatch):
    """cuDNN took the views as its weight buffer (the folded stack's, each layer's alone): no
    'not part of single contiguous chunk' warning once the layer's own silencing of it is taken
    away, odd sizes too."""
    monkeypatch.setattr("rnndrop.recurrent.quiet_weight_compaction", lambda device: contextlib.nullcontext())
    hidden = 0.5 if scope == "batch" else 0.0  # "step" without a recurrent mask: layer by layer
    cls = VariationalLSTM if kind == "lstm" else VariationalGRU
    layer = cls(sizes[0], sizes[1], num_layers=3, bidirectional=bidirectional, mask_scope=scope,
                dropout=0.3, dropout_hidden=hidden).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = layer(torch.randn(5, 3, sizes[0], device="cuda"))
        out.sum().backward()
    assert layer.weight_hh_l2.grad.abs().sum() > 0


def test_monte_carlo_knows_which_batch_scoped_stacks_share_noise_across_the_batch():
    """Copies of an input in one batch share a draw when a mask inside the stack is one for the
    batch (Monte-Carlo sampling then loops): recurrent or between layers, not the outer ones."""
    def shares(**kw):
        return VariationalLSTM(I, H, mask_scope="batch", **kw).shares_noise_across_batch()

    assert shares(dropout_hidden=0.3) and shares(num_layers=2, dropout=0.3)
    assert not shares(dropout_input=0.3, dropout_output=0.3)
    assert not shares(num_layers=1, dropout=0.0, dropout_input=0.2)


@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
@pytest.mark.parametrize("per_gate", [False, True])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_masks_drawn_per_sequence_when_asked_give_each_row_its_own(cls, per_gate, bidirectional):
    """Inside ``noise_per_sequence`` (Monte-Carlo samples stacked in one batch) the masks a batch
    shares are drawn for each sequence: copies of one sequence, packed in any order too, get
    outputs of their own; outside it they share them. Only the masks inside the stack are shared."""
    torch.manual_seed(21)
    layer = cls(I, H, num_layers=2, dropout=0.5, dropout_hidden=0.5, mask_scope="batch",
                per_gate_masks=per_gate, bidirectional=bidirectional)
    assert layer.switches_to_noise_per_sequence()
    same = torch.randn(T, 1, I).expand(T, 6, I).contiguous()
    packed = pack_sequence([same[:, 0]] * 3 + [same[:4, 0]] * 3, enforce_sorted=False)
    with torch.no_grad():
        shared = layer(same)[0]
        with noise_per_sequence(layer):
            apart = layer(same)[0]
            apart_packed = nn.utils.rnn.pad_packed_sequence(layer(packed)[0])[0]
        again = layer(same)[0]  # the setting ends with the block
    for b in range(6):  # one mask: equal rows, to the rounding of products blocked by rows (AVX-512)
        torch.testing.assert_close(shared[:, b], shared[:, 0], rtol=0, atol=1e-6)
        torch.testing.assert_close(again[:, b], again[:, 0], rtol=0, atol=1e-6)
    assert distinct(apart, 1) == 6 and distinct(apart_packed, 1) == 6
    assert all((apart[:, b] - apart[:, 0]).abs().max() > 1e-3 for b in range(1, 6))  # masks, not rounding


def test_drawing_per_sequence_is_each_module_s_switch_seen_by_threads_and_replicas():
    """``noise_per_sequence(model)`` sets a switch on the model's modules for the block, as their
    training mode is set: a call from another thread (``nn.DataParallel`` runs its replicas in
    threads) and a copy of the module's attributes (what ``nn.DataParallel``'s replicas are) see it; after
    the block, or an error in it, the modules draw as before."""
    torch.manual_seed(22)
    layer = VariationalLSTM(I, H, dropout_hidden=0.5, mask_scope="batch")
    model = nn.Sequential(layer)
    same = torch.randn(T, 1, I).expand(T, 6, I).contiguous()

    def rows_apart(module):
        with torch.no_grad():
            out = module(same)[0]
        return distinct(out, 1)

    results = []
    with noise_per_sequence(model) as given:
        assert given is model
        thread = threading.Thread(target=lambda: results.append(rows_apart(layer)))
        thread.start()
        thread.join()
        results.append(rows_apart(copy.copy(layer)))  # its attributes copied, as a replica's are
    assert results == [6, 6]
    assert rows_apart(layer) == 1
    with pytest.raises(RuntimeError, match="inside"), noise_per_sequence(model):
        raise RuntimeError("inside")
    assert rows_apart(layer) == 1 and "_noise_per_sequence" not in layer.__dict__
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"), noise_per_sequence("lstm"):
        pass


@pytest.mark.parametrize("scope", ["batch", "step"])
@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
def test_on_the_cpu_the_gru_runs_its_masked_calls_on_the_compiled_loop_kernel(cls, scope, monkeypatch):
    """On the CPU oneDNN's GRU is slower than the compiled loop kernel: ``kernel="auto"`` runs a
    GRU's calls with masks there on that kernel (no fused call: batch-shared masks not folded,
    layers of naive dropout without a recurrent mask not fused), with the fused path's results;
    the LSTM, which oneDNN runs about as fast, keeps the fused op (one call folded, or one a layer)."""
    monkeypatch.setattr(VariationalGRU, "_cell", GRU_CELL)  # the default rule, not the fixture's
    torch.manual_seed(23)
    probs = ALL_P if scope == "batch" else dict(dropout=0.3, dropout_input=0.2, dropout_output=0.4)
    layer = cls(I, H, num_layers=2, **probs, mask_scope=scope)
    fused = copy.deepcopy(layer)
    monkeypatch.setattr(fused, "_fuses", lambda x: True)
    masks = layer.sample_masks(B, T)
    x = torch.randn(T, B, I, requires_grad=True)
    with FusedCalls() as mode:
        out, state = layer(x, masks=masks)
    fused_calls = 1 if scope == "batch" else 2
    assert mode.calls == ([torch.lstm] * fused_calls if cls is VariationalLSTM else [])
    expected, expected_state = fused(x, masks=masks)
    assert_close(out, expected)
    assert_close(state, expected_state)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], d_out)
    assert_close(grads, torch.autograd.grad(expected, [x, *fused.parameters()], d_out), atol=1e-5, rtol=1e-5)
