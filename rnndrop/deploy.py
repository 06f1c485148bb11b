"""Deployment: a model with rnndrop's layers as the plain torch model it computes in eval mode.

In eval mode no mask is drawn, so a :class:`~rnndrop.VariationalLSTM` computes exactly its
``nn.LSTM``'s function. :func:`to_torch` makes that explicit: a copy of the model in which every
rnndrop recurrent layer is an ``nn.LSTM`` / ``nn.GRU`` (:meth:`VariationalRNNStack.to_plain`),
every sparse layer its pruned plain module, and every :class:`~rnndrop.WeightDrop` the module it
wraps. Tools that recognise ``nn.LSTM`` by type then apply to the copy:
``torch.ao.quantization.quantize_dynamic`` (which leaves rnndrop's layers in float: it maps types
and refuses subclasses), the legacy ONNX exporter, and anything else written for torch's modules.

The copy is for inference: it draws no noise, takes no ``masks`` and keeps no KL terms. Train and
run Monte-Carlo prediction with the original.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch import nn

from rnndrop.compiling import CompiledModel
from rnndrop.recurrent import VariationalRNNStack, compact_weights
from rnndrop.sparse import Sparsified
from rnndrop.validation import check_instance
from rnndrop.weight_drop import WeightDrop

__all__ = ["prune", "to_torch"]


def _replaced_copy(model: nn.Module, replacement: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """A deep copy of ``model`` in which every module that ``replacement`` maps to a module is
    that module (the copy itself, where it maps the whole model); None keeps a module and walks
    its children. A module registered in two places (twice in one parent, or shared by two) is
    replaced by one module in both: ``named_children`` would skip the repeat, and replacing each
    place on its own would untie what the model shares."""
    converted = copy.deepcopy(model)
    whole = replacement(converted)
    if whole is not None:
        return whole
    replacements: dict[int, nn.Module | None] = {}
    for module in list(converted.modules()):
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            if id(child) not in replacements:
                replacements[id(child)] = replacement(child)
            if replacements[id(child)] is not None:
                setattr(module, name, replacements[id(child)])
    return converted


def _wrapped(module: nn.Module) -> nn.Module | None:
    """The module a wrapper stands for in eval mode, else None: :class:`~rnndrop.WeightDrop`'s
    (exactly ``module(*args)`` there), ``DistributedDataParallel``'s and ``DataParallel``'s, and a
    compiled one's (:class:`~rnndrop.CompiledModel`, or
    torch.compile's ``OptimizedModule``, known by name: importing torch._dynamo takes seconds),
    whose copy would go on running the compiled function of the module it was made from (bound
    to it, in training mode): the copy is what it wraps, uncompiled."""
    if isinstance(module, (WeightDrop, CompiledModel, nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return module.module  # a data-parallel copy would carry its process group into deployment
    inner = getattr(module, "_orig_mod", None)
    if type(module).__name__ == "OptimizedModule" and isinstance(inner, nn.Module):
        return inner
    return None


def _plain(module: nn.Module) -> nn.Module | None:
    """The plain module replacing ``module``, or None to keep it (and convert its children)."""
    inner = _wrapped(module)
    if inner is not None:
        return _plain(inner) or inner
    if isinstance(module, VariationalRNNStack):
        return module.to_plain()
    if isinstance(module, Sparsified):
        return module.to_dense()
    return None


def to_torch(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in eval mode with rnndrop's layers replaced by the torch modules
    computing their eval-mode function.

    ``VariationalLSTM`` / ``GaussianLSTM`` / ``SparseLSTM`` -> ``nn.LSTM`` (GRUs -> ``nn.GRU``),
    ``SparseLinear`` -> ``nn.Linear``, ``SparseEmbedding`` -> ``nn.Embedding``, ``WeightDrop(m)``
    -> ``m``. Other modules are copied as they are (``LockedDropout`` and ``EmbeddingDropout``
    are the identity in eval mode and export as such). In eval mode the copy's outputs equal
    ``model``'s; ``model`` itself is not changed. A compiled model (:func:`~rnndrop.compile_model`,
    ``torch.compile``, whole or a part of it) becomes the copy of what it compiles, uncompiled
    (compile the copy again where wanted); a data-parallel one (``DistributedDataParallel``,
    ``DataParallel``) the copy of its ``module``. Raises ``TypeError`` for a layer whose class overrides
    the forward pass (see :meth:`~rnndrop.VariationalLSTM.to_plain`).

    Example::

        deployed = rnndrop.to_torch(model)
        quantized = torch.ao.quantization.quantize_dynamic(deployed, {nn.LSTM, nn.Linear})
    """
    check_instance("model", model, nn.Module, "an nn.Module")
    while (inner := _wrapped(model)) is not None:  # a compiled (or WeightDrop) model: what it wraps
        model = inner
    converted = _replaced_copy(model, _plain)
    compact_weights(converted)  # the deep copy's recurrent weights in one buffer again (cuDNN)
    return converted.eval()


def prune(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every sparse layer replaced by its plain pruned counterpart.

    ``SparseLSTM`` -> ``nn.LSTM``, ``SparseGRU`` -> ``nn.GRU``, ``SparseLinear`` ->
    ``nn.Linear``, ``SparseEmbedding`` -> ``nn.Embedding``, with the weights over the
    threshold set to zero and no ``log_sigma2``. In eval mode the copy computes what
    ``model`` computes in eval mode. ``model`` itself is not changed. A sparse layer registered in
    two places is one pruned layer in both. A sparse weight tied to a plain module (an embedding
    and its decoder) is untied in the copy: the plain module keeps the whole weight it read, the
    pruned layer its pruned copy.
    """
    check_instance("model", model, nn.Module, "an nn.Module")
    return _replaced_copy(model, lambda module: module.to_dense() if isinstance(module, Sparsified) else None)
