"""The host side of the Triton loop kernels: the steps of a call, the mask rows of a step, the
per-step matrix products (cuBLAS on CUDA), launch sizes and dtypes. Pure torch: no Triton here.

The step kernels (:mod:`rnndrop.kernels.triton_lstm`, :mod:`rnndrop.kernels.triton_gru`) take
every tensor already offset to the first row of its step, with the strides a kernel cannot
derive (mask rows shared by the batch, per-gate blocks) passed as integers.

Dtypes: the products run in the *compute* dtype, autocast's (float16 / bfloat16) where autocast
is on for the tensors' device, else the input's; cuBLAS accumulates them in float32. The step
kernels compute in float32 (float64 for float64 input) and keep the cell state and the
gradients that flow back through time in that dtype.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
from torch import Tensor

from rnndrop.kernels.precision import UNCHANGED
from rnndrop.kernels.schedule import Schedule

__all__ = [
    "BLOCK",
    "LAUNCH_OPTIONS",
    "StepPlan",
    "StepProducts",
    "accumulation_dtype",
    "as_dtype",
    "check_device",
    "compute_dtype",
    "initial_grad",
    "interpreted",
    "launch",
    "loop_key",
    "mask_rows",
    "next_state_target",
    "plan_steps",
    "state_rows",
]

#: Compile options of every launch of rnndrop's Triton kernels: fused multiply-adds, as Triton up to
#: 3.9 compiles by default and as every measurement of these kernels ran (Triton 3.10 leaves them
#: out by default, and 3.9 warns at a compile that leaves the choice to it).
LAUNCH_OPTIONS = {"enable_fp_fusion": True}
#: Lanes (elements of a step's rows) per program on a GPU; 4 warps run them.
BLOCK = 512
NUM_WARPS = 4
#: Under Triton's interpreter (CPU) a program costs milliseconds whatever its size: one program
#: covers a small step.
INTERPRETED_BLOCK = 4096


class StepPlan(NamedTuple):
    """One step in running order: its rows ``offset : offset + size`` (``carried`` of them continue
    the rows of the step before, from ``prev_offset``), and the step after (``next_t`` -1: none)."""

    t: int
    size: int
    offset: int
    carried: int
    prev_offset: int
    next_t: int
    next_size: int
    next_offset: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.size)


def plan_steps(schedule: Schedule) -> list[StepPlan]:
    """The steps of ``schedule`` in running order."""
    steps = schedule.steps
    out = []
    for k, step in enumerate(steps):
        after = steps[k + 1] if k + 1 < len(steps) else None
        prev_offset = schedule.offsets[step.prev] if step.prev >= 0 else 0
        out.append(StepPlan(step.t, step.size, schedule.offsets[step.t], step.carried, prev_offset,
                            after.t if after else -1, after.size if after else 0,
                            schedule.offsets[after.t] if after else 0))
    return out


def loop_key(schedule: Schedule) -> tuple[tuple[int, ...], int]:
    """What of a schedule a loop's launches depend on: the batch sizes and the first step."""
    return tuple(schedule.sizes), schedule.steps[0].t


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype of the step products: autocast's where autocast is on for ``x``'s device (and ``x``
    is a float32 tensor it would cast), else ``x``'s."""
    device = x.device.type
    if x.dtype != torch.float32 or not _autocast_enabled(device):
        return x.dtype
    get = getattr(torch, "get_autocast_dtype", None)
    if get is not None:
        return get(device)
    return torch.get_autocast_gpu_dtype() if device == "cuda" else torch.get_autocast_cpu_dtype()


def _autocast_enabled(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled() if device == "cuda" else torch.is_autocast_cpu_enabled()


def autocast_off(x: Tensor) -> contextlib.AbstractContextManager:
    """Autocast turned off for ``x``'s device inside the block (the kernels cast for themselves);
    nothing to enter where it is off already, the usual case (an autocast object costs the host
    more than the check)."""
    device = x.device.type
    return torch.autocast(device, enabled=False) if _autocast_enabled(device) else UNCHANGED



def as_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)``, without a call into torch where ``x`` has it already (the usual case: a
    host cost at every launch otherwise)."""
    return x if x.dtype == dtype else x.to(dtype)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the step kernels compute in and keep the cell state and running gradients in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def interpreted() -> bool:
    """Whether Triton runs its interpreter (``TRITON_INTERPRET=1``: kernels run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(x: Tensor) -> None:
    """The Triton kernel needs CUDA tensors, or CPU tensors under Triton's interpreter."""
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreted()):
        raise RuntimeError(
            "the 'triton' loop kernel runs on CUDA tensors (or on CPU tensors under Triton's "
            f"interpreter, TRITON_INTERPRET=1), got gates_x on {x.device}; use kernel='auto'"
        )


def launch(kernel, n: int, device: torch.device, *args, **constexprs) -> None:
    """Run ``kernel`` over ``n`` lanes."""
    if n <= 0:
        return
    block = BLOCK if device.type != "cpu" else min(INTERPRETED_BLOCK, max(16, 1 << (n - 1).bit_length()))
    kernel[(triton_cdiv(n, block),)](*args, n, **constexprs, BLOCK=block, num_warps=NUM_WARPS,
                                     **LAUNCH_OPTIONS)


def triton_cdiv(n: int, d: int) -> int:
    return -(-n // d)


def mask_rows(mask: Tensor | None, t: int, like: Tensor) -> tuple[Tensor, int, int]:
    """The hidden mask of step ``t`` (``mask`` ``[T', B', (G,) P]``, contiguous) as ``(rows, row
    stride, gate stride)``: the row stride is 0 where the batch shares the mask. Without a mask,
    ``like`` stands in (a kernel never reads it), as it does for ``t = -1`` (no step)."""
    if mask is None or t < 0:
        return like, 0, 0
    rows = mask[t if mask.shape[0] > 1 else 0]
    gate = rows.stride(1) if mask.dim() == 4 else 0
    return rows, (rows.stride(0) if rows.shape[0] > 1 else 0), gate


class StepProducts:
    """The recurrent products of one call, into buffers allocated once.

    ``weight`` ``W_hh`` ``[G * H, P]`` (compute dtype) of a cell with ``G`` gates; ``mask_gates``
    1, or ``G`` for one mask per gate (the products are then batched over the gates).
    """

    def __init__(self, weight: Tensor, cell_gates: int, mask_gates: int, batch: int) -> None:
        self.gates = mask_gates
        rows, self.P = weight.shape
        self.H = rows // cell_gates
        self.w = weight
        self.w_gates = weight.view(cell_gates, self.H, self.P)  # [G, H, P]
        self.forward_buf = weight.new_empty(batch * rows)
        self.backward_buf = weight.new_empty(batch * self.P * mask_gates)

    def forward(self, m: Tensor) -> tuple[Tensor, int, int]:
        """``W_hh m`` of a step: ``m`` ``[b, P]`` or per gate ``[b, G, P]`` -> ``(z, row, gate)``,
        gate ``g`` of row ``k`` at ``z[k * row + g * gate]``."""
        b = m.shape[0]
        if self.gates == 1:
            z = self.forward_buf[: b * self.w.shape[0]].view(b, -1)
            return torch.mm(m, self.w.t(), out=z), z.shape[1], self.H
        z = self.forward_buf[: b * self.w.shape[0]].view(self.gates, b, self.H)
        return torch.bmm(m.transpose(0, 1), self.w_gates.transpose(1, 2), out=z), self.H, b * self.H

    def backward(self, dz: Tensor) -> tuple[Tensor, int, int]:
        """``dm = W_hh^T dz`` of a step: ``dz`` ``[b, G * H]`` -> ``(dm, row, gate)``; per gate
        ``dm`` is ``[G, b, P]``, else ``[b, P]``."""
        b = dz.shape[0]
        if self.gates == 1:
            dm = self.backward_buf[: b * self.P].view(b, self.P)
            return torch.mm(dz, self.w, out=dm), self.P, 0
        dm = self.backward_buf[: b * self.P * self.gates].view(self.gates, b, self.P)
        dz = dz.view(b, self.gates, self.H).transpose(0, 1)
        return torch.bmm(dz, self.w_gates, out=dm), self.P, b * self.P


def state_rows(masked: Tensor | None, scratch: Tensor, offset: int, size: int) -> tuple[Tensor, int, int]:
    """The rows ``offset : offset + size`` of ``masked`` ``[N, (G,) P]`` (or, without a mask, the first
    ``size`` of ``scratch`` ``[B, P]``) as ``(rows, row stride, gate stride)``."""
    rows = scratch[:size] if masked is None else masked[offset : offset + size]
    return rows, rows.stride(0), (rows.stride(1) if rows.dim() == 3 else 0)


def next_state_target(
    step: StepPlan, masked: Tensor | None, scratch: Tensor
) -> tuple[Tensor | None, int, int]:
    """Where the forward pass of ``step`` writes the state that the step after multiplies by
    ``W_hh`` (:func:`state_rows`); None where the step's own output rows are that state (no mask,
    no sequence joining) or there is no step after."""
    if step.next_t < 0 or (masked is None and step.next_size <= step.size):
        return None, 0, 0
    return state_rows(masked, scratch, step.next_offset, step.next_size)


def initial_grad(grad: Tensor | None, like: Tensor, dtype: torch.dtype) -> Tensor:
    """A running gradient state ``[B, X]`` in ``dtype``: the final state's gradient, or zeros."""
    if grad is None:
        return torch.zeros(like.shape, dtype=dtype, device=like.device)
    return grad.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
