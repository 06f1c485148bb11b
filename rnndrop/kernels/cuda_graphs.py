"""CUDA-graph capture and replay of the Triton kernel's time loops (off unless asked for).

A layer's loop, forward or backward, launches the same kernels with the same arguments whenever
its *key* is the same: the cell, the pass, the batch sizes and direction, cuBLAS's float32 mode
(TF32 or not), and the shape, dtype and device of every tensor input (None where absent); the
hidden size, the mask's shape and the dtype follow from those. Noise is never drawn inside a loop
(masks are inputs), and nothing in it reads a tensor's value on the host. Per key:

1. the first call runs eagerly (and compiles the Triton kernels for its shapes);
2. the second copies its inputs into tensors the graph owns, runs the loop once on a side stream
   (warm-up: nothing compiles during the capture), captures it (``torch.cuda.graph``, a private
   memory pool per graph) and replays it;
3. later calls copy their inputs in, replay, and return *copies* of the graph's outputs: a replay
   overwrites them, and the copies are what callers keep (two layers with the same key, or two
   forward passes before one backward, never share memory).

A loop that cannot be captured (``capturable=False``, such as the backward pass that computes a
learned mask's gradient, which copies an index from the host; or a capture that fails) runs eagerly
from then on: the same kernels, the same result.

Memory: a graph keeps its inputs, outputs and pool, about twice what one eager call allocates;
at most ``max_graphs`` graphs are kept, the least recently used dropped first. Turn it on with
``RNNDROP_CUDA_GRAPHS=8`` (the most graphs to keep; 0 or unset: off) or :func:`set_max_graphs`.
A 2-layer bidirectional LSTM with padded batches needs 4 (forward and backward, each direction).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from rnndrop.kernels.precision import matmul_precision

__all__ = ["GRAPHS", "GraphCache", "check_environment", "set_max_graphs"]

logger = logging.getLogger(__name__)

Inputs = Sequence[Tensor | None]
Outputs = tuple[Tensor | None, ...]


class Captured(NamedTuple):
    """A captured loop: ``graph.replay()`` recomputes ``outputs`` from ``inputs`` in place."""

    graph: Any
    inputs: list[Tensor | None]
    outputs: Outputs


def tensor_key(t: Tensor | None) -> Hashable:
    """What of a tensor input a graph depends on: shape, strides, dtype, device (None: absent)."""
    return None if t is None else (tuple(t.shape), t.stride(), t.dtype, str(t.device))


def capture_cuda_graph(fn: Callable[..., Outputs], inputs: Inputs) -> Captured:
    """Warm ``fn`` up on a side stream, then capture it on copies of ``inputs``."""
    static = [None if x is None else x.clone() for x in inputs]
    device = next(x for x in inputs if x is not None).device
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        fn(*static)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = fn(*static)
    finally:
        torch.cuda.set_stream(current)  # where a failed capture leaves the capture stream current
    return Captured(graph, static, tuple(outputs))


def _on_cuda(inputs: Inputs) -> bool:
    return all(x is None or x.is_cuda for x in inputs)


class GraphCache:
    """The captured loops, by key (module docstring); ``capture`` and ``can_capture`` are
    replaceable for tests."""

    def __init__(
        self,
        max_graphs: int | None,
        capture: Callable[[Callable[..., Outputs], Inputs], Captured] = capture_cuda_graph,
        can_capture: Callable[[Inputs], bool] = _on_cuda,
    ) -> None:
        self._max_graphs = max_graphs  # None: read RNNDROP_CUDA_GRAPHS at first use
        self.capture = capture
        self.can_capture = can_capture
        self.graphs: OrderedDict[Hashable, Captured] = OrderedDict()
        self.seen: OrderedDict[Hashable, None] = OrderedDict()  # keys that ran once
        self.failed: set[Hashable] = set()
        self._lock = threading.Lock()

    @property
    def max_graphs(self) -> int:
        """The most graphs kept (0: off); read from ``RNNDROP_CUDA_GRAPHS`` at first use, so that a
        malformed value fails where graphs are used, not at ``import rnndrop``."""
        if self._max_graphs is None:
            self._max_graphs = _max_graphs_from_env()
        return self._max_graphs

    @max_graphs.setter
    def max_graphs(self, value: int) -> None:
        self._max_graphs = value

    def __call__(
        self, key: Hashable, fn: Callable[..., Outputs], inputs: Inputs, capturable: bool = True
    ) -> Outputs:
        """``fn(*inputs)``, replayed from a graph where the key has been seen before."""
        if self.max_graphs <= 0 or not capturable or not self.can_capture(inputs):
            return tuple(fn(*inputs))
        key = (key, matmul_precision(), *map(tensor_key, inputs))
        with self._lock:  # the graph's own tensors are shared: one caller at a time
            captured = self.graphs.get(key)
            if captured is not None:
                self.graphs.move_to_end(key)
            elif key not in self.failed and not self._first_time(key):
                captured = self._capture(key, fn, inputs)
            if captured is not None:
                return self._replay(captured, inputs)
        return tuple(fn(*inputs))

    def _first_time(self, key: Hashable) -> bool:
        if key in self.seen:
            return False
        self.seen[key] = None
        while len(self.seen) > 4 * self.max_graphs:
            self.seen.popitem(last=False)
        return True

    def _capture(self, key: Hashable, fn: Callable[..., Outputs], inputs: Inputs) -> Captured | None:
        try:
            captured = self.capture(fn, inputs)
        except RuntimeError as error:
            logger.warning("rnndrop: a Triton loop could not be captured in a CUDA graph; it runs "
                           "eagerly (%s)", str(error).splitlines()[0] if str(error) else type(error).__name__)
            self.failed.add(key)
            return None
        self.graphs[key] = captured
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return captured

    @staticmethod
    def _replay(captured: Captured, inputs: Inputs) -> Outputs:
        for static, x in zip(captured.inputs, inputs):
            if static is not None:
                static.copy_(x)
        captured.graph.replay()
        return tuple(None if out is None else out.clone() for out in captured.outputs)

    def clear(self) -> None:
        with self._lock:
            self.graphs.clear()
            self.seen.clear()
            self.failed.clear()


def _max_graphs_from_env() -> int:
    """``RNNDROP_CUDA_GRAPHS`` as a number of graphs (0 or unset: off); a ValueError naming the
    variable, what it takes and what it holds otherwise."""
    value = os.environ.get("RNNDROP_CUDA_GRAPHS", "0").strip() or "0"
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"RNNDROP_CUDA_GRAPHS must be a whole number of graphs (0: off), got {value!r}")
    return int(value)


def check_environment() -> None:
    """Raise the ValueError of a malformed ``RNNDROP_CUDA_GRAPHS`` now (command lines check it up
    front; the library reads it at the first Triton forward)."""
    _max_graphs_from_env()


#: The cache the Triton kernels use (its size read from the environment at first use).
GRAPHS = GraphCache(None)


def set_max_graphs(max_graphs: int) -> None:
    """Keep at most ``max_graphs`` captured loops (0: off, and the kept ones are dropped)."""
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 0:
        raise ValueError(f"max_graphs must be a whole number >= 0, got {max_graphs!r}")
    GRAPHS.max_graphs = max_graphs
    if max_graphs == 0:
        GRAPHS.clear()
    with GRAPHS._lock:
        while len(GRAPHS.graphs) > max_graphs:
            GRAPHS.graphs.popitem(last=False)
