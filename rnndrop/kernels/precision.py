"""Which float32 mode the loop kernels' products run in on CUDA: the one ``nn.LSTM`` runs in.

cuDNN runs ``nn.LSTM`` / ``nn.GRU``'s float32 products in TF32 while torch's switch for cuDNN RNNs
is on (``torch.backends.cudnn.allow_tf32``, or ``torch.backends.cudnn.rnn.fp32_precision``: on by
default), whatever cuBLAS's own switch says. A drop-in replacement does the same: the persistent
loop's ``tl.dot`` takes TF32 from :func:`cudnn_rnn_tf32`, and the cuBLAS products of a Triton-kernel
call (input projection, ``dW``, the step kernel's per-step products) run inside
:func:`products_as_cudnn`. With the switch off, every product is IEEE float32, as cuDNN's are.

torch's precision switches are process-wide, so :func:`products_as_cudnn` sets cuBLAS's for the
block and puts it back. It uses the legacy setter (``torch.backends.cuda.matmul.allow_tf32``):
setting the newer ``fp32_precision`` leaves some torch versions unable to read the legacy switch
afterwards ("a mix of the legacy and new APIs"), which torch.compile and Lightning read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["UNCHANGED", "cudnn_rnn_tf32", "matmul_precision", "products_as_cudnn"]


#: torch's getter of its precision API (torch >= 2.9), called directly: the properties
#: ``torch.backends.cuda.matmul.fp32_precision``, ``torch.backends.cudnn.rnn.fp32_precision`` and the
#: others call it with these ``(backend, op)`` pairs through several Python layers, and every
#: Triton-kernel call reads them a few times on a host-bound path.
_precision_of = getattr(torch._C, "_get_fp32_precision_getter", None)


def matmul_precision() -> str:
    """How cuBLAS runs float32 products now: "ieee", "tf32" (``allow_tf32``,
    ``set_float32_matmul_precision("high")``, ``fp32_precision = "tf32"``) or "bf16". Read through
    ``fp32_precision`` where torch has it: the legacy getters raise once the new API was used."""
    if _precision_of is None:  # torch < 2.9: the legacy switch only
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    mode = _precision_of("cuda", "matmul")  # torch.backends.cuda.matmul.fp32_precision
    if mode == "none":  # unset: the global default, torch.backends.fp32_precision
        mode = _precision_of("generic", "all")
    return "ieee" if mode == "none" else mode


def cudnn_rnn_tf32() -> bool:
    """Whether cuDNN runs ``nn.LSTM`` / ``nn.GRU``'s float32 products in TF32 now (torch's default).

    Read from the RNN entry of torch's precision API where torch has it, which never raises
    (``torch.backends.cudnn.allow_tf32`` does once cuDNN's convolutions and RNNs were set apart)."""
    if _precision_of is None:  # torch < 2.9: the legacy switch only
        return bool(torch.backends.cudnn.allow_tf32)
    mode = _precision_of("cuda", "rnn")  # torch.backends.cudnn.rnn.fp32_precision
    if mode == "none":
        mode = _precision_of("cuda", "all")  # torch.backends.cudnn.fp32_precision
    if mode == "none":
        mode = _precision_of("generic", "all")  # torch.backends.fp32_precision
    return mode == "tf32"


#: A block where nothing changes: one object, entered again and again (:func:`products_as_cudnn`,
#: and ``triton_plan.autocast_off``, where autocast is off already).
UNCHANGED = contextlib.nullcontext()


def products_as_cudnn(like: Tensor) -> contextlib.AbstractContextManager[None]:
    """cuBLAS's float32 products in TF32 inside the block where ``like`` is a CUDA float32 tensor,
    cuDNN would run an ``nn.LSTM``'s in TF32 (:func:`cudnn_rnn_tf32`) and cuBLAS is set to IEEE;
    elsewhere nothing changes (the usual case, with no context of its own to build: a host cost of
    every call of a loop kernel). The switch is put back on leaving."""
    if not (like.is_cuda and like.dtype == torch.float32 and matmul_precision() == "ieee"
            and cudnn_rnn_tf32()):
        return UNCHANGED
    return _tf32_products()


@contextlib.contextmanager
def _tf32_products() -> Iterator[None]:
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
