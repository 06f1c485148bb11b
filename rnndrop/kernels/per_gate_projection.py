"""The whole-sequence input projection with one input mask per gate, in place.

    gates_x[..., g] = (x * M_g) W_gᵀ + b_g        for the gates g = 0..G-1,
    dx = Σ_g (dz_g W_g) * M_g,   dW_g = dz_gᵀ (x * M_g),   dM_g = (dz_g W_g) * x (summed to M's shape)

where ``W_g`` and ``b_g`` are gate ``g``'s rows of ``W_ih`` and of the bias. The same result as
:func:`rnndrop.kernels.gates.masked_linear`, which masks ``x`` once per gate, projects each
copy and concatenates: four masked copies kept for backward, four outputs and their
concatenation, all fresh memory on every call. Here each gate's product writes its columns of
the output directly, the masked input goes through one reused buffer, and backward keeps only
``x`` and the mask. The fresh pages, not the arithmetic, were what made per-gate masks slow on a
CPU (docs/speed.md, "Per-gate masks").

A gate's forward product goes through oneDNN where :func:`~rnndrop.kernels.onednn.worth_onednn`
says so (its result copied into the gate's columns), else BLAS writes the columns itself: the
faster of the two at hidden 650 and at hidden 200 respectively on a Zen 3 / 4 (same section). On
a Zen 5 (:func:`~rnndrop.kernels.onednn.sequence_through_onednn`) every product, forward and
backward, goes through oneDNN.

On CUDA, where each launch costs the host more than the memory costs the GPU, every gate goes
in one batched product instead (:func:`_batched_forward`, :func:`_batched_backward`): three launches
forward and six backward whatever the number of gates, in the float32 mode cuDNN would use
(:func:`~rnndrop.kernels.precision.products_as_cudnn`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rnndrop.kernels.first_order import grads_like, needed, register_first_order
from rnndrop.kernels.onednn import matmul, sequence_through_onednn, worth_onednn
from rnndrop.kernels.precision import products_as_cudnn

__all__ = ["per_gate_projection", "per_gate_projection_op"]

#: Devices whose tensors take the batched products (tests add "cpu" to run them there).
BATCHED_DEVICES = {"cuda"}


def per_gate_projection(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``gates_x`` ``[..., G * H]`` from ``x`` ``[..., in]``, a mask ``[..., G, in]`` that
    broadcasts against ``x.unsqueeze(-2)``, ``weight`` ``[G * H, in]`` and ``bias`` ``[G * H]``.

    Twice differentiable (a double backward runs plain differentiable ops).
    """
    return _PerGateProjection.apply(x, mask, weight, bias)


def per_gate_projection_op(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """:func:`per_gate_projection` as the operator ``rnndrop::per_gate_linear``, for torch.compile
    to trace: the same products (on CUDA in cuDNN's float32 mode, where torch's own ops traced
    would run cuBLAS in its mode, IEEE by default), first-order."""
    return _per_gate_op(x, mask, weight, bias)


def _gate(mask: Tensor, g: int) -> Tensor:
    return mask.select(-2, g)


def _gate_product(x: Tensor, w_g: Tensor, b_g: Tensor | None, columns: Tensor, onednn: bool) -> None:
    """``columns = x w_gᵀ (+ b_g)``: ``x`` ``[N, in]``, ``w_g`` ``[H, in]``, ``columns`` ``[N, H]``."""
    if onednn:
        columns.copy_(torch.ops.mkldnn._linear_pointwise(x, w_g, b_g, "none", [], ""))
    elif b_g is None:
        torch.mm(x, w_g.t(), out=columns)
    else:
        torch.addmm(b_g, x, w_g.t(), out=columns)


def _product(a: Tensor, b: Tensor, out: Tensor, onednn: bool) -> None:
    """``out = a @ b`` (a gradient: ``a`` ``[m, k]``, ``b`` ``[k, n]``), through oneDNN
    (:func:`~rnndrop.kernels.onednn.matmul`, its result copied) or BLAS writing ``out`` itself."""
    if onednn:
        out.copy_(matmul(a, b))
    else:
        torch.mm(a, b, out=out)


def _forward(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``gates_x`` of :func:`per_gate_projection`, without autograd (``weight`` and ``bias`` detached)."""
    if x.device.type in BATCHED_DEVICES:
        with products_as_cudnn(x):
            return _batched_forward(x, mask, weight, bias)
    gates, size = mask.shape[-2], weight.shape[0] // mask.shape[-2]
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    rows, masked = out.view(-1, weight.shape[0]), x.new_empty(x.shape)
    onednn = x.dtype == weight.dtype and (worth_onednn(weight[:size], rows.shape[0])
                                          or sequence_through_onednn(weight))
    for g, w_g in enumerate(weight.chunk(gates)):
        torch.mul(x, _gate(mask, g), out=masked)
        b_g = None if bias is None else bias[g * size : (g + 1) * size]
        _gate_product(masked.view(-1, x.shape[-1]), w_g, b_g, rows[:, g * size : (g + 1) * size], onednn)
    return out


def _first_order_grads(
    d_out: Tensor, x: Tensor, mask: Tensor, weight: Tensor, need_x: bool, need_mask: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of ``x``, the mask and the weight (None where not needed), first-order."""
    if x.device.type in BATCHED_DEVICES:
        with products_as_cudnn(x):
            return _batched_backward(x, mask, weight, d_out, need_x, need_mask, need_w)
    gates, size, width = mask.shape[-2], weight.shape[0] // mask.shape[-2], x.shape[-1]
    d_rows = d_out.reshape(-1, weight.shape[0])
    d_x = torch.zeros_like(x) if need_x else None
    d_mask = torch.empty_like(mask) if need_mask else None
    d_w = torch.empty_like(weight) if need_w else None
    buffer = x.new_empty(x.shape)
    onednn = sequence_through_onednn(weight) and d_out.dtype == weight.dtype
    for g, w_g in enumerate(weight.chunk(gates)):
        d_g = d_rows[:, g * size : (g + 1) * size]
        if need_x or need_mask:
            _product(d_g, w_g, buffer.view(-1, width), onednn)  # d(x * M_g)
            if need_x:
                d_x.addcmul_(buffer, _gate(mask, g))
            if need_mask:
                _gate(d_mask, g).copy_((buffer * x).sum_to_size(_gate(mask, g).shape))
        if need_w:
            torch.mul(x, _gate(mask, g), out=buffer)
            _product(d_g.t(), buffer.view(-1, width), d_w[g * size : (g + 1) * size], onednn)
    return d_x, d_mask, d_w


def _bias_grad(d_out: Tensor) -> Tensor:
    return d_out.reshape(-1, d_out.shape[-1]).sum(0)


class _PerGateProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, mask, weight)
        ctx.has_bias = bias is not None
        return _forward(x, mask, weight.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx, d_out: Tensor):
        x, mask, weight = ctx.saved_tensors
        need_x, need_mask, need_w, need_b = ctx.needs_input_grad
        d_b = _bias_grad(d_out) if need_b and ctx.has_bias else None
        if torch.is_grad_enabled():  # create_graph: differentiable ops for a double backward
            return (*_differentiable_grads(x, mask, weight, d_out, need_x, need_mask, need_w), d_b)
        return (*_first_order_grads(d_out, x, mask, weight, need_x, need_mask, need_w), d_b)


def _differentiable_grads(
    x: Tensor, mask: Tensor, weight: Tensor, d_out: Tensor, need_x: bool, need_mask: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of x, mask and weight in ops autograd can differentiate again."""
    gates = mask.shape[-2]
    w = weight.view(gates, -1, weight.shape[-1])  # [G, H, in]
    d_gates = d_out.view(*d_out.shape[:-1], gates, -1)  # [..., G, H]
    d_masked = torch.einsum("...gh,ghi->...gi", d_gates, w)  # [..., G, in]
    d_x = (d_masked * mask).sum(-2) if need_x else None
    d_mask = (d_masked * x.unsqueeze(-2)).sum_to_size(mask.shape) if need_mask else None
    d_w = None
    if need_w:
        masked = (x.unsqueeze(-2) * mask).expand(*d_gates.shape[:-1], x.shape[-1])
        d_w = torch.einsum("...gh,...gi->ghi", d_gates, masked).reshape(weight.shape)
    return d_x, d_mask, d_w


def _masked_by_gate(x: Tensor, mask: Tensor) -> Tensor:
    """``x * M_g`` of every gate as ``[G, N, in]`` (a view of one ``[..., G, in]`` product)."""
    masked = x.unsqueeze(-2) * mask  # [..., G, in]
    return masked.reshape(-1, *masked.shape[-2:]).transpose(0, 1)


def _batched_forward(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``gates_x`` ``[..., G * H]`` in three launches: the masked inputs of every gate, one batched
    product ``[G, N, in] x [G, in, H]`` (plus the bias) and the copy into the gates' columns."""
    gates, width = mask.shape[-2], x.shape[-1]
    w = weight.view(gates, -1, width).transpose(1, 2)  # [G, in, H]
    masked = _masked_by_gate(x, mask)
    # [G, N, H]
    products = torch.bmm(masked, w) if bias is None else torch.baddbmm(bias.view(gates, 1, -1), masked, w)
    return products.transpose(0, 1).reshape(*x.shape[:-1], weight.shape[0])


def _batched_backward(
    x: Tensor, mask: Tensor, weight: Tensor, d_out: Tensor, need_x: bool, need_mask: bool, need_w: bool
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of ``x``, the mask and the weight with one batched product each."""
    gates, width = mask.shape[-2], x.shape[-1]
    d_gates = d_out.reshape(-1, gates, weight.shape[0] // gates).transpose(0, 1)  # [G, N, H], a view
    d_x = d_mask = d_w = None
    if need_x or need_mask:
        d_masked = torch.bmm(d_gates, weight.view(gates, -1, width))  # [G, N, in]: d(x * M_g)
        d_masked = d_masked.transpose(0, 1).reshape(*x.shape[:-1], gates, width)
        if need_x:
            d_x = (d_masked * mask).sum(-2)
        if need_mask:
            d_mask = (d_masked * x.unsqueeze(-2)).sum_to_size(mask.shape)
    if need_w:
        d_w = torch.bmm(d_gates.transpose(1, 2), _masked_by_gate(x, mask)).view(weight.shape)
    return d_x, d_mask, d_w


# ``per_gate_projection`` as a torch operator, for torch.compile (schemas given, as in
# rnndrop.kernels.ops).


@torch.library.custom_op("rnndrop::per_gate_linear", mutates_args=(), schema=(
    "(Tensor x, Tensor mask, Tensor weight, Tensor? bias) -> Tensor"))
def _per_gate_op(x: Tensor, mask: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _forward(x, mask, weight, bias)


@_per_gate_op.register_fake
def _(x, mask, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("rnndrop::per_gate_linear_backward", mutates_args=(), schema=(
    "(Tensor d_out, Tensor x, Tensor mask, Tensor weight, bool[] needs) -> Tensor[]"))
def _per_gate_backward_op(d_out: Tensor, x: Tensor, mask: Tensor, weight: Tensor,
                          needs: list[bool]) -> list[Tensor]:
    grads = _first_order_grads(d_out, x, mask, weight, *needs[:3])
    return needed((*grads, _bias_grad(d_out) if needs[3] else None), needs)


@_per_gate_backward_op.register_fake
def _(d_out, x, mask, weight, needs):
    return grads_like(needs, (x, mask, weight, d_out.new_empty(weight.shape[0])))


register_first_order(_per_gate_op, _per_gate_backward_op)
