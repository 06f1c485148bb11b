"""A job's results as Markdown: the run table, the paired comparison, the grid."""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["benchmark_markdown", "comparison_table", "format_dropout", "markdown_table",
           "paired_differences"]


def format_dropout(probabilities: Mapping[str, float]) -> str:
    """``"emb 0.1 · in 0.5 · ..."`` for the sites with p > 0, or ``"—"``."""
    short = {"embedding": "emb", "input": "in", "between": "mid", "hidden": "rec", "output": "out"}
    parts = [f"{short.get(k, k)} {v:g}" for k, v in probabilities.items() if v]
    return " · ".join(parts) if parts else "—"


def _mean_sd(values: Sequence[float], digits: int = 1, *, signed: bool = False) -> str:
    sign = "+" if signed else ""
    if len(values) == 1:
        return f"{values[0]:{sign}.{digits}f}"
    return f"{statistics.mean(values):{sign}.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def markdown_table(results: Sequence[Mapping[str, Any]], *, group: bool = True) -> str:
    """A Markdown table comparing runs.

    With ``group`` runs of the same regime and dropout probabilities (different seeds)
    share a row: perplexities are ``mean ± sd`` over the seeds, which are listed.
    """
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in results:
        key = (r["regime"], json.dumps(r["dropout"], sort_keys=True)) if group else (id(r),)
        groups.setdefault(key, []).append(r)
    lines = [
        "| regime | dropout | seeds | best epoch | valid ppl | test ppl | test ppl, MC | words/s "
        "| wall (min) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for runs in groups.values():
        first = runs[0]
        mc = [r["test_ppl_mc"] for r in runs if r.get("test_ppl_mc") is not None]
        mc_text = f"{_mean_sd(mc)} (S={first['mc_samples']})" if len(mc) == len(runs) else "—"
        lines.append(
            "| {regime} | {dropout} | {seeds} | {epoch} | {valid} | {test} | {mc} | {wps} | {wall} |".format(
                regime=first["regime"],
                dropout=format_dropout(first["dropout"]),
                seeds=", ".join(str(r["seed"]) for r in runs),
                epoch=", ".join(str(r["best_epoch"]) for r in runs),
                valid=_mean_sd([r["best_valid_ppl"] for r in runs]),
                test=_mean_sd([r["test_ppl"] for r in runs]),
                mc=mc_text,
                wps=f"{statistics.mean(r['words_per_second'] for r in runs):,.0f}",
                wall=f"{statistics.mean(r['wall_seconds'] for r in runs) / 60:.1f}",
            )
        )
    return "\n".join(lines) + "\n"


def paired_differences(
    results: Sequence[Mapping[str, Any]], baseline: str, key: str = "test_ppl"
) -> dict[str, list[float]]:
    """Per regime, ``run[key] - baseline_run[key]`` over the seeds both ran.

    Runs of one seed share the initialisation seed and the order of the data, so the
    paired difference removes what the seed does to both and shows what the regime does.
    """
    base = {r["seed"]: r[key] for r in results if r["regime"] == baseline and r.get(key) is not None}
    out: dict[str, list[float]] = {}
    for r in results:
        if r["regime"] != baseline and r["seed"] in base and r.get(key) is not None:
            out.setdefault(r["regime"], []).append(r[key] - base[r["seed"]])
    return out


def comparison_table(results: Sequence[Mapping[str, Any]], baseline: str = "naive") -> str:
    """One row per regime: test perplexity and its paired difference to ``baseline``
    (standard and Monte-Carlo), next-word calibration (ECE, NLL per token), and each
    seed's best epoch out of the epochs it ran ("cap" marks a run stopped by the epoch
    cap while validation was still improving: not converged). Values are mean ± sd."""
    by_regime: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        by_regime.setdefault(r["regime"], []).append(r)
    diff = paired_differences(results, baseline)
    diff_mc = paired_differences(results, baseline, "test_ppl_mc")
    lines = [
        f"| regime | best epoch / run | test ppl | Δ vs {baseline} | test ppl, MC | Δ MC vs {baseline} "
        "| ECE % | ECE %, MC | NLL | NLL, MC |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for regime, runs in by_regime.items():
        runs = sorted(runs, key=lambda r: r["seed"])

        def column(key: str, scale: float = 1.0, digits: int = 1, runs=runs) -> str:
            values = [r[key] * scale for r in runs if r.get(key) is not None]
            return _mean_sd(values, digits) if values and len(values) == len(runs) else "—"

        def delta(diffs: dict[str, list[float]], regime: str = regime) -> str:
            if regime == baseline:
                return "0"
            return _mean_sd(diffs[regime], signed=True) if regime in diffs else "—"

        epochs = ", ".join(
            f"{r['best_epoch']}/{r.get('epochs_run', len(r['epochs']))}"
            + ("" if r.get("converged", True) else " cap")
            for r in runs
        )
        lines.append(
            f"| {regime} | {epochs} | {column('test_ppl')} | {delta(diff)} | {column('test_ppl_mc')} | "
            f"{delta(diff_mc)} | {column('test_ece', 100, 2)} | {column('test_ece_mc', 100, 2)} | "
            f"{column('test_nll', 1, 3)} | {column('test_nll_mc', 1, 3)} |"
        )
    return "\n".join(lines) + "\n"

def benchmark_markdown(
    dataset: str,
    config_name: str,
    final_results: Sequence[Mapping[str, Any]],
    grid_results: Sequence[Mapping[str, Any]] = (),
    *,
    command: str = "",
    grid_seed: int | None = None,
) -> str:
    """The benchmark's report: command, corpus, the comparison table and the grid."""
    lines = [f"# {dataset} language-model benchmark, config `{config_name}`", ""]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    corpus_info = final_results[0].get("corpus", {}) if final_results else {}
    lines += [
        f"Corpus: `{corpus_info.get('source', '?')}` "
        f"({corpus_info.get('train_tokens', '?')} / {corpus_info.get('valid_tokens', '?')} / "
        f"{corpus_info.get('test_tokens', '?')} train / valid / test tokens with `<eos>`, "
        f"vocabulary {corpus_info.get('vocab_size', '?')}).",
        "",
        "Perplexities are mean ± sd over seeds; test perplexity uses the parameters of the "
        "best validation epoch; MC = Monte-Carlo dropout with S samples.",
        "",
        markdown_table(final_results),
    ]
    regimes = {r["regime"] for r in final_results}
    if len(regimes) > 1:
        baseline = "naive" if "naive" in regimes else final_results[0]["regime"]
        lines += [
            f"Paired against `{baseline}` (same seed: same initialisation seed and data order), "
            "next-word calibration on the test split (ECE with 15 bins, NLL in nats per token), "
            "and convergence (best epoch / epochs run; `cap`: stopped by the epoch cap while "
            "validation was still improving):",
            "",
            comparison_table(final_results, baseline),
        ]
    if grid_results:
        lines += [
            f"Grid (seed {grid_seed}); the dropout of each regime was chosen by validation "
            "perplexity only:",
            "",
            "| regime | dropout | best epoch | valid ppl | chosen |",
            "|---|---|---|---|---|",
        ]
        chosen = {f["regime"]: f["dropout"] for f in final_results}
        for r in sorted(grid_results, key=lambda r: (r["regime"], r["best_valid_ppl"])):
            mark = "✓" if r["dropout"] == chosen.get(r["regime"]) else ""
            lines.append(f"| {r['regime']} | {format_dropout(r['dropout'])} | {r['best_epoch']} | "
                         f"{r['best_valid_ppl']:.1f} | {mark} |")
        lines.append("")
    return "\n".join(lines)
