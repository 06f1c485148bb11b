"""Training one language-model run, read top to bottom: :func:`train_run` and its epoch loop.

One run = (corpus, config, regime, dropout probabilities, seed) written to a folder of its
own (:mod:`rnndrop.lm.run.checkpoint` names the files): ``checkpoint.pt`` after every epoch
(model, optimizer, RNG states, progress) and the one before it, ``best.pt`` (the weights of
the best validation epoch with what rebuilds the model, :func:`rnndrop.lm.load_model`),
``results.json`` and ``curve.png`` when the run has finished, ``run.lock`` meanwhile.

``train_run(..., resume=True)`` continues from ``checkpoint.pt`` (or, with a logged warning,
from ``checkpoint.prev.pt`` when the newest is corrupt) into the very state (bit for bit) an
uninterrupted run with the same seed reaches, and no finished epoch is lost. A run resumes
only into the same run (:func:`rnndrop.lm.run.checkpoint.run_identity`); the epoch cap may
grow but not shrink below the epochs already run (an error). A finished run whose cap grew trains
on, what it had finished with kept first (:func:`~rnndrop.lm.run.checkpoint.keep_finished_run`).

Training follows Zaremba et al.: contiguous batches, truncated BPTT with the state carried
(detached) across segments and reset every epoch, gradient-norm clipping, SGD or Adam.
AWD-LSTM's recipe is optional, field by field: AR / TAR, variable-length BPTT, NT-ASGD and
fine-tuning (:mod:`rnndrop.lm.run.recipe`, which also holds the rate schedule).

Under ``torchrun`` (a default process group of N > 1 ranks, see
:mod:`rnndrop.lm.run.process_group`) the same call on every rank trains one model with
DistributedDataParallel: each rank takes ``batch_size / N`` contiguous streams, DDP
averages the gradients before they are clipped, validation and test sums are added over
the ranks, each rank draws its own dropout noise (:mod:`rnndrop.distributed`), and rank 0
alone reads and writes the run's files (the functions of :mod:`rnndrop.lm.run.checkpoint`
that take a ``ctx``). The checkpoint holds every rank's RNG state; it resumes with the same
N only.

The module reads top to bottom: :func:`train_run` claims the folder, prepares the run, runs
the epoch loop (inline: set the rate, train an epoch, validate, keep the best, checkpoint) and
finishes it; then, in that order, the stages of the loop and one epoch's pass
(:func:`_train_epoch`), what a run trains with (:func:`prepare`: seeds, model, data,
optimiser, resumed state), what an epoch leaves behind (``best.pt``, ``checkpoint.pt``), the
divergence check (:class:`DivergenceCheck`) and the end of a run (:func:`finish_run`: test
scores, results.json; :func:`add_mc_result`).
"""

from __future__ import annotations

import logging
import math
import platform
import random
import resource
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import rnndrop
from rnndrop.activation_regularization import ActivationRegularization
from rnndrop.bptt import scaled_learning_rate
from rnndrop.compiling import CompiledModel, compile_model, speeds_up_under_compile
from rnndrop.distributed import check_parameters_agree, seed_noise_per_rank
from rnndrop.lm.data.corpus import Corpus, batchify
from rnndrop.lm.model.build import build_model, build_optimizer, trainable_parameters
from rnndrop.lm.model.language_model import detach_hidden
from rnndrop.lm.model.regimes import Regime, get_hook, get_regime, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import (
    ALPHAS,
    BEST,
    CHECKPOINT,
    CURVE,
    METRICS,
    RESULTS,
    SCHEMA,
    CheckpointError,
    ResultsError,
    RunLock,
    RunState,
    best_file,
    claim_folder,
    corpus_fingerprint,
    file_sha256,
    files_on_main,
    get_rng_state,
    keep_finished_run,
    load_checkpoint,
    load_model,
    load_state,
    read_best_weights,
    read_checkpoint,
    read_verified_result,
    run_id,
    run_identity,
    save_checkpoint,
    set_rng_state,
    text_sha256,
    write_signed_result,
)
from rnndrop.lm.run.evaluate import (
    CALIBRATION_BINS,
    MAX_NLL,
    MC_PROGRESS,
    Score,
    has_noise,
    mc_seconds,
    perplexity,
    score_split,
    token_loss,
)
from rnndrop.lm.run.process_group import (
    ONE_PROCESS,
    Distributed,
    all_gather_floats,
    all_gather_objects,
    all_reduce_sums,
    check_batch_split,
    current,
    shard_columns,
)
from rnndrop.lm.run.recipe import (
    AVERAGING_KEY,
    CONVERGED,
    EPOCH_CAP,
    LR_FLOOR,
    EpochSegments,
    LRSchedule,
    RunAveraging,
    Segment,
    activation_regularizer,
    epoch_segments,
    forward_with_penalty,
)
from rnndrop.lm.run.report import (
    EpochProgress,
    format_duration,
    metrics_text,
    plot_alphas,
    plot_learning_curves,
)

__all__ = [
    "EpochCallback",
    "RunInterrupted",
    "Training",
    "TrainingDiverged",
    "add_mc_result",
    "finish_run",
    "learned_noise",
    "peak_memory",
    "prepare",
    "rank_device",
    "resolve_device",
    "train_run",
    "versions",
]

log = logging.getLogger(__name__)

EpochCallback = Callable[[int, Mapping[str, Any]], None]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (KeyboardInterrupt) during :func:`train_run`.

    Attributes:
        epoch: the epoch that was interrupted (the finished epochs before it are in
            the checkpoint; rerun with ``resume=True`` to continue bit for bit); None after
            the last epoch, while the test split was scored (every epoch is saved).
        folder: the run's folder.
    """

    def __init__(self, epoch: int | None, folder: Path) -> None:
        where = f"during epoch {epoch}" if epoch is not None else "after the last epoch (testing)"
        super().__init__(f"interrupted {where} of the run in {str(folder)!r}; the finished epochs are "
                         "saved, resume=True (--resume) continues from there")
        self.epoch = epoch
        self.folder = folder


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
    compile: bool | None = None,
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
        compile: train under ``torch.compile`` (:func:`rnndrop.compile_model`: the whole step
            replayed from CUDA graphs on a GPU); evaluation runs eagerly. None (the default):
            where it is measured to be faster (:func:`rnndrop.compiling.speeds_up_under_compile`:
            on CUDA, a regime whose recurrence runs rnndrop's loop kernel; one process). The
            same model and distribution, other masks than an eager run of the same seed
            (Inductor draws its own random numbers); a run resumed in the other mode goes on,
            not bit for bit. A compile or compiled step that fails where the eager step does not
            makes the run go on eagerly with one warning (one process; under torchrun it fails
            the run). Recorded in the results, with the failure if any.

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
    get_regime(regime)  # before the folder is made: a misspelt regime leaves no empty folder
    with ExitStack() as stack:
        claim_folder(out, stack, ctx)
        run = prepare(corpus, config, regime, out, dropout=dropout, seed=seed, resume=resume, device=device,
                      mc_samples=mc_samples, init_from=init_from, dataset=dataset, ctx=ctx, compile=compile)
        if run.compiled and run.net.cuda_graphs:
            # a CUDA graph a truncated-BPTT length: variable lengths are the recipe's (AWD), and
            # torch warns past 8 of them at every recording (torch._inductor: imported on first use)
            inductor_config = torch._inductor.config
            stack.enter_context(inductor_config.patch({"triton.cudagraph_dynamic_shape_warn_limit": None}))
        # The epoch loop: set the rate, train an epoch, validate, keep the best, checkpoint.
        # It ends at the epoch cap or when the schedule stops the run; NT-ASGD's fine-tuning
        # stage then goes on through the same loop (_stages). Ctrl-C becomes RunInterrupted
        # (the epochs before it are in the checkpoint).
        state, schedule = run.state, LRSchedule(config)
        epoch = state.epoch + 1
        trains = False
        try:
            for epoch in _stages(run, schedule):
                if not trains:  # a finished run whose epoch cap grew: what it finished with is kept
                    files_on_main(partial(keep_finished_run, run.out), run.ctx, "keeping the finished run")
                    trains = True
                lr = schedule.rate(epoch, state.lr)
                for group in run.optimizer.param_groups:
                    group["lr"] = lr
                segments = epoch_segments(run.train_stream, config, run.seed, epoch)
                check = DivergenceCheck(epoch, segments.count, lr, run.checkpoint_path, state.epoch, run.ctx)
                train_ppl, words, seconds = _train_epoch(run, epoch, segments, check, progress)

                evaluated = run.evaluation_model  # the averaged weights once NT-ASGD averages
                valid = score_split(evaluated, run.valid_data, config.bptt, None, run.ctx)
                check.validation(valid.perplexity)
                criterion = selection_criterion(config, valid, run.extra_loss)
                improved = state.keep_if_best(epoch, valid.perplexity, criterion)
                if improved:
                    _save_best(run, epoch, evaluated)

                record = {
                    "epoch": epoch, "lr": lr, "train_ppl": train_ppl, "valid_ppl": valid.perplexity,
                    "seconds": seconds, "words_per_second": words / seconds,
                }
                if config.select == "objective":
                    record["valid_objective"] = criterion
                noise = learned_noise(run.model)
                if noise:
                    record["noise"] = noise
                next_lr, stop = schedule.after_epoch(lr, improved)
                if run.averaging is not None:
                    record.update(run.averaging.after_validation(state, epoch, valid.perplexity, run.regime))
                    stop = stop or run.averaging.stop_reason()
                state.end_epoch(record, next_lr, seconds, words)
                if stop:
                    state.stop_stage(stop)
                    log.info(stop_message(run, epoch, stop, next_lr))
                log.info("%s epoch %d: lr %g, train ppl %.2f, valid ppl %.2f, %.0f words/s",
                         run.regime, epoch, lr, train_ppl, valid.perplexity, words / seconds)

                run.wall_start = state.add_wall_time(run.wall_start)
                _save_progress(run)
                if on_epoch_end is not None:
                    on_epoch_end(epoch, record)
        except KeyboardInterrupt as e:
            if isinstance(e, RunInterrupted):
                raise
            raise RunInterrupted(epoch, run.out) from e
        finally:
            # Free the DDP wrapper (its reducer holds gradient buckets and the process group)
            # now, not whenever a reference cycle through a frame is collected: torch aborts
            # at exit when gloo work outlives destroy_process_group.
            if isinstance(run.net, CompiledModel):
                run.compile_failure = run.net.failure
            run.net = run.model
        try:
            return finish_run(run, bar=progress)
        except KeyboardInterrupt as e:
            raise RunInterrupted(None, run.out) from e


def _stages(run: Training, schedule: LRSchedule) -> Iterator[int]:
    """The epochs to train: the training stage's, then (``finetune_epochs``) the fine-tuning
    stage's, which begins here once the training stage is over (a resumed run already in it
    goes on); see :mod:`rnndrop.lm.run.recipe`."""
    yield from schedule.epochs(run.state)
    if not run.config.finetune_epochs:
        return
    if run.state.finetune_from is None:
        assert run.averaging is not None  # finetune_epochs needs nt_asgd
        run.optimizer = run.averaging.start_finetune(run.state, run.config, run.best_path, run.ctx,
                                                     run.regime)
    yield from schedule.finetune_epochs(run.state)


def _train_epoch(
    run: Training, epoch: int, segments: EpochSegments, check: DivergenceCheck, progress: bool
) -> tuple[float, int, float]:
    """One pass over the training stream: (train perplexity, words, seconds).

    ``run.extra_loss(progress)`` is added to the mean NLL (``progress`` runs from 0 to 1
    over training), and AR / TAR when the config asks for them; each step's rate is scaled
    by its segment's factor (variable-length BPTT; 1 otherwise) and NT-ASGD's average
    updated after it. Under DDP ``run.train_stream`` is this rank's shard and ``run.net`` the
    DDP wrapper of ``run.model`` (its backward all-reduces the gradients before they are
    clipped); perplexity and words are those of every rank together.
    """
    config, ctx = run.config, run.ctx
    run.net.train()
    bar = EpochProgress(segments.count, f"epoch {epoch}", progress and ctx.is_main)
    total, words, hidden = 0.0, 0, None
    read_words = 0  # the words of the steps read (checked, summed: in order, a few steps behind)
    start = time.perf_counter()
    try:
        for i, segment in enumerate(segments.items):
            targets = segment.targets
            try:
                done = _forward_backward(run, run.net, segment, hidden, epoch)
            except Exception as error:  # a backward that fails compiled (torch compiles it at its first call)
                if not (isinstance(run.net, CompiledModel) and run.net.compiled and run.net.fallback):
                    raise
                failed, done = error.with_traceback(None), None  # the attempt's tensors go with its frames
            if done is None:  # the step again, eagerly; an error here is not the compiler's: raised as it is
                done = _forward_backward(run, run.net.module, segment, hidden, epoch)
                run.net.run_eagerly(failed)
            objective, loss, hidden = done
            grad_norm = nn.utils.clip_grad_norm_(run.model.parameters(), config.clip)
            with scaled_learning_rate(run.optimizer, segment.lr_scale):
                run.optimizer.step()
            if run.averaging is not None:
                run.averaging.after_step()
            for loss_value, step_words in check.step(objective, loss, grad_norm, i, targets.numel()):
                total += loss_value * step_words
                read_words += step_words
            words += targets.numel()
            elapsed = time.perf_counter() - start
            shown = {"ppl": perplexity(total / read_words)} if read_words else {}  # as of the steps read
            bar.update(**shown, wps=words * ctx.world_size / max(elapsed, 1e-9))
        for loss_value, step_words in check.read():  # any step not read yet (none where the count was exact)
            total += loss_value * step_words
    finally:
        bar.close()
    if ctx.enabled:
        total, all_words = all_reduce_sums([total, words], ctx)
        words = round(all_words)
    return perplexity(total / words), words, time.perf_counter() - start


def _forward_backward(
    run: Training, net: nn.Module, segment: Segment, hidden: Any, epoch: int
) -> tuple[Tensor, Tensor, Any]:
    """One step's forward and backward of ``net`` (``run.net``, or the model it compiles) from
    ``hidden`` (gradients set, not applied): ``(objective, mean NLL, the next hidden state detached)``."""
    logits, next_hidden, penalty = forward_with_penalty(net, segment.inputs, hidden, run.activation_reg)
    # copied where CUDA graphs replay the step: the next replay overwrites this one's outputs
    next_hidden = detach_hidden(next_hidden, copy=isinstance(net, CompiledModel) and net.cuda_graphs)
    loss = token_loss(logits, segment.targets)
    objective = loss if penalty is None else loss + penalty
    if run.extra_loss is not None:
        objective = objective + run.extra_loss((epoch - 1 + segment.done) / run.config.epochs)
    run.optimizer.zero_grad(set_to_none=True)
    objective.backward()
    return objective, loss, next_hidden


# -- what a run trains with, built before its first epoch ------------------------------------------

ExtraLoss = Callable[[float], Tensor]


@dataclass
class Training:
    """One run as the epoch loop and the end of the run see it.

    Attributes:
        corpus, config, regime, seed, out, dataset: as passed to
            :func:`rnndrop.lm.run.train.train_run`;
            ``rules`` the regime itself, ``dropout`` its probability per site.
        identity: :func:`rnndrop.lm.run.checkpoint.run_identity` of the run.
        device, ctx: where it trains, and its process group.
        mc_samples: samples of the Monte-Carlo test perplexity (0: none).
        model: the language model; ``net`` what is called in training (``model``, its DDP
            wrapper, either compiled; ``model`` again once training is over).
        optimizer: the config's optimiser over the trainable parameters.
        extra_loss: ``progress -> tensor`` the regime adds to the loss, or None.
        train_stream: this rank's training streams ``[N, B]``; ``valid_data``,
            ``test_data`` the evaluation streams ``[N, eval_batch_size]``.
        state: the progress (:class:`RunState`, resumed from the checkpoint).
        wall_start: ``time.perf_counter()`` when wall time was last added to ``state``.
        activation_reg: AR / TAR at the config's weights, or None (:mod:`rnndrop.lm.run.recipe`).
        averaging: NT-ASGD (:class:`~rnndrop.lm.run.recipe.RunAveraging`), or None.
        compiled: whether it trains under torch.compile (``net`` a
            :class:`~rnndrop.compiling.CompiledModel`).
        compile_failure: why the compiled model fell back to eager in this process's training
            (:attr:`~rnndrop.compiling.CompiledModel.failure`), or None.
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
    compiled: bool = False
    compile_failure: str | None = None

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
    elif resolved.type == "meta":
        raise ValueError(f"device {str(device)!r} holds shapes without values, nothing can train or "
                         "be scored there; use --device cpu, cuda or auto")
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
    init_from: str | Path | None, dataset: str, ctx: Distributed, compile: bool | None = None,
) -> Training:
    """Check the arguments, seed, build the model, the data and the optimiser, and restore
    the checkpoint in ``out`` when resuming (see :func:`rnndrop.lm.run.checkpoint.read_checkpoint`)."""
    wall_start = time.perf_counter()
    rules = get_regime(regime)
    probabilities = regime_probabilities(rules, config.dropout if dropout is None else dropout)
    # rank 0 reads init_from's best.pt for its checksum
    identity = files_on_main(partial(run_identity, corpus, config, regime, probabilities, seed, init_from),
                            ctx, "making the run's identity")
    if ctx.enabled:
        _check_same_corpus(corpus, identity["corpus"], ctx)
    if resume and not dataset:  # resumed without a name: the one its results were written with stays
        dataset = files_on_main(partial(_previous_dataset_name, out / RESULTS), ctx,
                                "reading the run's results")
    device = rank_device(device, ctx)
    mc_samples = config.mc_samples if mc_samples is None else mc_samples
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
        raise ValueError(f"mc_samples must be an int >= 0, got {mc_samples!r}")
    check_batch_split(config.batch_size, config.eval_batch_size, ctx)

    torch.manual_seed(seed)
    random.seed(seed)
    model = build_model(len(corpus.vocab), config, rules, probabilities).to(device)
    train_data = batchify(corpus.train, config.batch_size, split="the train split").to(device)
    # The KL of an ELBO is divided by the whole training stream, not by one rank's shard.
    extra_loss = _extra_loss(model, config, rules, train_data.numel())
    valid_data = batchify(corpus.valid, config.eval_batch_size, split="the valid split",
                          size_name="eval_batch_size").to(device)
    test_data = batchify(corpus.test, config.eval_batch_size, split="the test split",
                         size_name="eval_batch_size").to(device)

    ckpt, state, loaded_init = read_checkpoint(out, identity, config, model, resume=resume,
                                               init_from=init_from, vocab=corpus.vocab.itos, ctx=ctx)
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
    if compile is None:  # not measured under DDP: eager there unless asked
        compile = not ctx.enabled and speeds_up_under_compile(model)
        if compile:
            log.info("%s: training under torch.compile, the step replayed from CUDA graphs (its loop "
                     "kernel is bound by the host's launches; --no-compile trains eagerly)", regime)
    if compile:
        # a rank that fell back alone would leave the others' collectives waiting: fail there instead
        net = compile_model(net, fallback=not ctx.enabled)
    return Training(
        corpus=corpus, config=config, regime=regime, rules=rules, dropout=probabilities, seed=seed,
        out=out, dataset=dataset, identity=identity, device=device, ctx=ctx, mc_samples=mc_samples,
        model=model, net=net, optimizer=optimizer, extra_loss=extra_loss, train_stream=train_stream,
        valid_data=valid_data, test_data=test_data, state=state, wall_start=wall_start,
        activation_reg=activation_regularizer(config), averaging=averaging, compiled=compile,
    )


def _check_same_corpus(corpus: Corpus, main_fingerprint: str, ctx: Distributed) -> None:
    """Every rank trains on the text rank 0 read (each reads its own copy: a node's may differ or
    be cut short, and training then failed in a collective with gloo's error, or went on with
    other text per rank); the same ValueError on every rank where one differs."""
    fingerprints = all_gather_objects(corpus_fingerprint(corpus), ctx)
    other = [rank for rank, fingerprint in enumerate(fingerprints) if fingerprint != main_fingerprint]
    if other:
        raise ValueError(f"the corpus read by rank {', '.join(map(str, other))} is not the one rank 0 read "
                         "(another folder or other files there): every process of the job needs the same "
                         "corpus")


def _extra_loss(model: nn.Module, config: TrainConfig, regime: Regime, train_tokens: int) -> ExtraLoss | None:
    """``progress -> kl_weight * regularizer(model, progress, train_tokens)``, the term the
    regime adds to the loss; None without a regularizer or with ``kl_weight`` 0 (then the
    KL is not computed at all)."""
    if regime.regularizer is None or not config.kl_weight:
        return None
    hook = get_hook(regime.regularizer)
    return lambda progress: config.kl_weight * hook(model, progress, train_tokens)


# -- what an epoch leaves behind -------------------------------------------------------------------

def selection_criterion(config: TrainConfig, valid: Score, extra_loss: ExtraLoss | None) -> float:
    """What the best epoch minimises: the validation perplexity, or (``select="objective"``)
    the validation NLL per word plus the extra loss at the end of training (full weight)."""
    if config.select == "perplexity":
        return valid.perplexity
    if extra_loss is None:
        return valid.nll
    with torch.no_grad():
        return valid.nll + float(extra_loss(1.0))


def _save_best(run: Training, epoch: int, evaluated: nn.Module) -> None:
    """best.pt: the weights of ``epoch`` that were validated (``evaluated``: the model, or the
    average of NT-ASGD) with what rebuilds the model (:func:`rnndrop.lm.load_model`)."""
    best = {
        "model": evaluated.state_dict(), "epoch": epoch, "config": run.config.to_dict(),
        "regime": run.regime, "regime_settings": run.rules.settings(), "dropout": run.dropout,
        "vocab": list(run.corpus.vocab.itos), "identity": run.identity,
    }
    save_checkpoint(best, run.best_path, ctx=run.ctx)


def _save_progress(run: Training) -> None:
    """checkpoint.pt: model, optimiser, progress, NT-ASGD's averaging state (when on) and every
    rank's RNG state (the one before it is kept as checkpoint.prev.pt until this one is verified)."""
    checkpoint = {"identity": run.identity, "model": run.model.state_dict(),
                  "optimizer": run.optimizer.state_dict(), "progress": run.state.to_dict(),
                  "rng": get_rng_state()}
    if run.averaging is not None:
        checkpoint[AVERAGING_KEY] = run.averaging.state_dict()
    if run.ctx.enabled:
        check_parameters_agree(run.model)
        checkpoint["distributed"] = {"world_size": run.ctx.world_size, "backend": run.ctx.backend,
                                     "rng": all_gather_objects(get_rng_state(), run.ctx)}
    save_checkpoint(checkpoint, run.checkpoint_path, keep_previous=True, ctx=run.ctx)


def stop_message(run: Training, epoch: int, stop: str, next_lr: float) -> str:
    """Why the stage the run is in stopped after ``epoch``, in one line."""
    stage = "fine-tuning" if run.state.finetune_from is not None else "training"
    if stop == LR_FLOOR:
        return (f"{run.regime}: {stage} converged after epoch {epoch} (the next learning rate "
                f"{next_lr:g} is below min_lr {run.config.min_lr:g})")
    return (f"{run.regime}: {stage} converged after epoch {epoch} (the averaged weights' validation "
            f"perplexity has not improved for {run.config.nonmono} epochs)")


def learned_noise(model: nn.Module) -> dict[str, dict[str, float]]:
    """``{"alpha": {site: mean alpha}, "kl": {site: KL term}}`` over the modules of ``model``
    that have ``alphas()`` and ``site_kl()``; sites are named ``<module>.<site>`` (e.g.
    ``rnn.hidden_l0``), without the ``log_alpha_`` prefix. Empty for a model without them."""
    alphas: dict[str, float] = {}
    kls: dict[str, float] = {}
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if not (callable(getattr(module, "alphas", None)) and callable(getattr(module, "site_kl", None))):
                continue
            for name, alpha in module.alphas().items():
                alphas[_site(prefix, name)] = float(alpha.float().mean())
            for name, kl in module.site_kl().items():
                kls[_site(prefix, name)] = float(kl)
    return {"alpha": alphas, "kl": kls} if alphas else {}


def _site(prefix: str, name: str) -> str:
    site = name.removeprefix("log_alpha_")
    return f"{prefix}.{site}" if prefix else site


# -- the one divergence check ----------------------------------------------------------------------

class TrainingDiverged(RuntimeError):
    """The loss or the gradient became NaN or infinite (or the perplexity overflowed)."""


class DivergenceCheck:
    """The checks of one epoch.

    A step's objective, NLL and gradient norm are recorded as tensors (:meth:`step`) and read
    on the host every :attr:`READ_EVERY` steps and at the end of the epoch (:meth:`read`): on a
    GPU a read waits for the GPU, and a wait every step would keep the host from queueing the next
    step while the GPU runs this one. A step that diverged is therefore found a few steps later,
    always before the epoch ends (so before its checkpoint is written), and named exactly. Under
    DDP every step is read at once, over every rank, so that the ranks stop together.

    Args:
        epoch: the epoch being trained; ``n_batches`` its truncated-BPTT segments and
            ``lr`` its learning rate (for the message).
        checkpoint_path: the run's ``checkpoint.pt``; ``last_good_epoch`` the epoch it
            holds (0: none yet).
        ctx: the process group (the loss check is decided over every rank).
    """

    READ_EVERY = 16

    def __init__(self, epoch: int, n_batches: int, lr: float, checkpoint_path: Path,
                 last_good_epoch: int, ctx: Distributed = ONE_PROCESS) -> None:
        self.epoch, self.n_batches, self.lr = epoch, n_batches, lr
        self.checkpoint_path, self.last_good_epoch, self.ctx = checkpoint_path, last_good_epoch, ctx
        # batch, words, objective, NLL, gradient norm
        self._pending: list[tuple[int, int, Tensor, Tensor, Tensor]] = []

    def step(
        self, objective: Tensor, loss: Tensor, norm: Tensor, batch: int, words: int
    ) -> list[tuple[float, int]]:
        """Record step ``batch`` of ``words`` words; ``(NLL per word, words)`` of the steps read now
        (:meth:`read`: every :attr:`READ_EVERY` steps, the epoch's last, every step under DDP),
        else none."""
        self._pending.append((batch, words, objective.detach(), loss.detach(), norm.detach()))
        if self.ctx.enabled or len(self._pending) >= self.READ_EVERY or batch == self.n_batches - 1:
            return self.read()
        return []

    def read(self) -> list[tuple[float, int]]:
        """Check every recorded step in order and return ``(NLL per word, words)`` of each: the
        objective (NLL + extra term) must be finite and the NLL per word at most :data:`MAX_NLL`,
        on every rank, and the clipped gradient's norm (before clipping) finite."""
        if not self._pending:
            return []
        steps = [(batch, words) for batch, words, *_ in self._pending]
        values = torch.stack([value.float() for *_, o, l, n in self._pending for value in (o, l, n)]).tolist()
        rows = [values[i : i + 3] for i in range(0, len(values), 3)]  # one stack and one read for all
        self._pending.clear()
        for (batch, _), (objective, loss, norm) in zip(steps, rows):
            if self.ctx.enabled:
                every_rank = all_gather_floats([objective, loss], self.ctx)
                for rank, (rank_objective, rank_loss) in enumerate(every_rank):
                    self._check_loss(rank_objective, rank_loss, f" on rank {rank}", batch)
            else:
                self._check_loss(objective, loss, "", batch)
            if not math.isfinite(norm):
                self.stop(f"the gradient norm is {norm}", batch)
        return [(loss, words) for (_, words), (_, loss, _) in zip(steps, rows)]

    def validation(self, perplexity: float) -> None:
        """The epoch's validation perplexity must be finite."""
        if not math.isfinite(perplexity):
            self.stop(f"the validation perplexity is {perplexity}", self.n_batches - 1)

    def _check_loss(self, objective: float, loss: float, on_rank: str, batch: int) -> None:
        if not math.isfinite(objective):
            self.stop(f"the training loss is {objective}{on_rank}", batch)
        if loss > MAX_NLL:
            self.stop(f"the training loss is {loss:.4g} nats per word{on_rank} (the perplexity "
                      "overflows)", batch)

    def stop(self, what: str, batch: int) -> None:
        """Raise :class:`TrainingDiverged`: ``what`` happened at ``batch`` (0-based)."""
        raise TrainingDiverged(
            f"training stopped: {what} at epoch {self.epoch}, batch {batch + 1}/{self.n_batches} "
            f"(lr {self.lr:g}); {self._checkpoint_note()}. Lower the learning rate or the clipping "
            "threshold and start again."
        )

    def _checkpoint_note(self) -> str:
        if not self.last_good_epoch:
            return "no epoch had finished, so there is no checkpoint"
        if not self.ctx.is_main:
            return f"rank 0 keeps the checkpoint of epoch {self.last_good_epoch}"
        try:
            load_checkpoint(self.checkpoint_path)
        except (OSError, CheckpointError) as e:
            return f"the checkpoint of epoch {self.last_good_epoch} failed verification: {e}"
        return (f"the checkpoint {str(self.checkpoint_path)!r} of epoch {self.last_good_epoch} was "
                "verified (SHA-256) and is kept")


# -- the end of a run: test scores of the best epoch, the signed results.json ----------------------

def finish_run(run: Training, bar: bool = False) -> dict[str, Any]:
    """Test the best epoch's weights, then write and return the run's result; the
    Monte-Carlo passes show their progress (a bar on a terminal when ``bar``, else log lines)."""
    config, ctx = run.config, run.ctx
    best = read_best_weights(run.best_path, ctx)
    load_state(run.model, best, run.best_path)
    test = score_split(run.model, run.test_data, config.bptt, CALIBRATION_BINS, ctx)
    test_mc = None
    if run.mc_samples > 0 and has_noise(run.model):
        if ctx.is_main:  # the phase after the last epoch's bar: say what runs and for how long
            _announce_mc(str(run.out), run.model, run.test_data, config.bptt, run.mc_samples)
        seed_noise(run.seed, ctx)
        test_mc = score_split(run.model, run.test_data, config.bptt, CALIBRATION_BINS, ctx, run.mc_samples,
                              progress=MC_PROGRESS.format(split="test", samples=run.mc_samples), bar=bar)
    run.state.add_wall_time(run.wall_start)
    result = _result(run, test, test_mc)

    def write_result() -> dict[str, Any]:
        # the files beside it that it vouches for: the weights it scored, the metrics it implies
        metrics = text_sha256(metrics_text(result["epochs"]))
        result["files"] = {BEST: file_sha256(run.best_path), METRICS: metrics}
        write_signed_result(result, run.out / RESULTS)
        plot_learning_curves([result], run.out / CURVE)
        plot_alphas([result], run.out / ALPHAS)
        return result

    return files_on_main(write_result, ctx, "writing results.json")


def _previous_dataset_name(path: Path) -> str:
    """The ``dataset`` name of the results.json at ``path``, or "" (none, or not verified)."""
    if not path.is_file():
        return ""
    try:
        name = read_verified_result(path).get("dataset")
    except ResultsError:
        return ""
    return name if isinstance(name, str) else ""


def _announce_mc(name: str, model: nn.Module, test_data: Tensor, bptt: int, n_samples: int) -> None:
    """The line before the Monte-Carlo passes: how many and about how long (timed on the
    first segment, :func:`rnndrop.lm.run.evaluate.mc_seconds`)."""
    log.info("%s: Monte-Carlo test perplexity, %d dropout samples (about %s)", name, n_samples,
             format_duration(mc_seconds(model, test_data, bptt, n_samples)))


def seed_noise(seed: int, ctx: Distributed) -> None:
    """Seed the dropout noise of an evaluation: ``seed`` itself in one process, each rank
    its own stream under DDP."""
    if ctx.enabled:
        seed_noise_per_rank(seed, ctx.rank)
    else:
        torch.manual_seed(seed)


def _result(run: Training, test: Score, test_mc: Score | None) -> dict[str, Any]:
    """The content of results.json (schema :data:`rnndrop.lm.run.checkpoint.SCHEMA`)."""
    state = run.state
    stop_reason = LRSchedule.stop_reason(state)
    memory, memory_kind = peak_memory(run.device)
    return {
        "schema": SCHEMA,
        "dataset": run.dataset,
        "corpus": run.corpus.summary(),
        "config": run.config.to_dict(),
        "regime": run.regime,
        "regime_settings": run.rules.settings(),
        "dropout": run.dropout,
        "seed": run.seed,
        "init_from": state.init_from,
        "epochs": state.history,
        "best_epoch": state.best_epoch,
        "best_valid_ppl": state.best_valid_ppl,
        "epochs_run": state.epoch,
        "stop_reason": stop_reason,
        # Not converged: validation was still improving when the epoch cap ended the run (or
        # its fine-tuning stage).
        "converged": _last_stop(state, stop_reason) in CONVERGED or state.best_epoch < state.epoch,
        "test_ppl": test.perplexity,
        "test_nll": test.nll,
        "test_ece": test.ece,
        "test_ppl_mc": None if test_mc is None else test_mc.perplexity,
        "test_nll_mc": None if test_mc is None else test_mc.nll,
        "test_ece_mc": None if test_mc is None else test_mc.ece,
        "mc_samples": run.mc_samples if test_mc is not None else 0,
        "words_per_second": state.train_words / state.train_seconds,
        "train_seconds": state.train_seconds,
        "wall_seconds": state.wall_seconds,
        "peak_memory_bytes": memory,
        "peak_memory_kind": memory_kind,
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "device": str(run.device),
        "compiled": run.compiled,
        "compile_failure": run.compile_failure,
        "threads": torch.get_num_threads(),
        # Processes that trained the model together (DDP) and their backend (None: one process).
        "world_size": run.ctx.world_size,
        "backend": run.ctx.backend,
        "versions": versions(),
        "identity": run.identity,
        "run_id": run_id(run.identity),
        **_averaging_result(run),
    }


def _last_stop(state: RunState, stop_reason: str) -> str:
    """Why the last stage of the run ended: training's reason, or fine-tuning's once it ran."""
    if state.finetune_from is None:
        return stop_reason
    return state.finetune_stopped or EPOCH_CAP


def _averaging_result(run: Training) -> dict[str, Any]:
    """NT-ASGD's stages (only in runs that use it): when averaging began, when fine-tuning
    began and why it ended."""
    if run.averaging is None:
        return {}
    state = run.state
    finetune = None
    if state.finetune_from is not None:
        finetune = {"from_epoch": state.finetune_from, "epochs_run": state.epoch - state.finetune_from,
                    "stop_reason": state.finetune_stopped or EPOCH_CAP}
    return {"nt_asgd": {"averaging_after_epoch": state.averaging_since, "finetune": finetune}}


def add_mc_result(
    corpus: Corpus, config: TrainConfig, out_dir: str | Path, n_samples: int,
    device: str | torch.device = "auto", *, label: str | None = None,
) -> dict[str, Any]:
    """Add the Monte-Carlo test perplexity to a finished run's results.json (verified
    before, re-signed after; a line names the run, ``label`` or its folder, when its model
    draws noise: nothing to do otherwise). ``config`` gives the evaluation batch size and BPTT; the
    model is rebuilt from ``best.pt``. Under DDP (call it on every rank) rank 0 reads and
    writes the files and every rank scores its share of the test streams."""
    out = Path(out_dir)
    ctx = current()
    with ExitStack() as stack:

        def read() -> tuple[dict[str, Any], dict[str, Tensor] | None]:
            stack.enter_context(RunLock(out))
            result = read_verified_result(out / RESULTS)
            return result, load_checkpoint(best_file(out))["model"] if ctx.enabled else None

        result, best_state = files_on_main(read, ctx, f"reading the results in {str(out)!r}")
        device = rank_device(device, ctx)
        if ctx.enabled:
            model = build_model(len(corpus.vocab), TrainConfig.from_dict(result["config"]),
                                Regime.from_settings(result["regime_settings"]), result["dropout"])
            load_state(model, best_state, best_file(out))
            model.to(device).eval()
        else:
            model = load_model(out, device).model
        if n_samples > 0 and has_noise(model):
            test_data = batchify(corpus.test, config.eval_batch_size, split="the test split",
                                 size_name="eval_batch_size").to(device)
            if ctx.is_main:
                _announce_mc(label or str(out), model, test_data, config.bptt, n_samples)
            seed_noise(result["seed"], ctx)
            start = time.perf_counter()
            test_mc = score_split(model, test_data, config.bptt, CALIBRATION_BINS, ctx, n_samples,
                                  progress=MC_PROGRESS.format(split="test", samples=n_samples))
            result.update(test_ppl_mc=test_mc.perplexity, test_nll_mc=test_mc.nll, test_ece_mc=test_mc.ece)
            result["mc_samples"] = n_samples
            result["mc_seconds"] = time.perf_counter() - start

            def write() -> dict[str, Any]:
                write_signed_result(result, out / RESULTS)
                return result

            result = files_on_main(write, ctx, "writing results.json")
    return result


def versions() -> dict[str, str]:
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "rnndrop": rnndrop.__version__,
        "platform": platform.platform(),
        "processor": platform.machine(),
    }


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak memory in bytes and what it measures (CUDA allocations, or the process's RSS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return int(rss * scale), "peak resident set size of the process (ru_maxrss)"
