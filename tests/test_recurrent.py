"""VariationalLSTM / VariationalGRU against the oracle nn.LSTM / nn.GRU, and their masks."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from rnndrop import (
    EmbeddingDropout,
    LockedDropout,
    RecurrentMasks,
    VariationalGRU,
    VariationalGRUCell,
    VariationalLSTM,
    VariationalLSTMCell,
    WeightDrop,
)
from rnndrop.kernels import KERNELS
from tests.oracle import assert_close, check_against_oracle, plain_twin, random_state

I, H, T, B = 5, 6, 7, 4
# The kernels that run on CPU tensors ("triton" runs on CUDA: tests/test_triton_kernel.py).
CPU_KERNELS = [name for name in KERNELS if name != "triton"]
KERNEL_NAMES = ["auto", *CPU_KERNELS]
KINDS = ["lstm", "gru"]
ALL_P = dict(dropout=0.4, dropout_input=0.3, dropout_hidden=0.5, dropout_output=0.2)

CONFIGS = {
    "1-layer": dict(num_layers=1),
    "2-layers": dict(num_layers=2),
    "3-layers-no-bias": dict(num_layers=3, bias=False),
    "2-layers-bidirectional": dict(num_layers=2, bidirectional=True),
    "2-layers-batch-first": dict(num_layers=2, batch_first=True),
    "2-layers-proj": dict(num_layers=2, proj_size=3),
    "2-layers-proj-bidirectional-batch-first": dict(
        num_layers=2, proj_size=3, bidirectional=True, batch_first=True
    ),
}
KIND_CONFIGS = [
    pytest.param(kind, config, id=f"{kind}-{name}")
    for kind in KINDS
    for name, config in CONFIGS.items()
    if kind == "lstm" or "proj_size" not in config
]


def make_pair(kind, dtype=torch.float32, **kw):
    """Our layer and the oracle nn.LSTM/GRU with the same weights: (oracle, ours)."""
    cls = VariationalLSTM if kind == "lstm" else VariationalGRU
    with warnings.catch_warnings():  # dropout with one layer: nn.LSTM's warning, tested below
        warnings.simplefilter("ignore", UserWarning)
        ours = cls(I, H, dtype=dtype, **kw)
    return plain_twin(ours), ours


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize(("kind", "config"), KIND_CONFIGS)
def test_zero_dropout_matches_oracle_in_every_configuration(kind, config, kernel):
    ref, ours = make_pair(kind, kernel=kernel, **config)
    shape = (B, T, I) if config.get("batch_first") else (T, B, I)
    x = torch.randn(*shape, requires_grad=True)
    check_against_oracle(ref, ours, x, None)
    check_against_oracle(ref, ours, x, random_state(ours, B))


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize(("kind", "config"), KIND_CONFIGS)
def test_unbatched_and_packed_input_match_oracle(kind, config, kernel):
    ref, ours = make_pair(kind, kernel=kernel, **config)
    x = torch.randn(T, I, requires_grad=True)  # unbatched
    check_against_oracle(ref, ours, x, None)
    check_against_oracle(ref, ours, x, random_state(ours, None))
    lengths = [3, T, 1, 5]  # unsorted
    packed = pack_sequence([torch.randn(n, I) for n in lengths], enforce_sorted=False)
    check_against_oracle(ref, ours, packed, random_state(ours, len(lengths)))


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_float64_matches_oracle(kind, kernel):
    ref, ours = make_pair(kind, dtype=torch.float64, kernel=kernel, num_layers=2, bidirectional=True)
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    check_against_oracle(ref, ours, x, random_state(ours, B, torch.float64))


@pytest.mark.parametrize("per_gate", [False, True], ids=["shared-mask", "per-gate"])
@pytest.mark.parametrize("scope", ["sequence", "step", "batch"])
@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_masks_of_ones_match_oracle(kind, kernel, scope, per_gate):
    """All mask sites active (so the loop runs) but every mask is 1."""
    config = dict(num_layers=2, bidirectional=True, mask_scope=scope, per_gate_masks=per_gate)
    ref, ours = make_pair(kind, kernel=kernel, **config, **ALL_P)
    masks = ours.sample_masks(B, T).map(torch.ones_like)
    x = torch.randn(T, B, I, requires_grad=True)
    check_against_oracle(ref, ours, x, random_state(ours, B), masks)


@pytest.mark.parametrize(("kind", "config"), KIND_CONFIGS)
def test_eval_mode_is_deterministic_and_matches_oracle(kind, config):
    ref, ours = make_pair(kind, **config, **ALL_P)
    ours.eval()
    ref.eval()
    x = torch.randn(*((B, T, I) if config.get("batch_first") else (T, B, I)), requires_grad=True)
    check_against_oracle(ref, ours, x, None)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_state_dict_interchanges_both_ways(kind):
    ref, ours = make_pair(kind, num_layers=2, bidirectional=True, **ALL_P)
    assert list(ours.state_dict()) == list(ref.state_dict())
    fresh_ref = type(ref)(I, H, num_layers=2, bidirectional=True)
    fresh_ref.load_state_dict(ours.state_dict())
    for (name, a), b in zip(ref.state_dict().items(), fresh_ref.state_dict().values()):
        assert torch.equal(a, b), name
    clone = copy.deepcopy(ours)
    assert clone.dropout_hidden == ours.dropout_hidden
    assert isinstance(ours, nn.LSTM if kind == "lstm" else nn.GRU)


def test_from_module_swaps_an_existing_layer_in_a_model():
    model = nn.Sequential()
    model.rnn = nn.LSTM(I, H, num_layers=2, batch_first=True, dropout=0.25, proj_size=3)
    x = torch.randn(B, T, I)
    before, _ = model.rnn.eval()(x)
    model.rnn = VariationalLSTM.from_module(model.rnn, dropout_hidden=0.3)
    assert model.rnn.dropout == 0.25 and model.rnn.dropout_hidden == 0.3 and model.rnn.proj_size == 3
    assert not model.rnn.training
    assert_close(model.rnn(x)[0], before)
    gru = VariationalGRU.from_module(nn.GRU(I, H, dtype=torch.float64), dropout_input=0.1)
    assert gru.weight_hh_l0.dtype == torch.float64
    with pytest.raises(TypeError, match="module must be an nn.LSTM, got GRU"):
        VariationalLSTM.from_module(nn.GRU(I, H))


# ----------------------------------------------------------------- masks by hand


def _cell_for(kind, layer, suffix="_l0"):
    cell_cls = VariationalLSTMCell if kind == "lstm" else VariationalGRUCell
    cell = cell_cls(getattr(layer, "weight_ih" + suffix).shape[1], layer.hidden_size, bias=layer.bias)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        getattr(cell, name).data.copy_(getattr(layer, name + suffix))
    return cell


def _by_hand(kind, cell, x, in_mask, hid_mask, out_mask, step):
    """One layer, one direction, step by step with the cell: the reference for masks."""
    h = x.new_zeros(x.shape[1], cell.hidden_size)
    state = h if kind == "gru" else (h, h.clone())
    outs = []
    for t in range(x.shape[0]):
        mi = in_mask[t] if step else in_mask
        mh = hid_mask[t] if step else hid_mask
        state = cell(x[t], state, input_mask=mi, hidden_mask=mh)
        h_t = state if kind == "gru" else state[0]
        outs.append(h_t * (out_mask[t] if step else out_mask))
    return torch.stack(outs)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("scope", ["sequence", "step", "batch"])
@pytest.mark.parametrize("per_gate", [False, True])
def test_masks_passed_in_are_the_masks_used(kind, scope, per_gate, kernel):
    _, layer = make_pair(
        kind,
        kernel=kernel,
        mask_scope=scope,
        per_gate_masks=per_gate,
        dropout_input=0.5,
        dropout_hidden=0.5,
        dropout_output=0.5,
    )
    masks = layer.sample_masks(B, T)
    x = torch.randn(T, B, I)
    out, _ = layer(x, masks=masks)
    expected = _by_hand(
        kind, _cell_for(kind, layer), x, masks.inputs[0], masks.hidden[0], masks.output, scope == "step"
    )
    assert_close(out, expected)


def _stack_by_hand(kind, layer, x, masks):
    """A whole stack step by step with the public cells, one per layer and direction, each
    given its masks: what the layer computes. Returns the output and the final states."""
    step = masks.scope == "step"
    D = 2 if layer.bidirectional else 1
    finals = []
    for k in range(layer.num_layers):
        outs = []
        for d in range(D):
            cell = _cell_for(kind, layer, f"_l{k}" + ("_reverse" if d else ""))
            h = x.new_zeros(x.shape[1], layer.hidden_size)
            state = h if kind == "gru" else (h, h.clone())
            in_mask, hid_mask = masks.inputs[k], masks.hidden[k * D + d]
            by_t = [None] * x.shape[0]
            for t in reversed(range(x.shape[0])) if d else range(x.shape[0]):
                state = cell(x[t], state, input_mask=in_mask[t] if step else in_mask,
                             hidden_mask=hid_mask[t] if step else hid_mask)
                by_t[t] = state if kind == "gru" else state[0]
            outs.append(torch.stack(by_t))
            finals.append(state)
        x = torch.cat(outs, -1)
    if kind == "gru":
        return x * masks.output, torch.stack(finals)
    return x * masks.output, (torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals]))


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("per_gate", [False, True], ids=["shared-mask", "per-gate"])
@pytest.mark.parametrize("scope", ["sequence", "step"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_layer_computes_the_public_cells_step_in_every_layer_and_direction(kind, scope, per_gate, kernel):
    """VariationalLSTM / VariationalGRU equal VariationalLSTMCell / VariationalGRUCell run by
    hand over every step, layer and direction with the same weights and masks."""
    _, layer = make_pair(kind, kernel=kernel, num_layers=2, bidirectional=True, mask_scope=scope,
                         per_gate_masks=per_gate, **ALL_P)
    masks = layer.sample_masks(B, T)
    x = torch.randn(T, B, I)
    assert_close(layer(x, masks=masks), _stack_by_hand(kind, layer, x, masks))


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_fresh_masks_are_drawn_by_sample_masks_in_training(kind):
    _, layer = make_pair(kind, num_layers=2, **ALL_P)
    x = torch.randn(T, B, I)
    torch.manual_seed(3)
    auto, _ = layer(x)
    torch.manual_seed(3)
    explicit, _ = layer(x, masks=layer.sample_masks(B, T))
    assert_close(auto, explicit)
    again, _ = layer(x)
    assert not torch.allclose(auto, again), "a new forward call must draw new masks"


@pytest.mark.parametrize("scope", ["sequence", "step"])
@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_use_masks_in_input_batch_order(kind, scope):
    """Each sequence of an unsorted PackedSequence gets the mask of its batch row."""
    _, layer = make_pair(kind, num_layers=2, bidirectional=True, mask_scope=scope, **ALL_P)
    lengths = [3, T, 1, 5]
    seqs = [torch.randn(n, I) for n in lengths]
    masks = layer.sample_masks(len(lengths), T)
    out, state = layer(pack_sequence(seqs, enforce_sorted=False), masks=masks)
    padded, _ = torch.nn.utils.rnn.pad_packed_sequence(out)
    step = scope == "step"
    for b, (seq, n) in enumerate(zip(seqs, lengths)):

        def row(m, b=b, n=n):
            return m[:n, b : b + 1] if step else m[b : b + 1]

        out_b, state_b = layer(seq.unsqueeze(1), masks=masks.map(row))
        assert_close(padded[:n, b], out_b[:, 0], msg=f"sequence {b}")
        for s, s_b in zip(state if kind == "lstm" else (state,), state_b if kind == "lstm" else (state_b,)):
            assert_close(s[:, b], s_b[:, 0], msg=f"sequence {b}")


@pytest.mark.parametrize("scope", ["sequence", "step"])
@pytest.mark.parametrize("kind", KINDS)
def test_fresh_masks_of_a_packed_batch_are_those_sample_masks_gives_in_input_order(kind, scope):
    """With one seed a sequence gets one mask whether the layer draws it or sample_masks does, and
    whether the batch comes packed (unsorted) or padded: the drawn masks are sorted as given ones."""
    _, layer = make_pair(kind, num_layers=2, mask_scope=scope, **ALL_P)
    lengths = [3, T, 1, 5]
    seqs = [torch.randn(n, I) for n in lengths]
    packed = pack_sequence(seqs, enforce_sorted=False)
    torch.manual_seed(5)
    drawn, _ = layer(packed)
    torch.manual_seed(5)
    given, _ = layer(packed, masks=layer.sample_masks(len(lengths), T))
    assert_close(drawn.data, given.data)
    torch.manual_seed(5)
    padded, _ = layer(torch.nn.utils.rnn.pad_sequence(seqs))
    unpacked, _ = torch.nn.utils.rnn.pad_packed_sequence(drawn)
    for b, n in enumerate(lengths):
        assert_close(unpacked[:n, b], padded[:n, b], msg=f"sequence {b}")


def test_sampled_masks_are_tied_over_time_and_differ_between_sequences():
    layer = VariationalLSTM(I, H, num_layers=2, **ALL_P)
    m = layer.sample_masks(64)
    assert m.scope == "sequence"
    assert m.inputs[0].shape == (64, I) and m.hidden[0].shape == (64, H)  # no time dimension
    assert not torch.equal(m.hidden[0][0], m.hidden[0][1])
    assert not torch.equal(layer.sample_masks(64).hidden[0], m.hidden[0])

    step = VariationalLSTM(I, H, dropout_hidden=0.5, mask_scope="step").sample_masks(8, T)
    assert step.hidden[0].shape == (T, 8, H)
    assert not torch.equal(step.hidden[0][0], step.hidden[0][1])

    batch = VariationalLSTM(I, H, dropout_hidden=0.5, dropout_input=0.5, mask_scope="batch")
    bm = batch.sample_masks(8)
    assert bm.hidden[0].shape == (1, H) and bm.inputs[0].shape == (8, I)


def test_identical_sequences_get_different_masks_in_one_batch():
    layer = VariationalLSTM(I, H, dropout_hidden=0.5, dropout_input=0.5)
    x = torch.randn(T, 1, I).expand(T, 8, I)
    out, _ = layer(x)
    assert not torch.allclose(out[:, 0], out[:, 1])


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
def test_sampled_masks_preserve_the_expected_value(p):
    layer = VariationalLSTM(I, 500, dropout_hidden=p)
    m = layer.sample_masks(400).hidden[0]
    values = torch.unique(m)
    assert len(values) == 2 and values[0] == 0
    assert values[1].item() == pytest.approx(1 / (1 - p))
    assert m.mean().item() == pytest.approx(1.0, abs=0.02)
    assert (m == 0).float().mean().item() == pytest.approx(p, abs=0.01)


def test_gaussian_noise_masks_have_mean_one_and_the_dropout_variance():
    p = 0.5
    m = VariationalLSTM(I, 500, dropout_hidden=p, noise="gaussian").sample_masks(400).hidden[0]
    assert m.mean().item() == pytest.approx(1.0, abs=0.01)
    assert m.var().item() == pytest.approx(p / (1 - p), rel=0.02)


def test_masks_carry_state_across_truncated_bptt_segments():
    """The same masks over two half-sequences equal one call over the whole sequence."""
    layer = VariationalLSTM(I, H, num_layers=2, **ALL_P)
    masks = layer.sample_masks(B)
    x = torch.randn(T, B, I)
    whole, state_whole = layer(x, masks=masks)
    first, state = layer(x[:3], masks=masks)
    second, state = layer(x[3:], state, masks=masks)
    assert_close(torch.cat([first, second]), whole)
    assert_close(state, state_whole)


@pytest.mark.slow
def test_a_model_with_tied_dropout_trains():
    """Remember the previous step's first feature, through tied dropout everywhere."""
    lstm = VariationalLSTM(
        I,
        16,
        num_layers=2,
        batch_first=True,
        dropout=0.2,
        dropout_input=0.1,
        dropout_hidden=0.2,
        dropout_output=0.1,
    )
    head = nn.Linear(16, 1)
    opt = torch.optim.Adam([*lstm.parameters(), *head.parameters()], lr=0.02)
    x = torch.randn(32, T, I)
    y = torch.cat([torch.zeros(32, 1, 1), x[:, :-1, :1]], dim=1)

    def eval_loss():
        lstm.eval()
        with torch.no_grad():
            loss = nn.functional.mse_loss(head(lstm(x)[0]), y).item()
        lstm.train()
        return loss

    before = eval_loss()
    for _ in range(80):
        loss = nn.functional.mse_loss(head(lstm(x)[0]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert eval_loss() < 0.3 * before


# ------------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", ["dropout", "dropout_input", "dropout_hidden", "dropout_output"])
@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_probability_outside_range_is_rejected_by_name(name, p):
    with pytest.raises(ValueError, match=rf"{name} must be a probability in \[0, 1\), got {p}"):
        VariationalLSTM(I, H, **{name: p})


def test_bad_options_are_rejected_by_name():
    with pytest.raises(ValueError, match="mask_scope must be one of .*got 'time'"):
        VariationalLSTM(I, H, mask_scope="time")
    with pytest.raises(ValueError, match="kernel must be .*got 'fastest'"):
        VariationalGRU(I, H, kernel="fastest")
    with pytest.raises(TypeError, match="dropout_hidden must be a float"):
        VariationalGRU(I, H, dropout_hidden="0.5")


@pytest.mark.parametrize(("name", "bad", "error", "message"), [
    ("dropout_hidden", 1.5, ValueError, r"must be a probability in \[0, 1\), got 1.5"),
    ("dropout", 1.0, ValueError, r"must be a probability in \[0, 1\), got 1.0"),
    ("dropout_input", float("nan"), ValueError, r"must be a probability in \[0, 1\), got nan"),
    ("dropout_output", "0.5", TypeError, "must be a float"),
    ("mask_scope", "bogus", ValueError, "must be one of .*got 'bogus'"),
    ("noise", "uniform", ValueError, "must be one of .*got 'uniform'"),
    ("per_gate_masks", 1, TypeError, "must be True or False, got int 1"),
    ("kernel", "nope", ValueError, "must be one of .*got 'nope'"),
])
@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
def test_a_setting_changed_after_the_constructor_is_checked_as_it_checked(cls, name, bad, error, message):
    """A dropout schedule or a typo sets a layer's attribute after the constructor: the same check
    then, not all-dropped states (p 1.5), no dropout (NaN) or a bare KeyError at the next call.
    (A Gaussian layer's noise settings cannot change at all: tests/test_gaussian.py.)"""
    layer = cls(I, H, 2, dropout=0.1, dropout_hidden=0.2)
    before = getattr(layer, name)
    with pytest.raises(error, match=f"{name} {message}"):
        setattr(layer, name, bad)
    assert getattr(layer, name) == before  # unchanged
    setattr(layer, name, before)
    layer.dropout_hidden = 0.4  # a good value is kept, normalised as the constructor keeps it
    assert layer.dropout_hidden == 0.4 and "dropout_hidden=0.4" in repr(layer)
    layer.dropout = 0
    assert type(layer.dropout) is float and layer(torch.randn(3, 2, I))[0].shape == (3, 2, H)


@pytest.mark.parametrize(("make", "name", "bad", "error", "message"), [
    (lambda: WeightDrop(nn.LSTM(3, 3), ["weight_hh_l0"], p=0.3), "p", "0.3", TypeError, "must be a float"),
    (lambda: WeightDrop(nn.LSTM(3, 3), ["weight_hh_l0"]), "p", 1.5, ValueError, "must be a probability"),
    (lambda: LockedDropout(0.3), "p", float("nan"), ValueError, "must be a probability"),
    (lambda: LockedDropout(0.3), "noise", "uniform", ValueError, "must be one of .*got 'uniform'"),
    (lambda: LockedDropout(0.3), "batch_first", 1, TypeError, "must be True or False"),
    (lambda: EmbeddingDropout.from_sizes(5, 3, p=0.1), "p", 1.0, ValueError, "must be a probability"),
    (lambda: EmbeddingDropout.from_sizes(5, 3, p=0.1), "scope", "step", ValueError, "must be one of"),
], ids=["weight-drop-str", "weight-drop-1.5", "locked-nan", "locked-noise", "locked-batch-first",
        "embedding-1.0", "embedding-scope"])
def test_the_other_dropout_modules_check_a_setting_changed_after_the_constructor(make, name, bad, error,
                                                                                 message):
    """WeightDrop, LockedDropout and EmbeddingDropout too: ``wd.p = "0.3"`` was a bare comparison
    TypeError at the next call, ``p = 1.5`` or NaN a wrong answer. WeightDrop's ``variational``
    cannot change (the constructor checked the weights for it)."""
    module = make()
    before = getattr(module, name)
    with pytest.raises(error, match=f"{name} {message}"):
        setattr(module, name, bad)
    assert getattr(module, name) == before
    setattr(module, name, before)
    if name == "p":
        module.p = 0.25
        assert module.p == 0.25 and "p=0.25" in repr(module)
    if isinstance(module, WeightDrop):
        with pytest.raises(AttributeError, match="WeightDrop.variational cannot change after construction"):
            module.variational = True


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_bad_inputs_name_what_was_expected_and_what_came(kind):
    _, layer = make_pair(kind, num_layers=2, **ALL_P)
    with pytest.raises(ValueError, match=r"input.size\(-1\) must be equal to input_size=5, got 3"):
        layer(torch.randn(T, B, 3))
    with pytest.raises(ValueError, match="input must be 3-D .* got 4-D"):
        layer(torch.randn(T, B, I, 1))
    with pytest.raises(TypeError, match="input dtype torch.float64 does not match"):
        layer(torch.randn(T, B, I, dtype=torch.float64))
    bad_hx = torch.randn(2, B + 1, H)
    hx = bad_hx if kind == "gru" else (bad_hx, torch.randn(2, B, H))
    name = "hx" if kind == "gru" else r"hx\[0\]"
    with pytest.raises(ValueError, match=rf"{name} must have shape \[2, 4, 6\], got \[2, 5, 6\]"):
        layer(torch.randn(T, B, I), hx)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_hand_built_packed_sequence_is_checked_as_packing_makes_them(kind, kernel):
    """batch_sizes of 0 killed the process (SIGFPE in the C++ kernel); data with more rows than
    batch_sizes sum to left rows of the output unwritten. pack_padded_sequence makes neither."""
    layer = make_pair(kind, kernel=kernel, **ALL_P)[1].train()
    order = "batch_sizes must be positive and non-increasing, got"
    rows_sum = r"data must have sum\(batch_sizes\) = 5 rows, got"
    for sizes, rows, message in (([0], 0, rf"{order} \[0\]"), ([2, 0], 2, rf"{order} \[2, 0\]"),
                                 ([2, 3], 5, rf"{order} \[2, 3\]"), ([3, 2], 9, f"{rows_sum} 9"),
                                 ([3, 2], 4, f"{rows_sum} 4")):
        packed = PackedSequence(torch.randn(rows, I), torch.tensor(sizes))
        with pytest.raises(ValueError, match=f"{type(layer).__name__}: PackedSequence " + message):
            layer(packed)


def test_sample_masks_and_hx_name_what_came():
    layer = VariationalLSTM(I, H, **ALL_P)
    with pytest.raises(ValueError, match="seq_len must be a positive int, got -1"):
        layer.sample_masks(B, -1)  # not used by masks of a sequence, still not a length
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        layer.sample_masks(B, generator=5)
    x = torch.randn(T, B, I)
    h = torch.zeros(1, B, H)
    with pytest.raises(TypeError, match=r"hx must be a tuple \(h_0, c_0\) or None, got tuple of 3"):
        layer(x, (h, h, h))
    with pytest.raises(TypeError, match=r"hx must be a tuple \(h_0, c_0\) or None, got Tensor"):
        layer(x, h)


def test_bad_masks_name_the_mask_and_the_shapes():
    layer = VariationalLSTM(I, H, num_layers=2, **ALL_P)
    x = torch.randn(T, B, I)
    good = layer.sample_masks(B)
    wrong_batch = layer.sample_masks(B + 1)
    with pytest.raises(ValueError, match=r"masks.inputs\[0\] must have shape \[4, 5\] .*got \[5, 5\]"):
        layer(x, masks=wrong_batch)
    bad_dtype = good.map(lambda m: m.double())
    with pytest.raises(TypeError, match=r"masks.inputs\[0\] must have the input's dtype torch.float32"):
        layer(x, masks=bad_dtype)
    bad_device = good.map(lambda m: m.to("meta"))
    with pytest.raises(ValueError, match=r"masks.inputs\[0\] must be on the input's device cpu"):
        layer(x, masks=bad_device)
    with pytest.raises(ValueError, match=r"masks.output must have shape \[4, 6\] .*got \[1, 6\]"):
        layer(x, masks=RecurrentMasks(inputs=good.inputs, hidden=good.hidden, output=good.output[:1]))
    short = RecurrentMasks(inputs=good.inputs[:1], hidden=good.hidden, output=good.output)
    with pytest.raises(ValueError, match=r"masks.inputs must hold 2 masks, got 1"):
        layer(x, masks=short)
    with pytest.raises(TypeError, match="masks must be a RecurrentMasks"):
        layer(x, masks=[torch.ones(B, I)])
    step = VariationalLSTM(I, H, dropout_hidden=0.5, mask_scope="step")
    with pytest.raises(ValueError, match="seq_len is required"):
        step.sample_masks(B)
    with pytest.raises(ValueError, match="seq_len must be a positive int, got 0"):
        step.sample_masks(B, 0)


def test_each_site_drops_at_its_own_probability_and_alone():
    """``dropout`` (between layers, nn.LSTM's) and ``dropout_input`` are separate sites; a layer
    whose only dropout is on its output drops there (and counts as stochastic for MC dropout); per-gate
    input masks without a recurrent mask still reach the input."""
    layer = VariationalLSTM(I, H, num_layers=2, dropout=0.5, dropout_input=0.0)
    masks = layer.sample_masks(4000)
    assert masks.inputs[0] is None and abs(float((masks.inputs[1] == 0).float().mean()) - 0.5) < 0.02
    output_only = VariationalLSTM(I, 8, dropout_output=0.5).train()
    assert output_only.is_stochastic()
    out, _ = output_only(torch.randn(T, 50, I))
    assert 0.3 < float((out == 0).float().mean()) < 0.7
    per_gate = VariationalLSTM(I, H, dropout_input=1 - 1e-6, per_gate_masks=True).train()
    x = torch.randn(T, B, I)
    dropped, _ = per_gate(x)  # every input entry dropped, at every gate
    assert_close(dropped, per_gate.eval()(torch.zeros_like(x))[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
def test_sample_masks_draws_from_the_generator_given(cls):
    layer = cls(I, H, num_layers=2, **ALL_P)
    first = layer.sample_masks(B, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(123)  # the global generator plays no part
    again = layer.sample_masks(B, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip((*first.inputs, *first.hidden, first.output),
                                                 (*again.inputs, *again.hidden, again.output)))
    other = layer.sample_masks(B, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(first.hidden[0], other.hidden[0])


@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
@pytest.mark.parametrize("sites", [dict(dropout=0.3), dict(dropout_input=0.3), dict(dropout_output=0.3)],
                         ids=["between", "input", "output"])
def test_layers_without_a_recurrent_mask_run_fused_with_each_layers_and_directions_states(cls, sites):
    """A stack whose masks are all outside its recurrences (nn.LSTM's own ``dropout``) runs each
    layer on torch's fused op in training: each layer and direction starts from its own slice of
    ``hx`` and returns its own final states, as the loop kernels (here "manual", same masks) do.
    With ``hx`` random (zeros hide a wrong slice) and both directions (a swap shows)."""
    torch.manual_seed(0)
    fused = cls(I, H, num_layers=2, bidirectional=True, **sites).train()
    manual = copy.deepcopy(fused)
    manual.kernel = "manual"
    x = torch.randn(T, B, I, requires_grad=True)
    states = 2 if cls is VariationalLSTM else 1
    hx = tuple(torch.randn(4, B, H, requires_grad=True) for _ in range(states))
    masks = fused.sample_masks(B)
    results = []
    for layer in (fused, manual):
        out, h_n = layer(x, hx if states == 2 else hx[0], masks=masks)
        finals = h_n if states == 2 else (h_n,)
        loss = out.square().sum() + sum((k + 2) * f.square().sum() for k, f in enumerate(finals))
        results.append((out, *finals, *torch.autograd.grad(loss, (x, *hx, *layer.parameters()))))
    assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_the_raw_output_of_batch_shared_masks_is_before_the_output_mask():
    """``return_raw_output`` (TAR's input) with ``mask_scope="batch"``: the last layer's output
    before its output mask, as on the other scopes."""
    layer = VariationalLSTM(I, H, 2, dropout=0.3, dropout_hidden=0.2, dropout_output=0.5, mask_scope="batch")
    masks = layer.sample_masks(B)
    out, _, raw = layer(torch.randn(T, B, I), masks=masks, return_raw_output=True)
    assert not torch.equal(out, raw)
    assert_close(out, raw * masks.output.unsqueeze(0))


# ------------------------------------------------- arguments checked: refused or warned about


def test_per_gate_masks_must_be_a_bool():
    with pytest.raises(TypeError, match="per_gate_masks must be True or False, got str 'no'"):
        VariationalLSTM(I, H, dropout_hidden=0.5, per_gate_masks="no")


@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
def test_dropout_with_one_layer_warns_like_nn_lstm(cls):
    torch_cls = nn.LSTM if cls is VariationalLSTM else nn.GRU
    with pytest.warns(UserWarning) as theirs:
        torch_cls(I, H, num_layers=1, dropout=0.5)
    with pytest.warns(UserWarning) as ours:
        layer = cls(I, H, num_layers=1, dropout=0.5)
    assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]
    assert layer.dropout == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls(I, H, num_layers=2, dropout=0.5)


@pytest.mark.parametrize(
    ("cls", "module"),
    [
        pytest.param(VariationalLSTM, nn.RNN(I, H), id="lstm-from-rnn"),
        pytest.param(VariationalLSTM, nn.GRU(I, H), id="lstm-from-gru"),
        pytest.param(VariationalGRU, nn.LSTM(I, H), id="gru-from-lstm"),
        pytest.param(VariationalGRU, nn.Linear(I, H), id="gru-from-linear"),
    ],
)
def test_from_module_takes_only_its_own_cell(cls, module):
    expected = "LSTM" if cls is VariationalLSTM else "GRU"
    with pytest.raises(TypeError, match=rf"module must be an nn.{expected}, got {type(module).__name__}"):
        cls.from_module(module)
