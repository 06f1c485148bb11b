"""Variable-length truncated BPTT (AWD-LSTM, Merity et al. 2017, section 4.1).

With a fixed BPTT length every word of a token stream always sits at the same position of
its segment: the word at position 0 never gets gradient through earlier words of its
segment. AWD-LSTM draws every segment's length at random so the split points move from
epoch to epoch:

- the base length is ``bptt`` with probability ``p_full`` (0.95) and ``bptt / 2`` otherwise;
- the length is ``int(N(base, std))`` (``std`` 5), at least ``min_len`` (5) and, when
  ``max_len`` is given, at most ``max_len``;
- the learning rate of that step is scaled by ``length / bptt``, so that a long segment,
  whose loss is a mean over more words, moves the weights as much per word as a short one.

:class:`VariableBPTT` draws the lengths from a generator of its own (seeded, with
``state_dict`` / ``load_state_dict`` to resume), so the lengths do not disturb the random
numbers of dropout masks and two runs with the same seed cut their streams alike.
:func:`scaled_learning_rate` scales every parameter group's learning rate for one step and
puts the exact values back.

Example (a batched stream ``data [N, B]`` as in Zaremba et al.'s batching)::

    lengths = VariableBPTT(70, seed=1)
    for inputs, targets, scale in lengths.batches(data):
        logits, hidden = model(inputs, hidden)
        loss = criterion(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(); loss.backward()
        with scaled_learning_rate(optimizer, scale):
            optimizer.step()

Differences from AWD-LSTM's ``main.py``: the last segment of a pass is cut to the rows that
are left and its learning rate is scaled by the length actually used (AWD scales by the
drawn length), and every row of the stream is used (AWD's loop stops one row early).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from rnndrop.validation import check_fraction, check_nonnegative_float, check_positive_int

__all__ = ["VariableBPTT", "scaled_learning_rate"]


class VariableBPTT:
    """AWD-LSTM's random sequence lengths for truncated BPTT, from a generator of its own.

    Args:
        bptt: the nominal length (AWD-LSTM: 70).
        p_full: probability of the base length ``bptt`` (else ``bptt / 2``), in [0, 1].
        std: standard deviation of the normal draw around the base (>= 0; 0: no jitter).
        min_len: the shortest length drawn (AWD-LSTM: 5).
        max_len: the longest length drawn, or None (no cap, as in AWD-LSTM).
        seed: seeds the generator; or pass ``generator`` (a CPU ``torch.Generator``) instead.
            Neither: a fresh generator's fixed default seed, not torch's global generator, so
            every process and every run draws the same lengths (what DDP needs, see below;
            ``torch.manual_seed`` does not change them): pass a seed of each run's own to a
            seed sweep.

    The lengths depend on the generator only: equal seeds give equal lengths on every
    process (what DistributedDataParallel needs: every rank takes the same number of steps).
    """

    def __init__(
        self,
        bptt: int,
        *,
        p_full: float = 0.95,
        std: float = 5.0,
        min_len: int = 5,
        max_len: int | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.bptt = check_positive_int("bptt", bptt)
        self.p_full = check_fraction("p_full", p_full)
        self.std = check_nonnegative_float("std", std)
        self.min_len = check_positive_int("min_len", min_len)
        if max_len is not None:
            check_positive_int("max_len", max_len)
            if max_len < min_len:
                raise ValueError(f"max_len must be >= min_len = {min_len}, got {max_len}")
        self.max_len = max_len
        if generator is not None and seed is not None:
            raise ValueError("pass seed or generator, not both")
        if generator is None:
            generator = torch.Generator()
            if seed is not None:
                if isinstance(seed, bool) or not isinstance(seed, int):
                    raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
                generator.manual_seed(seed)
        elif not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
            raise TypeError(f"generator must be a CPU torch.Generator, got {generator!r}")
        self.generator = generator

    def sample(self) -> int:
        """One segment length (two draws from the generator: the base, then the normal)."""
        base = self.bptt if torch.rand((), generator=self.generator).item() < self.p_full else self.bptt / 2
        length = int(base + self.std * torch.randn((), generator=self.generator).item())
        length = max(self.min_len, length)
        return length if self.max_len is None else min(length, self.max_len)

    def lr_scale(self, length: int) -> float:
        """The factor on the learning rate of a step over ``length`` positions: ``length / bptt``."""
        return length / self.bptt

    def lengths(self, rows: int) -> list[int]:
        """The segment lengths of one pass over a stream of ``rows`` rows (``rows - 1`` targets):
        drawn one by one, the last cut to what is left."""
        check_positive_int("rows", rows)
        out: list[int] = []
        start = 0
        while start < rows - 1:
            length = min(self.sample(), rows - 1 - start)
            out.append(length)
            start += length
        return out

    def batches(self, batched: Tensor, *, time_dim: int = 0) -> Iterator[tuple[Tensor, Tensor, float]]:
        """``(inputs, targets, lr_scale)`` segments of a batched stream ``[N, B, ...]``, top to
        bottom; ``targets`` are ``inputs`` shifted one row ahead. The lengths of the whole pass
        are drawn before the first segment is yielded (:meth:`lengths`)."""
        if not isinstance(batched, Tensor) or batched.dim() < 1:
            raise TypeError(f"batched must be a tensor with a time dimension, got {type(batched).__name__}")
        if time_dim not in (0, 1) or time_dim >= batched.dim():
            raise ValueError(f"time_dim must be 0 or 1 and within the tensor's dimensions, got {time_dim!r}")
        if batched.shape[time_dim] < 2:  # no target to predict
            raise ValueError(f"batched must hold at least 2 rows along time_dim {time_dim} (inputs and "
                             f"the targets one row ahead), got shape {tuple(batched.shape)}")
        start = 0
        for length in self.lengths(batched.shape[time_dim]):
            yield (batched.narrow(time_dim, start, length), batched.narrow(time_dim, start + 1, length),
                   self.lr_scale(length))
            start += length

    def state_dict(self) -> dict[str, Any]:
        """The generator's state (a uint8 tensor) and the settings, to resume the same lengths."""
        return {"generator": self.generator.get_state(), "bptt": self.bptt, "p_full": self.p_full,
                "std": self.std, "min_len": self.min_len, "max_len": self.max_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the settings must be this sampler's."""
        mine = {k: v for k, v in self.state_dict().items() if k != "generator"}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"the state was saved by a VariableBPTT with other settings: {theirs} there, "
                             f"{mine} here")
        self.generator.set_state(state["generator"])

    def __repr__(self) -> str:
        cap = f", max_len={self.max_len}" if self.max_len is not None else ""
        return (f"VariableBPTT(bptt={self.bptt}, p_full={self.p_full}, std={self.std}, "
                f"min_len={self.min_len}{cap})")


@contextmanager
def scaled_learning_rate(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Multiply every parameter group's ``lr`` by ``factor`` inside the block, then put the
    very same values back (also when the block raises)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (
            math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    saved = [group["lr"] for group in optimizer.param_groups]
    try:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr * factor
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr
