"""Recurrent stacks that regimes build with a class of their own (``Regime.rnn_factory``):
learned-alpha Gaussian dropout and sparse variational dropout, with ``nn.LSTM``'s call contract."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from rnndrop.gaussian import GaussianGRU, GaussianLSTM
from rnndrop.sparse import SparseGRU, SparseLSTM

__all__ = ["RNNFactory", "learned_gaussian", "sparse_variational"]

#: ``rnn_factory(input_size, hidden_size, num_layers, probabilities, cell=..., output_fan_out=...)
#: -> nn.Module``; ``output_fan_out``, the width of the layer the stack's output feeds (the
#: language model's decoder: its vocabulary size), is passed to factories that take it.
RNNFactory = Callable[..., nn.Module]


def _between(p: Mapping[str, float], num_layers: int) -> float:
    """The between-layer probability; 0 for one layer (nn.LSTM warns about a dropout it ignores)."""
    return p["between"] if num_layers > 1 else 0.0


def learned_gaussian(granularity: str, max_alpha: float | None = None,
                      kl_approximation: str = "molchanov", decoder_kl: bool = True) -> RNNFactory:
    """A builder of GaussianLSTM / GaussianGRU: learned alpha at ``granularity`` on every site,
    initialised at p / (1 - p) (at most ``max_alpha``). ``decoder_kl``: the output site's KL
    counts the decoder weights each unit scales (``output_fan_out``); False counts it once
    per unit, as the kept Gaussian runs of docs/gaussian-results.md did."""

    def build(input_size: int, hidden_size: int, num_layers: int, p: Mapping[str, float],
              cell: str = "lstm", output_fan_out: int = 1) -> nn.Module:
        return (GaussianGRU if cell == "gru" else GaussianLSTM)(
            input_size, hidden_size, num_layers, dropout=_between(p, num_layers),
            dropout_input=p["input"], dropout_hidden=p["hidden"], dropout_output=p["output"],
            granularity=granularity, max_alpha=max_alpha, kl_approximation=kl_approximation,
            output_fan_out=output_fan_out if decoder_kl else 1,
        )

    return build


def sparse_variational(
    input_size: int, hidden_size: int, num_layers: int, p: Mapping[str, float], cell: str = "lstm",
    output_fan_out: int = 1,
) -> nn.Module:
    """SparseLSTM / SparseGRU: sparse variational dropout on every recurrent weight matrix,
    plus tied Bernoulli dropout on the input, between-layer and output sites (the weight
    noise on ``W_hh`` replaces the recurrent mask; ``output_fan_out`` plays no part)."""
    return (SparseGRU if cell == "gru" else SparseLSTM)(
        input_size, hidden_size, num_layers, dropout=_between(p, num_layers), dropout_input=p["input"],
        dropout_output=p["output"],
    )
