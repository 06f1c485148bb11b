"""torch.compile traces the layers into its graph (with ``torch._dynamo.config.allow_rnn`` set: the
layers are ``nn.LSTM`` / ``nn.GRU``, which dynamo otherwise leaves out), each recurrence one call of
an operator of :mod:`rnndrop.kernels.ops` (the "compiled" kernel here; the "triton" kernel's in
``tests/triton_checks.py``).

Properties: the operators pass ``torch.library.opcheck`` (schema, fake tensors shaped as the real
ones, autograd, AOT dispatch); a compiled layer computes what the eager layer computes with the same
masks, in one graph (``fullgraph=True``), on random configurations; one graph serves every length;
masks drawn inside the graph are tied across time and fresh at every call; under autocast a layer
is traced where its loop runs the dtype it computes in; the calls that cannot be traced (eval mode,
packed input, another kernel, a bfloat16 LSTM on the CPU) still run, eagerly, with eager results.
"""

import random
import warnings
from unittest import mock

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

import rnndrop
from rnndrop import VariationalGRU, VariationalLSTM
from rnndrop.compiling import speeds_up_under_compile
from rnndrop.kernels import auto_loop_kernel_on, get_kernel, ops
from rnndrop.layout import EqualBatchSizes
from rnndrop.tracing import BEFORE_TRACING
from tests.helpers import assert_close, failing_backend
from tests.test_random_configurations import build, draw_configuration, inputs, tolerance

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def allow_rnn():
    """Dynamo traces into nn.RNNBase subclasses only with this switch; each test compiles afresh."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        yield
    torch._dynamo.reset()


def counting_backend(graphs: list):
    """A torch.compile backend that runs each graph as traced (AOT autograd's forward and backward,
    eagerly) and appends it to ``graphs``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))


# ------------------------------------------------------------------------------ the operators


def operator_arguments(cell: str, projected: bool, mask: str | None, reverse: bool, dtype: torch.dtype,
                       kernel: str = "compiled", device: torch.device = CPU) -> tuple:
    """Arguments of ``rnndrop::{cell}_recurrence`` for kernel ``kernel``: 4 steps of 3 sequences,
    5 units, with a mask of kind ``mask`` (None, "tied", "per step", "per gate", "shared")."""
    g = torch.Generator().manual_seed(0)
    H, B, T = 5, 3, 4
    P = 4 if projected else H
    G = 4 if cell == "lstm" else 3

    def r(*shape):
        return (0.5 * torch.randn(*shape, generator=g, dtype=dtype)).to(device).requires_grad_()

    masks = {None: None, "tied": (1, B, P), "per step": (T, B, P), "per gate": (1, B, G, P),
             "shared": (1, 1, P)}
    hidden_mask = None if mask is None else r(*masks[mask]).abs().detach().requires_grad_()
    if cell == "lstm":
        return (kernel, r(T * B, G * H), r(B, P), r(B, H), r(G * H, P), r(P, H) if projected else None,
                hidden_mask, reverse, True)
    return (kernel, r(T * B, G * H), r(B, H), r(G * H, H), r(G * H), hidden_mask, reverse, True)


@pytest.mark.parametrize("mask", [None, "tied", "per step", "per gate", "shared"])
@pytest.mark.parametrize("cell, projected", [("lstm", False), ("lstm", True), ("gru", False)])
@pytest.mark.parametrize("reverse", [False, True])
def test_the_operators_pass_opcheck(cell, projected, mask, reverse):
    args = operator_arguments(cell, projected, mask, reverse, torch.float64)
    op = torch.ops.rnndrop.lstm_recurrence if cell == "lstm" else torch.ops.rnndrop.gru_recurrence
    torch.library.opcheck(op.default, args)


@pytest.mark.parametrize("bias", [True, False])
def test_the_projection_operator_passes_opcheck(bias):
    """``rnndrop::linear``: the whole-sequence input projection through oneDNN (float32 on the CPU)."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(12, 5, generator=g), torch.randn(8, 5, generator=g)
    b = torch.randn(8, generator=g) if bias else None
    args = [t.requires_grad_() if t is not None else None for t in (x, weight, b)]
    torch.library.opcheck(torch.ops.rnndrop.linear.default, tuple(args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_shape", [(1, 3, 4, 5), (4, 3, 4, 5), (1, 1, 4, 5)],
                         ids=["tied", "per step", "shared"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_per_gate_projection_operator_passes_opcheck(mask_shape, bias):
    """``rnndrop::per_gate_linear``: the projection of ``[T, B, in]`` with a mask per gate, in float64
    (BLAS) and float32 (oneDNN where it serves), the mask's gradient too (Gaussian noise learns it)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        x = torch.randn(4, 3, 5, generator=g, dtype=dtype)
        weight = torch.randn(4 * 6, 5, generator=g, dtype=dtype)
        mask = torch.rand(*mask_shape, generator=g, dtype=dtype) * 2
        b = torch.randn(4 * 6, generator=g, dtype=dtype) if bias else None
        args = [t.requires_grad_() if t is not None else None for t in (x, mask, weight, b)]
        torch.library.opcheck(torch.ops.rnndrop.per_gate_linear.default, tuple(args), atol=1e-5, rtol=1e-5)


def test_an_operator_without_autograd_keeps_nothing():
    args = operator_arguments("lstm", False, "tied", False, torch.float32)
    with torch.no_grad():
        *_, saved = torch.ops.rnndrop.lstm_recurrence(*args[:-1], False)
    assert saved == []


def test_the_operators_refuse_the_batch_sizes_of_packed_input():
    _, gates_x, h0, c0, w_hh, *_ = operator_arguments("lstm", False, None, False, torch.float32)
    with pytest.raises(ValueError, match=r"equal batch sizes \(padded input\), got \[3, 3, 3, 2\]"):
        ops.lstm_recurrence("compiled")(gates_x[:11], [3, 3, 3, 2], h0, c0, w_hh, None, None)


def test_an_unknown_kernel_is_refused_by_name():
    _, gates_x, h0, c0, w_hh, *_ = operator_arguments("lstm", False, None, False, torch.float32)
    with pytest.raises(ValueError, match=r"kernel must be one of 'compiled', 'triton', got 'manual'"):
        ops.lstm_recurrence("manual")(gates_x, [3] * 4, h0, c0, w_hh, None, None)


@pytest.mark.parametrize("kernel", ["manual", "autograd", "compiled"])
def test_equal_batch_sizes_read_as_the_list_of_sizes_by_every_kernel(kernel):
    """``EqualBatchSizes`` (what a traced layout holds for padded input) is a sequence like
    ``[B] * T``: iterated, indexed (an IndexError past the end: iteration ends), sliced, and a
    kernel that reads it eagerly (a frame dynamo compiles on its own) computes what the list gives."""
    sizes = EqualBatchSizes(4, 3)
    assert list(sizes) == [3] * 4 and len(sizes) == 4 and sizes[-1] == 3 and sizes[1:3] == [3, 3]
    with pytest.raises(IndexError):
        sizes[4]
    _, gates_x, h0, c0, w_hh, *_ = operator_arguments("lstm", False, None, False, torch.float64)
    recurrence = get_kernel(kernel, "lstm")
    expected = recurrence(gates_x, [3] * 4, h0, c0, w_hh, None, None)
    assert_close(recurrence(gates_x, sizes, h0, c0, w_hh, None, None), expected, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------ compiled layers


def _step(layer, c: dict, masks, hx):
    """A function of the input: outputs, final states and a fixed functional of them (weights
    ``cos(k)`` of element ``k``), with the masks given."""

    def step(x):
        out, state = layer(x, hx if hx is None or c["cell"] == "lstm" else hx[0], masks)
        states = state if isinstance(state, tuple) else (state,)
        loss = sum((t * torch.arange(t.numel(), dtype=t.dtype, device=t.device).view(t.shape).cos()).sum()
                   for t in (out, *states))  # (on the outputs' device: the GPU runs this too)
        return out, states, loss

    return step


def compiled_and_eager(c: dict, seed: int, backend, with_grad: bool = True,
                       device: torch.device = CPU) -> tuple[list, list]:
    """Outputs, final states and gradients (input, initial state, every weight) of the
    configuration's layer in training mode, eagerly and compiled in one graph, with one set of
    masks."""
    torch.manual_seed(seed)
    layer = build(c, 0.4, c["kernel"], device)
    x, hx, _ = inputs(c, seed, device)
    batch = 1 if c["unbatched"] else c["batch"]
    masks = layer.sample_masks(batch, c["steps"], device="cpu", generator=torch.Generator().manual_seed(seed))
    masks = masks.map(lambda m: m.to(device))
    results = []
    for compiled in (False, True):
        leaf = x.clone().requires_grad_(with_grad)
        state = None if hx is None else tuple(h.clone().requires_grad_(with_grad)
                                              for h in (hx if isinstance(hx, tuple) else (hx,)))
        step = _step(layer, c, masks, state)
        if compiled:
            step = torch.compile(step, backend=backend, fullgraph=True)
        with torch.set_grad_enabled(with_grad):
            out, states, loss = step(leaf)
        result = [out, *states]
        if with_grad:
            result += torch.autograd.grad(loss, [leaf, *(state or ()), *layer.parameters()])
        results.append([t.detach() for t in result])
    return results[0], results[1]


def traceable_configuration(seed: int, kernels: tuple[str, ...] = ("auto", "compiled")) -> dict:
    """A configuration of ``tests.test_random_configurations`` whose training calls trace whole:
    padded input, a kernel of ``kernels``, and where the eager layer would run the fused op (an
    LSTM's masks shared by the batch) a GRU instead."""
    c = draw_configuration(random.Random(5000 + seed), kernels=kernels)
    c["packed"] = False
    if c["mask_scope"] == "batch" and not c["per_gate_masks"]:
        c["cell"], c["proj_size"] = "gru", 0  # an LSTM folds those into oneDNN's op: a graph break
    return c


@pytest.mark.parametrize("seed", range(24))
def test_a_compiled_layer_computes_what_the_eager_one_computes(seed):
    c = traceable_configuration(seed)
    graphs: list = []
    eager, compiled = compiled_and_eager(c, seed, counting_backend(graphs))
    assert len(graphs) == 1, c  # one forward graph: nothing ran outside it
    assert_close(compiled, eager, atol=10 * tolerance(c), rtol=10 * tolerance(c), msg=str(c))


def test_a_compiled_forward_without_autograd_computes_what_the_eager_one_computes():
    c = traceable_configuration(0)
    eager, compiled = compiled_and_eager(c, 0, "aot_eager", with_grad=False)
    assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_inductor_compiles_a_training_step_with_the_eager_results(cell):
    c = traceable_configuration(0)
    c.update(cell=cell, proj_size=0, dtype=torch.float32, num_layers=2, bidirectional=True,
             mask_scope="sequence", unbatched=False, steps=5, batch=3)
    eager, compiled = compiled_and_eager(c, 7, "inductor")
    assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_gate", [False, True])
def test_every_product_of_a_traced_layer_is_one_of_rnndrops_operators(per_gate):
    """The input projections run as ``rnndrop::linear`` / ``rnndrop::per_gate_linear`` (the eager
    layer's products: oneDNN on the CPU, cuDNN's float32 mode on CUDA), the recurrences as
    ``rnndrop::*_recurrence``: no product of torch's own in the forward graph (backward: their
    backward operators)."""
    graphs: list = []
    layer = VariationalLSTM(8, 16, 2, dropout_input=0.3, dropout_hidden=0.3, dropout_output=0.3,
                            per_gate_masks=per_gate)
    compiled = torch.compile(lambda x: layer(x)[0].pow(2).mean(), backend=counting_backend(graphs),
                             fullgraph=True)
    compiled(torch.randn(5, 3, 8)).backward()
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    projection = "rnndrop.per_gate_linear.default" if per_gate else "rnndrop.linear.default"
    assert {projection, "rnndrop.lstm_recurrence.default"} <= targets, targets
    assert not {t for t in targets if t.split(".")[1:2] in (["mm"], ["addmm"], ["bmm"], ["baddbmm"])}, targets


def test_one_graph_serves_every_length_and_batch():
    """After the first shapes the graph keeps the number of steps and the batch symbolic: a
    variable truncated-BPTT length recompiles once, not at every length."""
    graphs: list = []
    layer = VariationalLSTM(8, 16, 2, dropout_input=0.3, dropout_hidden=0.3, dropout_output=0.3)

    def step(x):
        out, _ = layer(x)
        return out.pow(2).mean()

    compiled = torch.compile(step, backend=counting_backend(graphs), fullgraph=True)
    for T, B in [(5, 3), (7, 3), (9, 3), (11, 3), (13, 3), (6, 4), (8, 5), (12, 2)]:
        compiled(torch.randn(T, B, 8)).backward()
    assert len(graphs) <= 3


@pytest.mark.parametrize("scope", ["sequence", "step"])
def test_masks_drawn_inside_the_graph_are_tied_across_time_and_fresh_at_every_call(scope):
    """The output mask of a compiled layer (p 0.5, no other mask but the recurrent one): a unit of a
    sequence is dropped at every step or at none with tied masks, at about half the steps with
    per-step masks; two calls draw apart."""
    torch.manual_seed(0)
    layer = VariationalGRU(4, 64, dropout_hidden=0.2, dropout_output=0.5, mask_scope=scope)
    compiled = torch.compile(lambda x: layer(x)[0], backend="aot_eager", fullgraph=True)
    x = torch.randn(12, 8, 4)
    first, second = compiled(x).eq(0), compiled(x).eq(0)
    per_unit = first.float().mean(0)  # [B, H]: the share of steps where the unit is dropped
    if scope == "sequence":
        assert set(per_unit.unique().tolist()) <= {0.0, 1.0}
    else:
        assert per_unit.gt(0).logical_and(per_unit.lt(1)).float().mean() > 0.9
    assert 0.4 < first.float().mean() < 0.6
    assert not torch.equal(first, second)


def test_compile_model_traces_the_layers_and_leaves_the_switch_as_it_was():
    """``rnndrop.compile_model``: the layer in one graph (``fullgraph=True``) with the eager
    results, ``allow_rnn`` set only while it compiles and runs; the module's parameters once."""
    torch.manual_seed(0)
    layer = VariationalLSTM(4, 6, 2, dropout_input=0.3, dropout_hidden=0.3, dropout_output=0.3)
    masks = layer.sample_masks(3, 5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 3, 4)
    graphs: list = []
    assert auto_loop_kernel_on in BEFORE_TRACING  # the kernel choice made before tracing
    with torch._dynamo.config.patch(allow_rnn=False):
        compiled = rnndrop.compile_model(layer, mode=None, backend=counting_backend(graphs), fullgraph=True)
        actual = compiled(x, None, masks)
        assert torch._dynamo.config.allow_rnn is False
    assert len(graphs) == 1
    assert_close(actual, layer(x, None, masks), atol=1e-6, rtol=1e-6)
    assert list(compiled.state_dict()) == [f"module.{k}" for k in layer.state_dict()]
    assert len(list(compiled.parameters())) == len(list(layer.parameters()))
    with pytest.raises(TypeError, match="module must be an nn.Module, got function"):
        rnndrop.compile_model(lambda x: x)


def test_a_failed_compile_runs_the_call_eagerly_with_one_warning_and_stays_eager():
    """``compile_model`` over a compiler that fails: the call returns the eager layer's result
    (same masks), one warning names the compiler's error, and later calls run eagerly without one."""
    torch.manual_seed(0)
    layer = VariationalLSTM(4, 6, 2, dropout_input=0.3, dropout_hidden=0.3, dropout_output=0.3)
    masks = layer.sample_masks(3, 5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 3, 4)
    compiled = rnndrop.compile_model(layer, mode=None, backend=failing_backend("forward"))
    assert compiled.compiled and compiled.failure is None
    failed = (r"compile_model: the compiled model failed \(BackendCompilerFailed, RuntimeError: no lowering "
              r"for the forward graph\); it runs eagerly")
    with pytest.warns(RuntimeWarning, match=failed) as caught:
        actual = compiled(x, None, masks)
    assert len(caught) == 1 and "second line" not in str(caught[0].message)
    assert_close(actual, layer(x, None, masks), atol=0, rtol=0)
    assert not compiled.compiled and compiled.failure.startswith("BackendCompilerFailed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(compiled(x, None, masks), actual, atol=0, rtol=0)


def test_a_callers_mistake_is_raised_as_eager_raises_it_and_the_model_stays_compiled():
    """A call that fails eagerly too (an input of the wrong size) raises the layer's own error,
    and the model stays compiled; ``fallback=False`` raises the compiler's error itself."""
    layer = VariationalLSTM(4, 6, 1, dropout_hidden=0.3)
    compiled = rnndrop.compile_model(layer, mode=None, backend="eager")
    with pytest.raises(ValueError, match="input") as error:
        compiled(torch.randn(5, 3, 7))
    assert type(error.value) is ValueError and compiled.compiled
    assert compiled(torch.randn(5, 3, 4))[0].shape == (5, 3, 6) and compiled.compiled
    strict = rnndrop.compile_model(layer, mode=None, backend=failing_backend("forward"), fallback=False)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="no lowering for the forward graph"):
        strict(torch.randn(5, 3, 4))
    assert strict.compiled
    with pytest.raises(TypeError, match="fallback must be a bool, got str"):
        rnndrop.compile_model(layer, fallback="yes")


@pytest.mark.parametrize(("settings", "loops"), [
    ({}, False),
    ({"dropout_input": 0.3, "dropout_output": 0.3, "dropout": 0.3}, False),
    ({"dropout_input": 0.3, "mask_scope": "step"}, False),
    ({"dropout_hidden": 0.3}, True),
    ({"dropout_hidden": 0.3, "mask_scope": "step"}, True),
    ({"dropout_hidden": 0.3, "mask_scope": "batch"}, False),
    ({"dropout": 0.3, "mask_scope": "batch"}, False),
    ({"dropout_input": 0.3, "per_gate_masks": True}, True),
    ({"dropout": 0.3, "per_gate_masks": True}, True),
    ({"dropout_hidden": 0.3, "per_gate_masks": True, "mask_scope": "batch"}, True),
    ({"dropout_output": 0.3, "per_gate_masks": True}, False),
    ({"kernel": "manual"}, True),
])
def test_trains_in_loop_says_whether_a_training_call_runs_the_loop_kernel(settings, loops):
    """``trains_in_loop()`` against what a training call of an LSTM runs (the CPU makes the LSTM's
    choice as CUDA does: the fused op wherever no mask is inside a layer)."""
    layer = VariationalLSTM(4, 6, 2, **settings)
    ran: list[int] = []
    original = VariationalLSTM._layer_loop

    def spy(self, *args, **kwargs):
        ran.append(1)
        return original(self, *args, **kwargs)

    with mock.patch.object(VariationalLSTM, "_layer_loop", spy):
        layer(torch.randn(5, 3, 4))
    assert layer.trains_in_loop() is loops and bool(ran) is loops


def test_speeds_up_under_compile_on_cuda_where_a_layer_trains_in_its_loop():
    """``speeds_up_under_compile``: on CUDA for a model with a layer that trains in rnndrop's loop
    (recurrent masks per sequence), not for masks shared by the batch, torch's own LSTM (as
    WeightDrop wraps it), a model without dropout, nor anywhere on the CPU."""
    cuda = torch.device("cuda")
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), VariationalLSTM(4, 6, dropout_hidden=0.3))
    assert speeds_up_under_compile(tied, cuda) and not speeds_up_under_compile(tied, "cpu")
    assert not speeds_up_under_compile(tied)  # its parameters are on the CPU
    for model in (VariationalLSTM(4, 6, dropout_hidden=0.3, mask_scope="batch"), torch.nn.LSTM(4, 6),
                  VariationalGRU(4, 6), rnndrop.WeightDrop(torch.nn.LSTM(4, 6), ["weight_hh_l0"], 0.3)):
        assert not speeds_up_under_compile(model, cuda), model


def test_monte_carlo_prediction_through_a_compiled_model_samples_in_its_graph():
    """``mc_predict`` on ``compile_model(model)``: the layer's samples (stacked copies of the batch,
    under ``torch.no_grad``) run in the compiled graph (``fullgraph=True``: nothing outside it), each
    copy with masks of its own, fresh at every call; the model is in eval mode again afterwards."""
    torch.manual_seed(0)
    layer = VariationalLSTM(4, 16, dropout_hidden=0.3, dropout_output=0.3).eval()
    graphs: list = []
    compiled = rnndrop.compile_model(layer, mode=None, backend=counting_backend(graphs), fullgraph=True)
    x = torch.randn(6, 2, 4)
    first = rnndrop.mc_predict(compiled, x, 8, task="regression", batch_dim=1, return_samples=True)
    second = rnndrop.mc_predict(compiled, x, 8, task="regression", batch_dim=1, return_samples=True)
    assert len(graphs) >= 1 and not layer.training  # traced (training mode inside), eval mode again
    samples = first.samples  # [S, T, B, H]
    assert samples.shape == (8, 6, 2, 16)
    assert all(not torch.equal(samples[0], samples[k]) for k in range(1, 8))
    assert not torch.equal(first.mean, second.mean)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_under_autocast_a_layer_is_traced_where_its_loop_runs_as_an_operator(cell):
    """Under autocast a layer computes in the dtype ``nn.LSTM`` / ``nn.GRU`` would (asked of torch
    once, outside the graph: no probe of torch's fused op in it). On the CPU that is float32 for the
    GRU, whose loop is then the "compiled" kernel's operator: traced, with eager's results; and
    bfloat16 for the LSTM, whose loop is the "manual" kernel's: eager, with eager's results (CUDA's
    autocast dtype runs the "triton" kernel's operator: tests/triton_checks.py)."""
    torch.manual_seed(0)
    layer = (VariationalLSTM if cell == "lstm" else VariationalGRU)(
        4, 8, 2, dropout_input=0.3, dropout_hidden=0.3, dropout_output=0.3)
    masks = layer.sample_masks(3, 5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 3, 4)

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = layer(x, None, masks)
        return out.float().pow(2).sum(), out

    graphs: list = []

    def keep(gm, example_inputs):  # dynamo's own graphs: what it traced, before AOT autograd
        graphs.append(gm)
        return gm.forward

    expected = step(x)
    actual = torch.compile(step, backend=keep, fullgraph=cell == "gru")(x)
    assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert ("rnndrop.gru_recurrence.default" in targets) == (cell == "gru"), targets
    probes = {t for t in targets if t.startswith(("<built-in method lstm", "<built-in method gru"))}
    assert not probes, targets


@pytest.mark.parametrize("case", ["eval", "packed", "autocast", "manual kernel", "fused lstm"])
def test_calls_that_are_not_traced_run_eagerly_inside_the_graph(case):
    torch.manual_seed(0)
    scope = "batch" if case == "fused lstm" else "sequence"
    kernel = "manual" if case == "manual kernel" else "auto"
    layer = VariationalLSTM(4, 6, 2, dropout_input=0.3, dropout_hidden=0.3, mask_scope=scope, kernel=kernel)
    layer.train(case != "eval")
    x = torch.randn(5, 3, 4)
    masks = layer.sample_masks(3, 5, generator=torch.Generator().manual_seed(1))

    def call(x):
        if case == "packed":
            out = layer(pack_padded_sequence(x, torch.tensor([5, 3, 2])), None, masks)[0].data
        elif case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = layer(x, None, masks)[0]
        else:
            out = layer(x, None, masks if layer.training else None)[0]
        return out.float().sum(), out

    expected = call(x)
    actual = torch.compile(call, backend="aot_eager")(x)
    assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_weight_drop_around_torchs_lstm_compiles_and_runs_it_eagerly():
    """docs/usage.md's AWD pattern, ``WeightDrop(nn.LSTM)``, under ``compile_model`` (Inductor, on
    the CPU): the torch LSTM runs eagerly inside the graph (traced with ``allow_rnn``, Inductor
    failed on its fused op), its dropped weights drawn in the graph; eval mode is nn.LSTM's."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6)
    model = rnndrop.WeightDrop(lstm, ["weight_hh_l0"], p=0.5)
    compiled = rnndrop.compile_model(model)
    x = torch.randn(5, 3, 4)
    out, _ = compiled(x)
    out.sum().backward()
    assert out.shape == (5, 3, 6) and lstm.weight_hh_l0.grad.abs().sum() > 0
    again, _ = compiled(x)
    assert not torch.equal(out, again)  # fresh weight masks at every call
    model.eval()
    assert_close(compiled(x)[0], lstm(x)[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("torch_rnn", "fix"), [(torch.nn.LSTM, "VariationalLSTM.from_module"),
                                                (torch.nn.GRU, "VariationalGRU.from_module"),
                                                (torch.nn.RNN, "compile with torch.compile")])
def test_compile_model_names_a_torch_rnn_inductor_would_fail_on(torch_rnn, fix):
    """A torch RNN on the CPU outside a WeightDrop: a one-line error at compile_model naming it and
    the fix, not Inductor's ``mkldnn_rnn_layer`` error at the first call."""
    model = torch.nn.ModuleDict({"encoder": torch_rnn(4, 6), "decoder": VariationalLSTM(6, 6)})
    with pytest.raises(ValueError, match=f"submodule 'encoder' is torch's nn.* on the CPU.*{fix}"):
        rnndrop.compile_model(model)
    rnndrop.compile_model(model, backend="aot_eager")  # other backends compile torch's ops


@pytest.mark.parametrize(("case", "named"), [("eval", "eval mode"), ("packed", "packed sequence"),
                                              ("manual kernel", "kernel='manual'"),
                                              ("fused lstm", "mask_scope='batch'")])
def test_fullgraph_names_why_a_call_cannot_be_traced(case, named):
    """``compile_model(..., fullgraph=True)`` over a call that must run eagerly: dynamo's error
    quotes rnndrop's reason (the case, and what to do), not ``torch.compiler.disable`` itself,
    which it named when the eager wrapper was made while tracing."""
    torch.manual_seed(0)
    scope = "batch" if case == "fused lstm" else "sequence"
    kernel = "manual" if case == "manual kernel" else "auto"
    layer = VariationalLSTM(4, 6, 1, dropout_hidden=0.3, mask_scope=scope, kernel=kernel)
    layer.train(case != "eval")
    x = torch.randn(5, 3, 4)
    if case == "packed":
        x = pack_padded_sequence(x, torch.tensor([5, 3, 2]))
    compiled = rnndrop.compile_model(layer, mode=None, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="compile without fullgraph=True") as error:
        compiled(x)
    assert named in str(error.value) and "rnndrop: " in str(error.value)
    assert "Attempted to call function marked as skipped" not in str(error.value)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_step_replayed_from_cuda_graphs_by_torch_compile_matches_eager(cell):
    """torch.compile's CUDA-graph backend (what ``mode="reduce-overhead"`` replays) over a training
    step of a layer on the "triton" kernel: the persistent loops captured in the step's graphs,
    recorded once and replayed, against the eager layer with the same masks at every call."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    layer = (VariationalLSTM if cell == "lstm" else VariationalGRU)(
        16, 32, 2, dropout=0.3, dropout_input=0.3, dropout_hidden=0.3, dropout_output=0.3).to(device)

    def step(x, masks):
        out, _ = layer(x, None, masks)
        loss = (out * out).sum()
        return [loss.detach(), *torch.autograd.grad(loss, [x, *layer.parameters()])]

    compiled = torch.compile(step, backend="cudagraphs")
    for call in range(3):  # the first calls warm up and record, the last replays
        x = torch.randn(7, 20, 16, device=device, requires_grad=True)
        masks = layer.sample_masks(20, 7)
        expected = step(x, masks)
        assert_close([t.clone() for t in compiled(x, masks)], expected, atol=1e-5, rtol=1e-5,
                     msg=f"{cell}, call {call}")


@pytest.mark.parametrize("make", [
    pytest.param(lambda: rnndrop.GaussianLSTM(3, 4, 2, dropout_hidden=0.3), id="gaussian-lstm"),
    pytest.param(lambda: rnndrop.GaussianGRU(3, 4, dropout_hidden=0.3), id="gaussian-gru"),
    pytest.param(lambda: rnndrop.SparseLSTM(3, 4, 2), id="sparse-lstm"),
    pytest.param(lambda: rnndrop.SparseGRU(3, 4), id="sparse-gru"),
])
def test_the_gaussian_and_sparse_layers_compile_with_their_eager_results(make):
    """The layers that draw noise of their own (learned Gaussian noise, sparse weights) under
    ``compile_model`` (``aot_eager``: eager's random numbers): outputs and every gradient."""
    layer = make()
    x = torch.randn(5, 2, 3)
    results = []
    for call in (layer, rnndrop.compile_model(layer, mode=None, backend="aot_eager")):
        layer.zero_grad()
        torch.manual_seed(1)
        out = call(x)[0]
        out.sum().backward()
        results.append([out.detach(), *(p.grad.clone() for p in layer.parameters())])
    assert_close(results[1], results[0], atol=1e-6, rtol=1e-6)
