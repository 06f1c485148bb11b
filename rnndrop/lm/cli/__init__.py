"""``rnndrop-lm``: train, compare, evaluate and sample word-level language models.

::

    rnndrop-lm ptb --data sample                 # the bundled PTB sample, no internet needed
    rnndrop-lm ptb --config gal-medium --regimes tied --device cuda   # full PTB, downloaded once
    rnndrop-lm wikitext2 --data sample --regimes none,tied
    rnndrop-lm evaluate runs/ptb-sample-mini/tied/<run>      # perplexity, MC perplexity, ECE
    rnndrop-lm generate runs/ptb-sample-mini/tied/<run> --words 50

``python -m rnndrop.lm`` is the same command. Exit status: 0 done, 2 a data or usage
problem (a model too large for memory included), 3 training diverged, 130 interrupted (Ctrl-C or
SIGTERM); the reason is one line on stderr, never a traceback.

The parsers are in :mod:`~rnndrop.lm.cli.parser`, the checks of a training job in
:mod:`~rnndrop.lm.cli.checks`, one function per sub-command in
:mod:`~rnndrop.lm.cli.commands`, and the exit statuses in :mod:`~rnndrop.lm.cli.errors`.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as dist

from rnndrop.kernels.cuda_graphs import check_environment
from rnndrop.lm.cli.commands import carve, evaluate, generate, train, train_main
from rnndrop.lm.cli.errors import (
    EXIT_DATA,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    UsageError,
    fail,
    lost_peer,
    out_of_memory,
)
from rnndrop.lm.cli.parser import CORPORA, build_parser
from rnndrop.lm.run.process_group import end_worker, torchrun_world_size

__all__ = [
    "EXIT_DATA",
    "EXIT_DIVERGED",
    "EXIT_INTERRUPTED",
    "UsageError",
    "build_parser",
    "main",
    "train_main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rnndrop-lm`` and ``python -m rnndrop.lm``: one sub-command, its output
    on stdout; returns the exit status (under torchrun, a worker that joined the process group
    exits with it instead)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    code = 0
    with _sigterm_as_ctrl_c():
        try:
            try:  # a malformed setting in the environment: one line, before anything runs
                check_environment()
            except ValueError as e:
                raise fail(str(e), EXIT_DATA) from None
            if args.command in ("ptb", "wikitext2"):
                sys.stdout.write(train(args, CORPORA[args.command], argv[1:]))
            elif args.command == "evaluate":
                sys.stdout.write(evaluate(args))
            elif args.command == "carve":
                sys.stdout.write(carve(args))
            else:
                sys.stdout.write(generate(args))
        except SystemExit as e:
            code = int(e.code or 0)
        except KeyboardInterrupt:  # outside training (reading data, scoring, sampling)
            sys.stderr.write("error: interrupted\n")
            code = EXIT_INTERRUPTED
        except (MemoryError, RuntimeError) as e:
            message = out_of_memory(e) or lost_peer(e)
            if message is None:
                raise
            fail(message, EXIT_DATA, every_rank=True)  # a rank may meet either alone
            code = EXIT_DATA
    if dist.is_available() and dist.is_initialized():
        end_worker(code)
    return code


@contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (``kill``, a scheduler ending the job) stops the command as Ctrl-C does: every
    finished epoch kept, worker processes stopped, one line. Without it the main process
    died at once and ``--jobs`` workers were left behind. torchrun's workers keep the default:
    torchrun itself ends them together."""
    try:
        under_torchrun = torchrun_world_size() > 1
    except ValueError:  # a malformed WORLD_SIZE: the command reports it in one line
        under_torchrun = False
    if threading.current_thread() is not threading.main_thread() or under_torchrun:
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
