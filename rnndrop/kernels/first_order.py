"""The backward passes of the hand-written kernels are first-order only, and say so; nor do those
kernels run under torch.func or torch.export, and they say that too (:func:`refuse_transforms`).
The backward operators torch.compile traces return only the gradients asked for (:func:`needed`,
:func:`grads_like`, :func:`spread`).

``torch.autograd.function.once_differentiable`` alone is not enough: asked for a graph
(``create_graph=True``, as a gradient penalty ``d/dW ||dy/dx||²`` or a Hessian-vector
product does), a once-differentiable backward returns gradients that are silently
cut off from the weights, so the second-order gradient comes out wrong or missing.
:func:`first_order_backward` refuses that case with an error that names the way out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd import forward_ad

from rnndrop.tracing import exporting


def functorch_wrapped(*tensors: Tensor) -> bool:
    """Whether any of ``tensors`` is inside a ``torch.func`` transform (``grad``, ``vmap``, ...),
    where autograd Functions without ``setup_context`` (the loop kernels', the projection's in
    :mod:`rnndrop.kernels.matmul`) cannot run."""
    is_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return is_wrapped is not None and any(is_wrapped(t) for t in tensors)


def has_tangent(*tensors: Tensor) -> bool:
    """Whether any of ``tensors`` carries a forward-mode tangent (``torch.autograd.forward_ad``),
    which the hand-written autograd Functions (no ``jvp``) cannot propagate. Outside a dual level
    (``forward_ad._current_level`` -1, what every call but forward-mode AD's sees) one attribute read."""
    if forward_ad._current_level < 0:
        return False
    return any(forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def transformed(*tensors: Tensor) -> bool:
    """Whether any of ``tensors`` is inside a ``torch.func`` transform or carries a forward-mode
    tangent: there only torch's own ops run (the hand-written Functions cannot), and torch's fused
    RNN op has no vmap rule."""
    return functorch_wrapped(*tensors) or has_tangent(*tensors)


def refuse_transforms(kernel: str, gates_x: Tensor) -> None:
    """A one-line RuntimeError instead of an error from deep inside torch where kernel ``kernel``
    cannot run: under a ``torch.func`` transform or forward-mode AD (its autograd Function has no
    ``setup_context`` nor ``jvp``) or while ``torch.export`` traces (it cannot trace the C++ loop
    nor ``out=`` calls)."""
    if transformed(gates_x) or exporting():
        raise RuntimeError(
            f"the {kernel!r} loop kernel cannot run under torch.func transforms (vmap, grad, ...), "
            "forward-mode AD nor torch.export; build the layer with kernel='auto' or kernel='autograd'"
        )


def will_differentiate(*tensors: Tensor | None) -> bool:
    """Whether autograd will want a backward pass through a recurrence of ``tensors``; where not
    (``torch.no_grad``, inference mode, nothing requires grad) a kernel's forward pass keeps none of
    the buffers backward reads (Monte-Carlo sampling's fast path)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class SecondOrderGradientError(RuntimeError):
    """A first-order-only kernel was differentiated with ``create_graph=True``."""


def first_order_backward(kernel: str) -> Callable[[Callable], Callable]:
    """Decorate the ``backward`` of kernel ``kernel``'s autograd Function: once differentiable,
    and an error instead of a wrong answer when autograd asks it for a graph. (It then always runs
    with gradients off, all that ``once_differentiable`` would add, which is not called: a host cost
    of every backward pass.)"""

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def guarded(ctx, *grad_outputs):
            if torch.is_grad_enabled():
                raise SecondOrderGradientError(
                    f"the {kernel!r} loop kernel computes first-order gradients only, but this "
                    "backward pass was asked for a graph (create_graph=True: a gradient penalty, a "
                    "Hessian-vector product); build the layer with kernel='autograd' for "
                    "second-order gradients"
                )
            return backward(ctx, *grad_outputs)

        return guarded

    return decorate


# A backward operator (rnndrop.kernels.ops, the projection's in rnndrop.kernels.matmul) returns the
# gradients its ``needs`` asks for, in order: a torch operator cannot return None in a list.


def needed(grads: Sequence[Tensor | None], needs: Sequence[bool]) -> list[Tensor]:
    """The gradients ``needs`` asks for, contiguous (the strides their traced shapes say)."""
    return [g.contiguous() for g, need in zip(grads, needs, strict=True) if need and g is not None]


def grads_like(needs: Sequence[bool], like: Sequence[Tensor | None]) -> list[Tensor]:
    """Empty gradients shaped as the arguments ``like`` that ``needs`` asks for (a backward
    operator's result as torch.compile traces it)."""
    return [torch.empty_like(t, memory_format=torch.contiguous_format)
            for t, need in zip(like, needs, strict=True) if need and t is not None]


def spread(needs: Sequence[bool], grads: Sequence[Tensor]) -> list[Tensor | None]:
    """A backward operator's gradients back in their arguments' places (None where not needed)."""
    given = iter(grads)
    return [next(given) if need else None for need in needs]


def register_first_order(op: Any, backward_op: Callable[..., list[Tensor]]) -> None:
    """Autograd for a torch operator ``op(*tensors, bias)`` (``bias`` optional, last) whose
    first-order backward is the operator ``backward_op(d_out, *tensors, needs)``: it returns the
    gradients ``needs`` asks for (one flag per argument, the bias's False without a bias), in
    order (:func:`needed`), which come back in their arguments' places (:func:`spread`)."""

    def setup(ctx: Any, inputs: tuple, output: Tensor) -> None:
        *tensors, bias = inputs
        ctx.has_bias = bias is not None
        ctx.save_for_backward(*tensors)

    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        needs = [*ctx.needs_input_grad[:-1], ctx.needs_input_grad[-1] and ctx.has_bias]
        return tuple(spread(needs, backward_op(d_out, *ctx.saved_tensors, needs)))

    op.register_autograd(backward, setup_context=setup)
