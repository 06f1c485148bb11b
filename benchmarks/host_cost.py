"""The host's work in a training step of the GPU path, measured without a GPU.

At batch 20 a training step on the "triton" kernel is bound by the host, for cuDNN and for the
persistent loop alike (docs/gpu.md): what counts there is the time Python, autograd and torch's
dispatcher take to issue the step, not the kernels. This script measures that path on the CPU: the
layer runs with ``kernel="triton"`` on CPU tensors under Triton's interpreter, with the persistent
loop's launches skipped (``kernel[grid](...)`` returns at once, their outputs are left as allocated;
the host's work around a launch is measured), on tiny tensors (hidden 16, batch 4,
35 steps, 2 layers, masks p 0.5 everywhere: tied for the LSTM and the GRU, and one a gate for the
LSTM, whose input projection runs the batched products CUDA runs), so what remains is the layer's
own host work.
It prints microseconds per forward, per training step and per Monte-Carlo sample (a forward under
``torch.no_grad``, fresh masks; median of rounds) and the torch ops one training step issues (those
that would launch a kernel on a GPU, and the views and allocations apart; ``speed.launching_ops``),
for the LSTM and the GRU.

    python benchmarks/host_cost.py [--rounds 7] [--json FILE]

The numbers are this CPU's, not a GPU host's: they compare versions of the host path on one machine
(run both in one session, nothing else running), not machines. A GPU host pays more per op (each
launching op also enqueues a kernel) and runs Python at its own speed.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton (rnndrop's torch._dynamo does)

import argparse
import contextlib
import importlib.util
import sys
from unittest import mock

if importlib.util.find_spec("triton") is None:  # the persistent loop is Triton's: one line, not a traceback
    sys.exit("host_cost.py: needs Triton (the [gpu] extra): pip install triton")

import torch
from torch.profiler import ProfilerActivity, profile

from rnndrop import VariationalGRU, VariationalLSTM
from rnndrop.atomic import unwritable, write_json_atomic
from rnndrop.kernels import per_gate_projection, persistent

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import launching_ops, machine, microseconds, top_level_ops  # shared with speed.py

HIDDEN, BATCH, STEPS, LAYERS = 16, 4, 35, 2


class _SkippedLaunch:
    """A persistent loop whose launches do nothing: ``kernel[grid](...)`` returns at once, so that
    everything the host does around a launch (``persistent._run``) is still measured."""

    def __init__(self, kernel) -> None:
        self.__name__ = kernel.__name__

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def launches_skipped():
    """The four persistent loops' launches skipped (:class:`_SkippedLaunch`) inside the block."""
    names = ("_lstm_forward", "_lstm_backward", "_gru_forward", "_gru_backward")
    with contextlib.ExitStack() as stack:
        for name in names:
            skipped = _SkippedLaunch(getattr(persistent, name))
            stack.enter_context(mock.patch.object(persistent, name, skipped))
        yield


def build(cell: str, per_gate: bool = False) -> torch.nn.Module:
    cls = VariationalLSTM if cell == "lstm" else VariationalGRU
    return cls(HIDDEN, HIDDEN, LAYERS, dropout=0.5, dropout_input=0.5, dropout_hidden=0.5, dropout_output=0.5,
               kernel="triton", per_gate_masks=per_gate)


@contextlib.contextmanager
def projections_as_on_cuda():
    """The per-gate input projection's batched products (what CUDA runs) on CPU tensors too."""
    with mock.patch.object(per_gate_projection, "BATCHED_DEVICES", {"cuda", "cpu"}):
        yield


def measure(cell: str, rounds: int, per_gate: bool = False) -> dict:
    torch.manual_seed(0)
    layer = build(cell, per_gate).train()
    x = torch.randn(STEPS, BATCH, HIDDEN)

    def forward() -> None:
        layer(x)

    def mc_sample() -> None:  # Monte-Carlo prediction: fresh masks, no autograd
        with torch.no_grad():
            layer(x)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        layer(x)[0].sum().backward()

    times = dict(forward_us=microseconds(forward, rounds), step_us=microseconds(step, rounds),
                 mc_sample_us=microseconds(mc_sample, rounds))
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # after the timing: it slows what follows
        step()
    launching = launching_ops(prof)
    return dict(cell=cell, masks="per-gate" if per_gate else "tied", **times, ops=sum(launching.values()),
                views=sum(top_level_ops(prof).values()) - sum(launching.values()),
                by_op=dict(launching.most_common()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of 200 calls (default 7)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.json and (why := unwritable(args.json)):  # said before measuring, not after
        parser.error(f"--json {args.json!r}: {why}")
    if args.rounds < 1:
        parser.error(f"--rounds: expected a positive integer, got {args.rounds}")
    torch.set_num_threads(1)
    print(f"{machine()}\nhost work of the 'triton' path, launches skipped: hidden {HIDDEN}, batch {BATCH}, "
          f"{STEPS} steps, {LAYERS} layers, 1 thread, load average {os.getloadavg()[0]:.2f}")
    rows = []
    with launches_skipped(), projections_as_on_cuda():
        for cell, per_gate in (("lstm", False), ("gru", False), ("lstm", True)):
            row = measure(cell, args.rounds, per_gate)
            rows.append(row)
            print(f"{cell:4s} {row['masks']:8s} forward {row['forward_us']:6.0f} us   training step "
                  f"{row['step_us']:6.0f} us   "
                  f"Monte-Carlo sample {row['mc_sample_us']:5.0f} us   ops a step {row['ops']:3d} "
                  f"(+ {row['views']} views and allocations)", flush=True)
    if args.json:
        write_json_atomic(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
