"""CUDA-graph capture and replay of the Triton loops (rnndrop/kernels/cuda_graphs.py): the cache's
keys, its bound, the copies in and out, and the eager fallback, on CPU with a stand-in graph
(tests.helpers.FakeGraph); a real capture where there is a GPU. The Triton kernels through the
cache: tests/triton_checks.py."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rnndrop.kernels import cuda_graphs
from rnndrop.kernels.cuda_graphs import GraphCache, capture_cuda_graph, set_max_graphs
from tests.helpers import fake_capture

ROOT = Path(__file__).resolve().parents[1]


class Counted:
    """A loop stand-in, ``(a, b) -> (2 a + b, None)``, that counts its eager calls and captures."""

    def __init__(self, max_graphs=8, fail=False):
        self.calls = self.captures = 0
        self.fail = fail
        self.cache = GraphCache(max_graphs, capture=self.capture, can_capture=lambda inputs: True)

    def fn(self, a, b):
        self.calls += 1
        return a * 2 + (0 if b is None else b), None

    def capture(self, fn, inputs):
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return fake_capture(fn, inputs)

    def __call__(self, key, a, b=None, capturable=True):
        return self.cache(key, self.fn, (a, b), capturable=capturable)


def test_first_call_eager_second_captures_later_ones_replay():
    loop = Counted()
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    assert loop("k", a, b)[0].equal(a * 2 + b) and loop.captures == 0
    second = loop("k", a + 1, b)[0]
    assert second.equal((a + 1) * 2 + b) and loop.captures == 1
    calls = loop.calls
    third, none = loop("k", a - 1, b)
    assert third.equal((a - 1) * 2 + b) and none is None
    assert loop.captures == 1 and loop.calls == calls + 1  # the one call is the replay's
    assert second.equal((a + 1) * 2 + b)  # a copy: the replay did not overwrite it
    (graph,) = loop.cache.graphs.values()
    assert graph.graph.replays == 2 and graph.outputs[0] is not third


def test_keys_tell_shapes_dtypes_absent_inputs_and_the_callers_key_apart():
    loop = Counted()
    a = torch.randn(3, 4)
    variants = [("k", a), ("k", a.double()), ("k", torch.randn(2, 4)), ("k", a.t().contiguous().t()),
                ("other", a), ("k", a, torch.ones(3, 4))]
    for args in variants * 2:
        loop(*args)
    assert loop.captures == len(variants) == len(loop.cache.graphs)


def test_switching_tf32_is_a_new_key_not_a_replay_of_the_other_mode(monkeypatch):
    """A graph replays the cuBLAS kernels it captured: after the float32 product mode changes, the
    loop runs eagerly (then captures) in the new mode instead of replaying the old one."""
    mode = ["ieee"]
    monkeypatch.setattr(cuda_graphs, "matmul_precision", lambda: mode[0])
    loop = Counted()
    a = torch.randn(3, 4)
    loop("k", a), loop("k", a)
    assert loop.captures == 1
    mode[0] = "tf32"
    loop("k", a)
    assert loop.captures == 1  # eager: the first call in this mode
    loop("k", a)
    assert loop.captures == 2 and len(loop.cache.graphs) == 2


# each in a fresh process: once the new API was used, torch's legacy getters raise
PRECISION_SETTINGS = [
    ("pass", "ieee"),
    ("torch.backends.cuda.matmul.allow_tf32 = True", "tf32"),
    ("torch.set_float32_matmul_precision('high')", "tf32"),
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),
    ("torch.backends.fp32_precision = 'tf32'", "tf32"),
    ("torch.backends.fp32_precision = 'tf32'; torch.backends.cuda.matmul.fp32_precision = 'ieee'", "ieee"),
]


def test_matmul_precision_reads_every_way_of_setting_it():
    """``matmul_precision`` reads the legacy switches and the new API alike, and never raises."""
    for setting, expected in PRECISION_SETTINGS:
        code = (f"import warnings, torch\nwarnings.simplefilter('ignore')\n{setting}\n"
                "from rnndrop.kernels.cuda_graphs import matmul_precision\nprint(matmul_precision())")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == [expected], setting


def test_at_most_max_graphs_are_kept_least_recently_used_dropped():
    loop = Counted(max_graphs=2)
    a = torch.randn(2, 2)
    for key in ("x", "x", "y", "y", "x", "z", "z"):
        loop(key, a)
    assert [k[0] for k in loop.cache.graphs] == ["x", "z"]  # y was the least recently used
    assert len(loop.cache.seen) <= 4 * 2


def test_a_failed_capture_runs_eagerly_from_then_on(caplog):
    loop = Counted(fail=True)
    a = torch.randn(3)
    with caplog.at_level(logging.WARNING, logger="rnndrop.kernels.cuda_graphs"):
        results = [loop("k", a + i)[0] for i in range(4)]
    assert all(r.equal((a + i) * 2) for i, r in enumerate(results))
    assert loop.captures == 1 and not loop.cache.graphs and len(loop.cache.failed) == 1
    assert "runs eagerly (operation not permitted when stream is capturing)" in caplog.text


def test_off_or_not_capturable_always_runs_eagerly():
    for loop, capturable in ((Counted(max_graphs=0), True), (Counted(), False)):
        for _ in range(3):
            loop("k", torch.ones(2), capturable=capturable)
        assert loop.captures == 0 and loop.calls == 3 and not loop.cache.graphs


def test_cpu_tensors_are_never_captured_by_default():
    cache = GraphCache(8)
    for _ in range(3):
        assert cache("k", lambda x: (x + 1,), (torch.zeros(2),))[0].equal(torch.ones(2))
    assert not cache.graphs and not cache.seen


def test_the_switch_and_its_checks(monkeypatch):
    monkeypatch.setattr(cuda_graphs.GRAPHS, "max_graphs", 0)
    set_max_graphs(3)
    assert cuda_graphs.GRAPHS.max_graphs == 3
    set_max_graphs(0)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="max_graphs must be a whole number >= 0"):
            set_max_graphs(bad)
    monkeypatch.setenv("RNNDROP_CUDA_GRAPHS", "lots")
    with pytest.raises(ValueError, match="RNNDROP_CUDA_GRAPHS must be a whole number .*got 'lots'"):
        cuda_graphs._max_graphs_from_env()
    monkeypatch.setenv("RNNDROP_CUDA_GRAPHS", "8")
    assert cuda_graphs._max_graphs_from_env() == 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU machine runs it)")
def test_a_real_capture_replays_what_eager_computes():
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")

    def fn(x, y):
        return x @ y + 1, None

    captured = capture_cuda_graph(fn, (a, b))
    captured.inputs[0].copy_(b)
    captured.graph.replay()
    torch.testing.assert_close(captured.outputs[0], b @ b + 1)
    cache = GraphCache(2)
    results = [cache("k", fn, (a + i, b))[0] for i in range(3)]
    assert len(cache.graphs) == 1
    for i, r in enumerate(results):
        torch.testing.assert_close(r, (a + i) @ b + 1)
