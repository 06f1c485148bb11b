"""Registers, spills and shared memory of the persistent loops, compiled for a GPU without one.

Triton lowers a kernel to PTX and assembles it with its own ``ptxas`` on any machine; only loading
the binary needs a GPU. This script compiles the LSTM and GRU loops, forward and backward, with the
launch settings ``persistent.plan`` picks on a Hopper GPU (an H100 / H200: 132 multiprocessors), or
on the GPU ``--gpu`` names, for the shapes of ``benchmarks/speed.py`` (tied masks, float32 in TF32),
specialised as Triton specialises a launch (every tensor 16-byte aligned, as torch allocates them;
integers that are multiples of 16 marked so), and prints what ``ptxas -v`` reports: registers a
thread and bytes spilled to local memory, the shared memory of a program, and how wide the loads
from global memory are (``scalar``: loads and asynchronous copies of one 4-byte value, ``vector``:
of 8 or 16 bytes). Spills inside the time loop cost every step, and so does each load instruction;
a change to the kernels can be checked here before a GPU times it.

    python benchmarks/kernel_resources.py [--gpu NAME] [--resident] [--spread] [--per-sm N] [--half-state]
                                          [--stages N] [--json FILE]

``--gpu`` is one of :data:`GPUS` (``h100``, the default; ``a100``, ``rtx4090``, ``b200``,
``rtx5090``, ``t4``, ``v100``): its compute capability, its multiprocessors (the plan's grid) and its shared
memory, where a load pipeline too deep to fit is compiled shallower, as a launch retries it.
``--resident`` asks for resident ``W_hh`` tiles (``persistent.tuning["resident"]``), which the plan
gives where the hidden size is at most ``persistent.MAX_RESIDENT``; ``--spread`` for programs of
fewer units than their tile (``persistent.tuning["spread"]``); ``--per-sm N`` for a grid of up to
N programs a multiprocessor (``persistent.tuning["per_sm"]``); ``--half-state`` for forward loops
that read the masked states from a float16 copy (``persistent.tuning["half_state"]``). Each line also
says how many programs of the kernel a multiprocessor holds at once by its registers and shared
memory (a cooperative launch of more is refused). Numbers are this Triton's (the GPU machine may run
another version); ~20 s on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tempfile
from typing import NamedTuple

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's

if importlib.util.find_spec("triton") is None:  # the persistent loop is Triton's: one line, not a traceback
    sys.exit("kernel_resources.py: needs Triton (the [gpu] extra): pip install triton")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from rnndrop.atomic import unwritable, write_json_atomic
from rnndrop.kernels import persistent
from rnndrop.kernels.triton_plan import LAUNCH_OPTIONS


class Gpu(NamedTuple):
    """What the loops' compilation and ``persistent.plan`` depend on of a GPU: its compute capability,
    multiprocessors, and shared memory (bytes) a multiprocessor has and one program may take."""

    capability: int
    multiprocessors: int
    shared: int
    shared_per_program: int


#: GPUs to compile for, by the name ``--gpu`` takes: Hopper (H100 / H200), where the persistent loop
#: has been measured and which is the default, and one of each other generation users train on.
GPUS = {
    "h100": Gpu(90, 132, 228 * 1024, 227 * 1024),
    "a100": Gpu(80, 108, 164 * 1024, 163 * 1024),
    "rtx4090": Gpu(89, 128, 100 * 1024, 99 * 1024),
    "b200": Gpu(100, 148, 228 * 1024, 227 * 1024),
    "rtx5090": Gpu(120, 170, 100 * 1024, 99 * 1024),
    "t4": Gpu(75, 40, 64 * 1024, 64 * 1024),
    "v100": Gpu(70, 80, 96 * 1024, 96 * 1024),
}
HOPPER = GPUS["h100"]
CAPABILITY, MULTIPROCESSORS = HOPPER.capability, HOPPER.multiprocessors
SHAPES = ((200, 20), (200, 128), (650, 20), (650, 128), (1500, 20), (1500, 128))
#: Integer pointers among the loops' arguments (the others hold floats: :func:`signature`).
INT_POINTERS = {"table_ptr", "counter_ptr"}


#: The pointers of each loop that hold the products' dtype (``persistent.lstm_forward`` and the
#: others allocate them like the gates): bfloat16 / float16 under autocast; the states, cells and
#: running gradients stay float32.
COMPUTE_POINTERS = {
    "_lstm_forward": {"gx_ptr", "w_ptr", "m_ptr", "m16_ptr", "acts_ptr", "out_ptr"},
    "_lstm_backward": {"d_out_ptr", "w_ptr", "acts_ptr", "dz_ptr", "d_masked_ptr"},
    "_gru_forward": {"gx_ptr", "w_ptr", "m_ptr", "m16_ptr", "acts_ptr", "out_ptr"},
    "_gru_backward": {"d_out_ptr", "w_ptr", "acts_ptr", "out_ptr", "da_ptr", "dn_ptr", "d_masked_ptr"},
}


def signature(kernel, constexprs: dict, dtype: str = "fp32") -> dict[str, str]:
    """Triton's signature of ``kernel``: ``*_ptr`` arguments are pointers (``dtype``, Triton's name
    of the products' dtype, for :data:`COMPUTE_POINTERS`; float16 for the masked states' copy where
    ``HALF_STATE``), the rest ``i32``."""
    names = inspect.signature(kernel.fn).parameters
    compute = COMPUTE_POINTERS[kernel.fn.__name__]

    def pointer(name: str) -> str:
        if name in INT_POINTERS:
            return "*i32"
        if name == "m16_ptr" and constexprs.get("HALF_STATE"):
            return "*fp16"
        return f"*{dtype}" if name in compute else "*fp32"

    return {name: "constexpr" if name in constexprs else pointer(name) if name.endswith("_ptr") else "i32"
            for name in names}


def specialization(kernel, constexprs: dict, integers: dict[str, int]) -> dict:
    """The attributes Triton gives a launch of ``kernel``: 16-byte alignment for every pointer (torch
    allocates so) and for each integer of ``integers`` that is a multiple of 16, except those the
    kernel keeps unspecialised (``do_not_specialize``: the steps, the rows); other integers, unknown
    here, get none."""
    names = list(inspect.signature(kernel.fn).parameters)
    unspecialised = set(persistent._RUN_TIME_INTS)
    aligned = [name for name in names if name not in constexprs
               and (name.endswith("_ptr") or (name not in unspecialised and integers.get(name, 1) % 16 == 0))]
    return {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}


def load_widths(ptx: str) -> tuple[int, int]:
    """``(scalar, vector)``: global loads and asynchronous copies to shared memory of one 4-byte
    value, and of 8 or 16 bytes, in ``ptx``."""
    copy_sizes = re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*\], (0x[0-9a-f]+)", ptx)
    copies = [int(size, 16) for size in copy_sizes]
    loads = re.findall(r"\bld\.global(\S*)\s", ptx)  # the modifiers of each load: .v4.b32, .b32, ...
    vector_loads = sum(".v2." in mods or ".v4." in mods for mods in loads)
    scalar = sum(size == 4 for size in copies) + len(loads) - vector_loads
    vector = sum(size > 4 for size in copies) + vector_loads
    return scalar, vector


def registers_and_spills(ptx: str, capability: int = CAPABILITY) -> tuple[int, int]:
    """``(registers a thread, bytes spilled)`` that ``ptxas -v`` reports for ``ptx`` (compiled for
    ``capability``: the architecture its ``.target`` line names)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        ptxas = get_ptxas(capability).path
        architecture = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)  # sm_90a, sm_80, ...
        command = [ptxas, "-v", f"--gpu-name={architecture}", source.name, "-o", "/dev/null"]
        report = subprocess.run(command, capture_output=True, text=True, check=True)
    text = report.stdout + report.stderr
    registers = int(re.search(r"Used (\d+) registers", text).group(1))
    spilled = int(re.search(r"(\d+) bytes spill stores", text).group(1))
    return registers, spilled


def tiles_before_loop(ttgir: str) -> int:
    """Shared-memory buffers filled from a loaded tensor (``ttg.local_alloc %x``) before the first
    loop of the kernel: resident tiles of ``W_hh`` that stay on chip for every step."""
    head = ttgir.split("scf.for", 1)[0]
    return len(re.findall(r"ttg\.local_alloc %", head))


def async_copies(ttgir: str) -> tuple[int, int]:
    """``(before the first loop, in all)``: asynchronous copies to shared memory
    (``ttg.async_copy_global_to_local``, the loads of a software-pipelined loop). Those before the
    kernel's first loop are the prologue of a pipelined time loop, loading steps not yet run; a
    pipelined ``K`` loop inside a step has its prologue inside the time loop."""
    copy = r"ttg\.async_copy_global_to_local"
    return len(re.findall(copy, ttgir.split("scf.for", 1)[0])), len(re.findall(copy, ttgir))


def barriers(ttgir: str) -> int:
    """Barriers of a program's threads the kernel asks for (``tl.debug_barrier``: ``gpu.barrier`` in
    Triton 3.6's TTGIR, ``ttg.barrier`` in 3.9's)."""
    return len(re.findall(r"\b(?:gpu|ttg)\.barrier\b", ttgir))


def loop_constexprs(cell: str, backward: bool, tiles: dict, hidden: int, mask_gates: int = 1) -> dict:
    """The compile-time arguments of a loop launch: ``tiles`` (``BB``, ``BH``, ``BK``, ``RESIDENT``),
    the vector width of ``hidden`` (and ``H_VEC`` where it is 1, which Triton compiles as a constant,
    as it does every integer argument equal to 1), a mask (``mask_gates`` per gate), float32 in TF32,
    a grid barrier; what training passes."""
    extra = dict(HAS_DOUT=True, NEED_DMASK=False, HAS_CARRY=False) if backward else dict(SAVE=True)
    sizes = persistent._sizes(1, hidden, 1)  # (H_VEC and VEC as a launch passes them)
    if sizes["H_VEC"] == 1:
        extra["H_VEC"] = 1
    if not backward:
        extra["HALF_STATE"] = bool(persistent.tuning.get("half_state", persistent.HALF_STATE))
    if cell == "gru" and not backward:
        extra["HAS_BIAS"] = True
    return dict(VEC=sizes["VEC"], MASK_GATES=mask_gates, HAS_MASK=True, SYNC=True,
                PRECISION="tf32", UPCAST=False, **tiles, **extra)


def compile_loop(cell: str, backward: bool, constexprs: dict, warps: int, stages: int = 3,
                 integers: dict[str, int] | None = None, dtype: str = "fp32",
                 capability: int = CAPABILITY) -> dict:
    """Compile one loop for ``capability`` (Hopper's by default) with a load pipeline ``stages`` deep,
    products in ``dtype`` (:func:`signature`), specialised for the values ``integers`` of its integer
    arguments (:func:`specialization`): ``registers``, ``spilled``, ``shared``, ``tiles_before_loop``,
    the asynchronous ``copies`` (``copies_before_loop`` of them before the time loop:
    :func:`async_copies`), the ``barriers`` of the program's threads the kernel asks for
    (:func:`barriers`) and the ``scalar`` and ``vector`` loads."""
    kernel = getattr(persistent, f"_{cell}_{'backward' if backward else 'forward'}")
    source = ASTSource(kernel, signature(kernel, constexprs, dtype), constexprs=constexprs,
                       attrs=specialization(kernel, constexprs, integers or {}))
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=warps, num_stages=stages, **LAUNCH_OPTIONS))
    registers, spilled = registers_and_spills(compiled.asm["ptx"], capability)
    ahead, copies = async_copies(compiled.asm["ttgir"])
    scalar, vector = load_widths(compiled.asm["ptx"])
    return dict(registers=registers, spilled=spilled, shared=compiled.metadata.shared,
                tiles_before_loop=tiles_before_loop(compiled.asm["ttgir"]), scalar=scalar, vector=vector,
                copies_before_loop=ahead, copies=copies, barriers=barriers(compiled.asm["ttgir"]))


class _PlannedCall:
    """What ``persistent.plan`` reads of a CUDA tensor: its dtype, device and size (speed.py's
    shapes are far below the 32-bit offsets' limit)."""

    dtype = torch.float32
    device = torch.device("cuda", 0)

    def numel(self) -> int:
        return 0


def planned(hidden: int, batch: int, multiprocessors: int = MULTIPROCESSORS,
            cell: str = "lstm") -> persistent.Launch | None:
    """The launch ``persistent.plan`` picks for a float32 call of ``cell`` on a GPU of
    ``multiprocessors`` (Hopper's 132 by default)."""
    saved = persistent._multiprocessors
    persistent._multiprocessors = lambda device: multiprocessors  # no GPU to ask
    try:
        return persistent.plan(_PlannedCall(), hidden, batch, False, cell=cell)  # type: ignore[arg-type]
    finally:
        persistent._multiprocessors = saved


#: A multiprocessor's registers (every GPU of :data:`GPUS`), and the shared memory (bytes) reserved
#: per program.
REGISTERS, SHARED_RESERVED = 65536, 1024


def programs_per_multiprocessor(registers: int, warps: int, shared: int, gpu: Gpu = HOPPER) -> int:
    """How many programs of a kernel a multiprocessor of ``gpu`` holds at once: registers are
    allocated per warp in units of 256, shared memory per program plus its reserve; at most 32 programs."""
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = REGISTERS // (per_warp * warps) if registers else 32
    return min(32, by_registers, gpu.shared // (shared + SHARED_RESERVED))


def compile_fitting(cell: str, backward: bool, constexprs: dict, warps: int, stages: int,
                    integers: dict[str, int], gpu: Gpu) -> dict:
    """:func:`compile_loop` for ``gpu`` at the first K block and load pipeline depth, from ``stages``
    down (``persistent._fittings``: narrower K blocks before one stage), whose shared memory one
    program may take there, as ``persistent._run`` launches it (where none fits, the last tried, with
    ``stages`` 0: that call would run the step kernel); with ``stages`` and the ``BK`` compiled."""
    fixed = persistent._block_k_fixed(constexprs)
    for block_k, depth in persistent._fittings(constexprs["BK"], stages, fixed):
        found = compile_loop(cell, backward, dict(constexprs, BK=block_k), warps, depth, integers,
                             capability=gpu.capability)
        if found["shared"] <= gpu.shared_per_program:
            return dict(found, stages=depth, BK=block_k)
    return dict(found, stages=0, BK=block_k)


def stages_note(fitted: int, asked: int) -> str:
    """What a line says of the pipeline depth that fitted (:func:`compile_fitting`), where it is not
    the one asked for."""
    if fitted == asked:
        return ""
    return f", {fitted} stages (shared memory)" if fitted else ", fits at no depth: the step kernel runs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resident", action="store_true", help="ask for resident W_hh tiles where they fit")
    parser.add_argument("--spread", action="store_true",
                        help="ask for fewer units a program where multiprocessors would idle")
    parser.add_argument("--half-state", action="store_true",
                        help="forward loops read the masked states from a float16 copy")
    parser.add_argument("--per-sm", type=int, default=1,
                        help="programs a multiprocessor may hold (default 1)")
    parser.add_argument("--stages", type=int, default=3, help="load pipeline depth (default 3, the built-in)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100",
                        help="the GPU to compile and plan for (default h100: Hopper, H100 / H200)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.json and (why := unwritable(args.json)):  # said before measuring, not after
        parser.error(f"--json {args.json!r}: {why}")
    gpu = GPUS[args.gpu]
    if args.stages < 1:
        parser.error(f"--stages: expected a positive integer, got {args.stages}")
    if not 1 <= args.per_sm <= 4:
        parser.error(f"--per-sm: expected 1, 2, 3 or 4, got {args.per_sm}")
    if args.resident:
        persistent.tuning["resident"] = True
    if args.spread:
        persistent.tuning["spread"] = True
    if args.per_sm != 1:
        persistent.tuning["per_sm"] = args.per_sm
    if args.half_state:
        persistent.tuning["half_state"] = True
    print(f"Triton {triton.__version__}, {args.gpu}: sm_{gpu.capability}, {gpu.multiprocessors} "
          f"multiprocessors, {gpu.shared_per_program // 1024} KiB shared a program; tied masks, TF32, "
          f"{args.stages} pipeline stages (fewer where the loads would not fit, as a launch does)")
    rows = []
    for cell in ("lstm", "gru"):
        for hidden, batch in SHAPES:
            how = planned(hidden, batch, gpu.multiprocessors, cell)
            if how is None:
                print(f"{cell:4s} {hidden:5d} x {batch:<4d} the step kernel (no persistent plan)")
                continue
            for backward in (False, True):
                tiles = persistent._tiles(how, batch, hidden, backward)
                warps = persistent._warps(tiles["BB"], tiles["RESIDENT"])
                constexprs = loop_constexprs(cell, backward, tiles, hidden)
                integers = persistent._sizes(batch, hidden, 35 * batch)
                found = compile_fitting(cell, backward, constexprs, warps, args.stages, integers, gpu)
                row = {**dict(cell=cell, hidden=hidden, batch=batch, backward=backward, programs=how.grid,
                                 warps=warps, gpu=args.gpu), **tiles, **found}  # (the K block compiled)
                row["fit_per_sm"] = programs_per_multiprocessor(row["registers"], warps, row["shared"], gpu)
                rows.append(row)
                print(f"{cell:4s} {hidden:5d} x {batch:<4d} {'backward' if backward else 'forward '} "
                      f"{how.grid:3d} programs, rows {tiles['BB']:3d}, K {row['BK']:3d}, {warps} warps"
                      f"{', resident' if tiles['RESIDENT'] else ''}: {row['registers']:3d} registers, "
                      f"{row['spilled']:4d} bytes spilled, {row['shared'] // 1024:3d} KiB shared, loads "
                      f"{row['scalar']:3d} scalar / {row['vector']:3d} vector, {row['fit_per_sm']} fit a "
                      f"multiprocessor{stages_note(row['stages'], args.stages)}", flush=True)
    if args.json:
        write_json_atomic(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
