"""How long a benchmark job should take on this machine, from a few timed steps.

:func:`estimate_seconds` times two training steps, two evaluation forwards and two
dropout forwards of each regime on the corpus's first batches and scales them to the
job: every epoch of the training split, a validation pass per epoch, a test pass and
the Monte-Carlo passes of each run. It is what ``rnndrop-lm`` prints before training.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from rnndrop.lm.data.corpus import Corpus, batchify
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.regimes import get_regime, regime_probabilities
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.setup import resolve_device

__all__ = ["estimate_seconds"]


def estimate_seconds(
    corpus: Corpus, config: TrainConfig, runs: Sequence[tuple[str, Mapping[str, float]]],
    mc_samples: int, *, jobs: int = 1, threads: int | None = None, device: str = "auto",
    epochs_left: Sequence[int] | None = None,
) -> float:
    """Wall seconds a job of ``runs`` (regime, dropout) should take on this machine, at most.

    Times two training steps, two evaluation forwards and two dropout forwards of each
    distinct regime on the corpus's first batches, and scales them to ``config.epochs``
    (plus ``finetune_epochs``) epochs of the training split, a validation pass per epoch, a test pass and
    ``mc_samples`` Monte-Carlo passes per run; ``jobs`` runs share the time. ``epochs_left``
    (one per run) counts fewer epochs for runs that resume part-way.
    """
    if epochs_left is not None and len(epochs_left) != len(runs):
        raise ValueError(f"epochs_left: expected one count per run ({len(runs)}), got {len(epochs_left)}")
    device_obj = resolve_device(device)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    rng = torch.get_rng_state()
    cost: dict[str, tuple[float, float, float]] = {}
    try:
        train = batchify(corpus.train, config.batch_size)[: config.bptt + 1].to(device_obj)
        valid = batchify(corpus.valid, config.eval_batch_size)[: config.bptt + 1].to(device_obj)
        for regime_name, probabilities in runs:
            key = json.dumps([regime_name, dict(probabilities)], sort_keys=True)
            if key in cost:
                continue
            regime = get_regime(regime_name)
            model = build_model(len(corpus.vocab), config, regime, probabilities).to(device_obj)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
            cost[key] = (
                _seconds_per_word(lambda m=model, o=optimizer: _train_step(m, o, train), train),
                _seconds_per_word(lambda m=model: _forward(m, valid, training=False), valid),
                _seconds_per_word(lambda m=model: _forward(m, valid, training=True), valid),
            )
    finally:
        torch.set_rng_state(rng)
        torch.set_num_threads(old_threads)
    total = 0.0
    n_train, n_valid, n_test = (corpus.split(s).numel() for s in ("train", "valid", "test"))
    all_epochs = config.epochs + config.finetune_epochs
    for (regime_name, probabilities), epochs in zip(runs, epochs_left or [all_epochs] * len(runs)):
        train_w, eval_w, sample_w = cost[json.dumps([regime_name, dict(probabilities)], sort_keys=True)]
        noisy = any(regime_probabilities(get_regime(regime_name), probabilities).values())
        total += epochs * (n_train * train_w + n_valid * eval_w) + n_test * eval_w
        total += mc_samples * n_test * sample_w if noisy else 0.0
    return total / max(1, min(jobs, len(runs)))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batched: torch.Tensor) -> None:
    model.train()
    logits, _ = model(batched[:-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batched[1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


@torch.no_grad()
def _forward(model: torch.nn.Module, batched: torch.Tensor, *, training: bool) -> None:
    model.train(training)
    model(batched[:-1])
    model.train()


def _seconds_per_word(step: Callable[[], None], batched: torch.Tensor) -> float:
    step()  # warm-up: allocations, kernel selection
    start = time.perf_counter()
    for _ in range(2):
        step()
    return (time.perf_counter() - start) / (2 * (batched.shape[0] - 1) * batched.shape[1])
