"""Masked weights that cuDNN runs without copying them: views of one fresh buffer laid out as the
module's own.

cuDNN runs an RNN from one flat buffer of its weights. ``flatten_parameters`` puts a module's
parameters into such a buffer (each a view at the offset cuDNN expects), and before every call
torch checks that the weights it is given are views of one storage at those offsets; weights
that are not (``W_hh * mask``, computed in every forward pass) are first copied into a new
buffer (``_cudnn_rnn_flatten_weight``, one copy per weight and a host cost of its own, with a
warning). Here the masked weights are written into a copy of the stretch of the module's buffer
the weights occupy (the whole buffer for a whole stack; one layer's block for a call of that
layer alone), each weight a view at its own offset from the first weight, so the check passes:

    buffer = copy of the weights' stretch of the buffer    (one copy)
    view_w = buffer[offset(w) - offset(first)]
           = w * mask_w  (dropped)                         (one product per dropped weight)
           = w           (the others, copied with the buffer)

Backward: ``dw = d(view_w) * mask_w`` for a dropped weight, ``d(view_w)`` for the others, and
``d mask_w`` = ``d(view_w) * w`` summed to the mask's shape where the mask needs a gradient
(learned Gaussian noise). Only where the weights are such views (:func:`in_one_buffer`);
elsewhere the caller multiplies the weights as before. :class:`~rnndrop.WeightDrop` uses it for
a wrapped ``nn.LSTM`` / ``nn.GRU`` (:func:`masked_views`), ``mask_scope="batch"`` for the masks
it folds into a whole stack's weights, and a layer of a stack called alone (no mask: its block
of the buffer, from offset 0 of a buffer of its own) through :func:`masked_in_one_buffer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["in_one_buffer", "masked_in_one_buffer", "masked_views", "shares_one_buffer"]

#: Devices whose RNNs run from a flat weight buffer (tests add "cpu" to run the views there).
FLAT_DEVICES = {"cuda"}


def in_one_buffer(weights: Sequence[Tensor]) -> bool:
    """Whether ``weights`` are views of one storage of one dtype on a device of
    :data:`FLAT_DEVICES` (``flatten_parameters`` put them there), outside autocast (which casts
    the weights into new tensors anyway), lying close together there: the stretch of storage
    they span is at most twice their size (not a few weights of a whole model's flat buffer,
    which would be copied at every call)."""
    first = weights[0]
    if first.device.type not in FLAT_DEVICES or torch.is_autocast_enabled(first.device.type):
        return False
    pointer = first.untyped_storage().data_ptr()
    if not all(w.untyped_storage().data_ptr() == pointer and w.dtype == first.dtype for w in weights):
        return False
    begin, end = _span(weights)
    return end - begin <= 2 * sum(w.numel() for w in weights)


def _span(weights: Sequence[Tensor]) -> tuple[int, int]:
    """The first and one past the last element of the storage that ``weights`` occupy."""
    begin = min(w.storage_offset() for w in weights)
    end = max(w.storage_offset() + sum((n - 1) * s for n, s in zip(w.shape, w.stride())) + 1 for w in weights)
    return begin, end


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


def masked_in_one_buffer(weights: Sequence[Tensor], masks: Sequence[Tensor | None]) -> tuple[Tensor, ...]:
    """``weights[i] * masks[i]`` (``weights[i]`` where the mask is None), each a view of one new
    buffer laid out as the stretch of storage ``weights`` share (:func:`in_one_buffer` must hold),
    from its first weight on: a buffer of its own, whose first weight starts it as cuDNN wants
    (a layer's block of a stack's buffer, say). A mask broadcasts against its weight.
    Differentiable with respect to the weights and the masks."""
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
        begin, end = _span(weights)
        buffer = weights[0].new_empty(0).set_(weights[0].untyped_storage(), begin, (end - begin,)).clone()
        views = []
        for weight, k in zip(weights, which):
            view = buffer.as_strided(weight.shape, weight.stride(), weight.storage_offset() - begin)
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
