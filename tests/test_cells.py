"""VariationalLSTMCell / VariationalGRUCell: masks applied before the gate matmuls."""

import pytest
import torch
from torch import nn

from rnndrop import VariationalGRUCell, VariationalLSTMCell
from rnndrop.noise import bernoulli_mask
from tests.helpers import assert_close

I, H, B = 5, 6, 3


def pair(kind):
    ref = nn.LSTMCell(I, H) if kind == "lstm" else nn.GRUCell(I, H)
    ours = VariationalLSTMCell(I, H) if kind == "lstm" else VariationalGRUCell(I, H)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_without_masks_the_cells_equal_torch_cells(kind):
    ref, ours = pair(kind)
    x = torch.randn(B, I)
    hx = torch.randn(B, H) if kind == "gru" else (torch.randn(B, H), torch.randn(B, H))
    assert_close(ours(x, hx), ref(x, hx))
    assert_close(ours(x), ref(x))
    assert_close(ours(x[0]), ref(x[0]))  # unbatched


def test_lstm_masks_multiply_input_and_previous_hidden_state():
    ref, ours = pair("lstm")
    x, h, c = torch.randn(B, I), torch.randn(B, H), torch.randn(B, H)
    mx, mh = bernoulli_mask((B, I), 0.5), bernoulli_mask((B, H), 0.5)
    assert_close(ours(x, (h, c), input_mask=mx, hidden_mask=mh), ref(x * mx, (h * mh, c)))


def test_gru_hidden_mask_enters_the_matmul_only():
    _, ours = pair("gru")
    x, h = torch.randn(B, I), torch.randn(B, H)
    mh = bernoulli_mask((B, H), 0.5)
    gx = x @ ours.weight_ih.T + ours.bias_ih
    gh = (h * mh) @ ours.weight_hh.T + ours.bias_hh
    r = torch.sigmoid(gx[:, :H] + gh[:, :H])
    z = torch.sigmoid(gx[:, H : 2 * H] + gh[:, H : 2 * H])
    n = torch.tanh(gx[:, 2 * H :] + r * gh[:, 2 * H :])
    assert_close(ours(x, h, hidden_mask=mh), (1 - z) * n + z * h)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_per_gate_masks_give_every_gate_its_own_mask(kind):
    _, ours = pair(kind)
    G = 4 if kind == "lstm" else 3
    x, h = torch.randn(B, I), torch.randn(B, H)
    mx, mh = bernoulli_mask((B, G, I), 0.5), bernoulli_mask((B, G, H), 0.5)
    wi, wh = ours.weight_ih.view(G, H, I), ours.weight_hh.view(G, H, H)
    gx = torch.cat([(x * mx[:, g]) @ wi[g].T for g in range(G)], -1) + ours.bias_ih
    gh = torch.cat([(h * mh[:, g]) @ wh[g].T for g in range(G)], -1) + ours.bias_hh
    if kind == "lstm":
        c = torch.randn(B, H)
        i, f, gg, o = (gx + gh).chunk(4, -1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
        expected = (torch.sigmoid(o) * torch.tanh(c_new), c_new)
        assert_close(ours(x, (h, c), input_mask=mx, hidden_mask=mh), expected)
    else:
        r = torch.sigmoid(gx[:, :H] + gh[:, :H])
        z = torch.sigmoid(gx[:, H : 2 * H] + gh[:, H : 2 * H])
        n = torch.tanh(gx[:, 2 * H :] + r * gh[:, 2 * H :])
        assert_close(ours(x, h, input_mask=mx, hidden_mask=mh), (1 - z) * n + z * h)


def test_cell_errors_name_the_argument():
    cell = VariationalLSTMCell(I, H)
    x = torch.randn(B, I)
    with pytest.raises(ValueError, match=r"input_mask must have shape \[3, 5\] or \[3, 4, 5\]"):
        cell(x, input_mask=torch.ones(B, H))
    with pytest.raises(ValueError, match=r"hidden_mask must have shape"):
        cell(x, hidden_mask=torch.ones(B + 1, H))
    with pytest.raises(TypeError, match="input_mask must have the input's dtype"):
        cell(x, input_mask=torch.ones(B, I, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"input.size\(-1\) must be equal to input_size=5, got 4"):
        cell(torch.randn(B, 4))
    with pytest.raises(ValueError, match=r"hx\[1\] must have shape \[3, 6\], got \[2, 6\]"):
        cell(x, (torch.zeros(B, H), torch.zeros(2, H)))
    with pytest.raises(ValueError, match="input must be 1-D .* or 2-D .* got 3-D"):
        VariationalGRUCell(I, H)(torch.randn(2, B, I))
    with pytest.raises(ValueError, match="input is on meta but the weights are on cpu"):
        cell(torch.randn(B, I, device="meta"))  # the layer's check, now the cell's too


def test_an_lstm_cell_given_a_tensor_for_its_state_pair_names_hx():
    """Was "too many values to unpack (expected 2)"."""
    cell = VariationalLSTMCell(5, 7)
    x, h = torch.randn(3, 5), torch.randn(3, 7)
    with pytest.raises(TypeError, match=r"LSTMCell: hx must be a tuple \(h, c\) of two Tensors, got Tensor"):
        cell(x, h)
    with pytest.raises(TypeError, match="got 3 values"):
        cell(x, (h, h, h))
