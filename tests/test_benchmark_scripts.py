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
])
def test_a_wrong_argument_is_one_line(tmp_path, argv, message):
    argv = [a.format(out=tmp_path / "out", missing=tmp_path / "missing") for a in argv]
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr and message in last, done.stderr
    assert not (tmp_path / "out").exists()
