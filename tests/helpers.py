"""Shared test helpers: tensor comparison, a stand-in for CUDA graphs, and the checks every loop
kernel passes against the reference kernel and nn.LSTM / nn.GRU."""

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

from rnndrop import RecurrentMasks, VariationalGRU, VariationalLSTM
from rnndrop.kernels import get_kernel
from rnndrop.kernels.cuda_graphs import Captured
from rnndrop.kernels.first_order import SecondOrderGradientError


def assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=""):
    """Compare tensors, tuples of tensors or PackedSequences."""
    if hasattr(actual, "batch_sizes"):
        torch.testing.assert_close(actual.batch_sizes, expected.batch_sizes)
        actual, expected = actual.data, expected.data
    if isinstance(actual, (tuple, list)):
        assert len(actual) == len(expected), msg
        for a, e in zip(actual, expected):
            assert_close(a, e, atol, rtol, msg)
        return
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg or None)


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` where there is no GPU: ``replay()`` reruns the captured
    function on the captured inputs and writes into the captured outputs in place, as a replay does."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs
        self.replays = 0

    def replay(self):
        self.replays += 1
        for out, new in zip(self.outputs, self.fn(*self.inputs)):
            if out is not None:
                out.copy_(new)


def fake_capture(fn, inputs):
    """``rnndrop.kernels.cuda_graphs.capture_cuda_graph`` with a :class:`FakeGraph`."""
    static = [None if x is None else x.clone() for x in inputs]
    outputs = tuple(fn(*static))
    return Captured(FakeGraph(fn, static, outputs), static, outputs)


# ------------------------------------------------ loop kernels and layers against their references
# Used by test_kernels.py ("manual"), test_compiled_kernel.py ("compiled") and triton_checks.py.

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
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype).to(o.device)).sum() for o in outputs)
    leaves = [a for a in args if a is not None and a.requires_grad]
    return list(outputs), list(torch.autograd.grad(loss, leaves))


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


def check_kernel_matches_reference_kernel(name, kind, reverse):
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


def check_kernel_passes_gradcheck(name, kind):
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


def check_a_graph_of_the_backward_is_refused_not_silently_wrong(name, cell):
    args = kernel_inputs(cell, [2, 2], (1, "B", "P"), 0)
    out = get_kernel(name, cell)(args[0], [2, 2], *args[1:], False)[0]
    out.sum().backward()  # first order works
    with pytest.raises(SecondOrderGradientError, match="kernel='autograd'"):
        torch.autograd.grad(out.pow(2).sum(), args[0], create_graph=True)



def check_layer_without_dropout_matches_torch(name, kind):
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


def check_layer_in_float64_matches_torch(name, kind):
    config = dict(num_layers=2, bidirectional=True) | (dict(proj_size=3) if kind == "lstm" else {})
    ref, ours = make_pair(kind, name, dtype=torch.float64, **config)
    x = torch.randn(T, B, I, dtype=torch.float64, requires_grad=True)
    hx = initial_state(kind, ours, B, torch.float64)
    assert_close(forward_and_grads(ours, x, hx), forward_and_grads(ref, x, hx), atol=1e-10, rtol=1e-10)


def check_layer_with_masks_matches_reference_kernel(name, kind):
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


def check_layer_passes_gradcheck_through_explicit_masks(name):
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


def weights_in(module, buffer, offsets):
    """``module`` with its flat weights moved into ``buffer`` (1-D) at ``offsets``, as parameters."""
    for name, offset in zip(module._flat_weights_names, offsets):
        weight = getattr(module, name).detach()
        view = buffer[offset : offset + weight.numel()].view(weight.shape)
        view.copy_(weight)
        setattr(module, name, nn.Parameter(view))
    return module


def flattened(module):
    """``module`` with its weights made views of one storage laid out as cuDNN lays out a stack
    (every layer's and direction's matrices in order, then their biases; read from cuDNN 9), with
    a gap before and after, as flatten_parameters leaves a cuDNN module."""
    names = module._flat_weights_names
    order = sorted(names, key=lambda n: getattr(module, n).dim() == 1)  # stable: matrices, then biases
    sizes = {n: getattr(module, n).numel() for n in names}
    starts = {n: 3 + sum(sizes[m] for m in order[: order.index(n)]) for n in names}
    return weights_in(module, torch.zeros(sum(sizes.values()) + 11), [starts[n] for n in names])


def distinct(t: torch.Tensor, dim: int = 0) -> int:
    """How many different slices ``t`` holds along ``dim`` (rows drawn apart, or sharing a draw)."""
    return len({tuple(part.flatten().tolist()) for part in t.unbind(dim)})


def failing_backend(where: str):
    """A torch.compile backend whose compiler fails: on the forward graph (``where="forward"``:
    dynamo raises it at the first call) or on the backward graph (``"backward"``: AOT autograd
    compiles it at the first backward)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fail(gm, example_inputs):
        raise RuntimeError(f"no lowering for the {where} graph\n(the compiler's second line)")

    def keep(gm, example_inputs):
        return make_boxed_func(gm.forward)

    if where == "forward":
        return fail
    return aot_autograd(fw_compiler=keep, bw_compiler=fail)
