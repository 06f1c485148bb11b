"""A word-level LSTM or GRU language model with every dropout site of the compared regimes.

``tokens [T, B] -> EmbeddingDropout (word types) -> VariationalLSTM / VariationalGRU stack (input,
between-layer, recurrent and output dropout) -> Linear decoder -> logits [T, B, V]``

The model follows the LM protocol of :mod:`rnndrop.lm`: time-major,
``model(tokens, hidden=None) -> (logits, hidden)``, where ``hidden`` is opaque
(``(h, c)`` for an LSTM, ``h`` for a GRU, each ``[num_layers, B, H]``) and is carried by the caller across
truncated-BPTT segments (detached with :func:`detach_hidden`). ``model(tokens, hidden,
return_outputs=True)`` adds the last layer's output before and after its dropout, for
AR / TAR (:mod:`rnndrop.activation_regularization`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rnndrop.activation_regularization import RecurrentOutputs
from rnndrop.embedding_dropout import EmbeddingDropout
from rnndrop.recurrent import VariationalGRU, VariationalLSTM, VariationalRNNStack
from rnndrop.validation import check_bool, check_positive_int, check_probability
from rnndrop.weight_drop import WeightDrop

__all__ = ["RNNLanguageModel", "detach_hidden"]


def detach_hidden(hidden: Any, copy: bool = False) -> Any:
    """``hidden`` (a tensor or nested tuples/lists of tensors) cut from the autograd graph; with
    ``copy``, copies of it."""
    if hidden is None:
        return None
    if isinstance(hidden, Tensor):
        return hidden.detach().clone() if copy else hidden.detach()
    return type(hidden)(detach_hidden(h, copy) for h in hidden)


class RNNLanguageModel(nn.Module):
    """LSTM or GRU language model (Zaremba et al. 2014; Gal & Ghahramani 2016).

    Args:
        vocab_size: ``V``.
        embedding_size: ``E``.
        hidden_size: ``H`` of every recurrent layer.
        num_layers: recurrent layers.
        dropout_embedding: probability of dropping a word type (whole embedding rows,
            Gal & Ghahramani's embedding dropout), per sequence or per batch
            (``embedding_scope``).
        dropout_input: on the first LSTM layer's input.
        dropout_between: on the input of every later layer.
        dropout_hidden: on ``h_{t-1}`` of every layer (the recurrent connections).
        dropout_output: on the last layer's output, before the decoder.
        weight_drop: DropConnect probability on every ``weight_hh_l*`` (AWD-LSTM),
            through :class:`rnndrop.weight_drop.WeightDrop`.
        mask_scope, per_gate_masks, noise: passed to :class:`rnndrop.VariationalLSTM`
            (or :class:`rnndrop.VariationalGRU`).
        cell: ``"lstm"`` or ``"gru"``: the recurrent stack built from the arguments above.
        embedding_scope: ``"sequence"`` or ``"batch"``, for the embedding dropout.
        tie_weights: share the embedding matrix with the decoder (needs ``E == H``).
        init_scale: every parameter uniform in ``[-init_scale, init_scale]`` (Zaremba);
            None keeps PyTorch's default initialisation.
        rnn: a recurrent stack to use instead of the VariationalLSTM built from the
            arguments above; it must take ``(x [T, B, E], hidden)`` and return
            ``(out [T, B, H], hidden)`` like ``nn.LSTM``, and it applies its own
            dropout (the ``dropout_*`` arguments other than ``dropout_embedding`` must
            then be 0).

    Shapes:
        tokens: ``[T, B]`` int64; returns logits ``[T, B, V]`` and the new hidden state.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int,
        hidden_size: int,
        num_layers: int = 2,
        *,
        dropout_embedding: float = 0.0,
        dropout_input: float = 0.0,
        dropout_between: float = 0.0,
        dropout_hidden: float = 0.0,
        dropout_output: float = 0.0,
        weight_drop: float = 0.0,
        mask_scope: str = "sequence",
        per_gate_masks: bool = False,
        noise: str = "bernoulli",
        embedding_scope: str = "sequence",
        tie_weights: bool = False,
        init_scale: float | None = 0.1,
        rnn: nn.Module | None = None,
        cell: str = "lstm",
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("embedding_size", embedding_size),
                            ("hidden_size", hidden_size), ("num_layers", num_layers)):
            check_positive_int(name, value)
        weight_drop = check_probability("weight_drop", weight_drop)
        dropout_embedding = check_probability("dropout_embedding", dropout_embedding)
        check_bool("tie_weights", tie_weights)
        if cell not in ("lstm", "gru"):
            raise ValueError(f"cell must be 'lstm' or 'gru', got {cell!r}")
        if tie_weights and embedding_size != hidden_size:
            raise ValueError(
                "tie_weights=True needs embedding_size == hidden_size, got "
                f"embedding_size={embedding_size} and hidden_size={hidden_size}"
            )
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.tie_weights = bool(tie_weights)
        self.cell = cell
        self.embedding = EmbeddingDropout(
            nn.Embedding(vocab_size, embedding_size), dropout_embedding, scope=embedding_scope
        )
        custom_rnn = rnn is not None
        if rnn is None:
            stack = VariationalGRU if cell == "gru" else VariationalLSTM
            recurrent = stack(
                embedding_size, hidden_size, num_layers,
                # A single layer has no between-layer site (nn.LSTM would warn).
                dropout=dropout_between if num_layers > 1 else 0.0, dropout_input=dropout_input,
                dropout_hidden=dropout_hidden, dropout_output=dropout_output,
                mask_scope=mask_scope, per_gate_masks=per_gate_masks, noise=noise,
            )
            rnn = self._weight_dropped(recurrent, weight_drop) if weight_drop > 0 else recurrent
        else:
            given = {"dropout_input": dropout_input, "dropout_between": dropout_between,
                     "dropout_hidden": dropout_hidden, "dropout_output": dropout_output,
                     "weight_drop": weight_drop}
            nonzero = [k for k, v in given.items() if v]
            if nonzero:
                raise ValueError(
                    f"with a custom rnn the recurrent dropout is the rnn's own: "
                    f"{', '.join(nonzero)} must be 0, got {[given[k] for k in nonzero]}"
                )
        self.rnn = rnn
        self.decoder = nn.Linear(hidden_size, vocab_size)
        if init_scale is not None:
            # A custom rnn keeps the initialisation its builder gave it.
            own = [self.embedding, self.decoder] + ([] if custom_rnn else [self.rnn])
            self.reset_parameters(init_scale, own)
        if self.tie_weights:
            self.decoder.weight = self.embedding.embedding.weight

    @staticmethod
    def _weight_dropped(recurrent: nn.Module, p: float) -> nn.Module:
        names = tuple(f"weight_hh_l{k}" for k in range(recurrent.num_layers))
        return WeightDrop(recurrent, weights=names, p=p)

    def reset_parameters(self, init_scale: float, modules: list[nn.Module] | None = None) -> None:
        """Every parameter (of ``modules``, default all) uniform in ``[-init_scale, init_scale]``
        (Zaremba et al.)."""
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        with torch.no_grad():
            for module in modules if modules is not None else [self]:
                for p in module.parameters():
                    p.uniform_(-init_scale, init_scale)

    def forward(self, tokens: Tensor, hidden: Any = None, return_outputs: bool = False) -> tuple[Any, ...]:
        """``(logits [T, B, V], hidden)``; with ``return_outputs`` also the last recurrent
        layer's output before and after its dropout, ``RecurrentOutputs(raw, dropped)``
        (``[T, B, H]`` each, ``dropped`` is what the decoder reads): what activation and
        temporal activation regularization need (:mod:`rnndrop.activation_regularization`).
        The masks drawn and the logits are those of the plain call."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            got = list(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be a [T, B] tensor of word ids, got {got}")
        x = self.embedding(tokens)  # [T, B, E]
        if not return_outputs:
            out, hidden = self.rnn(x, hidden)  # [T, B, H]
            return self.decoder(out), hidden  # [T, B, V]
        out, hidden, raw = self._rnn_with_raw_output(x, hidden)
        return self.decoder(out), hidden, RecurrentOutputs(raw, out)

    def _rnn_with_raw_output(self, x: Tensor, hidden: Any) -> tuple[Tensor, Any, Tensor]:
        """The recurrent stack's ``(output, hidden, output before the output dropout)``."""
        core = self.rnn.module if isinstance(self.rnn, WeightDrop) else self.rnn
        if isinstance(core, VariationalRNNStack):
            return self.rnn(x, hidden, return_raw_output=True)
        if type(core) in (nn.LSTM, nn.GRU):  # no output dropout: the two are one
            out, hidden = self.rnn(x, hidden)
            return out, hidden, out
        raise TypeError(
            f"return_outputs=True needs the last layer's output before its dropout, which a "
            f"{type(core).__name__} does not give: use a VariationalLSTM / VariationalGRU (or a stack "
            "built on rnndrop.recurrent.VariationalRNNStack), or an nn.LSTM / nn.GRU without output dropout"
        )
