"""Monte-Carlo evaluation of a language model: NLL, perplexity, next-word calibration."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rnndrop.calibration import ReliabilityDiagram, reliability_from_predictions
from rnndrop.mc.sampling import (
    DEFAULT_MEMORY_BUDGET,
    ChunkPlan,
    _copies_drawn_apart,
    _plan_chunks,
    _replicate,
    _resolve_method,
    mc_dropout,
)
from rnndrop.validation import check_positive_int, check_word_ids

__all__ = ["LanguageModelLoss", "mc_language_model_loss", "mc_perplexity"]


#: Beyond this mean NLL (nats per word) the perplexity overflows a float: a divergence.
MAX_NLL = math.log(torch.finfo(torch.float64).max)


def perplexity(nll: float) -> float:
    """``exp(nll)``, infinite where it would overflow (a diverged model's NLL)."""
    return math.exp(nll) if nll < MAX_NLL else math.inf


@dataclass(frozen=True)
class LanguageModelLoss:
    """Negative log-likelihood of a corpus under Monte-Carlo averaged predictions.

    Attributes:
        total_nll: summed over tokens, in nats.
        num_tokens: the number of predicted tokens.
        n_samples: ``S``.
        reliability: with ``calibration_bins``, the next-word reliability diagram of the
            averaged predictions (its ``ece`` is the expected calibration error).
    """

    total_nll: float
    num_tokens: int
    n_samples: int
    reliability: ReliabilityDiagram | None = None

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per token (nats)."""
        return self.total_nll / self.num_tokens

    @property
    def perplexity(self) -> float:
        """``exp(nll)``, infinite where it would overflow."""
        return perplexity(self.nll)


def _check_lm_batch(batch: Any, index: int) -> tuple[Tensor, Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"batches must yield (inputs [T, B], targets [T, B]) pairs, got {type(batch).__name__} "
            f"at batch {index}"
        )
    tokens, targets = batch
    for name, t in (("inputs", tokens), ("targets", targets)):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype not in (torch.long, torch.int32):
            got = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"batch {index}: {name} must be a 2-D int64 or int32 tensor of word ids [T, B], "
                            f"got {got}")
    # Word ids in either type nn.Embedding takes; the targets index as int64.
    targets = targets.long()
    if tokens.shape != targets.shape:
        raise ValueError(
            f"batch {index}: inputs and targets must have the same shape [T, B], got "
            f"{list(tokens.shape)} and {list(targets.shape)}"
        )
    return tokens, targets


def mc_language_model_loss(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    n_samples: int = 100,
    *,
    method: str = "auto",
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    strict: bool = True,
    calibration_bins: int | None = None,
) -> LanguageModelLoss:
    """Monte-Carlo dropout evaluation of a language model: NLL and token count.

    Per token the probability of the target is averaged over the ``S`` samples
    (Gal & Ghahramani 2016), not its log-probability:
    ``log p(y) = logsumexp_s log p_s(y) - log S``.

    Recurrent state and masks: each sample keeps a recurrent state of its own, carried
    from one segment to the next exactly as in deterministic evaluation, while every
    segment call draws fresh masks per sample (the model is called as in training, which
    also draws fresh masks at every truncated-BPTT segment). So sample ``s`` is one
    stochastic network per segment, its state a continuation of its own past; holding
    one mask for the whole corpus would need the model's masks to be passed in from
    outside, which the LM protocol does not offer, and would not match how the model
    was trained.

    Args:
        model: a language model under the LM protocol: ``model(tokens [T, B], hidden)
            -> (logits [T, B, V], hidden)``, time-major, ``hidden=None`` for zeros.
        batches: yields ``(inputs [T, B], targets [T, B])`` int64 / int32 word ids in corpus order,
            on the model's device; iterated once.
        n_samples: ``S``.
        method, chunk_size, memory_budget, strict: as for :func:`mc_predict`; the batch
            is replicated along dim 1. The chunk layout is fixed at the first segment
            and every chunk carries its own state.
        calibration_bins: also bin the top word of every averaged next-word distribution
            against the target (:func:`rnndrop.calibration.reliability_from_predictions`);
            this averages whole distributions ``[T, B, V]`` rather than the targets' alone.

    Returns:
        A :class:`LanguageModelLoss`.
    """
    n_samples = check_positive_int("n_samples", n_samples)
    if chunk_size is not None:
        chunk_size = check_positive_int("chunk_size", chunk_size)
    memory_budget = check_positive_int("memory_budget", memory_budget)
    if calibration_bins is not None:
        check_positive_int("calibration_bins", calibration_bins)
    totals = _Totals(n_samples, calibration_bins)
    with mc_dropout(model, strict=strict), torch.no_grad():
        _resolve_method(model, method)  # a method that cannot serve fails before the first segment
        samples = _SampleChunks(model, n_samples, method, chunk_size, memory_budget, calibration_bins)
        batch_size: int | None = None
        for index, batch in enumerate(batches):
            tokens, targets = _check_lm_batch(batch, index)
            if batch_size is None:
                batch_size = tokens.shape[1]
            elif tokens.shape[1] != batch_size:
                raise ValueError(
                    f"batch {index}: every batch must have the first one's B = {batch_size} "
                    f"sequences (the state is carried across batches), got {tokens.shape[1]}"
                )
            totals.add(samples.log_prob(tokens, targets), targets)
    return totals.result()


class _SampleChunks:
    """The ``S`` samples of a language model in chunks of copies, each chunk carrying its
    own recurrent state from segment to segment. The chunk layout is fixed at the first
    segment (:func:`rnndrop.mc.sampling._plan_chunks`, which may probe one sample)."""

    def __init__(self, model: nn.Module, n_samples: int, method: str, chunk_size: int | None,
                 memory_budget: int, calibration_bins: int | None) -> None:
        # ``method`` as asked; resolved at the first segment, by the device of its tokens
        self.model, self.n_samples, self.method = model, n_samples, method
        self.chunk_size, self.memory_budget = chunk_size, memory_budget
        self.calibration_bins = calibration_bins
        self.plan: ChunkPlan | None = None
        self.states: dict[int, Any] = {}  # the recurrent state of each chunk drawn so far

    def log_prob(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """``log sum_s p_s`` over the ``S`` samples of one segment: of the targets ``[T, B]``,
        or with ``calibration_bins`` of every word ``[T, B, V]``."""
        log_prob: Tensor | None = None
        first = 0
        if self.plan is None:
            self.method = _resolve_method(self.model, self.method, tokens.device)  # asked -> resolved

            def probe() -> int:
                nonlocal log_prob
                log_prob, self.states[0], per_copy = self._run(1, tokens, targets, None)
                return 3 * per_copy  # logits, log-probabilities, gathered values

            self.plan, first = _plan_chunks(self.method, self.n_samples, self.chunk_size, self.memory_budget,
                                            probe, tokens.device, tokens.shape[1])
        for i, copies in enumerate(itertools.islice(self.plan, first, None), start=first):
            chunk_log_prob, self.states[i], _ = self._run(copies, tokens, targets, self.states.get(i))
            log_prob = chunk_log_prob if log_prob is None else torch.logaddexp(log_prob, chunk_log_prob)
        assert log_prob is not None  # the plan holds at least one chunk
        return log_prob

    def _run(self, copies: int, tokens: Tensor, targets: Tensor, hidden: Any) -> tuple[Tensor, Any, int]:
        """``copies`` samples of one segment: log-probabilities summed in probability space
        over the copies (as :meth:`log_prob`), the new state, and the bytes of one copy's logits."""
        with _copies_drawn_apart(self.model, self.method):
            output = self.model(_replicate(tokens, copies, 1), hidden)
        if not (isinstance(output, (tuple, list)) and len(output) == 2):
            raise TypeError(
                "the language model must return (logits [T, B, V], hidden), got "
                f"{type(output).__name__}"
            )
        logits, hidden = output
        T, B = tokens.shape
        if not (isinstance(logits, Tensor) and logits.dim() == 3 and logits.shape[:2] == (T, copies * B)):
            got = list(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
            raise ValueError(
                f"the language model's logits must be [T, B, V] = [{T}, {copies * B}, V], got {got}"
            )
        check_word_ids("targets", targets, logits.shape[-1])  # else a bare gather error
        per_copy = logits.numel() * logits.element_size() // copies
        logp = logits.log_softmax(-1)
        if self.calibration_bins is not None:
            return logp.view(T, copies, B, -1).logsumexp(1), hidden, per_copy
        logp = logp.gather(-1, _replicate(targets, copies, 1).unsqueeze(-1))
        return logp.view(T, copies, B).logsumexp(1), hidden, per_copy


class _Totals:
    """The NLL summed over the segments, and with ``calibration_bins`` the confidence and
    correctness of every averaged next-word prediction."""

    def __init__(self, n_samples: int, calibration_bins: int | None) -> None:
        self.n_samples, self.log_s, self.calibration_bins = n_samples, math.log(n_samples), calibration_bins
        self.segment_nlls: list[Tensor] = []  # read once in result(): a read per segment waits for the GPU
        self.num_tokens = 0
        self.confidences: list[Tensor] = []
        self.correct: list[Tensor] = []

    def add(self, log_prob: Tensor, targets: Tensor) -> None:
        """Add one segment: ``log_prob`` from :meth:`_SampleChunks.log_prob`, ``targets [T, B]``."""
        if self.calibration_bins is not None:
            top_log_prob, top_word = log_prob.max(-1)
            # A mean of probabilities is at most 1; the logsumexp over samples can round a
            # near-certain word's to 1 + 1 ulp, which the reliability diagram would refuse.
            self.confidences.append((top_log_prob - self.log_s).exp().clamp_(max=1.0))
            self.correct.append(top_word == targets)
            log_prob = log_prob.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        self.segment_nlls.append((log_prob.double() - self.log_s).sum())
        self.num_tokens += targets.numel()

    def result(self) -> LanguageModelLoss:
        if self.num_tokens == 0:
            raise ValueError("batches must yield at least one (inputs, targets) pair, got none")
        reliability = None
        if self.calibration_bins is not None:
            reliability = reliability_from_predictions(
                torch.cat(self.confidences), torch.cat(self.correct), self.calibration_bins
            )
        total_nll = -sum(torch.stack(self.segment_nlls).tolist()) if self.segment_nlls else 0.0  # in order
        return LanguageModelLoss(total_nll, self.num_tokens, self.n_samples, reliability)


def mc_perplexity(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    n_samples: int = 100,
    **kwargs: Any,
) -> float:
    """Perplexity of a language model under Monte-Carlo dropout: ``exp(mean NLL)``.

    See :func:`mc_language_model_loss` for the arguments and how masks and states
    behave across truncated-BPTT segments.
    """
    return mc_language_model_loss(model, batches, n_samples, **kwargs).perplexity
