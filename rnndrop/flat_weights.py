"""Masked weights that cuDNN runs without copying them: views of one fresh buffer laid out as the
module's own.

cuDNN runs an RNN from one flat buffer of its weights. ``flatten_parameters`` puts a module's
parameters into such a buffer (each a view at the offset cuDNN expects), and before every call
torch checks that the weights it is given are views of one storage at those offsets; weights
that are not (``W_hh * mask``, computed in every forward pass) are first copied into a new
buffer (``_cudnn_rnn_flatten_weight``, one copy per weight and a host cost of its own, with a
warning). Here the masked weights are written into a copy of the module's buffer, each weight a
view at its own parameter's offset, so the check passes:

    buffer = copy of the module's flat buffer              (one copy)
    view_w = buffer[offset(w)]  = w * mask_w  (dropped)    (one product per dropped weight)
                                = w           (the others, copied with the buffer)

Backward: ``dw = d(view_w) * mask_w`` for a dropped weight, ``d(view_w)`` for the others. Only
where the module's own weights are such views (:func:`shares_one_buffer`); elsewhere the
caller multiplies the weights as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

__all__ = ["masked_views", "shares_one_buffer"]

#: Devices whose RNNs run from a flat weight buffer (tests add "cpu" to run the views there).
FLAT_DEVICES = {"cuda"}


def shares_one_buffer(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` on a device of
    :data:`FLAT_DEVICES` whose weights are all views of one storage (``flatten_parameters`` did
    it), outside autocast (which casts the weights into new tensors anyway)."""
    if type(module) not in (nn.LSTM, nn.GRU, nn.RNN):
        return False
    weights = [getattr(module, name) for name in module._flat_weights_names]
    first = weights[0]
    if first.device.type not in FLAT_DEVICES or torch.is_autocast_enabled(first.device.type):
        return False
    storage = first.untyped_storage().data_ptr()
    return all(w.untyped_storage().data_ptr() == storage and w.dtype == first.dtype for w in weights)


def masked_views(module: nn.Module, masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every flat weight of ``module`` (:func:`shares_one_buffer` must hold) by name, as a view
    of one new buffer laid out as the module's, the weights named in ``masks`` multiplied by
    their mask (which broadcasts against the weight). Differentiable with respect to the
    weights; the masks get no gradient."""
    names = list(module._flat_weights_names)
    weights = [getattr(module, name) for name in names]
    which = tuple(list(masks).index(name) if name in masks else -1 for name in names)
    views = _MaskedViews.apply(which, *weights, *masks.values())
    return dict(zip(names, views))


class _MaskedViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx, which: Sequence[int], *tensors: Tensor) -> tuple[Tensor, ...]:
        weights, masks = tensors[: len(which)], tensors[len(which) :]
        first = weights[0]
        whole = first.new_empty(0).set_(first.untyped_storage(), 0,
                                        (first.untyped_storage().nbytes() // first.element_size(),))
        buffer = whole.clone()
        views = []
        for weight, k in zip(weights, which):
            view = buffer.as_strided(weight.shape, weight.stride(), weight.storage_offset())
            if k >= 0:
                torch.mul(weight, masks[k], out=view)
            views.append(view)
        ctx.which = which
        ctx.save_for_backward(*masks)
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        masks = ctx.saved_tensors
        weight_grads = [g if k < 0 or g is None else g * masks[k] for g, k in zip(grads, ctx.which)]
        return (None, *weight_grads, *(None for _ in masks))
