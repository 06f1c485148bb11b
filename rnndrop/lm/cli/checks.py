"""The training job the command line describes, checked before anything trains:
config, regimes, seeds, dropout, the corpus (read once) and the output folder."""

from __future__ import annotations

import argparse
import json
import logging
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

from rnndrop.atomic import unwritable
from rnndrop.lm.cli.errors import UsageError, check_seed, check_threads, positive
from rnndrop.lm.cli.parser import CONFIG_FLAGS
from rnndrop.lm.data.corpus import cached_corpus, sample_dir
from rnndrop.lm.data.download import download_corpus
from rnndrop.lm.data.overlap import shared_lines, split_fingerprints, tuned_on_test
from rnndrop.lm.model.presets import get_config
from rnndrop.lm.model.regimes import get_regime
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import LEARNING_CURVES, RESULTS_TABLE, SUMMARY, JobLock, best_file, run_files
from rnndrop.lm.run.job import chosen_dropout, parse_dropout, tuning_fingerprints

__all__ = ["check_writable", "checked_job", "config_from_args", "resolve_data"]

log = logging.getLogger(__name__)

#: The files a job writes at the top of its folder (its report).
JOB_FILES = (RESULTS_TABLE, SUMMARY, LEARNING_CURVES)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``--config`` preset with the fields its flags override (UsageError if invalid)."""
    config = get_config(args.config)
    changes: dict[str, Any] = {}
    flags: list[str] = []
    for flag, (field_name, _, _) in CONFIG_FLAGS.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            changes[field_name] = value
            if isinstance(value, bool):
                flags.append(flag if value else f"--no-{flag[2:]}")
            else:
                flags.append(f"{flag} {value}")
    if "lr" in changes and "min_lr" not in changes and config.min_lr:
        # The floor stays as many decays below the start as the config puts it.
        changes["min_lr"] = config.min_lr * changes["lr"] / config.lr
    try:
        return replace(config, **changes) if changes else config
    except (TypeError, ValueError) as e:
        raise UsageError(f"{e} (config {config.name!r} with {', '.join(flags)})") from None


def _check_tuning_overlap(summary: str, data_dir: Path, allowed: bool) -> None:
    """Refuse dropout chosen on validation text that is part of this corpus' test split
    (:mod:`rnndrop.lm.data.overlap`), unless ``allowed``; say so where it cannot be checked."""
    tuned = tuning_fingerprints(summary)
    if tuned is None:
        log.warning("--dropout-from %s: the summary names no validation split that is still there, so "
                    "whether the grid tuned on this test split's text is not checked", summary)
        return
    lines, where = tuned
    test = split_fingerprints(data_dir, "test")
    if not tuned_on_test(lines, test):
        return
    what = (f"--dropout-from {summary!r}: the grid chose on {where}, whose lines are in the test split "
            f"of {str(data_dir)!r} ({shared_lines(lines, test)} of its {len(lines)})")
    if allowed:
        log.warning("%s: the test perplexity is not of text nobody tuned on (--allow-tuning-overlap)", what)
        return
    raise UsageError(f"{what} (tuning on test text); choose on a validation split apart from it (a "
                     "--grid on this corpus), or pass --allow-tuning-overlap to train anyway")


def resolve_data(data: str | None, dataset: str, args: argparse.Namespace) -> Path:
    """The corpus folder ``--data`` names: the bundled sample, a folder, or the download cache."""
    if data == "sample":
        return sample_dir(dataset)
    if data:
        return Path(data)
    return download_corpus(dataset, args.cache_dir, base_url=args.mirror, source=args.source)


def _no_repeats(flag: str, values: list[Any], given: str) -> None:
    """UsageError when ``values`` repeats one: the second run of it would find the first's folder."""
    repeated = list(dict.fromkeys(v for v in values if values.count(v) > 1))
    if repeated:
        raise UsageError(f"{flag} names {', '.join(map(str, repeated))} more than once, got {given!r}")


def check_writable(out: Path) -> None:
    """Create ``out`` if needed; UsageError unless a file can be written in it."""
    if why := unwritable(out, folder=True):
        raise UsageError(f"--out {str(out)!r} is not a writable folder: {why}")


def checked_job(args: argparse.Namespace, dataset: str, claim: ExitStack | None = None) -> tuple[Any, ...]:
    """The job the arguments describe, checked: (config, regimes, seeds, dropout,
    dropout by regime, data folder, output folder). Raises UsageError and the data's errors.

    With ``claim`` the output folder is taken (:class:`~rnndrop.lm.run.checkpoint.JobLock`, held
    until ``claim`` closes) before what it holds is checked: of two jobs started at once on one
    folder, one goes ahead and the other gets :class:`~rnndrop.lm.run.checkpoint.RunLocked`."""
    config = config_from_args(args)
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if not regimes:
        raise UsageError(f"--regimes must name at least one regime, got {args.regimes!r}")
    for r in regimes:
        try:
            get_regime(r)
        except ValueError as e:
            raise UsageError(f"--regimes: {e}") from None
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds takes comma-separated integers, got {args.seeds!r}") from None
    if not seeds:
        raise UsageError(f"--seeds must name at least one seed, got {args.seeds!r}")
    for seed in seeds:
        check_seed("--seeds", seed)
    for flag, values, given in (("--regimes", regimes, args.regimes), ("--seeds", seeds, args.seeds)):
        _no_repeats(flag, values, given)
    if args.grid and args.dropout:
        raise UsageError("--dropout cannot be combined with --grid (the grid sets the dropout)")
    # the sites it names, the others the config's (the AWD table's "--dropout hidden=P")
    named = parse_dropout(args.dropout) if args.dropout else {}
    dropped_at = {site for r in regimes for site in get_regime(r).sites}
    unused = [site for site, p in named.items() if p > 0 and site not in dropped_at]
    if unused:  # it would train without them, saying nothing
        raise UsageError(f"--dropout names {', '.join(unused)}, where none of the regimes "
                         f"({', '.join(regimes)}) drops; leave it out, or add a regime that drops there")
    dropout = {**config.dropout, **named} if args.dropout else None
    if args.dropout_from and (args.grid or args.dropout):
        raise UsageError("--dropout-from cannot be combined with --grid or --dropout")
    by_regime = chosen_dropout(args.dropout_from) if args.dropout_from else None
    lacking = [r for r in regimes if by_regime is not None and r not in by_regime and get_regime(r).sites]
    if lacking:  # they would silently train with the config's dropout
        raise UsageError(f"--dropout-from {args.dropout_from!r} holds no choice for regime(s) "
                         f"{', '.join(lacking)} (it has {', '.join(sorted(by_regime or {})) or 'none'}); "
                         "drop them from --regimes")
    if args.init_from is not None and not best_file(args.init_from).is_file():
        raise UsageError(f"--init-from: expected a finished run's folder (holding best.pt) or a best.pt "
                         f"file, got {args.init_from!r}, where there is none")
    positive("--jobs", args.jobs)
    check_threads(args.threads)
    positive("--mc-samples", args.mc_samples, 0)
    data_dir = resolve_data(args.data, dataset, args)
    cached_corpus(str(data_dir))  # fail early, with the corpus' own message (read once)
    if args.dropout_from:
        _check_tuning_overlap(args.dropout_from, data_dir, args.allow_tuning_overlap)
    elif args.allow_tuning_overlap:
        raise UsageError("--allow-tuning-overlap goes with --dropout-from")
    sample = "-sample" if args.data == "sample" else ""
    if args.out is not None and not args.out.strip():  # an unset shell variable: not the default folder
        raise UsageError(f"--out must name a folder, got {args.out!r}")
    out = Path(args.out) if args.out else Path("runs") / f"{dataset}{sample}-{config.name}"
    check_writable(out)
    if claim is not None:
        claim.enter_context(JobLock(out))
    earlier = _dataset_of_job(out)
    if earlier is not None and earlier != dataset:  # its report would mix the two under one title
        raise UsageError(f"{str(out)!r} holds a {earlier} job (its summary.json); a {dataset} job "
                         "writes into another --out")
    if not args.resume:
        held = sorted(folder for folder in out.glob("*/*/") if run_files(folder))
        if held:
            raise UsageError(
                f"{str(out)!r} already holds runs of a job (e.g. {str(held[0])!r}); add --resume "
                "to continue them (finished runs are reused), or pass another --out"
            )
        reports = [name for name in JOB_FILES if (out / name).exists()]
        if reports:  # a job's report without its runs, or files of the user's own: never written over
            raise UsageError(
                f"{str(out)!r} already holds {', '.join(reports)}, which the job would write over; "
                "pass another --out (or --resume to continue the job that wrote them)"
            )
    return config, regimes, seeds, dropout, by_regime, data_dir, out


def _dataset_of_job(out: Path) -> str | None:
    """The corpus name of the job whose summary.json is in ``out`` (None: none there, or unreadable,
    which the job's report then writes again)."""
    try:
        summary = json.loads((out / SUMMARY).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    dataset = summary.get("dataset") if isinstance(summary, dict) else None
    return dataset if isinstance(dataset, str) and dataset else None
