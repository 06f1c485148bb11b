"""The "compiled" kernel: the LSTM and GRU recurrences with their whole time loops in C++.

Same contract and equations as the "manual" kernel (:mod:`rnndrop.kernels.lstm`,
:mod:`rnndrop.kernels.gru`); the C++ sources are in ``csrc/``. Per step, forward and
backward, one matrix product through ATen and passes over the step's rows in C++
instead of a dozen ATen calls from Python; ``dW_hh`` and ``dW_hr`` are one product
each over all steps after the loop. CPU only, float32 and float64; once differentiable.

The extension is compiled with ``torch.utils.cpp_extension`` (needs a C++ compiler and ninja)
and cached in torch's extension directory (``TORCH_EXTENSIONS_DIR``), in a folder keyed by
everything that changes the binary, with a record of what the build wrote that is checked before
the library is loaded (:mod:`rnndrop.kernels.compiled_cache`); a cached build loads in well under
a second. ``kernel="auto"`` never waits for a compilation: its first call starts the build in a
background thread and runs the "manual" kernel until it is done (:func:`is_available`).
Build it ahead of time, with progress lines, and see where it lives, with::

    python -m rnndrop.kernels

``RNNDROP_NO_COMPILE=1`` turns it off: :func:`is_available` is then False and
``kernel="auto"`` runs the "manual" kernel. ``RNNDROP_COMPILE_WAIT=1`` makes ``kernel="auto"``
build it in its first call instead of in the background.

What crosses to C++ is named (``csrc/kernels.h``): each call takes and returns structs whose
fields are set and read by name, from the NamedTuples :class:`LSTMInputs`, :class:`LSTMSaved`,
:class:`GRUInputs` and :class:`GRUSaved`; a field missing or misnamed on either side is an error
(:func:`_struct`), so no reordering can hand a tensor to the wrong parameter.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx

from rnndrop.kernels import compiled_cache
from rnndrop.kernels.compiled_cache import Cache, Unavailable, build_key, extensions_root
from rnndrop.kernels.first_order import first_order_backward, refuse_transforms, will_differentiate
from rnndrop.kernels.onednn import sequence_through_onednn, worth_onednn
from rnndrop.kernels.optional import available_or_warn

__all__ = ["GRUInputs", "GRUSaved", "LSTMInputs", "LSTMSaved", "build", "gru_backward_saved",
           "gru_forward_saving", "gru_recurrence", "gru_saved_like", "is_available", "lstm_backward_saved",
           "lstm_forward_saving", "lstm_recurrence", "lstm_saved_like"]

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / f for f in ("module.cpp", "lstm.cpp", "gru.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / h for h in ("kernels.h", "common.h", "rows.h")]
#: -fno-trapping-math lets GCC turn the clamps of rows.h's e^x into vector min / max (no
#: floating-point exception is ever unmasked here), so the row passes vectorise. -fopenmp:
#: at::parallel_for is a header template, compiled here; without it the pragma inside is ignored
#: and every "parallel" loop runs on one thread. Linked the same way, the library names
#: libgomp.so.1, which the loader resolves to the one torch has loaded: one thread pool.
CFLAGS = ["-O3", "-fno-trapping-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _build_name() -> str:
    """The extension's name, and so its build folder: a hash of everything that changes the binary
    (:func:`rnndrop.kernels.compiled_cache.build_key`: sources, flags, torch, Python, compiler,
    include paths), so that two checkouts, versions or environments never rebuild over each
    other's cached library."""
    return f"rnndrop_loop_kernels_{build_key(SOURCES, HEADERS, CFLAGS + LDFLAGS)[:16]}"


NAME = _build_name()
HOW_TO_GET_IT = (
    "install a C++ compiler (g++) and ninja (`pip install ninja`), then build it with "
    "`python -m rnndrop.kernels`"
)
#: What a first build usually takes, as the messages say it (a quiet 2-core CPU to a busy one).
USUAL_BUILD_TIME = "about 1-4 min"

_lock = threading.Lock()  # one build or load at a time in this process
_extension: ModuleType | None = None
_failure: Unavailable | None = None  # why it cannot be had, once known
_background: threading.Thread | None = None  # the build kernel="auto" started, if any
_warned = False


class _NeedsBuild(Exception):
    """Raised by :func:`_obtain` when the library must be compiled and compiling was not allowed."""


def _missing_tool() -> str | None:
    """Why a build cannot even start, or None."""
    import torch.utils.cpp_extension as cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler: {compiler!r} is not on PATH"
    if not cpp_extension.is_ninja_available():
        return "ninja is missing"
    return None


def _cache() -> Cache:
    return Cache(NAME, extensions_root() / NAME)


def build() -> ModuleType:
    """The extension, loaded from the cache or compiled now (waiting for it, with progress lines
    logged at INFO); RuntimeError (:class:`~rnndrop.kernels.compiled_cache.Unavailable`) saying why
    it cannot be had. Waits for a build this process started in the background."""
    global _extension, _failure
    if _extension is not None:  # every call of the kernel asks: no lock once it is loaded
        return _extension
    with _lock:
        if _extension is None and _failure is None:
            try:
                _extension = _obtain(compile=True, report=logger.info)
            except Unavailable as error:
                _failure = error
        if _extension is None:
            assert _failure is not None
            raise Unavailable(f"the compiled loop kernel is not available: {_failure}", how=_failure.how)
        return _extension


def _obtain(compile: bool, report: Callable[[str], None] | None) -> ModuleType:
    """The extension: the cached library when it is what its build wrote, else (``compile``) one
    compiled now, under the folder's build lock; :class:`_NeedsBuild` when it must be compiled and
    ``compile`` is False; Unavailable with the reason when it cannot be had."""
    if os.environ.get("RNNDROP_NO_COMPILE", "") not in ("", "0"):
        raise Unavailable("disabled by RNNDROP_NO_COMPILE")
    _check_sources_unchanged()
    cache = _cache()
    damage = cache.check()
    if damage is None:  # a complete build: loaded as it is, even read-only, even with no compiler
        return cache.load()
    missing = _missing_tool()
    if missing is not None:
        if damage == "missing":
            raise Unavailable(missing)
        raise Unavailable(f"{damage}, and it cannot be rebuilt: {missing}",
                          how=f"delete {cache.folder}, then {HOW_TO_GET_IT}")
    if not compile:
        raise _NeedsBuild(damage)
    with cache.build_lock(compiled_cache.WAIT_FOR_OTHER_BUILD_S, report):
        damage = cache.check()  # built by another process while this one waited?
        if damage is not None:
            if damage != "missing":
                logger.warning("rnndrop: %s; rebuilding it", damage)
                cache.remove_library()
            started = time.monotonic()
            if report is not None:  # (a background build said so when it started)
                logger.warning("rnndrop: compiling the C++ loop kernel into %s (first use only: %s; "
                               "`python -m rnndrop.kernels` builds it ahead)", cache.folder, USUAL_BUILD_TIME)
            built = cache.compile(SOURCES, CFLAGS, LDFLAGS, report)
            try:
                _check_sources_unchanged()
            except RuntimeError:  # changed while compiling: the library may mix two versions
                shutil.rmtree(built.parent, ignore_errors=True)
                raise
            cache.publish(built)
            if report is not None:
                report(f"compiled in {time.monotonic() - started:.0f} s: {cache.library}")
        return cache.load()


def _check_sources_unchanged() -> None:
    """Unavailable when the C++ sources on disk are not those this process imported with (rnndrop
    upgraded or edited while it ran): their library would not fit the Python side in memory, and
    would be cached under the name of the sources it did not come from."""
    if _build_name() != NAME:
        raise Unavailable("its C++ sources changed on disk after rnndrop was imported (rnndrop upgraded "
                          "or edited while this process ran, or its compiler or environment changed); "
                          "restart the process to build them", how="restart the process")


def _build_in_background() -> None:
    """The body of the thread kernel="auto" starts: compile, then later calls run the kernel."""
    global _extension, _failure
    with _lock:
        if _extension is not None or _failure is not None:
            return
        started = time.monotonic()
        try:
            _extension = _obtain(compile=True, report=None)
        except Unavailable as error:
            _failure = error
        except Exception as error:  # a thread's error would be lost: say it once instead
            _failure = Unavailable(f"the build failed: {type(error).__name__}: {error}")
        else:
            logger.warning("rnndrop: the compiled loop kernel is built (%.0f s); kernel='auto' runs it from "
                           "now on", time.monotonic() - started)


def _after_fork_in_child() -> None:
    """A child forked while the parent builds (a DataLoader worker, Hogwild) inherits the lock the
    build thread holds but not the thread, which would never release it: kernel="compiled" there
    waited forever, and kernel="auto" ran "manual" for the child's life. The child starts with a
    free lock and no build of its own; its first call finds the library the parent published, or
    waits on the build's file lock (:mod:`rnndrop.kernels.compiled_cache`) as any other process."""
    global _lock, _background
    _lock = threading.Lock()
    _background = None


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _stop_background_build() -> None:
    """A build kernel="auto" started does not outlive its process (nor leave a compiler running)."""
    if compiled_cache.stop_children() or (_background is not None and _background.is_alive()):
        logger.warning("rnndrop: the compiled loop kernel's background build was stopped as the process "
                       "exited; `python -m rnndrop.kernels` builds it ahead of time")


def is_available() -> bool:
    """Whether the compiled kernel can run now: what kernel="auto" asks. Never waits for a
    compilation: where the library must be compiled, it starts the build in a background thread,
    logs one warning saying so, and answers False (the "manual" kernel runs) until the build is
    done; later calls then answer True. ``RNNDROP_COMPILE_WAIT=1`` builds it in the call instead.

    When it cannot be had, warns once per process saying why and how to get it.
    """
    global _warned, _extension, _failure, _background
    if _extension is not None:
        return True
    if os.environ.get("RNNDROP_COMPILE_WAIT", "") in ("", "0") and _failure is None:
        if _background is not None or not _lock.acquire(blocking=False):
            return False  # being built (here in the background, or by another thread)
        try:
            if _extension is None and _failure is None:
                try:
                    _extension = _obtain(compile=False, report=None)
                except _NeedsBuild as need:
                    damage = "" if str(need) == "missing" else f"{need}; "
                    logger.warning(
                        "rnndrop: %sbuilding the compiled C++ loop kernel in the background into %s (first "
                        "use only: %s); kernel='auto' runs the 'manual' kernel until it is ready, then "
                        "the compiled one. `python -m rnndrop.kernels` builds it ahead of time.",
                        damage, _cache().folder, USUAL_BUILD_TIME)
                    _background = threading.Thread(target=_build_in_background, name="rnndrop-kernel-build",
                                                   daemon=True)
                    _background.start()
                    return False
                except Unavailable as error:
                    _failure = error
        finally:
            _lock.release()
    available, _warned = available_or_warn(
        build, _warned, "RNNDROP_NO_COMPILE", HOW_TO_GET_IT, "the 'manual' kernel"
    )
    return available


# ------------------------------------------------ the boundary with the C++ side (csrc/kernels.h)


class LSTMInputs(NamedTuple):
    """The differentiable inputs of an LSTM recurrence (``N`` rows, ``B`` sequences, ``H`` units,
    ``P = proj_size or H``); also the names of their gradients and of ``needs_input_grad``."""

    gates_x: Tensor  # [N, 4H]
    h0: Tensor  # [B, P]
    c0: Tensor  # [B, H]
    w_hh: Tensor  # [4H, P]
    w_hr: Tensor | None  # [P, H]
    mask: Tensor | None  # [T', B', P] or per gate [T', B', 4, P]


class LSTMSaved(NamedTuple):
    """What the LSTM's backward pass reads (``csrc/kernels.h``'s ``LSTMSaved``, field by field)."""

    acts: Tensor  # [N, 4H]: i, f, g, o after their nonlinearities
    cells: Tensor  # [N, H]: c_t
    tanh_cells: Tensor  # [N, H]
    out: Tensor  # [N, P]: h_t
    r: Tensor | None  # [N, H]: o * tanh(c_t) before the projection
    masked: Tensor | None  # masked states (shared masks; per-gate ones are rebuilt)
    h0: Tensor
    c0: Tensor
    w_hh: Tensor
    w_hr: Tensor | None
    mask: Tensor | None


class GRUInputs(NamedTuple):
    """The differentiable inputs of a GRU recurrence (shapes as for :class:`LSTMInputs`)."""

    gates_x: Tensor  # [N, 3H]
    h0: Tensor  # [B, H]
    w_hh: Tensor  # [3H, H]
    b_hh: Tensor | None  # [3H]
    mask: Tensor | None  # [T', B', H] or per gate [T', B', 3, H]


class GRUSaved(NamedTuple):
    """What the GRU's backward pass reads (``csrc/kernels.h``'s ``GRUSaved``, field by field)."""

    acts: Tensor  # [N, 3H]: r, z, n
    a_n: Tensor  # [N, H]: the n part of W_hh m + b_hh
    out: Tensor  # [N, H]: h_t
    masked: Tensor | None  # masked states
    h0: Tensor
    w_hh: Tensor
    mask: Tensor | None


@functools.cache
def _fields(cls: type) -> frozenset[str]:
    """The fields of one of the extension's structs (properties of its Python class)."""
    return frozenset(name for name, value in vars(cls).items() if isinstance(value, property))


def _struct(cls: type, **fields: Any) -> Any:
    """An instance of the extension's struct ``cls`` with every field set by name: a field it
    lacks, or one left unset, is a ValueError, never a value passed to the wrong parameter."""
    if set(fields) != _fields(cls):
        raise ValueError(f"{cls.__name__} has the fields {sorted(_fields(cls))}, got {sorted(fields)}")
    struct = cls()
    for name, value in fields.items():
        setattr(struct, name, value)
    return struct


def _schedule(batch_sizes: list[int], reverse: bool) -> Any:
    """The extension's ``Schedule``: the rows of each step, and the direction."""
    return _struct(build().Schedule, batch_sizes=batch_sizes, reverse=reverse)


def _sizes(batch_sizes: Sequence[int]) -> list[int]:
    return [int(b) for b in batch_sizes]


def _lstm_forward(inputs: LSTMInputs, batch_sizes: list[int], reverse: bool, keep: bool) -> Any:
    """The extension's ``LSTMForward``, W_hh packed where oneDNN runs the products; ``keep``:
    whether the buffers backward reads are kept."""
    packed = packed_weights(inputs.w_hh, inputs.mask, batch_sizes[0])
    parts = split_parts(inputs.w_hh, inputs.w_hr, packed, batch_sizes)
    extension = build()
    return extension.lstm_forward(
        inputs=_struct(extension.LSTMInputs, **inputs._asdict()), schedule=_schedule(batch_sizes, reverse),
        w_packed=packed, keep=keep, parts=parts,
    )


def _gru_forward(inputs: GRUInputs, batch_sizes: list[int], reverse: bool, keep: bool) -> Any:
    """The extension's ``GRUForward`` (see :func:`_lstm_forward`)."""
    extension = build()
    return extension.gru_forward(
        inputs=_struct(extension.GRUInputs, **inputs._asdict()), schedule=_schedule(batch_sizes, reverse),
        w_packed=packed_weights(inputs.w_hh, inputs.mask, batch_sizes[0]), keep=keep,
    )


# ------------------------------------------------------------------------ how a call runs
# Which step products go through oneDNN's packed weights instead of BLAS
# (:func:`~rnndrop.kernels.onednn.worth_onednn`), and whether the LSTM's forward step is split by
# hidden units over the threads instead of by rows (``csrc/lstm.cpp``). Both are choices of speed
# alone: every path computes the same equations (the tests compare each with the reference kernel).


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


def split_parts(w_hh: Tensor, w_hr: Tensor | None, packed: list[Tensor], batch_sizes: list[int]) -> int:
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


# ------------------- the passes, for the autograd Functions below and the operators (kernels/ops.py)


def _kept_masked(mask: Tensor | None) -> bool:
    """Whether the LSTM's forward pass keeps the masked states: with a mask shared by the gates
    (per-gate ones are rebuilt by backward)."""
    return mask is not None and mask.dim() == 3


def lstm_forward_saving(
    gates_x: Tensor, batch_sizes: list[int], h0: Tensor, c0: Tensor, w_hh: Tensor, w_hr: Tensor | None,
    hidden_mask: Tensor | None, reverse: bool, keep: bool,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """``(out, h_n, c_n, saved)``: the forward pass, with ``keep`` what backward reads besides the
    arguments and ``out`` as :func:`lstm_saved_like` lays it out (``batch_sizes``: Python ints)."""
    inputs = LSTMInputs(gates_x=gates_x, h0=h0, c0=c0, w_hh=w_hh, w_hr=w_hr, mask=hidden_mask)
    result = _lstm_forward(inputs, batch_sizes, reverse, keep)
    if not keep:
        return result.out, result.h_n, result.c_n, []
    saved = [result.acts, result.cells, result.tanh_cells]
    saved += [result.r] if w_hr is not None else []
    saved += [result.masked] if _kept_masked(hidden_mask) else []
    return result.out, result.h_n, result.c_n, saved


def lstm_saved_like(gates_x: Tensor, h0: Tensor, c0: Tensor, w_hh: Tensor, w_hr: Tensor | None,
                    hidden_mask: Tensor | None) -> list[Tensor]:
    """Empty tensors shaped as :func:`lstm_forward_saving`'s ``saved`` (for torch.compile's
    tracing): ``acts [N, 4H]``, ``cells, tanh_cells [N, H]``, ``r [N, H]`` with a projection,
    ``masked [N, P]`` with a mask shared by the gates."""
    N, H, P = gates_x.shape[0], c0.shape[1], h0.shape[1]
    saved = [gates_x.new_empty(N, 4 * H), gates_x.new_empty(N, H), gates_x.new_empty(N, H)]
    saved += [gates_x.new_empty(N, H)] if w_hr is not None else []
    saved += [gates_x.new_empty(N, P)] if _kept_masked(hidden_mask) else []
    return saved


def lstm_backward_saved(
    batch_sizes: list[int], reverse: bool, needs: Sequence[bool], h0: Tensor, c0: Tensor, w_hh: Tensor,
    w_hr: Tensor | None, hidden_mask: Tensor | None, out: Tensor, saved: Sequence[Tensor],
    d_out: Tensor | None, d_hn: Tensor | None, d_cn: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """The gradients of the :class:`LSTMInputs` (None where not ``needs``) from
    :func:`lstm_forward_saving`'s ``out`` and ``saved``."""
    acts, cells, tanh_cells, *rest = saved
    r = rest.pop(0) if w_hr is not None else None
    state = LSTMSaved(acts=acts, cells=cells, tanh_cells=tanh_cells, out=out, r=r,
                      masked=rest[0] if rest else None, h0=h0, c0=c0, w_hh=w_hh, w_hr=w_hr, mask=hidden_mask)
    wanted = LSTMInputs._make(needs)._asdict()
    extension = build()
    grads = extension.lstm_backward(
        grads=_struct(extension.LSTMOutputGrads, out=d_out, h_n=d_hn, c_n=d_cn),
        saved=_struct(extension.LSTMSaved, **state._asdict()), schedule=_schedule(batch_sizes, reverse),
        needs=_struct(extension.LSTMNeeds, **wanted),
        w_t_packed=packed_weights(w_hh, hidden_mask, batch_sizes[0], transposed=True),
        onednn_weight_grad=sequence_through_onednn(w_hh),
    )
    return tuple(getattr(grads, name) if need else None for name, need in wanted.items())


def gru_forward_saving(
    gates_x: Tensor, batch_sizes: list[int], h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
    hidden_mask: Tensor | None, reverse: bool, keep: bool,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """``(out, h_n, saved)``, as :func:`lstm_forward_saving`; ``saved`` as :func:`gru_saved_like`."""
    inputs = GRUInputs(gates_x=gates_x, h0=h0, w_hh=w_hh, b_hh=b_hh, mask=hidden_mask)
    result = _gru_forward(inputs, batch_sizes, reverse, keep)
    if not keep:
        return result.out, result.h_n, []
    masked = [] if hidden_mask is None else [result.masked]
    return result.out, result.h_n, [result.acts, result.a_n, *masked]


def gru_saved_like(gates_x: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
                   hidden_mask: Tensor | None) -> list[Tensor]:
    """Empty tensors shaped as :func:`gru_forward_saving`'s ``saved``: ``acts [N, 3H]``,
    ``a_n [N, H]``, with a mask ``masked [N, H]`` (per gate gate-major ``[G, N, H]``)."""
    N, H = gates_x.shape[0], h0.shape[1]
    saved = [gates_x.new_empty(N, 3 * H), gates_x.new_empty(N, H)]
    if hidden_mask is not None:
        gates = () if hidden_mask.dim() == 3 else (hidden_mask.shape[2],)
        saved.append(gates_x.new_empty(*gates, N, H))
    return saved


def gru_backward_saved(
    batch_sizes: list[int], reverse: bool, needs: Sequence[bool], h0: Tensor, w_hh: Tensor,
    b_hh: Tensor | None, hidden_mask: Tensor | None, out: Tensor, saved: Sequence[Tensor],
    d_out: Tensor | None, d_hn: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """The gradients of the :class:`GRUInputs` (None where not ``needs``) from
    :func:`gru_forward_saving`'s ``out`` and ``saved``."""
    acts, a_n, *rest = saved
    state = GRUSaved(acts=acts, a_n=a_n, out=out, masked=rest[0] if rest else None, h0=h0, w_hh=w_hh,
                     mask=hidden_mask)
    wanted = GRUInputs._make(needs)._asdict()
    extension = build()
    grads = extension.gru_backward(
        grads=_struct(extension.GRUOutputGrads, out=d_out, h_n=d_hn),
        saved=_struct(extension.GRUSaved, **state._asdict()), schedule=_schedule(batch_sizes, reverse),
        needs=_struct(extension.GRUNeeds, **wanted),
        w_t_packed=packed_weights(w_hh, hidden_mask, batch_sizes[0], transposed=True),
        onednn_weight_grad=sequence_through_onednn(w_hh),
    )
    return tuple(getattr(grads, name) if need else None for name, need in wanted.items())


class _LSTMRecurrence(torch.autograd.Function):
    """Differentiable in the :class:`LSTMInputs` that follow ``batch_sizes`` and ``reverse``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, batch_sizes: list[int], reverse: bool, *tensors: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        out, h_n, c_n, saved = lstm_forward_saving(tensors[0], batch_sizes, *tensors[1:], reverse, keep=True)
        ctx.save_for_backward(*tensors[1:], out, *saved)
        ctx.schedule = (batch_sizes, reverse)
        ctx.set_materialize_grads(False)
        return out, h_n, c_n

    @staticmethod
    @first_order_backward("compiled")
    def backward(
        ctx: Any, d_out: Tensor | None, d_hn: Tensor | None, d_cn: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        h0, c0, w_hh, w_hr, mask, out, *saved = ctx.saved_tensors
        batch_sizes, reverse = ctx.schedule
        grads = lstm_backward_saved(batch_sizes, reverse, ctx.needs_input_grad[2:], h0, c0, w_hh, w_hr, mask,
                                    out, saved, d_out, d_hn, d_cn)
        return (None, None, *grads)


class _GRURecurrence(torch.autograd.Function):
    """Differentiable in the :class:`GRUInputs` that follow ``batch_sizes`` and ``reverse``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, batch_sizes: list[int], reverse: bool, *tensors: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        out, h_n, saved = gru_forward_saving(tensors[0], batch_sizes, *tensors[1:], reverse, keep=True)
        ctx.save_for_backward(*tensors[1:], out, *saved)
        ctx.schedule = (batch_sizes, reverse)
        ctx.set_materialize_grads(False)
        return out, h_n

    @staticmethod
    @first_order_backward("compiled")
    def backward(ctx: Any, d_out: Tensor | None, d_hn: Tensor | None) -> tuple[Tensor | None, ...]:
        h0, w_hh, b_hh, mask, out, *saved = ctx.saved_tensors
        batch_sizes, reverse = ctx.schedule
        grads = gru_backward_saved(batch_sizes, reverse, ctx.needs_input_grad[2:], h0, w_hh, b_hh, mask, out,
                                   saved, d_out, d_hn)
        return (None, None, *grads)


def _refuse_dtype(gates_x: Tensor) -> None:
    """A one-line error naming the fix where a layer built with ``kernel="compiled"`` meets a dtype
    the C++ loop does not run (it would fail there, naming its own function)."""
    if gates_x.dtype not in (torch.float32, torch.float64):
        raise RuntimeError(
            f"the 'compiled' loop kernel runs float32 and float64 tensors, got {gates_x.dtype}; build "
            "the layer with kernel='auto' (a kernel for every dtype) or kernel='manual'"
        )


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
    refuse_transforms("compiled", gates_x)
    _refuse_dtype(gates_x)
    inputs = LSTMInputs(gates_x=gates_x, h0=h0, c0=c0, w_hh=w_hh, w_hr=w_hr, mask=hidden_mask)
    sizes, reverse = _sizes(batch_sizes), bool(reverse)
    if not will_differentiate(*inputs):
        return lstm_forward_saving(gates_x, sizes, h0, c0, w_hh, w_hr, hidden_mask, reverse, keep=False)[:3]
    out, h_n, c_n = _LSTMRecurrence.apply(sizes, reverse, *inputs)
    return out, h_n, c_n


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
    refuse_transforms("compiled", gates_x)
    _refuse_dtype(gates_x)
    inputs = GRUInputs(gates_x=gates_x, h0=h0, w_hh=w_hh, b_hh=b_hh, mask=hidden_mask)
    sizes, reverse = _sizes(batch_sizes), bool(reverse)
    if not will_differentiate(*inputs):
        return gru_forward_saving(gates_x, sizes, h0, w_hh, b_hh, hidden_mask, reverse, keep=False)[:2]
    out, h_n = _GRURecurrence.apply(sizes, reverse, *inputs)
    return out, h_n
