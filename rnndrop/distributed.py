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

What "shared by the batch" means under DDP: the batch a mask is shared by is each rank's
shard. ``mask_scope="batch"`` draws one recurrent mask per rank and call,
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

import torch
from torch import nn

__all__ = ["check_noise_independent", "check_parameters_agree", "rank_seed", "seed_noise_per_rank"]


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


def _rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def seed_noise_per_rank(seed: int, rank: int | None = None) -> int:
    """Seed torch's global generators (CPU and every CUDA device) with :func:`rank_seed`.

    Call it on every rank after the model is built (the weights then come from ``seed``
    and agree across ranks; the masks drawn from here on differ).

    Args:
        seed: the run's seed, the same on every rank.
        rank: this process's rank; default the rank in the default process group (0
            when none is initialised).

    Returns:
        The seed given to ``torch.manual_seed``.
    """
    chosen = rank_seed(seed, _rank(rank))
    torch.manual_seed(chosen)
    return chosen


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
    digests = _gather_digests(hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest())
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
