"""A user's code, type-checked by mypy (tests/test_typing.py, and .ci/run): the public API must
check clean, and ``forward`` is typed as nn.LSTM's (a Tensor in gives a Tensor out, a
PackedSequence in a PackedSequence out). Not a test module: pytest does not collect it."""

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence
from typing_extensions import assert_type

import rnndrop
import rnndrop.distributed
from rnndrop import GaussianLSTM, SparseGRU, VariationalGRU, VariationalLSTM

x = torch.randn(5, 2, 3)
lstm = VariationalLSTM(3, 4, dropout_hidden=0.3)
out, (h_n, c_n) = lstm.forward(x)
assert_type(out, Tensor)
assert_type(h_n, Tensor)
print(out.shape, lstm(x)[0].shape)
assert_type(lstm.forward(pack_sequence([x[:, 0]]))[0], PackedSequence)
assert_type(lstm.forward(x, return_raw_output=True), tuple[Tensor, tuple[Tensor, Tensor], Tensor])
assert_type(lstm.forward(x, masks=lstm.sample_masks(2))[1], tuple[Tensor, Tensor])
assert_type(GaussianLSTM(3, 4, dropout_hidden=0.2).forward(x)[0], Tensor)

gru = VariationalGRU(3, 4)
assert_type(gru.forward(x), tuple[Tensor, Tensor])
assert_type(gru.forward(pack_sequence([x[:, 0]]), masks=gru.sample_masks(1))[0], PackedSequence)
assert_type(SparseGRU(3, 4).forward(x)[1], Tensor)

# deployment and distributed helpers
assert_type(lstm.to_plain(), nn.RNNBase)
assert_type(rnndrop.to_torch(lstm), nn.Module)
assert_type(rnndrop.distributed.seed_noise_per_rank(0), int)
rnndrop.distributed.auto_noise_per_rank(True)

# torch.compile with the layers traced
compiled = rnndrop.compile_model(lstm, mode=None)
assert_type(compiled, rnndrop.CompiledModel)
assert_type(compiled.module, nn.Module)
assert_type(compiled.compiled, bool)
assert_type(compiled.failure, str | None)
assert_type(rnndrop.compiling.speeds_up_under_compile(lstm, "cuda"), bool)
assert_type(lstm.trains_in_loop(), bool)
