"""The GPU machine's scripts as far as a machine without a GPU can check them: gpu_check.sh parses
and defines every section its header names; persistent_tuning.py refuses in one line without CUDA."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "gpu_check.sh"


def test_gpu_check_parses_and_defines_every_section_its_header_names():
    subprocess.run(["bash", "-n", str(CHECK)], check=True)
    text = CHECK.read_text()
    header = " ".join(line for line in text.splitlines()[:10] if line.startswith("#"))
    named = set(re.search(r"some of them: (.*)", header, re.S).group(1).replace("#", " ").split())
    defined = set(re.findall(r"^(\w+)\(\) \{", text, re.M))
    assert named <= defined, f"named in the header but not defined: {named - defined}"
    assert {"speed", "tuning", "projection", "host_profile", "lms"} <= named
    known = set(re.search(r'^known=" (.*) "$', text, re.M).group(1).split())
    assert known == named, f"sections it runs {sorted(known)} but names {sorted(named)}"


@pytest.mark.parametrize(("args", "env", "message"), [
    (["speeed"], {}, "unknown section 'speeed' (sections: machine checks"),  # was run as a command
    (["machine uname"], {}, "unknown section 'uname'"),
    (["machine"], {"DEADLINE": "9m"}, "DEADLINE must be whole seconds, got '9m'"),  # arithmetic errors
    (["machine"], {"BUNDLE": "{out}/gpu.tgz"}, "BUNDLE must be outside OUT"),  # tar read its own file
])
def test_gpu_check_refuses_what_it_cannot_run_before_any_step(tmp_path, args, env, message):
    out = tmp_path / "out"
    env = {k: v.format(out=out) for k, v in env.items()}
    done = subprocess.run(["bash", str(CHECK), *args], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": "false", **env})
    said = done.stdout + done.stderr  # the sections are checked where the console goes to console.log too
    assert done.returncode == 2 and message in said and "===" not in said, said


def test_gpu_check_ends_with_status_0_without_a_bundle_and_sums_up_only_this_calls_lm_runs(tmp_path):
    """The last line failed without BUNDLE (status 1 after every step ran); an LM run's summary
    read every results.json its folder held, an earlier call's when this one's run failed."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\ncase "$*" in *"sys.exit(main())"*) exit 2;; esac\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    stale = tmp_path / "runs" / "gpu-medium" / "none" / "seed-1"
    stale.mkdir(parents=True)
    (stale / "results.json").write_text('{"words_per_second": 12345, "best_valid_ppl": 99.0, '
                                        '"peak_memory_bytes": 0}')
    (stale / "metrics.csv").write_text("epoch,words_per_second\n1,11111\n")
    done = subprocess.run(["bash", str(CHECK), "lms"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                                            "PYTHON": str(python), "LMS": "medium:zaremba-medium:none::1"})
    assert done.returncode == 0 and "=== done" in done.stdout, done.stdout + done.stderr
    assert "12345" not in done.stdout and not stale.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_persistent_tuning_refuses_without_cuda_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "persistent_tuning.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == "persistent_tuning.py: needs a CUDA GPU"


@pytest.fixture
def tuning():
    """benchmarks/persistent_tuning.py as a module."""
    import importlib.util

    script = ROOT / "benchmarks" / "persistent_tuning.py"
    spec = importlib.util.spec_from_file_location("persistent_tuning", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_persistent_tuning_names_the_fastest_setting_of_each_case(tuning):
    """The sweep's last lines: per case the built-in rule's time, the fastest setting and the ratio."""

    def row(us, built_in=False, **setting):
        base = dict(units=16, row_blocks=1, block_k=None, warps=None, resident=False, stages=None,
                    vector=None)
        return dict(cell="lstm", hidden=1500, batch=20, built_in=built_in, us_per_step=us,
                    **{**base, **setting})

    lines = tuning.best_settings([row(39.5, built_in=True), row(30.0, units=12), row(41.0, vector=1),
                                  dict(row(8.0, built_in=True), hidden=200)])
    assert lines[1].split() == ["lstm", "tied", "1500", "20", "built-in", "39.5", "fastest", "30.0",
                                "(0.76x):", "units", "12,", "row_blocks", "1"]
    assert lines[2].endswith("fastest    8.0 (1.00x): built-in")


def test_a_setting_whose_launch_is_refused_is_one_line_and_the_sweep_goes_on(tuning, capsys, monkeypatch):
    """CUDA refused a setting's cooperative launch (the sixth round: two programs a multiprocessor,
    650 x 128), so the loop returned no result: the line says so (it said "cannot unpack
    non-iterable NoneType"), and the device is not left to the step kernel for later settings."""
    from rnndrop.kernels import persistent

    monkeypatch.setattr(persistent, "_given_up", set())
    monkeypatch.setattr(persistent, "plan", lambda *args, **kwargs: persistent.Launch(1, 16))
    monkeypatch.setattr(persistent, "lstm_forward",
                        lambda *args, **kwargs: persistent._given_up.add("cuda:0"))  # refused: None
    cpu = torch.device("cpu")
    inputs = tuning.loop_inputs("lstm", 16, 2, cpu)
    assert tuning.time_setting("lstm", "tied", 16, 2, {"per_sm": 2}, inputs, set(), cpu) is None
    line = capsys.readouterr().out
    assert line.count("\n") == 1
    assert "RuntimeError: the persistent loop did not run this launch (refused" in line
    assert not persistent._given_up


def test_persistent_tuning_keeps_the_rows_timed_when_its_time_limit_stops_it(tuning, tmp_path, monkeypatch):
    """gpu_check.sh's `timeout` stops the sweep (SIGTERM, raised as KeyboardInterrupt): the rows timed
    so far are in --json and their fastest settings printed."""
    import json

    row = dict(cell="lstm", masks="tied", hidden=200, batch=20, built_in=True, us_per_step=7.4, units=16)

    def sweep(device, cell, per_gate):
        yield row
        yield dict(row, built_in=False, us_per_step=7.0, units=8)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
    monkeypatch.setattr(tuning, "sweep", sweep)
    monkeypatch.setattr(tuning, "host_and_gpu", lambda device: pytest.fail("not reached"))
    out = tmp_path / "tuning.json"
    assert tuning.main(["--json", str(out)]) == 130
    saved = json.loads(out.read_text())
    assert len(saved["sweep"]) == 2 and not saved["complete"] and saved["host_and_gpu"] is None


def test_gpu_check_cuts_its_steps_to_the_deadline_and_bundles_what_it_wrote(tmp_path):
    """With DEADLINE a lease's one call ends in time: a step's limits are cut to what is left, a step
    with under 30 s left is skipped and says so (``lease2``: the second call's steps), and BUNDLE
    packs $OUT into one file."""
    limit = re.search(r"^limit\(\) \{.*?^\}", CHECK.read_text(), re.M | re.S).group(0)
    cut = subprocess.run(["bash", "-c", f"{limit}\nDEADLINE=100; SECONDS=70; limit 240; limit 20; "
                          "SECONDS=120; limit 60; DEADLINE=; limit 240"],
                         capture_output=True, text=True, check=True)
    assert cut.stdout.split() == ["30", "20", "1", "240"]
    out, bundle = tmp_path / "out", tmp_path / "gpu.tgz"
    done = subprocess.run(["bash", str(CHECK), "checks lease2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(out), "DEADLINE": "20",
                                           "BUNDLE": str(bundle), "PYTHON": "false"})
    assert re.search(r"checks skipped: (19|20) s left before DEADLINE=20", done.stdout), done.stdout
    assert all(f"=== {name} skipped" in done.stdout for name in ("mc_compile", "lengths", "tuning"))
    assert "=== done" in done.stdout
    assert bundle.is_file() and bundle.stat().st_size > 0
    first = subprocess.run(["bash", str(CHECK), "lease1"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, env={"PATH": "/usr/bin:/bin", "OUT": str(out), "DEADLINE": "0",
                                            "PYTHON": "false"})
    steps = re.findall(r"^=== (\w+) skipped", first.stdout, re.M)
    assert steps == ["machine", "checks", "tests", "speed", "compile"], first.stdout


def test_gpu_check_bundles_after_every_step_so_a_call_cut_short_returns_what_it_did(tmp_path):
    """The lease's own time limit may kill the call in the middle of a step: the bundle written
    after the step before holds that step's output, and the console's lines (console.log)."""
    import os
    import signal
    import tarfile
    import time

    python = tmp_path / "python"
    python.write_text('#!/bin/sh\ncase "$*" in *persistent_tuning*) sleep 60;; esac\necho "fake python $1"\n')
    python.chmod(0o755)
    out, bundle = tmp_path / "out", tmp_path / "gpu.tgz"
    process = subprocess.Popen(["bash", str(CHECK), "machine tuning"], cwd=ROOT, stdout=subprocess.PIPE,
                               text=True, start_new_session=True,
                               env={"PATH": "/usr/bin:/bin", "OUT": str(out), "BUNDLE": str(bundle),
                                    "PYTHON": str(python)})
    try:
        for line in process.stdout:
            if line.startswith("=== the persistent loop's"):
                break
        deadline = time.monotonic() + 20
        while not bundle.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with tarfile.open(bundle) as packed:
        console = packed.extractfile("./console.log").read().decode()
    assert "=== machine" in console and "fake python -c" in console
    assert not (tmp_path / "gpu.tgz.part").exists()


def test_lengths_trains_awd_on_a_generated_corpus_compiled_and_eagerly(tmp_path):
    """``lengths``: a corpus of 400k generated words in PTB's layout (enough segments for some 35
    truncated-BPTT lengths), then two AWD runs of rnndrop-lm on it, the default (compiled on CUDA)
    and ``--no-compile``; the LM calls are recorded by a stand-in python, the corpus is written by
    the real one."""
    calls = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-" ]; then exec {sys.executable} "$@"; fi\n'
                      f'echo "$@" >> {calls}\n')
    python.chmod(0o755)
    done = subprocess.run(["bash", str(CHECK), "lengths"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"),
                                            "PYTHON": str(python)})
    assert "=== done" in done.stdout, done.stdout + done.stderr
    corpus = tmp_path / "runs" / "gpu-lengths-data"
    assert 400_000 <= len((corpus / "ptb.train.txt").read_text().split()) < 400_030
    assert len(set((corpus / "ptb.valid.txt").read_text().split())) > 5000
    trained = [line for line in calls.read_text().splitlines() if "sys.exit(main())" in line]
    assert len(trained) == 2 and all("--data runs/gpu-lengths-data" in line and "--config awd --regimes tied"
                                     in line and "--device cuda" in line for line in trained)
    assert "--no-compile" not in trained[0] and trained[1].endswith("--no-compile")
