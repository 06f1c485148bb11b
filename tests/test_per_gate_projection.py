"""The input projection with one mask per gate (rnndrop.kernels.per_gate_projection): the same
values and gradients as masking a copy per gate (masked_linear), twice differentiable, less kept
for backward, and the path input_projection takes for per-gate masks."""

import pytest
import torch
from torch.testing import assert_close

from rnndrop.kernels import onednn
from rnndrop.kernels import per_gate_projection as per_gate_projection_module
from rnndrop.kernels.gates import masked_linear
from rnndrop.kernels.matmul import input_projection
from rnndrop.kernels.per_gate_projection import per_gate_projection

# (x, mask): padded steps with one mask a sequence, per step, shared by the batch; packed rows
CASES = [((5, 3, 7), (1, 3, 4, 7)), ((5, 3, 7), (5, 3, 4, 7)), ((5, 3, 7), (1, 1, 4, 7)), ((9, 7), (9, 4, 7))]


@pytest.mark.parametrize("x_shape, mask_shape", CASES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batched", [False, True], ids=["per gate", "batched (the CUDA path)"])
def test_matches_a_masked_copy_per_gate_twice_differentiably(x_shape, mask_shape, bias, batched, monkeypatch):
    if batched:
        monkeypatch.setattr(per_gate_projection_module, "BATCHED_DEVICES", {"cuda", "cpu"})
    torch.manual_seed(0)
    x = torch.randn(x_shape, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(mask_shape, dtype=torch.float64) * 2).requires_grad_()
    weight = torch.randn(12, 7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, dtype=torch.float64, requires_grad=True) if bias else None
    leaves = [t for t in (x, mask, weight, b) if t is not None]
    ours, ref = per_gate_projection(x, mask, weight, b), masked_linear(x, mask, weight, b)
    assert_close(ours, ref, atol=1e-12, rtol=0)
    d_out = torch.randn_like(ref)
    assert_close(torch.autograd.grad(ours, leaves, d_out), torch.autograd.grad(ref, leaves, d_out),
                 atol=1e-12, rtol=0)

    def projection(*args):
        return per_gate_projection(args[0], args[1], args[2], args[3] if bias else None)

    assert torch.autograd.gradcheck(projection, leaves)
    assert torch.autograd.gradgradcheck(projection, leaves)


@pytest.mark.parametrize(("cpu_family", "large", "onednn_calls"),
                         [(25, False, 0), (25, True, 4), (26, False, 12)])
def test_float32_first_order_without_mask_gradient(cpu_family, large, onednn_calls, monkeypatch):
    """The usual case: masks that need no gradient, float32 (the in-place backward), the
    products through BLAS or oneDNN: on a Zen 3 / 4 the forward's where every weight counts as
    large, on a Zen 5 (CPU family 26) forward and backward at any size."""
    monkeypatch.setattr(onednn, "amd_cpu_family", lambda: cpu_family)
    monkeypatch.setattr(onednn, "ONEDNN_MIN_WEIGHT", 0 if large else 10**12)
    torch.manual_seed(1)
    x = torch.randn(35, 20, 30, requires_grad=True)
    mask = torch.bernoulli(torch.full((1, 20, 4, 30), 0.5)) * 2
    weight = torch.randn(4 * 16, 30, requires_grad=True)
    bias = torch.randn(4 * 16, requires_grad=True)
    # 4 gates' products forward, 8 backward (d(x * M_g) and dW_g each); its probe runs first
    expected_calls = onednn_calls if onednn.onednn_enabled(x) else 0
    with torch.autograd.profiler.profile() as profile:
        ours = per_gate_projection(x, mask, weight, bias)
        d_out = torch.randn_like(ours)
        grads = torch.autograd.grad(ours, (x, weight, bias), d_out)
    ref = masked_linear(x, mask, weight, bias)
    assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert_close(grads, torch.autograd.grad(ref, (x, weight, bias), d_out), atol=1e-4, rtol=1e-5)
    calls = [e for e in profile.function_events if e.name == "mkldnn::_linear_pointwise"]
    assert len(calls) == expected_calls


def _saved_bytes(fn) -> int:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(unique.values())


def test_keeps_the_input_and_mask_for_backward_not_a_masked_copy_per_gate():
    x = torch.randn(35, 20, 64, requires_grad=True)
    mask = torch.bernoulli(torch.full((1, 20, 4, 64), 0.5)) * 2
    weight = torch.randn(4 * 64, 64, requires_grad=True)
    ours = _saved_bytes(lambda: per_gate_projection(x, mask, weight))
    copies = _saved_bytes(lambda: masked_linear(x, mask, weight))
    assert ours == x.nbytes + mask.nbytes + weight.nbytes
    assert copies >= 4 * x.nbytes


def test_input_projection_takes_it_for_per_gate_masks_only():
    x = torch.randn(6, 2, 5, requires_grad=True)
    weight = torch.randn(4 * 3, 5, requires_grad=True)
    per_gate = input_projection(x, torch.rand(1, 2, 4, 5), weight)
    assert type(per_gate.grad_fn).__name__ == "_PerGateProjectionBackward"
    shared = input_projection(x, torch.rand(1, 2, 5), weight)
    assert "PerGate" not in type(shared.grad_fn).__name__
    # a mask that would broadcast x to more rows than it has is left to masked_linear
    wider = input_projection(x[:1], torch.rand(6, 2, 4, 5), weight)
    assert wider.shape == (6, 2, 12) and "PerGate" not in type(wider.grad_fn).__name__
