"""Monte-Carlo prediction: ``S`` stochastic passes summarised (mean, entropies, std)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnndrop.mc.sampling import (
    DEFAULT_MEMORY_BUDGET,
    _copies_drawn_apart,
    _first_input,
    _first_tensor,
    _holds_packed,
    _normalize_dim,
    _numbers_as_long_as,
    _plan_chunks,
    _replicate,
    _resolve_method,
    _split_samples,
    mc_dropout,
)
from rnndrop.validation import check_bool, check_choice, check_positive_int

__all__ = ["TASKS", "MCPrediction", "mc_predict"]

TASKS: tuple[str, ...] = ("classification", "regression")

# Tensors of one sample's output size held at once while a chunk is processed
# (outputs, probabilities, log-probabilities, entropy terms).
_COPIES_PER_SAMPLE = {"classification": 4, "regression": 3}


@dataclass(frozen=True)
class MCPrediction:
    """Summary of ``n_samples`` stochastic forward passes.

    Shapes refer to one deterministic output ``[*out]`` (for classification the last
    dimension holds the ``C`` class logits, ``[*out] = [*lead, C]``). The statistics are
    computed in float32 for bfloat16 / float16 outputs (autocast), else in the outputs' dtype.

    Attributes:
        mean: classification: mean predicted probabilities ``[*lead, C]``;
            regression: mean output ``[*out]``.
        n_samples: ``S``.
        std: regression only: standard deviation over samples ``[*out]`` (divided by
            ``S``, not ``S - 1``, so it is 0 for ``S = 1``; of complex outputs the real
            ``sqrt(mean |z - mean|^2)``). This is the model
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


def _squared_magnitude(deviation: Tensor) -> Tensor:
    """``|d|^2``: a complex output's spread is real (``std = sqrt(E |z - mean|^2)``)."""
    return deviation.abs().square() if deviation.is_complex() else deviation.square()


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
        # Sums over thousands of samples in bfloat16 / float16 (autocast) lose whole digits.
        chunk = chunk.to(torch.promote_types(chunk.dtype, torch.float32))
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
        chunk_m2 = _squared_magnitude(chunk - chunk_mean).sum(0)
        if self.mean is None:
            self.mean, self.m2 = chunk_mean, chunk_m2
        else:
            n = self.count + k
            delta = chunk_mean - self.mean
            self.mean = self.mean + delta * (k / n)
            self.m2 = self.m2 + chunk_m2 + _squared_magnitude(delta) * (self.count * k / n)
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
    batch_dim: int | Sequence[int | None] = 0,
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
        inputs: a Tensor or a PackedSequence, or a tuple/list of positional arguments for
            ``model``. Every tensor in it (nested tuples/lists included, e.g. an LSTM state
            ``(h, c)``) must have the batch on its argument's ``batch_dim``; other values
            are passed unchanged (give per-sequence lengths as a tensor, not a list).
        n_samples: ``S``, the number of stochastic passes.
        task: ``"classification"`` (outputs are logits, classes on the last dimension,
            at least two of them; next-token prediction is classification) or
            ``"regression"``.
        batch_dim: the batch dimension of the input tensors (0 for batch-first
            models, 1 for time-major ones such as ``[T, B]`` token batches); or one entry
            per positional argument, e.g. ``(1, 0)`` for ``model(x [T, B, F], lengths [B])``
            or ``(0, 1)`` for ``model(x [B, T, F], (h0, c0) [L, B, H])``, None for an
            argument the batch does not split (a constant).
        output_batch_dim: the batch dimension of the output; defaults to ``batch_dim``
            (its first entry that is not None). If the model returns a tuple (e.g.
            ``(logits, hidden)``), the first element is the prediction. With a
            PackedSequence input the output may also be per word (``output.data``): its
            batch dimension is then not checked.
        method: ``"auto"``, ``"batched"`` or ``"loop"`` (see the module docstring); a
            PackedSequence is never stacked (``"auto"`` loops).
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
    check_bool("return_samples", return_samples)  # a string such as "no" would read as True
    check_bool("strict", strict)
    single = not isinstance(inputs, (tuple, list)) or isinstance(inputs, PackedSequence)
    args = (inputs,) if single else tuple(inputs)
    dims = _argument_batch_dims(batch_dim, len(args))
    if output_batch_dim is not None and not _is_int(output_batch_dim):
        raise TypeError("output_batch_dim must be an int (the batch dimension of the output), got "
                        f"{output_batch_dim!r} of type {type(output_batch_dim).__name__}")
    batched_args = [(i, d) for i, d in enumerate(dims) if d is not None]
    first_index, first_dim = next(
        ((i, d) for i, d in batched_args if _first_input(args[i]) is not None), (None, None))
    if first_index is None or first_dim is None:
        raise TypeError(f"inputs must be a Tensor or hold at least one (in an argument batch_dim does not "
                        f"set to None), got {type(inputs).__name__}")
    out_dim = first_dim if output_batch_dim is None else output_batch_dim
    # errors about the output's batch dimension name the argument it came from
    out_name = "batch_dim" if output_batch_dim is None else "output_batch_dim"
    out_note = ("" if output_batch_dim is not None
                else " (the output's batch dimension: output_batch_dim is not given)")
    packed = _holds_packed(args)
    first = _first_input(args[first_index])
    assert first is not None
    if isinstance(first, PackedSequence):
        device, batch_size = first.data.device, int(first.batch_sizes[0])
    else:
        device = first.device
        batch_size = first.shape[_normalize_dim(first_dim, first.dim(), _arg_name(batch_dim, first_index))]
    accumulator = _Accumulator(task, return_samples)

    def run(copies: int) -> None:
        stacked = tuple(arg if d is None else _replicate(arg, copies, d, f"inputs[{i}]")
                        for i, (arg, d) in enumerate(zip(args, dims)))
        out = _first_tensor(model(*stacked))
        if not (out.is_floating_point() or out.is_complex()):
            raise TypeError(f"the model's output is a {out.dtype} tensor; mc_predict averages "
                            f"task={task!r} outputs, which must be floating point (logits or values, "
                            "not predicted classes)")
        if task == "classification":
            if out.is_complex():
                raise TypeError(f"the model's output is a {out.dtype} tensor; task='classification' "
                                "averages the softmax of real logits")
            _check_classes(out, out_dim, out_name, out_note)
        checked_size = None if packed else batch_size
        accumulator.add(_split_samples(out, copies, checked_size, out_dim, out_name, out_note))

    def probe() -> int:
        run(1)
        return accumulator.mean.numel() * accumulator.mean.element_size() * _COPIES_PER_SAMPLE[task]

    with mc_dropout(model, strict=strict), torch.no_grad():
        resolved = _resolve_method(model, method, device, packed)
        if resolved == "batched":
            lists = [i for i, _ in batched_args if _numbers_as_long_as(args[i], batch_size)]
            if lists:
                raise TypeError(f"inputs[{lists[0]}] holds a list of {batch_size} numbers, as long as the "
                                "batch, which stacked copies would not tile; pass it as a tensor (lengths, "
                                "say), or use method='loop'")
        with _copies_drawn_apart(model, resolved):
            plan, done = _plan_chunks(resolved, n_samples, chunk_size, memory_budget, probe, device,
                                      batch_size)
            for copies in itertools.islice(plan, done, None):
                run(copies)
    return accumulator.result()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _argument_batch_dims(batch_dim: Any, n_args: int) -> list[int | None]:
    """``batch_dim`` (an int, or one int or None per positional argument) as one entry per argument."""
    if _is_int(batch_dim):
        return [batch_dim] * n_args
    if isinstance(batch_dim, (tuple, list)) and all(d is None or _is_int(d) for d in batch_dim):
        if len(batch_dim) != n_args:
            raise ValueError(f"batch_dim gives {len(batch_dim)} batch dimensions for {n_args} positional "
                             f"argument{'' if n_args == 1 else 's'} of the model, got {batch_dim!r}")
        return list(batch_dim)
    raise TypeError(f"batch_dim must be an int (the batch dimension of the inputs) or a tuple of one int "
                    f"or None per argument, got {batch_dim!r} of type {type(batch_dim).__name__}")


def _arg_name(batch_dim: Any, index: int) -> str:
    """How the errors name the batch dimension of argument ``index``."""
    return "batch_dim" if _is_int(batch_dim) else f"batch_dim[{index}]"


def _check_classes(out: Tensor, out_dim: int, out_name: str, out_note: str) -> None:
    """Classification needs a class dimension of at least two classes after the batch's."""
    binary = ("a binary classifier's one logit z gives the two classes' logits as "
              "torch.stack([torch.zeros_like(z), z], -1)")
    if out.dim() == 0:
        raise ValueError("task='classification' needs outputs with a class dimension, got a scalar")
    if _normalize_dim(out_dim, out.dim(), out_name, out_note) == out.dim() - 1:
        raise ValueError(f"task='classification' needs the classes on the output's last dimension, but "
                         f"the output of shape {list(out.shape)} has its batch there "
                         f"({out_name}={out_dim}{out_note}); "
                         f"{binary}")
    if out.shape[-1] < 2:
        raise ValueError(f"task='classification' needs at least two classes on the output's last dimension, "
                         f"got shape {list(out.shape)} (a softmax over one class is always 1); {binary}")
