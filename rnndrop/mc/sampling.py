"""Which modules sample under Monte-Carlo dropout, and how samples are batched.

:func:`mc_dropout` switches the sampling modules to training mode; the helpers
replicate a batch ``k`` times along its batch dimension, split the outputs back
into samples, and plan how many samples each forward call takes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, overload

import torch
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.utils.rnn import PackedSequence

from rnndrop.stochastic import Stochastic, noise_per_sequence, shared_switch
from rnndrop.validation import check_bool, check_choice, check_instance

__all__ = ["DEFAULT_MEMORY_BUDGET", "METHODS", "mc_dropout", "sampling_modules"]

logger = logging.getLogger(__name__)

METHODS: tuple[str, ...] = ("auto", "batched", "loop")

#: Default bound on the memory of one batched chunk's outputs and their derived tensors.
DEFAULT_MEMORY_BUDGET = 1 << 28


# ------------------------------------------------------------------ modules


def _is_sampling(module: nn.Module) -> bool:
    if isinstance(module, Stochastic):
        return bool(module.is_stochastic())
    return isinstance(module, _DropoutNd) and module.p > 0


def sampling_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) that :func:`mc_dropout` switches on."""
    check_instance("model", model, nn.Module, "an nn.Module")
    return [m for m in model.modules() if _is_sampling(m)]


@contextmanager
def mc_dropout(model: nn.Module, *, strict: bool = True) -> Iterator[nn.Module]:
    """Context under which only the sampling modules of ``model`` are in training mode.

    On entry every module goes to eval mode and each sampling module (see the module
    docstring) to training mode, that module alone: its children keep eval mode
    unless they sample too. On exit, also after an exception, every module gets back
    the mode it had. Gradients are not touched: wrap the call in ``torch.no_grad()``
    for inference. The modes are the model's own: while a block runs, another thread's call of
    the same model samples too (serve Monte-Carlo and plain predictions from two copies); blocks
    of several threads at once leave it as the first found it.

    Args:
        model: any ``nn.Module``.
        strict: raise a ValueError when ``model`` holds no module that would sample
            (every dropout probability 0): Monte-Carlo prediction would then repeat
            the deterministic prediction. ``strict=False`` allows it (a p = 0 baseline
            through the same code path).

    Yields:
        ``model``.
    """
    check_bool("strict", strict)
    samplers = sampling_modules(model)
    if strict and not samplers:
        raise ValueError(
            f"mc_dropout: model ({type(model).__name__}) has no stochastic module with p > 0 "
            "(an rnndrop Stochastic module whose is_stochastic() is True, or an nn.Dropout "
            "with p > 0); Monte-Carlo samples would all equal the eval prediction. "
            "Pass strict=False to allow it."
        )
    def switch() -> Callable[[], None]:
        modes = [(m, m.training) for m in model.modules()]

        def restore() -> None:
            for m, mode in modes:
                m.training = mode

        try:
            model.eval()
            for m in samplers:
                m.training = True
        except BaseException:  # a train() / eval() of the user's that failed part-way
            restore()
            raise
        return restore

    with shared_switch(model, "mc_dropout", switch):
        yield model


# ------------------------------------------------------------------ batching


def _normalize_dim(dim: int, ndim: int, name: str, note: str = "") -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a tensor with {ndim} dimensions{note}")
    return dim % ndim


def _replicate(obj: Any, copies: int, batch_dim: int, where: str = "the inputs") -> Any:
    """Tile every tensor in ``obj`` (nested tuples/lists) ``copies`` times along ``batch_dim``;
    ``where`` names ``obj`` for the errors.

    Row ``s * B + b`` of the result is row ``b`` of copy ``s``. A PackedSequence is passed as it
    is to a single copy and refused for several (:func:`_resolve_method` loops over them).
    """
    if copies == 1:
        return obj
    if isinstance(obj, Tensor):
        d = _normalize_dim(batch_dim, obj.dim(), "batch_dim",
                           f" (in {where}): give one batch dimension per positional argument "
                           "(batch_dim=(1, 0), say; None for one the batch does not split), or use "
                           "method='loop'")
        reps = [1] * obj.dim()
        reps[d] = copies
        return obj.repeat(*reps)
    if isinstance(obj, PackedSequence):
        raise TypeError(f"{where}: a PackedSequence cannot be stacked into copies; use method='loop'")
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple
        return type(obj)(*(_replicate(x, copies, batch_dim, where) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_replicate(x, copies, batch_dim, where) for x in obj)
    return obj


def _holds_packed(obj: Any) -> bool:
    if isinstance(obj, PackedSequence):
        return True
    return isinstance(obj, (tuple, list)) and any(_holds_packed(x) for x in obj)


def _numbers_as_long_as(obj: Any, batch_size: int) -> bool:
    """Whether ``obj`` holds a list or tuple of ``batch_size`` Python numbers (lengths given as a
    list, say): stacking copies would not tile it, and nothing tells it from a constant."""
    if isinstance(obj, (tuple, list)) and not isinstance(obj, PackedSequence):
        if len(obj) == batch_size and obj and all(isinstance(x, (int, float)) for x in obj):
            return True
        return any(_numbers_as_long_as(x, batch_size) for x in obj)
    return False


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


def _first_input(obj: Any) -> Tensor | PackedSequence | None:
    """The first tensor or PackedSequence in ``obj`` (nested tuples/lists)."""
    if isinstance(obj, (Tensor, PackedSequence)):
        return obj
    if isinstance(obj, (tuple, list)):
        for x in obj:
            first = _first_input(x)
            if first is not None:
                return first
    return None


def _split_samples(
    out: Tensor, copies: int, batch_size: int | None, batch_dim: int, name: str = "output_batch_dim",
    note: str = "",
) -> Tensor:
    """``[..., copies * B, ...]`` (copies along ``batch_dim``) -> ``[copies, ..., B, ...]``;
    ``name`` is the argument that gave ``batch_dim`` and ``note`` says more of it, for the errors.
    ``batch_size`` None (one copy of a packed batch, whose outputs may be per sequence or per
    word): not checked."""
    d = _normalize_dim(batch_dim, out.dim(), name, note)
    if batch_size is None:
        assert copies == 1
        return out.unsqueeze(0)
    if out.shape[d] != copies * batch_size:
        raise ValueError(
            f"the model's output has size {out.shape[d]} along {name}={batch_dim}{note} "
            f"for {copies} copies of a batch of {batch_size}, expected {copies * batch_size}; "
            "set batch_dim / output_batch_dim to the batch dimension of inputs / outputs"
        )
    return out.unflatten(d, (copies, batch_size)).movedim(d, 0)


def _resolve_method(
    model: nn.Module, method: str, device: torch.device | None = None, packed: bool = False
) -> str:
    """``"batched"`` or ``"loop"`` for ``method`` and the sampling modules of ``model``, its inputs
    on ``device`` (``packed``: they hold a PackedSequence, which is never stacked into copies).

    ``"auto"``: batched, unless a module shares noise on its weights across the batch; where a
    module shares a mask across the batch but draws it per sequence when asked
    (``mask_scope="batch"``, word masks of ``scope="batch"``), batched on CUDA alone. There one
    call a sample pays the host's launch path every time (cuDNN's inference is bound by it at
    hidden 200-650), while the stacked copies run the persistent loop once. On the CPU stacking is
    faster for some models and batches and slower for others (docs/usage.md, "Monte-Carlo
    prediction"), so looping stays the default there."""
    check_choice("method", method, METHODS)
    # modules whose noise a batch shares; copies stacked in one call share it too unless it switches
    sharing = [m for m in sampling_modules(model)
               if isinstance(m, Stochastic) and m.shares_noise_across_batch()]
    shared = [type(m).__name__ for m in sharing if not m.switches_to_noise_per_sequence()]
    if method == "batched" and shared:
        raise ValueError(
            f"method='batched' cannot draw independent samples: {', '.join(sorted(set(shared)))} "
            "share(s) one noise draw on weights across the batch; use method='loop' or 'auto'"
        )
    if method == "batched" and packed:
        raise ValueError("method='batched' cannot stack copies of a PackedSequence (each copy would "
                         "need its own packing); use method='loop' or 'auto'")
    if method != "auto":
        return method
    if packed:
        logger.debug("mc: looping over samples of a PackedSequence")
        return "loop"
    if shared:
        logger.debug("mc: looping over samples because %s share noise across the batch", shared)
        return "loop"
    if sharing and (device is None or device.type != "cuda"):
        logger.debug("mc: looping over samples off CUDA because %s share a mask across the batch",
                     [type(m).__name__ for m in sharing])
        return "loop"
    return "batched"


def _copies_drawn_apart(model: nn.Module, method: str) -> contextlib.AbstractContextManager:
    """The context ``model``'s calls by ``method`` (resolved) run in: for ``"batched"``,
    :func:`~rnndrop.stochastic.noise_per_sequence`, so that masks shared by a batch are drawn per
    sequence and the copies stacked in one call are independent samples."""
    return noise_per_sequence(model) if method == "batched" else contextlib.nullcontext()


class ChunkPlan(Sequence[int]):
    """The sizes of the forward calls that draw the samples: ``first`` calls of one sample, then
    calls of ``size`` until ``n_samples`` are drawn (the last takes what is left). Computed on
    demand: a plan of 10^12 samples costs no memory."""

    def __init__(self, n_samples: int, size: int, first: int = 0) -> None:
        self.first, self.size = first, size
        self.full, self.rest = divmod(n_samples - first, size)

    def __len__(self) -> int:
        return self.first + self.full + (1 if self.rest else 0)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"chunk {index} of a plan of {len(self)}")
        if index < self.first:
            return 1
        return self.size if index < self.first + self.full else self.rest

    def __iter__(self) -> Iterator[int]:
        yield from itertools.repeat(1, self.first)
        yield from itertools.repeat(self.size, self.full)
        if self.rest:
            yield self.rest


#: On the CPU, the most rows (copies times the batch) one batched call stacks, and the most bytes
#: its outputs may take as the probe counts them (:func:`_plan_chunks`), when no ``chunk_size`` is
#: given. There the calls are bound by their products and the memory they stream, not by the host:
#: a few copies a call beat one call a sample (larger products for the recurrence), many lose to it
#: (a step's rows and gates, or a language model's logits, leave the caches); docs/usage.md
#: ("Monte-Carlo prediction") has the numbers.
CPU_STACKED_ROWS = 128
CPU_CHUNK_BYTES = 64 << 20


def _plan_chunks(
    method: str, n_samples: int, chunk_size: int | None, memory_budget: int, probe: Callable[[], int],
    device: torch.device, batch_size: int,
) -> tuple[ChunkPlan, int]:
    """How many samples each forward call takes, and how many calls the probe already made.

    ``method`` is resolved (``"loop"`` or ``"batched"``). Batched without ``chunk_size``:
    ``probe()`` runs one single-sample call and returns the bytes one sample needs;
    the remaining samples then go in chunks that fit ``memory_budget``, on the CPU (``device``) in
    chunks of at most :data:`CPU_STACKED_ROWS` rows (copies of a batch of ``batch_size``) and
    :data:`CPU_CHUNK_BYTES`.
    """
    if method == "loop":
        return ChunkPlan(n_samples, 1), 0
    if chunk_size is not None:
        return ChunkPlan(n_samples, chunk_size), 0
    bytes_per_sample = probe()
    remaining = n_samples - 1
    if not remaining:
        return ChunkPlan(1, 1), 1
    most = remaining
    if device.type == "cpu":
        memory_budget = min(memory_budget, CPU_CHUNK_BYTES)
        most = max(1, CPU_STACKED_ROWS // max(1, batch_size))  # an empty batch: any number of copies
    size = max(1, min(remaining, memory_budget // max(1, bytes_per_sample), most))
    return ChunkPlan(n_samples, size, first=1), 1
