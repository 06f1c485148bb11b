"""The layout of a recurrent layer's input: batch_first, unbatched, padded or packed.

A recurrent layer works on *rows*: ``[N, features]`` in packed, time-major order,
``batch_sizes[t]`` rows for step ``t`` (non-increasing). Padded input ``[T, B, F]``
is the special case ``batch_sizes = [B] * T``. :class:`SequenceLayout` turns what
the user passed into rows, and turns rows back into what ``nn.LSTM`` returns.

Row ``r`` of step ``t`` belongs to sequence ``r - offset_t`` of the *sorted* batch
(:func:`packed_sequence_index`); a per-sequence mask ``[B, ...]`` reaches the rows by
indexing with it, which is also how :class:`rnndrop.LockedDropout` masks a
``PackedSequence``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from rnndrop.tracing import tracing_for_compile
from rnndrop.validation import check_input_features, check_tensor_like

__all__ = ["EqualBatchSizes", "SequenceLayout", "mask_packed_sequence", "packed_sequence_index"]


def packed_sequence_index(batch_sizes: Tensor) -> Tensor:
    """For each row of a ``PackedSequence``'s data, the (sorted) sequence it belongs to.

    Args:
        batch_sizes: ``[T]`` rows per time step (the PackedSequence's, on the CPU).

    Returns:
        ``[sum(batch_sizes)]`` int64: row ``offset_t + i`` of step ``t`` -> ``i``.
    """
    batch_sizes = batch_sizes.long()
    offsets = torch.cumsum(batch_sizes, 0) - batch_sizes
    rows = torch.arange(int(batch_sizes.sum()))
    return rows - torch.repeat_interleave(offsets, batch_sizes)


def _check_batch_sizes(owner: str, sizes: list[int], rows: int) -> None:
    """A ``PackedSequence``'s ``batch_sizes`` as ``pack_padded_sequence`` makes them: positive,
    non-increasing, summing to the data's rows (a kernel trusts them; a hand-built one that is not
    gave a crash of the process or rows left unwritten)."""
    if not sizes or sizes[-1] < 1 or any(later > earlier for earlier, later in itertools.pairwise(sizes)):
        shown = sizes if len(sizes) <= 8 else [*sizes[:8], "..."]
        raise ValueError(f"{owner}: PackedSequence batch_sizes must be positive and non-increasing, "
                         f"got {shown}")
    if sum(sizes) != rows:
        raise ValueError(f"{owner}: PackedSequence data must have sum(batch_sizes) = {sum(sizes)} rows, "
                         f"got {rows}")


def mask_packed_sequence(x: PackedSequence, mask: Tensor) -> PackedSequence:
    """``x`` with every row multiplied by its sequence's mask.

    Args:
        x: a ``PackedSequence`` of data ``[N, *features]``.
        mask: ``[B, *features]`` in the *sorted* batch order of ``x`` (for masks drawn
            i.i.d. per sequence any order is as good, and no sorting is needed).
    """
    rows = packed_sequence_index(x.batch_sizes).to(x.data.device)
    return PackedSequence(x.data * mask[rows], x.batch_sizes, x.sorted_indices, x.unsorted_indices)


class EqualBatchSizes(Sequence[int]):
    """``batch_sizes`` of padded input while torch.compile traces: ``steps`` times ``size``, held
    as the two numbers, so that a number of steps the graph keeps symbolic (one graph for every
    length) stays so; a list of one entry per step would fix it."""

    def __init__(self, steps: int, size: int) -> None:
        self.steps, self.size = steps, size

    def __len__(self) -> int:
        return int(self.steps)

    def __iter__(self) -> Iterator[int]:
        return itertools.repeat(self.size, int(self.steps))

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        steps = range(int(self.steps))
        if isinstance(index, slice):
            return [self.size] * len(steps[index])
        steps[index]  # an IndexError past the last step, as a list's
        return self.size

    def __repr__(self) -> str:
        return f"EqualBatchSizes(steps={self.steps}, size={self.size})"


@dataclass
class SequenceLayout:
    """Where the rows ``[N, F]`` of a time-major batch come from, and how to give them back."""

    batch_sizes: Sequence[int]  # rows per time step, non-increasing (a list, or EqualBatchSizes)
    packed_batch_sizes: Tensor | None  # the PackedSequence's, None for padded input
    sorted_indices: Tensor | None
    unsorted_indices: Tensor | None
    batch_first: bool
    unbatched: bool
    seq_len: int
    batch_size: int
    _row_index: dict[bool, Tensor] = field(default_factory=dict, repr=False)

    @property
    def packed(self) -> bool:
        return self.packed_batch_sizes is not None

    @classmethod
    def from_input(
        cls, input: Tensor | PackedSequence, *, batch_first: bool, input_size: int, weight: Tensor, owner: str
    ) -> tuple[Tensor, SequenceLayout]:
        """The rows ``[N, input_size]`` of ``input`` and their layout; checks ``input``.

        ``weight`` gives the dtype and device the input must have; ``owner`` (the
        layer's class name) starts every error message.
        """
        if isinstance(input, PackedSequence):
            x = input.data
            if x.dim() != 2:
                raise ValueError(f"{owner}: PackedSequence data must be 2-D, got {x.dim()}-D")
            sizes: Sequence[int] = input.batch_sizes.tolist()
            _check_batch_sizes(owner, sizes, x.shape[0])
            layout = cls(
                sizes,
                input.batch_sizes,
                input.sorted_indices,
                input.unsorted_indices,
                batch_first,
                False,
                len(sizes),
                sizes[0],
            )
        else:
            if not isinstance(input, Tensor):
                raise TypeError(
                    f"{owner}: input must be a Tensor or PackedSequence, got {type(input).__name__}"
                )
            if input.dim() not in (2, 3):
                batched = "[batch, seq, feature]" if batch_first else "[seq, batch, feature]"
                raise ValueError(
                    f"{owner}: input must be 3-D {batched} or 2-D unbatched [seq, feature], "
                    f"got {input.dim()}-D with shape {list(input.shape)}"
                )
            unbatched = input.dim() == 2
            x = input.unsqueeze(1) if unbatched else input
            if batch_first and not unbatched:
                x = x.transpose(0, 1)
            T, B = x.shape[:2]
            if T == 0 or B == 0:
                raise ValueError(
                    f"{owner}: input must have at least one step and one sequence, "
                    f"got shape {list(input.shape)}"
                )
            x = x.reshape(T * B, x.shape[-1])
            sizes = EqualBatchSizes(T, B) if tracing_for_compile() else [B] * T
            layout = cls(sizes, None, None, None, batch_first, unbatched, T, B)
        check_input_features(owner, x, input_size, weight)
        return x, layout

    def initial_states(
        self,
        hx: Tensor | tuple[Tensor, ...] | None,
        sizes: tuple[int, ...],
        num_rows: int,
        x: Tensor,
        owner: str,
    ) -> tuple[Tensor, ...]:
        """``hx`` (one tensor, or a tuple for several states) checked and in sorted batch order.

        Args:
            hx: as given to ``forward``: None (zeros), ``h_0`` for one state, ``(h_0, c_0)`` for two.
            sizes: the feature size of each state.
            num_rows: ``num_layers * num_directions``.
            x: the input rows (for dtype and device).

        Returns:
            One ``[num_rows, B, size]`` tensor per state.
        """
        B = self.batch_size
        if hx is None:
            if len(set(sizes)) == 1:  # one fill for every state (one launch on a GPU)
                return x.new_zeros(len(sizes), num_rows, B, sizes[0]).unbind()
            return tuple(x.new_zeros(num_rows, B, size) for size in sizes)
        if len(sizes) == 1:
            states, names = (hx,), ["hx"]
        else:
            if not isinstance(hx, (tuple, list)) or len(hx) != len(sizes):
                sequence = isinstance(hx, (tuple, list))
                got = f"{type(hx).__name__} of {len(hx)}" if sequence else type(hx).__name__
                raise TypeError(f"{owner}: hx must be a tuple (h_0, c_0) or None, got {got}")
            states, names = tuple(hx), [f"hx[{i}]" for i in range(len(sizes))]
        out = []
        for state, size, name in zip(states, sizes, names):
            expected = (num_rows, size) if self.unbatched else (num_rows, B, size)
            note = " (unbatched input)" if self.unbatched else ""
            check_tensor_like(f"{owner}: {name}", state, expected, x, shape_note=note)
            if self.unbatched:
                state = state.unsqueeze(1)
            elif self.sorted_indices is not None:
                state = state.index_select(1, self.sorted_indices)
            out.append(state)
        return tuple(out)

    def broadcastable(self, rows: Tensor, mask: Tensor, per_step: bool) -> tuple[Tensor, Tensor]:
        """``rows`` ``[N, ...]`` and a mask ``[B, ...]`` (``per_step``: ``[T, B, ...]``) as a pair
        that broadcasts row by row: for padded input ``[T, B, ...]`` and ``[1 or T, B, ...]``
        (views: the mask is not copied to every step), for packed input ``rows`` and the mask's
        rows ``[N, ...]``. A mask shared by the batch (``[1, ...]``) broadcasts as it is."""
        if self.packed and not per_step and mask.shape[0] == 1:
            return rows, mask
        if self.packed:
            return rows, self.broadcast_to_rows(mask, per_step)
        steps = rows.reshape(self.seq_len, self.batch_size, *rows.shape[1:])
        return steps, mask if per_step else mask.unsqueeze(0)

    def mask_rows(self, rows: Tensor, mask: Tensor, per_step: bool) -> Tensor:
        """``rows * mask`` ``[N, ...]`` (a mask as for :meth:`broadcastable`)."""
        if not self.packed:  # [T, B, ...] times [B, ...] / [T, B, ...] / [1, ...]: broadcasts as it is
            return (rows.reshape(self.seq_len, self.batch_size, *rows.shape[1:]) * mask).view(rows.shape)
        steps, mask = self.broadcastable(rows, mask, per_step)
        return (steps * mask).reshape(rows.shape)

    def broadcast_to_rows(self, mask: Tensor, per_step: bool) -> Tensor:
        """A mask ``[B, ...]`` (``per_step``: ``[T, B, ...]``), sorted batch order -> rows ``[N, ...]``."""
        T, B = self.seq_len, self.batch_size
        if not self.packed:
            if not per_step:
                mask = mask.unsqueeze(0).expand(T, *mask.shape)
            return mask.reshape(T * B, *mask.shape[2:])
        index = self._row_index.get(per_step)
        if index is None:
            index = packed_sequence_index(self.packed_batch_sizes)
            if per_step:  # row of step t, sequence i -> t * B + i
                steps = torch.repeat_interleave(torch.arange(T), self.packed_batch_sizes.long())
                index = steps * B + index
            index = self._row_index[per_step] = index.to(mask.device)
        flat = mask.reshape(T * B, *mask.shape[2:]) if per_step else mask
        return flat[index]

    def restore(
        self, out: Tensor, states: tuple[Tensor, ...]
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, ...]]:
        """Output rows ``[N, F]`` and final states ``[L, B, size]`` in the layout of the input."""
        if self.packed:
            if self.unsorted_indices is not None:
                states = tuple(s.index_select(1, self.unsorted_indices) for s in states)
            return PackedSequence(
                out, self.packed_batch_sizes, self.sorted_indices, self.unsorted_indices
            ), states
        output = out.view(self.seq_len, self.batch_size, out.shape[-1])
        if self.unbatched:
            return output.squeeze(1), tuple(s.squeeze(1) for s in states)
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, states
