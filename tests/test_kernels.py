"""The loop kernels: every kernel against the reference "autograd" kernel and nn.LSTM / nn.GRU."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.rnn import pack_sequence

from rnndrop import RecurrentMasks, VariationalGRU, VariationalLSTM
from rnndrop.kernels import DEFAULT_LOOP_KERNEL, KERNELS, get_kernel, input_projection
from rnndrop.kernels.first_order import SecondOrderGradientError
from rnndrop.kernels.matmul import StepWeight, matmul
from tests.helpers import assert_close

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")

# Kernels checked against the reference here ("compiled" needs a compiler: tests/test_compiled_kernel.py;
# "triton" a GPU or Triton's interpreter: tests/test_triton_kernel.py).
FAST = [name for name in KERNELS if name not in ("autograd", "compiled", "triton")]
I, H, T, B = 5, 6, 7, 4
GATES = {"lstm": 4, "gru": 3}

# Rows per time step: padded, packed (some sequences end early), a single step.
BATCH_SIZES = [[3, 3, 3, 3], [4, 3, 3, 1], [2], [4, 2, 2, 1, 1]]
# Hidden mask shapes: [T', B', P] or per gate [T', B', G, P]; "T", "B", "P" and "G" are filled in.
MASK_SHAPES = [
    None,
    (1, 1, "P"),
    (1, "B", "P"),
    ("T", "B", "P"),
    ("T", 1, "P"),
    (1, "B", "G", "P"),
    ("T", "B", "G", "P"),
    (1, 1, "G", "P"),
]


def kernel_inputs(kind, batch_sizes, mask_shape, proj, dtype=torch.float64, mask_grad=True, H=H):
    """Random arguments of ``kernel.lstm`` / ``kernel.gru`` (after ``batch_sizes``)."""
    G, P = GATES[kind], proj or H
    N, Bt, Tt = sum(batch_sizes), batch_sizes[0], len(batch_sizes)

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    mask = None
    if mask_shape is not None:
        shape = [{"T": Tt, "B": Bt, "P": P, "G": G}.get(s, s) for s in mask_shape]
        mask = (torch.rand(*shape, dtype=dtype) * 2).requires_grad_(mask_grad)
    if kind == "lstm":
        return [rand(N, 4 * H), rand(Bt, P), rand(Bt, H), rand(4 * H, P),
                rand(P, H) if proj else None, mask]
    return [rand(N, 3 * H), rand(Bt, H), rand(3 * H, H), rand(3 * H), mask]


def run_kernel(name, kind, batch_sizes, args, reverse):
    """Outputs of a kernel and the gradients of a random functional of them."""
    args = [a.detach().requires_grad_(a.requires_grad) if a is not None else None for a in args]
    outputs = get_kernel(name, kind)(args[0], batch_sizes, *args[1:], reverse)
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outputs)
    leaves = [a for a in args if a is not None and a.requires_grad]
    return list(outputs), list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_kernel_matches_reference_kernel(name, kind, reverse):
    """Outputs, final states and gradients of every input, including the mask's."""
    for batch_sizes in BATCH_SIZES:
        for mask_shape in MASK_SHAPES:
            for proj in [0, 3] if kind == "lstm" else [0]:
                for mask_grad in [True, False] if mask_shape else [False]:
                    args = kernel_inputs(kind, batch_sizes, mask_shape, proj, mask_grad=mask_grad)
                    where = f"{batch_sizes} mask {mask_shape} proj {proj}"
                    ours = run_kernel(name, kind, batch_sizes, args, reverse)
                    ref = run_kernel("autograd", kind, batch_sizes, args, reverse)
                    assert len(ours[1]) == len(ref[1])
                    assert_close(ours, ref, atol=1e-10, rtol=1e-8, msg=where)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_kernel_passes_gradcheck(name, kind):
    kernel = get_kernel(name, kind)
    cases = [([3, 2, 2, 1], (1, "B", "P"), True, 2), ([2, 2, 1], ("T", "B", "G", "P"), False, 0)]
    for batch_sizes, mask_shape, reverse, proj in cases:
        args = kernel_inputs(kind, batch_sizes, mask_shape, proj if kind == "lstm" else 0, H=3)
        present = tuple(a is not None for a in args)

        def fn(*tensors, batch_sizes=batch_sizes, reverse=reverse, present=present):
            it = iter(tensors)
            full = [next(it) if here else None for here in present]
            return kernel(full[0], batch_sizes, *full[1:], reverse)

        assert torch.autograd.gradcheck(fn, [a for a in args if a is not None])


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_graph_of_the_backward_is_refused_not_silently_wrong(name, cell):
    args = kernel_inputs(cell, [2, 2], (1, "B", "P"), 0)
    out = get_kernel(name, cell)(args[0], [2, 2], *args[1:], False)[0]
    out.sum().backward()  # first order works
    with pytest.raises(SecondOrderGradientError, match="kernel='autograd'"):
        torch.autograd.grad(out.pow(2).sum(), args[0], create_graph=True)


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

CONFIGS = [
    dict(num_layers=1),
    dict(num_layers=2, bidirectional=True),
    dict(num_layers=3, bias=False),
    dict(num_layers=2, batch_first=True),
    dict(num_layers=2, proj_size=3, bidirectional=True),
]


def make_pair(kind, kernel, dtype=torch.float32, **kw):
    ref_cls, our_cls = (nn.LSTM, VariationalLSTM) if kind == "lstm" else (nn.GRU, VariationalGRU)
    ref = ref_cls(I, H, dtype=dtype, **kw)
    ours = our_cls(I, H, dtype=dtype, kernel=kernel, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def initial_state(kind, layer, batch, dtype=torch.float32):
    L = layer.num_layers * (2 if layer.bidirectional else 1)
    h = torch.randn(L, batch, getattr(layer, "proj_size", 0) or H, dtype=dtype, requires_grad=True)
    return h if kind == "gru" else (h, torch.randn(L, batch, H, dtype=dtype, requires_grad=True))


def forward_and_grads(layer, x, hx, masks=None):
    out, state = layer(x, hx) if masks is None else layer(x, hx, masks=masks)
    data = out.data if hasattr(out, "batch_sizes") else out
    states = state if isinstance(state, tuple) else (state,)
    g = torch.Generator().manual_seed(1)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=t.dtype)).sum() for t in (data, *states))
    leaves = [x.data if hasattr(x, "batch_sizes") else x, *(hx if isinstance(hx, tuple) else (hx,))]
    return [data, *states], torch.autograd.grad(loss, [*leaves, *layer.parameters()])


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_without_dropout_matches_torch(name, kind):
    """VariationalLSTM/GRU(kernel=name) at p = 0 against nn.LSTM/GRU: outputs, final
    states, gradients of the input, h0, c0 and every weight (float32, 1e-5)."""
    for config in CONFIGS:
        if kind == "gru" and "proj_size" in config:
            continue
        ref, ours = make_pair(kind, name, **config)
        x = torch.randn(*((B, T, I) if config.get("batch_first") else (T, B, I)), requires_grad=True)
        hx = initial_state(kind, ours, B)
        assert_close(forward_and_grads(ours, x, hx), forward_and_grads(ref, x, hx), msg=str(config))

        lengths = [3, T, 1, 5]  # unsorted
        packed = pack_sequence([torch.randn(n, I) for n in lengths], enforce_sorted=False)
        packed.data.requires_grad_()
        hx = initial_state(kind, ours, len(lengths))
        assert_close(
            forward_and_grads(ours, packed, hx), forward_and_grads(ref, packed, hx), msg=f"packed {config}"
        )


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_in_float64_matches_torch(name, kind):
    config = dict(num_layers=2, bidirectional=True) | (dict(proj_size=3) if kind == "lstm" else {})
    ref, ours = make_pair(kind, name, dtype=torch.float64, **config)
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    hx = initial_state(kind, ours, B, torch.float64)
    assert_close(forward_and_grads(ours, x, hx), forward_and_grads(ref, x, hx), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_with_masks_matches_reference_kernel(name, kind):
    """Every mask scope (sequence, step, batch-shared) with shared and per-gate masks,
    on padded and packed input, against the same layer running the reference kernel."""
    proj = dict(proj_size=3) if kind == "lstm" else {}
    for scope in ["sequence", "step", "batch"]:
        for per_gate in [False, True]:
            ref, ours = (
                (VariationalLSTM if kind == "lstm" else VariationalGRU)(
                    I, H, num_layers=2, bidirectional=True, mask_scope=scope, per_gate_masks=per_gate,
                    dropout=0.4, dropout_input=0.3, dropout_hidden=0.5, dropout_output=0.2,
                    kernel=kernel, **proj,
                )
                for kernel in ("autograd", name)
            )
            ours.load_state_dict(ref.state_dict())
            masks = ref.sample_masks(B, T)
            x = torch.randn(T, B, I, requires_grad=True)
            hx = initial_state(kind, ours, B)
            where = f"scope {scope} per_gate {per_gate}"
            assert_close(
                forward_and_grads(ours, x, hx, masks), forward_and_grads(ref, x, hx, masks), msg=where
            )

            lengths = [3, T, 1, 5]
            packed = pack_sequence([torch.randn(n, I) for n in lengths], enforce_sorted=False)
            packed.data.requires_grad_()
            masks = ref.sample_masks(len(lengths), T)
            hx = initial_state(kind, ours, len(lengths))
            assert_close(
                forward_and_grads(ours, packed, hx, masks),
                forward_and_grads(ref, packed, hx, masks),
                msg=f"packed {where}",
            )


@pytest.mark.parametrize("name", FAST)
def test_layer_passes_gradcheck_through_explicit_masks(name):
    """Gradients of the layer in float64, including those of learned (Gaussian) masks."""
    torch.manual_seed(2)
    for kind in ["lstm", "gru"]:
        layer = (VariationalLSTM if kind == "lstm" else VariationalGRU)(
            3, 2, num_layers=2, bidirectional=True, dtype=torch.float64, kernel=name,
            dropout_hidden=0.5, per_gate_masks=True,
        )
        masks = layer.sample_masks(2)
        hidden = tuple(m.detach().requires_grad_() for m in masks.hidden)
        x = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)

        def fn(x, *hidden, masks=masks, layer=layer):
            m = RecurrentMasks(masks.inputs, hidden, masks.output, masks.scope, masks.per_gate)
            out, state = layer(x, masks=m)
            return out, *(state if isinstance(state, tuple) else (state,))

        assert torch.autograd.gradcheck(fn, (x, *hidden))


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
