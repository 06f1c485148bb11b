"""Sparse variational dropout against Bernoulli tied dropout: perplexity, sparsity, speed.

Two parts, both on one CPU thread by default:

1. ``timing``: one training step (forward + backward) of a 2-layer LSTM layer, batch 20,
   35 steps, for nn.LSTM, Bernoulli tied dropout (VariationalLSTM, per-sequence masks),
   learned-alpha Gaussian dropout (GaussianLSTM) and sparse VD (SparseLSTM); shuffled,
   interleaved rounds; the median time and its ratio to Bernoulli tied dropout.
2. ``lm``: word-level language models trained by the one LM loop
   (:func:`rnndrop.lm.train.train_run`): regime ``tied`` under the ``mini`` config (SGD,
   lr 20, plateau decay), regime ``sparse_vd`` under ``sparse-vd-mini`` (Adam, KL with
   linear warm-up, Lobacheva et al. 2017) from scratch, and ``sparse_vd`` fine-tuned from
   the tied run's best weights (``init_from``: train dense, then sparsify). Reports test
   perplexity (eval mode, and of the pruned model), sparsity per weight and compression.
   Each run lives in a folder under ``--runs`` and resumes with ``--resume``.

    python benchmarks/sparse_vd.py --data ../shared/data/ptb-mini --out /tmp/sparse_vd.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from rnndrop.gaussian import GaussianLSTM
from rnndrop.kl import model_kl
from rnndrop.lm.checkpoint import load_model
from rnndrop.lm.configs import get_config
from rnndrop.lm.corpus import batchify, load_corpus
from rnndrop.lm.evaluate import evaluate
from rnndrop.lm.train import train_run
from rnndrop.recurrent import VariationalLSTM
from rnndrop.sparse import SparseLSTM, prune, sparsity_report


def time_layers(hidden: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median seconds of one forward + backward per layer variant, and ratio to Bernoulli tied."""
    p = {"dropout": 0.5, "dropout_input": 0.5, "dropout_hidden": 0.2, "dropout_output": 0.5}
    layers = {
        "nn.LSTM": nn.LSTM(hidden, hidden, 2),
        "bernoulli tied (VariationalLSTM)": VariationalLSTM(hidden, hidden, 2, **p),
        "bernoulli, batch-scope recurrent mask": VariationalLSTM(
            hidden, hidden, 2, **p, mask_scope="batch"),
        "gaussian learned alpha (GaussianLSTM)": GaussianLSTM(hidden, hidden, 2, **p),
        "gaussian learned alpha, batch scope": GaussianLSTM(
            hidden, hidden, 2, **p, mask_scope="batch"),
        "sparse VD (SparseLSTM)": SparseLSTM(hidden, hidden, 2),
    }
    x = torch.randn(35, 20, hidden)
    times: dict[str, list[float]] = {name: [] for name in layers}
    order = list(layers)
    for r in range(rounds + 2):
        random.shuffle(order)
        for name in order:
            layer = layers[name].train()
            start = time.perf_counter()
            out, _ = layer(x)
            loss = out.pow(2).mean()
            if isinstance(layer, (GaussianLSTM, SparseLSTM)):
                loss = loss + model_kl(layer) * 1e-6
            loss.backward()
            elapsed = time.perf_counter() - start
            layer.zero_grad(set_to_none=True)
            if r >= 2:  # two warm-up rounds
                times[name].append(elapsed)
    base = statistics.median(times["bernoulli tied (VariationalLSTM)"])
    return {name: {"ms": 1000 * statistics.median(t), "ratio": statistics.median(t) / base}
            for name, t in times.items()}


def sparsity_of_run(folder: Path, corpus) -> dict:
    """Sparsity and the pruned model's test perplexity of a finished sparse-VD run."""
    run = load_model(folder)
    test = batchify(corpus.test, run.config.eval_batch_size)
    report = sparsity_report(run.model)
    return {
        "test_ppl_pruned": evaluate(prune(run.model), test, run.config.bptt),
        "sparsity": {layer.name: layer.sparsity for layer in report.layers},
        "total_sparsity": report.sparsity, "compression": report.compression,
        "model_compression": report.model_compression, "report": str(report),
    }


def lm_runs(args, log) -> dict:
    corpus = load_corpus(args.data)
    runs = Path(args.runs)
    dense = replace(get_config("mini"), epochs=args.epochs, mc_samples=0)
    sparse = replace(get_config("sparse-vd-mini"), epochs=args.epochs)
    plan = {
        "bernoulli_tied": (dense, "tied", None),
        "sparse_vd": (sparse, "sparse_vd", None),
        "sparse_vd_finetuned": (sparse, "sparse_vd", runs / "bernoulli_tied"),
    }
    results = {}
    for name in args.models.split(","):
        if name not in plan:
            raise SystemExit(f"--models: expected among {', '.join(plan)}, got {name!r}")
        config, regime, init_from = plan[name]
        log(f"{name}:")
        result = train_run(corpus, config, regime, runs / name, seed=args.seed, resume=args.resume,
                           device="cpu", progress=False, dataset=Path(args.data).name,
                           init_from=init_from)
        summary = {k: result[k] for k in ("best_valid_ppl", "test_ppl", "train_seconds", "init_from")}
        summary["history"] = result["epochs"]
        if regime == "sparse_vd":
            summary.update(sparsity_of_run(runs / name, corpus))
            log(summary["report"])
        results[name] = summary
        log(f"{name}: test ppl {result['test_ppl']:.2f}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="../shared/data/ptb-mini")
    parser.add_argument("--parts", default="timing,lm")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--size", type=int, default=200, help="embedding and hidden size of the timing part")
    parser.add_argument("--rounds", type=int, default=15, help="timing rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="")
    parser.add_argument("--models", default="bernoulli_tied,sparse_vd,sparse_vd_finetuned",
                        help="among bernoulli_tied, sparse_vd, sparse_vd_finetuned (needs bernoulli_tied)")
    parser.add_argument("--runs", default="runs/sparse_vd", help="folder of the runs")
    parser.add_argument("--resume", action="store_true", help="continue or reuse earlier runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    results: dict = {"args": vars(args), "torch": torch.__version__}
    parts = args.parts.split(",")
    if "timing" in parts:
        torch.manual_seed(args.seed)
        results["timing"] = time_layers(args.size, args.rounds)
        for name, t in results["timing"].items():
            log(f"{name:40s} {t['ms']:8.1f} ms  x{t['ratio']:.2f}")
    if "lm" in parts:
        results.update(lm_runs(args, log))
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
