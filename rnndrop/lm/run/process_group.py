"""The process group of a language-model run under ``torchrun``: setup, shards and sums across ranks.

``torchrun --nproc_per_node=N -m rnndrop.lm ...`` starts ``N`` processes with
``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` in their environment; :func:`init_from_env`
reads them and joins the default process group (gloo on the CPU, nccl on CUDA, rank
``r`` on ``cuda:LOCAL_RANK``). Without those variables it does nothing: one process.

What the training loop needs from the other ranks lives here: :func:`shard_columns` (the
batch streams of one rank), :func:`all_reduce_sums` (NLL and token sums, so that
perplexities are exact over a whole split), :func:`all_reduce_reliability` (calibration
bins), :func:`broadcast_from_main` and :func:`run_on_main` (rank 0 reads and writes the
run's files; the others receive what it read, or the error it met).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from rnndrop.calibration import ReliabilityDiagram

__all__ = [
    "ONE_PROCESS",
    "Distributed",
    "RankFailed",
    "all_gather_floats",
    "all_gather_objects",
    "all_reduce_reliability",
    "all_reduce_sums",
    "broadcast_from_main",
    "check_batch_split",
    "current",
    "end_worker",
    "init_from_env",
    "run_on_main",
    "shard_columns",
    "torchrun_world_size",
]

T = TypeVar("T")


class RankFailed(RuntimeError):
    """Raised on the other ranks when rank 0 met an error in a step only it performs
    (reading or writing the run's files); rank 0 raises the original error."""


@dataclass(frozen=True)
class Distributed:
    """Where this process stands in the run: ``rank`` of ``world_size`` (1: no process group)."""

    rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


#: No process group: one process does everything.
ONE_PROCESS = Distributed()


def current() -> Distributed:
    """The default process group's rank, size and backend; one process when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return Distributed(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))
    return ONE_PROCESS


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer (set by torchrun), "
                         f"got {value!r}") from None


def torchrun_world_size() -> int:
    """``WORLD_SIZE`` as torchrun sets it (1 when not launched by torchrun)."""
    world = _env_int("WORLD_SIZE")
    if world is None:
        return 1
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE must be >= 1, got {world}")
    return world


def init_from_env(device: str | torch.device = "auto", timeout: timedelta | None = None
                  ) -> tuple[Distributed, torch.device]:
    """Join the process group torchrun describes in the environment, if any.

    Args:
        device: ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``; under
            torchrun a CUDA rank runs on ``cuda:LOCAL_RANK``.
        timeout: of the process group's collectives (torch's default when None).

    Returns:
        ``(Distributed, device)``. Without torchrun's variables, or with ``WORLD_SIZE=1``,
        no process group is made and the device is resolved as for one process. An
        already initialised default group is used as it is.

    Raises:
        ValueError: inconsistent torchrun variables, or a CUDA device asked for under
            a rank whose ``LOCAL_RANK`` has no GPU.
    """
    requested = str(device)
    use_cuda = torch.cuda.is_available() if requested == "auto" else requested.startswith("cuda")
    if dist.is_available() and dist.is_initialized():
        ctx = current()
        return ctx, _device(ctx.backend) if ctx.enabled else torch.device(
            ("cuda" if use_cuda else "cpu") if requested == "auto" else requested)
    world = torchrun_world_size()
    if world == 1:
        return ONE_PROCESS, torch.device(("cuda" if use_cuda else "cpu") if requested == "auto"
                                           else requested)
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    if rank is None or not 0 <= rank < world:
        raise ValueError(f"environment variable RANK must be in [0, {world}) under torchrun, got {rank}")
    local_rank = 0 if local_rank is None else local_rank
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank} has no GPU: this node has "
                             f"{torch.cuda.device_count()}; start at most that many processes per node")
        run_device = torch.device("cuda", local_rank)
        torch.cuda.set_device(run_device)
    else:
        run_device = torch.device("cpu")
    kwargs: dict[str, Any] = {"backend": "nccl" if use_cuda else "gloo"}
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(**kwargs)
    return current(), run_device


def shard_columns(batched: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s contiguous share of the columns (streams) of ``batched [N, B]``:
    ``[N, B_r]``, the shares as even as they can be (the first ``B % world_size`` ranks
    get one more); together, in rank order, they are ``batched``."""
    if batched.shape[1] < world_size:
        raise ValueError(f"a batch of {batched.shape[1]} streams cannot be shared by {world_size} "
                         "processes: each needs at least one")
    return torch.tensor_split(batched, world_size, dim=1)[rank]


def _device(group_backend: str | None) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if group_backend == "nccl" \
        else torch.device("cpu")


def all_reduce_sums(values: list[float], ctx: Distributed) -> list[float]:
    """Sum each of ``values`` over the ranks (in float64); unchanged for one process."""
    if not ctx.enabled:
        return list(values)
    buffer = torch.tensor(values, dtype=torch.float64, device=_device(ctx.backend))
    dist.all_reduce(buffer)
    return buffer.tolist()


def all_gather_floats(values: list[float], ctx: Distributed) -> list[list[float]]:
    """Every rank's ``values`` (in float64), in rank order, on every rank."""
    if not ctx.enabled:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=_device(ctx.backend))
    out = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def all_reduce_reliability(diagram: ReliabilityDiagram, ctx: Distributed) -> ReliabilityDiagram:
    """The reliability diagram of every rank's predictions together (bins summed)."""
    if not ctx.enabled:
        return diagram
    count = diagram.count.double()
    filled = count > 0
    zero = torch.zeros_like(count)
    sums = torch.stack([
        count,
        torch.where(filled, diagram.confidence * count, zero),
        torch.where(filled, diagram.accuracy * count, zero),
    ]).to(_device(ctx.backend))
    dist.all_reduce(sums)
    count, conf_sum, correct_sum = sums.cpu()
    return ReliabilityDiagram(bin_edges=diagram.bin_edges, confidence=conf_sum / count,
                              accuracy=correct_sum / count, count=count.round().long())


def broadcast_from_main(obj: T, ctx: Distributed) -> T:
    """Rank 0's ``obj`` on every rank (pickled; tensors come back on the CPU as sent)."""
    if not ctx.enabled:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def all_gather_objects(obj: Any, ctx: Distributed) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not ctx.enabled:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def run_on_main(fn: Callable[[], T], ctx: Distributed, what: str) -> T:
    """``fn()`` on rank 0 alone, its value on every rank.

    When ``fn`` raises on rank 0, rank 0 re-raises it and every other rank raises
    :class:`RankFailed` naming ``what`` and the error, so that no rank waits for a
    collective rank 0 will never join. For one process it is ``fn()``.
    """
    if not ctx.enabled:
        return fn()
    value: Any = None
    error: BaseException | None = None
    if ctx.is_main:
        try:
            value = fn()
        except BaseException as e:  # shared before it propagates, Ctrl-C included
            error = e
    status = broadcast_from_main(
        ("error", f"{type(error).__name__}: {error}") if error is not None else ("ok", value), ctx)
    if error is not None:
        raise error
    if status[0] == "error":
        raise RankFailed(f"rank 0 failed while {what}: {status[1]}")
    return status[1]


def end_worker(code: int) -> NoReturn:
    """End a torchrun worker: leave the process group, flush the output, exit with ``code``.

    The interpreter's own teardown is skipped (``os._exit``): with torch 2.13 and gloo a
    worker that has trained under DDP sometimes aborts there ("terminate called without
    an active exception", SIGABRT) after ``destroy_process_group``, which would turn a
    finished run, its files all written and closed, into a failed worker.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_batch_split(batch_size: int, eval_batch_size: int, ctx: Distributed) -> None:
    """Every rank must get as many training streams as the others, and at least one
    evaluation stream."""
    if not ctx.enabled:
        return
    if batch_size % ctx.world_size:
        raise ValueError(f"batch_size must be a multiple of the number of processes ({ctx.world_size}) "
                         f"so that each trains on as many streams, got {batch_size}")
    if eval_batch_size < ctx.world_size:
        raise ValueError(f"eval_batch_size must be >= the number of processes ({ctx.world_size}) so that "
                         f"each scores at least one stream, got {eval_batch_size}")
