"""Sparse variational dropout on a word-level LM: the recipe, its trade-off, the pruned model.

The recipe (docs/sparse-vd-results.md): take a converged dense run of regime ``tied``
(config cpu-200) and fine-tune it with regime ``sparse_vd`` under config
``sparse-vd-cpu-200`` (Adam, KL warm-up, tied dropout kept on the other sites), once
per KL weight. Each fine-tune is one ``rnndrop.lm`` run (``train_run(init_from=...)``)
in a folder under ``--runs``, resumable with ``--resume``. Then, for every run and
every threshold on log alpha: validation and test perplexity of the pruned model and
the compression of the LSTM weights; the embedding and decoder are counted apart.
The headline is the most compressed (KL weight, threshold) whose *validation* perplexity
is within ``--budget`` of the dense model's; its test numbers are reported.
For the headline it also measures the pruned model: parameters, the size of its saved
state (dense, and with the LSTM weights in CSR), and LSTM inference time with dense
matmuls over zeros against CSR matmuls. ``--gaussian RUN`` plots the per-unit alpha
that a finished run of regime ``gaussian`` learned.

    python benchmarks/sparse_vd.py --data ../shared/data/ptb-144k \\
        --dense runs/ptb144k/tied/emb0.1-in0.5-mid0.5-rec0.2-out0.5-seed1 \\
        --kl-weights 1,0.3,0.1 --runs runs/sparse-vd --resume --out results/sparse-vd
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from rnndrop.atomic import atomic_write, unwritable, write_json_atomic
from rnndrop.deploy import prune
from rnndrop.lm.data.corpus import batchify, load_corpus
from rnndrop.lm.model.presets import get_config
from rnndrop.lm.run.checkpoint import load_model, read_verified_result
from rnndrop.lm.run.evaluate import score
from rnndrop.lm.run.train import train_run
from rnndrop.sparse import DEFAULT_THRESHOLD, Sparsified, sparsity_report


def set_threshold(model: nn.Module, threshold: float) -> None:
    for module in model.modules():
        if isinstance(module, Sparsified):
            module.threshold = threshold


def nonzero_parameters(module: nn.Module) -> tuple[int, int]:
    """(all parameters, nonzero parameters) of a plain module."""
    total = sum(p.numel() for p in module.parameters())
    return total, sum(int(p.count_nonzero()) for p in module.parameters())


def tradeoff(folder: Path, corpus, config, thresholds: list[float], dense_valid: float) -> list[dict]:
    """One row per threshold: LSTM compression and the pruned model's perplexities."""
    model = load_model(folder).model.eval()
    valid = batchify(corpus.valid, config.eval_batch_size)
    test = batchify(corpus.test, config.eval_batch_size)
    rows = []
    for threshold in thresholds:
        set_threshold(model, threshold)
        report = sparsity_report(model)
        pruned = prune(model).eval()
        valid_ppl = score(pruned, valid, config.bptt).perplexity
        rows.append({
            "threshold": threshold, "lstm_weights": report.total, "lstm_nonzero": report.total - report.zeros,
            "lstm_compression": report.compression, "valid_ppl": valid_ppl,
            "valid_vs_dense": valid_ppl / dense_valid - 1,
            "test_ppl": score(pruned, test, config.bptt).perplexity,
            "per_weight": {layer.name: layer.sparsity for layer in report.layers},
        })
    set_threshold(model, DEFAULT_THRESHOLD)
    return rows


def saved_size(state: dict[str, Tensor]) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getbuffer().nbytes


def csr_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The LSTM weight matrices in CSR with int32 indices; everything else as it is."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("rnn.weight_"):
            csr = tensor.to_sparse_csr()
            out[name] = torch.sparse_csr_tensor(csr.crow_indices().int(), csr.col_indices().int(),
                                                csr.values(), csr.shape)
        else:
            out[name] = tensor
    return out


def csr_layers(lstm: nn.LSTM) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(W_ih in CSR, W_hh in CSR, b_ih + b_hh) per layer: converted once, before any forward."""
    return [(getattr(lstm, f"weight_ih_l{k}").detach().to_sparse_csr(),
             getattr(lstm, f"weight_hh_l{k}").detach().to_sparse_csr(),
             (getattr(lstm, f"bias_ih_l{k}") + getattr(lstm, f"bias_hh_l{k}")).detach())
            for k in range(lstm.num_layers)]


def csr_lstm(layers: list[tuple[Tensor, Tensor, Tensor]], inputs: Tensor) -> Tensor:
    """``nn.LSTM``'s forward (zero initial state, unidirectional) with CSR matmuls.

    ``layers`` from :func:`csr_layers`; inputs ``[T, B, in]`` -> outputs ``[T, B, hidden]``;
    gates ``i, f, g, o`` as in nn.LSTM. The input projection of all steps is one product.
    """
    out = inputs
    for w_ih, w_hh, bias in layers:
        steps, batch, _ = out.shape
        x_gates = (w_ih @ out.reshape(steps * batch, -1).t()).t().reshape(steps, batch, -1) + bias
        h = out.new_zeros(batch, w_hh.shape[1])
        c = out.new_zeros(batch, w_hh.shape[1])
        hs = []
        for t in range(steps):
            i, f, g, o = (x_gates[t] + (w_hh @ h.t()).t()).chunk(4, 1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            hs.append(h)
        out = torch.stack(hs)
    return out


def inference_timing(lstm: nn.LSTM, size: int, rounds: int) -> dict[str, float]:
    """Median ms of one LSTM forward over [35, 10, size] inputs: dense over zeros vs CSR."""
    x = torch.randn(35, 10, size)
    with torch.no_grad():
        dense_out, _ = lstm(x)
        layers = csr_layers(lstm)
        torch.testing.assert_close(csr_lstm(layers, x), dense_out, atol=1e-5, rtol=1e-4)
        times: dict[str, list[float]] = {"dense": [], "csr": []}
        for r in range(rounds + 2):
            for name, fn in (("dense", lambda: lstm(x)), ("csr", lambda: csr_lstm(layers, x))):
                start = time.perf_counter()
                fn()
                if r >= 2:
                    times[name].append(time.perf_counter() - start)
    return {f"{name}_ms": 1000 * statistics.median(t) for name, t in times.items()}


def pruned_model_facts(folder: Path, threshold: float, rounds: int) -> dict:
    model = load_model(folder).model.eval()
    set_threshold(model, threshold)
    pruned = prune(model).eval()
    parts = {"embedding": pruned.embedding, "lstm": pruned.rnn, "decoder": pruned.decoder}
    state = pruned.state_dict()
    lstm_state = {name: t for name, t in state.items() if name.startswith("rnn.")}
    return {
        "parameters": {name: dict(zip(("total", "nonzero"), nonzero_parameters(m)))
                       for name, m in parts.items()},
        "variational_parameters_dropped": sum(p.numel() for n, p in model.named_parameters()
                                              if "log_sigma2" in n),
        "file_bytes_dense": saved_size(state),
        "file_bytes_lstm_csr": saved_size(csr_state(state)),
        "lstm_file_bytes_dense": saved_size(lstm_state),
        "lstm_file_bytes_csr": saved_size(csr_state(lstm_state)),
        "lstm_inference": inference_timing(pruned.rnn, pruned.rnn.input_size, rounds),
    }


def gaussian_alphas(folder: Path, png: Path) -> dict:
    """Plot the per-unit alpha of every site of a finished gaussian run; summary numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rnn = load_model(folder).model.rnn
    alphas = {site: a.flatten() for site, a in rnn.alphas().items()}
    fig, axes = plt.subplots(1, len(alphas), figsize=(3.2 * len(alphas), 3), sharey=True)
    for ax, (site, alpha) in zip(axes, alphas.items()):
        values = alpha.sort(descending=True).values
        ax.plot(values.numpy())
        ax.set_yscale("log")
        ax.set_title(site.replace("log_alpha_", ""), fontsize=9)
        ax.set_xlabel("unit (sorted)")
    axes[0].set_ylabel("learned alpha (noise variance)")
    fig.tight_layout()
    with atomic_write(png) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)

    def p_of(alpha: Tensor) -> Tensor:  # the Bernoulli rate of the same variance
        return alpha / (1 + alpha)

    return {site.replace("log_alpha_", ""): {
        "units": a.numel(), "median_alpha": float(a.median()), "min_alpha": float(a.min()),
        "max_alpha": float(a.max()), "median_equivalent_p": float(p_of(a).median()),
        "units_alpha_over_1": int((a > 1).sum()),
    } for site, a in alphas.items()}


def markdown(rows: list[dict], dense: dict) -> str:
    lines = ["| KL weight | threshold (log α) | LSTM nonzero / all | LSTM compression | valid ppl | "
             "Δ valid vs dense | test ppl | Δ test vs dense |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        test_vs_dense = 100 * (row["test_ppl"] / dense["test_ppl"] - 1)
        lines.append(
            f"| {row['kl_weight']:g} | {row['threshold']:g} "
            f"| {row['lstm_nonzero']:,} / {row['lstm_weights']:,} | {row['lstm_compression']:.1f}× "
            f"| {row['valid_ppl']:.1f} | {100 * row['valid_vs_dense']:+.1f}% "
            f"| {row['test_ppl']:.1f} | {test_vs_dense:+.1f}% |")
    return "\n".join(lines)


def _numbers(parser: argparse.ArgumentParser, flag: str, text: str) -> list[float]:
    """The comma-separated finite numbers of ``flag``; else the parser's one-line error (exit 2)."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) for v in values):
        parser.error(f"{flag}: expected comma-separated numbers, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="corpus folder (ptb.train.txt, ...)")
    parser.add_argument("--dense", required=True, help="finished dense run folder (regime tied)")
    parser.add_argument("--config", default="sparse-vd-cpu-200")
    parser.add_argument("--kl-weights", default="1,0.3,0.1")
    parser.add_argument("--freeze", default=None,
                        help="parameter-name prefixes kept fixed (default: the config's)")
    parser.add_argument("--thresholds", default="-2,-1,0,1,2,3")
    parser.add_argument("--budget", type=float, default=0.05, help="allowed perplexity rise (validation)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", default="runs/sparse-vd", help="folder of the fine-tuning runs")
    parser.add_argument("--resume", action="store_true", help="continue or reuse earlier runs")
    parser.add_argument("--only-train", action="store_true", help="train the runs, skip the report")
    parser.add_argument("--gaussian", default="", help="finished run of regime gaussian: plot its alphas")
    parser.add_argument("--rounds", type=int, default=20, help="timing rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/sparse-vd/report", help="folder of the report files")
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1:
        parser.error(f"--threads and --rounds: expected positive integers, got {args.threads} and "
                     f"{args.rounds}")
    warnings.filterwarnings("ignore", message="Sparse (CSR tensor support|invariant checks)")
    kl_weights, thresholds = (_numbers(parser, flag, text) for flag, text in
                              (("--kl-weights", args.kl_weights), ("--thresholds", args.thresholds)))
    try:  # every argument checked before anything trains: one line each, not a traceback
        dense = read_verified_result(Path(args.dense) / "results.json")
        corpus = load_corpus(args.data)
        base = get_config(args.config)
        if args.freeze is not None:
            base = replace(base, freeze=tuple(p for p in args.freeze.split(",") if p))
        for weight in kl_weights:
            replace(base, kl_weight=weight)
    except (ValueError, OSError) as e:
        raise SystemExit(f"sparse_vd.py: error: {e}") from None
    if why := unwritable(args.out, folder=True):  # the last check (it makes the folder): before training
        parser.error(f"--out {args.out!r}: {why}")
    torch.set_num_threads(args.threads)
    runs = {}
    for weight in kl_weights:
        folder = Path(args.runs) / f"kl{weight:g}"
        runs[weight] = train_run(corpus, replace(base, kl_weight=weight), "sparse_vd", folder, seed=args.seed,
                                 resume=args.resume, progress=False, dataset=Path(args.data).name,
                                 init_from=args.dense)
        sys.stderr.write(f"kl weight {weight:g}: test ppl {runs[weight]['test_ppl']:.2f}\n")
    if args.only_train:
        return
    rows = []
    for weight in kl_weights:
        folder = Path(args.runs) / f"kl{weight:g}"
        for row in tradeoff(folder, corpus, base, thresholds, dense["best_valid_ppl"]):
            rows.append({"kl_weight": weight, "best_epoch": runs[weight]["best_epoch"], **row})
    # The headline (KL weight, threshold) is chosen on validation, never on test.
    within = [r for r in rows if r["valid_vs_dense"] <= args.budget]
    head = max(within, key=lambda r: r["lstm_compression"]) if within else min(
        rows, key=lambda r: r["valid_ppl"])
    head_folder = Path(args.runs) / f"kl{head['kl_weight']:g}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "dense_run": str(args.dense), "dense_test_ppl": dense["test_ppl"],
        "dense_valid_ppl": dense["best_valid_ppl"], "sparse_run": str(head_folder),
        "kl_weight": head["kl_weight"], "threshold": head["threshold"],
        "sparse_test_ppl": head["test_ppl"], "sparse_valid_ppl": head["valid_ppl"],
        "lstm_compression": head["lstm_compression"], "within_budget_on_validation": bool(within),
        "goal_met": bool(within) and head["lstm_compression"] >= 10,
        "test_vs_dense": head["test_ppl"] / dense["test_ppl"] - 1,
        "pruned_model": pruned_model_facts(head_folder, head["threshold"], args.rounds),
        "tradeoff": rows, "runs": {f"{w:g}": {k: r[k] for k in ("best_epoch", "epochs_run", "train_seconds",
                                                                  "words_per_second", "init_from")}
                                   for w, r in runs.items()},
        "threads": torch.get_num_threads(), "torch": torch.__version__,
    }
    if args.gaussian:
        report["gaussian_alphas"] = gaussian_alphas(Path(args.gaussian), out / "gaussian-alphas.png")
    write_json_atomic(report, out / "sparse-vd-results.json")
    with atomic_write(out / "tradeoff.md", "w", encoding="utf-8") as f:
        f.write(markdown(rows, dense) + "\n")
    sys.stdout.write(markdown(rows, dense) + "\n\n" + json.dumps(
        {k: v for k, v in report.items() if k not in ("tradeoff",)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
