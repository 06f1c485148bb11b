"""Recurrence kernels: the time loop of one layer in one direction, one file per cell.

A kernel never samples and never changes the layer's contract; it computes the
same function as the reference loop in :mod:`rnndrop.kernels.reference`:

``lstm(gates_x, batch_sizes, h0, c0, w_hh, w_hr, hidden_mask, reverse) -> (out, h_n, c_n)``
``gru(gates_x, batch_sizes, h0, w_hh, b_hh, hidden_mask, reverse) -> (out, h_n)``

Shapes (``N = sum(batch_sizes)`` rows in packed, time-major order, ``B = batch_sizes[0]``,
``batch_sizes`` non-increasing):

- ``gates_x``: ``[N, G * H]``, the input projection of every step (for the LSTM it
  already holds both biases; for the GRU only ``b_ih``);
- ``h0``: ``[B, P]`` (``P = proj_size or H``), ``c0``: ``[B, H]``;
- ``w_hh``: ``[G * H, P]``, ``w_hr``: ``[P, H]`` or None, ``b_hh``: ``[G * H]`` or None;
- ``hidden_mask``: None or ``[T' , B', P]`` / per gate ``[T', B', G, P]`` with
  ``T'`` in ``{1, T}`` (1: the same mask at every step) and ``B'`` in ``{1, B}``;
- ``out``: ``[N, P]`` in the rows of ``gates_x``; ``h_n``: ``[B, P]``; ``c_n``: ``[B, H]``.

Kernels trust their arguments: the layer checks what a caller passed (shapes, dtypes,
devices, masks) and builds the rest to shape.
The two signatures are the protocols :class:`LSTMRecurrence` and :class:`GRURecurrence`;
a layer takes its kernel from :data:`KERNELS` (typed with them) and calls it.

Kernels, by name:

- ``"manual"``: a hand-written backward pass, :mod:`rnndrop.kernels.lstm`
  and :mod:`rnndrop.kernels.gru`, with the row bookkeeping in
  :mod:`rnndrop.kernels.schedule` and the matrix products in :mod:`rnndrop.kernels.matmul`;
- ``"autograd"``: the reference loop differentiated by autograd,
  :mod:`rnndrop.kernels.reference` (the slowest; twice differentiable);
- ``"compiled"``: the manual kernel's equations with the time loops in C++,
  :mod:`rnndrop.kernels.compiled` (CPU, float32 / float64; built on first use).
  ``kernel="auto"`` runs it where it can (:func:`auto_loop_kernel`);
- ``"triton"``: :mod:`rnndrop.kernels.gpu` (CUDA; Triton imported on first use, never by
  ``import rnndrop``): the whole loop of a layer and direction in one persistent launch each way,
  :mod:`rnndrop.kernels.persistent`, and where that cannot run (float64, ``proj_size``, a batch
  over 256) per step one cuBLAS product and one fused Triton kernel,
  :mod:`rnndrop.kernels.triton_lstm` / :mod:`rnndrop.kernels.triton_gru`. ``kernel="auto"`` runs
  it on CUDA tensors where Triton imports.

A new cell is one more file here, one more protocol and one more entry per kernel in
:data:`KERNELS`; the step equations the cells share live in :mod:`rnndrop.kernels.gates`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, TypedDict, overload

import torch
from torch import Tensor

from rnndrop.kernels import compiled, gpu, gru, lstm, ops, reference
from rnndrop.kernels.first_order import transformed
from rnndrop.kernels.matmul import input_projection
from rnndrop.tracing import BEFORE_TRACING, constant_for_compile, exporting, tracing_for_compile


class LSTMRecurrence(Protocol):
    """What an LSTM loop kernel is: :func:`rnndrop.kernels.lstm.lstm_recurrence` (``"manual"``),
    :func:`rnndrop.kernels.reference.lstm_recurrence` (``"autograd"``),
    :func:`rnndrop.kernels.compiled.lstm_recurrence` (``"compiled"``),
    :func:`rnndrop.kernels.gpu.lstm_recurrence` (``"triton"``)."""

    def __call__(
        self,
        gates_x: Tensor,
        batch_sizes: Sequence[int],
        h0: Tensor,
        c0: Tensor,
        w_hh: Tensor,
        w_hr: Tensor | None,
        hidden_mask: Tensor | None,
        reverse: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(out [N, P], h_n [B, P], c_n [B, H])``; shapes in the module docstring."""
        ...


class GRURecurrence(Protocol):
    """What a GRU loop kernel is: :func:`rnndrop.kernels.gru.gru_recurrence` (``"manual"``),
    :func:`rnndrop.kernels.reference.gru_recurrence` (``"autograd"``),
    :func:`rnndrop.kernels.compiled.gru_recurrence` (``"compiled"``),
    :func:`rnndrop.kernels.gpu.gru_recurrence` (``"triton"``)."""

    def __call__(
        self,
        gates_x: Tensor,
        batch_sizes: Sequence[int],
        h0: Tensor,
        w_hh: Tensor,
        b_hh: Tensor | None,
        hidden_mask: Tensor | None,
        reverse: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``(out [N, H], h_n [B, H])``; shapes in the module docstring."""
        ...


class CellKernels(TypedDict):
    """One kernel's recurrence functions, by cell."""

    lstm: LSTMRecurrence
    gru: GRURecurrence


#: ``KERNELS[kernel][cell]``: the recurrence function of ``cell`` (``"lstm"``, ``"gru"``).
KERNELS: Mapping[str, CellKernels] = {
    "manual": {"lstm": lstm.lstm_recurrence, "gru": gru.gru_recurrence},
    "autograd": {"lstm": reference.lstm_recurrence, "gru": reference.gru_recurrence},
    "compiled": {"lstm": compiled.lstm_recurrence, "gru": compiled.gru_recurrence},
    "triton": {"lstm": gpu.lstm_recurrence, "gru": gpu.gru_recurrence},
}

#: The loop kernel that ``kernel="auto"`` uses when the fused kernel cannot run and the
#: compiled one cannot either (:func:`auto_loop_kernel`).
DEFAULT_LOOP_KERNEL = "manual"


def auto_loop_kernel(x: Tensor, *others: Tensor) -> str:
    """The loop kernel ``kernel="auto"`` runs on tensors like ``x``: ``"autograd"`` inside a
    ``torch.func`` transform (``grad``, ``vmap``, ...) or under forward-mode AD (the hand-written
    backward passes are autograd Functions those cannot run: :func:`under_transform`) and while
    ``torch.export`` traces (it cannot trace into the C++ loop nor the manual kernel's ``out=``
    calls), else :func:`auto_loop_kernel_on` for ``x``'s device and dtype. ``others`` (the weights)
    are asked about transforms too: ``vmap`` over an ensemble's stacked weights batches them alone."""
    if exporting() or under_transform(x, *others):
        return "autograd"
    return auto_loop_kernel_on(x.device, x.dtype)


def under_transform(*xs: Tensor) -> bool:
    """Whether a call on ``xs`` (an input, weights) runs inside a ``torch.func`` transform or under
    forward-mode AD (:func:`~rnndrop.kernels.first_order.transformed`): only torch's own ops run
    there, layer by layer (torch's fused RNN op has no vmap rule). Never while torch.compile traces: the check
    would be a graph break."""
    return not torch.compiler.is_compiling() and transformed(*xs)


@constant_for_compile
def auto_loop_kernel_on(device: torch.device, dtype: torch.dtype) -> str:
    """``kernel="auto"``'s loop kernel for tensors of ``dtype`` on ``device``: ``"compiled"`` on
    CPU in float32 / float64 where it can be built (the first call builds it), ``"triton"`` on CUDA
    where Triton imports (the first call imports it) and passes its first-use check on the device
    (in float32, and in ``dtype`` where it is float16 / bfloat16: autocast's), else
    :data:`DEFAULT_LOOP_KERNEL`. torch.compile calls it while it traces and keeps the answer
    as a constant of the graph."""
    if device.type == "cuda" and gpu.is_available() and gpu.passes_first_use_check(device, dtype):
        return "triton"
    if device.type == "cpu" and dtype in (torch.float32, torch.float64) and compiled.is_available():
        return "compiled"
    return DEFAULT_LOOP_KERNEL


BEFORE_TRACING.append(auto_loop_kernel_on)


@overload
def recurrence_of(name: str, cell: Literal["lstm"]) -> LSTMRecurrence: ...
@overload
def recurrence_of(name: str, cell: Literal["gru"]) -> GRURecurrence: ...
def recurrence_of(name: str, cell: Literal["lstm", "gru"]) -> LSTMRecurrence | GRURecurrence:
    """The recurrence function of kernel ``name`` for ``cell``: from :data:`KERNELS`, or while
    torch.compile traces, one that calls the kernel's operators (:mod:`rnndrop.kernels.ops`) where
    it has them."""
    if tracing_for_compile() and name in ops.TRACEABLE:
        return ops.lstm_recurrence(name) if cell == "lstm" else ops.gru_recurrence(name)
    return KERNELS[name][cell]


def get_kernel(name: str, cell: str) -> LSTMRecurrence | GRURecurrence:
    """The recurrence function of kernel ``name`` for ``cell`` (``"lstm"`` or ``"gru"``), checked."""
    if name not in KERNELS:
        raise ValueError(f"kernel must be 'auto' or one of {', '.join(map(repr, KERNELS))}, got {name!r}")
    cells = KERNELS[name]
    if cell not in cells:
        raise ValueError(f"cell must be one of {', '.join(map(repr, cells))}, got {cell!r}")
    return cells[cell]  # type: ignore[literal-required]


__all__ = [
    "DEFAULT_LOOP_KERNEL",
    "KERNELS",
    "CellKernels",
    "GRURecurrence",
    "LSTMRecurrence",
    "auto_loop_kernel",
    "auto_loop_kernel_on",
    "get_kernel",
    "input_projection",
    "recurrence_of",
    "under_transform",
]
