"""benchmarks/speed.py as a user runs it: progress on stderr, Ctrl-C in one line."""

import json
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
@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "timeout"])
def test_ctrl_c_stops_speed_with_one_line(tmp_path, sent):
    process = subprocess.Popen([sys.executable, str(SCRIPT), *SMALL, "--rounds", "100000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=ctrl_c_reaches)
    for line in process.stderr:
        if "rounds, up to about" in line:
            break
    process.send_signal(sent)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130
    assert "Traceback" not in err and err.strip().endswith("the others were not timed")


HOST_COST = SCRIPT.parent / "host_cost.py"
LAYERS_TIMED = 2  # host_cost.LAYERS: one batched forward product a layer


def test_host_cost_times_the_triton_path_on_the_cpu_with_launches_skipped(tmp_path):
    """benchmarks/host_cost.py: both cells with tied masks and the LSTM with per-gate masks (the
    batched projection CUDA runs: no product per gate), a forward and a training step timed, the
    ops a step issues counted (views apart); a bad --rounds is one line and exit code 2."""
    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, str(HOST_COST), "--rounds", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "launches skipped" in done.stdout and "training step" in done.stdout
    rows = json.loads(out.read_text())
    kinds = [(r["cell"], r["masks"]) for r in rows]
    assert kinds == [("lstm", "tied"), ("gru", "tied"), ("lstm", "per-gate")]
    for row in rows:
        assert row["mc_sample_us"] > 0 and 0 < row["forward_us"] < row["step_us"]
        assert row["ops"] > 20 and row["views"] > 0 and row["by_op"]["aten::rand"] == 1
        assert not any(name in row["by_op"] for name in ("aten::view", "aten::t", "aten::empty"))
    assert rows[2]["by_op"]["aten::baddbmm"] == LAYERS_TIMED and "aten::addmm" not in rows[2]["by_op"]
    bad = subprocess.run([sys.executable, str(HOST_COST), "--rounds", "0"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "--rounds: expected a positive integer, got 0" in bad.stderr
    assert "Traceback" not in bad.stderr


TRITON_LAUNCH = SCRIPT.parent / "triton_launch_cost.py"


def test_triton_launch_cost_times_tritons_launch_path_with_a_stand_in_gpu(tmp_path):
    """benchmarks/triton_launch_cost.py: Triton's launch path for a persistent forward launch, the
    launcher call alone and the whole forward, timed with a stand-in driver (no GPU), or with a
    Triton whose internals differ from those it stands in for (checked: 3.6, 3.9) one line saying so;
    a bad --calls is one line and exit code 2, and so is running it under Triton's interpreter."""
    triton = pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "launch.json"
    done = subprocess.run([sys.executable, str(TRITON_LAUNCH), "--rounds", "1", "--calls", "20", "--json",
                           str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    if triton.__version__.split(".")[:2] not in (["3", "6"], ["3", "9"]) and done.returncode == 2:
        assert done.stderr.strip().startswith(f"triton_launch_cost.py: Triton {triton.__version__}'s launch")
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
        return
    assert done.returncode == 0, done.stderr
    assert "Triton's launch path" in done.stdout and "the launcher call alone" in done.stdout
    row = json.loads(out.read_text())
    assert row["arguments"] > 30
    assert 0 < row["launcher_alone_us"] < row["triton_path_us"] < row["lstm_forward_us"]
    bad = subprocess.run([sys.executable, str(TRITON_LAUNCH), "--calls", "0"], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path, env=env)
    assert bad.returncode == 2 and "--calls: expected a positive integer, got 0" in bad.stderr
    interpreted = subprocess.run([sys.executable, str(TRITON_LAUNCH)], capture_output=True, text=True,
                                 timeout=120, cwd=tmp_path, env=dict(env, TRITON_INTERPRET="1"))
    assert interpreted.returncode == 2 and "Traceback" not in interpreted.stderr
    assert interpreted.stderr.strip() == "triton_launch_cost.py: unset TRITON_INTERPRET (it times Triton's " \
        "compiled-kernel launch path)"
