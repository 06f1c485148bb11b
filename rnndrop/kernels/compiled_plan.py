"""How the compiled kernel (:mod:`rnndrop.kernels.compiled`) runs one call: which step products
go through oneDNN's packed weights instead of BLAS, and whether the LSTM's forward step is split
by hidden units over the threads instead of by rows (``csrc/lstm.cpp``). Both are choices of
speed alone: every path computes the same equations (the tests compare each with the reference
kernel)."""

from __future__ import annotations

import torch
from torch import Tensor

from rnndrop.kernels.matmul import onednn_enabled

__all__ = ["packed_weights", "split_parts"]

#: A recurrent weight (with per-gate masks: each gate's block) goes through oneDNN's packed
#: products (float32, where torch has oneDNN) when it has at least ONEDNN_MIN_WEIGHT elements, or at least
#: ONEDNN_MIN_WEIGHT_MANY_ROWS and the steps have ONEDNN_MANY_ROWS rows or more; else through
#: BLAS, whatever the thread count. Packing costs about one step's product (208 µs at H 200, 1
#: thread), once per call. Measured on an AMD EPYC Zen 4 (AVX-512; torch's MKL runs its AVX2
#: code there, oneDNN AVX-512), one step's product [rows, H] x [H, 4H], 1 / 2 threads, BLAS
#: against packed: H 400 (640 k elements), 20 rows 308 / 213 µs against 242 / 136; H 650 (1.7 M)
#: 883 / 584 against 618 / 325; H 200 (160 k), 20 rows 93 / 56 against 91 / 50, 64 rows 263 /
#: 157 against 216 / 114, 200 rows 752 / 445 against 633 / 317; H 100 (40 k), 64 rows 54 / 38
#: against 75 / 39. Time over nn.LSTM, tied LSTM, BLAS against packed: at 400, batch 20, 1.02 /
#: 1.18 against 0.96 / 1.09; at 200, batch 64, 0.99 / 1.23 against 0.90 / 1.07 (training), 1.39
#: against 1.29 (2 threads, Monte-Carlo forward). The GRU at 200 (120 k elements), batch 64,
#: trained 3-10% slower packed: hence 150 k. On a Zen 3 (AVX2) BLAS was the faster at 200 and
#: even at 650 with 1 thread (batch 20).
ONEDNN_MIN_WEIGHT = 250_000
ONEDNN_MIN_WEIGHT_MANY_ROWS = 150_000
ONEDNN_MANY_ROWS = 32


def packed_weights(w_hh: Tensor, mask: Tensor | None, rows: int, transposed: bool = False) -> list[Tensor]:
    """``W_hh`` ``[G * H, P]`` packed for oneDNN's products of a step's rows (at most ``rows``):
    ``[]`` where they go through BLAS, one packed weight, or with per-gate masks one a gate
    (``W_g``, rows ``g * H`` to ``(g + 1) * H``), each product judged on its own size.
    ``transposed``: ``W_hhᵀ`` (``W_gᵀ``) packed instead, for the backward pass's ``dz W``."""
    gates = mask.shape[-2] if mask is not None and mask.dim() == 4 else 1
    blocks = w_hh.detach().chunk(gates, 0)
    n = blocks[0].numel()
    worth_it = n >= ONEDNN_MIN_WEIGHT or (n >= ONEDNN_MIN_WEIGHT_MANY_ROWS and rows >= ONEDNN_MANY_ROWS)
    if not worth_it or not onednn_enabled(w_hh):
        return []
    pack = torch.ops.mkldnn._reorder_linear_weight
    return [pack((b.t() if transposed else b).contiguous(), None) for b in blocks]


def split_parts(w_hh: Tensor, w_hr: Tensor | None, mask: Tensor | None, packed: list[Tensor],
                batch_sizes: list[int]) -> int:
    """Into how many parts of hidden units (one a thread) the LSTM's forward step is split, or 0
    for the loop split by rows. The split runs a step in one parallel region instead of three
    (mask, product, rows), each thread with its own units' columns of W_hh (per-gate masks:
    each gate's, in one batched product); it needs several threads, padded input (every step all
    rows), no projection, products through BLAS (oneDNN's packed products split their own work),
    and 32 units a part."""
    parts = min(torch.get_num_threads(), w_hh.shape[0] // 4 // 32)
    if parts < 2 or w_hr is not None or packed or len(set(batch_sizes)) != 1:
        return 0
    return parts
