"""Sparse variational dropout against Bernoulli tied dropout: perplexity, sparsity, speed.

Two parts, both on one CPU thread by default:

1. ``timing``: one training step (forward + backward) of a 2-layer LSTM layer, batch 20,
   35 steps, for nn.LSTM, Bernoulli tied dropout (VariationalLSTM, per-sequence masks),
   learned-alpha Gaussian dropout (GaussianLSTM) and sparse VD (SparseLSTM); shuffled,
   interleaved rounds; the median time and its ratio to Bernoulli tied dropout.
2. ``lm``: word-level language models on a small corpus: the Bernoulli tied model of the
   ``mini`` config (SGD, lr 20, plateau decay, as in benchmarks/ptb.py) against a sparse-VD
   model whose embedding, LSTM and decoder are all sparse (Adam, KL with linear warm-up,
   Lobacheva et al. 2017). Reports test perplexity (eval mode, and of the pruned model),
   sparsity per weight and the compression ratio.

    python benchmarks/sparse_vd.py --data ../shared/data/ptb-mini --out /tmp/sparse_vd.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rnndrop.gaussian import GaussianLSTM
from rnndrop.kl import kl_warmup, model_kl, negative_elbo
from rnndrop.lm.corpus import batchify, bptt_batches, load_corpus
from rnndrop.lm.model import RNNLanguageModel, detach_hidden
from rnndrop.lm.train import evaluate
from rnndrop.recurrent import VariationalLSTM
from rnndrop.sparse import SparseEmbedding, SparseLinear, SparseLSTM, prune, sparsity_report

BERNOULLI = {"embedding": 0.1, "hidden": 0.2, "input": 0.5, "between": 0.5, "output": 0.5}


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


def bernoulli_model(vocab: int, size: int) -> nn.Module:
    return RNNLanguageModel(
        vocab, size, size, 2, dropout_embedding=BERNOULLI["embedding"],
        dropout_input=BERNOULLI["input"], dropout_between=BERNOULLI["between"],
        dropout_hidden=BERNOULLI["hidden"], dropout_output=BERNOULLI["output"], init_scale=0.1,
    )


def sparse_model(vocab: int, size: int) -> nn.Module:
    model = RNNLanguageModel(vocab, size, size, 2, rnn=SparseLSTM(size, size, 2), init_scale=0.1)
    model.embedding.embedding = SparseEmbedding(vocab, size)
    model.decoder = SparseLinear(size, vocab)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "log_sigma2" not in name:
                param.uniform_(-0.1, 0.1)
    return model


def train_lm(model: nn.Module, corpus, epochs: int, variational: bool, log,
             kl_dataset_size: int | None = None) -> dict:
    """Train with the regime's optimiser; keep the parameters of the best validation epoch."""
    train = batchify(corpus.train, 20)
    valid, test = batchify(corpus.valid, 10), batchify(corpus.test, 10)
    n_train = kl_dataset_size or int(corpus.train.numel())
    n_batches = -(-(train.shape[0] - 1) // 35)
    if variational:
        optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
    best, best_state, history, train_seconds = math.inf, None, [], 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        hidden, start = None, time.perf_counter()
        for i, (inputs, targets) in enumerate(bptt_batches(train, 35)):
            logits, hidden = model(inputs, hidden)
            hidden = detach_hidden(hidden)
            nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            if variational:
                progress = (epoch - 1 + i / n_batches) / epochs
                loss = negative_elbo(nll, model_kl(model), n_train, kl_warmup(progress, 0.3))
            else:
                loss = nll
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.25 if not variational else 5.0)
            optimizer.step()
        train_seconds += time.perf_counter() - start
        valid_ppl = evaluate(model, valid, 35)
        record = {"epoch": epoch, "valid_ppl": valid_ppl, "lr": optimizer.param_groups[0]["lr"]}
        if variational:
            record["sparsity"] = sparsity_report(model).sparsity
        history.append(record)
        log(f"  epoch {epoch}: {record}")
        if valid_ppl < best:
            best = valid_ppl
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        elif not variational:
            for group in optimizer.param_groups:
                group["lr"] /= 4.0  # the mini config's plateau decay
    model.load_state_dict(best_state)
    result = {"best_valid_ppl": best, "test_ppl": evaluate(model, test, 35),
              "train_seconds": train_seconds, "history": history}
    if variational:
        report = sparsity_report(model)
        pruned = prune(model)
        result.update(
            test_ppl_pruned=evaluate(pruned, test, 35),
            sparsity={layer.name: layer.sparsity for layer in report.layers},
            total_sparsity=report.sparsity, compression=report.compression,
            model_compression=report.model_compression, report=str(report),
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="../shared/data/ptb-mini")
    parser.add_argument("--parts", default="timing,lm")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--size", type=int, default=200, help="embedding and hidden size")
    parser.add_argument("--rounds", type=int, default=15, help="timing rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="")
    parser.add_argument("--models", default="bernoulli_tied,sparse_vd")
    parser.add_argument("--kl-dataset-size", type=int, default=0,
                        help="N dividing the KL (default: the training tokens)")
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
        corpus = load_corpus(args.data)
        vocab = len(corpus.vocab)
        for name, build, variational in (("bernoulli_tied", bernoulli_model, False),
                                         ("sparse_vd", sparse_model, True)):
            if name not in args.models.split(","):
                continue
            log(f"{name}:")
            torch.manual_seed(args.seed)
            random.seed(args.seed)
            results[name] = train_lm(build(vocab, args.size), corpus, args.epochs, variational, log,
                                     args.kl_dataset_size or None)
            log(f"{name}: test ppl {results[name]['test_ppl']:.2f}")
        if "sparse_vd" in results:
            log(results["sparse_vd"]["report"])
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
