"""Shared test helpers."""

import torch

from rnndrop.kernels.cuda_graphs import Captured


def assert_close(actual, expected, atol=1e-5, rtol=1e-5, msg=""):
    """Compare tensors, tuples of tensors or PackedSequences."""
    if hasattr(actual, "batch_sizes"):
        torch.testing.assert_close(actual.batch_sizes, expected.batch_sizes)
        actual, expected = actual.data, expected.data
    if isinstance(actual, (tuple, list)):
        assert len(actual) == len(expected), msg
        for a, e in zip(actual, expected):
            assert_close(a, e, atol, rtol, msg)
        return
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=msg or None)


class FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` where there is no GPU: ``replay()`` reruns the captured
    function on the captured inputs and writes into the captured outputs in place, as a replay does."""

    def __init__(self, fn, inputs, outputs):
        self.fn, self.inputs, self.outputs = fn, inputs, outputs
        self.replays = 0

    def replay(self):
        self.replays += 1
        for out, new in zip(self.outputs, self.fn(*self.inputs)):
            if out is not None:
                out.copy_(new)


def fake_capture(fn, inputs):
    """``rnndrop.kernels.cuda_graphs.capture_cuda_graph`` with a :class:`FakeGraph`."""
    static = [None if x is None else x.clone() for x in inputs]
    outputs = tuple(fn(*static))
    return Captured(FakeGraph(fn, static, outputs), static, outputs)
