r"""The persistent loop of the "triton" kernel: one launch runs every time step of a layer and
direction, forward, and one runs them all in reverse, backward.

Each of the ``n_programs`` programs owns ``BH`` hidden units ``j`` (columns of the state) of a
block of ``BB`` rows (sequences; one block holds the whole batch unless the grid has room for more
programs) for the whole sequence and keeps their cell state in registers; the recurrent product is
computed in the kernel with ``tl.dot`` over the rows of ``W_hh`` of its units (streamed from L2,
where the whole matrix stays between steps; or, with :attr:`Launch.resident`, loaded once before the
first step and kept on chip, one ``[K, units]`` tile per gate, where the hidden size is at most
:data:`MAX_RESIDENT`: Triton places the tiles in shared memory). The programs meet at a grid
barrier after every step, because the next step's product needs every column of the state.
Running steps ``s = 1 .. S`` (step 0 is a virtual step with no rows, whose "next state" is the
first real step's), rows ``k`` and ``m_s = h_{s-1} * M_s`` as in
:mod:`rnndrop.kernels.triton_common`::

    LSTM forward   z_s[k, g·H + j] = x̂_s[k, g·H + j] + Σ_p m_s^g[k, p] W_hh[g·H + j, p]
                   i, f, g, o = σ(z_i), σ(z_f), tanh(z_g), σ(z_o)
                   c_s = f c_{s-1} + i g,   h_s = o tanh(c_s)
                   m_{s+1}[k] = h'[k] * M_{s+1}[k]   (h' = h_s, or h_0 for rows joining at s+1)
                   — barrier —
    GRU forward    a = W_hh m_s + b_hh,  r = σ(x̂_r + a_r),  z = σ(x̂_z + a_z),  n = tanh(x̂_n + r a_n)
                   h_s = n + z (h_{s-1} - n),  then m_{s+1} as above — barrier —
    backward       dm_{s+1}^g[k, p] = Σ_h dz_{s+1}[k, g·H + h] W_hh[g·H + h, p]   (needs all of dz_{s+1})
                   dh_s[k] = d_out_s[k] + carry[k] + Σ_g dm_{s+1}^g[k] M_{s+1}^g[k]
                   then the gate gradients of :mod:`rnndrop.kernels.triton_lstm` /
                   :mod:`rnndrop.kernels.triton_gru` into dz_s, and carry (GRU: dh_s z) — barrier —

The backward loop runs from ``s = S`` down to the virtual step 0, whose rows are none: there it
only gathers ``dh_0`` of the first step's rows. ``dW_hh``, ``db_hh`` and the mask's gradient are
products over all steps after the loop, as in the step kernel, from the very tensors the step
kernel saves: either kernel's backward runs on either kernel's forward.

The barrier is an atomic counter: every program adds one after its step, then spins until the
counter reaches ``n_programs`` times the number of steps done. The forward loops add their one as
soon as the next state is stored (the one thing other programs read during the launch) and store
the gates, cells and outputs of the step while the others arrive. All programs must be resident at
once: the grid is at most one program per multiprocessor, launched cooperatively where Triton can
(CUDA then co-schedules every program or refuses the launch). A program that spins too long adds a
large number to the counter (every later barrier then passes at once) and the launch writes NaN
into its outputs; the host reads the counter when the launch has finished (a cooperative launch:
later, without waiting, in batches of a pool of counters) or at once (else: the call then reruns on
the step kernel), and from then on that device runs the step kernel. With one program there is nothing
to wait for, which is how Triton's interpreter (programs one after another) runs it on CPU;
``per_step=True`` instead launches the same body once per step, several programs without a
barrier, so that the slicing over programs is tested on CPU too.

The hidden size reaches the loops as ``H = H_VEC · VEC`` with ``VEC`` a compile-time power of two
dividing it (:func:`_vector`): Triton then knows every row of ``W_hh``, of the masked states and of
the gates starts on a multiple of ``VEC`` values, and loads them in vectors (16 bytes where ``VEC``
is 4 or more) instead of one value at a time; an integer argument alone tells it only whether the
value is a multiple of 16, which 200, 650 or 1500 are not. The masked states ``m`` (and their
gradients) are the loop's own buffers, laid out ``[N, (G,) H]``, so their row strides follow from
``H`` and need no argument. Where :data:`HALF_STATE` (a setting, off until timed), the forward loops
also write each ``m_{s+1}`` in float16 and read that copy for the products (half the bytes a
program reads of the state a step), unless a program finds, before the first step, that a state
could leave float16's range (:func:`_flag_beyond_half`): then every program reads the float32
states (two compiled copies of the time loop, one per reading); backward reads the float32 states.

The time loops are never software-pipelined (``tl.range(..., num_stages=1)``). Triton pipelines the
innermost loop whose loads feed ``tl.dot`` (in every precision): it issues the loads of later
iterations before the current one has run. That is meant for the loop over ``K`` blocks of
``W_hh`` inside a step. Where a step holds no loop, neither a grid barrier's spin loop (one program:
a batch of 16 or fewer where the hidden units fit one program) nor a ``K`` loop (resident tiles, or
a hidden size the compiler knows to be one block: ``H_VEC`` 1, hidden 1, 2, 4, 8 or 16), the time
loop is the innermost, and its pipeline read the masked states (backward: ``dz``) of steps
``s + 1`` and ``s + 2`` before step ``s`` had stored them: stale memory, which no compiler sees
through global memory, on a GPU only (the interpreter does not pipeline). For the same reason a
step ends with a barrier of the program's threads also where there is no grid barrier
(:func:`_wait`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple, TypeVar

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from rnndrop.kernels.precision import cudnn_rnn_tf32, products_as_cudnn
from rnndrop.kernels.schedule import Schedule
from rnndrop.kernels.triton_common import sigmoid, tanh
from rnndrop.kernels.triton_plan import (
    LAUNCH_OPTIONS,
    accumulation_dtype,
    as_dtype,
    autocast_off,
    initial_grad,
    interpreted,
)

__all__ = [
    "Launch", "first_or_step", "gave_up", "gru_backward", "gru_forward", "launched_as", "lstm_backward",
    "lstm_forward", "plan", "turned_off", "usable",
]

T = TypeVar("T")

#: The counter value a program that gave up waiting adds (far above any step count times programs).
GAVE_UP = 1 << 30

#: The persistent loops compute a row's offset as ``row * width`` in 32 bits (64-bit products in
#: every address cost registers the loop needs): a call whose gates ``[N, G * H]`` hold this many
#: elements or more runs the step kernel, whose offsets are within one step.
MAX_ELEMENTS = 1 << 31
#: Spins of the barrier before a program gives up (a step takes microseconds; this is about a second).
SPIN_LIMIT = 1 << 21
#: The largest batch kept in one block of rows, and the widest block of hidden units a program owns.
MAX_BATCH = 256
MAX_UNITS = 64
#: Table columns of a step (:func:`_step_table`).
_COLUMNS = 8
#: The largest hidden size whose ``W_hh`` tiles a program may keep on chip across steps
#: (:attr:`Launch.resident`: ``4 x 256 x 16`` float32 values for the LSTM, 64 KiB a program).
MAX_RESIDENT = 256
# The three as the loops read them (Triton reads a global inside a kernel only as a constexpr).
_GAVE_UP_BIT = tl.constexpr(GAVE_UP)
_SPINS = tl.constexpr(SPIN_LIMIT)
_TABLE_COLUMNS = tl.constexpr(_COLUMNS)
#: Whether :func:`plan` keeps the tiles resident where the hidden size allows, unless
#: ``tuning["resident"]`` says otherwise. Off until a GPU has timed it against streaming them
#: (``benchmarks/persistent_tuning.py``; docs/gpu.md): a kernel may not run slower than before.
RESIDENT = False
#: The cells (``"lstm"``, ``"gru"``) whose calls :func:`plan` gives each program fewer units than
#: a tile holds where that puts programs on multiprocessors that would idle (hidden 1500 in blocks
#: of 16: 94 of 132), unless ``tuning["spread"]`` says otherwise: each program then streams fewer
#: rows of ``W_hh`` a step, for the same ``tl.dot`` work. The LSTM's since the H200's sixth round
#: (docs/gpu.md: its GPU time and its training step as fast or faster at every shape timed, in three
#: rounds); not the GRU's, whose steps at hidden 1500 it made slower in each of them.
SPREAD = frozenset({"lstm"})
#: Programs a multiprocessor holds at once in :func:`plan`'s grid, unless ``tuning["per_sm"]`` says
#: otherwise. Where the loop waits on L2 for ``W_hh`` (hidden 1500: each program streams its rows a
#: step), two programs a multiprocessor keep twice the loads in flight, if the kernel's registers
#: and shared memory let two be resident at once (a cooperative launch is refused otherwise). One
#: until a GPU has timed two, as :data:`RESIDENT`.
PER_SM = 1
#: Whether the forward loops read the masked states ``m`` from a float16 copy where the products
#: run in TF32, unless ``tuning["half_state"]`` says otherwise. Every program reads the whole state
#: at every step (rows x H, four times that with per-gate masks), which outweighs its rows of
#: ``W_hh`` from batch 64 on; float16 halves it. TF32 keeps the same 10 bits of a value as float16
#: wherever float16 is normal (from 6.1e-5 to 65504 in magnitude; below it, an absolute error under
#: 3e-8, and the float32 copy that backward reads is kept as it is). A state beyond 65504 (a mask
#: or an initial state that large) would become inf: the loop checks that range before the first
#: step and reads the float32 states where it fails (:func:`_flag_beyond_half`). Off by default until
#: a GPU has timed it.
HALF_STATE = False


#: Integer arguments of the loops compiled as plain integers (Triton would otherwise compile a
#: variant for each value that is 1 or a multiple of 16): the steps run (variable-length BPTT) and
#: the rows of the sequence.
_RUN_TIME_INTS = ["s_begin", "s_end", "N"]
#: The widest vector a row's length is declared a multiple of (16 bfloat16 values; 4 float32 values
#: already fill the 16 bytes of a load).
MAX_VECTOR = 16


def _vector(hidden: int) -> int:
    """``VEC`` of the loops: the largest power of two up to :data:`MAX_VECTOR` dividing ``hidden``."""
    return min(hidden & -hidden, MAX_VECTOR)


@triton.jit
def _grid_barrier(counter_ptr, target, SYNC: tl.constexpr):
    """Wait until every program has reached ``target``; give up after :data:`SPIN_LIMIT` spins."""
    _arrive(counter_ptr, SYNC)
    _wait(counter_ptr, target, SYNC)


@triton.jit
def _arrive(counter_ptr, SYNC: tl.constexpr):
    """This program's arrival at the barrier: what it stored before is visible to every program
    that has waited for it (:func:`_wait`). Stores after it are not: only what no other program
    reads before the launch ends may follow it (the forward loops' gates, cells and outputs), and
    the barrier's latency then overlaps them."""
    if SYNC:
        tl.debug_barrier()  # every thread's stores of this step before the release (one thread's)
        tl.atomic_add(counter_ptr, 1, sem="release")


@triton.jit
def _wait(counter_ptr, target, SYNC: tl.constexpr):
    """Spin until the counter reaches ``target`` (every program has arrived); give up after
    :data:`SPIN_LIMIT` spins (every later barrier of the launch then passes at once). Without
    ``SYNC`` (one program, or one step a launch) only the program's own threads meet."""
    if SYNC:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        spins = 0
        while (seen < target) & (spins < _SPINS):
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
            spins += 1
        if seen < target:  # the GAVE_UP bit, set once however many programs give up together
            tl.atomic_or(counter_ptr, _GAVE_UP_BIT)
    # no thread reads the next step's data before the acquire, nor (one program) before every thread
    # of the program has stored its part: the compiler orders a program's threads only around its
    # own shared memory, which need not lie between the two
    tl.debug_barrier()


@triton.jit
def _poison_if_gave_up(counter_ptr, ptr, rows, width, ks, cols, H, GATES: tl.constexpr, SYNC: tl.constexpr,
                       BB: tl.constexpr, BH: tl.constexpr):
    """NaN into columns ``g·H + j`` (this program's units) of every row of ``ptr`` ``[rows, width]``
    where a barrier gave up: nothing that ran without its barrier passes for a result."""
    if SYNC:  # noqa: SIM102 (a compile-time test around a run-time one: Triton keeps them apart)
        if tl.atomic_add(counter_ptr, 0) >= _GAVE_UP_BIT:
            nan = tl.zeros((BB, BH), dtype=tl.float32) + float("nan")
            for r0 in range(0, rows, BB):
                for g in tl.static_range(GATES):
                    inside = ((r0 + ks) < rows)[:, None] & (cols < H)[None, :]
                    tl.store(ptr + (r0 + ks)[:, None] * width + g * H + cols[None, :],
                             nan.to(ptr.dtype.element_ty), mask=inside)


@triton.jit
def _block(B, H, BB: tl.constexpr, BH: tl.constexpr, UNITS: tl.constexpr):
    """This program's rows ``ks``, units ``cols`` (a tile ``BH`` wide of which the program owns
    ``UNITS``), which of them exist, and their offsets in a ``[B, H]`` state. Program ``p`` runs unit
    block ``p mod ceil(H / UNITS)`` of row block ``p div ceil(H / UNITS)``. Lanes past the program's
    own units (``UNITS < BH``) are given columns past ``H``: every test ``cols < H`` of the loops then
    leaves them out, as it leaves out the columns past the hidden size. (Moved by ``H`` rather than
    set to it, so that Triton still sees the columns in runs of ``UNITS``' largest power of two:
    the backward loop loads rows of ``W_hh`` along them.)"""
    unit_blocks = tl.cdiv(H, UNITS)
    ks = (tl.program_id(0) // unit_blocks) * BB + tl.arange(0, BB)
    lanes = tl.arange(0, BH)
    cols = (tl.program_id(0) % unit_blocks) * UNITS + lanes
    if UNITS < BH:
        cols = tl.where(lanes < UNITS, cols, cols + H)
    return ks, cols, (ks < B)[:, None] & (cols < H)[None, :], ks[:, None] * H + cols[None, :]


@triton.jit
def _row_lengths(H_VEC, VEC: tl.constexpr, MASK_GATES: tl.constexpr):
    """``(H, row stride, gate stride)`` of the hidden size ``H = H_VEC · VEC`` and of the masked
    states ``[N, (MASK_GATES,) H]``, each known to the compiler as a multiple of ``VEC``."""
    H = H_VEC * VEC
    return H, MASK_GATES * H, H


@triton.jit
def _step_row(table_ptr, s):
    """``(b, off, carried, prev_off, nb, noff, nmoff)`` of step ``s`` (see :func:`_step_table`)."""
    row = table_ptr + s * _TABLE_COLUMNS
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
            tl.load(row + 4), tl.load(row + 5), tl.load(row + 6))


@triton.jit
def _resident_tiles(w_ptr, cols, H, CELL_GATES: tl.constexpr, TRANSPOSED: tl.constexpr,
                    RESIDENT: tl.constexpr, BK: tl.constexpr):
    """Where ``RESIDENT``, this program's ``[BK, BH]`` tile of ``W_hh`` for each gate ``g``, loaded once
    (zeros past ``H``; the fourth repeats the third for a cell of three gates): ``(p, j) -> W[g·H + j, p]``
    for the forward products, ``(h, j) -> W[g·H + h, j]`` where ``TRANSPOSED`` (backward's
    ``dm = dz W``). Else four placeholders (the loops then stream ``W_hh``)."""
    if RESIDENT:
        p = tl.arange(0, BK)
        if TRANSPOSED:  # noqa: SIM108 (a compile-time choice: Triton builds the branch taken)
            at = w_ptr + p[:, None] * H + cols[None, :]
        else:
            at = w_ptr + cols[None, :] * H + p[:, None]
        inside = (p < H)[:, None] & (cols < H)[None, :]
        w0 = tl.load(at, mask=inside, other=0.0)
        w1 = tl.load(at + H * H, mask=inside, other=0.0)
        w2 = tl.load(at + 2 * H * H, mask=inside, other=0.0)
        w3 = w2
        if CELL_GATES == 4:
            w3 = tl.load(at + 3 * H * H, mask=inside, other=0.0)
    else:
        w0 = 0
        w1 = 0
        w2 = 0
        w3 = 0
    return w0, w1, w2, w3


@triton.jit
def _tile_of_gate(w0, w1, w2, w3, g: tl.constexpr):
    """Tile ``g`` of :func:`_resident_tiles`."""
    if g == 0:
        w = w0
    elif g == 1:
        w = w1
    elif g == 2:
        w = w2
    else:
        w = w3
    return w


# How the loops read what they stream from global memory: the states ``m`` and ``dz``, which other
# programs write between steps, past L1 (``.cg``), so never from a stale line; the rows of ``W_hh``
# through L1 (``.ca``), since a program reads the same rows at every step and at hidden 200-650 they
# fit in what shared memory leaves of L1. Triton 3.9 copies them so; Triton 3.6 copies every 16-byte
# piece past L1 whatever the load asks (4- and 8-byte pieces through it).
@triton.jit
def _block_products(m_ptr, m_row, m_gate, w_ptr, w0, w1, w2, w3, k0, off, rows, ks, cols, H, a0, a1, a2, a3,
                    CELL_GATES: tl.constexpr, MASK_GATES: tl.constexpr, RESIDENT: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr, HALF_STATE: tl.constexpr,
                    BK: tl.constexpr):
    """``a_g += Σ_p m^g[k, p] W[g·H + j, p]`` over the block ``p = k0 .. k0 + BK`` (one load of ``m``
    serves every gate without per-gate masks); ``W_hh``'s tiles loaded here, or where ``RESIDENT``
    the tiles ``w0 .. w3``. ``HALF_STATE``: ``m`` is float16 (widened to float32 for the product)."""
    p = k0 + tl.arange(0, BK)
    m_at = m_ptr + (off + ks)[:, None] * m_row + p[None, :]
    m_in = rows & (p < H)[None, :]
    w_at = w_ptr + cols[None, :] * H + p[:, None]
    w_in = (cols < H)[None, :] & (p < H)[:, None]
    m = tl.load(m_at, mask=m_in, other=0.0, cache_modifier=".cg")
    if HALF_STATE:
        m = m.to(tl.float32)
    for g in tl.static_range(CELL_GATES):
        if MASK_GATES > 1 and g > 0:
            m = tl.load(m_at + g * m_gate, mask=m_in, other=0.0, cache_modifier=".cg")
            if HALF_STATE:
                m = m.to(tl.float32)
        if RESIDENT:  # a compile-time choice: Triton builds the branch taken
            w = _tile_of_gate(w0, w1, w2, w3, g)
        else:
            w = tl.load(w_at + g * H * H, mask=w_in, other=0.0, cache_modifier=".ca")
        if UPCAST:
            part = tl.dot(m.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            part = tl.dot(m, w, input_precision=PRECISION)
        if g == 0:
            a0 += part
        elif g == 1:
            a1 += part
        elif g == 2:
            a2 += part
        else:
            a3 += part
    return a0, a1, a2, a3


@triton.jit
def _gate_products(m_ptr, m_row, m_gate, w_ptr, w0, w1, w2, w3, off, b, ks, cols, H,
                   CELL_GATES: tl.constexpr, MASK_GATES: tl.constexpr, RESIDENT: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr, HALF_STATE: tl.constexpr, BB: tl.constexpr,
                   BH: tl.constexpr, BK: tl.constexpr):
    """``[BB, BH]`` per gate ``g``: ``Σ_p m^g[k, p] W[g·H + j, p]`` over the rows ``k < b`` of the state
    at ``off``; the fourth is zeros for a cell of three gates. Streaming ``W_hh``, a loop over blocks of
    ``p``; where ``RESIDENT``, one block (``BK >= H``) with the tiles ``w0 .. w3`` of
    :func:`_resident_tiles`, and no loop over ``K`` blocks (nor a pipeline across steps: module docstring)."""
    a0 = tl.zeros((BB, BH), dtype=tl.float32)
    a1 = tl.zeros((BB, BH), dtype=tl.float32)
    a2 = tl.zeros((BB, BH), dtype=tl.float32)
    a3 = tl.zeros((BB, BH), dtype=tl.float32)
    rows = (ks < b)[:, None]
    if RESIDENT:
        a0, a1, a2, a3 = _block_products(m_ptr, m_row, m_gate, w_ptr, w0, w1, w2, w3, 0, off, rows, ks, cols,
                                         H, a0, a1, a2, a3, CELL_GATES, MASK_GATES, RESIDENT, PRECISION,
                                         UPCAST, HALF_STATE, BK)
    else:
        for k0 in range(0, H, BK):
            a0, a1, a2, a3 = _block_products(m_ptr, m_row, m_gate, w_ptr, w0, w1, w2, w3, k0, off, rows, ks,
                                             cols, H, a0, a1, a2, a3, CELL_GATES, MASK_GATES, RESIDENT,
                                             PRECISION, UPCAST, HALF_STATE, BK)
    return a0, a1, a2, a3


@triton.jit
def _step_inputs(table_ptr, s, x_ptr, mask_ptr, mask_row, ks, cols, H, GATES: tl.constexpr,
                 HAS_MASK: tl.constexpr):
    """What step ``s`` reads that no program writes during the loop, loaded before the barrier ahead
    of the step, so that its latency overlaps the wait: the step's row of the table, its rows of
    ``x_ptr`` ``[N, GATES·H]`` (this program's columns of each gate; zeros for a fourth gate the cell
    lacks) and the first gate's mask of the next state ``M_{s+1}`` (ones without a mask)."""
    b, off, carried, prev_off, nb, noff, nmoff = _step_row(table_ptr, s)
    live = (ks < b)[:, None] & (cols < H)[None, :]
    here = x_ptr + (off + ks)[:, None] * (GATES * H) + cols[None, :]
    x0 = tl.load(here, mask=live, other=0.0).to(tl.float32)
    x1 = tl.load(here + H, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(here + 2 * H, mask=live, other=0.0).to(tl.float32)
    x3 = tl.zeros_like(x2)
    if GATES == 4:
        x3 = tl.load(here + 3 * H, mask=live, other=0.0).to(tl.float32)
    m0 = tl.full(x0.shape, 1.0, tl.float32)
    if HAS_MASK:
        nxt = (ks < nb)[:, None] & (cols < H)[None, :]
        m0 = tl.load(mask_ptr + nmoff + ks[:, None] * mask_row + cols[None, :], mask=nxt, other=0.0)
        m0 = m0.to(tl.float32)
    return b, off, carried, prev_off, nb, noff, nmoff, x0, x1, x2, x3, m0


@triton.jit
def _store_next_state(h, h0, m0, mask_ptr, mask_row, mask_gate, m_ptr, m16_ptr, m_row, m_gate, ks, cols, b,
                      nb, noff, nmoff, H, MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr,
                      HALF_STATE: tl.constexpr):
    """``m_{s+1}[k] = h'[k] * M_{s+1}[k]`` for ``k < nb`` (``h'``: ``h`` for ``k < b``, else the
    tile ``h0`` of ``h_0``); ``m0`` is the first gate's mask tile (:func:`_step_inputs`). Where
    ``HALF_STATE``, also in float16 at ``m16_ptr`` (what the programs read for the next product)."""
    nxt = (ks < nb)[:, None] & (cols < H)[None, :]
    src = tl.where((ks < b)[:, None], h, h0)
    for g in tl.static_range(MASK_GATES):
        value = src
        if HAS_MASK:
            if g == 0:
                value = src * m0
            else:
                m = tl.load(mask_ptr + nmoff + ks[:, None] * mask_row + g * mask_gate + cols[None, :],
                            mask=nxt, other=0.0)
                value = src * m.to(tl.float32)
        at = (noff + ks)[:, None] * m_row + g * m_gate + cols[None, :]
        tl.store(m_ptr + at, value.to(m_ptr.dtype.element_ty), mask=nxt)
        if HALF_STATE:
            tl.store(m16_ptr + at, value.to(tl.float16), mask=nxt)


@triton.jit
def _store_gates(ptr, off, ks, cols, H, live, g0, g1, g2, g3, GATES: tl.constexpr):
    """This program's columns of each gate's tile into rows ``off + k`` (where ``live``) of ``ptr``
    ``[N, GATES·H]``, in its dtype; ``g3`` only for a cell of four gates."""
    here = ptr + (off + ks)[:, None] * (GATES * H) + cols[None, :]
    kind = ptr.dtype.element_ty
    tl.store(here, g0.to(kind), mask=live)
    tl.store(here + H, g1.to(kind), mask=live)
    tl.store(here + 2 * H, g2.to(kind), mask=live)
    if GATES == 4:
        tl.store(here + 3 * H, g3.to(kind), mask=live)


@triton.jit
def _flag_beyond_half(counter_ptr, h0, mask_ptr, mask_row, mask_gate, ks, cols, batch,
                      MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr):
    """Add 1 to the flag after the barrier's counter (``counter_ptr + 1``) where a masked state of
    this program's rows and units could leave float16's range (beyond 65504). Both cells keep
    ``|h_t| <= max(1, |h_0|)`` elementwise (an LSTM's ``|h_t| < 1``; a GRU's ``h_t`` lies between
    ``n_t`` and ``h_{t-1}``), so every masked state is bounded by ``|M| * max(1, |h_0|)``, checked
    here for the mask shared by every step (per-step masks never read float16: :func:`_half_state`)."""
    bound = tl.maximum(tl.abs(h0), 1.0)
    if HAS_MASK:
        largest = tl.zeros_like(bound)
        for g in tl.static_range(MASK_GATES):
            at = mask_ptr + ks[:, None] * mask_row + g * mask_gate + cols[None, :]
            m = tl.load(at, mask=batch, other=0.0)
            largest = tl.maximum(largest, tl.abs(m.to(tl.float32)) * bound)
        bound = largest
    beyond = tl.max(tl.max(tl.where(batch, bound, 0.0), axis=1), axis=0) > 65504.0
    tl.atomic_add(counter_ptr + 1, beyond.to(tl.int32))


@triton.jit
def _half_first_step(s_begin, s_end):
    """Where a launch with float16 copies starts reading them: after step 0 (no rows: it writes the
    first masked state and, with the barrier after it, every program's flag is in), else at once."""
    return tl.maximum(s_begin, tl.minimum(s_end, 1))


@triton.jit
def _within_half(counter_ptr):
    """Whether no program flagged a masked state beyond float16's range (:func:`_flag_beyond_half`)."""
    return tl.atomic_add(counter_ptr + 1, 0) == 0


@triton.jit
def _lstm_steps(s_lo, s_hi, s_begin, s_end, gx_ptr, w_ptr, w0, w1, w2, w3, mask_ptr, mask_row,
                mask_gate, table_ptr, m_ptr, m16_ptr, m_row, m_gate, acts_ptr, cells_ptr, out_ptr,
                counter_ptr, ks, cols, H, h0, c0, h_reg, c_reg, b, off, carried, nb, noff, nmoff, x_i, x_f,
                x_g, x_o, m0, MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, SAVE: tl.constexpr,
                HALF_STATE: tl.constexpr, READ_HALF: tl.constexpr, SYNC: tl.constexpr, RESIDENT: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr,
                BK: tl.constexpr):
    """Steps ``s_lo .. s_hi - 1`` of a launch of steps ``s_begin .. s_end - 1``, the products reading
    the masked states at ``m_ptr``, or where ``READ_HALF`` their float16 copy at ``m16_ptr``; what a
    step carries to the next in, and out."""
    read_ptr = m16_ptr if READ_HALF else m_ptr
    for s in tl.range(s_lo, s_hi, num_stages=1):  # never pipelined (module docstring)
        live = (ks < b)[:, None] & (cols < H)[None, :]
        z_i, z_f, z_g, z_o = _gate_products(read_ptr, m_row, m_gate, w_ptr, w0, w1, w2, w3, off, b, ks, cols,
                                            H, 4, MASK_GATES, RESIDENT, PRECISION, UPCAST, READ_HALF, BB, BH,
                                            BK)
        i = sigmoid(z_i + x_i)
        f = sigmoid(z_f + x_f)
        g = tanh(z_g + x_g)
        o = sigmoid(z_o + x_o)
        c = f * tl.where((ks < carried)[:, None], c_reg, c0) + i * g
        h = o * tanh(c)
        # the next state first: the one thing other programs read in this launch; then arrive, and
        # store what they do not read while the others arrive
        _store_next_state(h, h0, m0, mask_ptr, mask_row, mask_gate, m_ptr, m16_ptr, m_row, m_gate, ks, cols,
                          b, nb, noff, nmoff, H, MASK_GATES, HAS_MASK, HALF_STATE)
        _arrive(counter_ptr, SYNC)
        if SAVE:
            _store_gates(acts_ptr, off, ks, cols, H, live, i, f, g, o, 4)
            tl.store(cells_ptr + (off + ks)[:, None] * H + cols[None, :], c, mask=live)
        tl.store(out_ptr + (off + ks)[:, None] * H + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=live)
        c_reg = tl.where(live, c, c_reg)
        h_reg = tl.where(live, h, h_reg)
        b, off, carried, _, nb, noff, nmoff, x_i, x_f, x_g, x_o, m0 = _step_inputs(
            table_ptr, tl.minimum(s + 1, s_end - 1), gx_ptr, mask_ptr, mask_row, ks, cols, H, 4, HAS_MASK)
        _wait(counter_ptr, (s + 1 - s_begin) * tl.num_programs(0), SYNC)
    return h_reg, c_reg, b, off, carried, nb, noff, nmoff, x_i, x_f, x_g, x_o, m0


@triton.jit(do_not_specialize=_RUN_TIME_INTS)
def _lstm_forward(
    gx_ptr, w_ptr, h0_ptr, c0_ptr, mask_ptr, mask_row, mask_gate, table_ptr, m_ptr, m16_ptr,
    acts_ptr, cells_ptr, out_ptr, h_state_ptr, c_state_ptr, counter_ptr, s_begin, s_end, B, H_VEC, N,
    VEC: tl.constexpr, MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, SAVE: tl.constexpr,
    HALF_STATE: tl.constexpr, SYNC: tl.constexpr,
    RESIDENT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr,
    BK: tl.constexpr, UNITS: tl.constexpr,
):
    """Steps ``s_begin .. s_end - 1``; ``h_state``/``c_state`` carry the state between launches of
    one step each (their values are read only for rows that have run a step: any at the first).
    ``SAVE``: whether the gates and cells backward reads are written. ``HALF_STATE``: the loop also
    writes each masked state in float16 at ``m16_ptr``, and the products read that copy unless a
    program flagged a state beyond float16's range (:func:`_flag_beyond_half`; then every program
    reads the float32 states, exactly as without the setting)."""
    H, m_row, m_gate = _row_lengths(H_VEC, VEC, MASK_GATES)
    ks, cols, batch, state = _block(B, H, BB, BH, UNITS)
    h_reg = tl.load(h_state_ptr + state, mask=batch, other=0.0)
    c_reg = tl.load(c_state_ptr + state, mask=batch, other=0.0)
    h0 = tl.load(h0_ptr + state, mask=batch, other=0.0).to(tl.float32)
    c0 = tl.load(c0_ptr + state, mask=batch, other=0.0).to(tl.float32)
    w0, w1, w2, w3 = _resident_tiles(w_ptr, cols, H, 4, False, RESIDENT, BK)
    b, off, carried, _, nb, noff, nmoff, x_i, x_f, x_g, x_o, m0 = _step_inputs(
        table_ptr, s_begin, gx_ptr, mask_ptr, mask_row, ks, cols, H, 4, HAS_MASK)
    s_half = s_end  # where the products start reading the float16 copy: never, without one
    if HALF_STATE:
        _flag_beyond_half(counter_ptr, h0, mask_ptr, mask_row, mask_gate, ks, cols, batch, MASK_GATES,
                          HAS_MASK)
        s_half = _half_first_step(s_begin, s_end)
    h_reg, c_reg, b, off, carried, nb, noff, nmoff, x_i, x_f, x_g, x_o, m0 = _lstm_steps(
        s_begin, s_half, s_begin, s_end, gx_ptr, w_ptr, w0, w1, w2, w3, mask_ptr, mask_row, mask_gate,
        table_ptr, m_ptr, m16_ptr, m_row, m_gate, acts_ptr, cells_ptr, out_ptr, counter_ptr, ks, cols, H, h0,
        c0, h_reg, c_reg, b, off, carried, nb, noff, nmoff, x_i, x_f, x_g, x_o, m0, MASK_GATES, HAS_MASK,
        SAVE, HALF_STATE, False, SYNC, RESIDENT, PRECISION, UPCAST, BB, BH, BK)
    if HALF_STATE:  # the rest of the launch in one of two compiled loops: READ_HALF is compile-time
        if _within_half(counter_ptr):
            h_reg, c_reg, b, off, carried, nb, noff, nmoff, x_i, x_f, x_g, x_o, m0 = _lstm_steps(
                s_half, s_end, s_begin, s_end, gx_ptr, w_ptr, w0, w1, w2, w3, mask_ptr, mask_row,
                mask_gate, table_ptr, m_ptr, m16_ptr, m_row, m_gate, acts_ptr, cells_ptr, out_ptr,
                counter_ptr, ks, cols, H, h0, c0, h_reg, c_reg, b, off, carried, nb, noff, nmoff, x_i, x_f,
                x_g, x_o, m0, MASK_GATES, HAS_MASK, SAVE, HALF_STATE, True, SYNC, RESIDENT, PRECISION,
                UPCAST, BB, BH, BK)
        else:
            h_reg, c_reg, b, off, carried, nb, noff, nmoff, x_i, x_f, x_g, x_o, m0 = _lstm_steps(
                s_half, s_end, s_begin, s_end, gx_ptr, w_ptr, w0, w1, w2, w3, mask_ptr, mask_row,
                mask_gate, table_ptr, m_ptr, m16_ptr, m_row, m_gate, acts_ptr, cells_ptr, out_ptr,
                counter_ptr, ks, cols, H, h0, c0, h_reg, c_reg, b, off, carried, nb, noff, nmoff, x_i, x_f,
                x_g, x_o, m0, MASK_GATES, HAS_MASK, SAVE, HALF_STATE, False, SYNC, RESIDENT, PRECISION,
                UPCAST, BB, BH, BK)
    tl.store(h_state_ptr + state, h_reg, mask=batch)
    tl.store(c_state_ptr + state, c_reg, mask=batch)
    _poison_if_gave_up(counter_ptr, out_ptr, N, H, ks, cols, H, 1, SYNC, BB, BH)
    _poison_if_gave_up(counter_ptr, h_state_ptr, B, H, ks, cols, H, 1, SYNC, BB, BH)
    _poison_if_gave_up(counter_ptr, c_state_ptr, B, H, ks, cols, H, 1, SYNC, BB, BH)


@triton.jit
def _gru_steps(s_lo, s_hi, s_begin, s_end, gx_ptr, w_ptr, w0, w1, w2, w3, mask_ptr, mask_row,
               mask_gate, table_ptr, m_ptr, m16_ptr, m_row, m_gate, acts_ptr, a_n_ptr, out_ptr, counter_ptr,
               ks, cols, H, h0, b_r, b_z, b_n, h_reg, b, off, carried, nb, noff, nmoff, x_r, x_z, x_n, m0,
               MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, SAVE: tl.constexpr,
               HALF_STATE: tl.constexpr, READ_HALF: tl.constexpr, SYNC: tl.constexpr, RESIDENT: tl.constexpr,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr,
               BK: tl.constexpr):
    """:func:`_lstm_steps` for the GRU."""
    read_ptr = m16_ptr if READ_HALF else m_ptr
    for s in tl.range(s_lo, s_hi, num_stages=1):  # never pipelined (module docstring)
        live = (ks < b)[:, None] & (cols < H)[None, :]
        a_r, a_z, a_n, _ = _gate_products(read_ptr, m_row, m_gate, w_ptr, w0, w1, w2, w3, off, b, ks, cols, H,
                                          3, MASK_GATES, RESIDENT, PRECISION, UPCAST, READ_HALF, BB, BH, BK)
        a_n += b_n
        r = sigmoid(a_r + b_r + x_r)
        z = sigmoid(a_z + b_z + x_z)
        n = tanh(x_n + r * a_n)
        h = n + z * (tl.where((ks < carried)[:, None], h_reg, h0) - n)
        _store_next_state(h, h0, m0, mask_ptr, mask_row, mask_gate, m_ptr, m16_ptr, m_row, m_gate, ks, cols,
                          b, nb, noff, nmoff, H, MASK_GATES, HAS_MASK, HALF_STATE)
        _arrive(counter_ptr, SYNC)  # as in _lstm_steps: what no other program reads after it
        if SAVE:
            _store_gates(acts_ptr, off, ks, cols, H, live, r, z, n, n, 3)
            tl.store(a_n_ptr + (off + ks)[:, None] * H + cols[None, :], a_n, mask=live)
        tl.store(out_ptr + (off + ks)[:, None] * H + cols[None, :], h.to(out_ptr.dtype.element_ty), mask=live)
        h_reg = tl.where(live, h, h_reg)
        b, off, carried, _, nb, noff, nmoff, x_r, x_z, x_n, _, m0 = _step_inputs(
            table_ptr, tl.minimum(s + 1, s_end - 1), gx_ptr, mask_ptr, mask_row, ks, cols, H, 3, HAS_MASK)
        _wait(counter_ptr, (s + 1 - s_begin) * tl.num_programs(0), SYNC)
    return h_reg, b, off, carried, nb, noff, nmoff, x_r, x_z, x_n, m0


@triton.jit(do_not_specialize=_RUN_TIME_INTS)
def _gru_forward(
    gx_ptr, w_ptr, b_hh_ptr, h0_ptr, mask_ptr, mask_row, mask_gate, table_ptr, m_ptr, m16_ptr,
    acts_ptr, a_n_ptr, out_ptr, h_state_ptr, counter_ptr, s_begin, s_end, B, H_VEC, N,
    VEC: tl.constexpr, MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
    SAVE: tl.constexpr, HALF_STATE: tl.constexpr,
    SYNC: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, UNITS: tl.constexpr,
):
    """Steps ``s_begin .. s_end - 1`` (``h_state``, ``SAVE`` and ``HALF_STATE`` as in
    :func:`_lstm_forward`)."""
    H, m_row, m_gate = _row_lengths(H_VEC, VEC, MASK_GATES)
    ks, cols, batch, state = _block(B, H, BB, BH, UNITS)
    h_reg = tl.load(h_state_ptr + state, mask=batch, other=0.0)
    h0 = tl.load(h0_ptr + state, mask=batch, other=0.0).to(tl.float32)
    b_r = tl.zeros((1, BH), dtype=tl.float32)
    b_z = tl.zeros((1, BH), dtype=tl.float32)
    b_n = tl.zeros((1, BH), dtype=tl.float32)
    if HAS_BIAS:
        b_r = tl.load(b_hh_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        b_z = tl.load(b_hh_ptr + H + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
        b_n = tl.load(b_hh_ptr + 2 * H + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    w0, w1, w2, w3 = _resident_tiles(w_ptr, cols, H, 3, False, RESIDENT, BK)
    b, off, carried, _, nb, noff, nmoff, x_r, x_z, x_n, _, m0 = _step_inputs(
        table_ptr, s_begin, gx_ptr, mask_ptr, mask_row, ks, cols, H, 3, HAS_MASK)
    s_half = s_end  # as in _lstm_forward
    if HALF_STATE:
        _flag_beyond_half(counter_ptr, h0, mask_ptr, mask_row, mask_gate, ks, cols, batch, MASK_GATES,
                          HAS_MASK)
        s_half = _half_first_step(s_begin, s_end)
    h_reg, b, off, carried, nb, noff, nmoff, x_r, x_z, x_n, m0 = _gru_steps(
        s_begin, s_half, s_begin, s_end, gx_ptr, w_ptr, w0, w1, w2, w3, mask_ptr, mask_row, mask_gate,
        table_ptr, m_ptr, m16_ptr, m_row, m_gate, acts_ptr, a_n_ptr, out_ptr, counter_ptr, ks, cols, H, h0,
        b_r, b_z, b_n, h_reg, b, off, carried, nb, noff, nmoff, x_r, x_z, x_n, m0, MASK_GATES, HAS_MASK, SAVE,
        HALF_STATE, False, SYNC, RESIDENT, PRECISION, UPCAST, BB, BH, BK)
    if HALF_STATE:  # as in _lstm_forward
        if _within_half(counter_ptr):
            h_reg, b, off, carried, nb, noff, nmoff, x_r, x_z, x_n, m0 = _gru_steps(
                s_half, s_end, s_begin, s_end, gx_ptr, w_ptr, w0, w1, w2, w3, mask_ptr, mask_row,
                mask_gate, table_ptr, m_ptr, m16_ptr, m_row, m_gate, acts_ptr, a_n_ptr, out_ptr, counter_ptr,
                ks, cols, H, h0, b_r, b_z, b_n, h_reg, b, off, carried, nb, noff, nmoff, x_r, x_z, x_n, m0,
                MASK_GATES, HAS_MASK, SAVE, HALF_STATE, True, SYNC, RESIDENT, PRECISION, UPCAST, BB, BH, BK)
        else:
            h_reg, b, off, carried, nb, noff, nmoff, x_r, x_z, x_n, m0 = _gru_steps(
                s_half, s_end, s_begin, s_end, gx_ptr, w_ptr, w0, w1, w2, w3, mask_ptr, mask_row,
                mask_gate, table_ptr, m_ptr, m16_ptr, m_row, m_gate, acts_ptr, a_n_ptr, out_ptr, counter_ptr,
                ks, cols, H, h0, b_r, b_z, b_n, h_reg, b, off, carried, nb, noff, nmoff, x_r, x_z, x_n, m0,
                MASK_GATES, HAS_MASK, SAVE, HALF_STATE, False, SYNC, RESIDENT, PRECISION, UPCAST, BB, BH, BK)
    tl.store(h_state_ptr + state, h_reg, mask=batch)
    _poison_if_gave_up(counter_ptr, out_ptr, N, H, ks, cols, H, 1, SYNC, BB, BH)
    _poison_if_gave_up(counter_ptr, h_state_ptr, B, H, ks, cols, H, 1, SYNC, BB, BH)


@triton.jit
def _masked_state_grad(dm, gate, m, d_masked_ptr, dm_row, dm_gate, ks, cols, nxt, noff,
                       HAS_MASK: tl.constexpr, NEED_DMASK: tl.constexpr):
    """``dm^g * M^g`` (``m``: the mask tile) on the rows ``nxt`` (zeros elsewhere); stores ``dm^g``
    where asked."""
    if NEED_DMASK:
        tl.store(d_masked_ptr + (noff + ks)[:, None] * dm_row + gate * dm_gate + cols[None, :],
                 dm.to(d_masked_ptr.dtype.element_ty), mask=nxt)
    part = dm
    if HAS_MASK:
        part = dm * m
    return tl.where(nxt, part, 0.0)


@triton.jit
def _dm_of_gate(dz_ptr, w_ptr, w, g, ks, cols, nb, noff, H, CELL_GATES: tl.constexpr, RESIDENT: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr,
                BK: tl.constexpr):
    """``dm^g = Σ_h dz_{s+1}[k, g·H + h] W_hh[g·H + h, j]`` ``[BB, BH]`` for rows ``k < nb``: over blocks
    of ``h``, or where ``RESIDENT`` in one block (no loop) with ``w``, gate ``g``'s resident tile."""
    dm = tl.zeros((BB, BH), dtype=tl.float32)
    if RESIDENT:
        dm = _dm_block(dz_ptr, w_ptr, w, g, 0, dm, ks, cols, nb, noff, H, CELL_GATES, RESIDENT, PRECISION,
                       UPCAST, BK)
    else:
        for k0 in range(0, H, BK):
            dm = _dm_block(dz_ptr, w_ptr, w, g, k0, dm, ks, cols, nb, noff, H, CELL_GATES, RESIDENT,
                           PRECISION, UPCAST, BK)
    return dm


@triton.jit
def _dm_block(dz_ptr, w_ptr, w, g, k0, dm, ks, cols, nb, noff, H, CELL_GATES: tl.constexpr,
              RESIDENT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, BK: tl.constexpr):
    """``dm + Σ_h dz[k, g·H + h] W[g·H + h, j]`` over the block ``h = k0 .. k0 + BK``."""
    h = k0 + tl.arange(0, BK)
    dz = tl.load(dz_ptr + (noff + ks)[:, None] * (CELL_GATES * H) + g * H + h[None, :],
                 mask=(ks < nb)[:, None] & (h < H)[None, :], other=0.0, cache_modifier=".cg")
    if RESIDENT:
        tile = w
    else:
        tile = tl.load(w_ptr + (g * H + h)[:, None] * H + cols[None, :],
                       mask=(h < H)[:, None] & (cols < H)[None, :], other=0.0, cache_modifier=".ca")
    if UPCAST:
        return dm + tl.dot(dz.to(tl.float32), tile.to(tl.float32), input_precision=PRECISION)
    return dm + tl.dot(dz, tile, input_precision=PRECISION)


@triton.jit
def _state_grad(dz_ptr, w_ptr, w0, w1, w2, w3, m0, mask_ptr, mask_row, mask_gate, d_masked_ptr, dm_row,
                dm_gate, carry, ks, cols, nb, noff, nmoff, H,
                CELL_GATES: tl.constexpr, MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr,
                NEED_DMASK: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr,
                BK: tl.constexpr):
    """``carry + Σ_g dm_{s+1}^g M_{s+1}^g`` ``[BB, BH]`` for rows ``k < nb`` (``carry`` elsewhere),
    with ``dm_{s+1}^g = Σ_h dz_{s+1}[k, g·H + h] W_hh[g·H + h, j]`` (``m0``: the first gate's mask
    tile, :func:`_step_inputs`; ``w0 .. w3``: the resident tiles of ``W_hh`` where ``RESIDENT``); stores
    ``dm`` where asked."""
    nxt = (ks < nb)[:, None] & (cols < H)[None, :]
    total = carry
    if MASK_GATES == 1 and not RESIDENT:  # one sum over all G·H rows of W_hh
        dm = tl.zeros((BB, BH), dtype=tl.float32)
        for k0 in range(0, CELL_GATES * H, BK):
            h = k0 + tl.arange(0, BK)
            dz = tl.load(dz_ptr + (noff + ks)[:, None] * (CELL_GATES * H) + h[None, :],
                         mask=(ks < nb)[:, None] & (h < CELL_GATES * H)[None, :], other=0.0,
                         cache_modifier=".cg")
            w = tl.load(w_ptr + h[:, None] * H + cols[None, :],
                        mask=(h < CELL_GATES * H)[:, None] & (cols < H)[None, :], other=0.0,
                        cache_modifier=".ca")
            if UPCAST:
                dz, w = dz.to(tl.float32), w.to(tl.float32)
            dm += tl.dot(dz, w, input_precision=PRECISION)
        total += _masked_state_grad(dm, 0, m0, d_masked_ptr, dm_row, dm_gate, ks, cols, nxt, noff,
                                    HAS_MASK, NEED_DMASK)
    elif MASK_GATES == 1:  # the same sum, gate by gate over the resident tiles
        dm = tl.zeros((BB, BH), dtype=tl.float32)
        for g in tl.static_range(CELL_GATES):
            dm += _dm_of_gate(dz_ptr, w_ptr, _tile_of_gate(w0, w1, w2, w3, g), g, ks, cols, nb, noff, H,
                              CELL_GATES, RESIDENT, PRECISION, UPCAST, BB, BH, BK)
        total += _masked_state_grad(dm, 0, m0, d_masked_ptr, dm_row, dm_gate, ks, cols, nxt, noff,
                                    HAS_MASK, NEED_DMASK)
    else:
        for g in tl.static_range(CELL_GATES):  # one mask per gate: one sum per gate
            dm = _dm_of_gate(dz_ptr, w_ptr, _tile_of_gate(w0, w1, w2, w3, g), g, ks, cols, nb, noff, H,
                             CELL_GATES, RESIDENT, PRECISION, UPCAST, BB, BH, BK)
            m = m0
            if g > 0 and HAS_MASK:
                m = tl.load(mask_ptr + nmoff + ks[:, None] * mask_row + g * mask_gate + cols[None, :],
                            mask=nxt, other=0.0).to(tl.float32)
            total += _masked_state_grad(dm, g, m, d_masked_ptr, dm_row, dm_gate, ks, cols, nxt, noff,
                                        HAS_MASK, NEED_DMASK)
    return total


@triton.jit
def _step_state_grad(dz_ptr, w_ptr, w0, w1, w2, w3, m0, mask_ptr, mask_row, mask_gate, d_masked_ptr, dm_row,
                     dm_gate, carry, d_out, dh0_ptr, ks, cols, batch, state, b, nb, noff, nmoff, H,
                     CELL_GATES: tl.constexpr, MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr,
                     NEED_DMASK: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    """``dh_s`` of this step's rows (:func:`_state_grad` plus the tile ``d_out``; ``w0 .. w3``: those of
    :func:`_resident_tiles`); stores ``dh_0`` of the rows that start at the step after
    (``b <= k < nb``)."""
    dh = _state_grad(dz_ptr, w_ptr, w0, w1, w2, w3, m0, mask_ptr, mask_row, mask_gate, d_masked_ptr, dm_row,
                     dm_gate, carry, ks, cols, nb, noff, nmoff, H, CELL_GATES, MASK_GATES, HAS_MASK,
                     NEED_DMASK, RESIDENT, PRECISION, UPCAST, BB, BH, BK)
    tl.store(dh0_ptr + state, dh, mask=batch & ((ks >= b) & (ks < nb))[:, None])
    return dh + d_out


@triton.jit
def _row_tile(ptr, off, ks, cols, rows, H):
    """This program's columns of rows ``off + k`` (where ``rows``) of ``ptr`` ``[N, H]``, as float32."""
    return tl.load(ptr + (off + ks)[:, None] * H + cols[None, :], mask=rows, other=0.0).to(tl.float32)


@triton.jit
def _backward_inputs(table_ptr, s, acts_ptr, here_ptr, prev_ptr, d_out_ptr, mask_ptr, mask_row, ks, cols, H,
                     GATES: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOUT: tl.constexpr):
    """:func:`_step_inputs` of the saved activations, then this step's rows of ``here_ptr``, the
    previous step's of ``prev_ptr`` (rows carried on) and ``d_out`` (zeros without it), all
    ``[N, H]``."""
    b, off, carried, prev_off, nb, noff, nmoff, a0, a1, a2, a3, m0 = _step_inputs(
        table_ptr, s, acts_ptr, mask_ptr, mask_row, ks, cols, H, GATES, HAS_MASK)
    live = (ks < b)[:, None] & (cols < H)[None, :]
    here = _row_tile(here_ptr, off, ks, cols, live, H)
    prev = _row_tile(prev_ptr, prev_off, ks, cols, live & (ks < carried)[:, None], H)
    d_out = tl.zeros_like(here)
    if HAS_DOUT:
        d_out = _row_tile(d_out_ptr, off, ks, cols, live, H)
    return b, off, carried, nb, noff, nmoff, a0, a1, a2, a3, m0, here, prev, d_out


@triton.jit(do_not_specialize=_RUN_TIME_INTS)
def _lstm_backward(
    d_out_ptr, w_ptr, c0_ptr, mask_ptr, mask_row, mask_gate, table_ptr, acts_ptr, cells_ptr,
    dz_ptr, d_masked_ptr, carry_ptr, dc_ptr, dh0_ptr, dc0_ptr, counter_ptr, s_begin, s_end,
    B, H_VEC, N,
    VEC: tl.constexpr, MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOUT: tl.constexpr,
    NEED_DMASK: tl.constexpr, HAS_CARRY: tl.constexpr,
    SYNC: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, UNITS: tl.constexpr,
):
    """Steps ``s_end - 1`` down to ``s_begin``; the running ``dh`` and ``dc`` start from ``carry`` and
    ``dc`` and are left there where ``HAS_CARRY``, else start from zeros and are not kept."""
    H, dm_row, dm_gate = _row_lengths(H_VEC, VEC, MASK_GATES)
    ks, cols, batch, state = _block(B, H, BB, BH, UNITS)
    if HAS_CARRY:
        carry = tl.load(carry_ptr + state, mask=batch, other=0.0)
        dc_reg = tl.load(dc_ptr + state, mask=batch, other=0.0)
    else:
        carry = tl.zeros((BB, BH), dtype=tl.float32)
        dc_reg = tl.zeros((BB, BH), dtype=tl.float32)
    c0 = tl.load(c0_ptr + state, mask=batch, other=0.0).to(tl.float32)
    w0, w1, w2, w3 = _resident_tiles(w_ptr, cols, H, 4, True, RESIDENT, BK)
    b, off, carried, nb, noff, nmoff, i, f, g, o, m0, c, c_prev, d_out = _backward_inputs(
        table_ptr, s_end - 1, acts_ptr, cells_ptr, cells_ptr, d_out_ptr, mask_ptr, mask_row, ks, cols, H, 4,
        HAS_MASK, HAS_DOUT)
    for rs in tl.range(s_begin, s_end, num_stages=1):  # never pipelined (module docstring)
        s = s_end - 1 - (rs - s_begin)
        live = (ks < b)[:, None] & (cols < H)[None, :]
        dh = _step_state_grad(dz_ptr, w_ptr, w0, w1, w2, w3, m0, mask_ptr, mask_row, mask_gate, d_masked_ptr,
                              dm_row, dm_gate, carry, d_out, dh0_ptr, ks, cols, batch, state, b, nb, noff,
                              nmoff, H, 4, MASK_GATES, HAS_MASK, NEED_DMASK, RESIDENT, PRECISION, UPCAST, BB,
                              BH, BK)
        tc = tanh(c)
        joined = (ks >= carried)[:, None]
        c_prev = tl.where(joined, c0, c_prev)
        dc = dc_reg + dh * o * (1 - tc * tc)
        _store_gates(dz_ptr, off, ks, cols, H, live, dc * g * i * (1 - i), dc * c_prev * f * (1 - f),
                     dc * i * (1 - g * g), dh * tc * o * (1 - o), 4)
        tl.store(dc0_ptr + state, dc * f, mask=live & joined)
        dc_reg = tl.where(live, dc * f, dc_reg)
        carry = tl.where(live, 0.0, dh)
        b, off, carried, nb, noff, nmoff, i, f, g, o, m0, c, c_prev, d_out = _backward_inputs(
            table_ptr, tl.maximum(s - 1, s_begin), acts_ptr, cells_ptr, cells_ptr, d_out_ptr, mask_ptr,
            mask_row, ks, cols, H, 4, HAS_MASK, HAS_DOUT)
        _grid_barrier(counter_ptr, (rs + 1 - s_begin) * tl.num_programs(0), SYNC)
    if HAS_CARRY:
        tl.store(carry_ptr + state, carry, mask=batch)
        tl.store(dc_ptr + state, dc_reg, mask=batch)
    _poison_if_gave_up(counter_ptr, dz_ptr, N, 4 * H, ks, cols, H, 4, SYNC, BB, BH)
    _poison_if_gave_up(counter_ptr, dh0_ptr, B, H, ks, cols, H, 1, SYNC, BB, BH)
    _poison_if_gave_up(counter_ptr, dc0_ptr, B, H, ks, cols, H, 1, SYNC, BB, BH)


@triton.jit(do_not_specialize=_RUN_TIME_INTS)
def _gru_backward(
    d_out_ptr, w_ptr, h0_ptr, mask_ptr, mask_row, mask_gate, table_ptr, acts_ptr, a_n_ptr, out_ptr,
    da_ptr, dn_ptr, d_masked_ptr, carry_ptr, dh0_ptr, counter_ptr, s_begin, s_end, B, H_VEC, N,
    VEC: tl.constexpr, MASK_GATES: tl.constexpr, HAS_MASK: tl.constexpr, HAS_DOUT: tl.constexpr,
    NEED_DMASK: tl.constexpr, HAS_CARRY: tl.constexpr,
    SYNC: tl.constexpr, RESIDENT: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BB: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, UNITS: tl.constexpr,
):
    """Steps ``s_end - 1`` down to ``s_begin``; the running ``dh`` starts from ``carry`` and is left
    there where ``HAS_CARRY``, else starts from zeros and is not kept."""
    H, dm_row, dm_gate = _row_lengths(H_VEC, VEC, MASK_GATES)
    ks, cols, batch, state = _block(B, H, BB, BH, UNITS)
    if HAS_CARRY:
        carry = tl.load(carry_ptr + state, mask=batch, other=0.0)
    else:
        carry = tl.zeros((BB, BH), dtype=tl.float32)
    h0 = tl.load(h0_ptr + state, mask=batch, other=0.0).to(tl.float32)
    w0, w1, w2, w3 = _resident_tiles(w_ptr, cols, H, 3, True, RESIDENT, BK)
    b, off, carried, nb, noff, nmoff, r, z, n, _, m0, a_n, h_prev, d_out = _backward_inputs(
        table_ptr, s_end - 1, acts_ptr, a_n_ptr, out_ptr, d_out_ptr, mask_ptr, mask_row, ks, cols, H, 3,
        HAS_MASK, HAS_DOUT)
    for rs in tl.range(s_begin, s_end, num_stages=1):  # never pipelined (module docstring)
        s = s_end - 1 - (rs - s_begin)
        live = (ks < b)[:, None] & (cols < H)[None, :]
        dh = _step_state_grad(da_ptr, w_ptr, w0, w1, w2, w3, m0, mask_ptr, mask_row, mask_gate, d_masked_ptr,
                              dm_row, dm_gate, carry, d_out, dh0_ptr, ks, cols, batch, state, b, nb, noff,
                              nmoff, H, 3, MASK_GATES, HAS_MASK, NEED_DMASK, RESIDENT, PRECISION, UPCAST, BB,
                              BH, BK)
        h_prev = tl.where((ks >= carried)[:, None], h0, h_prev)
        dn_pre = dh * (1 - z) * (1 - n * n)
        _store_gates(da_ptr, off, ks, cols, H, live, dn_pre * a_n * r * (1 - r),
                     dh * (h_prev - n) * z * (1 - z), dn_pre * r, dn_pre, 3)
        tl.store(dn_ptr + (off + ks)[:, None] * H + cols[None, :], dn_pre.to(dn_ptr.dtype.element_ty),
                 mask=live)
        carry = tl.where(live, dh * z, dh)
        b, off, carried, nb, noff, nmoff, r, z, n, _, m0, a_n, h_prev, d_out = _backward_inputs(
            table_ptr, tl.maximum(s - 1, s_begin), acts_ptr, a_n_ptr, out_ptr, d_out_ptr, mask_ptr, mask_row,
            ks, cols, H, 3, HAS_MASK, HAS_DOUT)
        _grid_barrier(counter_ptr, (rs + 1 - s_begin) * tl.num_programs(0), SYNC)
    if HAS_CARRY:
        tl.store(carry_ptr + state, carry, mask=batch)
    _poison_if_gave_up(counter_ptr, da_ptr, N, 3 * H, ks, cols, H, 3, SYNC, BB, BH)
    _poison_if_gave_up(counter_ptr, dh0_ptr, B, H, ks, cols, H, 1, SYNC, BB, BH)


class Launch(NamedTuple):
    """How a call runs: ``programs`` blocks of ``units`` hidden units, for each of ``row_blocks``
    blocks of the batch's rows (one program per pair: :attr:`grid` programs); ``per_step``: one
    launch per step without a barrier (CPU tests of the slicing) instead of one persistent launch;
    ``resident``: each program loads its tiles of ``W_hh`` once, before the first step, and keeps
    them on chip instead of streaming them from L2 at every step."""

    programs: int
    units: int
    per_step: bool = False
    row_blocks: int = 1
    resident: bool = False

    @property
    def grid(self) -> int:
        return self.programs * self.row_blocks


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


_forced: Launch | None = None


@contextlib.contextmanager
def launched_as(how: Launch) -> Iterator[None]:
    """Run every call that the persistent loop can take as ``how`` (tests: several programs, one
    launch per step, on CPU under Triton's interpreter)."""
    global _forced
    _forced, before = how, _forced
    try:
        yield
    finally:
        _forced = before


@contextlib.contextmanager
def tuned(**setting: int) -> Iterator[None]:
    """The launch settings ``setting`` (:data:`tuning`) in the block, and those before it after it
    (benchmarks time a setting beside the built-in rule)."""
    before = dict(tuning)
    tuning.update(setting)
    try:
        yield
    finally:
        tuning.clear()
        tuning.update(before)


_off = False


@contextlib.contextmanager
def turned_off() -> Iterator[None]:
    """Every call in the block runs the step kernel (benchmarks compare the two)."""
    global _off
    _off, before = True, _off
    try:
        yield
    finally:
        _off = before


def disabled() -> bool:
    """Whether every call runs the step kernel: in :func:`turned_off`, or with ``RNNDROP_PERSISTENT=0``
    in the environment (to rule the persistent loop out when something looks wrong on a GPU)."""
    if _off:
        return True
    raw = os.environ.get("RNNDROP_PERSISTENT")
    if raw is None:  # the usual case, read at every call
        return False
    value = raw.strip().lower()
    if value in ("0", "", "false", "no", "off"):
        return True
    if value in ("1", "true", "yes", "on"):
        return False
    raise ValueError(f"RNNDROP_PERSISTENT must be 0 (off) or 1 (on), got {raw!r}")


def first_or_step(how: Launch | None, like: Tensor, persistent_pass: Callable[[Launch], T | None],
                  step_pass: Callable[[], T]) -> tuple[T, Launch | None]:
    """One pass (forward or backward) of a cell on ``like``'s device: ``persistent_pass(how)``
    where there is a plan and the device has not given the persistent loop up, else (or where it
    gave up in this call) ``step_pass()``; with the plan that ran (None: the step kernel). Either
    runs with autocast off (the kernels cast for themselves) and cuBLAS's float32 products in
    cuDNN's mode (:func:`~rnndrop.kernels.precision.products_as_cudnn`)."""
    with autocast_off(like), products_as_cudnn(like):
        if how is not None and usable(like.device):
            result = persistent_pass(how)
            if result is not None:
                return result, how
        return step_pass(), None


def plan(
    gates_x: Tensor, hidden: int, batch: int, projected: bool, mask: Tensor | None = None,
    cell: str | None = None,
) -> Launch | None:
    """How the persistent loop runs a call, or None where it cannot and the step kernel runs:
    float64 (``tl.dot`` keeps float32 at most), a projection (``h_t = W_hr r_t`` is a second
    product per step), gates or a (contiguous) recurrent ``mask`` of :data:`MAX_ELEMENTS` or more
    (the loops' offsets are 32-bit; a packed batch's per-step masks ``[T, B, (G,) H]`` outgrow its
    gates ``[N, G * H]`` where a few sequences are much longer than the rest),
    more hidden units than :data:`MAX_UNITS` times the multiprocessors (one
    program each, or :data:`PER_SM`, all resident), or a batch whose blocks of at most
    :data:`MAX_BATCH` rows do not fit beside them (under Triton's interpreter: a batch over
    :data:`MAX_BATCH`).

    Blocks of 16 units, as few per program as the multiprocessors allow; then, while the grid
    has room for twice the programs, the batch's rows split in two (down to blocks of 16 rows,
    ``tl.dot``'s least): a step takes each program about ``a + b * rows * units`` (the H200's
    launch-setting sweep: twice the units, twice the time; four times the rows, about twice),
    so programs with fewer rows on otherwise idle multiprocessors finish the step sooner; and for
    a ``cell`` in :data:`SPREAD`, programs of fewer units fill the multiprocessors still idle
    (``cell`` None: the rule without a cell's measured settings)."""
    if disabled() or projected or gates_x.dtype == torch.float64 or gates_x.numel() >= MAX_ELEMENTS:
        return None
    if mask is not None and mask.numel() >= MAX_ELEMENTS:
        return None
    if gates_x.device.type != "cuda" or _forced is not None:
        if batch > MAX_BATCH:
            return None
        if _forced is not None:
            return _forced
        # Triton's interpreter: one program owns every unit
        return Launch(1, max(16, _next_power_of_2(hidden))) if interpreted() else None
    sms = _multiprocessors(str(gates_x.device)) * _per_sm()
    units = tuning.get("units", 16)
    while units <= MAX_UNITS and -(-hidden // units) > sms:
        units *= 2
    if units > MAX_UNITS:
        return None
    programs = -(-hidden // units)
    least = _next_power_of_2(-(-batch // MAX_BATCH))  # row blocks of at most MAX_BATCH rows
    row_blocks = tuning.get("row_blocks")
    if row_blocks is None:
        row_blocks, padded = least, _batch_block(batch)
        while programs * row_blocks * 2 <= sms and padded // (row_blocks * 2) >= 16:
            row_blocks *= 2
    row_blocks = max(row_blocks, least)
    while row_blocks > least and programs * row_blocks > sms:  # a measured setting, where it fits
        row_blocks //= 2
    if programs * row_blocks > sms:
        return None
    if tuning.get("spread", cell in SPREAD) and programs * row_blocks < sms:
        # fewer units a program, so that the unit blocks fill the multiprocessors the row blocks leave
        spread = -(-hidden // (sms // row_blocks) // 4) * 4  # in fours: the lanes stay in vectors
        if spread < units:
            units, programs = spread, -(-hidden // spread)
    return Launch(programs, units, row_blocks=row_blocks, resident=_resident(hidden, units))


def _half_state(gates_x: Tensor, mask: Tensor | None) -> bool:
    """Whether a forward launch on ``gates_x`` writes float16 copies of the masked states for its
    products to read (:data:`HALF_STATE`, ``tuning["half_state"]``): float32 calls whose products run
    in TF32 (a measurement's setting also under IEEE float32, where it then rounds the states as TF32
    would not), with one mask for every step or none (the loop checks that mask against float16's
    range before the first step: :func:`_flag_beyond_half`; a mask a step would need every step's)."""
    if mask is not None and mask.shape[0] > 1:
        return False
    asked = tuning.get("half_state")
    if asked is None:
        return HALF_STATE and gates_x.dtype == torch.float32 and _precision(gates_x) == "tf32"
    return bool(asked) and gates_x.dtype == torch.float32


def _products_read(gates_x: Tensor, masked: Tensor, mask: Tensor | None) -> Tensor:
    """The masked states a forward launch's products may read: a float16 copy of ``masked``'s shape,
    which the loop writes beside it, where :func:`_half_state`; else ``masked`` itself."""
    return masked.new_empty(masked.shape, dtype=torch.float16) if _half_state(gates_x, mask) else masked


def _per_sm() -> int:
    """Programs a multiprocessor holds in :func:`plan`'s grid: ``tuning["per_sm"]``, else :data:`PER_SM`."""
    return _setting("per_sm", PER_SM, lambda n: 1 <= n <= 4, "1, 2, 3 or 4 programs a multiprocessor")


def _setting(name: str, default: int, valid: Callable[[int], bool], expected: str) -> int:
    """The integer launch setting ``tuning[name]``, else ``default``; a measurement's value that is not
    ``valid`` raises, saying it should be ``expected``."""
    if name not in tuning:
        return default
    value = tuning[name]
    if not (isinstance(value, int) and valid(value)):
        raise ValueError(f'tuning["{name}"] must be {expected}, got {value!r}')
    return value


def _width(units: int) -> int:
    """``BH``: the width of a program's tile of units, ``units`` rounded up to a power of two of at
    least 16 (``tl.dot``'s least); the lanes past ``units`` compute nothing that is kept."""
    return max(16, _next_power_of_2(units))


def _resident(hidden: int, units: int) -> bool:
    """Whether a program of ``units`` hidden units keeps its tiles of ``W_hh`` across steps:
    ``tuning["resident"]``, else :data:`RESIDENT`, where a gate's tile (one K block over the whole
    hidden size, by the tile's width) holds at most ``MAX_RESIDENT x 16`` values: hidden sizes up to
    :data:`MAX_RESIDENT` with tiles 16 units wide (``tl.dot``'s least)."""
    tile = _width(units) * _next_power_of_2(max(16, hidden))
    return bool(tuning.get("resident", RESIDENT)) and tile <= MAX_RESIDENT * 16


def _precision(x: Tensor) -> str:
    """``tl.dot``'s float32 mode: TF32 where cuDNN would use it (:mod:`rnndrop.kernels.precision`),
    else IEEE; half types need none."""
    if x.device.type == "cuda" and x.dtype == torch.float32 and cudnn_rnn_tf32():
        return "tf32"
    return "ieee"


class _Table:
    """A cached step table: its ``values`` on the device, the event after which they are there
    (CUDA: recorded on the stream that filled them) and the streams it is recorded on."""

    __slots__ = ("ready", "streams", "values")

    def __init__(self, values: Tensor, ready: torch.cuda.Event | None,
                 stream: tuple[int, int] | None) -> None:
        self.values, self.ready = values, ready
        self.streams = {stream}


_TABLES: OrderedDict[tuple, _Table] = OrderedDict()


def _step_table(schedule: Schedule, mask: Tensor | None, device: torch.device) -> Tensor:
    """``[S + 1, 8]`` int32: per step in running order (row 0: a virtual step with no rows) ``b``,
    its rows' offset, ``carried``, the previous step's offset, then the next step's ``b``, offset
    and mask offset (zeros after the last). Cached by schedule and mask layout, one table for every
    stream: CUDA graph captures (``torch.cuda.make_graphed_callables``, ``torch.compile``) warm a
    call up on one stream and record it on another, and a table made while capturing must copy
    from pinned memory. A stream that had not used the table waits for its copy and is recorded on
    it, so that its memory is not reused (evicted from the cache) while that stream may read it."""
    step_stride = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    # a schedule is built once per batch sizes and never changes
    key = (schedule, step_stride, device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    table = _TABLES.get(key)
    if table is not None:
        with contextlib.suppress(KeyError):  # another thread may have evicted it since
            _TABLES.move_to_end(key)
        if capturing:  # kept for the graph's replays, which read it by address; no wait: a capture
            # cannot wait for an event recorded outside it, and its replays come after it ends
            _CAPTURED_TABLES[table.values.data_ptr()] = (table.values,)
        elif device.type == "cuda":
            _used_on_this_stream(table, device)
        return table.values
    rows = [[0, 0, 0, 0]]
    for step in schedule.steps:
        prev = schedule.offsets[step.prev] if step.prev >= 0 else 0
        rows.append([step.size, schedule.offsets[step.t], step.carried, prev])
    for k, step in enumerate(schedule.steps):
        rows[k].extend([step.size, schedule.offsets[step.t], step.t * step_stride, 0])
    rows[-1].extend([0, 0, 0, 0])
    values = _outside_graph_pools(
        device, lambda: torch.empty(len(rows), _COLUMNS, dtype=torch.int32, device=device))
    source = torch.tensor(rows, dtype=torch.int32)
    if capturing:  # the graph copies it at every replay: from pinned memory, kept with the table
        source = source.pin_memory()
        values.copy_(source, non_blocking=True)
        _CAPTURED_TABLES[values.data_ptr()] = (values, source)
        return values  # made in the graph's pool: not for calls outside it
    values.copy_(source, non_blocking=True)
    ready = None
    if device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
    _TABLES[key] = _Table(values, ready, _stream_of(device) if device.type == "cuda" else None)
    if len(_TABLES) > 256:
        _TABLES.popitem(last=False)
    return values


def _used_on_this_stream(table: _Table, device: torch.device) -> None:
    """Order the current stream of ``device`` after ``table``'s copy and record the table on it,
    the first time this stream uses it."""
    stream = _stream_of(device)
    if stream not in table.streams:
        current = torch.cuda.current_stream(device)
        if table.ready is not None:
            current.wait_event(table.ready)
        table.values.record_stream(current)
        table.streams.add(stream)


def _outside_graph_pools(device: torch.device, allocate: Callable[[], Tensor]) -> Tensor:
    """``allocate()`` (an empty tensor kept across calls: a cached step table, a pool of counters),
    run in a thread of its own where ``device`` is CUDA and no graph is being captured: its memory
    then comes from the caching allocator's ordinary pool, never from a CUDA-graph pool that this
    thread's allocations are routed to. torch.compile's CUDA graphs (``mode="reduce-overhead"``)
    warm a graph up and record it with every allocation of the thread in the graph's pool, and
    refuse a tensor there that outlives the call ("tensor(s) in the cudagraph pool not tracked as
    outputs"). The block is the other thread's stream's (the default one): the caller's stream
    waits for that stream before it fills the tensor, and the tensor is recorded on the caller's
    stream (its memory is not reused while this stream may read it). During a capture the tensor
    is allocated here: another thread's allocation would break a capture that checks every thread."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return allocate()
    made: list[Tensor] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with torch.cuda.device(device):
                made.append(allocate())
        except BaseException as error:  # raised again in the caller's thread
            failed.append(error)

    worker = threading.Thread(target=run, name="rnndrop-persistent-alloc")
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    current = torch.cuda.current_stream(device)
    current.wait_stream(torch.cuda.default_stream(device))
    made[0].record_stream(current)
    return made[0]


#: Step tables a CUDA graph captured, by address: its replays read them there, so they are never
#: freed (a table evicted from the cache and made again is another one); a table made while
#: capturing with the pinned memory each replay copies it from.
_CAPTURED_TABLES: dict[int, tuple[Tensor, ...]] = {}


def _sizes(batch: int, hidden: int, rows: int) -> dict[str, int]:
    """The loops' size arguments: ``B``, the hidden size as ``H_VEC`` times ``VEC`` (:func:`_vector`),
    and ``N``."""
    # a measurement may ask for narrower vectors (1: every row loaded value by value)
    widest = _setting("vector", MAX_VECTOR, lambda n: n >= 1 and n & (n - 1) == 0, "a power of two")
    vec = min(_vector(hidden), widest)
    return dict(B=batch, H_VEC=hidden // vec, N=rows, VEC=vec)


def _mask_strides(mask: Tensor | None) -> tuple[int, int]:
    """``(row stride, gate stride)`` of a contiguous ``[T', B', (G,) P]`` mask; 0 where shared."""
    if mask is None:
        return 0, 0
    return (mask.stride(1) if mask.shape[1] > 1 else 0), (mask.stride(2) if mask.dim() == 4 else 0)


def _cooperative_launches() -> bool:
    """Whether this Triton launches a grid cooperatively (CUDA then runs every program at once, or
    refuses the launch): ``launch_cooperative_grid`` among Triton's NVIDIA options."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


_COOPERATIVE = _cooperative_launches()
_COOPERATIVE_OPTIONS = dict(LAUNCH_OPTIONS, launch_cooperative_grid=True)
#: The deepest load pipeline of the loops over ``W_hh``; depths from it down are tried (:func:`_fittings`),
#: and the first ``(K block, depth)`` whose shared memory fits is kept per kernel and block shape
#: (None where none does).
_DEEPEST_STAGES = 3
_stages: dict[tuple, tuple[int, int] | None] = {}
#: Pools' counters copied for reading once their launches finished: ``(event, pinned copy, device)``.
_pending: list[tuple[torch.cuda.Event, Tensor, torch.device]] = []


def _read_finished_counters() -> None:
    """Read the counters of finished cooperative launches (no waiting): one that gave up marks its
    device (:func:`gave_up`); its outputs were NaN."""
    while True:
        with _pools_lock:  # take() appends from other threads (DataParallel's replicas)
            if not (_pending and _pending[0][0].query()):
                return
            _, values, device = _pending.pop(0)
        if int(values.max()) >= GAVE_UP:
            gave_up(device, "a grid barrier gave up waiting; that call's results were NaN")


class _CounterPool:
    """The barrier counters of cooperative launches on one device and stream: :attr:`SLOTS` zeros,
    one per launch in turn, so that a launch costs the host no allocation, fill or copy. When every
    slot has served, the pool is copied to pinned memory (read by :func:`_read_finished_counters`
    once the copy has run: a barrier that gave up left :data:`GAVE_UP` in its counter) and zeroed,
    both in stream order after the launches that used it."""

    SLOTS = 16

    def __init__(self, device: torch.device, values: Tensor | None = None) -> None:
        self.device = device
        # 16 bytes apart: every slot as aligned as a fresh counter (Triton compiles a variant per
        # pointer alignment); a slot's second word is the float16 range flag (_flag_beyond_half)
        if values is None:
            values = torch.empty(self.SLOTS, 4, dtype=torch.int32, device=device)
        self.values = values.zero_()
        self.slots = [row[:1] for row in self.values]
        self.used = 0
        #: Held from taking a slot until its launch is enqueued: another thread launching on the
        #: stream meanwhile (a first launch compiles for seconds) could use the pool up, zero it and
        #: reuse the slot, and the launch would start from a finished one's count (barriers that
        #: never wait). Re-entrant: a launch that falls back to another shape launches again.
        self.launching = threading.RLock()

    def take(self) -> Tensor:
        """The next zero counter (a view of the pool)."""
        if self.used == self.SLOTS:
            _pending.append(self._hand_in())
            self.values.zero_()
            self.used = 0
        self.used += 1
        return self.slots[self.used - 1]

    def _hand_in(self) -> tuple[torch.cuda.Event, Tensor, torch.device]:
        """The pool's values copied to pinned memory, with the event after which they are there."""
        copy = torch.empty(self.SLOTS, 4, dtype=torch.int32, pin_memory=True)
        copy.copy_(self.values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return event, copy, self.device


try:  # the current stream's handle without building a torch.cuda.Stream (as Triton's launcher reads it)
    from torch._C import _cuda_getCurrentRawStream as _current_raw_stream
except ImportError:  # a torch without CUDA (pooled counters are CUDA's alone)
    def _current_raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


_pools: dict[tuple[int, int], _CounterPool] = {}  # by device index and stream
_pools_lock = threading.Lock()  # threads launching on one stream take distinct slots


def _stream_of(device: torch.device) -> tuple[int, int]:
    """``(device index, raw handle of its current stream)`` of a CUDA ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, _current_raw_stream(index)


def _pool(device: torch.device) -> _CounterPool:
    """The counter pool of ``device``'s current stream (made on first use)."""
    key = _stream_of(device)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:  # kept for the process: never in a CUDA graph's memory pool
            values = _outside_graph_pools(
                device, lambda: torch.empty(_CounterPool.SLOTS, 4, dtype=torch.int32, device=device))
            pool = _pools[key] = _CounterPool(device, values)
        return pool


def _fresh_counter(device: torch.device) -> Tensor:
    """A zero counter for one launch that takes none from a pool (:func:`_taken`, holding the
    pool's :attr:`~_CounterPool.launching` until the launch is enqueued): CPU, a launch being
    captured into a CUDA graph, whose replays need it zeroed each time, or a counter the host reads
    at once. 16 bytes, as a pool's slot: the counter, then the float16 range flag
    (:func:`_flag_beyond_half`)."""
    return torch.zeros(4, dtype=torch.int32, device=device)[:1]


def _taken(pool: _CounterPool) -> Tensor:
    """The next zero counter of ``pool`` (threads launching on one stream take distinct slots)."""
    with _pools_lock:
        return pool.take()


#: Launch settings a measurement may set (``benchmarks/persistent_tuning.py``): ``units``,
#: ``row_blocks``, ``block_k``, ``warps``, ``resident``, ``stages`` (the deepest load pipeline
#: tried, instead of :data:`_DEEPEST_STAGES`), ``vector`` (the widest ``VEC``), ``spread`` (every
#: cell's or none, instead of :data:`SPREAD`), ``per_sm`` (:data:`PER_SM`), ``half_state``
#: (:data:`HALF_STATE`); empty in normal use.
tuning: dict[str, int] = {}


def _warps(batch_block: int, resident: bool) -> int:
    """Warps a program: 8 for blocks of 128 rows or resident tiles (compiled for sm_90, a resident
    launch spills no register with 8; ``benchmarks/kernel_resources.py``), else 4."""
    return tuning.get("warps", 8 if batch_block >= 128 or resident else 4)


def _run(kernel, how: Launch, steps: int, args: tuple, backward: bool, **constexprs) -> bool:
    """Launch ``kernel`` over steps ``0 .. steps - 1``; False where the step kernel must run the
    call instead: a failure of the device (a cooperative grid refused, a barrier that gave up) gives
    the loop up there (:func:`gave_up`), a shape that fits no shared memory only that shape's calls.

    One persistent launch on CUDA. Launched cooperatively where Triton can (all programs resident,
    or CUDA refuses the launch), its counter (from a pool) is read later without waiting, since a
    barrier cannot then starve; else the host reads it after the launch (a synchronisation) and a
    barrier that gave up sends the call to the step kernel."""
    failure = _launch(kernel, how, steps, args, backward, **constexprs)
    if failure is not None and failure is not DOES_NOT_FIT:  # the device's failure, not the shape's
        gave_up(args[0].device, failure)
    return failure is None


#: :func:`_launch`'s failure where a launch shape's loads fit no shared memory even unpipelined: the
#: calls of that shape run the step kernel (one warning a shape), other shapes still run persistent.
DOES_NOT_FIT = "its loads do not fit in shared memory even unpipelined"


def _launch(kernel, how: Launch, steps: int, args: tuple, backward: bool, **constexprs) -> str | None:
    """:func:`_run`'s launch: None, or why the step kernel must run the call instead."""
    device = args[0].device
    cuda = device.type == "cuda"
    warps = _warps(constexprs["BB"], constexprs["RESIDENT"])
    # Triton's interpreter multiplies bfloat16 tiles wrongly: it gets float32 ones (exact products)
    upcast = not cuda and interpreted()
    if how.per_step:
        counter = _fresh_counter(device)
        order = range(steps - 1, -1, -1) if backward else range(steps)
        for s in order:
            kernel[(how.grid,)](*args, counter, s, s + 1, **constexprs, SYNC=False, UPCAST=upcast,
                                    num_warps=warps, **LAUNCH_OPTIONS)
        return None
    if not cuda and how.grid > 1:  # the interpreter runs programs one after another
        raise ValueError(f"{how} on CPU: Triton's interpreter runs one program at a time, so a grid "
                         "barrier between programs never opens; use per_step=True or programs=1")
    cooperative = cuda and _COOPERATIVE and how.grid > 1
    options = _COOPERATIVE_OPTIONS if cooperative else LAUNCH_OPTIONS
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    if cuda and not capturing:
        _read_finished_counters()
    deepest = _setting("stages", _DEEPEST_STAGES, lambda n: n >= 1, "a positive number of stages")
    fixed = _block_k_fixed(constexprs)
    fittings = _fittings(constexprs["BK"], deepest, fixed)
    # every setting that changes what the loads take (not B and N, which vary from call to call)
    key = (kernel.__name__, tuple(sorted((k, v) for k, v in constexprs.items() if k not in ("B", "N"))),
           warps, args[0].dtype, deepest, fixed)
    pool = _pool(device) if cooperative and not capturing else None
    with pool.launching if pool is not None else contextlib.nullcontext():
        counter = _fresh_counter(device) if pool is None else _taken(pool)
        fitting = _stages.get(key, fittings[0])  # None: nothing fits (remembered, not tried again)
        for block_k, stages in fittings[fittings.index(fitting):] if fitting else ():
            try:
                blocks = constexprs if block_k == constexprs["BK"] else dict(constexprs, BK=block_k)
                kernel[(how.grid,)](*args, counter, 0, steps, **blocks, SYNC=how.grid > 1,
                                    UPCAST=upcast, num_warps=warps, num_stages=stages, **options)
                _stages[key] = (block_k, stages)
                break
            except OutOfResources:  # the pipelined loads need more shared memory than there is
                continue
            except RuntimeError as error:  # a cooperative grid CUDA cannot hold at once
                if not cooperative:
                    raise
                return f"the cooperative launch was refused ({str(error).strip().splitlines()[0]})"
        else:
            if constexprs["RESIDENT"]:  # resident tiles do not fit beside the loads: stream W_hh, as before
                _stages[key] = None
                block_k = _block_k(constexprs["H_VEC"] * constexprs["VEC"], constexprs["BB"], backward)
                streaming = dict(constexprs, RESIDENT=False, BK=block_k)
                return _launch(kernel, how._replace(resident=False), steps, args, backward, **streaming)
            if fitting is not None:  # the first call of this shape: said once
                warnings.warn(f"rnndrop: the persistent 'triton' loop {kernel.__name__} at {how} with "
                              f"blocks {constexprs['BB']} x {constexprs['BK']} fits no shared memory of "
                              f"{device}, even unpipelined; calls of this shape there run the per-step "
                              "Triton kernel", RuntimeWarning, stacklevel=5)
            _stages[key] = None
            return DOES_NOT_FIT
    if not cuda or capturing or cooperative:
        return None
    if int(counter.item()) >= GAVE_UP:
        return "a grid barrier gave up waiting (another kernel held multiprocessors)"
    return None


def _block_k_fixed(constexprs: dict) -> bool:
    """Whether a launch keeps its K block whatever its shared memory (:func:`_fittings`): resident
    tiles (one block over the whole hidden size) or a measurement's ``block_k``."""
    return bool(constexprs["RESIDENT"]) or "block_k" in tuning


@functools.lru_cache(maxsize=64)  # (a host cost of every launch)
def _fittings(block_k: int, deepest: int, fixed: bool) -> tuple[tuple[int, int], ...]:
    """The ``(K block, pipeline depth)`` a launch tries in turn until its shared memory fits: the
    planned K block ``block_k`` at every depth from ``deepest`` down to 2; then, unless the K block is
    ``fixed`` (:func:`_block_k_fixed`), K blocks half as wide (down to 16, ``tl.dot``'s least) at
    those depths; only then the planned K block unpipelined. A wide K block that fits one stage only
    loads each block while the last one's products wait for nothing to overlap them (per-gate masks
    at hidden 1500, batch 128: four masked states of 128 rows a block, 144 KiB a stage on sm_90 at
    K 64, 72 KiB at K 32, where three stages fit: ``benchmarks/kernel_resources.py``)."""
    depths = range(deepest, 1, -1)
    blocks = [block_k]
    while not fixed and blocks[-1] // 2 >= 16:
        blocks.append(blocks[-1] // 2)
    return (*((k, depth) for k in blocks for depth in depths), (block_k, 1))


_given_up: set[str] = set()


def _key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def usable(device: torch.device) -> bool:
    """False once the persistent loop failed on ``device`` in this process."""
    return not _given_up or _key(device) not in _given_up  # (no device key to build while none failed)


def gave_up(device: torch.device, why: str) -> None:
    """Record that the persistent loop failed on ``device`` (``why``): later calls there run the
    per-step Triton kernel (one warning)."""
    if _key(device) not in _given_up:
        _given_up.add(_key(device))
        warnings.warn(f"rnndrop: the persistent 'triton' loop failed on {device}: {why}; this call (where "
                      "it can still be) and later ones there run the per-step Triton kernel",
                      RuntimeWarning, stacklevel=4)


def _tiles(how: Launch, batch: int, hidden: int, backward: bool) -> dict[str, int]:
    """The loops' block sizes: rows ``BB``, the tile of hidden units ``BH`` (:func:`_width`) of which
    a program owns ``UNITS``, and the K block ``BK`` (resident tiles: one block over the whole hidden
    size), and ``RESIDENT``."""
    rows = _batch_block(batch, how.row_blocks)
    k = max(16, _next_power_of_2(hidden)) if how.resident else _block_k(hidden, rows, backward)
    return dict(BB=rows, BH=_width(how.units), BK=k, RESIDENT=how.resident, UNITS=how.units)


def _shape(how: Launch, batch: int, hidden: int, rows: int, backward: bool) -> dict[str, int]:
    """A launch's sizes and blocks, :func:`_sizes` and :func:`_tiles` (a dict its caller unpacks and
    never changes): worked out once per shape where no measurement's setting is in :data:`tuning`
    (normal use: a host cost of every launch), at every call where one is."""
    return (_shape_of if tuning else _built_in_shape)(how, batch, hidden, rows, backward)


def _shape_of(how: Launch, batch: int, hidden: int, rows: int, backward: bool) -> dict[str, int]:
    return {**_sizes(batch, hidden, rows), **_tiles(how, batch, hidden, backward)}


_built_in_shape = functools.lru_cache(maxsize=1024)(_shape_of)


def _block_k(hidden: int, rows: int, backward: bool) -> int:
    """The K block of the loops over ``W_hh``: 64 (less where the hidden size is smaller); the
    forward loop of a program of 32 to 64 rows takes 32, which the H200's launch-setting sweep found
    faster at every such shape, while backward was as fast or slower with it (docs/gpu.md, the
    launch settings' table)."""
    if "block_k" in tuning:
        return tuning["block_k"]
    k = min(64, max(16, _next_power_of_2(hidden)))
    return min(k, 32) if not backward and 32 <= rows <= 64 else k


def _batch_block(batch: int, row_blocks: int = 1) -> int:
    """Rows a program holds: the batch's share of one of ``row_blocks`` blocks, at least 16."""
    return max(16, _next_power_of_2(-(-batch // row_blocks)))


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` without Triton's call overhead (a host cost of every launch)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def lstm_forward(how: Launch, schedule: Schedule, gates_x, h0, c0, w_hh, mask, keep: bool = True):
    """The step kernel's forward (:func:`rnndrop.kernels.triton_lstm._forward`, without a
    projection) in one launch: ``(out, h_n, c_n, acts, cells, None, masked)``, or None where the
    step kernel must run the call (:func:`_run`). ``masked`` is always written (``m_t = h_{t-1}``
    without a mask); ``acts`` and ``cells`` (what backward reads) are None unless ``keep``."""
    N, (B, H), device = gates_x.shape[0], h0.shape, gates_x.device
    G = mask.shape[2] if mask is not None and mask.dim() == 4 else 1
    out = gates_x.new_empty(N, H)
    acts = gates_x.new_empty(N, 4 * H) if keep else None
    cells = torch.empty(N, H, dtype=accumulation_dtype(gates_x.dtype), device=device) if keep else None
    masked = gates_x.new_empty(N, G, H) if G > 1 else gates_x.new_empty(N, H)
    # written by the loop (every row runs a step), read only as the state a row carries on
    h_state, c_state = (torch.empty(B, H, dtype=torch.float32, device=device) for _ in range(2))
    table = _step_table(schedule, mask, device)
    mask_row, mask_gate = _mask_strides(mask)
    read = _products_read(gates_x, masked, mask)
    args = (gates_x, w_hh, h0, c0, h0 if mask is None else mask, mask_row, mask_gate, table, masked, read,
            out if acts is None else acts, out if cells is None else cells, out, h_state, c_state)
    ran = _run(_lstm_forward, how, len(schedule.steps) + 1, args, False, MASK_GATES=G,
              HAS_MASK=mask is not None, SAVE=keep, HALF_STATE=read is not masked,
              PRECISION=_precision(gates_x), **_shape(how, B, H, N, False))
    if not ran:
        return None
    return out, as_dtype(h_state, out.dtype), as_dtype(c_state, c0.dtype), acts, cells, None, masked


def _carries(how: Launch, *final_grads: Tensor | None) -> bool:
    """Whether a backward launch reads its running gradients from memory and leaves them there:
    where a final state has a gradient (they start from it), or where one launch runs each step
    (:attr:`Launch.per_step`: the next launch goes on from them). Else the loop starts from zeros of
    its own: no fill before the launch."""
    return how.per_step or any(grad is not None for grad in final_grads)


def lstm_backward(how: Launch, schedule: Schedule, needs: Sequence[bool], saved, d_out, d_hn, d_cn):
    """``(d_gates_x, dh_0, dc_0)`` and the whole-sequence products, as the step kernel's backward,
    from its saved tensors (:class:`rnndrop.kernels.triton_lstm._Saved`); None where the step kernel
    must run it (:func:`_run`)."""
    s = saved
    (N, H), (B, _), device = s.cells.shape, s.h0.shape, s.cells.device
    G = s.mask.shape[2] if s.mask is not None and s.mask.dim() == 4 else 1
    d_gates = s.acts.new_empty(N, 4 * H)
    # every row starts once, so the loop writes every row of dh_0 and dc_0 (at the step it starts)
    dh0, dc0 = (torch.empty(B, H, dtype=torch.float32, device=device) for _ in range(2))
    has_carry = _carries(how, d_hn, d_cn)
    if not has_carry:  # the loop starts from zeros of its own (the pointers are never read)
        carry, dc = dh0, dc0
    elif d_hn is None and d_cn is None:  # one fill for both (the launches' scratch)
        carry, dc = torch.zeros(2, B, H, dtype=torch.float32, device=device).unbind()
    else:
        carry, dc = initial_grad(d_hn, s.h0, torch.float32), initial_grad(d_cn, s.c0, torch.float32)
    need_dmask = bool(needs[5]) and s.mask is not None
    d_masked = s.masked.new_empty(s.masked.shape) if need_dmask else None
    dm_target = d_masked if d_masked is not None else s.masked
    d_out = None if d_out is None else d_out.contiguous()
    mask_row, mask_gate = _mask_strides(s.mask)
    args = (s.acts if d_out is None else d_out, s.w_hh, s.c0, s.h0 if s.mask is None else s.mask, mask_row,
            mask_gate, _step_table(schedule, s.mask, device), s.acts, s.cells, d_gates, dm_target,
            carry, dc, dh0, dc0)
    ran = _run(_lstm_backward, how, len(schedule.steps) + 1, args, True, MASK_GATES=G,
              HAS_MASK=s.mask is not None, HAS_DOUT=d_out is not None, NEED_DMASK=need_dmask,
              HAS_CARRY=has_carry, PRECISION=_precision(s.acts), **_shape(how, B, H, N, True))
    if not ran:
        return None
    return d_gates, dh0, dc0, d_masked


def gru_forward(how: Launch, schedule: Schedule, gates_x, h0, w_hh, b_hh, mask, keep: bool = True):
    """The step kernel's forward (:func:`rnndrop.kernels.triton_gru._forward`) in one launch:
    ``(out, h_n, acts, a_n, masked)``, or None where the step kernel must run it (:func:`_run`);
    ``acts`` and ``a_n`` are None unless ``keep``."""
    N, (B, H), device = gates_x.shape[0], h0.shape, gates_x.device
    G = mask.shape[2] if mask is not None and mask.dim() == 4 else 1
    out = gates_x.new_empty(N, H)
    acts = gates_x.new_empty(N, 3 * H) if keep else None
    a_n = torch.empty(N, H, dtype=accumulation_dtype(gates_x.dtype), device=device) if keep else None
    masked = gates_x.new_empty(N, G, H) if G > 1 else gates_x.new_empty(N, H)
    h_state = torch.empty(B, H, dtype=torch.float32, device=device)  # as in lstm_forward
    mask_row, mask_gate = _mask_strides(mask)
    read = _products_read(gates_x, masked, mask)
    args = (gates_x, w_hh, h0 if b_hh is None else b_hh, h0, h0 if mask is None else mask, mask_row,
            mask_gate, _step_table(schedule, mask, device), masked, read, out if acts is None else acts,
            out if a_n is None else a_n, out, h_state)
    ran = _run(_gru_forward, how, len(schedule.steps) + 1, args, False, MASK_GATES=G,
              HAS_MASK=mask is not None, HAS_BIAS=b_hh is not None, SAVE=keep, HALF_STATE=read is not masked,
              PRECISION=_precision(gates_x), **_shape(how, B, H, N, False))
    if not ran:
        return None
    return out, as_dtype(h_state, out.dtype), acts, a_n, masked


def gru_backward(how: Launch, schedule: Schedule, needs: Sequence[bool], saved, d_out, d_hn):
    """``(d_a, d_n, dh_0, d_masked)`` of the step kernel's backward from its saved tensors
    (:class:`rnndrop.kernels.triton_gru._Saved`); None where the step kernel must run it
    (:func:`_run`)."""
    s = saved
    (N, H), device = s.out.shape, s.out.device
    B = s.h0.shape[0]
    G = s.mask.shape[2] if s.mask is not None and s.mask.dim() == 4 else 1
    d_a = s.acts.new_empty(N, 3 * H)
    d_n = s.acts.new_empty(N, H)
    dh0 = torch.empty(B, H, dtype=torch.float32, device=device)  # every row written at the step it starts
    has_carry = _carries(how, d_hn)
    carry = initial_grad(d_hn, s.h0, torch.float32) if has_carry else dh0  # (dh0: never read then)
    need_dmask = bool(needs[4]) and s.mask is not None
    d_masked = s.masked.new_empty(s.masked.shape) if need_dmask else None
    dm_target = d_masked if d_masked is not None else s.masked
    d_out = None if d_out is None else d_out.contiguous()
    mask_row, mask_gate = _mask_strides(s.mask)
    args = (s.acts if d_out is None else d_out, s.w_hh, s.h0, s.h0 if s.mask is None else s.mask, mask_row,
            mask_gate, _step_table(schedule, s.mask, device), s.acts, s.a_n, s.out, d_a, d_n, dm_target,
            carry, dh0)
    ran = _run(_gru_backward, how, len(schedule.steps) + 1, args, True, MASK_GATES=G,
              HAS_MASK=s.mask is not None, HAS_DOUT=d_out is not None, NEED_DMASK=need_dmask,
              HAS_CARRY=has_carry, PRECISION=_precision(s.acts), **_shape(how, B, H, N, True))
    if not ran:
        return None
    return d_a, d_n, dh0, d_masked
