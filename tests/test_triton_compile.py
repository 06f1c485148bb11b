"""The persistent loops compiled for a Hopper GPU on a machine without one (tests/triton_compile.py,
in a subprocess), and some of them for an A100 and a B200: every loop compiles, forward and
backward, streaming ``W_hh`` or keeping its tiles resident, in TF32 and in bfloat16; resident tiles
sit in shared memory before the time loop, no thread of a resident launch spills registers (8
warps), no launch loads a step ahead of the time loop on any of the three, and streaming loops load
rows in vectors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")))
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_compile.py")], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return {record["case"]: record for record in json.loads(result.stdout)}


def test_every_loop_compiles_forward_and_backward(compiled):
    assert len(compiled) == 43
    assert sum(case.endswith(("on sm_80", "on sm_100")) for case in compiled) == 6
    failed = {case: r["error"] for case, r in compiled.items() if not r["ok"]}
    assert failed == {}


def test_resident_tiles_are_in_shared_memory_before_the_time_loop(compiled):
    """One shared buffer per gate, filled once before the first step; none where W_hh streams."""
    for case, record in compiled.items():
        gates = 4 if case.startswith("lstm") else 3
        expected = gates if "resident" in case else 0
        assert record["tiles_before_loop"] == expected, case
        if "resident" in case:  # the tiles themselves, float32: K blocks of 256 (16 at hidden 16)
            block_k = 16 if "hidden 16" in case else 256
            assert record["shared"] >= gates * block_k * 16 * 4, case


def test_resident_tiles_spill_no_registers(compiled):
    """Resident launches take 8 warps and run their one block of ``K`` without a loop (no pipeline
    buffers): tiles and state then fit without spilling, tied or per-gate masks."""
    resident = {case: r["spilled"] for case, r in compiled.items() if "resident" in case}
    assert len(resident) == 12 and all(spilled == 0 for spilled in resident.values()), resident


def test_no_time_loop_loads_a_step_before_the_step_before_it_has_run(compiled):
    """No launch issues copies ahead of its first step: the pipeline Triton gives the innermost loop
    whose loads feed ``tl.dot`` (any precision) would otherwise be the time loop's wherever no
    loop runs inside a step (one program at hidden 16, tiles streamed or resident), reading the
    masked states of steps ``s + 1`` and ``s + 2`` before step ``s`` stores them (on an H200,
    bfloat16 outputs unrelated to the reference's at hidden 8 and 16). Where no loop runs inside a
    step (resident tiles; forward at hidden 16), no copy at all: a second time loop (the float16
    states' ``READ_HALF`` copy) would have its prologue after the first's. Streaming loops keep the
    pipeline of their loop over ``W_hh``."""
    ahead = {case: r["copies_before_loop"] for case, r in compiled.items() if r["copies_before_loop"]}
    assert ahead == {}
    stepless = {case: r["copies"] for case, r in compiled.items()
                if "resident" in case or ("forward hidden 16" in case)}
    assert len(stepless) == 18 and set(stepless.values()) == {0}, stepless
    unpipelined = {case for case, r in compiled.items() if "streaming" in case and r["copies"] == 0}
    assert unpipelined == set()


def test_the_threads_of_a_program_meet_after_every_step(compiled):
    """A barrier of the program's threads between a step's stores of the state (or ``dz``) and the
    next step's loads of it, with one program too (hidden 16: no grid barrier to wait at), where
    the compiler would otherwise order the threads only around its own uses of shared memory."""
    missing = {case for case, r in compiled.items() if r["barriers"] == 0}
    assert missing == set()
    assert {r["barriers"] for case, r in compiled.items() if "hidden 16" in case} == {1}


def test_a_pipeline_too_deep_for_a_gpu_is_compiled_as_deep_as_fits_there(compiled):
    """``kernel_resources.compile_fitting``, as a launch retries a depth whose shared memory the
    device refuses: four stages of a 128-row forward loop do not fit an RTX 4090's 99 KiB, three do."""
    record = compiled["lstm forward 128 rows, 4 stages asked, fitted to an RTX 4090"]
    assert record["stages"] == 3
    assert 64 * 1024 < record["shared"] <= 99 * 1024


def test_streaming_loops_load_rows_in_vectors(compiled):
    """At hidden 200 (``VEC`` 8: ``H = H_VEC · 8``) the loops that stream ``W_hh`` load its rows, the
    masked states and the gates mostly in vectors, not value by value (told only that 200 is not a
    multiple of 16, Triton loaded every one of them as a single 4-byte value); so do programs of
    fewer units than their tile (the lanes past their units moved past ``H``, not set to it)."""
    streaming = {case: (r["scalar"], r["vector"]) for case, r in compiled.items()
                 if "streaming" in case and "bfloat16" not in case}
    # programs of 12 units in tiles of 16, float16 states, and 128 rows on sm_80 / sm_100 too
    assert len(streaming) == 14
    assert all(vector > scalar for scalar, vector in streaming.values()), streaming


@pytest.mark.slow
def test_kernel_resources_reports_every_planned_launch(tmp_path):
    """benchmarks/kernel_resources.py: every shape of speed.py, both cells and passes, the launch
    persistent.plan picks on a 132-multiprocessor GPU, compiled, with registers and spills."""
    out = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    script = ROOT / "benchmarks" / "kernel_resources.py"
    done = subprocess.run([sys.executable, str(script), "--resident", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * 6 * 2  # cells x shapes x passes: every shape has a plan on that GPU
    resident = {(r["hidden"], r["RESIDENT"]) for r in rows}
    assert resident == {(200, True), (650, False), (1500, False)}
    assert all(r["registers"] > 0 and r["spilled"] >= 0 and r["shared"] > 0 for r in rows)
    assert all(r["vector"] > 0 for r in rows)  # every planned hidden size is even
    assert "bytes spilled" in done.stdout and "vector" in done.stdout
