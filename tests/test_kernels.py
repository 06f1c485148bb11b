"""The loop kernels: every kernel against the reference "autograd" kernel and nn.LSTM / nn.GRU."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rnndrop import VariationalGRU, VariationalLSTM
from rnndrop.kernels import DEFAULT_LOOP_KERNEL, KERNELS, get_kernel, input_projection
from rnndrop.kernels.first_order import SecondOrderGradientError
from rnndrop.kernels.matmul import StepWeight, matmul
from tests import helpers
from tests.helpers import assert_close, kernel_inputs, run_kernel

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")

# Kernels checked against the reference here ("compiled" needs a compiler: tests/test_compiled_kernel.py;
# "triton" a GPU or Triton's interpreter: tests/test_triton_kernel.py).
FAST = [name for name in KERNELS if name not in ("autograd", "compiled", "triton")]


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_kernel_matches_reference_kernel(name, kind, reverse):
    """Outputs, final states and gradients of every input, including the mask's."""
    helpers.check_kernel_matches_reference_kernel(name, kind, reverse)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_kernel_passes_gradcheck(name, kind):
    helpers.check_kernel_passes_gradcheck(name, kind)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_graph_of_the_backward_is_refused_not_silently_wrong(name, cell):
    helpers.check_a_graph_of_the_backward_is_refused_not_silently_wrong(name, cell)


@pytest.mark.parametrize("cls, plain_cls", [(VariationalLSTM, nn.LSTM), (VariationalGRU, nn.GRU)])
def test_gradient_penalty_through_a_dropout_layer_is_right_or_refused(cls, plain_cls):
    """d/dW ||dy/dx||² with a recurrent mask: the default kernel refuses; kernel='autograd'
    gives nn.LSTM's / nn.GRU's answer when the mask is all ones, and another one with a mask."""
    x = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)

    def penalty(layer, **masks):
        (g,) = torch.autograd.grad(layer(x, **masks)[0].pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), layer.weight_hh_l0)[0]

    layer = cls(3, 4, dropout_hidden=0.3).double()
    masks = layer.sample_masks(2)
    with pytest.raises(SecondOrderGradientError):
        penalty(layer, masks=masks)
    exact = cls(3, 4, dropout_hidden=0.3, kernel="autograd").double()
    exact.load_state_dict(layer.state_dict())
    plain = plain_cls(3, 4).double()
    plain.load_state_dict(layer.state_dict())
    ones = masks.map(torch.ones_like)
    assert_close(penalty(exact, masks=ones), penalty(plain), atol=1e-10)
    assert not torch.allclose(penalty(exact, masks=masks), penalty(plain))


# ---------------------------------------------------------------- layers


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_without_dropout_matches_torch(name, kind):
    """VariationalLSTM/GRU(kernel=name) at p = 0 against nn.LSTM/GRU: outputs, final
    states, gradients of the input, h0, c0 and every weight (float32, 1e-5)."""
    helpers.check_layer_without_dropout_matches_torch(name, kind)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_in_float64_matches_torch(name, kind):
    helpers.check_layer_in_float64_matches_torch(name, kind)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_with_masks_matches_reference_kernel(name, kind):
    """Every mask scope (sequence, step, batch-shared) with shared and per-gate masks,
    on padded and packed input, against the same layer running the reference kernel."""
    helpers.check_layer_with_masks_matches_reference_kernel(name, kind)


@pytest.mark.parametrize("name", FAST)
def test_layer_passes_gradcheck_through_explicit_masks(name):
    """Gradients of the layer in float64, including those of learned (Gaussian) masks."""
    helpers.check_layer_passes_gradcheck_through_explicit_masks(name)


def test_registry_is_keyed_by_kernel_and_cell():
    assert set(KERNELS) == {"manual", "autograd", "compiled", "triton"}
    assert DEFAULT_LOOP_KERNEL in KERNELS
    for name in KERNELS:
        assert {cell for cell in KERNELS[name]} == {"lstm", "gru"}
        assert get_kernel(name, "gru") is KERNELS[name]["gru"]
    assert get_kernel("manual", "lstm") is not get_kernel("autograd", "lstm")
    with pytest.raises(ValueError, match="kernel must be .*got 'no such kernel'"):
        get_kernel("no such kernel", "lstm")
    with pytest.raises(ValueError, match="cell must be .*got 'peephole'"):
        get_kernel("manual", "peephole")


# ------------------------------------------------- oneDNN products and their fallback

@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_float32_products_agree_with_and_without_onednn(kind):
    """The manual kernel in float32 (oneDNN products where available) against the same
    kernel with oneDNN disabled (torch.mm) and against the reference kernel, on packed
    rows with shared and per-gate masks and a projection."""
    cases = [([4, 3, 3, 1], (1, "B", "P"), 0), ([3, 3, 2], ("T", "B", "G", "P"), 0), ([4, 4, 2], None, 3)]
    for batch_sizes, mask_shape, proj in cases:
        if kind == "gru" and proj:
            continue
        args = kernel_inputs(kind, batch_sizes, mask_shape, proj, dtype=torch.float32, H=40)
        where = f"{batch_sizes} mask {mask_shape} proj {proj}"
        default = run_kernel("manual", kind, batch_sizes, args, reverse=False)
        with torch.backends.mkldnn.flags(enabled=False):
            fallback = run_kernel("manual", kind, batch_sizes, args, reverse=False)
        reference = run_kernel("autograd", kind, batch_sizes, args, reverse=False)
        assert_close(default, fallback, atol=1e-4, rtol=1e-5, msg=where)
        assert_close(default, reference, atol=1e-4, rtol=1e-5, msg=where)


def test_step_weight_chooses_onednn_by_capability():
    w = torch.randn(8, 5)
    assert StepWeight(w.double()).onednn is False  # oneDNN has no float64 products
    with torch.backends.mkldnn.flags(enabled=False):
        assert StepWeight(w).onednn is False
    x, add, bias = torch.randn(3, 5), torch.randn(3, 8), torch.randn(8)
    for weight in (w, w.double()):
        step = StepWeight(weight)
        xs = x.to(weight.dtype)
        assert_close(step(xs), xs @ weight.t(), atol=1e-5)
        assert_close(step(xs, add.to(weight.dtype)), xs @ weight.t() + add, atol=1e-5)
        assert_close(step(xs, bias=bias.to(weight.dtype)), xs @ weight.t() + bias, atol=1e-5)


def test_matmul_of_whole_sequences_matches_mm_for_every_operand_layout():
    """``matmul(a, b)`` = ``a @ b`` whether ``a`` is contiguous, a transposed view larger
    than ``b`` (a weight gradient ``dzᵀ m``: computed as ``(bᵀ aᵀ)ᵀ``), a transposed view
    smaller than ``b``, or a slice of columns (copied); on the oneDNN path and with oneDNN
    disabled."""
    m = torch.randn(30, 6)
    cases = {
        "contiguous a": (torch.randn(8, 30), m),
        "transposed a, larger": (torch.randn(30, 16).t(), m),
        "transposed a, smaller": (torch.randn(30, 2).t(), m),
        "a a slice of columns, larger": (torch.randn(30, 40)[:, 3:19].t(), m),
        "b a slice of columns": (torch.randn(8, 30), torch.randn(30, 12)[:, 2:8]),
        "a expanded (the gradient of a sum)": (torch.ones(1, 1).expand(30, 16).t(), m),
    }
    for name, (a, b) in cases.items():
        expected = a.double() @ b.double()
        assert_close(matmul(a, b).double(), expected, atol=1e-5, msg=name)
        with torch.backends.mkldnn.flags(enabled=False):
            assert_close(matmul(a, b).double(), expected, atol=1e-5, msg=f"{name}, without oneDNN")


def test_onednn_is_used_for_float32_on_cpu_wherever_torch_has_it():
    assert StepWeight(torch.randn(8, 5)).onednn is torch.backends.mkldnn.is_available()


def test_input_projection_matches_linear_twice_differentiably():
    """Outputs, gradients and a double backward against F.linear (float32, on the oneDNN
    path where available; with and without bias; with a mask it is masked_linear)."""
    for bias in (torch.randn(12, requires_grad=True), None):
        x = torch.randn(9, 5, requires_grad=True)
        w = torch.randn(12, 5, requires_grad=True)
        leaves = [t for t in (x, w, bias) if t is not None]
        y_ours, y_ref = input_projection(x, None, w, bias), F.linear(x, w, bias)
        assert_close(y_ours, y_ref, atol=1e-5)
        g = torch.randn(9, 12)
        grads_ours = torch.autograd.grad(y_ours, leaves, g, create_graph=True)
        grads_ref = torch.autograd.grad(y_ref, leaves, g, create_graph=True)
        assert_close(list(grads_ours), list(grads_ref), atol=1e-5)
        second_ours = torch.autograd.grad(grads_ours[0].square().sum(), w)
        second_ref = torch.autograd.grad(grads_ref[0].square().sum(), w)
        assert_close(list(second_ours), list(second_ref), atol=1e-4)
    mask = torch.rand(9, 5)
    assert_close(input_projection(x, mask, w), F.linear(x * mask, w), atol=1e-5)


def test_input_projection_without_gradients_runs_no_autograd_function():
    """Under ``torch.no_grad`` (Monte-Carlo sampling) or with nothing requiring a gradient, the
    product runs without the autograd Function (a host cost a layer and sample): no graph, the same
    values."""
    x, w = torch.randn(9, 5, requires_grad=True), torch.randn(12, 5, requires_grad=True)
    bias = torch.randn(12)
    with_grad = input_projection(x, None, w, bias)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        without = input_projection(x, None, w, bias)
    plain = input_projection(x.detach(), None, w.detach(), bias)
    assert without.grad_fn is None and plain.grad_fn is None
    assert_close(without, with_grad.detach(), atol=0, rtol=0)
    assert_close(plain, with_grad.detach(), atol=0, rtol=0)


def test_onednn_or_blas_is_decided_by_weight_rows_and_cpu_family(monkeypatch):
    """Zen 3/4 and other CPUs: oneDNN from 250 k elements, or 150 k with 32 rows or more; AMD Zen 5
    (family 26) and later, where oneDNN's packed products beat BLAS at hidden 200 and 20 rows:
    from 100 k at any rows. Read from /proc/cpuinfo once, so a machine always decides alike."""
    from rnndrop.kernels import onednn

    zen4 = "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
    assert onednn.amd_family_in(zen4) == 25
    assert onednn.amd_family_in(zen4.replace("25", "26")) == 26
    assert onednn.amd_family_in("vendor_id\t: GenuineIntel\ncpu family\t: 6\n") == 0
    assert onednn.amd_family_in("vendor_id : AuthenticAMD\n") == 0
    lstm_200, gru_200 = torch.ones(800, 200), torch.ones(600, 200)
    for family, expected in ((25, [False, True, False, False]), (26, [True, True, True, True])):
        monkeypatch.setattr(onednn, "amd_cpu_family", lambda family=family: family)
        assert [onednn.worth_onednn(w, rows) for w in (lstm_200, gru_200) for rows in (20, 64)] == expected
    # a whole sequence's products (per-gate projection, dW_hh): through oneDNN on a Zen 5 only
    for family, expected in ((25, False), (26, True)):
        monkeypatch.setattr(onednn, "amd_cpu_family", lambda family=family: family)
        assert onednn.sequence_through_onednn(gru_200) is (expected and onednn.onednn_enabled(gru_200))
