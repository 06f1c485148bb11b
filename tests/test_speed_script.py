"""benchmarks/speed.py as a user runs it: progress on stderr, Ctrl-C in one line."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lm_helpers import ctrl_c_reaches

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "speed.py"
SMALL = ["--shapes", "small", "--models", "gru", "--kernels", "manual", "--warmup", "1", "--no-memory",
         "--batch", "2", "--seq-len", "3", "--layers", "1", "--threads", "1"]


@pytest.mark.slow
def test_speed_says_what_it_times_and_how_long(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), *SMALL, "--rounds", "3"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "[1/1] gru small (hidden 200, batch 2): " in done.stderr and " rounds, up to about " in done.stderr
    assert "x base" in done.stdout and "nn.GRU" in done.stdout


@pytest.mark.slow
def test_ctrl_c_stops_speed_with_one_line(tmp_path):
    process = subprocess.Popen([sys.executable, str(SCRIPT), *SMALL, "--rounds", "100000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=ctrl_c_reaches)
    for line in process.stderr:
        if "rounds, up to about" in line:
            break
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130
    assert "Traceback" not in err and err.strip().endswith("the others were not timed")
