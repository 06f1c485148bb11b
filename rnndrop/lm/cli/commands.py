"""The sub-commands of ``rnndrop-lm``, one function each: :func:`train` (``ptb``,
``wikitext2``), :func:`evaluate` and :func:`generate`. Each returns what goes to stdout
and raises SystemExit after one line on stderr (:func:`rnndrop.lm.cli.errors.fail`)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import shlex
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from rnndrop.kernels import compiled
from rnndrop.lm.cli.checks import checked_job
from rnndrop.lm.cli.errors import (
    EXIT_DATA,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    UsageError,
    check_seed,
    check_threads,
    fail,
    positive,
)
from rnndrop.lm.cli.parser import CORPORA, corpus_parser
from rnndrop.lm.cli.terminal import markdown_for_terminal
from rnndrop.lm.data.carve import CarveError
from rnndrop.lm.data.carve import carve as carve_corpus
from rnndrop.lm.data.corpus import CorpusError, batchify, encode_split, load_corpus, sample_dir
from rnndrop.lm.data.download import DownloadError
from rnndrop.lm.run.checkpoint import (
    BEST,
    CHECKPOINT,
    LEARNING_CURVES,
    RESULTS,
    CheckpointError,
    LoadedModel,
    RunLocked,
    corpus_fingerprint,
    describe_differences,
    files_on_main,
    identity_differences,
    load_checkpoint,
    load_model,
)
from rnndrop.lm.run.evaluate import CALIBRATION_BINS, MC_PROGRESS, has_noise, score, score_mc, words_to_text
from rnndrop.lm.run.evaluate import generate as generate_words
from rnndrop.lm.run.job import JobInterrupted, WorkerDied, run_benchmark
from rnndrop.lm.run.process_group import RankFailed, init_from_env, torchrun_world_size
from rnndrop.lm.run.train import TrainingDiverged, resolve_device

__all__ = ["evaluate", "generate", "train", "train_main"]


def train_main(argv: Sequence[str] | None, dataset: str) -> str:
    """``rnndrop-lm <corpus> ARGS``; returns the report (the table and where the files are).

    Raises SystemExit with status 2 (data or usage), 3 (diverged) or 130 (interrupted)
    after one line on stderr.
    """
    parser = corpus_parser(dataset, prog=f"rnndrop-lm {dataset.replace('-', '')}")
    args = parser.parse_args(argv)
    return train(args, dataset, list(sys.argv[1:] if argv is None else argv))


def train(args: argparse.Namespace, dataset: str, given: list[str]) -> str:
    """``rnndrop-lm <corpus>`` from parsed arguments; returns the report (``given``: the
    arguments after the corpus, for the command line the report quotes)."""
    try:  # a device this machine lacks, or no device at all: one line naming --device
        resolve_device(args.device)
    except ValueError as e:
        raise fail(f"--{e}", EXIT_DATA) from None
    try:  # under torchrun: join the process group (each rank checks the same arguments)
        if torchrun_world_size() > 1 and args.jobs != 1:
            raise UsageError(f"--jobs must be 1 under torchrun (its processes train each run "
                             f"together), got {args.jobs}")
        ctx, device = init_from_env(args.device)
    except (UsageError, ValueError, RuntimeError) as e:
        raise fail(str(e), EXIT_DATA) from None
    logging.basicConfig(level=logging.INFO if ctx.is_main else logging.WARNING,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    with ExitStack() as claim:  # the output folder, taken before it is checked, until the job ends
        return _train(args, dataset, given, ctx, device, claim)


def _train(
    args: argparse.Namespace, dataset: str, given: list[str], ctx: Any, device: Any, claim: ExitStack
) -> str:
    try:
        # Rank 0 checks the data and the output folder (and downloads); the others get its answer.
        config, regimes, seeds, dropout, by_regime, data_dir, out = files_on_main(
            lambda: checked_job(args, dataset, claim), ctx, "checking the command line and the data")
    except RankFailed:
        raise fail("", EXIT_DATA) from None
    except (UsageError, ValueError, CorpusError, DownloadError, RunLocked, OSError) as e:
        raise fail(str(e), EXIT_DATA) from None
    if device.type == "cpu" and ctx.is_main:
        _compiled_kernel_first()
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
                estimate=not ctx.enabled, init_from=args.init_from, compile=args.compile,
            )
    except JobInterrupted as e:
        where = f"in epoch {e.epoch} of {e.label or e.folder}" if e.epoch is not None else "during training"
        if e.testing:
            where = f"after the last epoch of {e.label or e.folder}, while its test split was scored"
        raise fail(f"interrupted {where}; every finished epoch is saved: run the same command "
                   "with --resume to continue", EXIT_INTERRUPTED) from None
    except KeyboardInterrupt:
        raise fail("interrupted; every finished epoch is saved: run the same command with --resume "
                   "to continue", EXIT_INTERRUPTED) from None
    except TrainingDiverged as e:
        raise fail(str(e), EXIT_DIVERGED) from None
    except (RunLocked, OSError, CorpusError, ValueError, RankFailed, WorkerDied) as e:
        # another process holds a run folder, a file cannot be written, a damaged or
        # foreign checkpoint or result: the message names the file and what to do (under torchrun
        # from the rank that met it: rank 0 reports what it met for all, RankFailed elsewhere)
        raise fail(str(e), EXIT_DATA, every_rank=not isinstance(e, RankFailed)) from None
    if not ctx.is_main:
        return ""
    report = markdown_for_terminal(summary["markdown"]).rstrip() + "\n\n"
    report += f"Written to {out}/: {', '.join(summary['files'])} and one folder per run.\n"
    if LEARNING_CURVES in summary["files"]:
        report += f"Learning curves: {out / LEARNING_CURVES}\n"
    return report


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


def _compiled_kernel_first() -> None:
    """Build the compiled CPU kernel before the job's estimate and first step, in the foreground
    and with its progress lines (a cached build loads at once). A layer would otherwise start on the
    manual kernel and switch when a background build ends, and a run that switches kernels part-way
    does not resume bit for bit. Where it cannot be built, the layers say why and run the manual one."""
    with contextlib.suppress(RuntimeError):  # kernel="auto" then warns once, with the reason
        compiled.build()


def _load_run(path: str, device: str) -> LoadedModel:
    try:
        resolved = resolve_device(device)
    except ValueError as e:
        raise fail(f"--{e}", EXIT_DATA) from None
    runs = _runs_below(Path(path))
    if runs:  # a job's or a regime's folder: best.pt is in the run folders below it
        shown = ", ".join(runs[:3]) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")
        raise fail(f"{path!r} holds runs, not one run: pass one run's folder ({shown})", EXIT_DATA)
    try:
        return load_model(path, resolved)
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        raise fail(f"cannot load the model of {path!r}: {e}", EXIT_DATA) from None


def _runs_below(folder: Path) -> list[str]:
    """The run folders (holding best.pt) one or two levels below ``folder``, when ``folder``
    itself holds none: a job's folder (regime/run) or a regime's (run)."""
    if not folder.is_dir() or (folder / BEST).exists():
        return []
    found = sorted({*folder.glob(f"*/{BEST}"), *folder.glob(f"*/*/{BEST}")})
    return [str(best.parent) for best in found if best.parent != folder]


def _check_own_weights(run: LoadedModel, result: dict[str, Any]) -> None:
    """UsageError when the best.pt read belongs to another run than the folder's results.json
    (or, before the run finished, its checkpoint.pt) says: moved or swapped by hand, it would
    report another run's perplexity under this one's name."""
    theirs = result.get("identity")
    source = run.path.parent / RESULTS
    if not isinstance(theirs, dict) and (run.path.parent / CHECKPOINT).is_file():
        source = run.path.parent / CHECKPOINT
        try:
            theirs = load_checkpoint(source).get("identity")
        except (OSError, CheckpointError):
            theirs = None
    if not isinstance(theirs, dict) or run.identity is None:
        return
    differences = identity_differences(theirs, run.identity)
    if differences:
        raise UsageError(f"{str(run.path)!r} belongs to another run than {str(source)!r} beside it "
                         f"({describe_differences(differences)}: that file here vs best.pt); put back "
                         "this run's own best.pt, or pass the best.pt file of the run you mean")


def _run_result(best: Path) -> dict[str, Any]:
    """The run's results.json beside best.pt (for its corpus), or {} if absent or unreadable."""
    try:
        with open(best.parent / RESULTS, encoding="utf-8") as f:
            result = json.load(f)
        return result if isinstance(result, dict) else {}
    except (OSError, ValueError):
        return {}


def _evaluation_data(data: str | None, run: LoadedModel, result: dict[str, Any]) -> tuple[Path, bool]:
    """The corpus folder to score and whether it holds the run's own corpus: ``--data``
    (``sample``: the run's corpus' sample), or the folder the run was trained on (UsageError
    when its results do not say, or when that folder now holds another corpus). A run that has
    not finished has no results.json: its corpus is then known by the fingerprint in best.pt, and
    found among the samples shipped with the package when it is one of them."""
    expected = _corpus_fingerprint(run, result)
    if data == "sample":
        dataset = result.get("dataset")
        if dataset in CORPORA.values():
            data_dir = sample_dir(dataset)
        else:  # not finished: the sample that holds its corpus, if one does
            data_dir = _sample_holding(expected) or sample_dir("ptb")
    elif data:
        data_dir = Path(data)
    else:
        source = result.get("corpus", {}).get("source")
        found = Path(source) if source else _sample_holding(expected)
        if found is None:
            raise UsageError(f"{str(run.path.parent)!r} does not say which corpus it was trained "
                             "on (a run that has not finished names it only by its fingerprint): "
                             "pass --data DIR, the folder it was trained on")
        data_dir = found
    own = _is_training_corpus(data_dir, expected)
    if not data and not own:
        raise UsageError(f"{str(data_dir)!r}, the corpus folder {str(run.path.parent)!r} names, does not "
                         "hold the corpus the run was trained on (a relative path read from here, or a "
                         "folder that changed): pass --data DIR")
    return data_dir, own


def _corpus_fingerprint(run: LoadedModel, result: dict[str, Any]) -> str | None:
    """The fingerprint of the run's training corpus: its results', else its best.pt's."""
    expected = result.get("identity", {}).get("corpus")
    if expected is None and isinstance(run.identity, dict):
        expected = run.identity.get("corpus")
    return expected if isinstance(expected, str) else None


def _sample_holding(expected: str | None) -> Path | None:
    """The folder of the package's sample whose corpus has fingerprint ``expected``, if any."""
    for name in dict.fromkeys(CORPORA.values()):
        if expected is not None and _is_training_corpus(sample_dir(name), expected):
            return sample_dir(name)
    return None


def _is_training_corpus(data_dir: Path, expected: str | None) -> bool:
    """Whether ``data_dir`` holds the corpus of fingerprint ``expected`` (the run's)."""
    try:
        # (not its splits' words against its own vocabulary: the run's is what scores them)
        return expected is not None and corpus_fingerprint(load_corpus(data_dir, warn=False)) == expected
    except (CorpusError, OSError, ValueError):
        return False


def evaluate(args: argparse.Namespace) -> str:
    """``rnndrop-lm evaluate RUN [RUN ...]``: perplexity, MC perplexity and ECE on a split, of
    each run in turn (a shell pattern may name several: the seeds or the grid of a regime)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        positive("--mc-samples", args.mc_samples, 0)
        check_threads(args.threads)
        check_seed("--seed", args.seed)
    except UsageError as e:
        raise fail(str(e), EXIT_DATA) from None
    torch.set_num_threads(args.threads)
    return "\n".join(_evaluate_run(path, args) for path in args.runs)


def _evaluate_run(path: str, args: argparse.Namespace) -> str:
    """:func:`evaluate`'s lines for one run."""
    run = _load_run(path, args.device)
    result = _run_result(run.path)
    try:
        _check_own_weights(run, result)
        data_dir, own_corpus = _evaluation_data(args.data, run, result)
        ids = encode_split(data_dir, args.split, run.vocab)
        device = next(run.model.parameters()).device
        batched = batchify(ids, run.config.eval_batch_size, split=f"the {args.split} split",
                           size_name="eval_batch_size").to(device)
    except (UsageError, CorpusError, ValueError) as e:
        raise fail(str(e), EXIT_DATA) from None
    standard = score(run.model, batched, run.config.bptt, CALIBRATION_BINS)
    lines = [
        f"{run.path}: {run.regime}, epoch {run.epoch}; {args.split} split of {data_dir} "
        f"({standard.tokens:,} predicted words)",
        f"perplexity      {standard.perplexity:.2f}   (NLL {standard.nll:.4f} nats/word, "
        f"ECE {standard.ece:.4f})",
    ]
    if not own_corpus:
        lines.append("                (not the corpus the run was trained on)")
    elif args.split == "test" and isinstance(result.get("test_ppl"), (int, float)):
        lines.append(f"                (the run reported {result['test_ppl']:.2f} at the end of training)")
    if args.mc_samples and not has_noise(run.model):
        lines.append(f"perplexity, MC  the same: the {run.regime!r} run draws no dropout noise")
    elif args.mc_samples:
        torch.manual_seed(args.seed)
        mc = score_mc(run.model, batched, run.config.bptt, args.mc_samples, CALIBRATION_BINS,
                      progress=MC_PROGRESS.format(split=args.split, samples=args.mc_samples), bar=True)
        lines.append(f"perplexity, MC  {mc.perplexity:.2f}   (NLL {mc.nll:.4f} nats/word, "
                     f"ECE {mc.ece:.4f}; {args.mc_samples} dropout samples)")
    return "\n".join(lines) + "\n"


def generate(args: argparse.Namespace) -> str:
    """``rnndrop-lm generate RUN``: sample words from the trained model."""
    try:
        positive("--words", args.words, 0)
        check_threads(args.threads)
        check_seed("--seed", args.seed)
        if not args.temperature > 0:
            raise UsageError(f"--temperature must be > 0, got {args.temperature}")
        if args.top_k is not None and args.top_k < 1:
            raise UsageError(f"--top-k must be >= 1 (leave it out to draw among all words), got {args.top_k}")
        if args.top_p is not None and not 0 < args.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1] (1: all words), got {args.top_p}")
    except UsageError as e:
        raise fail(str(e), EXIT_DATA) from None
    torch.set_num_threads(args.threads)
    run = _load_run(args.run, args.device)
    try:
        _check_own_weights(run, _run_result(run.path))
    except UsageError as e:
        raise fail(str(e), EXIT_DATA) from None
    prompt = args.prompt.split()
    generator = torch.Generator().manual_seed(draw_seed(args.seed, prompt))
    unknown = [word for word in prompt if word not in run.vocab.stoi]
    if unknown:
        logging.getLogger(__name__).warning(
            "not in the model's vocabulary, read as <unk>: %s", ", ".join(dict.fromkeys(unknown)))
    words = generate_words(run.model, run.vocab, prompt, args.words, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, generator=generator)
    return words_to_text([*prompt, *words]) + "\n"


def draw_seed(seed: int, prompt: Sequence[str]) -> int:
    """The seed of ``generate``'s draws: ``seed`` and the prompt's words together. One seed alone
    gave every prompt the same random numbers, and a word drawn by them is mostly the one of the
    smallest exponential variate whatever the probabilities (torch.multinomial), so two prompts
    went on with the same words."""
    text = f"{seed}\0{' '.join(prompt)}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1  # < 2^63, what torch takes


def carve(args: argparse.Namespace) -> str:
    """``rnndrop-lm carve CORPUS --from DIR --out DIR``: a result page's corpus from the official files."""
    try:
        written = carve_corpus(args.corpus, args.official, args.out)
    except (CarveError, OSError) as e:
        raise fail(f"carve: {e}", EXIT_DATA) from None
    return f"{args.corpus}: wrote {', '.join(str(p) for p in written)}\n"
