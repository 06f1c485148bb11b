"""WeightDrop: DropConnect on the weights of nn.LSTM / nn.GRU / VariationalLSTM / any module."""

import copy
import os
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

from rnndrop import VariationalLSTM, VariationalLSTMCell, WeightDrop, flat_weights
from rnndrop.stochastic import Stochastic
from tests.helpers import assert_close, flattened

I, H, T, B = 4, 6, 5, 3


def _lstm(**kw):
    return nn.LSTM(I, H, **kw)


def _with_weight(module, name, weight):
    """A copy of module whose parameter ``name`` holds ``weight``."""
    clone = copy.deepcopy(module)
    with torch.no_grad():
        clone.get_parameter(name).copy_(weight)
    return clone


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_first_step_is_untouched_and_later_steps_change(cls):
    """h_0 = 0, so W_hh cannot matter at the first step (awd-lstm-lm's own check)."""
    wd = WeightDrop(cls(I, H), ["weight_hh_l0"], p=0.9)
    x = torch.randn(T, B, I)
    plain, _ = wd.module(x)
    a, _ = wd(x)
    b, _ = wd(x)
    assert torch.equal(a[0], plain[0]) and torch.equal(b[0], plain[0])
    assert not torch.allclose(a[1:], plain[1:])
    assert not torch.allclose(a[1:], b[1:])  # a fresh mask per call


def test_dropconnect_equals_the_module_with_the_masked_weight():
    wd = WeightDrop(_lstm(num_layers=2), ["weight_hh_l0", "weight_hh_l1"], p=0.5)
    masks = wd.sample_masks()
    assert set(masks) == {"weight_hh_l0", "weight_hh_l1"}
    assert masks["weight_hh_l0"].shape == (4 * H, H)
    assert set(masks["weight_hh_l0"].unique().tolist()) == {0.0, 2.0}
    ref = wd.module
    for name, m in masks.items():
        ref = _with_weight(ref, name, wd.module.get_parameter(name) * m)
    x = torch.randn(T, B, I)
    assert_close(wd.forward_with_masks(masks, x), ref(x), atol=0, rtol=0)


def test_gradient_reaches_the_raw_weight_through_the_mask():
    wd = WeightDrop(_lstm(), "weight_hh_l0", p=0.5)
    masks = wd.sample_masks()
    out, (_, c) = wd.forward_with_masks(masks, torch.randn(T, B, I))
    (out.sum() + c.sum()).backward()
    grad = wd.module.weight_hh_l0.grad
    dropped = masks["weight_hh_l0"] == 0
    assert torch.all(grad[dropped] == 0)
    assert grad[~dropped].abs().min() > 0
    assert [n for n, _ in wd.named_parameters()] == [f"module.{n}" for n, _ in _lstm().named_parameters()]


def test_eval_mode_and_p_zero_equal_the_module():
    lstm = _lstm(num_layers=2)
    ref = copy.deepcopy(lstm)
    x = torch.randn(T, B, I)
    wd = WeightDrop(lstm, ["weight_hh_l0", "weight_hh_l1"], p=0.5).eval()
    assert_close(wd(x), ref(x), atol=0, rtol=0)
    off = WeightDrop(copy.deepcopy(ref), "weight_hh_l0", p=0.0)
    assert_close(off(x), ref(x), atol=0, rtol=0)
    assert isinstance(wd, Stochastic) and wd.is_stochastic() and not off.is_stochastic()


def test_variational_mode_is_a_per_batch_recurrent_mask():
    """Dropping columns of W_hh = one mask on h_{t-1} for the whole batch (cells by hand)."""
    lstm = _lstm(dtype=torch.float64)
    wd = WeightDrop(lstm, "weight_hh_l0", p=0.5, variational=True)
    masks = wd.sample_masks()
    mask = masks["weight_hh_l0"]
    assert mask.shape == (1, H)
    x = torch.randn(T, B, I, dtype=torch.float64)
    out, (h_n, c_n) = wd.forward_with_masks(masks, x)

    cell = VariationalLSTMCell(I, H, dtype=torch.float64)
    cell.load_state_dict({k[:-3]: v for k, v in lstm.state_dict().items()})  # weight_ih_l0 -> weight_ih
    state = None
    steps = []
    for t in range(T):
        state = cell(x[t], state, hidden_mask=mask.expand(B, H))
        steps.append(state[0])
    assert_close(out, torch.stack(steps), atol=1e-12, rtol=1e-12)
    assert_close((h_n[0], c_n[0]), state, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("variational", [False, True])
def test_sample_masks_draws_from_the_generator_given(variational):
    wd = WeightDrop(_lstm(), "weight_hh_l0", p=0.5, variational=variational)
    first = wd.sample_masks(generator=torch.Generator().manual_seed(3))["weight_hh_l0"]
    torch.manual_seed(99)  # the global generator plays no part
    assert torch.equal(first, wd.sample_masks(generator=torch.Generator().manual_seed(3))["weight_hh_l0"])
    assert not torch.equal(first, wd.sample_masks(generator=torch.Generator().manual_seed(4))["weight_hh_l0"])


def test_wraps_variational_lstm_together_with_its_own_masks():
    layer = VariationalLSTM(I, H, num_layers=2, dropout=0.3, dropout_input=0.3, dropout_output=0.3)
    wd = WeightDrop(layer, ["weight_hh_l0", "weight_hh_l1"], p=0.5)
    masks = wd.sample_masks()
    layer_masks = layer.sample_masks(B)
    ref = layer
    for name, m in masks.items():
        ref = _with_weight(ref, name, layer.get_parameter(name) * m)
    x = torch.randn(T, B, I)
    assert_close(wd.forward_with_masks(masks, x, None, layer_masks), ref(x, masks=layer_masks))
    # the layer's own keyword passes through (WeightDrop's masks are positional only)
    assert_close(wd.forward_with_masks(masks, x, masks=layer_masks), ref(x, masks=layer_masks))
    out, _ = wd(x)  # training: both kinds of masks drawn
    assert out.shape == (T, B, H)


def test_packed_input_and_hx_pass_through():
    wd = WeightDrop(nn.GRU(I, H, batch_first=True), "weight_hh_l0", p=0.5)
    masks = wd.sample_masks()
    ref = _with_weight(wd.module, "weight_hh_l0", wd.module.weight_hh_l0 * masks["weight_hh_l0"])
    packed = pack_sequence([torch.randn(n, I) for n in (2, 5, 3)], enforce_sorted=False)
    h0 = torch.randn(1, 3, H)
    assert_close(wd.forward_with_masks(masks, packed, h0), ref(packed, h0), atol=0, rtol=0)


def test_any_module_with_a_weight_linear_dropconnect():
    lin = nn.Linear(5, 3)
    wd = WeightDrop(lin, "weight", p=0.5, variational=True)
    masks = wd.sample_masks()
    x = torch.randn(7, 5)
    # Dropping columns of W is input dropout with one mask for the batch.
    assert_close(wd.forward_with_masks(masks, x), lin(x * masks["weight"]))


def test_deepcopy_to_float64_and_no_warnings():
    wd = WeightDrop(_lstm(num_layers=2), ["weight_hh_l0", "weight_hh_l1"], p=0.5)
    twin = copy.deepcopy(wd)
    assert twin.module.weight_hh_l0 is not wd.module.weight_hh_l0
    x = torch.randn(T, B, I)
    wd.eval(), twin.eval()
    assert_close(twin(x), wd(x), atol=0, rtol=0)
    twin.train().to(torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = twin(x.double())
        out.sum().backward()
        twin.eval()(x.double())
    assert out.dtype == torch.float64
    assert twin.module.weight_hh_l1.grad.dtype == torch.float64
    assert wd.module.weight_hh_l1.grad is None


def test_state_dict_round_trips_and_loads_plain_lstm_checkpoints():
    wd = WeightDrop(_lstm(num_layers=2), ["weight_hh_l0"], p=0.5)
    plain = _lstm(num_layers=2)
    assert list(wd.state_dict()) == [f"module.{k}" for k in plain.state_dict()]

    wd.load_state_dict(plain.state_dict())  # bare nn.LSTM keys
    for k, v in plain.state_dict().items():
        assert torch.equal(wd.module.state_dict()[k], v)
    other = WeightDrop(_lstm(num_layers=2), ["weight_hh_l0"], p=0.5)
    other.load_state_dict(wd.state_dict())  # own keys
    fresh = _lstm(num_layers=2)
    fresh.load_state_dict(other.module.state_dict())  # and back to nn.LSTM
    x = torch.randn(T, B, I)
    assert_close(other.eval()(x), plain(x), atol=0, rtol=0)
    assert_close(fresh(x), plain(x), atol=0, rtol=0)

    # Nested in a model: keys under the model's prefix, both spellings.
    model = nn.Sequential(WeightDrop(_lstm(), "weight_hh_l0"))
    model.load_state_dict({f"0.{k}": v for k, v in _lstm().state_dict().items()})
    with pytest.raises(RuntimeError, match="Missing key"):
        WeightDrop(_lstm(num_layers=2)).load_state_dict(_lstm().state_dict())


@pytest.mark.slow
def test_works_under_torch_compile():
    torch._dynamo.reset()
    wd = WeightDrop(nn.LSTM(2, 3), "weight_hh_l0", p=0.9)
    compiled = torch.compile(wd)
    x = torch.randn(4, 2, 2)
    plain, _ = wd.module(x)
    out, _ = compiled(x)
    assert torch.allclose(out[0], plain[0], atol=1e-6)
    assert not torch.allclose(out[1:], plain[1:], atol=1e-3)
    out.sum().backward()
    assert wd.module.weight_hh_l0.grad is not None and wd.module.weight_hh_l0.grad.abs().sum() > 0
    wd.eval()
    assert_close(compiled(x), wd.module(x))


def test_a_tied_weight_named_by_its_second_name_says_which_name_drops_it():
    """Weight tying (``decoder.weight = embedding.weight``): named_parameters() lists the shared
    parameter once, so its second name read "has no parameter" beside a model that has it."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight
    tied = r"'1.weight' is tied to '0.weight' \(one parameter\): name '0.weight'"
    with pytest.raises(ValueError, match=tied):
        WeightDrop(model, ["1.weight"], p=0.5)
    WeightDrop(model, ["0.weight"], p=0.5)


def test_clear_errors():
    no_such = r"LSTM has no parameter 'weight_hh'; its parameters are weight_ih_l0, "
    with pytest.raises(ValueError, match=no_such):
        WeightDrop(_lstm(), "weight_hh")
    with pytest.raises(ValueError, match=r"no parameter 'weight_hh_l1'.*weight_hh_l0"):
        WeightDrop(_lstm(), ["weight_hh_l1"])
    with pytest.raises(ValueError, match="p must be a probability in"):
        WeightDrop(_lstm(), p=1.0)
    with pytest.raises(TypeError, match="p must be a float"):
        WeightDrop(_lstm(), p="0.5")
    with pytest.raises(ValueError, match=r"'bias_hh_l0' has shape \[24\]"):
        WeightDrop(_lstm(), "bias_hh_l0", variational=True)
    with pytest.raises(ValueError, match="at least one parameter"):
        WeightDrop(_lstm(), [])
    with pytest.raises(ValueError, match="must not repeat"):
        WeightDrop(_lstm(), ["weight_hh_l0", "weight_hh_l0"])
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        WeightDrop(torch.randn(3), "weight")
    wd = WeightDrop(_lstm(), "weight_hh_l0")
    with pytest.raises(ValueError, match=r"\['weight_ih_l0'\] are not among the dropped weights"):
        wd.forward_with_masks({"weight_ih_l0": torch.ones(4 * H, I)}, torch.randn(T, B, I))


@pytest.mark.parametrize(
    ("variational", "shape"),
    [(False, (24, 1)), (False, (1, 6)), (True, (24, 6)), (True, (6,))],
    ids=["column-for-weight", "row-for-weight", "weight-for-columns", "1-d"],
)
def test_masks_must_have_the_exact_shape(variational, shape):
    wd = WeightDrop(_lstm(), "weight_hh_l0", p=0.5, variational=variational)
    expected = r"\[1, 6\]" if variational else r"\[24, 6\]"
    with pytest.raises(ValueError, match=rf"masks\['weight_hh_l0'\] must have shape {expected}"):
        wd.forward_with_masks({"weight_hh_l0": torch.ones(shape)}, torch.randn(T, B, I))


def test_masks_must_have_the_weights_dtype():
    wd = WeightDrop(_lstm(), "weight_hh_l0", p=0.5)
    with pytest.raises(TypeError, match="must have the weight 'weight_hh_l0''s dtype"):
        wd.forward_with_masks({"weight_hh_l0": torch.ones(24, 6, dtype=torch.float64)}, torch.randn(T, B, I))


def test_a_weight_dropped_twice_is_refused_at_construction():
    inner = WeightDrop(_lstm(), "weight_hh_l0", p=0.5)
    with pytest.raises(ValueError, match=r"'module.weight_hh_l0' is already dropped by the WeightDrop"):
        WeightDrop(inner, "module.weight_hh_l0", p=0.5)
    outer = WeightDrop(inner, "module.weight_ih_l0", p=0.5)  # another weight: fine
    out, _ = outer(torch.randn(T, B, I))
    assert out.shape == (T, B, H)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("variational", [False, True])
def test_a_flattened_rnn_gets_its_masked_weights_as_views_of_one_buffer_with_the_same_results(
    cls, variational, monkeypatch
):
    """On a flattened cuDNN RNN every weight goes in as a view of a copy of the module's buffer at
    its own offset, the dropped ones multiplied there (cuDNN then copies nothing): the same
    outputs and gradients as multiplying the weights, the module's own weights untouched."""
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    torch.manual_seed(0)
    flat = flattened(cls(5, 6, 2))
    plain = cls(5, 6, 2)
    plain.load_state_dict(flat.state_dict())
    assert flat_weights.shares_one_buffer(flat) and not flat_weights.shares_one_buffer(plain)
    names = ["weight_hh_l0", "weight_hh_l1"]
    ours, theirs = (WeightDrop(m, names, p=0.5, variational=variational) for m in (flat, plain))
    masks = ours.sample_masks()
    views = flat_weights.masked_views(flat, masks)
    storage = {v.untyped_storage().data_ptr() for v in views.values()}
    assert len(storage) == 1 and storage != {flat.weight_ih_l0.untyped_storage().data_ptr()}
    start = flat.weight_ih_l0.storage_offset()  # the copy starts at the first weight
    assert all(v.storage_offset() == getattr(flat, n).storage_offset() - start for n, v in views.items())
    before = [p.detach().clone() for p in flat.parameters()]
    x = torch.randn(4, 3, 5)
    out, _ = ours.forward_with_masks(masks, x)
    expected, _ = theirs.forward_with_masks(masks, x)
    assert torch.allclose(out, expected, atol=1e-6)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(flat.parameters()), d_out)
    expected_grads = torch.autograd.grad(expected, list(plain.parameters()), d_out)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, expected_grads))
    assert all(torch.equal(a, b) for a, b in zip(before, flat.parameters()))


def test_only_a_plain_flattened_rnn_outside_autocast_takes_the_views(monkeypatch):
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda", "cpu"})
    assert flat_weights.shares_one_buffer(flattened(nn.GRU(3, 4)))
    assert not flat_weights.shares_one_buffer(VariationalLSTM(3, 4))  # its own forward pass
    assert not flat_weights.shares_one_buffer(nn.Linear(3, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not flat_weights.shares_one_buffer(flattened(nn.GRU(3, 4)))
    monkeypatch.setattr(flat_weights, "FLAT_DEVICES", {"cuda"})
    assert not flat_weights.shares_one_buffer(flattened(nn.GRU(3, 4)))  # CPU RNNs need no buffer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
def test_on_cuda_weight_drop_runs_cudnn_without_compacting_the_weights():
    """No 'not part of single contiguous chunk' warning: cuDNN took the views as its buffer."""
    wd = WeightDrop(nn.LSTM(8, 16, 2).cuda(), ["weight_hh_l0", "weight_hh_l1"], p=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, _ = wd(torch.randn(5, 3, 8, device="cuda"))
        out.sum().backward()


@pytest.mark.parametrize("inner", ["nn.LSTM", "VariationalLSTM"])
def test_calls_from_several_threads_give_what_each_gives_alone(inner):
    """torch.func.functional_call puts the dropped weights into the wrapped module for a call's
    length: two threads' calls read, and put back, each other's (outputs of another mask, and a
    Parameter left replaced by a masked tensor for good). A torch RNN is now given its weights, a
    wrapped rnndrop layer's calls take turns."""
    import threading

    from rnndrop import VariationalLSTM

    torch.manual_seed(0)
    lstm = nn.LSTM(6, 8) if inner == "nn.LSTM" else VariationalLSTM(6, 8)
    wd = WeightDrop(lstm, ["weight_hh_l0"], p=0.5).eval()
    x = torch.randn(5, 3, 6)
    masks = [wd.sample_masks() for _ in range(2)]
    with torch.no_grad():
        alone = [wd.forward_with_masks(m, x)[0] for m in masks]
        plain = wd(x)[0]
    wrong = []

    def calls(k):
        with torch.no_grad():
            for _ in range(150):
                out = wd.forward_with_masks(masks[k], x)[0] if k < 2 else wd(x)[0]
                wrong.append(not torch.equal(out, alone[k] if k < 2 else plain))

    threads = [threading.Thread(target=calls, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not any(wrong)
    assert isinstance(lstm._parameters["weight_hh_l0"], nn.Parameter)
    with torch.no_grad():
        assert torch.equal(wd(x)[0], plain)


def test_a_traced_call_takes_no_lock_and_a_subclass_keeps_its_forward():
    """torch.compile cannot enter a lock (a graph break, an error with fullgraph): a traced call
    puts nothing in place and takes none. An nn.LSTM subclass's own forward runs in training too
    (torch's op given the weights serves torch's own RNN classes alone)."""
    wd = WeightDrop(nn.Linear(4, 4), "weight", p=0.5)
    compiled = torch.compile(wd, backend="eager", fullgraph=True)
    for mode in (True, False):
        wd.train(mode)
        assert compiled(torch.randn(3, 4)).shape == (3, 4)

    class Sevens(nn.LSTM):
        def forward(self, x, hx=None):
            out, state = super().forward(x, hx)
            return out * 0 + 7, state

    subclassed = WeightDrop(Sevens(3, 3), ["weight_hh_l0"], p=0.5).train()
    assert torch.equal(subclassed(torch.randn(4, 2, 3))[0], torch.full((4, 2, 3), 7.0))


def test_a_module_pickled_before_its_settings_were_checked_still_loads():
    """Modules saved whole before WeightDrop / LockedDropout / EmbeddingDropout checked ``p`` when
    set hold it under ``p`` alone."""
    import pickle

    wd = WeightDrop(nn.LSTM(3, 3), ["weight_hh_l0"], p=0.3)
    del wd.__dict__["_checked_p"]
    old = pickle.loads(pickle.dumps(wd))
    assert old.p == 0.3 and old(torch.randn(2, 1, 3))[0].shape == (2, 1, 3)
    assert not hasattr(WeightDrop.__new__(WeightDrop), "p")  # (an AttributeError, not a KeyError)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_child_forked_while_a_call_held_the_lock_can_call():
    """A lock a parent's thread held at the fork stays held in the child for good."""
    import signal
    import threading

    from rnndrop import VariationalLSTM

    wd = WeightDrop(VariationalLSTM(3, 3), ["weight_hh_l0"], p=0.5)
    inside, done = threading.Event(), threading.Event()

    def a_call_in_another_thread():
        with wd._swaps(False):
            inside.set()
            done.wait(30)

    other = threading.Thread(target=a_call_in_another_thread)
    other.start()
    inside.wait(30)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)  # a child that would wait for good is ended, and the parent reads nothing
        free = wd._swaps(False).acquire(blocking=False)
        os.write(write, b"1" if free else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    done.set()
    other.join()
    assert answer == b"1"
