"""The benchmark scripts besides speed.py (tests/test_speed_benchmark.py), and ``python -m
rnndrop.kernels``: a wrong argument is one line and exit status 2, checked before anything is
written or built (they were tracebacks, an empty run folder, or a build that ignored them)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("argv", "message"), [
    (["benchmarks/ddp_speed.py", "sample", "{out}", "--threads", "0"], "--threads: expected a positive"),
    (["benchmarks/ddp_speed.py", "sample", "{out}", "--regime", "bogus"], "regime must be one of"),
    (["benchmarks/ddp_speed.py", "{missing}", "{out}"], "does not exist"),
    (["benchmarks/sparse_vd.py", "--data", "x", "--dense", "x", "--threads", "0"], "positive integers"),
    (["benchmarks/sparse_vd.py", "--data", "x", "--dense", "x", "--kl-weights", "abc"],
     "--kl-weights: expected comma-separated numbers, got 'abc'"),
    (["benchmarks/sparse_vd.py", "--data", "x", "--dense", "x", "--thresholds", "1,nan"],
     "--thresholds: expected comma-separated numbers, got '1,nan'"),
    (["-m", "rnndrop.kernels", "--bogus"], "unrecognized arguments: --bogus"),
    # an output that cannot be written: said before measuring or training (a traceback after it)
    (["benchmarks/ddp_speed.py", "sample", "{a_file}/runs"], "out '{a_file}/runs': '{a_file}' is a file"),
    (["benchmarks/speed.py", "--json", "{a_file}/x.json"], "--json '{a_file}/x.json': '{a_file}' is a file"),
    (["benchmarks/host_cost.py", "--json", "{out}"], "--json '{out}': it is a folder, expected a file"),
    (["benchmarks/kernel_resources.py", "--json", "{a_file}/k.json"], "is a file, not a folder"),
    (["benchmarks/triton_launch_cost.py", "--json", "{a_file}/t.json"], "is a file, not a folder"),
])
def test_a_wrong_argument_is_one_line(tmp_path, argv, message):
    names = {"out": tmp_path / "out", "missing": tmp_path / "missing", "a_file": tmp_path / "a_file"}
    names["a_file"].write_text("")
    if "{out}" in argv[-1] and "--json" in argv:  # a folder where a file is expected
        names["out"].mkdir()
    argv, message = [a.format(**names) for a in argv], message.format(**names)
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr and message in last, done.stderr
    assert "--json" in argv or not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["host_cost.py", "kernel_resources.py", "persistent_tuning.py"])
def test_a_script_written_in_triton_says_so_in_one_line_where_triton_is_missing(script):
    """--help too raised ModuleNotFoundError: Triton is the [gpu] extra, not the CPU install's.
    ``python -S`` finds no site-packages (the check comes before torch is imported)."""
    done = subprocess.run([sys.executable, "-S", f"benchmarks/{script}", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    expected = f"{script}: needs Triton (the [gpu] extra): pip install triton\n"
    assert done.returncode == 1 and done.stderr == expected
