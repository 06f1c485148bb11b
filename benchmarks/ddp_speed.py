"""Training words/s of one process against DDP processes (docs/distributed.md).

One process with T threads::

    python benchmarks/ddp_speed.py DATA_DIR OUT --threads 2      # DATA_DIR "sample": the PTB sample

N processes with one thread each (DDP, gloo on the CPU), the same total batch::

    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_speed.py DATA_DIR OUT --threads 1

Trains the ``mini`` config (regime ``tied``) for ``--epochs`` epochs into a fresh folder
under OUT and prints one line: processes, threads, words/s of training (rank 0).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rnndrop.atomic import unwritable
from rnndrop.lm.data.corpus import load_corpus, sample_dir
from rnndrop.lm.model.presets import get_config
from rnndrop.lm.model.regimes import get_regime
from rnndrop.lm.run.process_group import end_worker, init_from_env
from rnndrop.lm.run.train import train_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("data")
    parser.add_argument("out")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--regime", default="tied")
    parser.add_argument("--resume", action="store_true", help="continue (or reuse) the run in OUT")
    args = parser.parse_args()
    for name in ("threads", "epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    try:  # before anything is written: one line, not a traceback and an empty run folder
        get_regime(args.regime)
        corpus = load_corpus(sample_dir("ptb") if args.data == "sample" else args.data)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    if why := unwritable(args.out, folder=True):  # the last check (it makes the folder)
        parser.error(f"out {args.out!r}: {why}")
    ctx, device = init_from_env("cpu")
    torch.set_num_threads(args.threads)
    config = replace(get_config("mini"), epochs=args.epochs, mc_samples=0)
    folder = Path(args.out) / f"{ctx.world_size}x{args.threads}-{args.regime}"
    try:
        result = train_run(corpus, config, args.regime, folder, device=device, progress=False,
                           resume=args.resume)
    except FileExistsError as error:
        parser.error(str(error).replace("resume=True (--resume)", "--resume"))
    if ctx.is_main:
        print(f"{ctx.world_size} process(es) x {args.threads} thread(s): "
              f"{result['words_per_second']:,.0f} words/s, valid ppl {result['best_valid_ppl']:.1f}")
    if ctx.enabled:
        end_worker(0)


if __name__ == "__main__":
    main()
