"""Training and evaluation of one language-model run, with verified checkpoints and resume.

One run = (corpus, config, regime, dropout probabilities, seed) written to a folder of
its own:

- ``checkpoint.pt``: model, optimizer, RNG states, epoch, learning rate, best
  validation perplexity and the history, after every epoch; ``checkpoint.prev.pt``:
  the one before it, kept until the new one is written and verified;
- ``best.pt``: the weights of the best validation epoch with the config, regime,
  dropout and vocabulary that rebuild the model (:func:`rnndrop.lm.load_model`);
- ``results.json`` (with a SHA-256 of its content) and ``curve.png`` when the run has
  finished; ``run.lock`` while a process writes into the folder.

Checkpoints are verified on load (:mod:`rnndrop.lm.run.checkpoint`); what makes two runs
the same run is :mod:`rnndrop.lm.run.identity`. ``train_run(...,
resume=True)`` continues from ``checkpoint.pt`` (or, with a logged warning, from
``checkpoint.prev.pt`` when the newest is corrupt): the run ends in the very state
(bit for bit) an uninterrupted run with the same seed reaches, and no finished epoch
is lost. A run resumes only into the same run (:func:`run_identity`: corpus, config
but the epoch cap, regime, dropout, seed, starting weights, format version); the
epoch cap may grow but not shrink below the epochs already run (an error).

Training follows Zaremba et al.: contiguous batches, truncated BPTT with the hidden
state carried (detached) across segments and reset at every epoch, gradient-norm
clipping, and the optimiser the config names (SGD or Adam).

Under ``torchrun`` (a default process group of N > 1 ranks, see
:mod:`rnndrop.lm.run.process_group`) the same call on every rank trains one model with
DistributedDataParallel: each rank takes ``batch_size / N`` contiguous streams, DDP
averages the gradients before they are clipped, validation and test sums are added over
the ranks, each rank draws its own dropout noise (:mod:`rnndrop.distributed`), and rank 0
alone reads and writes the run's files. The checkpoint holds every rank's RNG state; it
resumes with the same N only.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rnndrop.distributed import check_parameters_agree, seed_noise_per_rank
from rnndrop.lm.data.corpus import Corpus, batchify, bptt_batches, num_bptt_batches
from rnndrop.lm.model.configs import (
    TrainConfig,
    build_model,
    build_optimizer,
    trainable_parameters,
)
from rnndrop.lm.model.language_model import detach_hidden
from rnndrop.lm.model.regimes import Regime, get_hook, get_regime, regime_probabilities
from rnndrop.lm.run.atomic import remove_stale_temporaries
from rnndrop.lm.run.checkpoint import (
    CheckpointError,
    get_rng_state,
    load_checkpoint,
    load_latest,
    load_model,
    save_checkpoint,
    set_rng_state,
)
from rnndrop.lm.run.evaluate import (
    CALIBRATION_BINS,
    MAX_NLL,
    Score,
    has_noise,
    perplexity,
    score_split,
    token_loss,
)
from rnndrop.lm.run.folder import BEST, CHECKPOINT, CURVE, RESULTS, previous_path
from rnndrop.lm.run.identity import (
    best_file,
    file_sha256,
    identity_differences,
    read_verified_result,
    run_identity,
    write_signed_result,
)
from rnndrop.lm.run.lock import RunLock
from rnndrop.lm.run.process_group import (
    ONE_PROCESS,
    Distributed,
    all_gather_floats,
    all_gather_objects,
    all_reduce_sums,
    check_batch_split,
    current,
    run_on_main,
    shard_columns,
)
from rnndrop.lm.run.progress import EpochProgress
from rnndrop.lm.run.results import SCHEMA, peak_memory, plot_learning_curves, versions

__all__ = [
    "EpochCallback",
    "RunInterrupted",
    "TrainingDiverged",
    "add_mc_result",
    "resolve_device",
    "train_run",
]

log = logging.getLogger(__name__)



EpochCallback = Callable[[int, Mapping[str, Any]], None]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient became NaN or infinite (or the perplexity overflowed)."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (KeyboardInterrupt) during :func:`train_run`.

    Attributes:
        epoch: the epoch that was interrupted (the finished epochs before it are in
            the checkpoint; rerun with ``resume=True`` to continue bit for bit).
        folder: the run's folder.
    """

    def __init__(self, epoch: int, folder: Path) -> None:
        super().__init__(f"interrupted during epoch {epoch} of the run in {str(folder)!r}; "
                         f"epochs before it are saved, resume=True (--resume) continues from there")
        self.epoch = epoch
        self.folder = folder


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else the CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _epoch_lr(config: TrainConfig, epoch: int, current: float) -> float:
    if config.schedule == "fixed":
        return config.lr / config.lr_decay ** max(0, epoch - config.decay_after)
    return current


# ---------------------------------------------------------------------------------------
# Training


def _train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batched: Tensor,
    config: TrainConfig,
    epoch: int,
    extra_loss: Callable[[float], Tensor] | None,
    progress: bool,
    checkpoint_path: Path,
    last_good_epoch: int,
    ctx: Distributed = ONE_PROCESS,
    net: nn.Module | None = None,
) -> tuple[float, int, float]:
    """One pass over the training stream: (train perplexity, words, seconds).

    ``extra_loss(progress)`` is added to the mean NLL (``progress`` runs from 0 to 1 over
    training). Under DDP ``batched`` is this rank's shard and ``net`` the DDP wrapper of
    ``model`` (what is called; its backward all-reduces the gradients before they are
    clipped); perplexity and words are those of every rank together.
    """
    net = model if net is None else net
    net.train()
    n_batches = num_bptt_batches(batched, config.bptt)
    bar = EpochProgress(n_batches, f"epoch {epoch}", progress and ctx.is_main)
    total, words, hidden = 0.0, 0, None
    start = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]

    def diverged(what: str, batch: int) -> None:
        _diverged(what, epoch, batch, n_batches, lr, checkpoint_path, last_good_epoch, ctx)

    try:
        for i, (inputs, targets) in enumerate(bptt_batches(batched, config.bptt)):
            logits, hidden = net(inputs, hidden)
            hidden = detach_hidden(hidden)
            loss = token_loss(logits, targets)
            objective = loss
            if extra_loss is not None:
                objective = loss + extra_loss((epoch - 1 + i / n_batches) / config.epochs)
            if ctx.enabled:
                _check_losses_on_every_rank(objective, loss, ctx, diverged, i)
            else:
                if not torch.isfinite(objective):
                    diverged(f"the training loss is {objective.item()}", i)
                if loss.item() > MAX_NLL:
                    diverged(f"the training loss is {loss.item():.4g} nats per word (the perplexity "
                             "overflows)", i)
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), config.clip)
            if not torch.isfinite(grad_norm):
                diverged(f"the gradient norm is {grad_norm.item()}", i)
            optimizer.step()
            total += loss.item() * targets.numel()
            words += targets.numel()
            elapsed = time.perf_counter() - start
            bar.update(ppl=perplexity(total / words), wps=words * ctx.world_size / max(elapsed, 1e-9))
    finally:
        bar.close()
    if ctx.enabled:
        total, all_words = all_reduce_sums([total, words], ctx)
        words = round(all_words)
    return perplexity(total / words), words, time.perf_counter() - start


def _selection_criterion(
    config: TrainConfig, valid: Score, extra_loss: Callable[[float], Tensor] | None
) -> float:
    """What the best epoch minimises: the validation perplexity, or (``select="objective"``)
    the validation NLL per word plus the extra loss at the end of training (full weight)."""
    if config.select == "perplexity":
        return valid.perplexity
    if extra_loss is None:
        return valid.nll
    with torch.no_grad():
        return valid.nll + float(extra_loss(1.0))


def _extra_loss(
    model: nn.Module, config: TrainConfig, regime: Regime, train_tokens: int
) -> Callable[[float], Tensor] | None:
    """``progress -> kl_weight * regularizer(model, progress, train_tokens)``, the term the
    regime adds to the loss; None without a regularizer or with ``kl_weight`` 0 (then the
    KL is not computed at all)."""
    if regime.regularizer is None or not config.kl_weight:
        return None
    hook = get_hook(regime.regularizer)
    return lambda progress: config.kl_weight * hook(model, progress, train_tokens)


def _seed_noise(seed: int, ctx: Distributed) -> None:
    """Seed the dropout noise of an evaluation: ``seed`` itself in one process, each rank
    its own stream under DDP."""
    if ctx.enabled:
        seed_noise_per_rank(seed, ctx.rank)
    else:
        torch.manual_seed(seed)


def _check_losses_on_every_rank(
    objective: Tensor, loss: Tensor, ctx: Distributed, diverged: Callable[[str, int], None], batch: int
) -> None:
    """The divergence checks of one step, decided together: every rank learns every rank's
    loss before any of them enters the backward pass (and its all-reduce)."""
    values = all_gather_floats([objective.item(), loss.item()], ctx)
    for rank, (rank_objective, rank_loss) in enumerate(values):
        if not math.isfinite(rank_objective):
            diverged(f"the training loss is {rank_objective} on rank {rank}", batch)
        if rank_loss > MAX_NLL:
            diverged(f"the training loss is {rank_loss:.4g} nats per word on rank {rank} (the "
                     "perplexity overflows)", batch)


def _diverged(what: str, epoch: int, batch: int, n_batches: int, lr: float,
              checkpoint_path: Path, last_good_epoch: int, ctx: Distributed = ONE_PROCESS) -> None:
    if not last_good_epoch:
        where = "no epoch had finished, so there is no checkpoint"
    elif not ctx.is_main:
        where = f"rank 0 keeps the checkpoint of epoch {last_good_epoch}"
    else:
        try:
            load_checkpoint(checkpoint_path)
            where = (f"the checkpoint {str(checkpoint_path)!r} of epoch {last_good_epoch} was verified "
                     "(SHA-256) and is kept")
        except (OSError, CheckpointError) as e:
            where = f"the checkpoint of epoch {last_good_epoch} failed verification: {e}"
    raise TrainingDiverged(
        f"training stopped: {what} at epoch {epoch}, batch {batch + 1}/{n_batches} (lr {lr:g}); "
        f"{where}. Lower the learning rate or the clipping threshold and start again."
    )


def _load_initial_weights(model: nn.Module, init_from: str | Path) -> dict[str, Any]:
    """Copy into ``model`` every tensor of another run's best.pt that it has (same name and
    shape); the others keep their initialisation. Returns what was loaded, for the results."""
    best = best_file(init_from)
    source = load_checkpoint(best)["model"]
    own = model.state_dict()
    mismatched = [f"{k}: {list(v.shape)} there vs {list(own[k].shape)} here"
                  for k, v in source.items() if k in own and v.shape != own[k].shape]
    if mismatched:
        raise ValueError(f"init_from {str(best)!r}: tensors of other shapes: {'; '.join(mismatched)}")
    loaded = sorted(k for k in source if k in own)
    kept = sorted(k for k in own if k not in source)
    ignored = sorted(k for k in source if k not in own)
    model.load_state_dict({k: source[k] for k in loaded}, strict=False)
    log.info("init_from %s: loaded %d tensors (%s); kept the initialisation of %s; ignored %s",
             best, len(loaded), ", ".join(loaded), ", ".join(kept) or "none", ", ".join(ignored) or "none")
    return {"path": str(best), "sha256": file_sha256(best), "loaded": loaded, "kept_init": kept,
            "ignored": ignored}


def train_run(
    corpus: Corpus,
    config: TrainConfig,
    regime: str,
    out_dir: str | Path,
    *,
    dropout: Mapping[str, float] | None = None,
    seed: int = 1,
    resume: bool = False,
    device: str | torch.device = "auto",
    mc_samples: int | None = None,
    progress: bool = True,
    dataset: str = "",
    on_epoch_end: EpochCallback | None = None,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train one run to the end (or resume it) and return its result (also in results.json).

    Args:
        corpus: the data (see :func:`rnndrop.lm.data.corpus.load_corpus`).
        config: model size and optimisation.
        regime: a key of :data:`rnndrop.lm.model.regimes.REGIMES`.
        out_dir: the run's folder (locked while the run writes into it).
        dropout: probability per site; default ``config.dropout``. Sites the regime
            does not use get 0.
        seed: seeds torch's and Python's generators (initialisation and masks).
        resume: continue from ``out_dir/checkpoint.pt`` if it exists. Without it, a
            folder that already holds a checkpoint is an error (nothing is overwritten).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``...
        mc_samples: samples for the Monte-Carlo test perplexity; default
            ``config.mc_samples``; 0 skips it (so does a model without dropout).
        progress: show a progress bar (tqdm if installed, else log lines).
        dataset: a name for the result file.
        on_epoch_end: called as ``on_epoch_end(epoch, record)`` after each epoch's
            checkpoint is written.
        init_from: a run folder or its ``best.pt``: start from those weights (every
            tensor of the same name and shape; the others, e.g. the ``log_sigma2_*`` of
            sparse VD, keep their initialisation). With regime ``sparse_vd`` this is the
            recipe "train dense, then fine-tune with sparse VD". Recorded in the results.

    Under torchrun (an initialised default process group of N > 1 ranks, e.g. from
    :func:`rnndrop.lm.run.process_group.init_from_env`) call it on every rank with the same
    arguments: see the module docstring. ``batch_size`` must be a multiple of N and
    ``eval_batch_size`` at least N; ``on_epoch_end`` is called on every rank; every rank
    returns rank 0's result, which records ``world_size`` and ``backend``.

    Raises:
        TrainingDiverged: a NaN / infinite loss or gradient, or a perplexity that
            overflows (the checkpoint of the last finished epoch is left as it was).
        RunInterrupted: Ctrl-C; finished epochs are saved, resume continues bit for bit.
        RunLocked: another process is writing into ``out_dir``.
        PermissionError: ``out_dir`` is not writable (checked before training).
        FileExistsError: ``out_dir`` holds a checkpoint and ``resume`` is False.
        CheckpointError: a checkpoint that fails verification (and no intact previous one).
        ValueError: the checkpoint belongs to another run (the message names the fields
            that differ), or ``config.epochs`` is below the epochs it has already run, or it
            was written by another number of processes.
        RankFailed: (ranks other than 0) rank 0 met one of the errors above.
    """
    out = Path(out_dir)
    ctx = current()
    with ExitStack() as stack:

        def claim_folder() -> None:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except PermissionError as e:
                raise PermissionError(
                    f"output folder {str(out)!r} cannot be created ({e.strerror})") from None
            stack.enter_context(RunLock(out))
            removed = remove_stale_temporaries(out)
            if removed:
                log.warning("%s: removed %d temporary files left by a killed write: %s", out, len(removed),
                            ", ".join(p.name for p in removed))

        run_on_main(claim_folder, ctx, f"taking the run folder {str(out)!r}")
        return _train_locked(corpus, config, regime, out, dropout=dropout, seed=seed, resume=resume,
                             device=device, mc_samples=mc_samples, progress=progress, dataset=dataset,
                             on_epoch_end=on_epoch_end, init_from=init_from, ctx=ctx)


def _rank_device(device: str | torch.device, ctx: Distributed) -> torch.device:
    """:func:`resolve_device`; under DDP a bare ``cuda`` is this rank's GPU (the current
    device, which :func:`rnndrop.lm.run.process_group.init_from_env` set to ``LOCAL_RANK``)."""
    device = resolve_device(device)
    if ctx.enabled and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _checkpoint_world_size(ckpt: Mapping[str, Any]) -> int:
    return int(ckpt.get("distributed", {}).get("world_size", 1))


def _read_checkpoint(
    out: Path, identity: dict[str, Any], config: TrainConfig, model: nn.Module, *, resume: bool,
    init_from: str | Path | None, ctx: Distributed,
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the checkpoint in ``out`` to resume from, or None; what ``init_from`` loaded into
    ``model``, or None), every check done: a checkpoint there needs ``resume``, belongs to
    this run, has not trained past the epoch cap, was written by as many processes, and
    its ``best.pt`` verifies."""
    ckpt_path, best_path = out / CHECKPOINT, out / BEST
    has_checkpoint = ckpt_path.exists() or previous_path(ckpt_path).exists()
    if has_checkpoint and not resume:
        raise FileExistsError(
            f"{str(out)!r} already holds a checkpoint; pass resume=True (--resume) to "
            "continue that run, or choose another output folder"
        )
    ckpt = load_latest(ckpt_path) if has_checkpoint else None
    if ckpt is None:
        return None, None if init_from is None else _load_initial_weights(model, init_from)
    differences = identity_differences(identity, ckpt.get("identity", {}))
    if differences:
        raise ValueError(
            f"the checkpoint in {str(out)!r} belongs to another run; what differs (this "
            f"call vs the checkpoint): {'; '.join(differences)}. Choose another output folder"
        )
    if ckpt["progress"]["epoch"] > config.epochs:
        raise ValueError(
            f"epochs must be >= {ckpt['progress']['epoch']}, the epochs the run in {str(out)!r} "
            f"has already trained, got {config.epochs} (the epoch cap of a run may grow, not shrink)"
        )
    if _checkpoint_world_size(ckpt) != ctx.world_size:
        raise ValueError(
            f"the checkpoint in {str(out)!r} was written by {_checkpoint_world_size(ckpt)} "
            f"process(es); resume it with as many (torchrun --nproc_per_node), got {ctx.world_size}"
        )
    if ckpt["progress"]["best_epoch"]:
        load_checkpoint(best_path)  # verify it now rather than after training
    return ckpt, None


def _train_locked(
    corpus: Corpus, config: TrainConfig, regime: str, out: Path, *, dropout: Mapping[str, float] | None,
    seed: int, resume: bool, device: str | torch.device, mc_samples: int | None, progress: bool,
    dataset: str, on_epoch_end: EpochCallback | None, init_from: str | Path | None,
    ctx: Distributed = ONE_PROCESS,
) -> dict[str, Any]:
    wall_start = time.perf_counter()
    ckpt_path, best_path = out / CHECKPOINT, out / BEST
    regime_obj = get_regime(regime)
    probabilities = regime_probabilities(regime_obj, config.dropout if dropout is None else dropout)
    identity = run_on_main(partial(run_identity, corpus, config, regime, probabilities, seed, init_from),
                           ctx, "making the run's identity")
    device = _rank_device(device, ctx)
    mc_samples = config.mc_samples if mc_samples is None else mc_samples
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
        raise ValueError(f"mc_samples must be an int >= 0, got {mc_samples!r}")
    check_batch_split(config.batch_size, config.eval_batch_size, ctx)

    torch.manual_seed(seed)
    random.seed(seed)
    model = build_model(len(corpus.vocab), config, regime_obj, probabilities).to(device)
    train_data = batchify(corpus.train, config.batch_size).to(device)
    # The KL of an ELBO is divided by the whole training stream, not by one rank's shard.
    extra_loss = _extra_loss(model, config, regime_obj, train_data.numel())
    valid_data = batchify(corpus.valid, config.eval_batch_size).to(device)
    test_data = batchify(corpus.test, config.eval_batch_size).to(device)

    state: dict[str, Any] = {
        "epoch": 0, "lr": config.lr, "best_valid_ppl": math.inf, "best_epoch": 0,
        "history": [], "train_seconds": 0.0, "train_words": 0, "wall_seconds": 0.0,
        "stopped": None, "init_from": None,
    }

    # Rank 0 reads; every rank gets the checkpoint (init_from weights reach the other ranks
    # through DDP's broadcast of rank 0's parameters).
    ckpt, loaded_init = run_on_main(
        partial(_read_checkpoint, out, identity, config, model, resume=resume, init_from=init_from, ctx=ctx),
        ctx, f"reading the checkpoint in {str(out)!r}",
    )
    if loaded_init is not None:
        state["init_from"] = loaded_init
    optimizer = build_optimizer(trainable_parameters(model, config), config)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state.update(ckpt["progress"])
        set_rng_state(ckpt["distributed"]["rng"][ctx.rank] if ctx.enabled else ckpt["rng"])
        log.info("%s: resumed after epoch %d", out, state["epoch"])
    elif ctx.enabled:
        seed_noise_per_rank(seed, ctx.rank)  # the weights came from `seed`; each rank its own masks
    net: nn.Module = model
    train_stream = train_data
    if ctx.enabled:
        net = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        train_stream = shard_columns(train_data, ctx.rank, ctx.world_size)

    best_extras = {
        "config": config.to_dict(), "regime": regime, "regime_settings": regime_obj.settings(),
        "dropout": probabilities, "vocab": list(corpus.vocab.itos), "identity": identity,
    }
    epoch = state["epoch"] + 1
    try:
        for epoch in range(state["epoch"] + 1, config.epochs + 1):
            if state.get("stopped"):
                break
            lr = _epoch_lr(config, epoch, state["lr"])
            for group in optimizer.param_groups:
                group["lr"] = lr
            train_ppl, words, seconds = _train_epoch(
                model, optimizer, train_stream, config, epoch, extra_loss, progress,
                ckpt_path, state["epoch"], ctx, net,
            )
            valid = score_split(model, valid_data, config.bptt, None, ctx)
            valid_ppl = valid.perplexity
            if not math.isfinite(valid_ppl):
                _diverged(f"the validation perplexity is {valid_ppl}", epoch,
                          num_bptt_batches(train_data, config.bptt) - 1,
                          num_bptt_batches(train_data, config.bptt), lr, ckpt_path, state["epoch"], ctx)
            criterion = _selection_criterion(config, valid, extra_loss)
            improved = criterion < state.get("best_criterion", state["best_valid_ppl"])
            if improved:
                state["best_valid_ppl"], state["best_epoch"] = valid_ppl, epoch
                state["best_criterion"] = criterion
                run_on_main(partial(save_checkpoint, {"model": model.state_dict(), "epoch": epoch,
                                                      **best_extras}, best_path), ctx, "writing best.pt")
            next_lr = lr / config.lr_decay if config.schedule == "plateau" and not improved else lr
            record = {
                "epoch": epoch, "lr": lr, "train_ppl": train_ppl, "valid_ppl": valid_ppl,
                "seconds": seconds, "words_per_second": words / seconds,
            }
            if config.select == "objective":
                record["valid_objective"] = criterion
            state["history"] = [*state["history"], record]
            state.update(epoch=epoch, lr=next_lr, train_seconds=state["train_seconds"] + seconds,
                         train_words=state["train_words"] + words)
            if next_lr < config.min_lr:
                state["stopped"] = "lr_floor"
                log.info("%s: converged after epoch %d (the next learning rate %g is below min_lr %g)",
                         regime, epoch, next_lr, config.min_lr)
            log.info("%s epoch %d: lr %g, train ppl %.2f, valid ppl %.2f, %.0f words/s",
                     regime, epoch, lr, train_ppl, valid_ppl, words / seconds)
            state["wall_seconds"] += time.perf_counter() - wall_start
            wall_start = time.perf_counter()
            checkpoint = {"identity": identity, "model": model.state_dict(),
                          "optimizer": optimizer.state_dict(), "progress": state, "rng": get_rng_state()}
            if ctx.enabled:
                check_parameters_agree(model)
                checkpoint["distributed"] = {"world_size": ctx.world_size, "backend": ctx.backend,
                                             "rng": all_gather_objects(get_rng_state(), ctx)}
            run_on_main(partial(save_checkpoint, checkpoint, ckpt_path, keep_previous=True), ctx,
                        "writing checkpoint.pt")
            if on_epoch_end is not None:
                on_epoch_end(epoch, record)
    except KeyboardInterrupt as e:
        if isinstance(e, RunInterrupted):
            raise
        raise RunInterrupted(epoch, out) from e
    finally:
        # Free the DDP wrapper (its reducer holds gradient buckets and the process group)
        # now, not whenever a reference cycle through this frame is collected: torch aborts
        # at exit when gloo work outlives destroy_process_group.
        del net

    model.load_state_dict(run_on_main(lambda: load_checkpoint(best_path)["model"], ctx, "reading best.pt"))
    test = score_split(model, test_data, config.bptt, CALIBRATION_BINS, ctx)
    test_mc = None
    if mc_samples > 0 and has_noise(model):
        _seed_noise(seed, ctx)
        test_mc = score_split(model, test_data, config.bptt, CALIBRATION_BINS, ctx, mc_samples)
    epochs_run = state["epoch"]
    stop_reason = state.get("stopped") or "epoch_cap"
    state["wall_seconds"] += time.perf_counter() - wall_start
    memory, memory_kind = peak_memory(device)
    result = {
        "schema": SCHEMA,
        "dataset": dataset,
        "corpus": corpus.summary(),
        "config": config.to_dict(),
        "regime": regime,
        "regime_settings": regime_obj.settings(),
        "dropout": probabilities,
        "seed": seed,
        "init_from": state.get("init_from"),
        "epochs": state["history"],
        "best_epoch": state["best_epoch"],
        "best_valid_ppl": state["best_valid_ppl"],
        "epochs_run": epochs_run,
        "stop_reason": stop_reason,
        # Not converged: validation was still improving when the epoch cap ended the run.
        "converged": stop_reason == "lr_floor" or state["best_epoch"] < epochs_run,
        "test_ppl": test.perplexity,
        "test_nll": test.nll,
        "test_ece": test.ece,
        "test_ppl_mc": None if test_mc is None else test_mc.perplexity,
        "test_nll_mc": None if test_mc is None else test_mc.nll,
        "test_ece_mc": None if test_mc is None else test_mc.ece,
        "mc_samples": mc_samples if test_mc is not None else 0,
        "words_per_second": state["train_words"] / state["train_seconds"],
        "train_seconds": state["train_seconds"],
        "wall_seconds": state["wall_seconds"],
        "peak_memory_bytes": memory,
        "peak_memory_kind": memory_kind,
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": str(device),
        "threads": torch.get_num_threads(),
        # Processes that trained the model together (DDP) and their backend (None: one process).
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "versions": versions(),
        "identity": identity,
    }

    def write_result() -> dict[str, Any]:
        write_signed_result(result, out / RESULTS)
        plot_learning_curves([result], out / CURVE)
        return result

    return run_on_main(write_result, ctx, "writing results.json")


def add_mc_result(
    corpus: Corpus, config: TrainConfig, out_dir: str | Path, n_samples: int,
    device: str | torch.device = "auto",
) -> dict[str, Any]:
    """Add the Monte-Carlo test perplexity to a finished run's results.json (verified
    before, re-signed after). ``config`` gives the evaluation batch size and BPTT; the
    model is rebuilt from ``best.pt``. Under DDP (call it on every rank) rank 0 reads and
    writes the files and every rank scores its share of the test streams."""
    out = Path(out_dir)
    ctx = current()
    with ExitStack() as stack:

        def read() -> tuple[dict[str, Any], dict[str, Tensor] | None]:
            stack.enter_context(RunLock(out))
            result = read_verified_result(out / RESULTS)
            return result, load_checkpoint(best_file(out))["model"] if ctx.enabled else None

        result, best_state = run_on_main(read, ctx, f"reading the results in {str(out)!r}")
        device = _rank_device(device, ctx)
        if ctx.enabled:
            model = build_model(len(corpus.vocab), TrainConfig.from_dict(result["config"]),
                                Regime.from_settings(result["regime_settings"]), result["dropout"])
            model.load_state_dict(best_state)
            model.to(device).eval()
        else:
            model = load_model(out, device).model
        if n_samples > 0 and has_noise(model):
            _seed_noise(result["seed"], ctx)
            start = time.perf_counter()
            test_data = batchify(corpus.test, config.eval_batch_size).to(device)
            test_mc = score_split(model, test_data, config.bptt, CALIBRATION_BINS, ctx, n_samples)
            result.update(test_ppl_mc=test_mc.perplexity, test_nll_mc=test_mc.nll, test_ece_mc=test_mc.ece)
            result["mc_samples"] = n_samples
            result["mc_seconds"] = time.perf_counter() - start

            def write() -> dict[str, Any]:
                write_signed_result(result, out / RESULTS)
                return result

            result = run_on_main(write, ctx, "writing results.json")
    return result
