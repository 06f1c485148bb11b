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
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from types import ModuleType

from torch import Tensor

from rnndrop.kernels.optional import available_or_warn

__all__ = ["gru_recurrence", "is_available", "load", "lstm_recurrence"]

HOW_TO_GET_IT = 'pip install "rnndrop[gpu]" (Triton)'

_lock = threading.Lock()
_modules: tuple[ModuleType, ModuleType] | None = None
_failure: str | None = None
_warned = False


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
    return load()[1].gru_recurrence(gates_x, batch_sizes, h0, w_hh, b_hh, hidden_mask, reverse)
