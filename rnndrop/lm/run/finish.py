"""The end of a run: the test scores of its best epoch and its signed results.json.

:func:`finish_run` tests the weights of the best validation epoch (and, when the model
has dropout noise, under Monte-Carlo dropout), then writes ``results.json`` and
``curve.png``; :func:`add_mc_result` adds the Monte-Carlo test perplexity to a run
that finished without it.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rnndrop.distributed import seed_noise_per_rank
from rnndrop.lm.data.corpus import Corpus, batchify
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.regimes import Regime
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import load_checkpoint, load_model, load_state
from rnndrop.lm.run.evaluate import CALIBRATION_BINS, Score, has_noise, score_split
from rnndrop.lm.run.folder import ALPHAS, CURVE, RESULTS
from rnndrop.lm.run.identity import best_file, read_verified_result, write_signed_result
from rnndrop.lm.run.lock import RunLock
from rnndrop.lm.run.plots import plot_alphas, plot_learning_curves
from rnndrop.lm.run.process_group import Distributed, current, run_on_main
from rnndrop.lm.run.progress import format_duration
from rnndrop.lm.run.result_file import SCHEMA, peak_memory, versions
from rnndrop.lm.run.schedule import CONVERGED, EPOCH_CAP, Schedule
from rnndrop.lm.run.setup import Training, rank_device
from rnndrop.lm.run.state import RunState

__all__ = ["add_mc_result", "finish_run"]

log = logging.getLogger(__name__)

#: how the Monte-Carlo passes are labelled in bars and log lines
MC_PROGRESS = "MC test, {} samples"


def finish_run(run: Training, bar: bool = False) -> dict[str, Any]:
    """Test the best epoch's weights, then write and return the run's result; the
    Monte-Carlo passes show their progress (a bar on a terminal when ``bar``, else log lines)."""
    config, ctx = run.config, run.ctx
    best = run_on_main(lambda: load_checkpoint(run.best_path)["model"], ctx, "reading best.pt")
    load_state(run.model, best, run.best_path)
    start = time.perf_counter()
    test = score_split(run.model, run.test_data, config.bptt, CALIBRATION_BINS, ctx)
    test_mc = None
    if run.mc_samples > 0 and has_noise(run.model):
        one_pass = time.perf_counter() - start
        if ctx.is_main:  # the phase after the last epoch's bar: say what runs and for how long
            log.info("%s: Monte-Carlo test perplexity, %d dropout samples (up to about %s)", run.out,
                     run.mc_samples, format_duration(one_pass * run.mc_samples))
        seed_noise(run.seed, ctx)
        test_mc = score_split(run.model, run.test_data, config.bptt, CALIBRATION_BINS, ctx, run.mc_samples,
                              progress=MC_PROGRESS.format(run.mc_samples), bar=bar)
    run.state.add_wall_time(run.wall_start)
    result = _result(run, test, test_mc)

    def write_result() -> dict[str, Any]:
        write_signed_result(result, run.out / RESULTS)
        plot_learning_curves([result], run.out / CURVE)
        plot_alphas([result], run.out / ALPHAS)
        return result

    return run_on_main(write_result, ctx, "writing results.json")


def seed_noise(seed: int, ctx: Distributed) -> None:
    """Seed the dropout noise of an evaluation: ``seed`` itself in one process, each rank
    its own stream under DDP."""
    if ctx.enabled:
        seed_noise_per_rank(seed, ctx.rank)
    else:
        torch.manual_seed(seed)


def _result(run: Training, test: Score, test_mc: Score | None) -> dict[str, Any]:
    """The content of results.json (see :mod:`rnndrop.lm.run.result_file` for its schema)."""
    state = run.state
    stop_reason = Schedule.stop_reason(state)
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
        "threads": torch.get_num_threads(),
        # Processes that trained the model together (DDP) and their backend (None: one process).
        "world_size": run.ctx.world_size,
        "backend": run.ctx.backend,
        "versions": versions(),
        "identity": run.identity,
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
        device = rank_device(device, ctx)
        if ctx.enabled:
            model = build_model(len(corpus.vocab), TrainConfig.from_dict(result["config"]),
                                Regime.from_settings(result["regime_settings"]), result["dropout"])
            load_state(model, best_state, best_file(out))
            model.to(device).eval()
        else:
            model = load_model(out, device).model
        if n_samples > 0 and has_noise(model):
            seed_noise(result["seed"], ctx)
            start = time.perf_counter()
            test_data = batchify(corpus.test, config.eval_batch_size).to(device)
            test_mc = score_split(model, test_data, config.bptt, CALIBRATION_BINS, ctx, n_samples,
                                  progress=MC_PROGRESS.format(n_samples))
            result.update(test_ppl_mc=test_mc.perplexity, test_nll_mc=test_mc.nll, test_ece_mc=test_mc.ece)
            result["mc_samples"] = n_samples
            result["mc_seconds"] = time.perf_counter() - start

            def write() -> dict[str, Any]:
                write_signed_result(result, out / RESULTS)
                return result

            result = run_on_main(write, ctx, "writing results.json")
    return result
