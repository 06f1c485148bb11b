"""Everything a run trains with, built before its first epoch (:func:`prepare`).

The order of the steps is part of the run's reproducibility: the generators are seeded,
then the model is built (its initialisation draws from them), then the checkpoint (or
``init_from``) is read and, when resuming, the generators are set to the state saved
after the last finished epoch.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rnndrop.activation_regularization import ActivationRegularization
from rnndrop.distributed import seed_noise_per_rank
from rnndrop.lm.data.corpus import Corpus, batchify
from rnndrop.lm.model.build import build_model, build_optimizer, trainable_parameters
from rnndrop.lm.model.regimes import Regime, get_hook, get_regime, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.averaging import CHECKPOINT_KEY as AVERAGING_KEY
from rnndrop.lm.run.averaging import RunAveraging
from rnndrop.lm.run.checkpoint import load_state, set_rng_state
from rnndrop.lm.run.folder import BEST, CHECKPOINT
from rnndrop.lm.run.identity import run_identity
from rnndrop.lm.run.process_group import Distributed, check_batch_split, run_on_main, shard_columns
from rnndrop.lm.run.recipe import activation_regularizer
from rnndrop.lm.run.resume import read_checkpoint
from rnndrop.lm.run.state import RunState

__all__ = ["Training", "prepare", "rank_device", "resolve_device"]

log = logging.getLogger(__name__)

ExtraLoss = Callable[[float], Tensor]


@dataclass
class Training:
    """One run as the epoch loop and the end of the run see it.

    Attributes:
        corpus, config, regime, seed, out, dataset: as passed to
            :func:`rnndrop.lm.run.train.train_run`;
            ``rules`` the regime itself, ``dropout`` its probability per site.
        identity: :func:`rnndrop.lm.run.identity.run_identity` of the run.
        device, ctx: where it trains, and its process group.
        mc_samples: samples of the Monte-Carlo test perplexity (0: none).
        model: the language model; ``net`` what is called in training (``model`` or its
            DDP wrapper; ``model`` again once training is over).
        optimizer: the config's optimiser over the trainable parameters.
        extra_loss: ``progress -> tensor`` the regime adds to the loss, or None.
        train_stream: this rank's training streams ``[N, B]``; ``valid_data``,
            ``test_data`` the evaluation streams ``[N, eval_batch_size]``.
        state: the progress (:class:`RunState`, resumed from the checkpoint).
        wall_start: ``time.perf_counter()`` when wall time was last added to ``state``.
        activation_reg: AR / TAR at the config's weights, or None (:mod:`rnndrop.lm.run.recipe`).
        averaging: NT-ASGD (:class:`~rnndrop.lm.run.averaging.RunAveraging`), or None.
    """

    corpus: Corpus
    config: TrainConfig
    regime: str
    rules: Regime
    dropout: dict[str, float]
    seed: int
    out: Path
    dataset: str
    identity: dict[str, Any]
    device: torch.device
    ctx: Distributed
    mc_samples: int
    model: nn.Module
    net: nn.Module
    optimizer: torch.optim.Optimizer
    extra_loss: ExtraLoss | None
    train_stream: Tensor
    valid_data: Tensor
    test_data: Tensor
    state: RunState
    wall_start: float
    activation_reg: ActivationRegularization | None = None
    averaging: RunAveraging | None = None

    @property
    def evaluation_model(self) -> nn.Module:
        """What is validated, saved as best and tested: the averaged weights once NT-ASGD
        averages, else the model."""
        return self.model if self.averaging is None else self.averaging.evaluation_model

    @property
    def checkpoint_path(self) -> Path:
        return self.out / CHECKPOINT

    @property
    def best_path(self) -> Path:
        return self.out / BEST


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else the CPU. A device this machine does not have is a
    ValueError that says so (torch would fail later with an AssertionError deep inside)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {str(device)!r}: {why}; use --device cpu (or auto)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ValueError(f"device {str(device)!r}: this machine has {count} CUDA GPU(s)")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r}: MPS is not available here; use --device cpu (or auto)")
    return resolved


def rank_device(device: str | torch.device, ctx: Distributed) -> torch.device:
    """:func:`resolve_device`; under DDP a bare ``cuda`` is this rank's GPU (the current
    device, which :func:`rnndrop.lm.run.process_group.init_from_env` set to ``LOCAL_RANK``)."""
    device = resolve_device(device)
    if ctx.enabled and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def prepare(
    corpus: Corpus, config: TrainConfig, regime: str, out: Path, *, dropout: Mapping[str, float] | None,
    seed: int, resume: bool, device: str | torch.device, mc_samples: int | None,
    init_from: str | Path | None, dataset: str, ctx: Distributed,
) -> Training:
    """Check the arguments, seed, build the model, the data and the optimiser, and restore
    the checkpoint in ``out`` when resuming (see :func:`rnndrop.lm.run.resume.read_checkpoint`)."""
    wall_start = time.perf_counter()
    rules = get_regime(regime)
    probabilities = regime_probabilities(rules, config.dropout if dropout is None else dropout)
    identity = run_on_main(partial(run_identity, corpus, config, regime, probabilities, seed, init_from),
                           ctx, "making the run's identity")
    device = rank_device(device, ctx)
    mc_samples = config.mc_samples if mc_samples is None else mc_samples
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
        raise ValueError(f"mc_samples must be an int >= 0, got {mc_samples!r}")
    check_batch_split(config.batch_size, config.eval_batch_size, ctx)

    torch.manual_seed(seed)
    random.seed(seed)
    model = build_model(len(corpus.vocab), config, rules, probabilities).to(device)
    train_data = batchify(corpus.train, config.batch_size).to(device)
    # The KL of an ELBO is divided by the whole training stream, not by one rank's shard.
    extra_loss = _extra_loss(model, config, rules, train_data.numel())
    valid_data = batchify(corpus.valid, config.eval_batch_size).to(device)
    test_data = batchify(corpus.test, config.eval_batch_size).to(device)

    # Rank 0 reads; every rank gets the checkpoint (init_from weights reach the other ranks
    # through DDP's broadcast of rank 0's parameters).
    ckpt, state, loaded_init = run_on_main(
        partial(read_checkpoint, out, identity, config, model, resume=resume, init_from=init_from,
                vocab=corpus.vocab.itos, ctx=ctx),
        ctx, f"reading the checkpoint in {str(out)!r}",
    )
    optimizer = build_optimizer(trainable_parameters(model, config), config)
    averaging = RunAveraging(model, config) if config.nt_asgd else None
    if ckpt is not None and state is not None:
        load_state(model, ckpt["model"], out / CHECKPOINT)
        load_state(optimizer, ckpt["optimizer"], out / CHECKPOINT, "optimizer")
        if averaging is not None:
            averaging.load_state_dict(ckpt.get(AVERAGING_KEY), f"the checkpoint in {str(out)!r}")
        set_rng_state(ckpt["distributed"]["rng"][ctx.rank] if ctx.enabled else ckpt["rng"])
        log.info("%s: resumed after epoch %d", out, state.epoch)
    else:
        state = RunState(lr=config.lr, init_from=loaded_init)
        if ctx.enabled:
            seed_noise_per_rank(seed, ctx.rank)  # the weights came from `seed`; each rank its own masks
    net: nn.Module = model
    train_stream = train_data
    if ctx.enabled:
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        train_stream = shard_columns(train_data, ctx.rank, ctx.world_size)
    return Training(
        corpus=corpus, config=config, regime=regime, rules=rules, dropout=probabilities, seed=seed,
        out=out, dataset=dataset, identity=identity, device=device, ctx=ctx, mc_samples=mc_samples,
        model=model, net=net, optimizer=optimizer, extra_loss=extra_loss, train_stream=train_stream,
        valid_data=valid_data, test_data=test_data, state=state, wall_start=wall_start,
        activation_reg=activation_regularizer(config), averaging=averaging,
    )


def _extra_loss(model: nn.Module, config: TrainConfig, regime: Regime, train_tokens: int) -> ExtraLoss | None:
    """``progress -> kl_weight * regularizer(model, progress, train_tokens)``, the term the
    regime adds to the loss; None without a regularizer or with ``kl_weight`` 0 (then the
    KL is not computed at all)."""
    if regime.regularizer is None or not config.kl_weight:
        return None
    hook = get_hook(regime.regularizer)
    return lambda progress: config.kl_weight * hook(model, progress, train_tokens)
