"""The oracle every layer test compares against: nn.LSTM / nn.GRU with the same weights.

``plain_twin`` builds it, ``check_against_oracle`` compares outputs, final states and
the gradients of inputs, initial states and weights.
"""

import torch
from torch import nn

from tests.helpers import assert_close

__all__ = ["assert_close", "check_against_oracle", "grads", "plain_twin", "random_state"]


def plain_twin(layer: nn.RNNBase, weights: dict | None = None) -> nn.RNNBase:
    """The plain nn.LSTM / nn.GRU with ``layer``'s configuration and weights
    (``weights`` replaces some, by name). Only nn.LSTM's own parameters are copied."""
    plain_cls = nn.LSTM if isinstance(layer, nn.LSTM) else nn.GRU
    kw = {"proj_size": layer.proj_size} if plain_cls is nn.LSTM else {}
    w = layer.weight_ih_l0
    plain = plain_cls(
        layer.input_size,
        layer.hidden_size,
        layer.num_layers,
        bias=layer.bias,
        batch_first=layer.batch_first,
        bidirectional=layer.bidirectional,
        device=w.device,
        dtype=w.dtype,
        **kw,
    )
    state = {n: getattr(layer, n).detach() for n in layer._flat_weights_names}
    state.update(weights or {})
    plain.load_state_dict(state)
    return plain.train(layer.training)


def random_state(layer: nn.RNNBase, batch: int | None, dtype=torch.float32, requires_grad=True):
    """A random ``hx`` for ``layer`` (``batch=None``: unbatched), leaves with gradients."""
    D = 2 if layer.bidirectional else 1
    L = layer.num_layers * D
    out_size = getattr(layer, "proj_size", 0) or layer.hidden_size
    shape = (L, batch) if batch else (L,)
    h = torch.randn(*shape, out_size, dtype=dtype, requires_grad=requires_grad)
    if isinstance(layer, nn.GRU):
        return h
    return h, torch.randn(*shape, layer.hidden_size, dtype=dtype, requires_grad=requires_grad)


def grads(out, state, inputs, module):
    """Gradients of a fixed random functional of the outputs w.r.t. inputs and weights."""
    data = out.data if hasattr(out, "batch_sizes") else out
    g = torch.Generator().manual_seed(1)
    loss = (data * torch.randn(data.shape, generator=g, dtype=data.dtype)).sum()
    for s in state if isinstance(state, tuple) else (state,):
        loss = loss + (s * torch.randn(s.shape, generator=g, dtype=s.dtype)).sum()
    targets = [t for t in inputs if t.requires_grad] + list(module.parameters())
    return torch.autograd.grad(loss, targets)


def check_against_oracle(ref, ours, x, hx, masks=None, atol=1e-5, rtol=1e-5):
    """``ours(x, hx[, masks])`` equals ``ref(x, hx)``: outputs, final states, gradients."""
    out_ref, state_ref = ref(x, hx)
    out, state = ours(x, hx, masks=masks) if masks is not None else ours(x, hx)
    assert_close(out, out_ref, atol, rtol)
    assert_close(state, state_ref, atol, rtol)
    leaves = [x] if isinstance(x, torch.Tensor) else []
    leaves += list(hx) if isinstance(hx, tuple) else ([hx] if hx is not None else [])
    assert_close(grads(out, state, leaves, ours), grads(out_ref, state_ref, leaves, ref), atol, rtol)
