"""The matrix products of the loop kernels, on the fastest path torch has for them.

A recurrence multiplies a few rows by the same weight at every step
(``[B, P] x [P, G * H]`` forward, ``[B, G * H] x [G * H, P]`` backward). On CPU in
float32, torch's oneDNN build runs these from a weight packed once per call
(``torch.ops.mkldnn._linear_pointwise``, the op ``torch.compile`` emits for
``nn.Linear`` on CPU); elsewhere (CUDA, float64, a build without oneDNN, oneDNN
disabled by ``torch.backends.mkldnn.flags(enabled=False)``) they go to
``torch.mm`` with a contiguous transposed weight. The choice is made by
capability: whatever the CPU vendor, an op that is missing or fails on a tiny
probe sends every product to the fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rnndrop.kernels.first_order import grads_like, needed, register_first_order, transformed
from rnndrop.kernels.gates import masked_linear
from rnndrop.kernels.onednn import matmul, onednn_enabled, onednn_enabled_on
from rnndrop.kernels.per_gate_projection import per_gate_projection, per_gate_projection_op
from rnndrop.kernels.precision import products_as_cudnn
from rnndrop.tracing import constant_for_compile, tracing_for_compile


class StepWeight:
    """One weight ``W`` ``[out, in]`` prepared for many products ``x @ W^T`` with few rows.

    Prepare it once per kernel call (outside the time loop); it is a constant of the
    call, never a parameter. ``pack``: reorder ``W`` into oneDNN's blocked layout,
    which pays off when ``W`` is contiguous (forward: ``W_hh``); for a transposed view
    (backward: ``W_hh^T``) the reorder costs more than the 35 products it speeds up
    at the Zaremba shapes, so oneDNN reads it in place.
    """

    def __init__(self, weight: Tensor, pack: bool = True) -> None:
        weight = weight.detach()
        self.onednn = onednn_enabled(weight)
        if self.onednn:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if pack else weight
        else:
            self.transposed = weight.t().contiguous()

    def __call__(self, x: Tensor, add: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
        """``x @ W^T + add + bias``: ``x`` ``[b, in]``, ``add`` ``[b, out]`` (contiguous),
        ``bias`` ``[out]`` -> a new ``[b, out]``."""
        if self.onednn:
            if add is not None:
                return torch.ops.mkldnn._linear_pointwise.binary(x, add, self.weight, bias, "add")
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")
        if add is not None:
            out = torch.addmm(add, x, self.transposed)
            return out if bias is None else out.add_(bias)
        if bias is not None:
            return torch.addmm(bias, x, self.transposed)
        return torch.mm(x, self.transposed)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ W^T + b`` of :class:`_Linear`'s forward pass (CUDA or oneDNN), without autograd."""
    if x.is_cuda:
        with products_as_cudnn(x):
            return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _linear_grads(d_out: Tensor, x: Tensor, weight: Tensor, needs: Sequence[bool], has_bias: bool):
    """``(d_x, d_w, d_b)`` of ``x @ W^T + b`` (None where not ``needs``), first-order, through
    :func:`matmul` and on CUDA in cuDNN's float32 mode."""
    need_x, need_w, need_b = needs
    with products_as_cudnn(d_out):
        d_x = matmul(d_out, weight) if need_x else None
        d_w = matmul(d_out.t(), x) if need_w else None
    return d_x, d_w, d_out.sum(0) if need_b and has_bias else None


class _Linear(torch.autograd.Function):
    """``x @ W^T + b`` with every product through :func:`matmul` / oneDNN on CPU, and on CUDA in
    the float32 mode cuDNN would use for an ``nn.LSTM`` (:func:`products_as_cudnn`), forward and
    backward."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias)  # (forward runs with gradients off: nothing to detach)

    @staticmethod
    def backward(ctx, d_out: Tensor):
        x, weight = ctx.saved_tensors
        if not torch.is_grad_enabled():
            return _linear_grads(d_out, x, weight, ctx.needs_input_grad, ctx.has_bias)
        # create_graph: differentiable ops for a double backward
        need_x, need_w, need_b = ctx.needs_input_grad
        with products_as_cudnn(d_out):
            d_x = d_out.mm(weight) if need_x else None
            d_w = d_out.t().mm(x) if need_w else None
        return d_x, d_w, d_out.sum(0) if need_b and ctx.has_bias else None


# ``_Linear`` as a torch operator, for torch.compile: its graph would run ``x @ W^T`` through
# ``aten.mm`` (BLAS on the CPU, slower there than oneDNN; cuBLAS in its own float32 mode on CUDA,
# IEEE by default where cuDNN runs an LSTM's products in TF32), so while it traces the projection
# is this opaque call instead, computing what the eager layer computes. (Schemas given, as in
# rnndrop.kernels.ops.)


@torch.library.custom_op("rnndrop::linear", mutates_args=(), schema=(
    "(Tensor x, Tensor weight, Tensor? bias) -> Tensor"))
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _linear(x.contiguous(), weight, bias)


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


# (The schema keeps ``has_bias``, which ``needs[2]`` already says: a changed schema would break the
# code Inductor cached on disk for it, which calls the operator with its old arguments.)
@torch.library.custom_op("rnndrop::linear_backward", mutates_args=(), schema=(
    "(Tensor d_out, Tensor x, Tensor weight, bool[] needs, bool has_bias) -> Tensor[]"))
def _linear_backward_op(d_out: Tensor, x: Tensor, weight: Tensor, needs: list[bool],
                        has_bias: bool) -> list[Tensor]:
    return needed(_linear_grads(d_out, x, weight, needs, has_bias), needs)


@_linear_backward_op.register_fake
def _(d_out, x, weight, needs, has_bias):
    return grads_like(needs, (x, weight, d_out[0] if has_bias else None))


register_first_order(_linear_op, lambda d_out, x, weight, needs: _linear_backward_op(
    d_out, x, weight, needs, needs[2]))


@constant_for_compile
def _through_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products of rows of ``dtype`` on ``device`` run through :class:`_Linear` (CUDA, or
    oneDNN on the CPU), eagerly or, as ``rnndrop::linear``, while torch.compile traces (which
    keeps the answer as a constant of the graph)."""
    return device.type == "cuda" or onednn_enabled_on(device, dtype)


def input_projection(x: Tensor, mask: Tensor | None, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``gates_x = (x * mask) @ W_ih^T + bias`` for the rows ``x`` ``[N, in]`` of a whole
    sequence (:func:`rnndrop.kernels.gates.masked_linear`, same arguments).

    Without a mask (or with one the caller already applied), forward and backward run
    through oneDNN where :class:`StepWeight` uses it, on CUDA in cuDNN's float32 mode
    (:func:`~rnndrop.kernels.precision.products_as_cudnn`), else ``F.linear``; with a mask per gate
    ``[..., G, in]`` (broadcasting against ``x`` ``[..., in]`` row by row), through
    :func:`~rnndrop.kernels.per_gate_projection.per_gate_projection`. Twice differentiable
    either way. While torch.compile traces, they are the operators ``rnndrop::linear`` and
    ``rnndrop::per_gate_linear`` (the same products; first-order); inside ``torch.func``
    transforms both are ``masked_linear``.
    """
    plain = mask is None and x.dim() == 2 and weight.dtype == x.dtype
    # (not torch.broadcast_shapes: its first call imports torch._refs; docs/speed.md, "Per-gate masks")
    per_gate = (mask is not None and mask.dim() == x.dim() + 1
                and all(m in (1, n) for m, n in zip(mask.shape[:-2], x.shape[:-1])))
    if tracing_for_compile():
        if plain and _through_linear(x.device, x.dtype):
            return _linear_op(x, weight, bias)
        if per_gate:
            return per_gate_projection_op(x, mask, weight, bias)
        return masked_linear(x, mask, weight, bias)  # torch's ops, which torch.compile traces
    if transformed(*(t for t in (x, mask, weight, bias) if t is not None)):
        return masked_linear(x, mask, weight, bias)
    if plain and _through_linear(x.device, x.dtype):
        differentiated = torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        if not differentiated:  # Monte-Carlo sampling: no autograd Function
            return _linear(x.contiguous(), weight, bias)
        return _Linear.apply(x.contiguous(), weight, bias)
    if per_gate:
        return per_gate_projection(x, mask, weight, bias)
    return masked_linear(x, mask, weight, bias)
