"""Compile the persistent loops (rnndrop/kernels/persistent.py) for an NVIDIA GPU without one, with
the machinery of ``benchmarks/kernel_resources.py`` (Triton lowers to PTX and assembles it with its
own ``ptxas`` on any machine; only loading the binary needs a GPU). So the CPU machine catches what
the interpreter cannot (a kernel the compiler rejects: types that change around a loop, shapes
``tl.dot`` refuses) and reads what the compiler made of it.

Not collected: ``tests/test_triton_compile.py`` runs it in a subprocess (Triton's interpreter must
be off, and the compile cache in a folder of its own) and reads the JSON it prints: one record per
case, ``{"case", "ok", "error", "registers", "spilled", "shared", "tiles_before_loop", "barriers",
"copies_before_loop", "copies", "scalar", "vector"}`` (and ``"stages"``, ``"BK"`` for
:data:`FITTED`, compiled as deep as fits a smaller GPU).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_resources.py"
_spec = importlib.util.spec_from_file_location("kernel_resources", _PATH)
resources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(resources)


#: GPUs other than Hopper's the loops are compiled for too: an A100 (cp.async copies, ``mma.sync``)
#: and a B200 (products of 128 rows on its fifth-generation tensor cores, ``tcgen05``).
OTHER_CAPABILITIES = (80, 100)


def cases() -> list[tuple[str, str, bool, dict, int, int, str, dict, int]]:
    """``(name, cell, backward, tiles, mask gates, hidden, dtype, settings, capability)``, ``settings`` the
    compile-time arguments that differ from a training launch's: each loop, forward and backward,
    streaming ``W_hh`` (tied masks, blocks of 16 rows and units, K blocks of 32 forward and 64
    backward; and programs of 12 units in tiles of 16, ``persistent.SPREAD``) and with resident
    tiles (hidden 200: one K block of 256; tied and per-gate masks); the forward loops reading the
    masked states from a float16 copy (``persistent.HALF_STATE``, tied and per-gate masks); and
    hidden 16 as ``persistent.plan`` launches it for a batch of 16 or fewer, one program (no barrier to
    spin at), whose one K block of 16 the compiler knows (``H_VEC`` 1), tiles streamed or resident:
    no loop inside a step. Products in TF32, and in bfloat16 (autocast's loads and ``tl.dot``, which
    the interpreter runs upcast to float32) streaming at hidden 200 and at hidden 16. All for Hopper
    (sm_90); and for each of :data:`OTHER_CAPABILITIES` the LSTM's loops at hidden 16 in one program
    and its forward loop streaming blocks of 128 rows (8 warps), where each generation's compiler
    lowers the products its own way."""
    found = []
    for cell, gates in (("lstm", 4), ("gru", 3)):
        for backward in (False, True):
            direction = "backward" if backward else "forward"
            streamed = dict(BB=16, BH=16, BK=64 if backward else 32, RESIDENT=False, UNITS=16)
            resident = dict(streamed, BK=256, RESIDENT=True)
            one_block = dict(streamed, BK=16)  # hidden 16
            one_program = dict(SYNC=False)  # no grid barrier
            for label, tiles, mask_gates, hidden, dtype, settings in (
                    ("streaming", streamed, 1, 200, "fp32", {}), ("resident", resident, 1, 200, "fp32", {}),
                    ("resident per-gate", resident, gates, 200, "fp32", {}),
                    ("streaming spread", dict(streamed, UNITS=12), 1, 200, "fp32", {}),
                    ("streaming bfloat16", streamed, 1, 200, "bf16", {}),
                    ("hidden 16", one_block, 1, 16, "fp32", one_program),
                    ("hidden 16 resident", dict(one_block, RESIDENT=True), 1, 16, "fp32", one_program),
                    ("hidden 16 bfloat16", one_block, 1, 16, "bf16", one_program)):
                name = f"{cell} {direction} {label}"
                found.append((name, cell, backward, tiles, mask_gates, hidden, dtype, settings,
                              resources.CAPABILITY))
        for label, mask_gates in (("streaming float16 states", 1),
                                  ("streaming float16 states per-gate", gates)):
            tiles = dict(BB=16, BH=16, BK=32, RESIDENT=False, UNITS=16)
            found.append((f"{cell} forward {label}", cell, False, tiles, mask_gates, 200, "fp32",
                          dict(HALF_STATE=True), resources.CAPABILITY))
    for capability in OTHER_CAPABILITIES:
        one_block = dict(BB=16, BH=16, BK=16, RESIDENT=False, UNITS=16)
        rows_128 = dict(BB=128, BH=16, BK=64, RESIDENT=False, UNITS=16)
        for name, backward, tiles, hidden, settings in (
                ("lstm forward hidden 16", False, one_block, 16, dict(SYNC=False)),
                ("lstm backward hidden 16", True, one_block, 16, dict(SYNC=False)),
                ("lstm forward streaming 128 rows", False, rows_128, 200, {})):
            found.append((f"{name} on sm_{capability}", "lstm", backward, tiles, 1, hidden, "fp32", settings,
                          capability))
    return found


def compile_case(cell: str, backward: bool, tiles: dict, mask_gates: int, hidden: int, dtype: str,
                 settings: dict, capability: int) -> dict:
    """What ``kernel_resources.compile_loop`` reports of one case of :func:`cases` (training's
    compile-time arguments with the mask's gradient written, then the case's ``settings``)."""
    constexprs = resources.loop_constexprs(cell, backward, tiles, hidden, mask_gates)
    if backward:
        constexprs["NEED_DMASK"] = True  # the mask's gradient written too
    constexprs.update(settings)
    if dtype != "fp32":
        constexprs["PRECISION"] = "ieee"  # what persistent._precision gives half types
    warps = resources.persistent._warps(tiles["BB"], tiles["RESIDENT"])
    return resources.compile_loop(cell, backward, constexprs, warps, dtype=dtype, capability=capability)


def main() -> None:
    records = [record(name, functools.partial(compile_case, *case)) for name, *case in cases()]
    records.append(record(FITTED, fitted_to_a_smaller_gpu))
    json.dump(records, sys.stdout)


def record(case: str, compiled: Callable[[], dict]) -> dict:
    """``case``'s record: what ``compiled()`` reports, or the error it raised (reported, not raised:
    the test names every case that failed)."""
    try:
        return dict(case=case, ok=True, error=None, **compiled())
    except Exception as error:
        return dict(case=case, ok=False,
                    error=f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}")


#: The case :func:`fitted_to_a_smaller_gpu` compiles.
FITTED = "lstm forward 128 rows, 4 stages asked, fitted to an RTX 4090"


def fitted_to_a_smaller_gpu() -> dict:
    """:data:`FITTED`: ``kernel_resources.compile_fitting`` for an RTX 4090 (99 KiB of shared memory
    a program) of a forward loop of 128 rows whose four-stage pipeline would take more (three
    stages: 96 KiB there), with the ``stages`` it kept."""
    tiles = dict(BB=128, BH=16, BK=64, RESIDENT=False, UNITS=16)
    constexprs = resources.loop_constexprs("lstm", False, tiles, 200)
    return resources.compile_fitting("lstm", False, constexprs, 8, 4, {}, resources.GPUS["rtx4090"])


if __name__ == "__main__":
    main()
