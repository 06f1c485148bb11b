"""Sampling text from a trained language model.

``generate(model, vocab, prompt, n_words)`` feeds the prompt, then draws one word at a
time from ``softmax(logits / temperature)`` and feeds it back, carrying the recurrent
state; dropout is off (eval mode).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rnndrop.lm.data.corpus import EOS, Vocabulary

__all__ = ["generate", "words_to_text"]


@torch.no_grad()
def generate(
    model: nn.Module,
    vocab: Vocabulary,
    prompt: Sequence[str] = (),
    n_words: int = 50,
    *,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[str]:
    """``n_words`` words sampled after ``prompt`` (words the vocabulary lacks become
    ``<unk>``; an empty prompt starts after ``<eos>``, i.e. at a sentence start).

    Args:
        model: a language model of the :mod:`rnndrop.lm` protocol (``[T, B]`` ids in,
            ``([T, B, V]`` logits, hidden) out).
        vocab: its vocabulary.
        temperature: > 0; below 1 favours likely words, above 1 flattens the distribution.
        generator: for reproducible samples.
    """
    if isinstance(n_words, bool) or not isinstance(n_words, int) or n_words < 0:
        raise ValueError(f"n_words must be an int >= 0, got {n_words!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        ids = vocab.encode(list(prompt) or [EOS]).to(device)[:, None]  # [T, 1]
        logits, hidden = model(ids)
        words: list[str] = []
        for _ in range(n_words):
            # shifted so the largest is 0: a tiny temperature then gives the greedy choice,
            # not inf / inf = NaN probabilities
            scores = logits[-1, 0].double()
            probs = torch.softmax((scores - scores.max()) / temperature, dim=-1).cpu()
            word = int(torch.multinomial(probs, 1, generator=generator))
            words.append(vocab.itos[word])
            logits, hidden = model(torch.tensor([[word]], device=device), hidden)
    finally:
        model.train(was_training)
    return words


def words_to_text(words: Sequence[str]) -> str:
    """Words joined by spaces, one line per sentence (``<eos>`` ends a line)."""
    lines, current = [], []
    for word in words:
        if word == EOS:
            lines.append(" ".join(current))
            current = []
        else:
            current.append(word)
    return "\n".join([*lines, " ".join(current)] if current else lines)
