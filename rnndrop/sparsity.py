"""Counting and removing the zeros of sparse layers: :func:`sparsity_report`, :func:`prune`.

A sparse layer (:mod:`rnndrop.sparse`) is a :class:`Sparsified` module: it names the
weights it sparsifies, says which entries survive in eval mode (``keep_mask``), keeps
a ``log_sigma2_<name>`` parameter per weight, and gives its plain counterpart with the
zeros (``to_dense``).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import Tensor, nn

from rnndrop.validation import check_instance

__all__ = ["LayerSparsity", "Sparsified", "SparsityReport", "prune", "sparsity_report"]


class Sparsified(ABC):
    """A module whose weights sparse variational dropout zeroes (see the module docstring)."""

    @abstractmethod
    def sparse_weight_names(self) -> tuple[str, ...]:
        """Names of the weights this module sparsifies."""

    @abstractmethod
    def keep_mask(self, name: str) -> Tensor:
        """Bool tensor, the weight's shape: True where the weight survives in eval mode."""

    @abstractmethod
    def to_dense(self) -> nn.Module:
        """The plain module (``nn.LSTM``, ``nn.Linear``, ...) holding the pruned weights."""


@dataclass(frozen=True)
class LayerSparsity:
    """One sparsified weight: its qualified name, its size and how many entries are zero."""

    name: str
    total: int
    zeros: int

    @property
    def sparsity(self) -> float:
        return self.zeros / self.total


@dataclass(frozen=True)
class SparsityReport:
    """Sparsity of every sparsified weight of a model (eval-mode zeros).

    ``compression`` is the number of sparsified weights over the number that remain
    nonzero; ``dense_params`` counts the model's other parameters (biases, layers
    that are not sparse, excluding ``log_sigma2``), which pruning keeps.
    """

    layers: tuple[LayerSparsity, ...]
    dense_params: int

    @property
    def total(self) -> int:
        return sum(layer.total for layer in self.layers)

    @property
    def zeros(self) -> int:
        return sum(layer.zeros for layer in self.layers)

    @property
    def sparsity(self) -> float:
        return self.zeros / self.total if self.total else 0.0

    @property
    def compression(self) -> float:
        """Sparsified weights / nonzero sparsified weights (``inf`` when all are zero; 1 for a
        model without sparse layers, of which nothing is removed)."""
        if not self.total:
            return 1.0
        kept = self.total - self.zeros
        return self.total / kept if kept else float("inf")

    @property
    def model_compression(self) -> float:
        """All parameters of the pruned model / its nonzero parameters (dense ones kept)."""
        return (self.total + self.dense_params) / (self.total - self.zeros + self.dense_params)

    def __str__(self) -> str:
        width = max([len(layer.name) for layer in self.layers] + [6])
        lines = [f"{'weight':<{width}}  {'size':>10}  {'zeros':>10}  sparsity"]
        lines += [f"{layer.name:<{width}}  {layer.total:>10}  {layer.zeros:>10}  {layer.sparsity:8.2%}"
                  for layer in self.layers]
        lines.append(f"{'total':<{width}}  {self.total:>10}  {self.zeros:>10}  {self.sparsity:8.2%}")
        lines.append(f"compression x{self.compression:.2f} (sparse weights), "
                     f"x{self.model_compression:.2f} (whole model)")
        return "\n".join(lines)


def sparsity_report(model: nn.Module) -> SparsityReport:
    """Count the weights that eval mode zeroes in every sparse layer of ``model``."""
    check_instance("model", model, nn.Module, "an nn.Module")
    layers = []
    sparse_params: set[int] = set()
    for prefix, module in model.named_modules():
        if not isinstance(module, Sparsified):
            continue
        for name in module.sparse_weight_names():
            keep = module.keep_mask(name)
            full = f"{prefix}.{name}" if prefix else name
            layers.append(LayerSparsity(full, keep.numel(), int((~keep).sum())))
            sparse_params.add(id(getattr(module, name)))
            sparse_params.add(id(getattr(module, "log_sigma2_" + name)))
    dense = sum(p.numel() for p in model.parameters() if id(p) not in sparse_params)
    return SparsityReport(tuple(layers), dense)


def prune(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every sparse layer replaced by its plain pruned counterpart.

    ``SparseLSTM`` -> ``nn.LSTM``, ``SparseGRU`` -> ``nn.GRU``, ``SparseLinear`` ->
    ``nn.Linear``, ``SparseEmbedding`` -> ``nn.Embedding``, with the weights over the
    threshold set to zero and no ``log_sigma2``. In eval mode the copy computes what
    ``model`` computes in eval mode. ``model`` itself is not changed.
    """
    check_instance("model", model, nn.Module, "an nn.Module")
    if isinstance(model, Sparsified):
        return model.to_dense()
    pruned = copy.deepcopy(model)
    for module in list(pruned.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Sparsified):
                setattr(module, name, child.to_dense())
    return pruned
