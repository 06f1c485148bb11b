"""The layers' ``forward`` is typed as ``nn.LSTM``'s: a Tensor in gives a Tensor out, a
PackedSequence in a PackedSequence out, so ``lstm.forward(x)[0].shape`` type-checks. mypy
reads a user's code; where mypy is not installed the test is skipped."""

import subprocess
import sys
from pathlib import Path

import pytest

#: A user's code using the public API (also type-checked by .ci/run).
USE = Path(__file__).resolve().parent / "typing_checks" / "public_api.py"


@pytest.mark.slow
def test_forward_types_follow_the_input_as_nn_lstms_do(tmp_path):
    pytest.importorskip("mypy")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
         "--cache-dir", str(tmp_path / "cache"), str(USE)],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
