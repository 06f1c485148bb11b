"""Packed-row bookkeeping for the loop kernels: which rows belong to which time step,
in which order the steps run, and where every row finds its previous state.

Rows are packed and time-major (``N = sum(batch_sizes)``): step ``t`` owns rows
``offsets[t] : offsets[t] + batch_sizes[t]``, and row ``k`` of a step is sequence
``k``. Sequences end in decreasing length order, so a step's rows continue the
first rows of the step before it; in reverse direction new sequences join at the
bottom and start from the initial state. No math lives here: the cell kernels
(:mod:`rnndrop.kernels.lstm`, :mod:`rnndrop.kernels.gru`) ask this module for
views and indices and do the arithmetic themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


def step_offsets(batch_sizes: Sequence[int]) -> list[int]:
    """Row offset of each time step in packed, time-major rows."""
    offsets = [0]
    for b in batch_sizes[:-1]:
        offsets.append(offsets[-1] + b)
    return offsets


class Step(NamedTuple):
    """One time step of the recurrence, in the order it runs.

    The step has ``size`` rows. The first ``carried`` of them continue the state
    of step ``prev`` (the step that ran before, which has ``prev_size`` rows; -1
    for the first step); the others start from rows ``carried : size`` of the
    initial state.
    """

    t: int
    size: int
    prev: int
    prev_size: int
    carried: int


class Schedule:
    """The order of the time steps and where every step reads its previous state.

    ``steps`` in running order (``t`` descending when ``reverse``); ``sizes`` and
    ``offsets`` indexed by ``t``; ``batch`` = ``sizes[0]``.
    """

    def __init__(self, batch_sizes: Sequence[int], reverse: bool) -> None:
        self.sizes = [int(b) for b in batch_sizes]
        self.offsets = step_offsets(self.sizes)
        self.seq_len = len(self.sizes)
        self.batch = self.sizes[0]
        order = range(self.seq_len - 1, -1, -1) if reverse else range(self.seq_len)
        self.steps: list[Step] = []
        prev = -1
        for t in order:
            size = self.sizes[t]
            if prev < 0:
                self.steps.append(Step(t, size, -1, 0, 0))
            else:
                prev_size = self.sizes[prev]
                self.steps.append(Step(t, size, prev, prev_size, min(size, prev_size)))
            prev = t

    @staticmethod
    def of(batch_sizes: Sequence[int], reverse: bool) -> Schedule:
        """The schedule of ``batch_sizes`` and direction, built once and shared (a schedule is
        never changed after it is built): a GPU loop's host time is the cost to cut there."""
        return _cached_schedule(tuple(map(int, batch_sizes)), bool(reverse))

    def by_step(self, x: Tensor) -> tuple[Tensor, ...]:
        """Views of the rows of every time step of ``x`` ``[N, ...]``, indexed by ``t``."""
        return torch.split(x, self.sizes)

    def in_running_order(self, by_t: Sequence) -> list:
        """The items of ``by_t`` (indexed by ``t``) in the order the steps run."""
        return [by_t[step.t] for step in self.steps]

    def previous_views(self, by_step: Sequence[Tensor], init: Tensor) -> list[Tensor | None]:
        """For every step in running order, its previous state as a view (see :func:`previous`),
        or None where rows of ``init`` join rows of the step before (reverse direction,
        packed): those must be concatenated once the step before has run."""
        return [
            None if step.prev >= 0 and step.carried < step.size else previous(by_step, init, step)
            for step in self.steps
        ]

    def final_rows(self, device: torch.device) -> Tensor:
        """``[B]`` the row of the last step of every sequence (the rows of ``h_n``)."""
        segments = []  # (first sequence, first row, count)
        for k, step in enumerate(self.steps):
            following = self.steps[k + 1].carried if k + 1 < len(self.steps) else 0
            if step.size > following:
                start = self.offsets[step.t] + following
                segments.append((following, start, step.size - following))
        segments.sort()
        return _arange_segments([(row, n) for _, row, n in segments], device)

    def previous_blocks(self) -> list[tuple[int, int, bool, int]]:
        """Where the previous state of every row lives, as blocks of consecutive rows.

        ``(row, count, from_init, source_row)``: rows ``row : row + count`` continue rows
        ``source_row : source_row + count`` of the buffer of all steps, or of the initial
        state when ``from_init``. Rows in ascending order.
        """
        by_step = {}
        for step in self.steps:
            start = self.offsets[step.t]
            blocks = [(start, step.carried, False, self.offsets[step.prev])] if step.carried else []
            if step.size > step.carried:
                blocks.append((start + step.carried, step.size - step.carried, True, step.carried))
            by_step[step.t] = blocks
        merged: list[list] = []
        for t in range(self.seq_len):
            for row, count, from_init, source in by_step[t]:
                last = merged[-1] if merged else None
                if last and last[2] == from_init and last[0] + last[1] == row and last[3] + last[1] == source:
                    last[1] += count
                else:
                    merged.append([row, count, from_init, source])
        return [tuple(block) for block in merged]

    def mask_index(self, mask: Tensor) -> Tensor:
        """``[N]``: for every row, its index in ``mask`` ``[T', B', ...]`` flattened to
        ``[T' * B', ...]``."""
        steps, batch = mask.shape[0], mask.shape[1]
        index = []
        for t, size in enumerate(self.sizes):
            first = (t if steps > 1 else 0) * batch
            index.extend(range(first, first + size) if batch > 1 else [first] * size)
        return torch.tensor(index, dtype=torch.long, device=mask.device)

    def step_masks(self, mask: Tensor | None) -> list[Tensor | None]:
        """The hidden mask of every step, ``[size or 1, P]`` / ``[size or 1, G, P]``, by ``t``."""
        if mask is None:
            return [None] * self.seq_len
        shared = mask[0] if mask.shape[0] == 1 else None
        out = []
        for t, size in enumerate(self.sizes):
            m = mask[t] if shared is None else shared
            out.append(m[:size] if m.shape[0] > size else m)
        return out


@functools.lru_cache(maxsize=256)
def _cached_schedule(batch_sizes: tuple[int, ...], reverse: bool) -> Schedule:
    return Schedule(batch_sizes, reverse)


def _arange_segments(segments: list[tuple[int, int]], device: torch.device) -> Tensor:
    """The concatenation of ``arange(start, start + count)`` over ``(start, count)`` pairs."""
    merged: list[list[int]] = []
    for start, count in segments:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += count
        else:
            merged.append([start, count])
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in merged])


def rows(x: Tensor, lo: int, hi: int) -> Tensor:
    """Rows ``lo:hi`` of ``x``; ``x`` itself when that is all of it or it has one row
    (a mask that the batch shares)."""
    if x.shape[0] == 1 or (lo == 0 and hi == x.shape[0]):
        return x
    return x[lo:hi]


def previous(by_step: Sequence[Tensor], init: Tensor, step: Step) -> Tensor:
    """The previous state of the rows of ``step``: ``[size, ...]`` (a view when it can be)."""
    if step.prev < 0:
        return rows(init, 0, step.size)
    prev = by_step[step.prev]
    if step.carried == step.size:
        return prev if step.prev_size == step.size else prev[: step.size]
    return torch.cat([prev, init[step.carried : step.size]])


def previous_targets(
    grad_by_step: Sequence[Tensor], init_grad: Tensor, step: Step
) -> list[tuple[Tensor, int, int]]:
    """``(target, lo, hi)``: rows ``lo:hi`` of ``step`` feed ``target`` (views of the
    gradient buffer of the previous step's rows, or of the initial state's)."""
    k = step.carried
    targets = []
    if k:
        prev = grad_by_step[step.prev]
        targets.append((prev if step.prev_size == k else prev[:k], 0, k))
    if step.size > k:
        targets.append((init_grad[k : step.size], k, step.size))
    return targets


def add_product(targets: list[tuple[Tensor, int, int]], x: Tensor, y: Tensor) -> None:
    """``target += x * y`` on the rows of every target (see :func:`previous_targets`)."""
    for target, lo, hi in targets:
        target.addcmul_(rows(x, lo, hi), rows(y, lo, hi))


def add_rows(targets: list[tuple[Tensor, int, int]], x: Tensor) -> None:
    """``target += x`` on the rows of every target."""
    for target, lo, hi in targets:
        target.add_(rows(x, lo, hi))


def gather_previous(buffer: Tensor, init: Tensor, blocks: list) -> Tensor:
    """``[N, ...]`` the previous state of every row (see :meth:`Schedule.previous_blocks`)."""
    out = torch.empty_like(buffer)
    for row, count, from_init, source in blocks:
        src = init if from_init else buffer
        out[row : row + count] = src[source : source + count]
    return out


def mul_previous_(target: Tensor, buffer: Tensor, init: Tensor, blocks: list) -> None:
    """``target *= previous state`` row by row, in place (``target``: ``[N, ...]``)."""
    for row, count, from_init, source in blocks:
        src = init if from_init else buffer
        target[row : row + count].mul_(src[source : source + count])
