"""Masked weights that cuDNN runs without copying them: views of one fresh buffer laid out as
cuDNN lays out the weights of that call.

cuDNN runs an RNN from one flat buffer of its weights. ``flatten_parameters`` puts a module's
parameters into such a buffer (each a view at the offset cuDNN expects), and before every call
torch checks that the weights it is given are views of one storage at those offsets; weights
that are not (``W_hh * mask``, computed in every forward pass) are first copied into a new
buffer (``_cudnn_rnn_flatten_weight``, one copy per weight and a host cost of its own, with a
warning). cuDNN's buffer holds the matrices of every layer and direction first, in order, then
their biases (read from cuDNN 9 on an H200, 2026-11-26): a layer's block is two stretches of the
stack's buffer, and a call of that layer alone wants them side by side. So the weights are
written into a new buffer holding the stretches of storage they cover without a gap ("runs"),
packed in storage order; for a whole stack that is its whole buffer, as it was:

    buffer = the weights' runs of the module's buffer, packed    (one copy a run)
    view_w = buffer[packed offset of w]
           = w * mask_w  (dropped)                               (one product per dropped weight)
           = w           (the others, copied with their run)

Backward: ``dw = d(view_w) * mask_w`` for a dropped weight, ``d(view_w)`` for the others, and
``d mask_w`` = ``d(view_w) * w`` summed to the mask's shape where the mask needs a gradient
(learned Gaussian noise). Only where the weights are such views (:func:`in_one_buffer`);
elsewhere they are multiplied (:func:`masked_weights`). :class:`~rnndrop.WeightDrop` uses it for
a wrapped ``nn.LSTM`` / ``nn.GRU`` (:func:`masked_views`); ``mask_scope="batch"`` for the masks
it folds into a whole stack's weights, and a layer of a stack called alone (no mask), through
:func:`masked_weights`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

__all__ = [
    "forward_with_weights",
    "in_one_buffer",
    "masked_in_one_buffer",
    "masked_views",
    "masked_weights",
    "runs_without_hooks",
    "shares_one_buffer",
]

#: Devices whose RNNs run from a flat weight buffer (tests add "cpu" to run the views there).
FLAT_DEVICES = {"cuda"}


def in_one_buffer(weights: Sequence[Tensor]) -> bool:
    """Whether ``weights`` are contiguous views of one storage of one dtype on a device of
    :data:`FLAT_DEVICES` (``flatten_parameters`` put them there), none overlapping another,
    outside autocast (which casts the weights into new tensors anyway)."""
    first = weights[0]
    if first.device.type not in FLAT_DEVICES or torch.is_autocast_enabled(first.device.type):
        return False
    pointer = first.untyped_storage().data_ptr()
    if not all(w.untyped_storage().data_ptr() == pointer and w.dtype == first.dtype and w.is_contiguous()
               for w in weights):
        return False
    extents = sorted((w.storage_offset(), w.storage_offset() + w.numel()) for w in weights)
    return all(begin >= end for (_, end), (begin, _) in itertools.pairwise(extents))


def _runs(weights: Sequence[Tensor]) -> list[tuple[int, int]]:
    """The stretches ``(begin, end)`` of storage that ``weights`` (:func:`in_one_buffer`) cover
    without a gap, in storage order."""
    runs: list[tuple[int, int]] = []
    for begin, end in sorted((w.storage_offset(), w.storage_offset() + w.numel()) for w in weights):
        if runs and runs[-1][1] == begin:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((begin, end))
    return runs


def masked_weights(weights: Sequence[Tensor], masks: Sequence[Tensor | None]) -> list[Tensor]:
    """``weights[i] * masks[i]`` (``weights[i]`` where the mask is None) as cuDNN runs a call of
    them without copying them: views of one packed copy (:func:`masked_in_one_buffer`) where they
    are :func:`in_one_buffer`, themselves where no mask multiplies them and they already are a
    buffer of their own from its start (a whole module's), plain products elsewhere (cuDNN then
    copies them itself). A layer of a stack called alone gets its matrices and biases side by side
    this way (no masks)."""
    weights = list(weights)
    if not in_one_buffer(weights):
        return [w if m is None else w * m for w, m in zip(weights, masks)]
    if all(m is None for m in masks) and _runs(weights) == [(0, sum(w.numel() for w in weights))]:
        return weights
    return list(masked_in_one_buffer(weights, masks))


def shares_one_buffer(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` whose flat weights are
    :func:`in_one_buffer`."""
    if type(module) not in (nn.LSTM, nn.GRU, nn.RNN):
        return False
    return in_one_buffer([getattr(module, name) for name in module._flat_weights_names])


def masked_views(module: nn.Module, masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every flat weight of ``module`` (:func:`shares_one_buffer` must hold) by name, the
    weights named in ``masks`` multiplied by their mask (:func:`masked_in_one_buffer`)."""
    names = list(module._flat_weights_names)
    weights = [getattr(module, name) for name in names]
    return dict(zip(names, masked_in_one_buffer(weights, [masks.get(name) for name in names])))


#: torch's fused op of each ``nn.RNNBase.mode``.
_FUSED_OPS = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}
#: nn.Module's per-module and global hook registries: a module with any hook goes through its own
#: forward call (a registry torch renamed counts as holding hooks).
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def runs_without_hooks(module: nn.Module) -> bool:
    """Whether neither ``module`` nor nn.Module's global registries hold a forward or backward
    hook (calling its forward pass directly would skip them)."""
    registries = [getattr(module, name, None) for name in _HOOKS]
    registries += [getattr(nn.modules.module, "_global" + name, None) for name in _HOOKS]
    return all(registry is not None and not registry for registry in registries)


def forward_with_weights(
    module: nn.RNNBase, weights: Sequence[Tensor], input: Tensor | PackedSequence, hx: Any = None
) -> tuple[Tensor | PackedSequence, Any]:
    """``module(input, hx)`` of a plain ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` with ``weights`` (its
    flat weights, in ``_flat_weights_names``' order) in place of its own: torch's fused op called
    as the module's forward calls it (packed, unbatched and batch-first input, ``hx`` by default
    zeros, torch's own checks of ``hx``). The module's forward itself, given weights that are not
    its parameters (``torch.func.functional_call``), would first flatten them into a new buffer
    (``flatten_parameters``, a copy and about a millisecond of host time on a GPU machine, at every
    call) and so undo :func:`masked_views`. No module hooks run (see :func:`runs_without_hooks`)."""
    lstm = module.mode == "LSTM"
    packed = isinstance(input, PackedSequence)
    batch_sizes = sorted_indices = unsorted_indices = None
    unbatched = False
    if packed:
        x, batch_sizes, sorted_indices, unsorted_indices = input
        batch = int(batch_sizes[0])
    else:
        if input.dim() not in (2, 3):
            raise ValueError(f"{module.mode}: Expected input to be 2D or 3D, got {input.dim()}D instead")
        x, unbatched = input, input.dim() == 2
        if unbatched:
            x = x.unsqueeze(0 if module.batch_first else 1)
        batch = x.size(0 if module.batch_first else 1)
    if hx is None:
        states = 2 * module.num_layers if module.bidirectional else module.num_layers
        sizes = (module.proj_size or module.hidden_size, module.hidden_size)[: 2 if lstm else 1]
        zeros = tuple(torch.zeros(states, batch, size, dtype=x.dtype, device=x.device) for size in sizes)
        hx = zeros if lstm else zeros[0]
    elif not packed:
        parts = hx if lstm else (hx,)
        want = 2 if unbatched else 3
        if any(part.dim() != want for part in parts):
            names = "hx and cx" if lstm else "hx"
            raise RuntimeError(f"For {'unbatched 2-D' if unbatched else 'batched 3-D'} input, {names} should "
                               f"also be {want}-D but got {tuple(part.dim() for part in parts)}-D tensors")
        if unbatched:
            hx = tuple(part.unsqueeze(1) for part in parts) if lstm else hx.unsqueeze(1)
    module.check_forward_args(x, hx, batch_sizes)
    hx = module.permute_hidden(hx, sorted_indices)
    op = _FUSED_OPS[module.mode]
    common = (list(weights), module.bias, module.num_layers, float(module.dropout), module.training,
              module.bidirectional)
    result = op(x, batch_sizes, hx, *common) if packed else op(x, hx, *common, module.batch_first)
    out, hidden = result[0], (tuple(result[1:]) if lstm else result[1])
    if packed:
        return PackedSequence(out, batch_sizes, sorted_indices, unsorted_indices), module.permute_hidden(
            hidden, unsorted_indices)
    if unbatched:
        out = out.squeeze(0 if module.batch_first else 1)
        hidden = tuple(h.squeeze(1) for h in hidden) if lstm else hidden.squeeze(1)
    return out, hidden


def masked_in_one_buffer(weights: Sequence[Tensor], masks: Sequence[Tensor | None]) -> tuple[Tensor, ...]:
    """``weights[i] * masks[i]`` (``weights[i]`` where the mask is None), each a view of one new
    buffer holding the runs of storage ``weights`` cover (:func:`in_one_buffer` must hold) packed
    in storage order, as cuDNN lays out a call of these weights alone (the module docstring). A
    mask broadcasts against its weight. Differentiable with respect to the weights and the masks."""
    which = []
    dropped: list[Tensor] = []
    for mask in masks:
        which.append(len(dropped) if mask is not None else -1)
        if mask is not None:
            dropped.append(mask)
    return _MaskedViews.apply(tuple(which), *weights, *dropped)


class _MaskedViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx, which: Sequence[int], *tensors: Tensor) -> tuple[Tensor, ...]:
        weights, masks = tensors[: len(which)], tensors[len(which) :]
        runs = _runs(weights)
        storage = weights[0].new_empty(0).set_(weights[0].untyped_storage())
        if len(runs) == 1:
            buffer = storage[runs[0][0] : runs[0][1]].clone()
        else:
            buffer = torch.cat([storage[begin:end] for begin, end in runs])
        packed, start = {}, 0  # a run's first element -> its offset in ``buffer``
        for begin, end in runs:
            packed[begin], start = start, start + end - begin
        run_of = [max(b for b, _ in runs if b <= w.storage_offset()) for w in weights]
        views = []
        for weight, k, begin in zip(weights, which, run_of):
            offset = packed[begin] + weight.storage_offset() - begin
            view = buffer.as_strided(weight.shape, weight.stride(), offset)
            if k >= 0:
                torch.mul(weight, masks[k], out=view)
            views.append(view)
        ctx.which = which
        # The weights only where a mask needs its gradient (d mask = d view * weight).
        mask_grads = ctx.needs_input_grad[1 + len(which):]
        ctx.save_for_backward(*masks, *(w if k >= 0 and mask_grads[k] else None
                                        for w, k in zip(weights, which)))
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        which = ctx.which
        saved = ctx.saved_tensors
        masks, weights = saved[: len(saved) - len(which)], saved[len(saved) - len(which) :]
        weight_grads = [g if k < 0 or g is None else g * masks[k] for g, k in zip(grads, which)]
        mask_grads: list[Tensor | None] = [None] * len(masks)
        for g, k, w in zip(grads, which, weights):
            if k >= 0 and g is not None and w is not None:
                mask_grads[k] = (g * w).sum_to_size(masks[k].shape)
        return (None, *weight_grads, *mask_grads)
