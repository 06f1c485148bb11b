"""The layers' ``forward`` is typed as ``nn.LSTM``'s: a Tensor in gives a Tensor out, a
PackedSequence in a PackedSequence out, so ``lstm.forward(x)[0].shape`` type-checks. mypy
reads a user's code; where mypy is not installed the test is skipped."""

import subprocess
import sys
from pathlib import Path

import pytest

USE = '''
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pack_sequence
from typing_extensions import assert_type

from rnndrop import GaussianLSTM, SparseGRU, VariationalGRU, VariationalLSTM

x = torch.randn(5, 2, 3)
lstm = VariationalLSTM(3, 4)
out, (h_n, c_n) = lstm.forward(x)
assert_type(out, Tensor)
assert_type(h_n, Tensor)
print(out.shape, lstm(x)[0].shape)
assert_type(lstm.forward(pack_sequence([x[:, 0]]))[0], PackedSequence)
assert_type(lstm.forward(x, return_raw_output=True), tuple[Tensor, tuple[Tensor, Tensor], Tensor])
assert_type(GaussianLSTM(3, 4, dropout_hidden=0.2).forward(x)[0], Tensor)

gru = VariationalGRU(3, 4)
assert_type(gru.forward(x), tuple[Tensor, Tensor])
assert_type(gru.forward(pack_sequence([x[:, 0]]), masks=gru.sample_masks(1))[0], PackedSequence)
assert_type(SparseGRU(3, 4).forward(x)[1], Tensor)
'''


@pytest.mark.slow
def test_forward_types_follow_the_input_as_nn_lstms_do(tmp_path):
    pytest.importorskip("mypy")
    use = tmp_path / "use.py"
    use.write_text(USE)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent",
         "--cache-dir", str(tmp_path / "cache"), str(use)],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 0, done.stdout + done.stderr
