r"""The loop kernels as torch operators, which ``torch.compile`` traces into its graph.

A layer compiled with ``torch.compile`` runs its masks, input projections and states in the
compiled graph, and each layer and direction's recurrence as one opaque call of an operator
(``torch.library.custom_op``), forward and backward::

    rnndrop::lstm_recurrence(str kernel, Tensor gates_x, Tensor h0, Tensor c0, Tensor w_hh,
        Tensor? w_hr, Tensor? hidden_mask, bool reverse, bool keep)
        -> (Tensor out, Tensor h_n, Tensor c_n, Tensor[] saved)
    rnndrop::lstm_recurrence_backward(str kernel, bool reverse, bool[] needs, Tensor h0,
        Tensor c0, Tensor w_hh, Tensor? w_hr, Tensor? hidden_mask, Tensor out, Tensor[] saved,
        Tensor? d_out, Tensor? d_hn, Tensor? d_cn) -> Tensor[]

and the GRU's alike (``b_hh`` for ``c0`` and ``w_hr``, no ``c_n``). They serve padded input, every
step ``B = h0.size(0)`` rows (``batch_sizes = [B] * (N // B)``), so that a graph can leave the
number of steps symbolic: one graph for every length (packed input runs eagerly). ``saved`` is
what the kernel's backward pass reads besides the arguments and ``out`` (empty unless ``keep``);
the backward operator returns the gradients of the tensor arguments that ``needs`` asks for, in
order. (The input projection before the loop is ``rnndrop::linear``, in
:mod:`rnndrop.kernels.matmul`.) With no Python between the operators of a training step,
``torch.compile(mode="reduce-overhead")`` can replay the whole step from CUDA graphs: the host's
work per step, which bounds a small batch on a GPU (docs/gpu.md), is then one replay.

The kernels that run as operators are :data:`TRACEABLE`: ``"compiled"`` (CPU) and ``"triton"``
(CUDA); each module gives three functions per cell, ``forward_saving`` (the forward pass and its
``saved`` list), ``saved_like`` (that list's shapes, empty: what tracing sees) and
``backward_saved``. A layer on another kernel (or, under autocast, whose loop runs the "manual"
kernel in the dtype it computes in) runs eagerly inside ``torch.compile``, as before: see
:meth:`rnndrop.recurrent.VariationalRNNStack._untraced_because`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from rnndrop.kernels import compiled, gpu
from rnndrop.kernels.first_order import grads_like, needed, spread, will_differentiate
from rnndrop.layout import EqualBatchSizes

__all__ = ["TRACEABLE", "gru_recurrence", "lstm_recurrence"]

#: The loop kernels that run as operators inside ``torch.compile``.
TRACEABLE = ("compiled", "triton")


def _split(kernel: str, cell: str, part: str) -> Callable[..., Any]:
    """Kernel ``kernel``'s function ``part`` (``forward_saving``, ``saved_like``,
    ``backward_saved``) for ``cell``."""
    if kernel == "compiled":
        return getattr(compiled, f"{cell}_{part}")
    if kernel == "triton":
        triton_lstm, triton_gru = gpu.load()
        module: ModuleType = triton_lstm if cell == "lstm" else triton_gru
        return getattr(module, part)
    raise ValueError(f"kernel must be one of {', '.join(map(repr, TRACEABLE))}, got {kernel!r}")


def _contiguous(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The operators' results as their traced shapes say (torch.compile checks sizes and strides)."""
    return [t.contiguous() for t in tensors]


def _equal_sizes(gates_x: Tensor, h0: Tensor) -> list[int]:
    """The batch sizes of ``gates_x``'s rows, ``h0.size(0)`` at every step."""
    batch = h0.shape[0]
    return [batch] * (gates_x.shape[0] // batch)


def _check_equal_sizes(batch_sizes: Sequence[int]) -> None:
    """Refuse batch sizes the operators do not serve (those of packed input)."""
    if not isinstance(batch_sizes, EqualBatchSizes) and any(b != batch_sizes[0] for b in batch_sizes):
        raise ValueError("rnndrop's recurrence operators take equal batch sizes (padded input), "
                         f"got {list(batch_sizes)}")


# ------------------------------------------------------------------------------------------ LSTM


# The schemas are given, not inferred from the annotations, which this module keeps as strings
# (``from __future__ import annotations``): torch versions parse those differently.
@torch.library.custom_op("rnndrop::lstm_recurrence", mutates_args=(), schema=(
    "(str kernel, Tensor gates_x, Tensor h0, Tensor c0, Tensor w_hh, Tensor? w_hr, "
    "Tensor? hidden_mask, bool reverse, bool keep) -> (Tensor, Tensor, Tensor, Tensor[])"))
def _lstm_op(
    kernel: str, gates_x: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor, w_hr: Tensor | None,
    hidden_mask: Tensor | None, reverse: bool, keep: bool,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    out, h_n, c_n, saved = _split(kernel, "lstm", "forward_saving")(
        gates_x, _equal_sizes(gates_x, h0), h0, c0, w_hh, w_hr, hidden_mask, reverse, keep
    )
    out, h_n, c_n = _contiguous((out, h_n, c_n))
    return out, h_n, c_n, _contiguous(saved)


@_lstm_op.register_fake
def _(kernel, gates_x, h0, c0, w_hh, w_hr, hidden_mask, reverse, keep):
    saved = _split(kernel, "lstm", "saved_like")(gates_x, h0, c0, w_hh, w_hr, hidden_mask) if keep else []
    out = gates_x.new_empty(gates_x.shape[0], h0.shape[1])
    return out, gates_x.new_empty(h0.shape), c0.new_empty(c0.shape), saved


@torch.library.custom_op("rnndrop::lstm_recurrence_backward", mutates_args=(), schema=(
    "(str kernel, bool reverse, bool[] needs, Tensor h0, Tensor c0, Tensor w_hh, "
    "Tensor? w_hr, Tensor? hidden_mask, Tensor out, Tensor[] saved, Tensor? d_out, "
    "Tensor? d_hn, Tensor? d_cn) -> Tensor[]"))
def _lstm_backward_op(
    kernel: str, reverse: bool, needs: list[bool], h0: Tensor, c0: Tensor, w_hh: Tensor,
    w_hr: Tensor | None, hidden_mask: Tensor | None, out: Tensor, saved: list[Tensor],
    d_out: Tensor | None, d_hn: Tensor | None, d_cn: Tensor | None,
) -> list[Tensor]:
    grads = _split(kernel, "lstm", "backward_saved")(
        _equal_sizes(out, h0), reverse, needs, h0, c0, w_hh, w_hr, hidden_mask, out, saved, d_out, d_hn, d_cn
    )
    return needed(grads, needs)


@_lstm_backward_op.register_fake
def _(kernel, reverse, needs, h0, c0, w_hh, w_hr, hidden_mask, out, saved, d_out, d_hn, d_cn):
    return grads_like(needs, (saved[0], h0, c0, w_hh, w_hr, hidden_mask))  # saved[0]: acts, shaped as gates_x


def _lstm_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    kernel, _, h0, c0, w_hh, w_hr, hidden_mask, reverse, _ = inputs
    out, _, _, saved = output
    ctx.kernel, ctx.reverse = kernel, reverse
    ctx.save_for_backward(h0, c0, w_hh, w_hr, hidden_mask, out, *saved)


def _lstm_backward(ctx: Any, d_out: Tensor | None, d_hn: Tensor | None, d_cn: Tensor | None,
                   _: list[Tensor] | None) -> tuple:
    h0, c0, w_hh, w_hr, hidden_mask, out, *saved = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[1:7])
    grads = spread(needs, _lstm_backward_op(
        ctx.kernel, ctx.reverse, needs, h0, c0, w_hh, w_hr, hidden_mask, out, saved,
        d_out, d_hn, d_cn,
    ))
    return None, *grads, None, None


_lstm_op.register_autograd(_lstm_backward, setup_context=_lstm_setup)


def lstm_recurrence(kernel: str) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """Kernel ``kernel``'s LSTM recurrence through the operators: the contract of
    :class:`rnndrop.kernels.LSTMRecurrence`."""

    def recurrence(gates_x: Tensor, batch_sizes: Sequence[int], h0: Tensor, c0: Tensor, w_hh: Tensor,
                   w_hr: Tensor | None, hidden_mask: Tensor | None, reverse: bool = False,
                   ) -> tuple[Tensor, Tensor, Tensor]:
        _check_equal_sizes(batch_sizes)
        keep = will_differentiate(gates_x, h0, c0, w_hh, w_hr, hidden_mask)
        out, h_n, c_n, _ = _lstm_op(kernel, gates_x, h0, c0, w_hh, w_hr, hidden_mask, bool(reverse), keep)
        return out, h_n, c_n

    return recurrence


# ------------------------------------------------------------------------------------------- GRU


@torch.library.custom_op("rnndrop::gru_recurrence", mutates_args=(), schema=(
    "(str kernel, Tensor gates_x, Tensor h0, Tensor w_hh, Tensor? b_hh, "
    "Tensor? hidden_mask, bool reverse, bool keep) -> (Tensor, Tensor, Tensor[])"))
def _gru_op(
    kernel: str, gates_x: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
    hidden_mask: Tensor | None, reverse: bool, keep: bool,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    out, h_n, saved = _split(kernel, "gru", "forward_saving")(
        gates_x, _equal_sizes(gates_x, h0), h0, w_hh, b_hh, hidden_mask, reverse, keep
    )
    out, h_n = _contiguous((out, h_n))
    return out, h_n, _contiguous(saved)


@_gru_op.register_fake
def _(kernel, gates_x, h0, w_hh, b_hh, hidden_mask, reverse, keep):
    saved = _split(kernel, "gru", "saved_like")(gates_x, h0, w_hh, b_hh, hidden_mask) if keep else []
    return gates_x.new_empty(gates_x.shape[0], h0.shape[1]), gates_x.new_empty(h0.shape), saved


@torch.library.custom_op("rnndrop::gru_recurrence_backward", mutates_args=(), schema=(
    "(str kernel, bool reverse, bool[] needs, Tensor h0, Tensor w_hh, Tensor? b_hh, "
    "Tensor? hidden_mask, Tensor out, Tensor[] saved, Tensor? d_out, "
    "Tensor? d_hn) -> Tensor[]"))
def _gru_backward_op(
    kernel: str, reverse: bool, needs: list[bool], h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
    hidden_mask: Tensor | None, out: Tensor, saved: list[Tensor], d_out: Tensor | None, d_hn: Tensor | None,
) -> list[Tensor]:
    grads = _split(kernel, "gru", "backward_saved")(
        _equal_sizes(out, h0), reverse, needs, h0, w_hh, b_hh, hidden_mask, out, saved, d_out, d_hn
    )
    return needed(grads, needs)


@_gru_backward_op.register_fake
def _(kernel, reverse, needs, h0, w_hh, b_hh, hidden_mask, out, saved, d_out, d_hn):
    return grads_like(needs, (saved[0], h0, w_hh, b_hh, hidden_mask))  # saved[0]: acts, shaped as gates_x


def _gru_setup(ctx: Any, inputs: tuple, output: tuple) -> None:
    kernel, _, h0, w_hh, b_hh, hidden_mask, reverse, _ = inputs
    out, _, saved = output
    ctx.kernel, ctx.reverse = kernel, reverse
    ctx.save_for_backward(h0, w_hh, b_hh, hidden_mask, out, *saved)


def _gru_backward(ctx: Any, d_out: Tensor | None, d_hn: Tensor | None, _: list[Tensor] | None) -> tuple:
    h0, w_hh, b_hh, hidden_mask, out, *saved = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[1:6])
    grads = spread(needs, _gru_backward_op(
        ctx.kernel, ctx.reverse, needs, h0, w_hh, b_hh, hidden_mask, out, saved, d_out, d_hn,
    ))
    return None, *grads, None, None


_gru_op.register_autograd(_gru_backward, setup_context=_gru_setup)


def gru_recurrence(kernel: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """Kernel ``kernel``'s GRU recurrence through the operators: the contract of
    :class:`rnndrop.kernels.GRURecurrence`."""

    def recurrence(gates_x: Tensor, batch_sizes: Sequence[int], h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
                   hidden_mask: Tensor | None, reverse: bool = False) -> tuple[Tensor, Tensor]:
        _check_equal_sizes(batch_sizes)
        keep = will_differentiate(gates_x, h0, w_hh, b_hh, hidden_mask)
        out, h_n, _ = _gru_op(kernel, gates_x, h0, w_hh, b_hh, hidden_mask, bool(reverse), keep)
        return out, h_n

    return recurrence
