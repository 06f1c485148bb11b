"""Using a language model: scoring it (NLL, perplexity, next-word calibration, standard or
Monte-Carlo) and sampling text from it.

``score`` runs the model in eval mode (dropout off: the weight-scaling approximation);
``score_mc`` keeps dropout on and averages every word's probability over ``S`` draws
(:func:`rnndrop.mc.mc_language_model_loss`). Both carry the recurrent state across the
truncated-BPTT segments of a batched stream ``[N, B]`` and return a :class:`Score`.
``score_split`` scores a whole split under DistributedDataParallel: each rank scores its
share of the streams and the sums are added over the ranks.

``generate(model, vocab, prompt, n_words)`` feeds the prompt, then draws one word at a
time from ``softmax(logits / temperature)`` (optionally cut to the ``top_k`` likeliest words,
or to the nucleus of probability ``top_p``) and feeds it back, carrying the recurrent
state; dropout is off (eval mode).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rnndrop.calibration import ReliabilityDiagram, reliability_from_predictions
from rnndrop.lm.data.corpus import EOS, Vocabulary, bptt_batches, check_words
from rnndrop.lm.run.process_group import Distributed, all_reduce_reliability, all_reduce_sums, shard_columns
from rnndrop.lm.run.report import EpochProgress
from rnndrop.mc import mc_language_model_loss, sampling_modules
from rnndrop.mc.language_model import MAX_NLL, perplexity

__all__ = [
    "CALIBRATION_BINS",
    "MAX_NLL",
    "MC_PROGRESS",
    "MC_UNIT",
    "Score",
    "check_sampling",
    "evaluate",
    "evaluate_mc",
    "generate",
    "has_noise",
    "mc_seconds",
    "perplexity",
    "score",
    "score_mc",
    "score_split",
    "score_sums",
    "token_loss",
    "truncated",
    "words_to_text",
]

#: how the Monte-Carlo passes over a split are labelled in bars and log lines
#: (``MC_PROGRESS.format(split=..., samples=...)``), and what they count: the truncated-BPTT
#: segments of the split, each scored with every sample
MC_PROGRESS = "MC {split}, {samples} samples"
MC_UNIT = "segments"

#: Confidence bins of the next-word calibration measured on the test split.
CALIBRATION_BINS = 15

def token_loss(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``logits [T, B, V]`` against ``targets [T, B]`` (mean or sum over tokens)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


@dataclass(frozen=True)
class Score:
    """How well a language model predicts a token stream.

    Attributes:
        nll: mean negative log-likelihood per token (nats); perplexity is ``exp(nll)``.
        tokens: the number of predicted tokens.
        ece: expected calibration error of the top next-word prediction
            (:mod:`rnndrop.calibration`), or None when not measured.
    """

    nll: float
    tokens: int
    ece: float | None = None

    @property
    def perplexity(self) -> float:
        return perplexity(self.nll)


def score(model: nn.Module, batched: Tensor, bptt: int, calibration_bins: int | None = None) -> Score:
    """NLL (and with ``calibration_bins`` the ECE) of ``model`` in eval mode (dropout off:
    the weight-scaling approximation) on a batched stream ``[N, B]``, the state carried
    across segments."""
    total, count, diagram = score_sums(model, batched, bptt, calibration_bins)
    if not count:
        raise ValueError(f"batched must hold at least 2 rows (inputs and the targets one row ahead), "
                         f"got shape {list(batched.shape)}: no word to predict")
    return Score(total / count, count, None if diagram is None else diagram.ece)


@torch.no_grad()
def score_sums(
    model: nn.Module, batched: Tensor, bptt: int, calibration_bins: int | None
) -> tuple[float, int, ReliabilityDiagram | None]:
    """:func:`score` as sums: (summed NLL, tokens, reliability diagram or None)."""
    was_training = model.training
    model.eval()
    count, hidden = 0, None
    losses: list[Tensor] = []  # read once at the end: a read per segment would wait for the GPU
    confidences: list[Tensor] = []
    correct: list[Tensor] = []
    try:
        for inputs, targets in bptt_batches(batched, bptt):
            logits, hidden = model(inputs, hidden)
            losses.append(token_loss(logits, targets, "sum"))
            count += targets.numel()
            if calibration_bins is not None:
                top_prob, top_word = logits.softmax(-1).max(-1)
                confidences.append(top_prob)
                correct.append(top_word == targets)
    finally:
        model.train(was_training)
    total = sum(torch.stack(losses).tolist()) if losses else 0.0  # summed in order, as floats
    diagram = None
    if calibration_bins is not None:
        diagram = reliability_from_predictions(torch.cat(confidences), torch.cat(correct), calibration_bins)
    return total, count, diagram


def score_split(
    model: nn.Module, batched: Tensor, bptt: int, calibration_bins: int | None, ctx: Distributed,
    mc_samples: int = 0, *, progress: str | None = None, bar: bool = False,
) -> Score:
    """:func:`score` (or with ``mc_samples`` :func:`score_mc`, shown under ``progress`` as
    there) of a whole split: each rank scores its share of the streams and the sums are
    added over the ranks (rank 0 alone shows progress)."""
    if not ctx.enabled:
        if mc_samples:
            return score_mc(model, batched, bptt, mc_samples, calibration_bins, progress=progress, bar=bar)
        return score(model, batched, bptt, calibration_bins)
    shard = shard_columns(batched, ctx.rank, ctx.world_size)
    if mc_samples:
        segments = _shown(list(bptt_batches(shard, bptt)), progress if ctx.is_main else None, bar)
        loss = mc_language_model_loss(model, segments, mc_samples, calibration_bins=calibration_bins)
        total, count, diagram = loss.total_nll, loss.num_tokens, loss.reliability
    else:
        total, count, diagram = score_sums(model, shard, bptt, calibration_bins)
    total, count = all_reduce_sums([total, count], ctx)
    ece = None if diagram is None else all_reduce_reliability(diagram, ctx).ece
    return Score(total / count, round(count), ece)


def score_mc(
    model: nn.Module, batched: Tensor, bptt: int, n_samples: int, calibration_bins: int | None = None,
    *, progress: str | None = None, bar: bool = False,
) -> Score:
    """:func:`score` under Monte-Carlo dropout (:func:`rnndrop.mc.mc_language_model_loss`):
    every word's predictive probability averaged over ``n_samples`` dropout draws.

    ``progress``: show the passes under this label, a tqdm bar on a terminal when ``bar``,
    else a log line every tenth of the split (None: nothing shown).
    """
    segments = _shown(list(bptt_batches(batched, bptt)), progress, bar)
    loss = mc_language_model_loss(model, segments, n_samples, calibration_bins=calibration_bins)
    return Score(loss.nll, loss.num_tokens, None if loss.reliability is None else loss.reliability.ece)


def mc_seconds(model: nn.Module, batched: Tensor, bptt: int, n_samples: int,
               calibration_bins: int | None = CALIBRATION_BINS) -> float:
    """About how long :func:`score_mc` of ``n_samples`` samples takes on ``batched``: its first
    segment scored with up to 8 samples (the median of three timings), scaled to the whole
    stream and every sample
    (the Monte-Carlo code itself, so its cost over a plain forward is counted). It draws
    dropout noise: seed the generator after it."""
    segments = list(bptt_batches(batched, bptt))
    if not segments or n_samples < 1:
        return 0.0
    samples = min(n_samples, 8)
    times = []
    for _ in range(3):  # the median: one busy moment of a shared machine does not count
        start = time.perf_counter()
        mc_language_model_loss(model, segments[:1], samples, calibration_bins=calibration_bins)
        times.append(time.perf_counter() - start)
    seconds = sorted(times)[1]
    words = sum(targets.numel() for _, targets in segments)
    return seconds * n_samples / samples * words / segments[0][1].numel()


def _shown(
    segments: list[tuple[Tensor, Tensor]], label: str | None, bar: bool
) -> Iterator[tuple[Tensor, Tensor]]:
    """``segments`` again, counted on an :class:`EpochProgress` named ``label`` as they are used."""
    if label is None:
        yield from segments
        return
    shown = EpochProgress(len(segments), label, True, bar=bar, unit=MC_UNIT)
    try:
        for segment in segments:
            yield segment
            shown.update()
    finally:
        shown.close()


def evaluate(model: nn.Module, batched: Tensor, bptt: int) -> float:
    """Perplexity of ``model`` in eval mode on a batched stream ``[N, B]`` (see :func:`score`)."""
    return score(model, batched, bptt).perplexity


def evaluate_mc(model: nn.Module, batched: Tensor, bptt: int, n_samples: int) -> float:
    """Perplexity under Monte-Carlo dropout with ``n_samples`` draws (see :func:`score_mc`)."""
    return score_mc(model, batched, bptt, n_samples).perplexity


def has_noise(model: nn.Module) -> bool:
    """Whether any module of ``model`` samples noise (a Monte-Carlo evaluation is possible)."""
    return bool(sampling_modules(model))


# -- sampling text ---------------------------------------------------------------------------------

@torch.no_grad()
def generate(
    model: nn.Module,
    vocab: Vocabulary,
    prompt: Sequence[str] = (),
    n_words: int = 50,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> list[str]:
    """``n_words`` words sampled after ``prompt`` (words the vocabulary lacks become
    ``<unk>``; an empty prompt starts after ``<eos>``, i.e. at a sentence start).

    Args:
        model: a language model of the :mod:`rnndrop.lm` protocol (``[T, B]`` ids in,
            ``([T, B, V]`` logits, hidden) out).
        vocab: its vocabulary.
        temperature: > 0; below 1 favours likely words, above 1 flattens the distribution.
        top_k: draw among the ``top_k`` likeliest words only (None: all).
        top_p: nucleus sampling: draw among the fewest likeliest words whose probabilities
            (after the temperature) add up to ``top_p`` or more, in (0, 1] (None or 1: all).
            With ``top_k`` too, the nucleus is taken within the ``top_k`` words.
        generator: for reproducible samples.
    """
    check_words("prompt", prompt)
    if isinstance(n_words, bool) or not isinstance(n_words, int) or n_words < 0:
        raise ValueError(f"n_words must be an int >= 0, got {n_words!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    check_sampling(top_k, top_p)
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
            word = int(torch.multinomial(truncated(probs, top_k, top_p), 1, generator=generator))
            words.append(vocab.itos[word])
            logits, hidden = model(torch.tensor([[word]], device=device), hidden)
    finally:
        model.train(was_training)
    return words


def check_sampling(top_k: int | None, top_p: float | None) -> None:
    """ValueError unless ``top_k`` is None or an int >= 1 and ``top_p`` None or in (0, 1]."""
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 (or None: all words), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] (or None: all words), got {top_p!r}")


def truncated(probs: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """``probs`` (one distribution, summing to 1) with every word outside the ``top_k``
    likeliest, and outside the nucleus of ``top_p`` (the fewest likeliest words whose
    probabilities add up to ``top_p`` or more), set to 0; the likeliest word always stays.
    Not renormalised (``torch.multinomial`` needs no normalisation)."""
    if top_k is None and (top_p is None or top_p >= 1):
        return probs
    order = probs.argsort(descending=True, stable=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k is not None and top_k < probs.numel():
        keep[order[top_k:]] = False
    if top_p is not None and top_p < 1:
        ranked = probs[order] * keep[order]
        before = ranked.cumsum(0) - ranked  # probability of the likelier words
        # within the sum's rounding of the target counts as reaching it (p 0.8 of ten equal words:
        # eight, where the eight summed to 0.7999...)
        reached = top_p * ranked.sum() * (1 - torch.finfo(ranked.dtype).eps * ranked.numel())
        keep[order[before >= reached]] = False
    return probs * keep


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
