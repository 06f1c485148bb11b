"""Forward + backward time of the fused-kernel regularizers against a plain nn.LSTM.

    python benchmarks/regularizers_speed.py                  # Zaremba small and medium shapes
    python benchmarks/regularizers_speed.py --sizes 200 --rounds 5 --threads 2

Models (training mode, same shapes, batch-first=False, sequence length 35, batch 20):

- ``nn.LSTM``: no dropout, the baseline;
- ``batch``: ``VariationalLSTM(mask_scope="batch")`` with dropout_input, dropout (between
  layers), dropout_hidden and dropout_output all 0.5 (the fused kernel with W_hh's columns
  masked);
- ``weightdrop``: ``WeightDrop(nn.LSTM, every weight_hh, p=0.5)`` (DropConnect);
- ``sequence``: ``VariationalLSTM`` with the same probabilities and per-sequence masks
  (the loop kernel), for scale.

The models are timed in interleaved rounds (every round times each model once), and the
ratio to nn.LSTM is taken within each round, so load from other processes hits all of them
alike; the median ratio over rounds is reported, of wall-clock time and of the process's CPU
time (less sensitive to being descheduled on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

from rnndrop import VariationalLSTM, WeightDrop

P = 0.5


def build(name: str, hidden: int, layers: int) -> nn.Module:
    if name == "nn.LSTM":
        return nn.LSTM(hidden, hidden, layers)
    if name == "weightdrop":
        names = [f"weight_hh_l{k}" for k in range(layers)]
        return WeightDrop(nn.LSTM(hidden, hidden, layers), names, p=P)
    scope = "batch" if name == "batch" else "sequence"
    return VariationalLSTM(
        hidden, hidden, layers, dropout=P, dropout_input=P, dropout_hidden=P, dropout_output=P,
        mask_scope=scope,
    )


def time_once(model: nn.Module, x: torch.Tensor, iters: int) -> tuple[float, float]:
    """Wall-clock and process CPU seconds per forward + backward, averaged over ``iters`` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        out, _ = model(x)
        out.sum().backward()
    return (time.perf_counter() - wall) / iters, (time.process_time() - cpu) / iters


def run(hidden: int, layers: int, batch: int, seq_len: int, names: list[str], rounds: int, iters: int):
    torch.manual_seed(0)
    models = {name: build(name, hidden, layers).train() for name in names}
    x = torch.randn(seq_len, batch, hidden)
    for model in models.values():  # warm up
        time_once(model, x, 2)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            w, c = time_once(model, x, iters)
            wall[name].append(w)
            cpu[name].append(c)

    def median_ratio(times: dict[str, list[float]], name: str) -> float:
        return statistics.median(t / b for t, b in zip(times[name], times["nn.LSTM"]))

    return [
        (name, statistics.median(wall[name]) * 1e3, median_ratio(wall, name), median_ratio(cpu, name))
        for name in names
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="200,650", help="hidden sizes (Zaremba small 200, medium 650)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=35)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=5, help="calls per model per round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="nn.LSTM,batch,weightdrop,sequence")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.models.split(",")
    if names[0] != "nn.LSTM":
        names.insert(0, "nn.LSTM")
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {args.threads} thread(s), load average {load[0]:.2f} {load[1]:.2f}")
    for hidden in map(int, args.sizes.split(",")):
        rows = run(hidden, args.layers, args.batch, args.seq_len, names, args.rounds, args.iters)
        print(f"\nhidden {hidden}, {args.layers} layers, batch {args.batch}, seq {args.seq_len}")
        print(f"{'model':<12} {'ms/iter':>9} {'x nn.LSTM':>10} {'x (CPU time)':>13}")
        for name, ms, ratio, cpu_ratio in rows:
            print(f"{name:<12} {ms:9.2f} {ratio:10.3f} {cpu_ratio:13.3f}")
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f}")


if __name__ == "__main__":
    main()
