"""Compile the persistent loops (rnndrop/kernels/persistent.py) for an NVIDIA GPU without one.

Triton lowers a kernel to PTX and assembles it with its own ``ptxas`` on any machine; only loading
the binary needs a GPU. So the CPU machine can catch what the interpreter cannot (a kernel the
compiler rejects: types that change around a loop, shapes ``tl.dot`` refuses) and read what the
compiler made of it: registers and spills (``ptxas -v``) and where shared memory is allocated.

Not collected: ``tests/test_triton_compile.py`` runs it in a subprocess (Triton's interpreter must
be off, and the compile cache in a folder of its own) and reads the JSON it prints: one record per
case, ``{"case", "ok", "error", "registers", "spilled", "shared", "tiles_before_loop"}``.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from rnndrop.kernels import persistent

#: Hopper, where the persistent loop has been measured (H100 / H200).
CAPABILITY = 90
#: Integer pointers among the loops' arguments (every other ``*_ptr`` holds float32 here).
INT_POINTERS = {"table_ptr", "counter_ptr"}


def signature(kernel, constexprs: dict) -> dict[str, str]:
    """Triton's signature of ``kernel``: ``*_ptr`` arguments are pointers, the rest ``i32``."""
    names = inspect.signature(kernel.fn).parameters
    return {
        name: "constexpr" if name in constexprs
        else ("*i32" if name in INT_POINTERS else "*fp32") if name.endswith("_ptr")
        else "i32"
        for name in names
    }


def registers_and_spills(ptx: str) -> tuple[int, int]:
    """``(registers a thread, bytes spilled)`` that ``ptxas -v`` reports for ``ptx``."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        ptxas = get_ptxas(CAPABILITY).path
        command = [ptxas, "-v", f"--gpu-name=sm_{CAPABILITY}a", source.name, "-o", "/dev/null"]
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


def cases() -> list[tuple[str, object, dict, int]]:
    """``(name, kernel, constexprs, warps)``: each loop, forward and backward, streaming ``W_hh``
    (tied masks, the built-in blocks of a 650 x 20 call) and with resident tiles (hidden 200: one
    K block of 256, 8 warps; tied and per-gate masks)."""
    found = []
    for cell, gates in (("lstm", 4), ("gru", 3)):
        for backward in (False, True):
            kernel = getattr(persistent, f"_{cell}_{'backward' if backward else 'forward'}")
            extra = dict(HAS_DOUT=True, NEED_DMASK=True) if backward else dict(SAVE=True)
            if cell == "gru" and not backward:
                extra["HAS_BIAS"] = True
            settings = (("streaming", 1, False, 32 if not backward else 64, 4),
                        ("resident", 1, True, 256, 8), ("resident per-gate", gates, True, 256, 8))
            for label, mask_gates, resident, block_k, warps in settings:
                constexprs = dict(MASK_GATES=mask_gates, HAS_MASK=True, SYNC=True, RESIDENT=resident,
                                  PRECISION="tf32", UPCAST=False, BB=16, BH=16, BK=block_k, **extra)
                name = f"{cell} {'backward' if backward else 'forward'} {label}"
                found.append((name, kernel, constexprs, warps))
    return found


def main() -> None:
    records = []
    for name, kernel, constexprs, warps in cases():
        record: dict = dict(case=name, ok=False, error=None)
        try:
            source = ASTSource(kernel, signature(kernel, constexprs), constexprs=constexprs)
            compiled = triton.compile(source, target=GPUTarget("cuda", CAPABILITY, 32),
                                      options=dict(num_warps=warps, num_stages=3))
            registers, spilled = registers_and_spills(compiled.asm["ptx"])
            record.update(ok=True, registers=registers, spilled=spilled, shared=compiled.metadata.shared,
                          tiles_before_loop=tiles_before_loop(compiled.asm["ttgir"]))
        except Exception as error:  # reported, not raised: the test names every case that failed
            record["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"
        records.append(record)
    json.dump(records, sys.stdout)


if __name__ == "__main__":
    main()
