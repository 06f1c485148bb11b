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


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_persistent_tuning_refuses_without_cuda_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "persistent_tuning.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == "persistent_tuning.py: needs a CUDA GPU"
