"""Running a job's runs: one at a time in this process, or in worker processes
(``--jobs N``), where Ctrl-C reaches the main process alone, which stops the workers."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from rnndrop.lm.run.progress import EpochRelay, JobProgress, relay_events
from rnndrop.lm.run.spec import JobInterrupted, RunSpec, execute, worker_logging

__all__ = ["WorkerDied", "run_all"]


class WorkerDied(RuntimeError):
    """A worker process of ``--jobs`` ended without a result (killed, out of memory)."""

    def __init__(self, label: str) -> None:
        super().__init__(
            f"a worker process died while it ran {label} (killed, or out of memory); every finished "
            "epoch is saved: run the same command with --resume to continue"
        )


#: in a worker process: the queue its runs report their epochs on (see :class:`EpochRelay`)
_events: Any = None


def _worker_init(events: Any) -> None:
    """Workers leave Ctrl-C to the main process, which stops them with SIGTERM; SIGTERM then
    unwinds the worker's run, so its run folder's lock is released and no half-written
    file is left (checkpoints are atomic either way). Their runs report to ``events``. A
    worker whose main process dies without stopping it (kill -9) sends itself SIGTERM: it
    would otherwise wait for work forever."""
    global _events
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _events = events
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_end_with_parent, args=(parent.sentinel,), daemon=True,
                         name="rnndrop-parent-watch").start()


def _end_with_parent(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])  # ready once the main process is gone
    os.kill(os.getpid(), signal.SIGTERM)


class _Terminated(BaseException):
    """SIGTERM in a worker: unwinds the run (its lock released), then the worker ends."""


_running = False  # whether this worker is inside a run (SIGTERM unwinds it) or waiting for one


def _exit_on_sigterm(signum: int, frame: object) -> None:
    if not _running:
        os._exit(128 + signal.SIGTERM)  # between runs: nothing to unwind
    raise _Terminated


def _in_worker(fn: Callable[[RunSpec, Any], dict[str, Any]], spec: RunSpec) -> dict[str, Any]:
    global _running
    _running = True
    worker_logging(spec.label)
    try:
        return fn(spec, EpochRelay(_events))
    except _Terminated:
        os._exit(128 + signal.SIGTERM)  # unwound: the run folder is released; nothing to report
    finally:
        _running = False


def run_all(
    specs: Sequence[RunSpec], jobs: int, progress: JobProgress | None,
    fn: Callable[[RunSpec, JobProgress | None], dict[str, Any]] = execute,
) -> list[dict[str, Any]]:
    """``fn`` on every spec, ``jobs`` at a time; the results in the order of ``specs``.
    Ctrl-C stops every worker and raises :class:`JobInterrupted`."""
    if jobs <= 1 or len(specs) <= 1:
        return [fn(s, progress) for s in specs]
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=context,
                               initializer=_worker_init, initargs=(events,))
    try:
        # Workers start while SIGINT is ignored, and keep ignoring it (the disposition is
        # inherited): a Ctrl-C at the terminal reaches the main process alone, which stops them.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            futures = {pool.submit(_in_worker, fn, s): i for i, s in enumerate(specs)}
        finally:
            signal.signal(signal.SIGINT, previous)
        results: dict[int, dict[str, Any]] = {}
        pending, reused = set(futures), set()
        while pending:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            if progress is not None:
                relay_events(events, progress, reused)
            for future in done:
                i = futures[future]
                try:
                    results[i] = future.result()
                except BrokenProcessPool:
                    raise WorkerDied(specs[i].label or specs[i].folder) from None
                if progress is not None and fn is execute:
                    progress.run_done(specs[i].label, results[i], reused=specs[i].label in reused)
        return [results[i] for i in range(len(specs))]
    except KeyboardInterrupt:
        _stop(pool)
        raise JobInterrupted(None, None) from None
    except BaseException:
        _stop(pool)
        raise
    finally:
        pool.shutdown(wait=True)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the running workers (checkpoints are atomic)."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
