"""The loop kernels' float32 mode on CUDA follows cuDNN's switch for RNNs, the one nn.LSTM follows
(rnndrop.kernels.precision), read through either of torch's APIs and put back after each block.
The flags are process-wide: each test sets them by assignment and restores them the same way
(torch's switch modules answer through __getattr__, which monkeypatch cannot restore)."""

from types import SimpleNamespace

import pytest
import torch

from rnndrop.kernels.precision import cudnn_rnn_tf32, matmul_precision, products_as_cudnn

CUDA_FLOAT32 = SimpleNamespace(is_cuda=True, dtype=torch.float32)  # what the block looks at


@pytest.fixture
def flags():
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("cudnn", [True, False])
def test_cudnn_rnn_tf32_reads_the_legacy_switch_and_the_rnn_entry(flags, cudnn):
    torch.backends.cudnn.allow_tf32 = cudnn
    assert cudnn_rnn_tf32() is cudnn
    if hasattr(torch.backends.cudnn, "rnn"):
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "tf32"  # convolutions apart: the legacy getter raises
        assert cudnn_rnn_tf32() is False
        torch.backends.cudnn.rnn.fp32_precision = "tf32"
        assert cudnn_rnn_tf32() is True


def test_the_block_runs_cublas_in_tf32_where_cudnn_would_and_puts_the_switch_back(flags):
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    with products_as_cudnn(CUDA_FLOAT32):
        assert matmul_precision() == "tf32"
    assert matmul_precision() == "ieee" and torch.backends.cuda.matmul.allow_tf32 is False


@pytest.mark.parametrize("case", ["cpu tensor", "float64", "cuDNN in IEEE", "cuBLAS set to TF32 by the user"])
def test_the_block_changes_nothing_elsewhere(flags, case):
    like = CUDA_FLOAT32
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    if case == "cpu tensor":
        like = torch.ones(1)
    elif case == "float64":
        like = SimpleNamespace(is_cuda=True, dtype=torch.float64)
    elif case == "cuDNN in IEEE":
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.backends.cuda.matmul.allow_tf32 = True
    before = matmul_precision()
    with products_as_cudnn(like):
        assert matmul_precision() == before
    assert matmul_precision() == before


def test_the_switch_is_put_back_when_the_block_raises(flags):
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    with pytest.raises(KeyError), products_as_cudnn(CUDA_FLOAT32):
        raise KeyError("inside")
    assert matmul_precision() == "ieee"


@pytest.mark.skipif(not hasattr(torch.backends.cudnn, "rnn"), reason="torch < 2.9: no precision API")
def test_the_direct_reads_agree_with_torchs_properties(flags):
    """The two readers call torch's precision getter directly; they answer as the properties would,
    whichever of the RNN entry, cuDNN's, cuBLAS's and the global one is set."""
    cudnn, generic, matmul = torch.backends.cudnn, torch.backends, torch.backends.cuda.matmul
    before = cudnn.rnn.fp32_precision, cudnn.fp32_precision, generic.fp32_precision, matmul.fp32_precision
    try:
        for rnn in ("none", "tf32", "ieee"):
            for everything in ("none", "tf32", "ieee"):
                for default in ("tf32", "ieee"):
                    for products in ("none", "tf32", "ieee"):
                        generic.fp32_precision = default
                        cudnn.fp32_precision, cudnn.rnn.fp32_precision = everything, rnn
                        matmul.fp32_precision = products
                        modes = [m for m in (cudnn.rnn.fp32_precision, cudnn.fp32_precision,
                                             generic.fp32_precision) if m != "none"]
                        assert cudnn_rnn_tf32() is (modes[:1] == ["tf32"])
                        cublas = matmul.fp32_precision
                        assert matmul_precision() == (cublas if cublas != "none" else generic.fp32_precision)
    finally:
        (cudnn.rnn.fp32_precision, cudnn.fp32_precision, generic.fp32_precision,
         matmul.fp32_precision) = before
