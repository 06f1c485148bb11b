r"""What the Triton step kernels of the LSTM and the GRU share (:mod:`rnndrop.kernels.triton_lstm`,
:mod:`rnndrop.kernels.triton_gru`): gate functions, where a row finds its previous state, the
next step's masked state (forward) and the gradient that reaches a state (backward).

Rows are those of :mod:`rnndrop.kernels.schedule`: a step with ``b`` rows, whose first ``carried``
rows continue the step that ran before and whose other rows start from the initial state. A
kernel's lane is one element ``(k, j)`` of a row; every kernel pointer is already offset to its
step's first row. The masked state that the step after (``b'`` rows, mask ``M'``) multiplies by
``W_hh``, written by the forward kernel of the step before it::

    m'[k]  = h'[k] * M'[k]         (per gate g: m'^g[k] = h'[k] * M'^g[k])
    h'[k]  = h_t[k]  for k < b      (the rows this step ran),
             h_0[k]  for b <= k < b' (sequences that start at the step after: reverse direction)

The gradient reaching ``h_{t-1}`` of the step after, gathered by the backward kernel of this step
(which runs next), where ``dm' = W_hh^T dz'`` is that step's product::

    dh_t[k]  = d_out_t[k] + carry[k] + Σ_g dm'^g[k] * M'^g[k]          (the last term for k < b')
    carry[k] = what the step after sent directly (GRU: dh' * z'; LSTM: 0), or dh_n[k] for a
               sequence that ends at this step; rows b <= k < b' keep carry + Σ_g dm' M' as dh_0[k]

``tanh(x) = 2 σ(2x) - 1`` (``σ(x) = 1 / (1 + e^{-x})``): one exponential, and no overflow to
NaN at large ``|x|``. Values are loaded in the storage dtype and computed in ``acc`` (float32, or
float64 for float64 tensors).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "gather_state_grad", "load_previous", "next_state", "sigmoid", "state_grad", "store_next_state", "tanh",
]


@triton.jit
def sigmoid(x):
    """``σ(x) = 1 / (1 + e^{-x})``."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def tanh(x):
    """``tanh(x) = 2 σ(2x) - 1``."""
    return 2.0 * sigmoid(2.0 * x) - 1.0


@triton.jit
def lanes_of(b, width, n, BLOCK: tl.constexpr):
    """This program's lanes ``(k, j, lanes, rows)``: lane ``k * width + j`` is column ``j`` of row
    ``k``; ``lanes`` the ones below ``n``, ``rows`` those of the step's ``b`` rows."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    k = offs // width
    lanes = offs < n
    return k, offs % width, lanes, lanes & (k < b)


@triton.jit
def load_previous(prev_ptr, init_ptr, k, j, width, carried, rows, acc):
    """The state row ``k`` starts its step from: row ``k`` of the step before where ``k < carried``,
    else row ``k`` of the initial state (both ``[*, width]``); ``rows``: the lanes of the step's rows."""
    mine = rows & (k < carried)
    prev = tl.load(prev_ptr + k * width + j, mask=mine, other=0.0).to(acc)
    init = tl.load(init_ptr + k * width + j, mask=rows & (k >= carried), other=0.0).to(acc)
    return tl.where(mine, prev, init)


@triton.jit
def store_next_state(
    h, k, j, width, b, b_next, lanes, h0_ptr, mask_ptr, mask_row, mask_gate, m_ptr, m_row, m_gate,
    MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """``m'[k] = h'[k] * M'[k]`` for ``k < b'`` (module docstring); ``h``: this step's new state for
    ``k < b``. Row ``k``, gate ``g`` of the mask and of ``m'`` at ``k * row + g * gate + j``."""
    nxt = lanes & (k < b_next)
    h0 = tl.load(h0_ptr + k * width + j, mask=nxt & (k >= b), other=0.0).to(h.dtype)
    src = tl.where(k < b, h, h0)
    for g in tl.static_range(MASK_GATES):
        value = src
        if HAS_MASK:
            m = tl.load(mask_ptr + k * mask_row + g * mask_gate + j, mask=nxt, other=0.0)
            value = src * m.to(h.dtype)
        tl.store(m_ptr + k * m_row + g * m_gate + j, value, mask=nxt)


@triton.jit
def gather_state_grad(
    d_out_ptr, dm_ptr, dm_row, dm_gate, mask_ptr, mask_row, mask_gate, dh_state_ptr,
    k, j, width, b, b_next, lanes, acc,
    MASK_GATES: tl.constexpr, HAS_DOUT: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_MASK: tl.constexpr,
):
    """``dh_t[k]`` for ``k < b`` (module docstring; ``carry`` is ``dh_state`` ``[B, width]``), and
    ``dh_0[k]`` into ``dh_state`` for ``b <= k < b'``."""
    carry = tl.load(dh_state_ptr + k * width + j, mask=lanes, other=0.0).to(acc)
    if HAS_NEXT:
        nxt = lanes & (k < b_next)
        for g in tl.static_range(MASK_GATES):
            dm = tl.load(dm_ptr + k * dm_row + g * dm_gate + j, mask=nxt, other=0.0).to(acc)
            if HAS_MASK:
                dm = dm * tl.load(mask_ptr + k * mask_row + g * mask_gate + j, mask=nxt, other=0.0).to(acc)
            carry += dm
    tl.store(dh_state_ptr + k * width + j, carry, mask=lanes & (k >= b))
    if HAS_DOUT:
        carry += tl.load(d_out_ptr + k * width + j, mask=lanes & (k < b), other=0.0).to(acc)
    return carry


@triton.jit
def next_state(
    out_ptr, h0_ptr, mask_ptr, mask_row, mask_gate, m_ptr, m_row, m_gate, b, b_next, width, n,
    MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr,
):
    """Kernel: the masked state ``m'`` from this step's outputs ``out`` ``[b, width]`` (written by a
    product: the LSTM's projection) and ``h_0``; with ``b = 0``, the first step's from ``h_0``.
    ``n = max(b, b') * width`` lanes; ``F64``: compute in float64."""
    k, j, lanes, rows = lanes_of(b, width, n, BLOCK)
    acc = tl.float64 if F64 else tl.float32
    h = tl.load(out_ptr + k * width + j, mask=rows, other=0.0).to(acc)
    store_next_state(h, k, j, width, b, b_next, lanes, h0_ptr, mask_ptr, mask_row, mask_gate,
                     m_ptr, m_row, m_gate, MASK_GATES, HAS_MASK)


@triton.jit
def state_grad(
    d_out_ptr, dm_ptr, dm_row, dm_gate, mask_ptr, mask_row, mask_gate, dh_state_ptr, dh_ptr,
    b, b_next, width, n,
    MASK_GATES: tl.constexpr, HAS_DOUT: tl.constexpr, HAS_NEXT: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Kernel: ``dh_t`` of the step's rows into ``dh`` ``[b, width]`` and ``carry = 0`` there (the
    LSTM's projection takes it from here); ``dh_0`` of rows ``b <= k < b'``. With ``b = 0``, after
    the last backward step: ``dh_0`` of the first step's rows. ``n = max(b, b') * width`` lanes."""
    k, j, lanes, rows = lanes_of(b, width, n, BLOCK)
    acc = dh_state_ptr.dtype.element_ty
    dh = gather_state_grad(d_out_ptr, dm_ptr, dm_row, dm_gate, mask_ptr, mask_row, mask_gate, dh_state_ptr,
                           k, j, width, b, b_next, lanes, acc, MASK_GATES, HAS_DOUT, HAS_NEXT, HAS_MASK)
    tl.store(dh_ptr + k * width + j, dh, mask=rows)
    tl.store(dh_state_ptr + k * width + j, tl.zeros_like(dh), mask=rows)
