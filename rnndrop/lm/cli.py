"""``rnndrop-lm``: train, compare, evaluate and sample word-level language models.

::

    rnndrop-lm ptb --data sample                 # the bundled PTB sample, no internet needed
    rnndrop-lm ptb --config gal-medium --regimes tied --device cuda   # full PTB, downloaded once
    rnndrop-lm wikitext2 --data sample --regimes none,tied
    rnndrop-lm evaluate runs/ptb-sample-mini/tied/<run>      # perplexity, MC perplexity, ECE
    rnndrop-lm generate runs/ptb-sample-mini/tied/<run> --words 50

``python -m rnndrop.lm`` is the same command. Exit status: 0 done, 2 a data or usage
problem, 3 training diverged, 130 interrupted (Ctrl-C); the reason is one line on
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rnndrop.lm.run.folder import LEARNING_CURVES, RESULTS

__all__ = ["EXIT_DATA", "EXIT_DIVERGED", "EXIT_INTERRUPTED", "build_parser", "main", "train_main"]

log = logging.getLogger(__name__)

EXIT_DATA = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130

#: Corpus names on the command line -> names in :mod:`rnndrop.lm.data.download`.
CORPORA = {"ptb": "ptb", "wikitext2": "wikitext-2", "wikitext-2": "wikitext-2"}

def _prefixes(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


#: Flags that override a field of the config: flag -> (TrainConfig field, type, help).
CONFIG_FLAGS: dict[str, tuple[str, type, str]] = {
    "--epochs": ("epochs", int, "number of epochs (the cap when the config stops at min_lr)"),
    "--lr": ("lr", float, "initial learning rate"),
    "--optimizer": ("optimizer", str, "sgd or adam"),
    "--model": ("cell", str, "recurrent cell: lstm or gru"),
    "--emb-size": ("embedding_size", int, "word embedding size"),
    "--hidden-size": ("hidden_size", int, "units per recurrent layer"),
    "--layers": ("num_layers", int, "recurrent layers"),
    "--batch-size": ("batch_size", int, "training batch size"),
    "--bptt": ("bptt", int, "truncated-BPTT length"),
    "--clip": ("clip", float, "gradient-norm clipping threshold"),
    "--kl-weight": ("kl_weight", float, "factor on the KL term of variational regimes (1: the ELBO)"),
    "--freeze": ("freeze", _prefixes, "comma-separated parameter-name prefixes kept fixed, e.g. "
                 "embedding.,decoder."),
}


class UsageError(Exception):
    """A problem with the command line or the data, reported in one line (exit 2)."""


def _fail(message: str, code: int) -> SystemExit:
    if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 alone reports
        sys.stderr.write("error: " + " ".join(str(message).split()) + "\n")
    return SystemExit(code)


def _add_train_arguments(parser: argparse.ArgumentParser, dataset: str) -> None:
    from rnndrop.lm.data.download import DATASETS
    from rnndrop.lm.model.configs import CONFIGS
    from rnndrop.lm.model.regimes import REGIMES

    remote = DATASETS[dataset]
    data = parser.add_argument_group("data")
    data.add_argument("--data", metavar="sample|DIR",
                      help="'sample': the small real sample shipped with rnndrop (no internet needed); "
                      f"DIR: a folder with the corpus ({', '.join(remote.files().values())}); default: "
                      "the cache, downloading the full corpus once")
    data.add_argument("--cache-dir", help="download cache (default $RNNDROP_CACHE or ~/.cache/rnndrop)")
    data.add_argument("--mirror", help="URL of a folder serving the official archive "
                      f"{remote.archive} (default $RNNDROP_DATA_MIRROR or {remote.base_url})")
    data.add_argument("--source", choices=("auto", "url", "hub"), default="auto",
                      help="where to download from: the official archive, the Hugging Face hub, or both")
    job = parser.add_argument_group("job")
    job.add_argument("--config", default="mini", choices=sorted(CONFIGS),
                     help="model size and optimisation preset; the flags below override single fields")
    job.add_argument("--regimes", default="none,naive,tied",
                     help=f"comma-separated, among {', '.join(REGIMES)}")
    job.add_argument("--grid", action="store_true",
                     help="search each regime's dropout grid on validation with the first seed")
    job.add_argument("--seeds", default="1", help="comma-separated seeds")
    job.add_argument("--dropout", default=None,
                     help="override the config's dropout, e.g. input=0.5,hidden=0.2 (not with --grid)")
    job.add_argument("--init-from", default=None, metavar="RUN",
                     help="start every run from the weights of a finished run (its folder or best.pt), "
                     "e.g. --regimes sparse_vd --config sparse-vd-cpu-200 fine-tuning a dense tied run")
    job.add_argument("--dropout-from", default=None, metavar="SUMMARY",
                     help="take each regime's dropout from the summary.json of a --grid run")
    job.add_argument("--mc-samples", type=int, default=None,
                     help="Monte-Carlo dropout samples for the test perplexity (0: skip; default: "
                     "the config's)")
    job.add_argument("--out", default=None,
                     help="output folder (default runs/<corpus>-<config>, runs/<corpus>-sample-<config> "
                     "with --data sample)")
    job.add_argument("--resume", action="store_true",
                     help="continue the interrupted runs in --out and reuse its finished ones (rerun the "
                     "same command with --resume after Ctrl-C)")
    model = parser.add_argument_group("model and optimisation (default: the config's)")
    for flag, (_, kind, text) in CONFIG_FLAGS.items():
        if flag == "--optimizer":
            model.add_argument(flag, choices=("sgd", "adam"), default=None, help=text)
        elif flag == "--model":
            model.add_argument(flag, choices=("lstm", "gru"), default=None, help=text)
        else:
            model.add_argument(flag, type=kind, default=None, help=text)
    model.add_argument("--tie-weights", action="store_true", help="tie embedding and decoder weights")
    machine = parser.add_argument_group("machine")
    machine.add_argument("--jobs", type=int, default=1, help="runs trained at once (processes)")
    machine.add_argument("--threads", type=int, default=1,
                         help="torch threads per run: 1 is fastest for the small configs on a shared "
                         "CPU; give more to big models on a machine of their own")
    machine.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    machine.add_argument("--no-progress", action="store_true",
                         help="no progress bars (log lines only)")


def _corpus_parser(dataset: str, prog: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"Train and compare word-level language models on {dataset} with different "
        "dropout regimes (none, naive, tied variational, ...), then print the comparison table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kwargs,
    )
    _add_train_arguments(parser, dataset)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``rnndrop-lm`` (corpus or command first)."""
    parser = argparse.ArgumentParser(
        prog="rnndrop-lm",
        description="Word-level language models with recurrent dropout: train and compare "
        "regimes on a corpus, then evaluate or sample a trained run.",
        epilog="Start with: rnndrop-lm ptb --data sample   (the bundled sample, about 10 minutes on "
        "2 CPU cores; after Ctrl-C run the same command with --resume). "
        "Exit status: 0 done, 2 data or usage problem, 3 training diverged, 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{ptb,wikitext2,evaluate,generate}", required=True)
    for name in ("ptb", "wikitext2"):
        p = sub.add_parser(name, help=f"train and compare regimes on {CORPORA[name]} "
                           "(--data sample|DIR, --resume, ...)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           description=f"Train and compare word-level language models on "
                           f"{CORPORA[name]} with different dropout regimes, then print the "
                           "comparison table and the path of the learning curves.")
        _add_train_arguments(p, CORPORA[name])
    evaluate = sub.add_parser("evaluate", help="score a trained run on a corpus split: perplexity, "
                              "Monte-Carlo perplexity, calibration (ECE)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    evaluate.add_argument("run", help="a run folder (holding best.pt) or a best.pt file")
    evaluate.add_argument("--data", metavar="sample|DIR", default=None,
                          help="corpus to score (default: the one the run was trained on)")
    evaluate.add_argument("--split", choices=("train", "valid", "test"), default="test")
    evaluate.add_argument("--mc-samples", type=int, default=0,
                          help="Monte-Carlo dropout samples (0: weight-scaling only)")
    evaluate.add_argument("--seed", type=int, default=1, help="seed of the Monte-Carlo masks")
    evaluate.add_argument("--device", default="auto")
    evaluate.add_argument("--threads", type=int, default=1, help="torch threads")
    generate = sub.add_parser("generate", help="sample text from a trained run",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    generate.add_argument("run", help="a run folder (holding best.pt) or a best.pt file")
    generate.add_argument("--words", type=int, default=50, help="words to generate")
    generate.add_argument("--prompt", default="", help="words to start from (unknown ones become <unk>)")
    generate.add_argument("--temperature", type=float, default=1.0,
                          help="softmax temperature (lower: more likely words)")
    generate.add_argument("--seed", type=int, default=1)
    generate.add_argument("--device", default="auto")
    generate.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser


def _positive(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"{name} must be >= {minimum}, got {value}")


def _config_from_args(args: argparse.Namespace):
    from rnndrop.lm.model.configs import get_config

    config = get_config(args.config)
    changes: dict[str, Any] = {}
    flags: list[str] = []
    for flag, (field_name, _, _) in CONFIG_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            if field_name not in config.__dataclass_fields__:
                raise UsageError(f"{flag} is not supported by this version's TrainConfig")
            changes[field_name] = value
            flags.append(f"{flag} {value}")
    if args.tie_weights:
        changes["tie_weights"] = True
        flags.append("--tie-weights")
    try:
        return replace(config, **changes) if changes else config
    except (TypeError, ValueError) as e:
        raise UsageError(f"{e} (config {config.name!r} with {', '.join(flags)})") from None


def _resolve_data(data: str | None, dataset: str, args: argparse.Namespace) -> Path:
    from rnndrop.lm.data.corpus import sample_dir
    from rnndrop.lm.data.download import download_corpus

    if data == "sample":
        return sample_dir(dataset)
    if data:
        return Path(data)
    return download_corpus(dataset, args.cache_dir, base_url=args.mirror, source=args.source)


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise UsageError(f"--out {str(out)!r} is not a writable folder: {e.strerror or e}") from None


def train_main(argv: Sequence[str] | None, dataset: str) -> str:
    """``rnndrop-lm <corpus> ARGS``; returns the report (the table and where the files are).

    Raises SystemExit with status 2 (data or usage), 3 (diverged) or 130 (interrupted)
    after one line on stderr.
    """
    parser = _corpus_parser(dataset, prog=f"rnndrop-lm {dataset.replace('-', '')}")
    args = parser.parse_args(argv)
    return _train(args, dataset, list(sys.argv[1:] if argv is None else argv))


def _train(args: argparse.Namespace, dataset: str, given: list[str]) -> str:
    from rnndrop.lm.data.corpus import CorpusError
    from rnndrop.lm.data.download import DownloadError
    from rnndrop.lm.run.benchmark import JobInterrupted, run_benchmark
    from rnndrop.lm.run.lock import RunLocked
    from rnndrop.lm.run.process_group import RankFailed, init_from_env, run_on_main, torchrun_world_size
    from rnndrop.lm.run.train import TrainingDiverged

    try:  # under torchrun: join the process group (each rank checks the same arguments)
        if torchrun_world_size() > 1 and args.jobs != 1:
            raise UsageError(f"--jobs must be 1 under torchrun (its processes train each run "
                             f"together), got {args.jobs}")
        ctx, device = init_from_env(args.device)
    except (UsageError, ValueError, RuntimeError) as e:
        raise _fail(str(e), EXIT_DATA) from None
    logging.basicConfig(level=logging.INFO if ctx.is_main else logging.WARNING,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        # Rank 0 checks the data and the output folder (and downloads); the others get its answer.
        config, regimes, seeds, dropout, by_regime, data_dir, out = run_on_main(
            lambda: _checked_job(args, dataset), ctx, "checking the command line and the data")
    except RankFailed:
        raise _fail("", EXIT_DATA) from None
    except (UsageError, ValueError, CorpusError, DownloadError) as e:
        raise _fail(str(e), EXIT_DATA) from None
    threads = args.threads
    command = "rnndrop-lm " + " ".join(shlex.quote(a) for a in [dataset.replace("-", ""), *given])
    bars = not args.no_progress and args.jobs <= 1 and ctx.is_main
    try:
        with _logging_beside_bars(bars):
            summary = run_benchmark(
                data_dir, dataset, config, regimes, seeds, out, grid=args.grid, dropout=dropout,
                dropout_by_regime=by_regime, mc_samples=args.mc_samples, resume=args.resume,
                jobs=args.jobs, threads=threads, device=str(device) if ctx.enabled else args.device,
                progress=not args.no_progress and ctx.is_main, command=command,
                # the estimate times one process: no guide to N of them
                estimate=not ctx.enabled, init_from=args.init_from,
            )
    except JobInterrupted as e:
        where = f"in epoch {e.epoch} of {e.label or e.folder}" if e.epoch is not None else "during training"
        raise _fail(f"interrupted {where}; every finished epoch is saved: run the same command "
                    "with --resume to continue", EXIT_INTERRUPTED) from None
    except KeyboardInterrupt:
        raise _fail("interrupted; every finished epoch is saved: run the same command with --resume "
                    "to continue", EXIT_INTERRUPTED) from None
    except TrainingDiverged as e:
        raise _fail(str(e), EXIT_DIVERGED) from None
    except (RunLocked, OSError, CorpusError, ValueError, RankFailed) as e:
        # another process holds a run folder, a file cannot be written, a damaged or
        # foreign checkpoint or result: the message names the file and what to do
        raise _fail(str(e), EXIT_DATA) from None
    if not ctx.is_main:
        return ""
    report = summary["markdown"].rstrip() + "\n\n"
    report += f"Written to {out}/: {', '.join(summary['files'])} and one folder per run.\n"
    if LEARNING_CURVES in summary["files"]:
        report += f"Learning curves: {out / 'learning_curves.png'}\n"
    return report


def _checked_job(args: argparse.Namespace, dataset: str) -> tuple[Any, ...]:
    """The job the arguments describe, checked: (config, regimes, seeds, dropout,
    dropout by regime, data folder, output folder). Raises UsageError and the data's errors."""
    from rnndrop.lm.data.corpus import load_corpus
    from rnndrop.lm.model.regimes import get_regime
    from rnndrop.lm.run.benchmark import chosen_dropout, parse_dropout
    from rnndrop.lm.run.identity import best_file

    config = _config_from_args(args)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if not regimes:
        raise UsageError(f"--regimes must name at least one regime, got {args.regimes!r}")
    for r in regimes:
        get_regime(r)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds takes comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise UsageError(f"--seeds must name at least one seed, got {args.seeds!r}")
    if args.grid and args.dropout:
        raise UsageError("--dropout cannot be combined with --grid (the grid sets the dropout)")
    dropout = parse_dropout(args.dropout) if args.dropout else None
    if args.dropout_from and (args.grid or args.dropout):
        raise UsageError("--dropout-from cannot be combined with --grid or --dropout")
    by_regime = chosen_dropout(args.dropout_from) if args.dropout_from else None
    if args.init_from is not None and not best_file(args.init_from).is_file():
        raise UsageError(f"--init-from: expected a finished run's folder (holding best.pt) or a best.pt "
                         f"file, got {args.init_from!r}, where there is none")
    _positive("--jobs", args.jobs)
    _positive("--threads", args.threads)
    _positive("--mc-samples", args.mc_samples, 0)
    data_dir = _resolve_data(args.data, dataset, args)
    load_corpus(data_dir)  # fail early, with the corpus' own message
    sample = "-sample" if args.data == "sample" else ""
    out = Path(args.out) if args.out else Path("runs") / f"{dataset}{sample}-{config.name}"
    _check_writable(out)
    if not args.resume:
        held = sorted(out.glob("*/*/checkpoint.pt"))
        if held:
            raise UsageError(
                f"{str(out)!r} already holds runs of a job (e.g. {str(held[0].parent)!r}); add --resume "
                "to continue them (finished runs are reused), or pass another --out"
            )
    return config, regimes, seeds, dropout, by_regime, data_dir, out


def _load_run(path: str, device: str):
    from rnndrop.lm.run.checkpoint import CheckpointError, load_model
    from rnndrop.lm.run.train import resolve_device

    try:
        return load_model(path, resolve_device(device))
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        raise _fail(f"cannot load the model of {path!r}: {e}", EXIT_DATA) from None


def _run_result(best: Path) -> dict[str, Any]:
    """The run's results.json beside best.pt (for its corpus), or {} if absent or unreadable."""
    import json

    try:
        with open(best.parent / RESULTS, encoding="utf-8") as f:
            result = json.load(f)
        return result if isinstance(result, dict) else {}
    except (OSError, ValueError):
        return {}


def _evaluate(args: argparse.Namespace) -> str:
    """``rnndrop-lm evaluate RUN``: perplexity, MC perplexity and ECE on a split."""
    import torch

    from rnndrop.lm.data.corpus import CorpusError, batchify, encode_split, sample_dir
    from rnndrop.lm.run.evaluate import CALIBRATION_BINS, score, score_mc

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        _positive("--mc-samples", args.mc_samples, 0)
        _positive("--threads", args.threads)
    except UsageError as e:
        raise _fail(str(e), EXIT_DATA) from None
    torch.set_num_threads(args.threads)
    run = _load_run(args.run, args.device)
    result = _run_result(run.path)
    dataset = result.get("dataset") or "ptb"
    try:
        if args.data == "sample":
            data_dir = sample_dir(dataset if dataset in CORPORA.values() else "ptb")
        elif args.data:
            data_dir = Path(args.data)
        else:
            source = result.get("corpus", {}).get("source")
            if not source:
                raise UsageError(f"{str(run.path.parent)!r} does not say which corpus it was trained "
                                 "on: pass --data sample or --data DIR")
            data_dir = Path(source)
        ids = encode_split(data_dir, args.split, run.vocab)
        device = next(run.model.parameters()).device
        batched = batchify(ids, run.config.eval_batch_size).to(device)
    except (UsageError, CorpusError, ValueError) as e:
        raise _fail(str(e), EXIT_DATA) from None
    standard = score(run.model, batched, run.config.bptt, CALIBRATION_BINS)
    lines = [
        f"{run.path}: {run.regime}, epoch {run.epoch}; {args.split} split of {data_dir} "
        f"({standard.tokens:,} predicted words)",
        f"perplexity      {standard.perplexity:.2f}   (NLL {standard.nll:.4f} nats/word, "
        f"ECE {standard.ece:.4f})",
    ]
    own_corpus = Path(str(result.get("corpus", {}).get("source", ""))) == Path(data_dir)
    if args.split == "test" and own_corpus and isinstance(result.get("test_ppl"), (int, float)):
        lines.append(f"                (the run reported {result['test_ppl']:.2f} at the end of training)")
    if args.mc_samples:
        torch.manual_seed(args.seed)
        mc = score_mc(run.model, batched, run.config.bptt, args.mc_samples, CALIBRATION_BINS)
        lines.append(f"perplexity, MC  {mc.perplexity:.2f}   (NLL {mc.nll:.4f} nats/word, "
                     f"ECE {mc.ece:.4f}; {args.mc_samples} dropout samples)")
    return "\n".join(lines) + "\n"


def _generate(args: argparse.Namespace) -> str:
    """``rnndrop-lm generate RUN``: sample words from the trained model."""
    import torch

    from rnndrop.lm.run.generate import generate, words_to_text

    try:
        _positive("--words", args.words, 0)
        _positive("--threads", args.threads)
        if not args.temperature > 0:
            raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    except UsageError as e:
        raise _fail(str(e), EXIT_DATA) from None
    torch.set_num_threads(args.threads)
    run = _load_run(args.run, args.device)
    generator = torch.Generator().manual_seed(args.seed)
    prompt = args.prompt.split()
    words = generate(run.model, run.vocab, prompt, args.words, temperature=args.temperature,
                     generator=generator)
    return words_to_text([*prompt, *words]) + "\n"


class _logging_beside_bars:
    """Route log lines above tqdm's bars while they are drawn."""

    def __init__(self, bars: bool) -> None:
        self.context = None
        if bars:
            try:
                from tqdm.contrib.logging import logging_redirect_tqdm

                self.context = logging_redirect_tqdm()
            except ImportError:
                pass

    def __enter__(self) -> None:
        if self.context is not None:
            self.context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.context is not None:
            self.context.__exit__(*exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rnndrop-lm`` and ``python -m rnndrop.lm``; returns the exit status
    (under torchrun, a worker that joined the process group exits with it instead)."""
    code = _main(argv)
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from rnndrop.lm.run.process_group import end_worker

            end_worker(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in ("ptb", "wikitext2"):
            sys.stdout.write(_train(args, CORPORA[args.command], argv[1:]))
        elif args.command == "evaluate":
            sys.stdout.write(_evaluate(args))
        else:
            sys.stdout.write(_generate(args))
    except SystemExit as e:
        return int(e.code or 0)
    except KeyboardInterrupt:  # outside training (reading data, scoring, sampling)
        sys.stderr.write("error: interrupted\n")
        return EXIT_INTERRUPTED
    return 0
