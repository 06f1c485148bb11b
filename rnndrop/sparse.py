"""Sparse variational dropout (Molchanov et al. 2017) for recurrent layers (Lobacheva et al. 2017).

Every sparsified weight ``w`` has the posterior ``N(θ, σ²)`` with its own
``log σ²`` (additive reparameterisation: ``θ`` and ``log σ²`` are the parameters,
``log α = log σ² − log θ²`` is derived), the log-uniform prior and the KL of
:func:`rnndrop.kl.kl_molchanov`. As ``α`` grows without bound the weight carries
only noise; in eval mode weights with ``log α >= threshold`` (default 3, i.e.
``α ≳ 20``) are exactly zero.

What is tied to what in training:

- :class:`SparseLSTM` / :class:`SparseGRU`: ``W_ih``, ``W_hh`` (and ``W_hr``) are
  sampled **once per forward call**, shared by every sequence of the batch and every
  time step (Lobacheva et al. sample the recurrent weights once per mini-batch). The
  layer then runs torch's fused kernel with the sampled weights, so the weight noise
  costs one ``randn`` per weight and call. Biases are not sparsified. Tied dropout
  masks of the parent (``dropout_input`` etc.) can be combined with it.
- :class:`SparseLinear`: local reparameterisation by default: every row (every
  token) gets independent pre-activation noise ``N(x θᵀ, x² σ²ᵀ)``. This is exact
  for a layer whose output row feeds only its own loss term (a decoder); set
  ``local_reparameterization=False`` to sample one weight per forward call instead
  (e.g. for a layer that feeds a recurrence).
- :class:`SparseEmbedding`: the rows of the word types in the batch are sampled once
  per forward call, so a word has the same noisy vector at every step and in every
  sequence of the batch.

Truncated BPTT: each call (segment) draws new weights.

:func:`sparsity_report` counts the zeroed weights; :func:`rnndrop.prune` (``rnndrop.deploy``)
returns a copy of a model with plain ``nn.LSTM`` / ``nn.GRU`` / ``nn.Linear`` / ``nn.Embedding`` holding
the zeros, which computes what the sparse model computes in eval mode. A sparse layer is a
:class:`Sparsified` module: it names the weights it sparsifies, says which entries survive in
eval mode (``keep_mask``), keeps a ``log_sigma2_<name>`` parameter per weight, and gives its plain
counterpart with the zeros (``to_dense``).
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rnndrop.kl import KLRegularized, kl_molchanov
from rnndrop.noise import standard_normal_noise
from rnndrop.recurrent import VariationalGRU, VariationalLSTM
from rnndrop.stochastic import Stochastic
from rnndrop.validation import check_bool, check_finite_float, check_instance, check_word_ids, checked_setting

__all__ = [
    "DEFAULT_THRESHOLD",
    "INIT_LOG_SIGMA2",
    "LayerSparsity",
    "SparseEmbedding",
    "SparseGRU",
    "SparseLSTM",
    "SparseLinear",
    "Sparsified",
    "SparsityReport",
    "sparsity_report",
]

log = logging.getLogger(__name__)

#: Weights with ``log alpha`` at or above this are zero in eval mode.
DEFAULT_THRESHOLD = 3.0
#: Initial ``log sigma^2`` of every weight (Molchanov et al.).
INIT_LOG_SIGMA2 = -10.0
_LOG_ALPHA_CLIP = 10.0  # KL and its gradient are flat beyond this; keeps exp() finite
_EPS = 1e-8



def _noise_like(t: Tensor) -> Tensor:
    """``eps ~ N(0, 1)`` of ``t``'s shape, dtype and device (rnndrop.noise's one draw: per rank under DDP)."""
    return standard_normal_noise(t.shape, device=t.device, dtype=t.dtype)

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


class _SparseWeightsMixin(KLRegularized, Stochastic, Sparsified):
    """``log_sigma2_<name>`` for each weight in ``_sparse_names``; log alpha, masks, KL."""

    _sparse_names: tuple[str, ...]

    # Checked whenever it is set: a threshold may change after training (how much to prune).
    threshold = checked_setting("threshold",
                                functools.partial(check_finite_float, meaning="a float (a log alpha)"))

    def _init_sparse(self, names: tuple[str, ...], threshold: float) -> None:
        self.threshold = threshold
        self._sparse_names = names
        for name in names:
            weight = getattr(self, name)
            self.register_parameter(
                "log_sigma2_" + name, nn.Parameter(torch.full_like(weight, INIT_LOG_SIGMA2))
            )

    def reset_parameters(self) -> None:
        # The parent redraws its parameters (nn.RNNBase: every one, log_sigma2 included);
        # log_sigma2 then starts again at its initial value.
        super().reset_parameters()
        self._reset_log_sigma2()

    def _reset_log_sigma2(self) -> None:
        with torch.no_grad():
            for name in getattr(self, "_sparse_names", ()):
                getattr(self, "log_sigma2_" + name).fill_(INIT_LOG_SIGMA2)

    def is_stochastic(self) -> bool:
        return True

    def shares_noise_across_batch(self) -> bool:
        # Weights are sampled once per call; local reparameterisation samples per row.
        return not getattr(self, "local_reparameterization", False)

    def log_alpha(self, name: str, clipped: bool = True) -> Tensor:
        """``log σ² − log θ²`` of the weight ``name``, the weight's shape; clipped to [-10, 10]
        (the KL's range) unless ``clipped`` is False."""
        theta = getattr(self, name)
        log_alpha = getattr(self, "log_sigma2_" + name) - torch.log(theta * theta + _EPS)
        return log_alpha.clamp(-_LOG_ALPHA_CLIP, _LOG_ALPHA_CLIP) if clipped else log_alpha

    def keep_mask(self, name: str) -> Tensor:
        """Bool tensor, the weight's shape: True where ``log alpha < threshold``, of the log alpha
        as it is (clipped to the KL's range, a threshold of 10 or more would prune nothing and one
        of -10 or less everything)."""
        return self.log_alpha(name, clipped=False).detach() < self.threshold

    def pruned_weight(self, name: str) -> Tensor:
        """``θ`` with the weights over the threshold set to exactly zero."""
        theta = getattr(self, name)
        return theta * self.keep_mask(name).to(theta.dtype)

    def sampled_weight(self, name: str) -> Tensor:
        """One draw ``θ + σ ε`` of the weight ``name``."""
        theta = getattr(self, name)
        sigma = torch.exp(0.5 * getattr(self, "log_sigma2_" + name))
        return theta + sigma * _noise_like(theta)

    def kl(self) -> Tensor:
        """Molchanov's KL summed over all sparsified weights of this module (scalar)."""
        return torch.stack([kl_molchanov(self.log_alpha(n)).sum() for n in self._sparse_names]).sum()

    def sparse_weight_names(self) -> tuple[str, ...]:
        """Names of the weights this module sparsifies."""
        return self._sparse_names

    def _weight_for_forward(self, name: str) -> Tensor:
        return self.sampled_weight(name) if self.training else self.pruned_weight(name)


class _SparseRNNMixin(_SparseWeightsMixin):
    """Placed before VariationalLSTM / VariationalGRU: swaps the weights the forward uses."""

    def __init__(self, *args: Any, threshold: float = DEFAULT_THRESHOLD, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_sparse_rnn(threshold)

    def _init_sparse_rnn(self, threshold: float) -> None:
        names = tuple(n for n in self._flat_weights_names if n.startswith("weight_"))
        self._init_sparse(names, threshold)

    def _layer_weights(self, layer: int, direction: int) -> dict[str, Tensor]:
        # The layer's weights hook (VariationalRNNStack): the forward asks for each layer's
        # weights once per call, so each weight is sampled once per call.
        weights = super()._layer_weights(layer, direction)
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        for key in weights:
            if key.startswith("weight_"):
                weights[key] = self._weight_for_forward(key + suffix)
        return weights

    def to_dense(self) -> nn.RNNBase:
        """A plain ``nn.LSTM`` / ``nn.GRU`` holding the pruned weights (zeros over the threshold).

        Its output equals this layer's output in eval mode.
        """
        plain_cls = nn.LSTM if isinstance(self, nn.LSTM) else nn.GRU
        kwargs = {"proj_size": self.proj_size} if plain_cls is nn.LSTM else {}
        weight = self.weight_ih_l0
        plain = plain_cls(
            self.input_size, self.hidden_size, self.num_layers, bias=self.bias,
            batch_first=self.batch_first, bidirectional=self.bidirectional,
            device=weight.device, dtype=weight.dtype, **kwargs,
        )
        with torch.no_grad():
            state = {n: getattr(self, n).detach().clone() for n in self._flat_weights_names}
            for name in self._sparse_names:
                state[name] = self.pruned_weight(name).detach()
        plain.load_state_dict(state)
        return plain.train(self.training)


_SPARSE_RNN_DOC = """
    Takes the arguments of the parent class, plus one keyword argument:
        threshold: weights with ``log alpha >= threshold`` are zero in eval mode (default 3).

    Every weight matrix (``weight_ih_l*``, ``weight_hh_l*``, ``weight_hr_l*``) gets a
    ``log_sigma2_<name>`` parameter of its shape, initialised to -10; biases stay
    deterministic. In training, weights are sampled once per forward call (shared by
    the batch, tied over time) and the fused kernel runs. ``kl()`` is the KL term,
    ``log_alpha(name)`` / ``keep_mask(name)`` / ``pruned_weight(name)`` inspect a weight,
    ``to_dense()`` returns the pruned plain layer. The parent's dropout arguments
    still work (all 0 by default).
"""


class SparseLSTM(_SparseRNNMixin, VariationalLSTM):
    __doc__ = (
        """:class:`~rnndrop.VariationalLSTM` with sparse variational dropout on its weights.

    State dicts hold ``nn.LSTM``'s entries plus ``log_sigma2_*``: load an
    ``nn.LSTM`` checkpoint with ``load_state_dict(sd, strict=False)``.
"""
        + _SPARSE_RNN_DOC
    )


class SparseGRU(_SparseRNNMixin, VariationalGRU):
    __doc__ = (
        """:class:`~rnndrop.VariationalGRU` with sparse variational dropout on its weights.
"""
        + _SPARSE_RNN_DOC
    )


class SparseLinear(_SparseWeightsMixin, nn.Linear):
    """``nn.Linear`` with sparse variational dropout on ``weight`` (``[out, in]``).

    Args:
        in_features, out_features, bias, device, dtype: as ``nn.Linear``.
        threshold: weights with ``log alpha >= threshold`` are zero in eval mode.
        local_reparameterization: True (default): independent noise for every row of
            the input, drawn on the pre-activations; False: one weight sample per call.

    Shapes: input ``[*, in]`` -> ``[*, out]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        local_reparameterization: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.local_reparameterization = check_bool("local_reparameterization", local_reparameterization)
        self._init_sparse(("weight",), threshold)

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return F.linear(input, self.pruned_weight("weight"), self.bias)
        if not self.local_reparameterization:
            return F.linear(input, self.sampled_weight("weight"), self.bias)
        mean = F.linear(input, self.weight, self.bias)
        var = F.linear(input * input, self.log_sigma2_weight.exp())
        return mean + torch.sqrt(var + _EPS) * _noise_like(mean)

    def to_dense(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding the pruned weight."""
        w = self.weight
        plain = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                          device=w.device, dtype=w.dtype)
        with torch.no_grad():
            plain.weight.copy_(self.pruned_weight("weight"))
            if self.bias is not None:
                plain.bias.copy_(self.bias)
        return plain.train(self.training)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", threshold={self.threshold}"


class SparseEmbedding(_SparseWeightsMixin, nn.Embedding):
    """``nn.Embedding`` with sparse variational dropout on ``weight`` (``[num_embeddings, dim]``).

    In training the rows of the word types present in the input are sampled once per
    call, so every occurrence of a word in the batch gets the same noisy vector.
    ``padding_idx``, ``max_norm`` and sparse gradients are not supported.

    Shapes: input ``[*]`` LongTensor -> ``[*, embedding_dim]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        threshold: float = DEFAULT_THRESHOLD,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, device=device, dtype=dtype)
        self._init_sparse(("weight",), threshold)

    def forward(self, input: Tensor) -> Tensor:
        # in training a negative id would index the last rows silently (weight[types])
        check_word_ids("input", input, self.num_embeddings)
        if not self.training:
            return F.embedding(input, self.pruned_weight("weight"))
        types, where = torch.unique(input, return_inverse=True)
        theta = self.weight[types]
        rows = theta + torch.exp(0.5 * self.log_sigma2_weight[types]) * _noise_like(theta)
        return F.embedding(where, rows)

    def to_dense(self) -> nn.Embedding:
        """A plain ``nn.Embedding`` holding the pruned weight."""
        w = self.weight
        plain = nn.Embedding(self.num_embeddings, self.embedding_dim, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            plain.weight.copy_(self.pruned_weight("weight"))
        return plain.train(self.training)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", threshold={self.threshold}"


# -- counting and removing the zeros ------------------------------------------------------------


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
        """All parameters of the pruned model / its nonzero parameters (dense ones kept; ``inf``
        when nothing is left, 1 for a model without parameters)."""
        everything, kept = self.total + self.dense_params, self.total - self.zeros + self.dense_params
        if not everything:
            return 1.0
        return everything / kept if kept else float("inf")

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
    """Count the weights that eval mode zeroes in every sparse layer of ``model``.

    A sparse weight that a plain module also holds (an embedding tied to a decoder) is counted
    dense, with a warning: that module reads all of it, pruned or not."""
    check_instance("model", model, nn.Module, "an nn.Module")
    layers = []
    sparse_params: set[int] = set()
    held_by_plain = {id(p) for m in model.modules() if not isinstance(m, Sparsified)
                     for p in m._parameters.values() if p is not None}
    for prefix, module in model.named_modules():
        if not isinstance(module, Sparsified):
            continue
        for name in module.sparse_weight_names():
            full = f"{prefix}.{name}" if prefix else name
            sparse_params.add(id(getattr(module, "log_sigma2_" + name)))  # training's alone
            if id(getattr(module, name)) in held_by_plain:
                log.warning("sparsity_report: %s is also a parameter of a plain module (tied weights), "
                            "which reads all of it: counted dense", full)
                continue
            keep = module.keep_mask(name)
            layers.append(LayerSparsity(full, keep.numel(), int((~keep).sum())))
            sparse_params.add(id(getattr(module, name)))
    dense = sum(p.numel() for p in model.parameters() if id(p) not in sparse_params)
    return SparsityReport(tuple(layers), dense)
