"""Training and evaluation of one language-model run, with verified checkpoints and resume.

One run = (corpus, config, regime, dropout probabilities, seed) written to a folder of
its own (:mod:`rnndrop.lm.run.folder`): ``checkpoint.pt`` after every epoch (model,
optimizer, RNG states, progress) and the one before it, ``best.pt`` (the weights of the
best validation epoch with what rebuilds the model, :func:`rnndrop.lm.load_model`),
``results.json`` and ``curve.png`` when the run has finished, ``run.lock`` meanwhile.

Checkpoints are verified on load (:mod:`rnndrop.lm.run.checkpoint`); what makes two runs
the same run is :mod:`rnndrop.lm.run.identity`. ``train_run(..., resume=True)``
continues from ``checkpoint.pt`` (or, with a logged warning, from ``checkpoint.prev.pt``
when the newest is corrupt) into the very state (bit for bit) an uninterrupted run with
the same seed reaches, and no finished epoch is lost. A run resumes only into the same
run (:func:`rnndrop.lm.run.identity.run_identity`); the epoch cap may grow but not shrink
below the epochs already run (an error).

Training follows Zaremba et al.: contiguous batches, truncated BPTT with the state carried
(detached) across segments and reset every epoch, gradient-norm clipping, SGD or Adam.
AWD-LSTM's recipe is optional, field by field: AR / TAR and variable-length BPTT
(:mod:`rnndrop.lm.run.recipe`), NT-ASGD and fine-tuning (:mod:`rnndrop.lm.run.averaging`).

Under ``torchrun`` (a default process group of N > 1 ranks, see
:mod:`rnndrop.lm.run.process_group`) the same call on every rank trains one model with
DistributedDataParallel: each rank takes ``batch_size / N`` contiguous streams, DDP
averages the gradients before they are clipped, validation and test sums are added over
the ranks, each rank draws its own dropout noise (:mod:`rnndrop.distributed`), and rank 0
alone reads and writes the run's files. The checkpoint holds every rank's RNG state; it
resumes with the same N only.

This module reads top to bottom: :func:`train_run` claims the folder, prepares the run
(:mod:`rnndrop.lm.run.setup`: seeds, model, data, optimiser, resumed state), runs the
epoch loop (:func:`_train_epochs`) and finishes it (:mod:`rnndrop.lm.run.finish`: test
scores, results.json); the helpers follow in the order the loop calls them. The rate
and stopping rules are :mod:`rnndrop.lm.run.schedule`, the divergence check
:mod:`rnndrop.lm.run.divergence`, the progress a checkpoint holds :mod:`rnndrop.lm.run.state`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rnndrop.bptt import scaled_learning_rate
from rnndrop.lm.data.corpus import Corpus
from rnndrop.lm.model.language_model import detach_hidden
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.divergence import DivergenceCheck, TrainingDiverged
from rnndrop.lm.run.epoch_end import save_best, save_checkpoint, selection_criterion, stop_message
from rnndrop.lm.run.evaluate import perplexity, score_split, token_loss
from rnndrop.lm.run.finish import add_mc_result, finish_run
from rnndrop.lm.run.lock import claim_folder
from rnndrop.lm.run.noise_trace import learned_noise
from rnndrop.lm.run.process_group import all_reduce_sums, current, run_on_main
from rnndrop.lm.run.progress import EpochProgress
from rnndrop.lm.run.recipe import EpochSegments, epoch_segments, forward_with_penalty
from rnndrop.lm.run.schedule import Schedule
from rnndrop.lm.run.setup import Training, prepare, resolve_device

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
        run_on_main(partial(claim_folder, out, stack), ctx, f"taking the run folder {str(out)!r}")
        run = prepare(corpus, config, regime, out, dropout=dropout, seed=seed, resume=resume, device=device,
                      mc_samples=mc_samples, init_from=init_from, dataset=dataset, ctx=ctx)
        try:
            _train_epochs(run, progress, on_epoch_end)
        finally:
            # Free the DDP wrapper (its reducer holds gradient buckets and the process group)
            # now, not whenever a reference cycle through a frame is collected: torch aborts
            # at exit when gloo work outlives destroy_process_group.
            run.net = run.model
        try:
            return finish_run(run, bar=progress)
        except KeyboardInterrupt as e:
            raise RunInterrupted(None, run.out) from e


def _train_epochs(run: Training, progress: bool, on_epoch_end: EpochCallback | None) -> None:
    """The epoch loop: set the rate, train an epoch, validate, keep the best, checkpoint.

    It ends at the epoch cap or when the schedule stops the run (:mod:`rnndrop.lm.run.schedule`);
    NT-ASGD's fine-tuning stage then goes on through the same loop (:func:`_stages`). Ctrl-C
    becomes :class:`RunInterrupted` (the epochs before it are in the checkpoint).
    """
    config, state, schedule = run.config, run.state, Schedule(run.config)
    epoch = state.epoch + 1
    try:
        for epoch in _stages(run, schedule):
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
                save_best(run, epoch, evaluated)

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
            save_checkpoint(run)
            if on_epoch_end is not None:
                on_epoch_end(epoch, record)
    except KeyboardInterrupt as e:
        if isinstance(e, RunInterrupted):
            raise
        raise RunInterrupted(epoch, run.out) from e


def _stages(run: Training, schedule: Schedule) -> Iterator[int]:
    """The epochs to train: the training stage's, then (``finetune_epochs``) the fine-tuning
    stage's, which begins here once the training stage is over (a resumed run already in it
    goes on); see :mod:`rnndrop.lm.run.averaging`."""
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
    start = time.perf_counter()
    try:
        for i, segment in enumerate(segments.items):
            targets = segment.targets
            logits, hidden, penalty = forward_with_penalty(run.net, segment.inputs, hidden,
                                                           run.activation_reg)
            hidden = detach_hidden(hidden)
            loss = token_loss(logits, targets)
            objective = loss if penalty is None else loss + penalty
            if run.extra_loss is not None:
                objective = objective + run.extra_loss((epoch - 1 + segment.done) / config.epochs)
            check.losses(objective, loss, i)
            run.optimizer.zero_grad(set_to_none=True)
            objective.backward()
            grad_norm = nn.utils.clip_grad_norm_(run.model.parameters(), config.clip)
            check.gradient_norm(grad_norm, i)
            with scaled_learning_rate(run.optimizer, segment.lr_scale):
                run.optimizer.step()
            if run.averaging is not None:
                run.averaging.after_step()
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
