"""The language-model benchmark: train regimes, choose dropout on validation, report.

``python benchmarks/ptb.py --data DIR --config mini`` trains each regime once with
the config's dropout probabilities; ``--grid`` first searches each regime's small
grid (``TrainConfig.grid``) with the first seed, keeps the candidate with the best
*validation* perplexity, trains it again with the other ``--seeds``, and adds the
Monte-Carlo test perplexity of the chosen runs. The test split plays no part in any
choice.

Outputs in ``--out`` (default ``runs/<dataset>-<config>``): one folder per run
(checkpoint, best model, results.json, curve.png), ``results.md`` (tables),
``summary.json`` and ``learning_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import shlex
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rnndrop.lm.atomic import atomic_write
from rnndrop.lm.configs import (
    CONFIGS,
    REGIMES,
    SITES,
    TrainConfig,
    get_config,
    get_regime,
    regime_probabilities,
)
from rnndrop.lm.corpus import CorpusError, load_corpus
from rnndrop.lm.download import DATASETS, DownloadError, download_corpus
from rnndrop.lm.identity import finished_result, run_identity
from rnndrop.lm.results import (
    format_dropout,
    markdown_table,
    plot_learning_curves,
    write_json_atomic,
)
from rnndrop.lm.train import TrainingDiverged, add_mc_result, train_run

__all__ = ["RunSpec", "build_parser", "chosen_dropout", "main", "run_benchmark"]

log = logging.getLogger(__name__)

_SHORT = {"embedding": "emb", "input": "in", "between": "mid", "hidden": "rec", "output": "out"}


@dataclass(frozen=True)
class RunSpec:
    """One run of the benchmark (picklable, for worker processes)."""

    data_dir: str
    dataset: str
    config: TrainConfig
    regime: str
    dropout: Mapping[str, float]
    seed: int
    folder: str
    mc_samples: int
    resume: bool
    device: str
    threads: int | None
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def run_tag(probabilities: Mapping[str, float]) -> str:
    """A folder name for dropout probabilities, e.g. ``in0.5-mid0.5-out0.5``."""
    parts = [f"{_SHORT[s]}{probabilities[s]:g}" for s in SITES if probabilities.get(s)]
    return "-".join(parts) or "p0"


def parse_dropout(text: str) -> dict[str, float]:
    """``"input=0.5,hidden=0.2"`` -> ``{"input": 0.5, "hidden": 0.2}``."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        site, sep, value = item.partition("=")
        if not sep or site not in SITES:
            raise ValueError(
                f"--dropout takes site=p pairs with sites among {', '.join(SITES)}, got {item!r}"
            )
        out[site] = float(value)
    return out


def chosen_dropout(summary_path: str | Path) -> dict[str, dict[str, float]]:
    """The dropout each regime's grid chose, from a grid run's ``summary.json``."""
    path = Path(summary_path)
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        if not summary.get("grid"):
            raise ValueError("it is not the summary of a --grid run")
        return {run["regime"]: dict(run["dropout"]) for run in summary["runs"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--dropout-from {str(path)!r}: cannot read the grid's choices ({e})") from None


def _finished(spec: RunSpec) -> dict[str, Any] | None:
    if not (Path(spec.folder) / "results.json").is_file():
        return None  # nothing to reuse: skip reading the corpus
    identity = run_identity(load_corpus(spec.data_dir), spec.config, spec.regime, spec.dropout, spec.seed)
    return finished_result(spec.folder, identity, epochs=spec.config.epochs)


def _execute(spec: RunSpec) -> dict[str, Any]:
    """Run (or reuse, or resume) one spec; top-level so worker processes can call it."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if spec.resume:
        done = _finished(spec)
        if done is not None:
            log.info("%s: finished earlier, reusing its results", spec.folder)
            return done
    corpus = load_corpus(spec.data_dir)
    return train_run(
        corpus, spec.config, spec.regime, spec.folder, dropout=spec.dropout, seed=spec.seed,
        resume=spec.resume, device=spec.device, mc_samples=spec.mc_samples,
        progress=spec.progress, dataset=spec.dataset,
    )


def _execute_mc(spec: RunSpec) -> dict[str, Any]:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    done = _finished(spec)
    if done is not None and (done.get("test_ppl_mc") is not None or spec.mc_samples == 0):
        return done
    corpus = load_corpus(spec.data_dir)
    return add_mc_result(corpus, spec.config, spec.folder, spec.mc_samples, spec.device)


def _run_all(specs: Sequence[RunSpec], jobs: int, fn=_execute) -> list[dict[str, Any]]:
    if jobs <= 1 or len(specs) <= 1:
        return [fn(s) for s in specs]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=context) as pool:
        return list(pool.map(fn, specs))


def run_benchmark(
    corpus_dir: str | Path,
    dataset: str,
    config: TrainConfig,
    regimes: Sequence[str],
    seeds: Sequence[int],
    out_dir: str | Path,
    *,
    grid: bool = False,
    dropout: Mapping[str, float] | None = None,
    dropout_by_regime: Mapping[str, Mapping[str, float]] | None = None,
    mc_samples: int | None = None,
    resume: bool = False,
    jobs: int = 1,
    threads: int | None = None,
    device: str = "auto",
    progress: bool = True,
    command: str = "",
) -> dict[str, Any]:
    """Run the benchmark and write its summary files; returns the summary.

    Args:
        grid: search ``config.grid[regime]`` (default: ``config.dropout`` alone) with
            ``seeds[0]``, choose on validation perplexity, then run the choice with
            the other seeds and add the Monte-Carlo test perplexity.
        dropout: without ``grid``: the probabilities of every regime (default
            ``config.dropout``).
        dropout_by_regime: without ``grid``: the probabilities of each regime, e.g. the
            ones a grid on another corpus chose (:func:`chosen_dropout`); overrides
            ``dropout`` for the regimes it names.
    """
    for r in regimes:
        get_regime(r)
    if not seeds:
        raise ValueError("seeds must name at least one seed, got none")
    out = Path(out_dir)
    mc = config.mc_samples if mc_samples is None else mc_samples

    def spec(regime: str, probabilities: Mapping[str, float], seed: int, mc_n: int) -> RunSpec:
        p = regime_probabilities(get_regime(regime), probabilities)
        folder = out / regime / f"{run_tag(p)}-seed{seed}"
        return RunSpec(str(corpus_dir), dataset, config, regime, p, seed, str(folder), mc_n,
                       resume, device, threads, progress)

    grid_results: list[dict[str, Any]] = []
    if grid:
        candidates = [
            spec(r, p, seeds[0], 0)
            for r in regimes
            for p in config.grid.get(r, (config.dropout,))
        ]
        # One candidate per distinct effective setting (e.g. "none" ignores probabilities).
        candidates = list({c.folder: c for c in candidates}.values())
        grid_results = _run_all(candidates, jobs)
        chosen: dict[str, dict[str, Any]] = {}
        for r in grid_results:
            best = chosen.get(r["regime"])
            if best is None or r["best_valid_ppl"] < best["best_valid_ppl"]:
                chosen[r["regime"]] = r
        more = [spec(r, chosen[r]["dropout"], s, 0) for r in regimes for s in seeds[1:]]
        _run_all(more, jobs)
        finals = [spec(r, chosen[r]["dropout"], s, mc) for r in regimes for s in seeds]
        final_results = _run_all(finals, jobs, _execute_mc)
    else:
        default = config.dropout if dropout is None else dropout
        by_regime = dict(dropout_by_regime or {})
        finals = [spec(r, by_regime.get(r, default), s, mc) for r in regimes for s in seeds]
        final_results = _run_all(finals, jobs)

    table = markdown_table(final_results)
    lines = [f"# {dataset} language-model benchmark, config `{config.name}`", ""]
    if command:
        lines += ["Command:", "", "```bash", command, "```", ""]
    corpus_info = final_results[0].get("corpus", {})
    lines += [
        f"Corpus: `{corpus_info.get('source', corpus_dir)}` "
        f"({corpus_info.get('train_tokens', '?')} / {corpus_info.get('valid_tokens', '?')} / "
        f"{corpus_info.get('test_tokens', '?')} train / valid / test tokens with `<eos>`, "
        f"vocabulary {corpus_info.get('vocab_size', '?')}).",
        "",
        "Perplexities are mean ± sd over seeds; test perplexity uses the parameters of the "
        "best validation epoch; MC = Monte-Carlo dropout with S samples.",
        "",
        table,
    ]
    if grid_results:
        lines += [
            f"Grid (seed {seeds[0]}); the dropout of each regime was chosen by validation "
            "perplexity only:",
            "",
            "| regime | dropout | best epoch | valid ppl | chosen |",
            "|---|---|---|---|---|",
        ]
        chosen_dropout = {f["regime"]: f["dropout"] for f in final_results}
        for r in sorted(grid_results, key=lambda r: (r["regime"], r["best_valid_ppl"])):
            mark = "✓" if r["dropout"] == chosen_dropout[r["regime"]] else ""
            lines.append(f"| {r['regime']} | {format_dropout(r['dropout'])} | {r['best_epoch']} | "
                         f"{r['best_valid_ppl']:.1f} | {mark} |")
        lines.append("")
    markdown = "\n".join(lines)
    with atomic_write(out / "results.md", "w", encoding="utf-8") as f:
        f.write(markdown)
    first_seed = [r for r in final_results if r["seed"] == seeds[0]]
    plot = plot_learning_curves(first_seed, out / "learning_curves.png")
    summary = {
        "dataset": dataset, "config": config.name, "regimes": list(regimes), "seeds": list(seeds),
        "grid": grid, "command": command,
        "runs": [{"regime": r["regime"], "dropout": r["dropout"], "seed": r["seed"],
                  "best_valid_ppl": r["best_valid_ppl"], "test_ppl": r["test_ppl"],
                  "test_ppl_mc": r["test_ppl_mc"], "words_per_second": r["words_per_second"]}
                 for r in final_results],
        "grid_runs": [{"regime": r["regime"], "dropout": r["dropout"], "seed": r["seed"],
                       "best_valid_ppl": r["best_valid_ppl"]} for r in grid_results],
        "markdown": markdown,
        "files": ["results.md", "summary.json"] + ([plot.name] if plot is not None else []),
    }
    write_json_atomic(summary, out / "summary.json")
    return summary


def build_parser(dataset: str) -> argparse.ArgumentParser:
    remote = DATASETS[dataset]
    parser = argparse.ArgumentParser(
        description=f"Train and compare LSTM language models on {dataset} with different "
        "dropout regimes (none, naive, tied variational, ...).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--data", help=f"folder with the corpus ({', '.join(remote.files().values())}); "
                        "default: download once into the cache")
    parser.add_argument("--cache-dir", help="download cache (default $RNNDROP_CACHE or ~/.cache/rnndrop)")
    parser.add_argument("--mirror", help="URL of a folder serving the official archive "
                        f"{remote.archive} (default $RNNDROP_DATA_MIRROR or {remote.base_url})")
    parser.add_argument("--source", choices=("auto", "url", "hub"), default="auto",
                        help="where to download from: the official archive, the Hugging Face hub, or both")
    parser.add_argument("--config", default="mini", choices=sorted(CONFIGS))
    parser.add_argument("--regimes", default="none,naive,tied",
                        help=f"comma-separated, among {', '.join(REGIMES)}")
    parser.add_argument("--grid", action="store_true",
                        help="search each regime's dropout grid on validation with the first seed")
    parser.add_argument("--seeds", default="1", help="comma-separated seeds")
    parser.add_argument("--dropout", default=None,
                        help="override the config's dropout, e.g. input=0.5,hidden=0.2 (not with --grid)")
    parser.add_argument("--dropout-from", default=None, metavar="SUMMARY",
                        help="take each regime's dropout from the summary.json of a --grid run "
                        "(e.g. a grid on a smaller corpus)")
    parser.add_argument("--epochs", type=int, default=None, help="override the config's epochs")
    parser.add_argument("--tie-weights", action="store_true", help="tie embedding and decoder weights")
    parser.add_argument("--mc-samples", type=int, default=None,
                        help="Monte-Carlo dropout samples for the test perplexity (0: skip)")
    parser.add_argument("--out", default=None, help="output folder (default runs/<dataset>-<config>)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse finished runs and continue interrupted ones in --out")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once (processes)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run (default: 1 with --jobs > 1, else torch's)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None, *, dataset: str = "ptb") -> str:
    """Command-line entry point; returns the Markdown summary. Exits with status 2 on
    a data problem and 3 when training diverged, with the reason on stderr."""
    parser = build_parser(dataset)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = get_config(args.config)
        changes: dict[str, Any] = {}
        if args.epochs is not None:
            changes["epochs"] = args.epochs
        if args.tie_weights:
            changes["tie_weights"] = True
        config = replace(config, **changes) if changes else config
        regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
        for r in regimes:
            get_regime(r)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        if args.grid and args.dropout:
            raise ValueError("--dropout cannot be combined with --grid (the grid sets the dropout)")
        dropout = parse_dropout(args.dropout) if args.dropout else None
        if args.dropout_from and (args.grid or args.dropout):
            raise ValueError("--dropout-from cannot be combined with --grid or --dropout")
        by_regime = chosen_dropout(args.dropout_from) if args.dropout_from else None
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    except ValueError as e:
        parser.error(str(e))
    threads = args.threads if args.threads is not None else (1 if args.jobs > 1 else None)
    try:
        if args.data:
            data_dir = Path(args.data)
        else:
            data_dir = download_corpus(dataset, args.cache_dir, base_url=args.mirror, source=args.source)
        load_corpus(data_dir)  # fail early, with the corpus' own message
    except (CorpusError, DownloadError) as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
    out = Path(args.out) if args.out else Path("runs") / f"{dataset}-{config.name}"
    given = list(argv) if argv is not None else sys.argv[1:]
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *given])
    try:
        summary = run_benchmark(
            data_dir, dataset, config, regimes, seeds, out, grid=args.grid, dropout=dropout,
            dropout_by_regime=by_regime,
            mc_samples=args.mc_samples, resume=args.resume, jobs=args.jobs, threads=threads,
            device=args.device, progress=not args.no_progress, command=command,
        )
    except TrainingDiverged as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(3) from None
    except FileExistsError as e:
        sys.stderr.write(f"error: {e}\n")
        raise SystemExit(2) from None
    return summary["markdown"] + f"\nWritten to {out}/ ({', '.join(summary['files'])})\n"

