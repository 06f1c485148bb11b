"""Dropout under DistributedDataParallel: the same initial weights on every rank, its own noise on each.

Every mask rnndrop draws (:mod:`rnndrop.masks`, :class:`~rnndrop.WeightDrop`, the weight
samples of the sparse layers, the Gaussian noise) comes from torch's global generator.
Ranks that are seeded alike so that they build identical initial weights therefore also
draw identical masks, step after step: every rank drops the same units of its shard, and
the regularisation the user asked for is silently weaker (one mask where the whole batch
should see several). The recipe is to seed alike, build the model, then give each rank a
noise stream of its own::

    torch.manual_seed(seed)                          # the same on every rank
    model = build_model()                            # identical initial weights
    ddp = DistributedDataParallel(model)             # (it also broadcasts rank 0's weights)
    rnndrop.distributed.seed_noise_per_rank(seed)    # each rank its own masks from here on
    rnndrop.distributed.check_noise_independent()    # optional: raises if two ranks share a stream

Gradients are averaged by DDP, so the parameters stay identical on every rank
(:func:`check_parameters_agree` verifies it, bit for bit).

**The default: per-rank noise whenever a process group is initialised.** Scripts that seed every
rank alike and never call :func:`seed_noise_per_rank` (Lightning's ``seed_everything``, most DDP
scripts) are caught at rnndrop's first draw of noise from torch's global generator in a process
whose default process group is initialised with two ranks or more: every rank hashes its CPU
generator state and the ranks compare the hashes (one ``all_gather_object``, once per process;
under DDP every rank reaches its first draw in the same step). Only a draw under autograd (a
training step) checks: a draw under ``torch.no_grad`` (evaluation, Monte-Carlo prediction, which
a script may run on one rank alone, where a collective would wait forever) leaves the check to
the first training step. Inside a graph of ``torch.compile`` no check can run:
:func:`rnndrop.compile_model` checks before each call, a bare ``torch.compile`` needs
:func:`seed_noise_per_rank`. If any two ranks hold the same
state, every rank calls ``seed_noise_per_rank(torch.initial_seed())``, the recipe above, and
warns once: the masks are then reproducible from the seed and the rank
(:func:`rank_seed`). If the states already differ (each rank seeded its own way, or a resumed run
restored each rank's state) nothing changes. After :func:`seed_noise_per_rank` no check is made;
``auto_noise_per_rank(False)`` turns the check off (identical masks on every rank, if wanted).
Noise drawn from a ``generator=`` of the caller's is not the global generator's and is not checked.

What "shared by the batch" means under DDP: the batch a mask is shared by is each rank's
shard. ``mask_scope="batch"`` draws one recurrent (and between-layer) mask per rank and call,
:class:`~rnndrop.WeightDrop` one ``W_hh`` mask per rank and call, the sparse layers one
weight sample per rank and call, ``EmbeddingDropout(scope="batch")`` one set of dropped
word types per rank and call. With ``N`` ranks the global batch sees ``N`` independent
draws, and the averaged gradient is that of ``N`` sub-batches each under its own noise:
the same objective in expectation as one process with one draw for the whole batch, with
a lower variance. Per-sequence and per-step masks are unaffected (each sequence lives on
one rank).
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch
from torch import nn

__all__ = [
    "auto_noise_per_rank",
    "check_noise_independent",
    "check_parameters_agree",
    "ensure_noise_per_rank",
    "rank_seed",
    "seed_noise_per_rank",
]

#: Whether :func:`ensure_noise_per_rank` checks (see the module docstring).
_auto = True
#: Whether this process's noise stream is settled: checked at the first draw under a process
#: group, or seeded by :func:`seed_noise_per_rank`.
_settled = False


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s noise stream: a 63-bit hash of ``(seed, rank)``.

    Distinct from ``seed`` itself, so that no rank draws its masks from the numbers that
    initialised the weights, and distinct between ranks.
    """
    for name, value in (("seed", seed), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    digest = hashlib.sha256(f"rnndrop noise stream {seed} {rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _rank(rank: int | None) -> int | None:
    """``rank``, else the rank of the default process group, else torchrun's ``RANK`` variable;
    None where nothing says it."""
    if rank is not None:
        return rank
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    from_env = os.environ.get("RANK", "")
    return int(from_env) if from_env.isdigit() else None


def seed_noise_per_rank(seed: int, rank: int | None = None) -> int:
    """Seed torch's global generators (CPU and every CUDA device) with :func:`rank_seed`.

    Call it on every rank after the model is built (the weights then come from ``seed``
    and agree across ranks; the masks drawn from here on differ).

    Args:
        seed: the run's seed, the same on every rank.
        rank: this process's rank; default the rank in the default process group, or before
            one is initialised torchrun's ``RANK`` variable, else 0. Where nothing gave the rank
            (0 taken), the check of the first training step under a process group still runs:
            ranks that all took 0 are caught there.

    Returns:
        The seed given to ``torch.manual_seed``.
    """
    global _settled
    known = _rank(rank)
    chosen = rank_seed(seed, 0 if known is None else known)
    torch.manual_seed(chosen)
    _settled = _settled or known is not None
    return chosen


def auto_noise_per_rank(enabled: bool = True) -> None:
    """Turn on (the default) or off the check of :func:`ensure_noise_per_rank`."""
    global _auto
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _auto = enabled


def ensure_noise_per_rank() -> None:
    """Give each rank its own noise stream if the ranks share one (see the module docstring).

    rnndrop calls it before it draws noise from torch's global generator; it returns at once
    except at the first draw under autograd in a process with an initialised process group of
    two ranks or more, where it is a collective (all ranks reach their first training step
    together under DDP).
    """
    global _settled
    if _settled or not _auto or not torch.is_grad_enabled():
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or torch.compiler.is_compiling():
        return
    _settled = True
    if dist.get_world_size() == 1:
        return
    digests = _gather_digests(_rng_digest())
    if len(set(digests)) == len(digests):
        return
    seed = torch.initial_seed()
    chosen = seed_noise_per_rank(seed)
    alike = sum(1 for digest in digests if digests.count(digest) > 1)
    which = f"the {len(digests)}" if alike == len(digests) else f"{alike} of the {len(digests)}"
    warnings.warn(
        f"rnndrop: {which} ranks of the process group held the same random generator "
        f"state, so they would have drawn the same dropout masks; each rank now draws its own "
        f"(torch.manual_seed(rnndrop.distributed.rank_seed({seed}, rank)), here {chosen}). Call "
        "rnndrop.distributed.seed_noise_per_rank(seed) after building the model to choose the "
        "point yourself, or auto_noise_per_rank(False) to keep the shared stream",
        stacklevel=2,
    )


def _rng_digest() -> str:
    """A hash of the generators rnndrop's noise comes from: the CPU's, and the current CUDA
    device's where CUDA is in use (masks of CUDA tensors come from it)."""
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        digest.update(torch.cuda.get_rng_state().numpy().tobytes())
    return digest.hexdigest()


def _gather_digests(digest: str) -> list[str]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [digest]
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    return [str(d) for d in digests]


def check_noise_independent() -> None:
    """Raise ``RuntimeError`` if two ranks hold the same state of torch's CPU generator
    (they would draw the same masks). A collective: call it on every rank."""
    digests = _gather_digests(_rng_digest())
    seen: dict[str, int] = {}
    for rank, digest in enumerate(digests):
        if digest in seen:
            raise RuntimeError(
                f"ranks {seen[digest]} and {rank} hold the same random generator state and would "
                "draw the same dropout masks; call rnndrop.distributed.seed_noise_per_rank(seed) "
                "on every rank after building the model"
            )
        seen[digest] = rank


def _parameters_digest(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, parameter in module.named_parameters():
        digest.update(name.encode())
        digest.update(parameter.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_parameters_agree(module: nn.Module) -> None:
    """Raise ``RuntimeError`` unless every rank holds bit-identical parameters in ``module``.

    DDP keeps replicas equal by averaging gradients; a rank that updates differently
    (a missed all-reduce, a nondeterministic step) is caught here. A collective: call it
    on every rank (it moves the parameters to the CPU to hash them).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    digests = _gather_digests(_parameters_digest(module))
    differing = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise RuntimeError(
            f"the parameters of rank(s) {differing} differ from rank 0's: the replicas have "
            "diverged (were gradients all-reduced before every optimiser step?)"
        )
