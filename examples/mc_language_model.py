"""Monte-Carlo dropout on a word-level language model: perplexity, uncertainty, calibration.

Trains an :class:`rnndrop.lm.RNNLanguageModel` with tied (variational) dropout for
``--train-seconds`` on a PTB-format corpus (``ptb.{train,valid,test}.txt``), then on
the test split

- compares the standard perplexity (dropout off) with the MC perplexity
  (:func:`rnndrop.mc.mc_perplexity`: every word's probability averaged over samples);
- runs :func:`rnndrop.mc.mc_predict` over the test stream and lists the next-word
  predictions the model is least sure about, by mutual information (the part of the
  predictive entropy that comes from the spread between dropout samples);
- draws reliability diagrams of the standard and the MC next-word predictions into
  ``--out/mc_language_model_reliability.png``, with their expected calibration errors.

Run (``--data`` defaults to the PTB sample shipped with rnndrop; any folder with
``ptb.{train,valid,test}.txt`` works)::

    python examples/mc_language_model.py --out /tmp/mc_lm
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from rnndrop.atomic import unwritable
from rnndrop.calibration import reliability_diagram
from rnndrop.lm import (
    CorpusError,
    RNNLanguageModel,
    batchify,
    bptt_batches,
    detach_hidden,
    evaluate,
    load_corpus,
)
from rnndrop.lm.data.corpus import sample_dir
from rnndrop.lm.run.report import reliability_axes
from rnndrop.mc import mc_perplexity, mc_predict


def train(model: nn.Module, stream: torch.Tensor, args: argparse.Namespace) -> None:
    """SGD with clipping over truncated-BPTT segments until the time budget is spent."""
    data = batchify(stream, args.batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    epoch = 0
    while time.perf_counter() - start < args.train_seconds:
        epoch += 1
        model.train()
        hidden, total, count = None, 0.0, 0
        for inputs, targets in bptt_batches(data, args.bptt):
            hidden = detach_hidden(hidden)
            logits, hidden = model(inputs, hidden)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            total += loss.item() * targets.numel()
            count += targets.numel()
            if time.perf_counter() - start > args.train_seconds:
                break
        print(f"epoch {epoch}: train perplexity {math.exp(total / count):.1f} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)


def fail(message: str) -> None:
    """One line on stderr and exit status 2 (a data or usage problem)."""
    sys.stderr.write(f"error: {message}\n")
    raise SystemExit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=sample_dir("ptb"),
                        help="corpus folder (default: the PTB sample shipped with rnndrop)")
    parser.add_argument("--out", type=Path, default=Path("mc_language_model_out"))
    parser.add_argument("--train-seconds", type=float, default=60.0)
    parser.add_argument("--size", type=int, default=200, help="embedding and hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--lr", type=float, default=20.0)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--samples", type=int, default=50, help="MC samples")
    parser.add_argument("--eval-batch-size", type=int, default=10)
    parser.add_argument("--show", type=int, default=15, help="how many uncertain predictions to list")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for name in ("size", "layers", "batch_size", "bptt", "samples", "eval_batch_size", "threads"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    for name in ("train_seconds", "lr", "clip"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.show < 0:
        fail(f"--show must be >= 0, got {args.show}")
    if why := unwritable(args.out, folder=True):
        fail(f"--out {str(args.out)!r}: {why}")
    try:  # imported only to run the example (--help works without it)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("the reliability diagrams need matplotlib: pip install -e \".[examples]\"")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    try:  # the corpus, and batches of the sizes asked for (a split too short for them)
        corpus = load_corpus(args.data)
        batchify(corpus.train, args.batch_size, split="the train split", size_name="--batch-size")
        batchify(corpus.test, args.eval_batch_size, split="the test split", size_name="--eval-batch-size")
    except CorpusError as e:
        fail(str(e))
    vocab = corpus.vocab
    print(f"{args.data}: {corpus.train.numel()} training words, vocabulary {len(vocab)}")
    model = RNNLanguageModel(
        len(vocab), args.size, args.size, args.layers,
        dropout_embedding=0.1, dropout_input=0.5, dropout_between=0.5, dropout_hidden=0.2,
        dropout_output=0.5,
    )
    train(model, corpus.train, args)

    test = batchify(corpus.test, args.eval_batch_size)  # [N, B]
    start = time.perf_counter()
    standard = evaluate(model, test, args.bptt)
    seconds = time.perf_counter() - start
    torch.manual_seed(args.seed + 1)
    start = time.perf_counter()
    mc = mc_perplexity(model, bptt_batches(test, args.bptt), n_samples=args.samples)
    mc_seconds = time.perf_counter() - start
    print(f"test perplexity: standard (dropout off) {standard:.1f} in {seconds:.1f} s, "
          f"MC ({args.samples} samples) {mc:.1f} in {mc_seconds:.1f} s")

    # Per-word uncertainty: every column of the test stream as one sequence, the
    # masks of each sample tied over the whole column.
    inputs, targets = test[:-1], test[1:]  # [T, B]
    model.eval()
    with torch.no_grad():
        standard_probs = model(inputs)[0].softmax(-1)  # [T, B, V]
    torch.manual_seed(args.seed + 2)
    prediction = mc_predict(model, inputs, n_samples=args.samples, batch_dim=1)
    mi = prediction.mutual_information  # [T, B]
    mean = prediction.mean  # [T, B, V]
    target_p = mean.gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    print(f"\nThe {args.show} next-word predictions with the highest mutual information, one per "
          "(word, next word) pair (nats; H = predictive entropy):")
    print(f"{'context':>42}  {'next word':<12} {'MC top guess':<12} {'p(next)':>7} {'H':>5} {'MI':>5}")
    shown: set[tuple[int, int]] = set()
    for flat in mi.flatten().argsort(descending=True).tolist():
        t, b = divmod(flat, mi.shape[1])
        pair = (int(inputs[t, b]), int(targets[t, b]))
        if pair in shown:
            continue
        shown.add(pair)
        if len(shown) > args.show:
            break
        context = " ".join(vocab.decode(inputs[max(0, t - 5) : t + 1, b]))
        guess = vocab.itos[int(mean[t, b].argmax())]
        print(f"{context[-42:]:>42}  {vocab.itos[int(targets[t, b])]:<12} {guess:<12} "
              f"{target_p[t, b]:7.3f} {prediction.predictive_entropy[t, b]:5.2f} {mi[t, b]:5.2f}")

    by_word: dict[str, list[float]] = {}
    for word_id, value in zip(inputs.flatten().tolist(), mi.flatten().tolist()):
        by_word.setdefault(vocab.itos[word_id], []).append(value)
    ranked = sorted(((sum(v) / len(v), w, len(v)) for w, v in by_word.items() if len(v) >= 5), reverse=True)
    print("\nWords after which the model is least sure what comes next (mean MI, ≥5 occurrences):")
    print(", ".join(f"{w} {m:.2f} ({n}x)" for m, w, n in ranked[:12]))
    print(f"mean MI over the test split: {mi.mean():.3f} nats; mean predictive entropy "
          f"{prediction.predictive_entropy.mean():.3f}")

    diagrams = {
        "standard (dropout off)": reliability_diagram(standard_probs, targets),
        f"MC dropout ({args.samples} samples)": reliability_diagram(mean, targets),
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 6), height_ratios=(3, 1), sharex=True)
    for column, (title, diagram) in enumerate(diagrams.items()):
        reliability_axes(axes[0, column], axes[1, column], diagram, f"Next-word prediction, {title}")
        print(f"ECE {title}: {100 * diagram.ece:.2f}%")
    axes[0, 0].set_ylabel("accuracy")
    axes[1, 0].set_ylabel("predictions")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one entry per kind of bar
    axes[0, 0].legend(unique.values(), unique.keys(), loc="upper left", fontsize=8)
    fig.suptitle(f"{args.data.name} test split, {len(vocab)}-word vocabulary")
    fig.tight_layout()
    path = args.out / "mc_language_model_reliability.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
