"""Monte-Carlo prediction: ``S`` stochastic passes summarised (mean, entropies, std)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rnndrop.mc.sampling import (
    DEFAULT_MEMORY_BUDGET,
    _copies_drawn_apart,
    _first_input,
    _first_tensor,
    _normalize_dim,
    _plan_chunks,
    _replicate,
    _resolve_method,
    _split_samples,
    mc_dropout,
)
from rnndrop.validation import check_choice, check_positive_int

__all__ = ["TASKS", "MCPrediction", "mc_predict"]

TASKS: tuple[str, ...] = ("classification", "regression")

# Tensors of one sample's output size held at once while a chunk is processed
# (outputs, probabilities, log-probabilities, entropy terms).
_COPIES_PER_SAMPLE = {"classification": 4, "regression": 3}


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
            chosen from ``memory_budget`` after one single-sample probe call, and on the
            CPU at most ``max(1, 128 // B)`` copies of a batch of ``B`` a call and 64 MiB
            (``rnndrop.mc.sampling.CPU_STACKED_ROWS``, ``CPU_CHUNK_BYTES``).
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
    for name, flag in (("return_samples", return_samples), ("strict", strict)):
        if not isinstance(flag, bool):  # a string such as "no" would read as True
            raise TypeError(f"{name} must be True or False, got {flag!r} of type {type(flag).__name__}")
    dims = (("batch_dim", batch_dim, "inputs"), ("output_batch_dim", output_batch_dim, "output"))
    for name, dim, of in dims:
        if (dim is not None or name == "batch_dim") and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"{name} must be an int (the batch dimension of the {of}), got {dim!r} "
                            f"of type {type(dim).__name__}")
    out_dim = batch_dim if output_batch_dim is None else output_batch_dim
    # errors about the output's batch dimension name the argument it came from
    out_name = ("output_batch_dim" if output_batch_dim is not None
                else "batch_dim (the output's batch dimension too: output_batch_dim is not given)")
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    first = _first_input(args)
    if first is None:
        raise TypeError(f"inputs must be a Tensor or hold at least one, got {type(inputs).__name__}")
    batch_size = first.shape[_normalize_dim(batch_dim, first.dim(), "batch_dim")]
    accumulator = _Accumulator(task, return_samples)

    def run(copies: int) -> None:
        out = _first_tensor(model(*_replicate(args, copies, batch_dim)))
        if not (out.is_floating_point() or out.is_complex()):
            raise TypeError(f"the model's output is a {out.dtype} tensor; mc_predict averages "
                            f"task={task!r} outputs, which must be floating point (logits or values, "
                            "not predicted classes)")
        if task == "classification" and out.dim() == 0:
            raise ValueError("task='classification' needs outputs with a class dimension, got a scalar")
        accumulator.add(_split_samples(out, copies, batch_size, out_dim, out_name))

    def probe() -> int:
        run(1)
        return accumulator.mean.numel() * accumulator.mean.element_size() * _COPIES_PER_SAMPLE[task]

    with mc_dropout(model, strict=strict), torch.no_grad():
        resolved = _resolve_method(model, method, first.device)
        with _copies_drawn_apart(model, resolved):
            plan, done = _plan_chunks(resolved, n_samples, chunk_size, memory_budget, probe, first.device,
                                      batch_size)
            for copies in itertools.islice(plan, done, None):
                run(copies)
    return accumulator.result()
