"""Tiny corpora and configs for the language-model tests (written into tmp_path), and running
the command line in-process. A plain module: its fixtures are in ``tests/conftest.py``."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import torch

from rnndrop.lm import cli
from rnndrop.lm.model.train_config import TrainConfig

SUBJECTS = ["the cat", "a dog", "the bird", "my friend", "the teacher"]
VERBS = ["sees", "likes", "finds", "follows"]
OBJECTS = ["the ball", "a tree", "the house", "some food", "the river"]


def sentences(n: int, seed: int) -> list[str]:
    """``n`` lines of a small grammar: predictable enough for a tiny LSTM to learn."""
    rng = random.Random(seed)
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ." for _ in range(n)]


def write_corpus(directory: Path, layout: str = "ptb.{split}.txt", sizes=(160, 30, 30)) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for i, (split, n) in enumerate(zip(("train", "valid", "test"), sizes)):
        lines = sentences(n, seed=i)
        if split == "test":
            lines.append("the zebra sees the ball .")  # 'zebra' never occurs in train
        (directory / layout.format(split=split)).write_text("\n".join(lines) + "\n")
    return directory


TINY = TrainConfig(
    name="tiny", embedding_size=16, hidden_size=16, num_layers=2, batch_size=4, bptt=8,
    epochs=3, lr=8.0, lr_decay=4.0, decay_after=0, clip=1.0, init_scale=None,
    schedule="plateau", eval_batch_size=2, mc_samples=3,
    dropout={"embedding": 0.1, "input": 0.2, "between": 0.2, "hidden": 0.2, "output": 0.2},
    grid={"naive": ({"input": 0.1, "between": 0.1, "output": 0.1},
                    {"input": 0.3, "between": 0.3, "output": 0.3})},
)


class Killed(Exception):
    """Raised from an ``on_epoch_end`` callback: a run stopped between epochs."""


def kill_after_first_epoch(epoch: int, record) -> None:
    if epoch == 1:
        raise Killed


def run_cli(argv: list[str]) -> int:
    """``rnndrop-lm argv`` in this process (its exit status); the command sets its own thread
    count, which is put back afterwards."""
    threads = torch.get_num_threads()
    try:
        return cli.main(argv)
    finally:
        torch.set_num_threads(threads)


def ctrl_c_reaches() -> None:
    """``preexec_fn`` of a child a test interrupts with SIGINT: a shell that starts jobs in
    the background (``cmd &``) starts them with SIGINT ignored, and Python then never turns
    it into KeyboardInterrupt; the child gets SIGINT's default back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
