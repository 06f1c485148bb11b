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

Checkpoints are verified on load (:mod:`rnndrop.lm.checkpoint`); what makes two runs
the same run is :mod:`rnndrop.lm.identity`. ``train_run(...,
resume=True)`` continues from ``checkpoint.pt`` (or, with a logged warning, from
``checkpoint.prev.pt`` when the newest is corrupt): the run ends in the very state
(bit for bit) an uninterrupted run with the same seed reaches, and no finished epoch
is lost. A run resumes only into the same run (:func:`run_identity`: corpus, config
but the epoch cap, regime, dropout, seed, starting weights, format version); the
epoch cap may grow but not shrink below the epochs already run (an error).

Training follows Zaremba et al.: contiguous batches, truncated BPTT with the hidden
state carried (detached) across segments and reset at every epoch, gradient-norm
clipping, and the optimiser the config names (SGD or Adam).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rnndrop.calibration import reliability_from_predictions
from rnndrop.lm.atomic import remove_stale_temporaries
from rnndrop.lm.checkpoint import (
    CheckpointError,
    LoadedModel,
    get_rng_state,
    load_checkpoint,
    load_model,
    previous_path,
    save_checkpoint,
    set_rng_state,
)
from rnndrop.lm.configs import (
    TrainConfig,
    build_model,
    build_optimizer,
    get_hook,
    get_regime,
    regime_probabilities,
)
from rnndrop.lm.corpus import Corpus, batchify, bptt_batches, num_bptt_batches
from rnndrop.lm.identity import (
    BEST,
    RESULTS,
    ResultsError,
    best_file,
    corpus_fingerprint,
    file_sha256,
    finished_result,
    identity_differences,
    read_verified_result,
    run_identity,
    write_signed_result,
)
from rnndrop.lm.lock import RunLock, RunLocked
from rnndrop.lm.model import detach_hidden
from rnndrop.lm.results import SCHEMA, peak_memory, plot_learning_curves, versions

__all__ = [
    "CALIBRATION_BINS",
    "CheckpointError",
    "LoadedModel",
    "ResultsError",
    "RunInterrupted",
    "RunLocked",
    "Score",
    "TrainingDiverged",
    "add_mc_result",
    "corpus_fingerprint",
    "evaluate",
    "evaluate_mc",
    "finished_result",
    "identity_differences",
    "load_model",
    "resolve_device",
    "run_identity",
    "score",
    "score_mc",
    "train_run",
]

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
CURVE = "curve.png"

#: Confidence bins of the next-word calibration measured on the test split.
CALIBRATION_BINS = 15

#: Beyond this mean NLL (nats per word) the perplexity overflows a float: a divergence.
MAX_NLL = math.log(torch.finfo(torch.float64).max)

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


class _Progress:
    """A tqdm bar on a terminal when tqdm is installed (below the job's bar of
    :class:`rnndrop.lm.progress.JobProgress`, if one is drawn), else a log line every
    tenth of the loop (e.g. when stderr goes to a file)."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.count = total, desc, 0
        self.bar = None
        self.enabled = enabled
        import sys

        if enabled and sys.stderr.isatty():
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
            except ImportError:
                pass
        self.every = max(1, total // 10)

    def update(self, **stats: float) -> None:
        self.count += 1
        text = {k: f"{v:,.0f}" if v >= 100 else f"{v:.2f}" for k, v in stats.items()}
        if self.bar is not None:
            self.bar.set_postfix(text, refresh=False)
            self.bar.update(1)
        elif self.enabled and (self.count % self.every == 0 or self.count == self.total):
            log.info("%s %d/%d %s", self.desc, self.count, self.total,
                     " ".join(f"{k}={v}" for k, v in text.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _perplexity(nll: float) -> float:
    """``exp(nll)``, infinite where it would overflow."""
    return math.exp(nll) if nll < MAX_NLL else math.inf


def _loss(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


@dataclass(frozen=True)
class Score:
    """How well a language model predicts a token stream.

    Attributes:
        nll: mean negative log-likelihood per token (nats); perplexity is ``exp(nll)``.
        tokens: the number of predicted tokens.
        ece: expected calibration error of the top next-word prediction
            (:mod:`rnndrop.calibration`), or None when not measured.
    """

    nll: float
    tokens: int
    ece: float | None = None

    @property
    def perplexity(self) -> float:
        return _perplexity(self.nll)


@torch.no_grad()
def score(model: nn.Module, batched: Tensor, bptt: int, calibration_bins: int | None = None) -> Score:
    """NLL (and with ``calibration_bins`` the ECE) of ``model`` in eval mode (dropout off:
    the weight-scaling approximation) on a batched stream ``[N, B]``, the state carried
    across segments."""
    was_training = model.training
    model.eval()
    total, count, hidden = 0.0, 0, None
    confidences: list[Tensor] = []
    correct: list[Tensor] = []
    try:
        for inputs, targets in bptt_batches(batched, bptt):
            logits, hidden = model(inputs, hidden)
            total += _loss(logits, targets, "sum").item()
            count += targets.numel()
            if calibration_bins is not None:
                top_prob, top_word = logits.softmax(-1).max(-1)
                confidences.append(top_prob)
                correct.append(top_word == targets)
    finally:
        model.train(was_training)
    ece = None
    if calibration_bins is not None:
        ece = reliability_from_predictions(torch.cat(confidences), torch.cat(correct), calibration_bins).ece
    return Score(total / count, count, ece)


def score_mc(
    model: nn.Module, batched: Tensor, bptt: int, n_samples: int, calibration_bins: int | None = None
) -> Score:
    """:func:`score` under Monte-Carlo dropout (:func:`rnndrop.mc.mc_language_model_loss`):
    every word's predictive probability averaged over ``n_samples`` dropout draws."""
    from rnndrop.mc import mc_language_model_loss

    loss = mc_language_model_loss(
        model, list(bptt_batches(batched, bptt)), n_samples, calibration_bins=calibration_bins
    )
    return Score(loss.nll, loss.num_tokens, None if loss.reliability is None else loss.reliability.ece)


def evaluate(model: nn.Module, batched: Tensor, bptt: int) -> float:
    """Perplexity of ``model`` in eval mode on a batched stream ``[N, B]`` (see :func:`score`)."""
    return score(model, batched, bptt).perplexity


def evaluate_mc(model: nn.Module, batched: Tensor, bptt: int, n_samples: int) -> float:
    """Perplexity under Monte-Carlo dropout with ``n_samples`` draws (see :func:`score_mc`)."""
    return score_mc(model, batched, bptt, n_samples).perplexity


def _has_noise(model: nn.Module) -> bool:
    from rnndrop.mc import sampling_modules

    return bool(sampling_modules(model))


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
    regularizer: Callable[[nn.Module, float, int], Tensor] | None,
    progress: bool,
    checkpoint_path: Path,
    last_good_epoch: int,
) -> tuple[float, int, float]:
    """One pass over the training stream: (train perplexity, words, seconds)."""
    model.train()
    n_batches = num_bptt_batches(batched, config.bptt)
    bar = _Progress(n_batches, f"epoch {epoch}", progress)
    total, words, hidden = 0.0, 0, None
    start = time.perf_counter()
    lr = optimizer.param_groups[0]["lr"]

    def diverged(what: str, batch: int) -> None:
        _diverged(what, epoch, batch, n_batches, lr, checkpoint_path, last_good_epoch)

    try:
        for i, (inputs, targets) in enumerate(bptt_batches(batched, config.bptt)):
            logits, hidden = model(inputs, hidden)
            hidden = detach_hidden(hidden)
            loss = _loss(logits, targets)
            objective = loss
            if regularizer is not None:
                progress_frac = (epoch - 1 + i / n_batches) / config.epochs
                objective = loss + regularizer(model, progress_frac, batched.numel())
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
            bar.update(ppl=_perplexity(total / words), wps=words / max(elapsed, 1e-9))
    finally:
        bar.close()
    return _perplexity(total / words), words, time.perf_counter() - start


def _diverged(what: str, epoch: int, batch: int, n_batches: int, lr: float,
              checkpoint_path: Path, last_good_epoch: int) -> None:
    if not last_good_epoch:
        where = "no epoch had finished, so there is no checkpoint"
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


def _load_latest(ckpt_path: Path) -> dict[str, Any] | None:
    """The newest verified checkpoint of a run, or None when it has none.

    A corrupt ``checkpoint.pt`` is set aside (``checkpoint.corrupt.pt``) and the run
    continues from ``checkpoint.prev.pt`` with a logged warning; with no intact
    previous one the :class:`CheckpointError` is raised.
    """
    prev = previous_path(ckpt_path)
    if ckpt_path.exists():
        try:
            return load_checkpoint(ckpt_path)
        except CheckpointError as e:
            if not prev.exists():
                raise
            corrupt = ckpt_path.with_name(f"{ckpt_path.stem}.corrupt{ckpt_path.suffix}")
            ckpt_path.replace(corrupt)
            log.warning("%s; moved it to %s and resuming from the previous checkpoint %s",
                        e, corrupt.name, prev)
    elif prev.exists():
        log.warning("%s is missing; resuming from the previous checkpoint %s", ckpt_path, prev)
    else:
        return None
    return load_checkpoint(prev)


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
        corpus: the data (see :func:`rnndrop.lm.corpus.load_corpus`).
        config: model size and optimisation.
        regime: a key of :data:`rnndrop.lm.configs.REGIMES`.
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

    Raises:
        TrainingDiverged: a NaN / infinite loss or gradient, or a perplexity that
            overflows (the checkpoint of the last finished epoch is left as it was).
        RunInterrupted: Ctrl-C; finished epochs are saved, resume continues bit for bit.
        RunLocked: another process is writing into ``out_dir``.
        PermissionError: ``out_dir`` is not writable (checked before training).
        FileExistsError: ``out_dir`` holds a checkpoint and ``resume`` is False.
        CheckpointError: a checkpoint that fails verification (and no intact previous one).
        ValueError: the checkpoint belongs to another run (the message names the fields
            that differ), or ``config.epochs`` is below the epochs it has already run.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except PermissionError as e:
        raise PermissionError(f"output folder {str(out)!r} cannot be created ({e.strerror})") from None
    with RunLock(out):
        removed = remove_stale_temporaries(out)
        if removed:
            log.warning("%s: removed %d temporary files left by a killed write: %s", out, len(removed),
                        ", ".join(p.name for p in removed))
        return _train_locked(corpus, config, regime, out, dropout=dropout, seed=seed, resume=resume,
                             device=device, mc_samples=mc_samples, progress=progress, dataset=dataset,
                             on_epoch_end=on_epoch_end, init_from=init_from)


def _train_locked(
    corpus: Corpus, config: TrainConfig, regime: str, out: Path, *, dropout: Mapping[str, float] | None,
    seed: int, resume: bool, device: str | torch.device, mc_samples: int | None, progress: bool,
    dataset: str, on_epoch_end: EpochCallback | None, init_from: str | Path | None,
) -> dict[str, Any]:
    wall_start = time.perf_counter()
    ckpt_path, best_path = out / CHECKPOINT, out / BEST
    regime_obj = get_regime(regime)
    probabilities = regime_probabilities(regime_obj, config.dropout if dropout is None else dropout)
    identity = run_identity(corpus, config, regime, probabilities, seed, init_from)
    regularizer = None if regime_obj.regularizer is None else get_hook(regime_obj.regularizer)
    device = resolve_device(device)
    mc_samples = config.mc_samples if mc_samples is None else mc_samples
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
        raise ValueError(f"mc_samples must be an int >= 0, got {mc_samples!r}")

    torch.manual_seed(seed)
    random.seed(seed)
    model = build_model(len(corpus.vocab), config, regime_obj, probabilities).to(device)
    train_data = batchify(corpus.train, config.batch_size).to(device)
    valid_data = batchify(corpus.valid, config.eval_batch_size).to(device)
    test_data = batchify(corpus.test, config.eval_batch_size).to(device)

    state: dict[str, Any] = {
        "epoch": 0, "lr": config.lr, "best_valid_ppl": math.inf, "best_epoch": 0,
        "history": [], "train_seconds": 0.0, "train_words": 0, "wall_seconds": 0.0,
        "stopped": None, "init_from": None,
    }
    has_checkpoint = ckpt_path.exists() or previous_path(ckpt_path).exists()
    if has_checkpoint and not resume:
        raise FileExistsError(
            f"{str(out)!r} already holds a checkpoint; pass resume=True (--resume) to "
            "continue that run, or choose another output folder"
        )
    ckpt = _load_latest(ckpt_path) if has_checkpoint else None
    if ckpt is not None:
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
        if ckpt["progress"]["best_epoch"]:
            load_checkpoint(best_path)  # verify it now rather than after training
    else:
        if init_from is not None:
            state["init_from"] = _load_initial_weights(model, init_from)
    optimizer = build_optimizer(model.parameters(), config)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        state.update(ckpt["progress"])
        set_rng_state(ckpt["rng"])
        log.info("%s: resumed after epoch %d", out, state["epoch"])

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
                model, optimizer, train_data, config, epoch, regularizer, progress,
                ckpt_path, state["epoch"],
            )
            valid_ppl = evaluate(model, valid_data, config.bptt)
            if not math.isfinite(valid_ppl):
                _diverged(f"the validation perplexity is {valid_ppl}", epoch,
                          num_bptt_batches(train_data, config.bptt) - 1,
                          num_bptt_batches(train_data, config.bptt), lr, ckpt_path, state["epoch"])
            improved = valid_ppl < state["best_valid_ppl"]
            if improved:
                state["best_valid_ppl"], state["best_epoch"] = valid_ppl, epoch
                save_checkpoint({"model": model.state_dict(), "epoch": epoch, **best_extras}, best_path)
            next_lr = lr / config.lr_decay if config.schedule == "plateau" and not improved else lr
            record = {
                "epoch": epoch, "lr": lr, "train_ppl": train_ppl, "valid_ppl": valid_ppl,
                "seconds": seconds, "words_per_second": words / seconds,
            }
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
            save_checkpoint(
                {"identity": identity, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "progress": state, "rng": get_rng_state()},
                ckpt_path, keep_previous=True,
            )
            if on_epoch_end is not None:
                on_epoch_end(epoch, record)
    except KeyboardInterrupt as e:
        if isinstance(e, RunInterrupted):
            raise
        raise RunInterrupted(epoch, out) from e

    model.load_state_dict(load_checkpoint(best_path)["model"])
    test = score(model, test_data, config.bptt, CALIBRATION_BINS)
    test_mc = None
    if mc_samples > 0 and _has_noise(model):
        torch.manual_seed(seed)
        test_mc = score_mc(model, test_data, config.bptt, mc_samples, CALIBRATION_BINS)
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
        "versions": versions(),
        "identity": identity,
    }
    write_signed_result(result, out / RESULTS)
    plot_learning_curves([result], out / CURVE)
    return result


def add_mc_result(
    corpus: Corpus, config: TrainConfig, out_dir: str | Path, n_samples: int,
    device: str | torch.device = "auto",
) -> dict[str, Any]:
    """Add the Monte-Carlo test perplexity to a finished run's results.json (verified
    before, re-signed after). ``config`` gives the evaluation batch size and BPTT; the
    model is rebuilt from ``best.pt``."""
    out = Path(out_dir)
    with RunLock(out):
        result = read_verified_result(out / RESULTS)
        device = resolve_device(device)
        model = load_model(out, device).model
        if n_samples > 0 and _has_noise(model):
            torch.manual_seed(result["seed"])
            start = time.perf_counter()
            test_data = batchify(corpus.test, config.eval_batch_size).to(device)
            test_mc = score_mc(model, test_data, config.bptt, n_samples, CALIBRATION_BINS)
            result.update(test_ppl_mc=test_mc.perplexity, test_nll_mc=test_mc.nll, test_ece_mc=test_mc.ece)
            result["mc_samples"] = n_samples
            result["mc_seconds"] = time.perf_counter() - start
            write_signed_result(result, out / RESULTS)
    return result
