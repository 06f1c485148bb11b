"""The host's cost of Triton's own launch path for one persistent-loop launch, measured without a GPU.

A launch of ``kernel[grid](...)`` on a GPU runs Triton's Python first (binding and specialising the
arguments, looking the compiled kernel up by them), then its C launcher. This script times that path
on the CPU for the launch ``persistent.lstm_forward`` makes (hidden 200, batch 20, 35 steps, tied
mask: 34 arguments), with a stand-in driver that names an sm_90 GPU and a stand-in for the compiled
kernel whose launcher does nothing (the first call "compiles" it: Triton's cache then holds it, as
after a real first call). It prints microseconds per call of

- Triton's launch path (everything ``kernel[grid](...)`` does before the launcher),
- the launcher call alone (the stand-in's: the floor a direct call of the compiled kernel would pay
  in Python, without the C launcher's own work),
- ``persistent.lstm_forward`` whole (rnndrop's host work around the launch, and the launch path).

    python benchmarks/triton_launch_cost.py [--rounds 7] [--calls 2000] [--json FILE]

It answers whether launching the compiled kernel directly (reproducing Triton's specialisation
key) would pay: docs/gpu.md, "Triton's launch path". It uses Triton's runtime internals
(``JITFunction._do_compile``, the driver's ``_active``), checked with Triton 3.6 and 3.9; another Triton
may refuse, in one line. The numbers are this CPU's; a GPU host runs the same Python at its own speed.
"""

from __future__ import annotations

import argparse
import os
import sys
from unittest import mock

import torch

from rnndrop.atomic import unwritable, write_json_atomic

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speed import machine, microseconds  # shared with speed.py

BATCH, HIDDEN, STEPS = 20, 200, 35


class _StandInDriver:
    """The current device, stream and target as Triton's CUDA driver would give them (sm_90)."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class _StandInKernel:
    """A compiled kernel whose launcher does nothing."""

    function = None
    packed_metadata = None

    def launch_metadata(self, grid, stream, *args) -> None:
        return None

    def run(self, *args) -> None:
        pass


def _compile_nothing(self, key, signature, device, constexprs, options, attrs, warmup):
    """``JITFunction._do_compile``'s stand-in: Triton's cache holds a :class:`_StandInKernel`."""
    kernel = _StandInKernel()
    self.device_caches[device][0][key] = kernel
    return kernel


def measure(rounds: int, calls: int) -> dict:
    """The three times, in microseconds, and the number of arguments a launch passes (Triton and
    the persistent loop imported here: after the check that Triton's interpreter is off)."""
    from rnndrop.kernels import persistent
    from rnndrop.kernels.schedule import Schedule
    from rnndrop.kernels.triton_plan import LAUNCH_OPTIONS

    gates_x = torch.randn(BATCH * STEPS, 4 * HIDDEN)
    w_hh = torch.randn(4 * HIDDEN, HIDDEN)
    h0, c0 = torch.zeros(BATCH, HIDDEN), torch.zeros(BATCH, HIDDEN)
    mask = torch.rand(1, BATCH, HIDDEN)
    schedule = Schedule.of([BATCH] * STEPS, False)
    seen: dict = {}

    def record(kernel, how, steps, args, backward, **constexprs):
        seen.update(kernel=kernel, steps=steps, args=args, constexprs=constexprs)

    # the launch an H100 / H200 gets at this shape: two blocks of rows of 13 programs
    grid = persistent.Launch(13, 16, row_blocks=2)
    with mock.patch.object(persistent, "_run", record):
        persistent.lstm_forward(grid, schedule, gates_x, h0, c0, w_hh, mask)
    kernel, constexprs = seen["kernel"], seen["constexprs"]
    counter = torch.zeros(1, dtype=torch.int32)
    warps = persistent._warps(constexprs["BB"], False)
    options = dict(SYNC=True, UPCAST=False, num_warps=warps, num_stages=3, launch_cooperative_grid=True,
                   **LAUNCH_OPTIONS)
    launch_args = [*seen["args"], counter, 0, seen["steps"]]

    def triton_path() -> None:
        kernel[(grid.grid,)](*launch_args, **constexprs, **options)

    stand_in = _StandInKernel()
    bound = [*launch_args, *constexprs.values(), True, False]  # every parameter, as Triton passes them

    def launcher_alone() -> None:
        stand_in.run(grid.grid, 1, 1, 0, None, None, None, None, None, *bound)

    one_program = persistent.Launch(1, 16)  # a grid the CPU may launch (no barrier)

    def whole_forward() -> None:
        persistent.lstm_forward(one_program, schedule, gates_x, h0, c0, w_hh, mask)

    return dict(arguments=len(bound), triton_path_us=microseconds(triton_path, rounds, calls),
                launcher_alone_us=microseconds(launcher_alone, rounds, calls),
                lstm_forward_us=microseconds(whole_forward, rounds, calls))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--calls", type=int, default=2000, help="calls a round (default 2000)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.json and (why := unwritable(args.json)):  # said before measuring, not after
        parser.error(f"--json {args.json!r}: {why}")
    for name in ("rounds", "calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # read when the kernels are defined
        print("triton_launch_cost.py: unset TRITON_INTERPRET (it times Triton's compiled-kernel launch path)",
              file=sys.stderr)
        return 2
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    torch.set_num_threads(1)
    try:
        with (mock.patch.object(driver, "_active", _StandInDriver()),
              mock.patch.object(JITFunction, "_do_compile", _compile_nothing)):
            row = measure(args.rounds, args.calls)
    except Exception as error:  # another Triton's internals, whatever it raises on them
        first_line = (str(error).strip().splitlines() or [""])[0]
        print(f"triton_launch_cost.py: Triton {triton.__version__}'s launch path differs from the one this "
              f"script stands in for ({type(error).__name__}: {first_line})", file=sys.stderr)
        return 2
    print(f"{machine()}\nTriton {triton.__version__}, 1 thread, load average {os.getloadavg()[0]:.2f}; "
          f"persistent LSTM forward launch, hidden {HIDDEN}, batch {BATCH}, {STEPS} steps, "
          f"{row['arguments']} arguments")
    print(f"Triton's launch path        {row['triton_path_us']:6.1f} us")
    print(f"the launcher call alone     {row['launcher_alone_us']:6.2f} us")
    print(f"persistent.lstm_forward     {row['lstm_forward_us']:6.1f} us "
          "(rnndrop's host work and the launch path)")
    if args.json:
        write_json_atomic(dict(row, triton=triton.__version__), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
