"""Recurrences with a hand-written backward pass, one ``torch.autograd.Function`` per call.

The reference kernel (:mod:`rnndrop.kernels.autograd`) records a dozen autograd
nodes per time step; on a CPU the per-node overhead, not the arithmetic, is what
makes it slow. Here the forward loop runs without autograd into preallocated
buffers with a few in-place ops per step and keeps only what the backward pass
needs (gate activations, cell states, the masked previous state). The backward
loop computes the pre-activation gradients of each step into one ``[N, G * H]``
buffer; the weight gradient ``dW_hh`` is then a single large matmul over all
steps, as cuDNN does. Gradients of ``gates_x`` (hence of ``W_ih`` and the hoisted
biases), ``h0``, ``c0``, ``w_hh``, ``w_hr``, ``b_hh`` and of the mask itself
are returned; autograd handles everything outside the recurrence.

The functions are once differentiable: a double backward raises an error.
See :mod:`rnndrop.kernels` for the contract; results equal the reference kernel
up to floating-point rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from rnndrop.kernels.autograd import step_offsets


class _Step(NamedTuple):
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


class _Schedule:
    """The order of the time steps and where every step reads its previous state."""

    def __init__(self, batch_sizes: Sequence[int], reverse: bool) -> None:
        self.sizes = [int(b) for b in batch_sizes]
        self.offsets = step_offsets(self.sizes)
        self.seq_len = len(self.sizes)
        self.batch = self.sizes[0]
        self.num_rows = self.offsets[-1] + self.sizes[-1]
        order = range(self.seq_len - 1, -1, -1) if reverse else range(self.seq_len)
        self.steps: list[_Step] = []
        prev = -1
        for t in order:
            size = self.sizes[t]
            if prev < 0:
                self.steps.append(_Step(t, size, -1, 0, 0))
            else:
                prev_size = self.sizes[prev]
                self.steps.append(_Step(t, size, prev, prev_size, min(size, prev_size)))
            prev = t

    def split(self, x: Tensor) -> tuple[Tensor, ...]:
        """Views of the rows of every time step of ``x`` ``[N, ...]``, indexed by ``t``."""
        return torch.split(x, self.sizes)

    def final_rows(self, device: torch.device) -> Tensor:
        """``[B]`` row of the last step of every sequence (the rows of ``h_n``)."""
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

    def mask_rows(self, mask: Tensor) -> Tensor:
        """``[N]`` for every row, its index in ``mask`` flattened to ``[T' * B', ...]``."""
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


def _arange_segments(segments: list[tuple[int, int]], device: torch.device) -> Tensor:
    """The concatenation of ``arange(start, start + count)`` over ``(start, count)`` pairs."""
    merged: list[list[int]] = []
    for start, count in segments:
        if merged and merged[-1][0] + merged[-1][1] == start:
            merged[-1][1] += count
        else:
            merged.append([start, count])
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in merged])


def _rows(x: Tensor, lo: int, hi: int) -> Tensor:
    """Rows ``lo:hi`` of ``x``; ``x`` itself when that is all of it or it has one row
    (a mask that the batch shares)."""
    if x.shape[0] == 1 or (lo == 0 and hi == x.shape[0]):
        return x
    return x[lo:hi]


def _previous(by_step: Sequence[Tensor], init: Tensor, step: _Step) -> Tensor:
    """The previous state of the rows of ``step``: ``[size, ...]`` (a view when it can be)."""
    if step.prev < 0:
        return _rows(init, 0, step.size)
    prev = by_step[step.prev]
    if step.carried == step.size:
        return prev if step.prev_size == step.size else prev[: step.size]
    return torch.cat([prev, init[step.carried : step.size]])


def _previous_targets(
    grad_by_step: Sequence[Tensor], init_grad: Tensor, step: _Step
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


def _gather_previous(buffer: Tensor, init: Tensor, blocks: list) -> Tensor:
    """``[N, ...]`` the previous state of every row (see :meth:`_Schedule.previous_blocks`)."""
    out = torch.empty_like(buffer)
    for row, count, from_init, source in blocks:
        src = init if from_init else buffer
        out[row : row + count] = src[source : source + count]
    return out


def _mul_previous_(target: Tensor, buffer: Tensor, init: Tensor, blocks: list) -> None:
    """``target *= previous state`` row by row, in place (``target``: ``[N, ...]``)."""
    for row, count, from_init, source in blocks:
        src = init if from_init else buffer
        target[row : row + count].mul_(src[source : source + count])


# ------------------------------------------------------------ recurrent matmul


def _masked_state(h_prev: Tensor, mask: Tensor, out: Tensor) -> Tensor:
    """``h_prev * mask`` into ``out``: ``[b, P]``, or ``[b, G, P]`` for a per-gate mask."""
    if mask.dim() == 3:
        return torch.mul(h_prev.unsqueeze(1), mask, out=out)
    return torch.mul(h_prev, mask, out=out)


def _recurrent_into(out: Tensor, add: Tensor | None, hm: Tensor, w_hh_t: Tensor) -> None:
    """``out = add + hm @ w_hh_t`` for one step.

    ``out``: ``[b, G * H]``; ``add``: ``[b, G * H]``, ``[G * H]`` or None;
    ``hm``: ``[b, P]`` (one matmul) or ``[b, G, P]`` (per gate: a batched matmul);
    ``w_hh_t``: ``W_hh`` transposed, ``[P, G * H]``.
    """
    if hm.dim() == 2:
        if add is None:
            torch.mm(hm, w_hh_t, out=out)
        else:
            torch.addmm(add, hm, w_hh_t, out=out)
        return
    gates = hm.shape[1]
    w = w_hh_t.view(w_hh_t.shape[0], gates, -1).transpose(0, 1)  # [G, P, H]
    per_gate = torch.bmm(hm.transpose(0, 1), w).transpose(0, 1)  # [b, G, H]
    out3 = out.view(out.shape[0], gates, -1)
    if add is None:
        out3.copy_(per_gate)
    else:
        torch.add(add.view(-1, gates, out3.shape[2]), per_gate, out=out3)


def _recurrent_back(
    targets: list[tuple[Tensor, int, int]],
    d_gates: Tensor,
    w_hh: Tensor,
    mask: Tensor | None,
    d_hm: Tensor | None,
) -> None:
    """Add the gradient of ``h_prev`` from one step's gate gradients ``[b, G * H]``
    to ``targets`` (see :func:`_previous_targets`).

    ``d_hm`` (``[b, P]`` or ``[b, G, P]``) receives the gradient of the masked state
    ``h_prev * mask``; for a shared mask it may also be a scratch buffer.
    """
    if mask is None:
        for target, lo, hi in targets:
            target.addmm_(_rows(d_gates, lo, hi), w_hh)
        return
    if mask.dim() == 2:
        d = torch.mm(d_gates, w_hh, out=d_hm)
        for target, lo, hi in targets:
            target.addcmul_(_rows(d, lo, hi), _rows(mask, lo, hi))
        return
    gates = mask.shape[1]
    w = w_hh.view(gates, -1, w_hh.shape[1])  # [G, H, P]
    b = d_gates.shape[0]
    per_gate = torch.bmm(d_gates.view(b, gates, -1).transpose(0, 1), w)  # [G, b, P]
    if d_hm is not None:
        d_hm.copy_(per_gate.transpose(0, 1))
    d = (per_gate * mask.transpose(0, 1)).sum(0)
    for target, lo, hi in targets:
        target.add_(_rows(d, lo, hi))


def _add_product(targets: list[tuple[Tensor, int, int]], x: Tensor, y: Tensor) -> None:
    """``target += x * y`` on the rows of every target."""
    for target, lo, hi in targets:
        target.addcmul_(_rows(x, lo, hi), _rows(y, lo, hi))


def _output_grad(d_out: Tensor | None, out: Tensor) -> Tensor:
    """A fresh contiguous buffer holding the gradient of the output (zeros if None)."""
    if d_out is None:
        return out.new_zeros(out.shape)
    return d_out.clone(memory_format=torch.contiguous_format)


def _masked_state_grad_buffer(need_mask: bool, mask: Tensor | None, hm: Tensor | None) -> Tensor | None:
    """Where the backward loop writes ``d(h_prev * mask)``: ``hm``'s shape when the mask's
    gradient is wanted, a ``[N, P]`` scratch buffer for a batch-shared mask, else None."""
    if need_mask:
        return hm.new_empty(hm.shape)
    if mask is not None and mask.dim() == 3:
        return hm.new_empty(hm.shape[0], hm.shape[1])  # scratch
    return None


def _weight_grad(d_gates: Tensor, hm: Tensor) -> Tensor:
    """``dW_hh`` ``[G * H, P]`` from all gate gradients ``[N, G * H]`` and masked states."""
    if hm.dim() == 2:
        return d_gates.t().mm(hm)
    gates = hm.shape[1]
    n = d_gates.shape[0]
    per_gate = torch.bmm(d_gates.view(n, gates, -1).permute(1, 2, 0), hm.transpose(0, 1))
    return per_gate.reshape(-1, hm.shape[2])


def _mask_grad(
    schedule: _Schedule, mask: Tensor, d_hm: Tensor, h_prev: Tensor
) -> Tensor:
    """The gradient of the hidden mask from ``d(h_prev * mask)`` of every row."""
    product = d_hm * (h_prev.unsqueeze(1) if d_hm.dim() == 3 else h_prev)
    flat = product.new_zeros(mask.shape[0] * mask.shape[1], *mask.shape[2:])
    flat.index_add_(0, schedule.mask_rows(mask), product)
    return flat.view(mask.shape)


def _check_mask(mask: Tensor | None, gates: int, size: int, schedule: _Schedule) -> None:
    if mask is None:
        return
    ok = mask.dim() in (3, 4) and mask.shape[0] in (1, schedule.seq_len)
    ok = ok and mask.shape[1] in (1, schedule.batch) and mask.shape[-1] == size
    if not ok or (mask.dim() == 4 and mask.shape[2] != gates):
        raise ValueError(
            f"hidden_mask must have shape [1 or {schedule.seq_len}, 1 or {schedule.batch}, "
            f"{size}] or [..., {gates}, {size}], got {list(mask.shape)}"
        )


# ------------------------------------------------------------------- LSTM


class _LSTMRecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, gates_x, h0, c0, w_hh, w_hr, mask, schedule):
        N, H = gates_x.shape[0], c0.shape[1]
        acts = gates_x.new_empty(N, 4 * H)  # sigmoid(i), sigmoid(f), tanh(g), sigmoid(o)
        cells = gates_x.new_empty(N, H)
        tanh_c = gates_x.new_empty(N, H)
        out = gates_x.new_empty(N, h0.shape[1])
        h_raw = out if w_hr is None else gates_x.new_empty(N, H)  # h before the projection
        hm = None if mask is None else gates_x.new_empty(N, *mask.shape[2:])
        pre = gates_x.new_empty(schedule.batch, 4 * H)
        pre_by_size = {b: (pre[:b], pre[:b, 2 * H : 3 * H]) for b in set(schedule.sizes)}

        split = schedule.split
        GX, A, C, TC, OUT, HR = map(split, (gates_x, acts, cells, tanh_c, out, h_raw))
        I, F, G, O = (split(a) for a in acts.split(H, 1))
        HM = split(hm) if hm is not None else None
        masks = schedule.step_masks(mask)
        # A contiguous W_hh^T makes the small per-step matmuls 1.3-1.5x faster on CPU (MKL).
        w_hh_t = w_hh.t().contiguous()
        w_hr_t = None if w_hr is None else w_hr.t().contiguous()
        for step in schedule.steps:
            t = step.t
            h_prev = _previous(OUT, h0, step)
            m = masks[t]
            if m is not None:
                h_prev = _masked_state(h_prev, m, HM[t])
            p, p_g = pre_by_size[step.size]
            _recurrent_into(p, GX[t], h_prev, w_hh_t)
            torch.sigmoid(p, out=A[t])
            torch.tanh(p_g, out=G[t])
            c = torch.mul(F[t], _previous(C, c0, step), out=C[t]).addcmul_(I[t], G[t])
            torch.mul(O[t], torch.tanh(c, out=TC[t]), out=HR[t])
            if w_hr_t is not None:
                torch.mm(HR[t], w_hr_t, out=OUT[t])
        final = schedule.final_rows(gates_x.device)
        ctx.schedule = schedule
        ctx.save_for_backward(acts, cells, tanh_c, out, h_raw, hm, h0, c0, w_hh, w_hr, mask, final)
        ctx.set_materialize_grads(False)
        return out, out.index_select(0, final), cells.index_select(0, final)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_hn, d_cn):
        acts, cells, tanh_c, out, h_raw, hm, h0, c0, w_hh, w_hr, mask, final = ctx.saved_tensors
        schedule: _Schedule = ctx.schedule
        needs = ctx.needs_input_grad
        N, H = cells.shape
        blocks = schedule.previous_blocks()

        # Per row, the factors that turn d(c_t) into the pre-activation gradients of
        # (i, f, g), d(h_t) into that of o, and d(h_t) into d(c_t).
        i, f, g, o = acts.split(H, 1)
        one = acts.new_ones(())
        factors = torch.addcmul(acts, acts, acts, value=-1)  # sigmoid' = a (1 - a)
        torch.addcmul(one, g, g, value=-1, out=factors[:, 2 * H : 3 * H])  # tanh' = 1 - a^2
        factors[:, :H] *= g
        _mul_previous_(factors[:, H : 2 * H], cells, c0, blocks)
        factors[:, 2 * H : 3 * H] *= i
        factors[:, 3 * H :] *= tanh_c
        dc_from_h = torch.addcmul(o, o, tanh_c * tanh_c, value=-1)

        d_h = _output_grad(d_out, out)
        if d_hn is not None:
            d_h.index_add_(0, final, d_hn)
        d_c = cells.new_zeros(N, H)
        if d_cn is not None:
            d_c.index_add_(0, final, d_cn)
        d_gates = acts.new_empty(N, 4 * H)
        d_h0 = h0.new_zeros(h0.shape)
        d_c0 = c0.new_zeros(c0.shape)
        need_mask = needs[5]
        d_hm = _masked_state_grad_buffer(need_mask, mask, hm)

        split = schedule.split
        DH, DC, DG, DCH, FG = map(split, (d_h, d_c, d_gates, dc_from_h, f))
        DG3 = split(d_gates[:, : 3 * H].view(N, 3, H))
        FAC3 = split(factors[:, : 3 * H].view(N, 3, H))
        DGO, FACO = split(d_gates[:, 3 * H :]), split(factors[:, 3 * H :])
        DHM = split(d_hm) if d_hm is not None else None
        masks = schedule.step_masks(mask)
        if w_hr is not None:
            d_h_raw = cells.new_empty(schedule.batch, H)
            d_h_raw_by_size = {b: d_h_raw[:b] for b in set(schedule.sizes)}

        for step in reversed(schedule.steps):
            t = step.t
            dh = DH[t]
            if w_hr is not None:
                dh = torch.mm(dh, w_hr, out=d_h_raw_by_size[step.size])
            dc = DC[t].addcmul_(dh, DCH[t])
            torch.mul(FAC3[t], dc.unsqueeze(1), out=DG3[t])
            torch.mul(FACO[t], dh, out=DGO[t])
            _add_product(_previous_targets(DC, d_c0, step), dc, FG[t])
            _recurrent_back(
                _previous_targets(DH, d_h0, step), DG[t], w_hh, masks[t],
                None if DHM is None else DHM[t],
            )

        d_w_hh = d_w_hr = d_mask = None
        h_prev = None
        if (needs[3] and hm is None) or need_mask:
            h_prev = _gather_previous(out, h0, blocks)
        if needs[3]:
            d_w_hh = _weight_grad(d_gates, h_prev if hm is None else hm)
        if need_mask:
            d_mask = _mask_grad(schedule, mask, d_hm, h_prev)
        if w_hr is not None and needs[4]:
            d_w_hr = d_h.t().mm(h_raw)
        return d_gates, d_h0, d_c0, d_w_hh, d_w_hr, d_mask, None


def lstm_recurrence(
    gates_x: Tensor,
    batch_sizes: Sequence[int],
    h0: Tensor,
    c0: Tensor,
    w_hh: Tensor,
    w_hr: Tensor | None,
    hidden_mask: Tensor | None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """The LSTM recurrence of one layer and direction (contract in :mod:`rnndrop.kernels`)."""
    schedule = _Schedule(batch_sizes, reverse)
    _check_mask(hidden_mask, 4, h0.shape[1], schedule)
    out, h_n, c_n = _LSTMRecurrence.apply(
        gates_x.contiguous(), h0.contiguous(), c0.contiguous(), w_hh, w_hr, hidden_mask, schedule
    )
    return out, h_n, c_n


# -------------------------------------------------------------------- GRU


class _GRURecurrence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, gates_x, h0, w_hh, b_hh, mask, schedule):
        N, H = gates_x.shape[0], h0.shape[1]
        acts = gates_x.new_empty(N, 3 * H)  # sigmoid(r), sigmoid(z), n
        gates_h = gates_x.new_empty(N, 3 * H)  # W_hh (h * m) + b_hh
        out = gates_x.new_empty(N, H)
        hm = None if mask is None else gates_x.new_empty(N, *mask.shape[2:])

        split = schedule.split
        OUT, GH = split(out), split(gates_h)
        GX_RZ, GX_N = split(gates_x[:, : 2 * H]), split(gates_x[:, 2 * H :])
        GH_RZ, GH_N = split(gates_h[:, : 2 * H]), split(gates_h[:, 2 * H :])
        A_RZ, A_N = split(acts[:, : 2 * H]), split(acts[:, 2 * H :])
        A_R, A_Z = split(acts[:, :H]), split(acts[:, H : 2 * H])
        HM = split(hm) if hm is not None else None
        masks = schedule.step_masks(mask)
        w_hh_t = w_hh.t().contiguous()
        for step in schedule.steps:
            t = step.t
            h_prev = _previous(OUT, h0, step)
            m = masks[t]
            hm_t = h_prev if m is None else _masked_state(h_prev, m, HM[t])
            _recurrent_into(GH[t], b_hh, hm_t, w_hh_t)
            torch.add(GX_RZ[t], GH_RZ[t], out=A_RZ[t]).sigmoid_()
            n = torch.addcmul(GX_N[t], A_R[t], GH_N[t], out=A_N[t]).tanh_()
            h = torch.sub(h_prev, n, out=OUT[t])
            torch.addcmul(n, A_Z[t], h, out=h)
        final = schedule.final_rows(gates_x.device)
        ctx.schedule = schedule
        ctx.save_for_backward(acts, gates_h, out, hm, h0, w_hh, mask, final)
        ctx.set_materialize_grads(False)
        return out, out.index_select(0, final)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out, d_hn):
        acts, gates_h, out, hm, h0, w_hh, mask, final = ctx.saved_tensors
        schedule: _Schedule = ctx.schedule
        needs = ctx.needs_input_grad
        N, H = out.shape
        h_prev = _gather_previous(out, h0, schedule.previous_blocks())

        # d(h_t) times these factors gives the gradient of W_hh (h * m) + b_hh;
        # d(h_t) * d_n_pre is that of the n gate's input part.
        r, z, n = acts.split(H, 1)
        d_n_pre = torch.addcmul(acts.new_ones(()), n, n, value=-1)  # tanh' = 1 - n^2
        d_n_pre.addcmul_(z, d_n_pre, value=-1)  # times (1 - z)
        factors = torch.addcmul(acts, acts, acts, value=-1)  # sigmoid' = a (1 - a)
        factors[:, :H] *= d_n_pre
        factors[:, :H] *= gates_h[:, 2 * H :]
        factors[:, H : 2 * H] *= h_prev - n
        torch.mul(d_n_pre, r, out=factors[:, 2 * H :])

        d_h = _output_grad(d_out, out)
        if d_hn is not None:
            d_h.index_add_(0, final, d_hn)
        d_gates_h = acts.new_empty(N, 3 * H)
        d_h0 = h0.new_zeros(h0.shape)
        need_mask = needs[4]
        d_hm = _masked_state_grad_buffer(need_mask, mask, hm)

        split = schedule.split
        DH, Z = split(d_h), split(z)
        DG, DG3, FAC3 = split(d_gates_h), split(d_gates_h.view(N, 3, H)), split(factors.view(N, 3, H))
        DHM = split(d_hm) if d_hm is not None else None
        masks = schedule.step_masks(mask)
        for step in reversed(schedule.steps):
            t = step.t
            dh = DH[t]
            torch.mul(FAC3[t], dh.unsqueeze(1), out=DG3[t])
            targets = _previous_targets(DH, d_h0, step)
            _add_product(targets, dh, Z[t])
            _recurrent_back(targets, DG[t], w_hh, masks[t], None if DHM is None else DHM[t])

        d_gates_x = d_w_hh = d_b_hh = d_mask = None
        if needs[2]:
            d_w_hh = _weight_grad(d_gates_h, h_prev if hm is None else hm)
        if needs[3]:
            d_b_hh = d_gates_h.sum(0)
        if need_mask:
            d_mask = _mask_grad(schedule, mask, d_hm, h_prev)
        if needs[0]:  # the r and z parts are those of gates_h: reuse the buffer
            d_gates_x = d_gates_h
            torch.mul(d_h, d_n_pre, out=d_gates_x[:, 2 * H :])
        return d_gates_x, d_h0, d_w_hh, d_b_hh, d_mask, None


def gru_recurrence(
    gates_x: Tensor,
    batch_sizes: Sequence[int],
    h0: Tensor,
    w_hh: Tensor,
    b_hh: Tensor | None,
    hidden_mask: Tensor | None,
    reverse: bool = False,
) -> tuple[Tensor, Tensor]:
    """The GRU recurrence of one layer and direction (contract in :mod:`rnndrop.kernels`)."""
    schedule = _Schedule(batch_sizes, reverse)
    _check_mask(hidden_mask, 3, h0.shape[1], schedule)
    out, h_n = _GRURecurrence.apply(
        gates_x.contiguous(), h0.contiguous(), w_hh, b_hh, hidden_mask, schedule
    )
    return out, h_n
