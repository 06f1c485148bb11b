"""The "triton" loop kernel's front: whether it can run, and its LSTM and GRU recurrences,
whose modules (:mod:`rnndrop.kernels.triton_lstm`, :mod:`rnndrop.kernels.triton_gru`) are imported
on first use, so that ``import rnndrop`` never imports Triton.

The kernel runs on CUDA tensors (NVIDIA, or AMD through ROCm), in float32, float64, and float16 /
bfloat16 (or under ``torch.autocast``) with float32 accumulation; and on CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported), which is how it is
tested without a GPU. Triton comes with torch's CUDA wheels on Linux, else
``pip install "rnndrop[gpu]"``. Each step kernel compiles on first use (about a second) and is
cached on disk by Triton. ``RNNDROP_NO_TRITON=1`` turns it off: :func:`is_available` is then
False and ``kernel="auto"`` runs the "manual" kernel on CUDA. See docs/gpu.md.

Before ``kernel="auto"`` first runs it on a device, :func:`passes_first_use_check` runs a small
LSTM and GRU through it and through the reference kernel, forward and backward, in float32, and
before it first runs it in float16 / bfloat16 (autocast) there, in that dtype too; if Triton's
compiler or the device fails that, ``"auto"`` runs the "manual" kernel there (in that dtype), with
one warning that says why, rather than fail or be wrong in the middle of a user's training.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from rnndrop.kernels import reference
from rnndrop.kernels.optional import available_or_warn
from rnndrop.kernels.precision import cudnn_rnn_tf32, matmul_precision

__all__ = [
    "first_use_failure",
    "gru_recurrence",
    "is_available",
    "load",
    "lstm_recurrence",
    "passes_first_use_check",
]

HOW_TO_GET_IT = 'pip install "rnndrop[gpu]" (Triton)'


_lock = threading.Lock()
_modules: tuple[ModuleType, ModuleType] | None = None
_failure: str | None = None
_warned = False
#: (device, dtype checked) -> why the kernel failed the first-use check there, or None
_checked: dict[tuple[str, torch.dtype], str | None] = {}
#: The dtypes the first-use check runs the kernel in apart from float32 (autocast's): the products'
#: rounding differs, and the fourth GPU round found a half path wrong where float32 was right.
HALF_TYPES = (torch.bfloat16, torch.float16)
#: How far a half-precision run of the check may be from the float32 reference, in relative norm
#: per output and gradient: bfloat16 keeps 8 bits of mantissa (about 1e-2 at the check's shapes);
#: a wrong kernel is off by the size of the values.
HALF_TOLERANCE = 5e-2
_check_lock = threading.Lock()


def load() -> tuple[ModuleType, ModuleType]:
    """``(triton_lstm, triton_gru)``, imported once; RuntimeError saying why they cannot be."""
    global _modules, _failure
    if _modules is not None:
        return _modules
    with _lock:
        if _modules is None and _failure is None:
            if os.environ.get("RNNDROP_NO_TRITON", "") not in ("", "0"):
                _failure = "disabled by RNNDROP_NO_TRITON"
            else:
                try:
                    import rnndrop.kernels.triton_gru as triton_gru
                    import rnndrop.kernels.triton_lstm as triton_lstm

                    _modules = (triton_lstm, triton_gru)
                except ImportError as error:  # no Triton, or one without what the kernels use
                    _failure = f"Triton cannot be imported ({error})"
        if _modules is None:
            raise RuntimeError(f"the 'triton' loop kernel is not available: {_failure}")
        return _modules


def is_available() -> bool:
    """Whether the Triton kernel can run (imports it on the first call; the answer is cached).
    When it cannot, warns once per process saying why and how to get it."""
    global _warned
    available, _warned = available_or_warn(
        load, _warned, "RNNDROP_NO_TRITON", HOW_TO_GET_IT, "the 'manual' kernel on CUDA"
    )
    return available


def lstm_recurrence(
    gates_x: Tensor,
    batch_sizes: Sequence[int],
    h0: Tensor,
    c0: Tensor,
    w_hh: Tensor,
    w_hr: Tensor | None,
    hidden_mask: Tensor | None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The LSTM recurrence of one layer and direction (contract in :mod:`rnndrop.kernels`)."""
    with _on_device(gates_x):
        return load()[0].lstm_recurrence(gates_x, batch_sizes, h0, c0, w_hh, w_hr, hidden_mask, reverse)


def gru_recurrence(
    gates_x: Tensor,
    batch_sizes: Sequence[int],
    h0: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    hidden_mask: Tensor | None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor]:
    """The GRU recurrence of one layer and direction (contract in :mod:`rnndrop.kernels`)."""
    with _on_device(gates_x):
        return load()[1].gru_recurrence(gates_x, batch_sizes, h0, w_hh, b_hh, hidden_mask, reverse)


def _on_device(x: Tensor) -> contextlib.AbstractContextManager:
    """``x``'s CUDA device made current where another is: Triton launches on the current device
    and its current stream (a model on ``cuda:1`` without ``torch.cuda.set_device(1)``)."""
    index = x.device.index
    if x.device.type == "cuda" and index is not None and index != torch.cuda.current_device():
        return torch.cuda.device(x.device)
    return contextlib.nullcontext()


# gradients even where the caller runs under torch.inference_mode (a server's mc_predict), whose
# tensors cannot be saved for backward: the mode is not the kernel's failure
@torch.inference_mode(False)
def first_use_failure(device: torch.device | str, dtype: torch.dtype = torch.float32) -> str | None:
    """Why the kernel fails on ``device``, or None: a small packed LSTM (tied mask) and GRU
    (per-gate mask), on a GPU over several programs (the LSTM's over blocks of rows too), in float32,
    outputs and every gradient against the reference kernel within 1e-4, or within 2e-2 where
    float32 products may run in TF32 (or bfloat16): cuBLAS's mode for the reference, cuDNN's switch
    for RNNs (:func:`~rnndrop.kernels.precision.cudnn_rnn_tf32`, on by default) for this kernel,
    which keep 10 (7) bits of mantissa, each rounding its own way. With ``dtype`` one of
    :data:`HALF_TYPES` the kernel runs under ``torch.autocast`` in it (its products in that dtype,
    its state in float32, as a layer under autocast runs it) against the float32 reference, each
    output and gradient within :data:`HALF_TOLERANCE` in relative norm.

    Uses its own generator (the global random state is left as it was) and runs outside any
    ``torch.autocast``, ``torch.no_grad`` or ``torch.inference_mode`` the caller is in."""
    device = torch.device(device)
    half = dtype in HALF_TYPES
    generator = torch.Generator().manual_seed(0)
    # this kernel's products follow cuDNN's TF32 switch on CUDA, the reference's cuBLAS's
    tf32 = device.type == "cuda" and cudnn_rnn_tf32()
    tolerance = 1e-4 if matmul_precision() == "ieee" and not tf32 else 2e-2
    # over several programs on a GPU (40 units: three blocks; the LSTM's 20 sequences: two blocks
    # of rows), so that the grid barrier and the split of rows are checked too
    lstm_sizes, lstm_hidden, gru_sizes, gru_hidden = [20, 17, 9], 40, [3, 2, 1], 40
    cases = {  # cell: (batch sizes, the argument shapes after them, this kernel and the reference)
        "lstm": (lstm_sizes, [(46, 4 * lstm_hidden), (20, lstm_hidden), (20, lstm_hidden),
                              (4 * lstm_hidden, lstm_hidden), None, (1, 20, lstm_hidden)],
                 (lstm_recurrence, reference.lstm_recurrence)),
        "gru": (gru_sizes, [(6, 3 * gru_hidden), (3, gru_hidden), (3 * gru_hidden, gru_hidden),
                            (3 * gru_hidden,), (1, 3, 3, gru_hidden)],
                (gru_recurrence, reference.gru_recurrence)),
    }
    try:
        for cell, (sizes, shapes, kernels) in cases.items():
            values = [None if s is None else torch.rand(s, generator=generator) - 0.5 for s in shapes]
            results = []
            for kernel in kernels:
                args = [None if v is None else v.to(device).requires_grad_() for v in values]
                in_half = half and kernel is kernels[0]
                with torch.enable_grad(), torch.autocast(device.type, dtype=dtype, enabled=in_half):
                    outputs = kernel(args[0], sizes, *args[1:])
                    loss = sum(((k + 1) * o.float()).sum() for k, o in enumerate(outputs))
                    grads = torch.autograd.grad(loss, [a for a in args if a is not None])
                results.append([t.detach().float().cpu() for t in (*outputs, *grads)])
            for ours, expected in zip(*results, strict=True):
                if half:
                    gap = float((ours - expected).norm() / expected.norm().clamp_min(1e-12))
                    if not gap <= HALF_TOLERANCE:  # NaN fails too
                        return (f"its {cell.upper()} in {str(dtype).removeprefix('torch.')} differs from the "
                                f"float32 reference kernel by {gap:.3g} in relative norm")
                elif not torch.allclose(ours, expected, atol=tolerance, rtol=tolerance):
                    gap = (ours - expected).abs().max()
                    return f"its {cell.upper()} differs from the reference kernel by {gap:.3g}"
    except Exception as error:  # whatever Triton's compiler or the driver raise
        first_line = (str(error).strip().splitlines() or [""])[0]
        return f"{type(error).__name__}: {first_line}"
    return None


def passes_first_use_check(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``kernel="auto"`` may run the kernel on ``device`` in ``dtype``: :func:`first_use_failure`
    in float32, and in ``dtype`` too where it is a half type, each once per device and process (not
    while a CUDA graph is being captured: then True, checked later). A failure warns once, with the
    reason."""
    # asked at every layer call (kernel="auto"): two cached lookups, nothing built
    return _passes(device, torch.float32) and (dtype not in HALF_TYPES or _passes(device, dtype))


def _passes(device: torch.device, dtype: torch.dtype) -> bool:
    key = (str(device), dtype)
    if key not in _checked:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return True
        with _check_lock:
            if key not in _checked:
                _checked[key] = failure = first_use_failure(device, dtype)
                if failure is not None:
                    where = "" if dtype == torch.float32 else f" in {str(dtype).removeprefix('torch.')}"
                    warnings.warn(
                        f"rnndrop: the 'triton' loop kernel failed its first-use check{where} on {key[0]} "
                        f"({failure}); kernel='auto' runs the 'manual' kernel there{where} instead. Please "
                        "report it, with `python -m pytest tests/test_triton_kernel.py` run on this machine.",
                        RuntimeWarning, stacklevel=4)
    return _checked[key] is None
