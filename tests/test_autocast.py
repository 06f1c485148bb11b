"""Mixed precision: the layers under ``torch.autocast`` return what ``nn.LSTM`` / ``nn.GRU`` return
there (the dtype torch's fused op computes in), in training and eval, and the cached oneDNN probe
neither raises nor caches a wrong answer when autocast is on at its first call."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

from rnndrop import GaussianLSTM, SparseLSTM, VariationalGRU, VariationalLSTM
from rnndrop.kernels import onednn

BF16 = torch.bfloat16


def _reference(layer: nn.Module) -> nn.Module:
    extra = {"proj_size": layer.proj_size} if layer.proj_size else {}
    plain = (nn.LSTM if isinstance(layer, nn.LSTM) else nn.GRU)(
        layer.input_size, layer.hidden_size, num_layers=layer.num_layers,
        bidirectional=layer.bidirectional, batch_first=layer.batch_first, **extra,
    )
    plain.load_state_dict(layer.state_dict(), strict=False)
    return plain.eval()


def _data(output):
    """A layer's output tensor (a packed output's data)."""
    return output.data if isinstance(output, PackedSequence) else output


def _dtypes(result) -> list[torch.dtype]:
    out, states = result[0], result[1]
    states = states if isinstance(states, tuple) else (states,)
    return [_data(out).dtype, *(s.dtype for s in states)]


LAYERS = [
    pytest.param(lambda: VariationalLSTM(4, 8, num_layers=2, dropout=0.2, dropout_hidden=0.3),
                 id="lstm-loop"),
    pytest.param(lambda: VariationalLSTM(4, 8, dropout_hidden=0.3, mask_scope="batch"), id="lstm-folded"),
    pytest.param(lambda: VariationalLSTM(4, 8, dropout_hidden=0.3, per_gate_masks=True, dropout_input=0.2),
                 id="lstm-per-gate"),
    pytest.param(lambda: VariationalLSTM(4, 8, bidirectional=True, dropout_output=0.3), id="lstm-bidir"),
    pytest.param(lambda: VariationalGRU(4, 8, dropout_hidden=0.3, dropout_input=0.2), id="gru"),
    pytest.param(lambda: GaussianLSTM(4, 8, dropout_hidden=0.3), id="gaussian"),
    pytest.param(lambda: SparseLSTM(4, 8), id="sparse"),
]


def test_onednn_probe_under_autocast_does_not_raise_and_answers_as_without():
    onednn._onednn_ops_work.cache_clear()
    try:
        with torch.autocast("cpu", dtype=BF16):
            under = onednn._onednn_ops_work()
        onednn._onednn_ops_work.cache_clear()
        assert under == onednn._onednn_ops_work()
    finally:
        onednn._onednn_ops_work.cache_clear()


@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize("warm_up", [False, True], ids=["cold", "after-float32"])
def test_training_under_bf16_autocast_returns_nn_lstm_dtypes(make, warm_up):
    onednn._onednn_ops_work.cache_clear()  # the first call of the probe under autocast (the crash)
    layer = make().train()
    x = torch.randn(5, 3, 4)
    if warm_up:
        layer(x)
    with torch.autocast("cpu", dtype=BF16):
        result = layer(x)
        expected = _reference(layer)(x)
    assert _dtypes(result) == _dtypes(expected)
    result[0].float().sum().backward()
    assert layer.weight_hh_l0.grad is not None and layer.weight_hh_l0.grad.dtype == torch.float32


def test_autocast_dtypes_are_torchs():
    """The dtype is asked of torch, not assumed: on the CPU torch 2.13 runs the LSTM in bfloat16
    and the GRU in float32, and the layers follow."""
    x = torch.randn(5, 3, 4)
    with torch.autocast("cpu", dtype=BF16):
        assert VariationalLSTM(4, 8, dropout_hidden=0.3)(x)[0].dtype == nn.LSTM(4, 8)(x)[0].dtype
        assert VariationalGRU(4, 8, dropout_hidden=0.3)(x)[0].dtype == nn.GRU(4, 8)(x)[0].dtype


EVAL_SETTINGS = [
    pytest.param(cls, settings, id=f"{cls.__name__}-{name}")
    for cls in (VariationalLSTM, VariationalGRU)
    for name, settings in (("default", {}), ("batch-first", {"batch_first": True}),
                           ("proj", {"proj_size": 3}), ("bidir", {"bidirectional": True}))
    if cls is VariationalLSTM or name != "proj"  # nn.GRU has no projection
]


@pytest.mark.parametrize(("cls", "settings"), EVAL_SETTINGS)
def test_eval_under_autocast_equals_nn_lstm_under_autocast(cls, settings):
    """Bit for bit, outputs and final states (batch-first GRUs and LSTMs with projections came 1e-3
    apart: autocast casts the fused op's arguments its own way, which the layer now leaves to it)."""
    layer = cls(4, 8, num_layers=2, dropout=0.3, dropout_hidden=0.3, **settings).eval()
    plain = _reference(layer)
    x = torch.randn(5, 3, 4)
    with torch.autocast("cpu", dtype=BF16):
        got, expected = layer(x), plain(x)
    assert torch.equal(got[0], expected[0])
    for mine, theirs in zip(*(o[1] if isinstance(o[1], tuple) else (o[1],) for o in (got, expected))):
        assert torch.equal(mine, theirs)


def test_given_float32_masks_and_states_under_autocast():
    layer = VariationalLSTM(4, 8, dropout_hidden=0.3).train()
    x = torch.randn(5, 3, 4)
    masks = layer.sample_masks(3)
    hx = (torch.zeros(1, 3, 8), torch.zeros(1, 3, 8))
    with torch.autocast("cpu", dtype=BF16):
        out, (h, c) = layer(x, hx, masks)
    assert out.dtype == h.dtype == c.dtype == BF16
    assert not any("autocast" in name or "dtype" in name for name in vars(layer))  # nothing kept
    out32, _ = layer(x, hx, masks)
    torch.testing.assert_close(out.float(), out32, atol=0.05, rtol=0.05)


def test_a_cell_torch_cannot_run_under_autocast_computes_in_its_dtype_with_one_warning():
    """Where torch's fused op refuses the autocast dtype (so nn.LSTM could not run either), the
    layer keeps its weights' dtype and says why once, instead of falling back silently."""
    import dataclasses

    from rnndrop.recurrent import LSTM_CELL, _autocast_result_dtype, _probed_result_dtypes

    def refuses(*args):
        raise RuntimeError("no such kernel for this dtype\nsecond line")

    cell = dataclasses.replace(LSTM_CELL, fused=refuses)
    with pytest.warns(RuntimeWarning, match=r"cannot run under autocast .*\(no such kernel for this dtype\)"):
        assert _probed_result_dtypes(cell, "cpu", torch.float32, torch.bfloat16) == (torch.float32,) * 3
    assert _autocast_result_dtype("LSTM", "cpu", torch.float32, torch.bfloat16) == (BF16,) * 3


CALLS = [  # (layer, input): the calls whose dtypes torch 2.13 decides otherwise than a padded batch's
    pytest.param(lambda: VariationalLSTM(4, 8, dropout_hidden=0.3), "uneven", id="lstm-packed-uneven"),
    pytest.param(lambda: VariationalLSTM(4, 8, dropout_hidden=0.3), "even", id="lstm-packed-even"),
    pytest.param(lambda: VariationalLSTM(4, 8, proj_size=3, dropout_hidden=0.3), "padded", id="lstm-proj"),
    pytest.param(lambda: VariationalLSTM(4, 8, 2, proj_size=3, dropout=0.3, mask_scope="batch"), "uneven",
                 id="lstm-proj-packed-folded"),
    pytest.param(lambda: VariationalGRU(4, 8, dropout_hidden=0.3), "uneven", id="gru-packed-uneven"),
]


@pytest.mark.parametrize(("make", "batch"), CALLS)
def test_training_returns_nn_lstm_dtypes_for_packed_batches_and_projections(make, batch):
    """A packed batch of sequences of different lengths runs ``torch.lstm`` in float32 on the CPU
    (of equal lengths, in bfloat16 on torch 2.13 and float32 on 2.11), and ``c_n`` beside a
    projection comes back in float32: the layer in training returns what ``nn.LSTM`` returns for
    the same call (it probed a padded batch without a projection alone: bfloat16 everywhere), and
    the values follow the dtype it computes in."""
    torch.manual_seed(0)
    layer = make().train()
    x = torch.randn(5, 3, 4)
    lengths = {"uneven": [5, 4, 2], "even": [5, 5, 5]}.get(batch)
    given = pack_padded_sequence(x, torch.tensor(lengths)) if lengths else x
    with torch.autocast("cpu", dtype=BF16):
        result = layer(given)
        expected = _reference(layer)(given)
    assert _dtypes(result) == _dtypes(expected)
    if batch == "uneven" and isinstance(layer, VariationalLSTM) and not layer.proj_size:
        assert _dtypes(result)[0] == torch.float32  # not the padded batch's bfloat16
    torch.manual_seed(1)
    masks = layer.sample_masks(3)
    with torch.autocast("cpu", dtype=BF16):
        under = layer(given, masks=masks)
    exact = layer(given, masks=masks)
    tolerance = 1e-5 if _dtypes(under)[0] == torch.float32 else 0.05
    torch.testing.assert_close(_data(under[0]).float(), _data(exact[0]), atol=tolerance, rtol=tolerance)
    _data(under[0]).float().sum().backward()
    assert layer.weight_hh_l0.grad is not None and layer.weight_hh_l0.grad.dtype == torch.float32
