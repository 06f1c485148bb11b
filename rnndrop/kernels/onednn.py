"""Whether and when a product goes through oneDNN instead of torch's CPU BLAS, and
:func:`matmul`, a whole sequence's product through it.

Whether: by capability. Whatever the CPU vendor, an op that is missing or fails on a tiny probe
sends every product to BLAS. When: by the weight's size and the rows a product has.

Why: torch's CPU BLAS (MKL) runs AVX2 code on AMD CPUs, while oneDNN, which
torch's own fused ``nn.LSTM`` uses, picks AVX-512 wherever the CPU has it, and
is then the faster for large weights. Results agree with ``torch.mm`` to float32
rounding. The measurements behind the rule: docs/speed.md, "oneDNN or BLAS for a product".
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "amd_cpu_family", "amd_family_in", "matmul", "onednn_enabled", "sequence_through_onednn", "worth_onednn",
]

#: A weight (with per-gate masks: each gate's block) goes through oneDNN's products (float32,
#: where torch has oneDNN) when it has at least ONEDNN_MIN_WEIGHT elements, or at least
#: ONEDNN_MIN_WEIGHT_MANY_ROWS and the products have ONEDNN_MANY_ROWS rows or more; else through
#: BLAS, whatever the thread count. Packing costs about one step's product, once per call: the
#: packed product gains from hidden 400 at any rows and at hidden 200 from 32 rows; the 150 k floor
#: keeps the GRU at hidden 200 (120 k elements) on BLAS, where packed it trained slower. Measured
#: on a Zen 4 (AVX-512) and a Zen 3 (AVX2): docs/speed.md, "oneDNN or BLAS for a product".
ONEDNN_MIN_WEIGHT = 250_000
ONEDNN_MIN_WEIGHT_MANY_ROWS = 150_000
ONEDNN_MANY_ROWS = 32
#: On AMD Zen 5 (CPU family 26) and later, oneDNN's packed products run about twice as fast as
#: BLAS already at hidden 200 and 20 rows, packing included: from this many elements at any rows
#: (or ONEDNN_MIN_WEIGHT, if lower). Measured on a Zen 5: docs/speed.md, "AMD EPYC Zen 5".
ONEDNN_MIN_WEIGHT_ZEN5 = 100_000
ZEN5_FAMILY = 26


@functools.cache
def _onednn_ops_work() -> bool:
    """Whether this torch build has the oneDNN linear ops and they compute ``x @ w.T``.

    Cached, so it runs once, inside whatever context the first caller has: autocast is
    switched off for it (the probe checks float32 products), and it never raises: any failure
    means "no" and sends every product to BLAS.
    """
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:
        with torch.autocast("cpu", enabled=False), torch.no_grad():
            x = torch.arange(6.0).view(2, 3)
            w = torch.arange(12.0).view(4, 3) / 7
            packed = ops._reorder_linear_weight(w, None)
            y = ops._linear_pointwise(x, packed, None, "none", [], "")
            y2 = ops._linear_pointwise.binary(x, y, packed, None, "add")
            expected = x @ w.t()
            if y.dtype != torch.float32 or y2.dtype != torch.float32:
                return False
            return torch.allclose(y, expected, atol=1e-5) and torch.allclose(y2, 2 * expected, atol=1e-5)
    except Exception:  # any failure of the probe means: not usable here
        return False


def onednn_enabled(t: Tensor) -> bool:
    """Whether products with ``t``'s dtype and device go through oneDNN."""
    return onednn_enabled_on(t.device, t.dtype)


def onednn_enabled_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products of ``dtype`` on ``device`` go through oneDNN."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and bool(torch.backends.mkldnn.enabled)
        and _onednn_ops_work()
    )


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for 2-D operands of a whole sequence (``a`` ``[m, k]``, ``b`` ``[k, n]``),
    through oneDNN where :class:`~rnndrop.kernels.matmul.StepWeight` uses it.

    oneDNN reads its weight operand contiguous or transposed but wants the rows operand
    contiguous, so a transposed ``a`` (a weight gradient ``dzᵀ m``) is computed as
    ``(bᵀ aᵀ)ᵀ``, copying whichever operand is smaller (the result is then a transposed
    view); an operand with other strides is copied.
    """
    if not (onednn_enabled(a) and b.dtype == a.dtype):
        return a.mm(b)
    b = b if _dense(b) else b.contiguous()
    if a.is_contiguous() or a.numel() <= b.numel() or not _dense(a):
        return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.t(), None, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(b.t().contiguous(), a, None, "none", [], "").t()


def _dense(t: Tensor) -> bool:
    """Whether oneDNN reads ``t`` as a weight without a reorder of its own: contiguous or a
    transposed contiguous view. Other strides (a slice of columns) make it reorder the operand on
    every product, far slower than a copy (docs/speed.md, "Operands oneDNN reads without a copy"),
    so such an operand is copied first."""
    return t.is_contiguous() or t.t().is_contiguous()


def worth_onednn(weight: Tensor, rows: int) -> bool:
    """Whether products of ``rows`` rows by ``weight`` (or one gate's block of it) are faster
    through oneDNN than through BLAS: large enough a weight, float32, oneDNN there. The rule
    depends on the weight, the rows and the CPU's family alone, so a run computes the same
    products in every process on one machine (a resumed run continues bit for bit)."""
    n = weight.numel()
    if amd_cpu_family() >= ZEN5_FAMILY:  # a lower floor at any rows
        large = n >= min(ONEDNN_MIN_WEIGHT, ONEDNN_MIN_WEIGHT_ZEN5)
    else:
        large = n >= ONEDNN_MIN_WEIGHT or (n >= ONEDNN_MIN_WEIGHT_MANY_ROWS and rows >= ONEDNN_MANY_ROWS)
    return large and onednn_enabled(weight)


def sequence_through_onednn(weight: Tensor) -> bool:
    """Whether the compiled and per-gate kernels' whole-sequence products with ``weight`` (every
    step's rows at once, not packed: the per-gate input projection and its gradients, ``dW_hh``)
    go through oneDNN rather than BLAS: on AMD Zen 5 and later, where oneDNN runs them faster at
    every size measured (docs/speed.md, "AMD EPYC Zen 5"); elsewhere BLAS, the faster there (the
    per-gate forward keeps :func:`worth_onednn`)."""
    return amd_cpu_family() >= ZEN5_FAMILY and onednn_enabled(weight)


@functools.cache
def amd_cpu_family() -> int:
    """The CPU family of an AMD processor (``cpu family`` in ``/proc/cpuinfo``; 25: Zen 3 and 4,
    26: Zen 5), or 0 for another vendor or where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return amd_family_in(f.read(65536))
    except OSError:
        return 0


def amd_family_in(cpuinfo: str) -> int:
    """:func:`amd_cpu_family` from the text of ``/proc/cpuinfo``."""
    if "AuthenticAMD" not in cpuinfo:
        return 0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "cpu family":
            return int(value) if value.strip().isdigit() else 0
    return 0
