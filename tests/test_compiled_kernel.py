"""The "compiled" loop kernel (C++ time loops): against the reference kernel, nn.LSTM / nn.GRU
and the autograd layer; kernel="auto" picks it on CPU; without it, "manual" runs after one warning.

The extension is built (or loaded from torch's cache) once per session by ``tests/conftest.py``.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rnndrop import VariationalGRU, VariationalLSTM
from rnndrop.kernels import (
    DEFAULT_LOOP_KERNEL,
    auto_loop_kernel,
    compiled,
    compiled_cache,
    get_kernel,
    onednn,
)
from rnndrop.kernels.onednn import onednn_enabled
from tests import helpers
from tests.helpers import assert_close

pytestmark = [
    pytest.mark.filterwarnings("ignore:LSTM with projections is not supported"),
    pytest.mark.usefixtures("needs_compiled_kernel"),  # CI has g++ and ninja: no kernel is a failure
]

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------ the kernel against the reference kernel


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_matches_reference_kernel_in_float64(kind, reverse):
    """Every packed layout, mask shape (shared / per gate, T' and B' in {1, full}), projection,
    with and without the mask's gradient: outputs, final states, gradients of every input."""
    helpers.check_kernel_matches_reference_kernel("compiled", kind, reverse)


@pytest.mark.parametrize("reverse", [False, True])
def test_gru_without_recurrent_bias_matches_reference_kernel(reverse):
    for batch_sizes in helpers.BATCH_SIZES:
        for mask_shape in (None, ("T", "B", "P"), (1, "B", "G", "P")):
            args = helpers.kernel_inputs("gru", batch_sizes, mask_shape, 0)
            args[3] = None  # b_hh
            ours = helpers.run_kernel("compiled", "gru", batch_sizes, args, reverse)
            ref = helpers.run_kernel("autograd", "gru", batch_sizes, args, reverse)
            assert len(ours[1]) == len(ref[1])
            assert_close(ours, ref, atol=1e-10, rtol=1e-8, msg=f"{batch_sizes} {mask_shape}")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_matches_reference_kernel_in_float32(kind):
    """At 1e-5, with weights on nn.LSTM's scale (1 / sqrt(size)): unscaled random weights
    saturate the gates and amplify float32 rounding differences beyond it."""
    cases = [
        ([4, 3, 3, 1], (1, "B", "P"), 0, False),
        ([3, 3, 2], ("T", "B", "G", "P"), 0, True),
        ([4, 4, 2], None, 3, True),
        ([5, 5, 5], ("T", 1, "P"), 3, False),
    ]
    for batch_sizes, mask_shape, proj, reverse in cases:
        if kind == "gru" and proj:
            continue
        args = helpers.kernel_inputs(kind, batch_sizes, mask_shape, proj, dtype=torch.float32, H=40)
        with torch.no_grad():
            for weight in args[3:5] if kind == "lstm" else args[2:3]:
                if weight is not None:
                    weight /= weight.shape[1] ** 0.5
        ours = helpers.run_kernel("compiled", kind, batch_sizes, args, reverse)
        ref = helpers.run_kernel("autograd", kind, batch_sizes, args, reverse)
        assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=f"{batch_sizes} mask {mask_shape} proj {proj}")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_saturated_gates_match_reference_kernel_in_float32(kind):
    """The kernel's own σ and tanh (a polynomial e^x, clamped where float32's e^x would leave
    the normal range) against ATen's, where the pre-activations reach far into saturation:
    every gate at 0, ±0.5, ±20, ±90, ±200 and ±1e4, outputs and gradients."""
    levels = torch.tensor([0.0, 0.5, 20.0, 90.0, 200.0, 1e4])
    levels = torch.cat([levels, -levels[1:]])
    for batch_sizes, mask_shape in (([4, 3, 3, 1], (1, "B", "P")), ([3, 3, 2], None)):
        args = helpers.kernel_inputs(kind, batch_sizes, mask_shape, 0, dtype=torch.float32, H=40)
        with torch.no_grad():
            picks = torch.randint(len(levels), args[0].shape, generator=torch.Generator().manual_seed(0))
            args[0].copy_(levels[picks])
            weight = args[3] if kind == "lstm" else args[2]
            weight /= weight.shape[1] ** 0.5
        ours = helpers.run_kernel("compiled", kind, batch_sizes, args, False)
        ref = helpers.run_kernel("autograd", kind, batch_sizes, args, False)
        assert all(torch.isfinite(t).all() for t in ours[0] + ours[1])
        assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=f"{batch_sizes} mask {mask_shape}")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_matches_reference_kernel_with_two_threads(kind):
    """Wide rows (H 256) with two threads, where ATen may run the step's products and σ threaded
    and the kernel splits the rows of its passes over the threads (more than 2048 / 256 rows)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for mask_shape in (None, ("T", "B", "P"), ("T", "B", "G", "P")):
            args = helpers.kernel_inputs(kind, [12, 12, 9], mask_shape, 0, H=256)
            for reverse in (False, True):
                ours = helpers.run_kernel("compiled", kind, [12, 12, 9], args, reverse)
                ref = helpers.run_kernel("autograd", kind, [12, 12, 9], args, reverse)
                assert_close(ours, ref, atol=1e-10, rtol=1e-8, msg=f"{mask_shape} reverse {reverse}")
                with torch.no_grad():  # the inference forward, its rows split too
                    inferred = get_kernel("compiled", kind)(args[0], [12, 12, 9], *args[1:], reverse)
                assert_close(list(inferred), ours[0], atol=1e-10, rtol=1e-8, msg=f"no_grad {mask_shape}")
    finally:
        torch.set_num_threads(threads)


def test_parallel_loops_run_on_every_thread():
    """The extension's at::parallel_for is compiled into it: built without OpenMP it would run
    every "parallel" loop on one thread whatever torch.get_num_threads() says."""
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert compiled.build().parallel_threads() == n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("threads, H", [(2, 80), (3, 100)])
def test_forward_split_by_units_matches_reference_kernel(threads, H, dtype):
    """The LSTM's forward step split by hidden units over the threads (padded input, one mask,
    per-gate masks or none; uneven parts with 3 threads): outputs, final states and gradients,
    every direction, the inference forward (no_grad, inference_mode) equal to the training
    forward bit for bit."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    try:
        for batch_sizes in ([3, 3, 3, 3], [2]):
            for mask_shape in (None, (1, 1, "P"), (1, "B", "P"), ("T", "B", "P"), ("T", 1, "P"),
                               (1, "B", "G", "P"), ("T", "B", "G", "P"), (1, 1, "G", "P")):
                args = helpers.kernel_inputs("lstm", batch_sizes, mask_shape, 0, dtype=dtype, H=H)
                with torch.no_grad():
                    args[3] /= H**0.5
                parts = compiled.split_parts(args[3], None, [], batch_sizes)
                assert parts == min(threads, H // 32)  # the split runs
                for reverse in (False, True):
                    where = f"{batch_sizes} mask {mask_shape} reverse {reverse}"
                    ours = helpers.run_kernel("compiled", "lstm", batch_sizes, args, reverse)
                    ref = helpers.run_kernel("autograd", "lstm", batch_sizes, args, reverse)
                    assert_close(ours, ref, atol=tol, rtol=tol, msg=where)
                    with torch.no_grad():
                        inferred = get_kernel("compiled", "lstm")(args[0], batch_sizes, *args[1:], reverse)
                    assert all(torch.equal(a, b) for a, b in zip(inferred, ours[0], strict=True)), where
                    with torch.inference_mode():  # the other threads' products run in it too
                        inferred = get_kernel("compiled", "lstm")(args[0], batch_sizes, *args[1:], reverse)
                    assert all(torch.equal(a, b) for a, b in zip(inferred, ours[0], strict=True)), where
    finally:
        torch.set_num_threads(saved)


HOOKS_WITH_THREADS = textwrap.dedent(
    """
    import torch
    from rnndrop import VariationalLSTM
    torch.set_num_threads(2)
    x = torch.randn(6, 4, 64)
    for per_gate in (False, True):  # the forward step split by units over the two threads
        layer = VariationalLSTM(64, 64, dropout_hidden=0.3, per_gate_masks=per_gate, kernel="compiled")
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            layer(x)[0].sum().backward()
        with torch.autograd.graph.save_on_cpu():
            layer(x)[0].sum().backward()
    print("done")
    """
)


def test_several_threads_under_saved_tensor_hooks_do_not_deadlock():
    """The threads of a step split by units used to copy the caller's whole thread-local state,
    saved-tensor hooks (Python objects) included, and waited for the GIL the caller held: a
    process that hung for good under saved_tensors_hooks / save_on_cpu. A subprocess, so that a
    hang is a timeout, not a hung test run."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", HOOKS_WITH_THREADS], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]


def test_forward_split_by_units_only_where_it_applies():
    """Several threads, padded input, no projection, BLAS products, 32 units a part (any mask)."""
    w = torch.randn(4 * 200, 200)
    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert compiled.split_parts(w, None, [], [20] * 5) == 0
        torch.set_num_threads(2)
        assert compiled.split_parts(w, None, [], [20] * 5) == 2  # with a mask or without, per gate or not
        assert compiled.split_parts(w, torch.randn(200, 50), [], [20] * 5) == 0  # projection
        assert compiled.split_parts(w, None, [torch.empty(0)], [20] * 5) == 0  # oneDNN's products
        assert compiled.split_parts(w, None, [], [20, 20, 19]) == 0  # packed sequences
        assert compiled.split_parts(w, None, [], []) == 0  # no step
        narrow = torch.randn(4 * 63, 63)  # under 32 units a part
        assert compiled.split_parts(narrow, None, [], [20] * 5) == 0
    finally:
        torch.set_num_threads(with_threads)


@pytest.mark.parametrize("through_onednn", [False, True])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_inference_forward_equals_training_forward(kind, through_onednn, monkeypatch):
    """Under no_grad the kernel keeps one step's rows instead of the buffers backward reads:
    the same outputs and final states, bit for bit, in every layout, mask shape and projection
    (float32 with oneDNN's packed products too)."""
    if through_onednn:
        monkeypatch.setattr(onednn, "ONEDNN_MIN_WEIGHT", 0)
    dtype = torch.float32 if through_onednn else torch.float64
    kernel = get_kernel("compiled", kind)
    for batch_sizes in helpers.BATCH_SIZES:
        for mask_shape in helpers.MASK_SHAPES:
            for proj in [0, 3] if kind == "lstm" else [0]:
                args = helpers.kernel_inputs(kind, batch_sizes, mask_shape, proj, dtype=dtype)
                for reverse in (False, True):
                    trained = kernel(args[0], batch_sizes, *args[1:], reverse)
                    assert trained[0].requires_grad  # the differentiable path ran
                    with torch.no_grad():
                        inferred = kernel(args[0], batch_sizes, *args[1:], reverse)
                    where = f"{batch_sizes} mask {mask_shape} proj {proj} reverse {reverse}"
                    for ours, ref in zip(inferred, trained, strict=True):
                        assert torch.equal(ours, ref.detach()), where
    # A projection's product of rows kept at an odd offset (hidden 5, 5 or 7 rows a step): BLAS
    # summed them in another order than the same rows of inference's buffer (1 ulp apart).
    for batch_sizes in ([5, 5], [7, 7, 7]) if kind == "lstm" else ():
        args = helpers.kernel_inputs(kind, batch_sizes, None, 1, dtype=dtype, H=5)
        trained = kernel(args[0], batch_sizes, *args[1:], False)
        with torch.no_grad():
            inferred = kernel(args[0], batch_sizes, *args[1:], False)
        for ours, ref in zip(inferred, trained, strict=True):
            assert torch.equal(ours, ref.detach()), f"{batch_sizes} hidden 5 proj 1"


def test_onednn_products_chosen_by_weight_size_and_rows(monkeypatch):
    """Packed oneDNN products for large weights at any batch, for mid-sized ones only with many
    rows (on AMD Zen 5: from 100 k elements at any rows), never for small ones or float64; with
    per-gate masks one a gate, judged by its size."""
    def packed(h, rows, dtype=torch.float32, mask=None):
        return len(compiled.packed_weights(torch.randn(4 * h, h, dtype=dtype), mask, rows))

    one = int(onednn_enabled(torch.randn(2, 2)))
    monkeypatch.setattr(onednn, "amd_cpu_family", lambda: 25)  # Zen 3 / 4 (and any other CPU)
    assert packed(400, 1) == one and packed(400, 20) == one
    assert packed(200, 20) == 0 and packed(200, 64) == one
    assert packed(100, 1024) == 0
    assert packed(400, 20, dtype=torch.float64) == 0
    assert packed(650, 20, mask=torch.ones(1, 20, 4, 650)) == 4 * one  # 422 k a gate
    assert packed(400, 20, mask=torch.ones(1, 20, 4, 400)) == 0  # 160 k a gate, 20 rows
    monkeypatch.setattr(onednn, "amd_cpu_family", lambda: 26)  # Zen 5
    assert packed(200, 20) == one and packed(200, 1) == one
    assert packed(150, 20) == 0  # 90 k
    assert packed(400, 20, mask=torch.ones(1, 20, 4, 400)) == 4 * one  # 160 k a gate


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_onednn_products_match_reference_kernel(kind, monkeypatch):
    """The oneDNN path of the step products (large float32 weights; here every weight), per-gate
    masks with one packed weight a gate."""
    monkeypatch.setattr(onednn, "ONEDNN_MIN_WEIGHT", 0)
    cases = [([4, 3, 3, 1], (1, "B", "P"), False), ([3, 3, 2], None, True),
             ([4, 3, 3, 1], ("T", "B", "G", "P"), True), ([3, 3, 2], (1, 1, "G", "P"), False)]
    for batch_sizes, mask_shape, reverse in cases:
        args = helpers.kernel_inputs(kind, batch_sizes, mask_shape, 0, dtype=torch.float32, H=40)
        with torch.no_grad():
            weight = args[3] if kind == "lstm" else args[2]
            weight /= weight.shape[1] ** 0.5
        # With oneDNN the step products go through its packed weights; a torch without it
        # runs the same comparison through BLAS.
        packed = compiled.packed_weights(weight, args[-1], batch_sizes[0])
        gates = 1 if mask_shape is None or len(mask_shape) == 3 else weight.shape[0] // 40
        assert len(packed) == (gates if onednn_enabled(weight) else 0)
        ours = helpers.run_kernel("compiled", kind, batch_sizes, args, reverse)
        ref = helpers.run_kernel("autograd", kind, batch_sizes, args, reverse)
        assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=f"{batch_sizes} mask {mask_shape}")
        if kind == "gru":
            args[3] = None  # no b_hh
            ours = helpers.run_kernel("compiled", kind, batch_sizes, args, reverse)
            ref = helpers.run_kernel("autograd", kind, batch_sizes, args, reverse)
            assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=f"no bias {batch_sizes} mask {mask_shape}")


@pytest.mark.parametrize("kind, threads", [("gru", 2), ("lstm", 3)])
def test_per_gate_onednn_products_cut_to_share_the_threads_match_reference_kernel(kind, threads, monkeypatch):
    """Where the gates do not divide the threads evenly (3 gates on 2 threads, 4 on 3), each
    gate's packed product is cut into blocks of output rows (forward W_g, backward W_gᵀ):
    the same outputs and gradients as the reference kernel, packed and padded steps."""
    monkeypatch.setattr(onednn, "ONEDNN_MIN_WEIGHT", 0)
    with_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for batch_sizes in ([6, 6, 6, 6], [6, 5, 3, 1]):
            args = helpers.kernel_inputs(
                kind, batch_sizes, ("T", "B", "G", "P"), 0, dtype=torch.float32, H=96
            )
            with torch.no_grad():
                weight = args[3] if kind == "lstm" else args[2]
                weight /= weight.shape[1] ** 0.5
            gates = weight.shape[0] // 96
            parts = compiled.gate_parts(gates, 96)
            assert parts == threads // math.gcd(gates, threads) > 1
            packed = compiled.packed_weights(weight, args[-1], batch_sizes[0])
            assert len(packed) == (gates * parts if onednn_enabled(weight) else 0)
            for reverse in (False, True):
                ours = helpers.run_kernel("compiled", kind, batch_sizes, args, reverse)
                ref = helpers.run_kernel("autograd", kind, batch_sizes, args, reverse)
                assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=f"{batch_sizes} reverse {reverse}")
    finally:
        torch.set_num_threads(with_threads)


@pytest.mark.parametrize("cpu_family", [25, 26])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_weight_gradient_through_onednn_on_zen5_matches_reference_kernel(kind, cpu_family, monkeypatch):
    """On a Zen 5 (CPU family 26) the extension computes dW_hh through oneDNN, elsewhere through
    BLAS; either way the reference kernel's gradients, for per-sequence, per-step and per-gate
    masks, and only the wanted ones (here W_hh's alone, too)."""
    monkeypatch.setattr(onednn, "amd_cpu_family", lambda: cpu_family)
    asked = []
    extension = compiled.build()

    class Recording:
        def __getattr__(self, name):
            found = getattr(extension, name)
            if not name.endswith("_backward"):
                return found
            return lambda **kw: asked.append(kw["onednn_weight_grad"]) or found(**kw)

    monkeypatch.setattr(compiled, "build", Recording)
    w = 3 if kind == "lstm" else 2  # W_hh among the kernel's arguments
    for mask_shape in ((1, "B", "P"), ("T", "B", "P"), (1, "B", "G", "P")):
        args = helpers.kernel_inputs(kind, [4, 3, 3, 1], mask_shape, 0, dtype=torch.float32, H=40)
        with torch.no_grad():
            args[w] /= args[w].shape[1] ** 0.5
        ours = helpers.run_kernel("compiled", kind, [4, 3, 3, 1], args, False)
        ref = helpers.run_kernel("autograd", kind, [4, 3, 3, 1], args, False)
        assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=str(mask_shape))
        only_w = [a if a is None or k == w else a.detach() for k, a in enumerate(args)]
        ours = helpers.run_kernel("compiled", kind, [4, 3, 3, 1], only_w, False)
        ref = helpers.run_kernel("autograd", kind, [4, 3, 3, 1], only_w, False)
        assert len(ours[1]) == 1 and ours[1][0].shape == args[w].shape
        assert_close(ours, ref, atol=1e-5, rtol=1e-5, msg=f"W_hh only, {mask_shape}")
    assert asked == [cpu_family == 26 and onednn_enabled(args[w])] * 6


def test_only_wanted_gradients_are_returned():
    """Inputs without requires_grad get None (and the others are still right)."""
    args = helpers.kernel_inputs("lstm", [3, 2, 1], ("T", "B", "P"), 2, mask_grad=False)
    for frozen in (1, 2, 3):
        args[frozen] = args[frozen].detach()
    ours = helpers.run_kernel("compiled", "lstm", [3, 2, 1], args, True)
    ref = helpers.run_kernel("autograd", "lstm", [3, 2, 1], args, True)
    assert len(ours[1]) == 2  # gates_x, w_hr
    assert_close(ours, ref, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_passes_gradcheck(kind):
    helpers.check_kernel_passes_gradcheck("compiled", kind)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_graph_of_the_backward_is_refused_not_silently_wrong(cell):
    helpers.check_a_graph_of_the_backward_is_refused_not_silently_wrong("compiled", cell)


def test_rejects_tensors_it_cannot_run():
    args = helpers.kernel_inputs("gru", [2, 2], None, 0, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="float32 and float64 tensors, got torch.float16"):
        get_kernel("compiled", "gru")(args[0], [2, 2], *args[1:])


@pytest.mark.parametrize("layer_cls", [VariationalLSTM, VariationalGRU])
def test_a_layer_built_with_it_names_the_fix_for_a_dtype_it_cannot_run(layer_cls):
    """kernel="compiled" is a choice of the user's (the layer runs it even in eval mode): on half
    or bfloat16 tensors the error names the argument that fixes it, not the C++ function."""
    layer = layer_cls(3, 4, kernel="compiled").to(torch.bfloat16).eval()
    with pytest.raises(RuntimeError, match=r"got torch.bfloat16; build the layer with kernel='auto'"):
        layer(torch.randn(5, 2, 3, dtype=torch.bfloat16))


# ------------------------------------------------------------------ in the layers


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_without_dropout_matches_torch(kind):
    helpers.check_layer_without_dropout_matches_torch("compiled", kind)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_in_float64_matches_torch(kind):
    helpers.check_layer_in_float64_matches_torch("compiled", kind)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_with_masks_matches_autograd_kernel(kind):
    helpers.check_layer_with_masks_matches_reference_kernel("compiled", kind)


def test_layer_passes_gradcheck_through_explicit_masks():
    helpers.check_layer_passes_gradcheck_through_explicit_masks("compiled")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_auto_runs_the_compiled_kernel_in_training(kind, monkeypatch):
    """kernel="auto" with masks on CPU: the compiled kernel runs (counted) and the layer
    matches kernel="autograd" with the same explicit masks."""
    assert auto_loop_kernel(torch.ones(1)) == "compiled"
    assert auto_loop_kernel(torch.ones(1, dtype=torch.float16)) == DEFAULT_LOOP_KERNEL
    function = compiled._LSTMRecurrence if kind == "lstm" else compiled._GRURecurrence
    calls = []
    original = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or original(*a))
    cls = VariationalLSTM if kind == "lstm" else VariationalGRU
    layers = [
        cls(helpers.I, helpers.H, num_layers=2, bidirectional=True, dropout=0.3, dropout_hidden=0.5, kernel=k)
        for k in ("auto", "autograd")
    ]
    layers[1].load_state_dict(layers[0].state_dict())
    masks = layers[0].sample_masks(helpers.B, helpers.T)
    x = torch.randn(helpers.T, helpers.B, helpers.I, requires_grad=True)
    hx = helpers.initial_state(kind, layers[0], helpers.B)
    ours = helpers.forward_and_grads(layers[0], x, hx, masks)
    assert len(calls) == 4  # 2 layers x 2 directions
    assert_close(ours, helpers.forward_and_grads(layers[1], x, hx, masks))


# ------------------------------------------------------------------ without a compiler

FALLBACK = textwrap.dedent(
    """
    import json, warnings
    import torch
    from rnndrop import VariationalLSTM
    from rnndrop.kernels import auto_loop_kernel, compiled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answers = [compiled.is_available(), compiled.is_available()]
        chosen = auto_loop_kernel(torch.ones(1))
        torch.manual_seed(0)
        layers = [VariationalLSTM(3, 4, dropout_hidden=0.5, kernel=k) for k in ("auto", "manual")]
        layers[1].load_state_dict(layers[0].state_dict())
        masks = layers[0].sample_masks(2, 5)
        x = torch.randn(5, 2, 3)
        outs = [layer(x, masks=masks)[0] for layer in layers]
    try:
        h0 = c0 = torch.ones(1, 4)
        compiled.lstm_recurrence(torch.ones(1, 16), [1], h0, c0, torch.ones(16, 4), None, None)
        explicit = "ran"
    except RuntimeError as error:
        explicit = str(error)
    print(json.dumps(dict(
        answers=answers, chosen=chosen, same=bool(torch.equal(outs[0], outs[1])), explicit=explicit,
        warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    )))
    """
)


def test_without_compiler_auto_warns_once_and_runs_manual():
    env = dict(os.environ, RNNDROP_NO_COMPILE="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["answers"] == [False, False]
    assert result["chosen"] == "manual"
    assert result["same"]
    assert "RNNDROP_NO_COMPILE" in result["explicit"]
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "RNNDROP_NO_COMPILE" in result["warnings"][0] and "'manual'" in result["warnings"][0]


def test_a_compiler_that_fails_is_a_reason_to_fall_back_not_a_traceback(monkeypatch, tmp_path):
    """A compiler that fails (CXX=/bin/false, a compile error) is a reason the kernel is not
    available, with the first error line, so kernel='auto' falls back to 'manual', not a traceback;
    nothing is left in the cache folder."""
    for name, value in (("_extension", None), ("_failure", None), ("_warned", False), ("_background", None)):
        monkeypatch.setattr(compiled, name, value)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "_missing_tool", lambda: None)
    monkeypatch.setattr(compiled_cache, "_COMPILE", "raise SystemExit('c++: error: /bin/false failed')")
    with pytest.raises(RuntimeError, match="the compiled loop kernel is not available: the build failed: "
                                           "c\\+\\+: error: /bin/false failed"):
        compiled.build()
    assert not list((tmp_path / compiled.NAME).glob("build-*"))
    assert not (tmp_path / compiled.NAME / f"{compiled.NAME}.so").exists()


def test_a_failed_build_is_summed_up_by_the_line_that_says_why():
    """The compiler's first error; for a compiler that cannot run at all, the exception torch's
    traceback ended with, not a source line of that traceback (reliability probe case 352)."""
    traceback = ("Traceback (most recent call last):\n  File \"subprocess.py\", line 571, in run\n"
                 "    raise CalledProcessError(retcode, process.args,\n"
                 "subprocess.CalledProcessError: Command '['/bin/false', '--version']' returned "
                 "non-zero exit status 1.\n")
    raised = "subprocess.CalledProcessError: Command '['/bin/false'"
    assert compiled_cache._complaint(traceback, 1).startswith(raised)
    compiler = "In file included from x.cpp:1:\nx.cpp:3:1: error: expected ';' before '}'\n" + traceback
    assert compiled_cache._complaint(compiler, 1) == "x.cpp:3:1: error: expected ';' before '}'"
    assert compiled_cache._complaint("", 2) == "exit status 2"


@pytest.mark.parametrize("when", ["before", "during"])
def test_sources_changed_since_import_are_not_built_into_this_process(monkeypatch, tmp_path, when):
    """A job that runs while rnndrop is upgraded or edited: its Python side (in memory) no longer
    fits the C++ on disk. The build is refused (the layer falls back to 'manual' with one warning)
    instead of loading a library whose functions take other arguments; a library compiled while the
    sources changed is never put in the cache, where it would sit under the wrong name."""
    sources_now = [compiled.NAME]

    def compile(self, *args, **kwargs):
        sources_now[0] = "rnndrop_loop_kernels_edited"  # the edit lands while it compiles
        work = self.folder / "build-here"
        work.mkdir()
        (work / f"{self.name}.so").write_bytes(b"built")
        return work / f"{self.name}.so"

    for name, value in (("_extension", None), ("_failure", None), ("_warned", False), ("_background", None)):
        monkeypatch.setattr(compiled, name, value)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RNNDROP_COMPILE_WAIT", "1")
    monkeypatch.setattr(compiled, "_missing_tool", lambda: None)
    monkeypatch.setattr(compiled_cache.Cache, "compile", compile)
    monkeypatch.setattr(compiled, "_build_name", lambda: sources_now[0])
    if when == "before":
        sources_now[0] = "rnndrop_loop_kernels_edited"
    with pytest.warns(RuntimeWarning, match="sources changed on disk after rnndrop was imported.*restart"):
        assert not compiled.is_available()
    folder = tmp_path / compiled.NAME
    assert not (folder / f"{compiled.NAME}.so").exists() and not (folder / "build-here").exists()


def test_build_command_says_where_the_kernel_is_or_why_not(compiled_kernel):
    """``python -m rnndrop.kernels``: the cached build and its path, no runpy warning; without
    a kernel, one line and exit status 1."""
    command = [sys.executable, "-m", "rnndrop.kernels"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "built and cached" in done.stdout and "Warning" not in done.stderr
    env = {**os.environ, "RNNDROP_NO_COMPILE": "1"}
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines() == ["rnndrop: the compiled loop kernel is not available: "
                                                   "disabled by RNNDROP_NO_COMPILE"]


# ------------------------------------------------ the boundary with C++ (csrc/kernels.h)


def test_every_struct_crossing_the_boundary_has_the_fields_of_its_python_side(needs_compiled_kernel):
    """Each C++ struct that compiled.py fills or reads has exactly the fields of the NamedTuple
    that names them in Python: the saved state, the inputs, and per input a need and a gradient."""
    ext = needs_compiled_kernel
    pairs = {
        "LSTMSaved": compiled.LSTMSaved, "GRUSaved": compiled.GRUSaved,
        "LSTMInputs": compiled.LSTMInputs, "LSTMNeeds": compiled.LSTMInputs, "LSTMGrads": compiled.LSTMInputs,
        "GRUInputs": compiled.GRUInputs, "GRUNeeds": compiled.GRUInputs, "GRUGrads": compiled.GRUInputs,
    }
    for struct, fields in pairs.items():
        assert compiled._fields(getattr(ext, struct)) == set(fields._fields), struct
    assert compiled._fields(ext.LSTMOutputGrads) == {"out", "h_n", "c_n"}
    assert compiled._fields(ext.GRUOutputGrads) == {"out", "h_n"}


def test_a_struct_is_filled_by_name_or_refused(needs_compiled_kernel):
    """A field left out or named wrong is an error naming the struct's fields, not a tensor
    passed on to another parameter."""
    ext = needs_compiled_kernel
    schedule = compiled._struct(ext.Schedule, batch_sizes=[2, 1], reverse=True)
    assert schedule.batch_sizes == [2, 1] and schedule.reverse is True
    fields = r"Schedule has the fields \['batch_sizes', 'reverse'\], got \['batch_sizes'\]"
    with pytest.raises(ValueError, match=fields):
        compiled._struct(ext.Schedule, batch_sizes=[2, 1])
    with pytest.raises(ValueError, match="LSTMOutputGrads has the fields"):
        compiled._struct(ext.LSTMOutputGrads, out=None, h_n=None, c_n=None, d_out=None)
