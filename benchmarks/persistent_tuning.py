"""GPU time of the persistent loop's launches by launch setting, and where a training step waits.

Part 1 times one forward launch and one backward launch of the LSTM loop (and the GRU's with
``--cells lstm,gru``; 2 x 35 steps of rnndrop.kernels.persistent, no autograd, no host work in
between: the launches queue up, so CUDA events time the GPU alone) for each setting of
``persistent.tuning``: hidden units per program, blocks of the batch's rows, the K block of the
loops over ``W_hh``, warps per program, whether the programs keep their tiles of ``W_hh`` on chip
across steps (``resident``, hidden 200), how deep the load pipeline of the loops over ``W_hh`` is
(``stages``; 3 built in), how wide its loads are (``vector``), whether programs own fewer units
than their tile (``spread``) and how many programs a multiprocessor holds (``per_sm``); with tied
masks, and with per-gate masks (``--masks``) for a few unit and row blocks at the shapes where the
loop waits on L2 (:data:`PER_GATE_SETTINGS`). The fastest setting per case is what
``persistent.plan`` / ``_block_k`` / ``_warps`` should pick (docs/gpu.md says which they do); the
last lines name it.

Part 2 splits a whole training step (VariationalLSTM, 2 layers, tied and per-gate masks) and a
Monte-Carlo forward into the time the host takes to issue it and the time until the GPU has
finished it, beside nn.LSTM's training step and inference: a call whose two times are close is
host-bound.

    python benchmarks/persistent_tuning.py [--cells lstm,gru] [--masks tied,per-gate] [--json FILE]
    # CUDA only, about 1.5 minutes a cell on an H200
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import signal
import statistics
import sys
import time
from collections.abc import Iterator

if importlib.util.find_spec("triton") is None:  # the persistent loop is Triton's: one line, not a traceback
    sys.exit("persistent_tuning.py: needs Triton (the [gpu] extra): pip install triton")

import torch
from torch import nn

from rnndrop import VariationalLSTM
from rnndrop.atomic import unwritable, write_json_atomic
from rnndrop.kernels import persistent
from rnndrop.kernels.schedule import Schedule
from rnndrop.kernels.triton_gru import _Saved as _GRUSaved
from rnndrop.kernels.triton_lstm import _Saved

SHAPES = ((200, 20), (200, 128), (650, 20), (650, 128), (1500, 20), (1500, 128))
#: Settings of ``persistent.tuning`` to time, the built-in choice first (row blocks: as many as the
#: grid has room for, down to 16 rows, where 1 was the built-in choice before 2026-11-26's sixth
#: session; resident tiles: off, and asked for they run only up to persistent.MAX_RESIDENT hidden
#: units; load pipeline: 3 stages deep, where the loop over ``W_hh`` waits on L2 at every K block).
SETTINGS = (
    {}, dict(row_blocks=1), dict(row_blocks=2), dict(row_blocks=4), dict(row_blocks=8),
    dict(units=16, row_blocks=1, block_k=32, warps=4), dict(units=16, row_blocks=1, block_k=64, warps=8),
    dict(units=16, row_blocks=2, block_k=64, warps=8), dict(units=16, row_blocks=4, block_k=32, warps=4),
    dict(units=32, row_blocks=1, block_k=64, warps=4),
    dict(resident=True), dict(resident=True, warps=4), dict(resident=True, row_blocks=1, warps=8),
    dict(resident=True, row_blocks=4, warps=8),
    dict(stages=4), dict(stages=6), dict(stages=6, warps=8),
    dict(vector=1),  # rows of W_hh and of the states loaded value by value, as before VEC
    dict(vector=2),  # 8-byte loads: Triton copies them through L1 (.ca), 16-byte ones past it (.cg)
    dict(spread=True), dict(spread=False),  # fewer units a program on idle multiprocessors (LSTM: built in)
    # two programs a multiprocessor: more loads of W_hh in flight (rows split first, or units spread)
    dict(per_sm=2), dict(per_sm=2, spread=True), dict(per_sm=2, row_blocks=1, spread=True),
    dict(half_state=True),  # the forward loop reads the masked states from a float16 copy
)
#: Per-gate masks: each program loads four masked states a block of ``W_hh`` instead of one, that is
#: four times the rows of the state for the same products; so the settings that give a program
#: fewer rows (more row blocks, two programs a multiprocessor to make room for them) and the
#: load-side ones, timed at the shapes where the loop is bound by the GPU. (Wider unit blocks were
#: 2-3x slower with tied masks in the H200 sweep: a program's time grows with its rows x units.)
PER_GATE_SHAPES = ((650, 128), (1500, 20), (1500, 128))
#: (``block_k=64``: the K block as planned at every shape, however shallow its pipeline must then be;
#: the built-in halves it where that keeps two stages or more: ``persistent._fittings``.)
PER_GATE_SETTINGS = (
    {}, dict(row_blocks=2), dict(row_blocks=4), dict(row_blocks=8), dict(per_sm=2),
    dict(per_sm=2, row_blocks=8), dict(block_k=32), dict(block_k=64), dict(warps=8), dict(spread=True),
    dict(half_state=True),
)
STEPS, REPEATS = 35, 10


def loop_inputs(cell: str, hidden: int, batch: int, device: torch.device, per_gate: bool = False):
    """The step schedule, ``gates_x`` ``[T * B, G * H]``, ``h_0``, ``c_0`` (LSTM), ``W_hh`` and a
    tied mask (``[1, B, H]``; ``per_gate``: one per gate, ``[1, B, G, H]``) of one layer, direction
    and batch of ``STEPS`` full steps."""
    torch.manual_seed(0)
    gates = 4 if cell == "lstm" else 3
    schedule = Schedule.of([batch] * STEPS, False)
    gates_x = torch.randn(STEPS * batch, gates * hidden, device=device)
    h0 = torch.zeros(batch, hidden, device=device)
    c0 = torch.zeros(batch, hidden, device=device)
    w_hh = torch.randn(gates * hidden, hidden, device=device) / hidden**0.5
    mask_shape = (1, batch, gates, hidden) if per_gate else (1, batch, hidden)
    mask = (torch.rand(mask_shape, device=device) >= 0.5).float() * 2
    return schedule, gates_x, h0, c0, w_hh, mask


def ran(result):
    """A launch's results; a launch the loop did not run (CUDA refused it: its warning says why)
    returns None, and is an error here."""
    if result is None:
        raise RuntimeError("the persistent loop did not run this launch (refused; see the warning)")
    return result


def launches(cell: str, how, schedule, gates_x, h0, c0, w_hh, mask):
    """``(forward, backward)``: callables that issue one forward and one backward launch of the loop
    (the backward from the saved tensors of a first forward pass)."""
    if cell == "lstm":
        forward = functools.partial(persistent.lstm_forward, how, schedule, gates_x, h0, c0, w_hh, mask)
        out, _, _, acts, cells, _, masked = ran(forward())
        saved = _Saved(acts, cells, out, None, masked, h0, c0, w_hh, None, mask)
        needs = (True, False, False, True, False, False)  # d gates_x and dW_hh, as in training
        d_out = torch.randn_like(out)
        backward = functools.partial(persistent.lstm_backward, how, schedule, needs, saved, d_out, None, None)
        return forward, backward
    forward = functools.partial(persistent.gru_forward, how, schedule, gates_x, h0, w_hh, None, mask)
    out, _, acts, a_n, masked = ran(forward())
    saved = _GRUSaved(acts, a_n, out, masked, h0, w_hh, None, mask)
    needs = (True, False, True, False, False)  # d gates_x and dW_hh, as in training
    d_out = torch.randn_like(out)
    backward = functools.partial(persistent.gru_backward, how, schedule, needs, saved, d_out, None)
    return forward, backward


def time_launches(fn, device: torch.device) -> float:
    """Median GPU milliseconds of ``fn`` (launches only), queued ``REPEATS`` times between events."""
    fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPEATS):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / REPEATS)
    return statistics.median(times)


def sweep(device: torch.device, cell: str = "lstm", per_gate: bool = False) -> Iterator[dict]:
    """The timed rows, one a launch setting, as they are timed."""
    masks = "per-gate" if per_gate else "tied"
    for hidden, batch in PER_GATE_SHAPES if per_gate else SHAPES:
        inputs = loop_inputs(cell, hidden, batch, device, per_gate)
        seen: set = set()
        for setting in PER_GATE_SETTINGS if per_gate else SETTINGS:
            with persistent.tuned(**setting):  # plan, compile and time under the setting
                row = time_setting(cell, masks, hidden, batch, setting, inputs, seen, device)
            if row is not None:
                yield row


def time_setting(cell: str, masks: str, hidden: int, batch: int, setting: dict, inputs, seen: set,
                 device: torch.device) -> dict | None:
    """One forward and one backward launch of the loop under ``setting`` (in force), timed and printed;
    None where the setting plans a launch already timed (``seen``) or fails to compile or launch."""
    how = persistent.plan(inputs[1], hidden, batch, False, cell=cell)  # inputs[1]: gates_x
    block_k, warps, stages = setting.get("block_k"), setting.get("warps"), setting.get("stages")
    vector, per_sm, half = setting.get("vector"), setting.get("per_sm"), setting.get("half_state")
    # (row blocks that do not fit fall back to a setting already timed)
    if how is None or (how, block_k, warps, stages, vector, half) in seen:
        return None
    seen.add((how, block_k, warps, stages, vector, half))
    try:
        forward, backward = launches(cell, how, *inputs)
        forward_ms, backward_ms = time_launches(forward, device), time_launches(backward, device)
    except Exception as error:  # a setting that does not compile or launch: say so, go on
        print(f"hidden {hidden} batch {batch} {setting}: {type(error).__name__}: "
              f"{str(error).splitlines()[0][:120]}", flush=True)
        persistent._given_up.clear()  # a refused launch must not send later ones to the step kernel
        return None
    row = dict(cell=cell, masks=masks, hidden=hidden, batch=batch, units=how.units,
               row_blocks=how.row_blocks, block_k=block_k, warps=warps, resident=how.resident,
               stages=stages, vector=vector, per_sm=per_sm, half_state=half, programs=how.grid,
               built_in=not setting, forward_ms=forward_ms, backward_ms=backward_ms,
               us_per_step=(forward_ms + backward_ms) * 1e3 / (2 * (STEPS + 1)))
    label = (f"{'built-in ' if row['built_in'] else ''}units {how.units:2d} x rows/{how.row_blocks}"
             f", K {block_k or 'auto'}, warps {warps or 'auto'}"
             f"{', resident' if how.resident else ''}{f', {stages} stages' if stages else ''}"
             f"{f', vectors of {vector}' if vector else ''}"
             f"{f', {per_sm} a multiprocessor' if per_sm else ''}"
             f"{', float16 states' if half else ''}")
    print(f"{cell:4s} {masks:8s} {hidden:5d} {batch:4d}  {label:38s} programs {how.grid:3d}  forward "
          f"{forward_ms:6.3f} ms  backward {backward_ms:6.3f} ms  {row['us_per_step']:6.1f} us/step",
          flush=True)
    return row


def host_and_gpu(device: torch.device) -> list[dict]:
    """Milliseconds to issue (host) and to finish (GPU) a training step of nn.LSTM and of tied and
    per-gate masks, and a Monte-Carlo forward (no gradient, fresh masks) against nn.LSTM's inference."""
    rows = []
    for hidden, batch in ((200, 20), (650, 20), (650, 128)):
        x = torch.randn(STEPS, batch, hidden, device=device)
        probs = dict(dropout=0.5, dropout_input=0.5, dropout_hidden=0.5, dropout_output=0.5)
        for name, module, training in (
            ("nn.LSTM", nn.LSTM(hidden, hidden, 2), True),
            ("tied", VariationalLSTM(hidden, hidden, 2, **probs), True),
            ("per-gate", VariationalLSTM(hidden, hidden, 2, per_gate_masks=True, **probs), True),
            ("nn.LSTM inference", nn.LSTM(hidden, hidden, 2), False),
            ("tied Monte-Carlo", VariationalLSTM(hidden, hidden, 2, **probs), False),
        ):
            module.to(device).train(name != "nn.LSTM inference")
            issued, finished = [], []
            for k in range(13):
                module.zero_grad(set_to_none=True)
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                if training:
                    module(x)[0].sum().backward()
                else:
                    with torch.no_grad():
                        module(x)
                issue = time.perf_counter() - start
                torch.cuda.synchronize(device)
                if k >= 3:
                    issued.append(issue * 1e3)
                    finished.append((time.perf_counter() - start) * 1e3)
            row = dict(hidden=hidden, batch=batch, variant=name, host_ms=statistics.median(issued),
                       total_ms=statistics.median(finished))
            rows.append(row)
            what = "step" if training else "forward"
            print(f"lstm {hidden:5d} {batch:4d}  {name:17s} host issues the {what} in "
                  f"{row['host_ms']:6.2f} ms, GPU done at {row['total_ms']:6.2f} ms", flush=True)
    return rows


def best_settings(rows: list[dict]) -> list[str]:
    """A line per swept case: the built-in rule's microseconds a step and pass, and the fastest
    setting's, with its name and their ratio (what to flip a default by)."""
    lines = ["fastest setting per case (us a step and pass; ratio to the built-in rule):"]
    cases: dict[tuple, list[dict]] = {}
    for row in rows:
        cases.setdefault((row["cell"], row.get("masks", "tied"), row["hidden"], row["batch"]), []).append(row)
    for (cell, masks, hidden, batch), timed in cases.items():
        built_in = next((r for r in timed if r["built_in"]), None)
        best = min(timed, key=lambda r: r["us_per_step"])
        keys = ("units", "row_blocks", "block_k", "warps", "resident", "stages", "vector", "per_sm",
                "half_state")
        name = "built-in" if best["built_in"] else ", ".join(
            f"{key} {best[key]}" for key in keys if best.get(key) not in (None, False))
        versus = f"{best['us_per_step'] / built_in['us_per_step']:.2f}x" if built_in else "no built-in row"
        base = f"{built_in['us_per_step']:6.1f}" if built_in else "     -"
        lines.append(f"{cell:4s} {masks:8s} {hidden:5d} {batch:4d}  built-in {base}  "
                     f"fastest {best['us_per_step']:6.1f} ({versus}): {name}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--cells", default="lstm", help="loops to sweep, comma-separated: lstm, gru")
    parser.add_argument("--masks", default="tied,per-gate",
                        help="masks to sweep, comma-separated: tied (every shape and setting), per-gate "
                             "(PER_GATE_SHAPES and PER_GATE_SETTINGS); default both")
    args = parser.parse_args(argv)
    if args.json and (why := unwritable(args.json)):  # said before measuring, not after
        parser.error(f"--json {args.json!r}: {why}")
    cells, masks = args.cells.split(","), args.masks.split(",")
    if not cells or any(c not in ("lstm", "gru") for c in cells):
        parser.error(f"--cells: expected a comma-separated list of lstm and gru, got {args.cells!r}")
    if not masks or any(m not in ("tied", "per-gate") for m in masks):
        parser.error(f"--masks: expected a comma-separated list of tied and per-gate, got {args.masks!r}")
    if not torch.cuda.is_available():
        print("persistent_tuning.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), torch.__version__, flush=True)
    rows: list[dict] = []
    result: dict = dict(sweep=rows, host_and_gpu=None, complete=False)
    # `timeout` (gpu_check.sh's time limits) sends SIGTERM: stop as Ctrl-C does, with what is timed
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        for cell in cells:
            for kind in masks:
                for row in sweep(device, cell, kind == "per-gate"):
                    rows.append(row)
                    save(result, args.json)  # a time limit keeps the rows timed
        print("\n".join(best_settings(rows)), flush=True)
        result["host_and_gpu"] = host_and_gpu(device)
    except KeyboardInterrupt:
        print("interrupted: the rows timed so far are kept", file=sys.stderr, flush=True)
        print("\n".join(best_settings(rows)), flush=True)
        save(result, args.json)
        return 130
    result["complete"] = True
    save(result, args.json)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def save(result: dict, path: str | None) -> None:
    if path:
        write_json_atomic(result, path)


if __name__ == "__main__":
    sys.exit(main())
