"""How the compiled kernel (:mod:`rnndrop.kernels.compiled`) runs one call: which step products
go through oneDNN's packed weights instead of BLAS (:func:`~rnndrop.kernels.onednn.worth_onednn`),
and whether the LSTM's forward step is split by hidden units over the threads instead of by rows
(``csrc/lstm.cpp``). Both are choices of speed alone: every path computes the same equations (the
tests compare each with the reference kernel)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rnndrop.kernels.onednn import worth_onednn

__all__ = ["gate_parts", "packed_weights", "split_parts"]


def packed_weights(w_hh: Tensor, mask: Tensor | None, rows: int, transposed: bool = False) -> list[Tensor]:
    """``W_hh`` ``[G * H, P]`` packed for oneDNN's products of a step's rows (at most ``rows``):
    ``[]`` where they go through BLAS, one packed weight, or with per-gate masks one a gate
    (``W_g``, rows ``g * H`` to ``(g + 1) * H``), each product judged on its own size, and each
    gate's cut into :func:`gate_parts` blocks of output rows (part ``j`` of ``n`` rows: rows
    ``j n // S`` to ``(j + 1) n // S``). ``transposed``: ``W_hhᵀ`` (``W_gᵀ``) packed instead, for
    the backward pass's ``dz W``. The products of one step run one a thread (``csrc/common.h``)."""
    gates = mask.shape[-2] if mask is not None and mask.dim() == 4 else 1
    blocks = w_hh.detach().chunk(gates, 0)
    if not worth_onednn(blocks[0], rows):
        return []
    pack = torch.ops.mkldnn._reorder_linear_weight
    if gates == 1:
        return [pack((blocks[0].t() if transposed else blocks[0]).contiguous(), None)]
    packed = []
    for block in blocks:
        w = block.t() if transposed else block  # [out, in]
        parts = gate_parts(gates, w.shape[0])
        for j in range(parts):
            packed.append(pack(w[j * w.shape[0] // parts : (j + 1) * w.shape[0] // parts].contiguous(), None))
    return packed


def gate_parts(gates: int, out_rows: int) -> int:
    """Into how many blocks of output rows each gate's product is cut, so that the ``G S``
    products of a step share the threads evenly: ``S = threads / gcd(G, threads)`` (a GRU's three
    gates on 2 threads: 6 products, 3 a thread, where 3 left one thread idle a third of the time),
    with at least 32 rows a block."""
    threads = torch.get_num_threads()
    return max(1, min(threads // math.gcd(gates, threads), out_rows // 32))


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
