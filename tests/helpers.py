"""Shared test helpers."""

import torch


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
