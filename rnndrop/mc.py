"""Monte-Carlo dropout: predict with dropout kept on and average the samples.

A network trained with tied dropout is an approximate Bayesian model (Gal &
Ghahramani 2016): every dropout mask is a draw of the weights from the
approximate posterior. Keeping dropout on at test time and averaging ``S``
stochastic forward passes estimates the predictive distribution::

    result = mc_predict(model, inputs, n_samples=100)   # result.mean, result.mutual_information
    ppl = mc_perplexity(language_model, bptt_batches(test, 35), n_samples=100)

Which modules sample: every :class:`rnndrop.stochastic.Stochastic` whose
``is_stochastic()`` is True (the variational layers, embedding, locked and weight
dropout) and every ``nn.Dropout`` sibling (``torch.nn.modules.dropout._DropoutNd``:
Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout) with ``p > 0``. All
other modules stay in eval mode (BatchNorm keeps its running statistics), and so do
the children of a sampling module unless they sample themselves. ``nn.LSTM``'s own
``dropout`` argument is *not* switched on: it is not a module of its own and draws
fresh, untied masks at every step; use :class:`rnndrop.VariationalLSTM`.

Sampling strategies (``method``):

``"batched"``  the batch is replicated ``k`` times along its batch dimension and run
               in one forward call, ``k`` bounded by ``chunk_size`` or a memory budget.
               Masks are drawn per sequence, so every copy gets masks of its own.
``"loop"``     one forward call per sample.
``"auto"``     batched, unless a sampling module shares its noise across the batch
               (a recurrent mask with ``mask_scope="batch"``, an embedding dropout with
               ``scope="batch"``, a weight-dropped layer): copies in one batch would
               then share one draw and the samples would not be independent, so it loops.

The same holds for sampled weights (``SparseLSTM``, ``SparseGRU``, ``SparseEmbedding``,
``SparseLinear(local_reparameterization=False)``). Every module says so itself through
:meth:`rnndrop.stochastic.Stochastic.shares_noise_across_batch`.

All randomness comes from torch's global generator: seed it with ``torch.manual_seed``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd

from rnndrop.calibration import ReliabilityDiagram, reliability_from_predictions
from rnndrop.stochastic import Stochastic
from rnndrop.validation import check_choice, check_positive_int

__all__ = [
    "LanguageModelLoss",
    "MCPrediction",
    "mc_dropout",
    "mc_language_model_loss",
    "mc_perplexity",
    "mc_predict",
    "sampling_modules",
]

logger = logging.getLogger(__name__)

TASKS: tuple[str, ...] = ("classification", "regression")
METHODS: tuple[str, ...] = ("auto", "batched", "loop")

#: Default bound on the memory of one batched chunk's outputs and their derived tensors.
DEFAULT_MEMORY_BUDGET = 1 << 28

# Tensors of one sample's output size held at once while a chunk is processed
# (outputs, probabilities, log-probabilities, entropy terms).
_COPIES_PER_SAMPLE = {"classification": 4, "regression": 3}


# ------------------------------------------------------------------ modules


def _is_sampling(module: nn.Module) -> bool:
    if isinstance(module, Stochastic):
        return bool(module.is_stochastic())
    return isinstance(module, _DropoutNd) and module.p > 0


def sampling_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) that :func:`mc_dropout` switches on."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return [m for m in model.modules() if _is_sampling(m)]


def _shares_noise_across_batch(module: nn.Module) -> bool:
    return isinstance(module, Stochastic) and module.shares_noise_across_batch()


@contextmanager
def mc_dropout(model: nn.Module, *, strict: bool = True) -> Iterator[nn.Module]:
    """Context under which only the sampling modules of ``model`` are in training mode.

    On entry every module goes to eval mode and each sampling module (see the module
    docstring) to training mode, that module alone: its children keep eval mode
    unless they sample too. On exit, also after an exception, every module gets back
    the mode it had. Gradients are not touched: wrap the call in ``torch.no_grad()``
    for inference.

    Args:
        model: any ``nn.Module``.
        strict: raise a ValueError when ``model`` holds no module that would sample
            (every dropout probability 0): Monte-Carlo prediction would then repeat
            the deterministic prediction. ``strict=False`` allows it (a p = 0 baseline
            through the same code path).

    Yields:
        ``model``.
    """
    samplers = sampling_modules(model)
    if strict and not samplers:
        raise ValueError(
            f"mc_dropout: model ({type(model).__name__}) has no stochastic module with p > 0 "
            "(an rnndrop Stochastic module whose is_stochastic() is True, or an nn.Dropout "
            "with p > 0); Monte-Carlo samples would all equal the eval prediction. "
            "Pass strict=False to allow it."
        )
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        for m in samplers:
            m.training = True
        yield model
    finally:
        for m, mode in modes:
            m.training = mode


# ------------------------------------------------------------------ batching


def _normalize_dim(dim: int, ndim: int, name: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a tensor with {ndim} dimensions")
    return dim % ndim


def _replicate(obj: Any, copies: int, batch_dim: int) -> Any:
    """Tile every tensor in ``obj`` (nested tuples/lists) ``copies`` times along ``batch_dim``.

    Row ``s * B + b`` of the result is row ``b`` of copy ``s``.
    """
    if isinstance(obj, Tensor):
        if copies == 1:
            return obj
        d = _normalize_dim(batch_dim, obj.dim(), "batch_dim")
        reps = [1] * obj.dim()
        reps[d] = copies
        return obj.repeat(*reps)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(_replicate(x, copies, batch_dim) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_replicate(x, copies, batch_dim) for x in obj)
    if isinstance(obj, torch.nn.utils.rnn.PackedSequence):
        raise TypeError("inputs must not hold a PackedSequence: pad it, or use method='loop'")
    return obj


def _first_tensor(output: Any) -> Tensor:
    """The prediction in a model's output: the output itself or its first element."""
    while isinstance(output, (tuple, list)) and len(output) > 0:
        output = output[0]
    if not isinstance(output, Tensor):
        raise TypeError(
            "the model must return a Tensor or a tuple whose first element is one, "
            f"got {type(output).__name__}"
        )
    return output


def _batch_size(obj: Any, batch_dim: int) -> int | None:
    """Size along ``batch_dim`` of the first tensor in ``obj`` (nested tuples/lists)."""
    if isinstance(obj, Tensor):
        return obj.shape[_normalize_dim(batch_dim, obj.dim(), "batch_dim")]
    if isinstance(obj, (tuple, list)):
        for x in obj:
            size = _batch_size(x, batch_dim)
            if size is not None:
                return size
    return None


def _split_samples(out: Tensor, copies: int, batch_size: int, batch_dim: int) -> Tensor:
    """``[..., copies * B, ...]`` (copies along ``batch_dim``) -> ``[copies, ..., B, ...]``."""
    d = _normalize_dim(batch_dim, out.dim(), "output_batch_dim")
    if out.shape[d] != copies * batch_size:
        raise ValueError(
            f"the model's output has size {out.shape[d]} along output_batch_dim={batch_dim} "
            f"for {copies} copies of a batch of {batch_size}, expected {copies * batch_size}; "
            "set batch_dim / output_batch_dim to the batch dimension of inputs / outputs"
        )
    return out.unflatten(d, (copies, batch_size)).movedim(d, 0)


def _resolve_method(model: nn.Module, method: str) -> str:
    check_choice("method", method, METHODS)
    shared = [type(m).__name__ for m in sampling_modules(model) if _shares_noise_across_batch(m)]
    if method == "batched" and shared:
        raise ValueError(
            f"method='batched' cannot draw independent samples: {', '.join(sorted(set(shared)))} "
            "share(s) one noise draw across the batch; use method='loop' or 'auto'"
        )
    if method == "auto":
        if shared:
            logger.debug("mc: looping over samples because %s share noise across the batch", shared)
        return "loop" if shared else "batched"
    return method


def _chunks(n_samples: int, chunk_size: int) -> list[int]:
    full, rest = divmod(n_samples, chunk_size)
    return [chunk_size] * full + ([rest] if rest else [])


def _plan_chunks(
    method: str, n_samples: int, chunk_size: int | None, memory_budget: int, probe: Callable[[], int]
) -> tuple[list[int], int]:
    """How many samples each forward call takes, and how many calls the probe already made.

    ``method`` is resolved (``"loop"`` or ``"batched"``). Batched without ``chunk_size``:
    ``probe()`` runs one single-sample call and returns the bytes one sample needs;
    the remaining samples then go in chunks that fit ``memory_budget``.
    """
    if method == "loop":
        return [1] * n_samples, 0
    if chunk_size is not None:
        return _chunks(n_samples, chunk_size), 0
    bytes_per_sample = probe()
    remaining = n_samples - 1
    if not remaining:
        return [1], 1
    size = max(1, min(remaining, memory_budget // max(1, bytes_per_sample)))
    return [1, *_chunks(remaining, size)], 1


# ------------------------------------------------------------------ prediction


@dataclass(frozen=True)
class MCPrediction:
    """Summary of ``n_samples`` stochastic forward passes.

    Shapes refer to one deterministic output ``[*out]`` (for classification the last
    dimension holds the ``C`` class logits, ``[*out] = [*lead, C]``).

    Attributes:
        mean: classification: mean predicted probabilities ``[*lead, C]``;
            regression: mean output ``[*out]``.
        n_samples: ``S``.
        std: regression only: standard deviation over samples ``[*out]`` (divided by
            ``S``, not ``S - 1``, so it is 0 for ``S = 1``). This is the model
            (epistemic) part; add observation noise yourself if your model has one.
        predictive_entropy: classification only: ``H[mean]`` in nats, ``[*lead]``.
        expected_entropy: classification only: mean over samples of each sample's
            entropy (the aleatoric part), ``[*lead]``.
        mutual_information: classification only: ``predictive_entropy -
            expected_entropy`` (the epistemic part, BALD), clamped at 0, ``[*lead]``.
        samples: with ``return_samples=True``: the raw outputs (logits for
            classification) ``[S, *out]``; else None.
    """

    mean: Tensor
    n_samples: int
    std: Tensor | None = None
    predictive_entropy: Tensor | None = None
    expected_entropy: Tensor | None = None
    mutual_information: Tensor | None = None
    samples: Tensor | None = None


def _entropy(probs: Tensor) -> Tensor:
    return -torch.special.xlogy(probs, probs).sum(-1)


class _Accumulator:
    """Running statistics over sample chunks ``[k, *out]``; keeps no samples unless asked."""

    def __init__(self, task: str, keep_samples: bool) -> None:
        self.task = task
        self.count = 0
        self.mean: Tensor | None = None  # probabilities or outputs
        self.m2: Tensor | None = None  # regression: sum of squared deviations (Chan et al.)
        self.entropy_sum: Tensor | None = None
        self.samples: list[Tensor] | None = [] if keep_samples else None

    def add(self, chunk: Tensor) -> None:
        k = chunk.shape[0]
        if self.samples is not None:
            self.samples.append(chunk)
        if self.task == "classification":
            probs = chunk.softmax(-1)
            entropy = _entropy(probs).sum(0)
            total = probs.sum(0)
            if self.mean is None:
                self.mean, self.entropy_sum = total, entropy
            else:
                self.mean += total
                self.entropy_sum += entropy
            self.count += k
            return
        chunk_mean = chunk.mean(0)
        chunk_m2 = (chunk - chunk_mean).square().sum(0)
        if self.mean is None:
            self.mean, self.m2 = chunk_mean, chunk_m2
        else:
            n = self.count + k
            delta = chunk_mean - self.mean
            self.mean = self.mean + delta * (k / n)
            self.m2 = self.m2 + chunk_m2 + delta.square() * (self.count * k / n)
        self.count += k

    def result(self) -> MCPrediction:
        samples = torch.cat(self.samples) if self.samples is not None else None
        if self.task == "regression":
            std = (self.m2 / self.count).sqrt()
            return MCPrediction(self.mean, self.count, std=std, samples=samples)
        mean = self.mean / self.count
        predictive = _entropy(mean)
        expected = self.entropy_sum / self.count
        return MCPrediction(
            mean,
            self.count,
            predictive_entropy=predictive,
            expected_entropy=expected,
            mutual_information=(predictive - expected).clamp_min(0),
            samples=samples,
        )


def mc_predict(
    model: nn.Module,
    inputs: Any,
    n_samples: int = 100,
    *,
    task: str = "classification",
    batch_dim: int = 0,
    output_batch_dim: int | None = None,
    method: str = "auto",
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    return_samples: bool = False,
    strict: bool = True,
) -> MCPrediction:
    """Monte-Carlo dropout prediction: ``n_samples`` stochastic passes, summarised.

    Runs under :func:`mc_dropout` and ``torch.no_grad()``; the model's modes are
    restored afterwards. Each sample has its own masks, tied over time as in training.

    Args:
        model: any ``nn.Module`` with rnndrop modules or ``nn.Dropout`` inside.
        inputs: a Tensor, or a tuple/list of positional arguments for ``model``.
            Every tensor in it (nested tuples/lists included, e.g. an LSTM state
            ``(h, c)``) must have the batch on ``batch_dim``; other values are
            passed unchanged.
        n_samples: ``S``, the number of stochastic passes.
        task: ``"classification"`` (outputs are logits, classes on the last
            dimension; next-token prediction is classification) or ``"regression"``.
        batch_dim: the batch dimension of the input tensors (0 for batch-first
            models, 1 for time-major ones such as ``[T, B]`` token batches).
        output_batch_dim: the batch dimension of the output; defaults to ``batch_dim``.
            If the model returns a tuple (e.g. ``(logits, hidden)``), the first
            element is the prediction.
        method: ``"auto"``, ``"batched"`` or ``"loop"`` (see the module docstring).
        chunk_size: batched: at most this many samples per forward call. None:
            chosen from ``memory_budget`` after one single-sample probe call.
        memory_budget: bytes allowed for one chunk's outputs and the tensors derived
            from them (probabilities, entropies). Activations inside the model are
            not counted; for models whose outputs are small next to their hidden
            activations, give ``chunk_size`` instead.
        return_samples: keep the raw outputs of every sample (``S`` times the output
            memory) in ``MCPrediction.samples``.
        strict: passed to :func:`mc_dropout` (raise when nothing samples).

    Returns:
        An :class:`MCPrediction`.
    """
    n_samples = check_positive_int("n_samples", n_samples)
    check_choice("task", task, TASKS)
    if chunk_size is not None:
        chunk_size = check_positive_int("chunk_size", chunk_size)
    memory_budget = check_positive_int("memory_budget", memory_budget)
    out_dim = batch_dim if output_batch_dim is None else output_batch_dim
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    batch_size = _batch_size(args, batch_dim)
    if batch_size is None:
        raise TypeError(f"inputs must be a Tensor or hold at least one, got {type(inputs).__name__}")
    accumulator = _Accumulator(task, return_samples)

    def run(copies: int) -> None:
        out = _first_tensor(model(*_replicate(args, copies, batch_dim)))
        if task == "classification" and out.dim() == 0:
            raise ValueError("task='classification' needs outputs with a class dimension, got a scalar")
        accumulator.add(_split_samples(out, copies, batch_size, out_dim))

    def probe() -> int:
        run(1)
        return accumulator.mean.numel() * accumulator.mean.element_size() * _COPIES_PER_SAMPLE[task]

    with mc_dropout(model, strict=strict), torch.no_grad():
        plan, done = _plan_chunks(_resolve_method(model, method), n_samples, chunk_size, memory_budget, probe)
        for copies in plan[done:]:
            run(copies)
    return accumulator.result()


# ------------------------------------------------------------------ language models


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
        """``exp(nll)``."""
        return math.exp(self.nll)


def _check_lm_batch(batch: Any, index: int) -> tuple[Tensor, Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"batches must yield (inputs [T, B], targets [T, B]) pairs, got {type(batch).__name__} "
            f"at batch {index}"
        )
    tokens, targets = batch
    for name, t in (("inputs", tokens), ("targets", targets)):
        if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype != torch.long:
            got = f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"batch {index}: {name} must be a 2-D LongTensor [T, B], got {got}")
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
        batches: yields ``(inputs [T, B], targets [T, B])`` LongTensors in corpus order,
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
    total_nll = 0.0
    num_tokens = 0
    plan: list[int] | None = None
    states: list[Any] = []
    log_s = math.log(n_samples)
    confidences: list[Tensor] = []
    correct: list[Tensor] = []

    def run(copies: int, tokens: Tensor, targets: Tensor, hidden: Any) -> tuple[Tensor, Any, int]:
        """``copies`` samples of one segment: log-probabilities summed in probability space
        over the copies (of the targets ``[T, B]``, or with ``calibration_bins`` of every word
        ``[T, B, V]``), the new state, and the bytes of one copy's logits."""
        output = model(_replicate(tokens, copies, 1), hidden)
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
        per_copy = logits.numel() * logits.element_size() // copies
        logp = logits.log_softmax(-1)
        if calibration_bins is not None:
            return logp.view(T, copies, B, -1).logsumexp(1), hidden, per_copy
        logp = logp.gather(-1, _replicate(targets, copies, 1).unsqueeze(-1))
        return logp.view(T, copies, B).logsumexp(1), hidden, per_copy

    with mc_dropout(model, strict=strict), torch.no_grad():
        resolved = _resolve_method(model, method)
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
            log_prob: Tensor | None = None
            first = 0
            if plan is None:

                def probe(tokens: Tensor = tokens, targets: Tensor = targets) -> int:
                    nonlocal log_prob
                    log_prob, state, per_copy = run(1, tokens, targets, None)
                    states.append(state)
                    return 3 * per_copy  # logits, log-probabilities, gathered values

                plan, first = _plan_chunks(resolved, n_samples, chunk_size, memory_budget, probe)
                states.extend([None] * (len(plan) - len(states)))
            for i in range(first, len(plan)):
                chunk_log_prob, states[i], _ = run(plan[i], tokens, targets, states[i])
                log_prob = chunk_log_prob if log_prob is None else torch.logaddexp(log_prob, chunk_log_prob)
            if calibration_bins is not None:
                top_log_prob, top_word = log_prob.max(-1)
                confidences.append((top_log_prob - log_s).exp())
                correct.append(top_word == targets)
                log_prob = log_prob.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            total_nll -= (log_prob.double() - log_s).sum().item()
            num_tokens += targets.numel()
    if num_tokens == 0:
        raise ValueError("batches must yield at least one (inputs, targets) pair, got none")
    reliability = None
    if calibration_bins is not None:
        reliability = reliability_from_predictions(
            torch.cat(confidences), torch.cat(correct), calibration_bins
        )
    return LanguageModelLoss(total_nll, num_tokens, n_samples, reliability)


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
