"""The argument parsers of ``rnndrop-lm``: one sub-command per corpus (train and compare
regimes), ``evaluate`` and ``generate``."""

from __future__ import annotations

import argparse
from typing import Any

from rnndrop.lm.data.carve import CARVINGS
from rnndrop.lm.data.download import DATASETS
from rnndrop.lm.model.presets import CONFIGS
from rnndrop.lm.model.regimes import REGIMES

__all__ = [
    "CONFIG_FLAGS",
    "CORPORA",
    "ESTIMATE_HELP",
    "HelpFormatter",
    "add_train_arguments",
    "build_parser",
    "corpus_parser",
]

#: Corpus names on the command line -> names in :mod:`rnndrop.lm.data.download`.
CORPORA = {"ptb": "ptb", "wikitext2": "wikitext-2", "wikitext-2": "wikitext-2"}


#: The largest integer a flag takes: sizes and counts beyond it overflow inside torch (a
#: traceback) long before they would fit a machine.
LARGEST_INTEGER = 2**31 - 1


def integer(text: str) -> int:
    """An integer flag's value (argparse's ``type``): one line naming the flag for a value that
    is no integer or overflows what torch takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if abs(value) > LARGEST_INTEGER:
        raise argparse.ArgumentTypeError(f"expected an integer of at most {LARGEST_INTEGER}, got {text}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after an option's help unless the help states its default itself, or
    there is none to state (None, an empty text, a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, "", False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


#: How a training job's time estimate is made and how it adapts (the epilog of its --help).
ESTIMATE_HELP = (
    "Time: before training, the job times a few training steps, evaluation and Monte-Carlo passes "
    "of each regime and prints how long it should take (runs that stop early at the learning-rate "
    "floor take less). The progress bar's ETA starts from that same number; once the first epoch "
    "ends, the measured speed replaces the timed one (so on a machine that gets busier the ETA "
    "grows), and runs that stop early drop their epochs left. At the end the job says how far off "
    "the estimate was."
)


def _prefixes(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


#: Flags that override a field of the config: flag -> (TrainConfig field, type, help).
CONFIG_FLAGS: dict[str, tuple[str, type, str]] = {
    "--epochs": ("epochs", int, "number of epochs (the cap when the config stops at min_lr)"),
    "--lr": ("lr", float, "initial learning rate (the config's min_lr scales with it unless --min-lr "
             "is given)"),
    "--schedule": ("schedule", str, "learning-rate rule: fixed (decay by --lr-decay after decay_after "
                   "epochs; 1: constant) or plateau (divide by --lr-decay after every epoch that does "
                   "not improve validation)"),
    "--lr-decay": ("lr_decay", float, "the factor of the learning-rate rule"),
    "--min-lr": ("min_lr", float, "stop once the next learning rate would be below this (0: never)"),
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
    "--weight-decay": ("weight_decay", float, "L2 weight decay of the optimiser"),
    "--tie-weights": ("tie_weights", bool, "share one matrix between the embedding and the decoder "
                      "(tying needs --emb-size equal to --hidden-size); --no-tie-weights: separate "
                      "matrices, any sizes"),
    # AWD-LSTM's training recipe (docs/language-models.md#the-awd-lstm-recipe)
    "--ar": ("ar", float, "activation regularization: ar * mean of the squared dropped last-layer "
             "output, added to the loss (AWD-LSTM: 2; 0: off)"),
    "--tar": ("tar", float, "temporal activation regularization: tar * mean of the squared change of "
              "the raw last-layer output between steps (AWD-LSTM: 1; 0: off)"),
    "--variable-bptt": ("variable_bptt", bool, "random segment lengths around --bptt, the rate "
                        "scaled by length / bptt (AWD-LSTM)"),
    "--nt-asgd": ("nt_asgd", bool, "NT-ASGD: average the weights once validation has not improved "
                  "for --nonmono epochs; validate, keep and test the average"),
    "--nonmono": ("nonmono", int, "epochs without improvement that start NT-ASGD's averaging (and end "
                  "the averaging and fine-tuning stages)"),
    "--finetune-epochs": ("finetune_epochs", int, "after training, fine-tune up to this many epochs "
                          "from the best averaged weights with averaging restarted (0: none; needs "
                          "NT-ASGD)"),
}


def add_train_arguments(parser: argparse.ArgumentParser, dataset: str) -> None:
    """The options of ``rnndrop-lm <corpus>``: data, job, model and optimisation, machine."""
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
                     help="override the config's dropout at the sites named, e.g. input=0.5,hidden=0.2 "
                     "(the other sites keep the config's; site=0 drops nothing there; not with --grid)")
    job.add_argument("--init-from", default=None, metavar="RUN",
                     help="start every run from the weights of a finished run (its folder or best.pt), "
                     "e.g. --regimes sparse_vd --config sparse-vd-cpu-200 fine-tuning a dense tied run")
    job.add_argument("--dropout-from", default=None, metavar="SUMMARY",
                     help="take each regime's dropout from the summary.json of a --grid run (refused "
                     "where the grid's validation text shares lines with this corpus' test split)")
    job.add_argument("--allow-tuning-overlap", action="store_true",
                     help="with --dropout-from: train even where the grid's validation text shares lines "
                     "with the test split (the test perplexity is then not of text nobody tuned on; "
                     "the flag is kept in the job's command)")
    job.add_argument("--mc-samples", type=integer, default=None,
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
        elif flag == "--schedule":
            model.add_argument(flag, choices=("fixed", "plateau"), default=None, help=text)
        elif flag == "--model":
            model.add_argument(flag, choices=("lstm", "gru"), default=None, help=text)
        elif kind is bool:  # --flag / --no-flag; absent: the config's
            model.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            model.add_argument(flag, type=integer if kind is int else kind, default=None, help=text)
    machine = parser.add_argument_group("machine")
    machine.add_argument("--jobs", type=integer, default=1, help="runs trained at once (processes)")
    machine.add_argument("--threads", type=integer, default=1,
                         help="torch threads per run: 1 is fastest for the small configs on a shared "
                         "CPU; give more to big models on a machine of their own")
    machine.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    machine.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                         help="train under torch.compile (rnndrop.compile_model: the whole step from CUDA "
                         "graphs on a GPU; compiles for a while first; evaluation runs eagerly; a step "
                         "that fails compiled goes on eagerly). Default: on CUDA for regimes whose "
                         "recurrence runs rnndrop's loop kernel (tied, untied, Gaussian masks), eager "
                         "elsewhere and under torchrun")
    machine.add_argument("--no-progress", action="store_true",
                         help="no progress bars (log lines only)")


def corpus_parser(dataset: str, prog: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of one corpus alone (:func:`rnndrop.lm.cli.commands.train_main`)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"Train and compare word-level language models on {dataset} with different "
        "dropout regimes (none, naive, tied variational, ...), then print the comparison table.",
        formatter_class=HelpFormatter, epilog=ESTIMATE_HELP, **kwargs,
    )
    add_train_arguments(parser, dataset)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``rnndrop-lm`` (corpus or command first)."""
    parser = argparse.ArgumentParser(
        prog="rnndrop-lm",
        description="Word-level language models with recurrent dropout: train and compare "
        "regimes on a corpus, then evaluate or sample a trained run.",
        epilog="Start with: rnndrop-lm ptb --data sample   (the bundled sample, 10-30 minutes on "
        "2 CPU cores, estimated up front; after Ctrl-C run the same command with --resume). "
        "Exit status: 0 done, 2 data or usage problem, 3 training diverged, 130 interrupted.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{ptb,wikitext2,evaluate,generate,carve}",
                                required=True)
    for name in ("ptb", "wikitext2"):
        p = sub.add_parser(name, help=f"train and compare regimes on {CORPORA[name]} "
                           "(--data sample|DIR, --resume, ...)",
                           formatter_class=HelpFormatter,
                           description=f"Train and compare word-level language models on "
                           f"{CORPORA[name]} with different dropout regimes, then print the "
                           "comparison table and the path of the learning curves.", epilog=ESTIMATE_HELP)
        add_train_arguments(p, CORPORA[name])
    _add_evaluate(sub)
    _add_generate(sub)
    _add_carve(sub)
    return parser


def _add_carve(sub: Any) -> None:
    carve = sub.add_parser(
        "carve", help="make the small corpora of the result pages from the official PTB / "
        "WikiText-2 files", description="Write ptb-mini, ptb-144k or wikitext-2-mini (the corpora "
        "of docs/results.md) from the official files: Mikolov's PTB simple-examples/data "
        "(ptb.train.txt, ptb.valid.txt) or WikiText-2's wiki.valid.tokens.")
    carve.add_argument("corpus", choices=tuple(CARVINGS))
    carve.add_argument("--from", dest="official", required=True, metavar="DIR",
                       help="the folder of the official files")
    carve.add_argument("--out", required=True, metavar="DIR", help="the folder to write (new or empty)")


def _add_evaluate(sub: Any) -> None:
    evaluate = sub.add_parser("evaluate", help="score a trained run on a corpus split: perplexity, "
                              "Monte-Carlo perplexity, calibration (ECE)",
                              formatter_class=HelpFormatter)
    evaluate.add_argument("runs", nargs="+", metavar="RUN",
                          help="run folders (holding best.pt) or best.pt files, scored one after another")
    evaluate.add_argument("--data", metavar="sample|DIR", default=None,
                          help="corpus to score (default: the one the run was trained on)")
    evaluate.add_argument("--split", choices=("train", "valid", "test"), default="test",
                          help="the split to score")
    evaluate.add_argument("--mc-samples", type=integer, default=0,
                          help="Monte-Carlo dropout samples (0: weight-scaling only)")
    evaluate.add_argument("--seed", type=int, default=1, help="seed of the Monte-Carlo masks")
    evaluate.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    evaluate.add_argument("--threads", type=integer, default=1, help="torch threads")


def _add_generate(sub: Any) -> None:
    generate = sub.add_parser("generate", help="sample text from a trained run",
                              formatter_class=HelpFormatter)
    generate.add_argument("run", help="a run folder (holding best.pt) or a best.pt file")
    generate.add_argument("--words", type=integer, default=50, help="words to generate")
    generate.add_argument("--prompt", default="", help="words to start from (unknown ones become <unk>)")
    generate.add_argument("--temperature", type=float, default=1.0,
                          help="softmax temperature (lower: more likely words)")
    generate.add_argument("--top-k", type=integer, default=None, metavar="K",
                          help="draw each word among the K likeliest only (default: among all words)")
    generate.add_argument("--top-p", type=float, default=None, metavar="P",
                          help="nucleus sampling: draw each word among the fewest likeliest words whose "
                          "probabilities add up to P or more, 0 < P <= 1 (default: 1, all words)")
    generate.add_argument("--seed", type=int, default=1,
                          help="seed of the draws (default: 1), taken with the prompt: the same run, "
                          "prompt, options and seed give the same text; pass another seed for other text")
    generate.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    generate.add_argument("--threads", type=integer, default=1, help="torch threads")
