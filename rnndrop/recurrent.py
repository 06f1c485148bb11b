"""VariationalLSTM and VariationalGRU: nn.LSTM / nn.GRU with tied (variational) dropout.

The layers subclass ``nn.LSTM`` / ``nn.GRU``: same constructor, parameters,
parameter names, initialisation, ``state_dict`` and forward contract (``hx``,
``batch_first``, unbatched input, ``PackedSequence``), plus dropout on

- the first layer's input (``dropout_input``),
- the input of every later layer (``dropout``, nn.LSTM's meaning: "between layers"),
- the recurrent state ``h_{t-1}`` of every layer and direction (``dropout_hidden``),
- the last layer's output (``dropout_output``).

How long a mask lives is ``mask_scope`` (see :mod:`rnndrop.masks`). Input masks
are shared by both directions of a layer; each direction has its own recurrent
mask. Dropout never touches the returned final states except through the
recurrence itself.

The shared machinery (masks, the three execution paths) is
:class:`rnndrop.stack.VariationalRNNStack`; what differs between the two cells is
their :class:`~rnndrop.cell_specs.CellSpec` and their loop path, ``_layer_loop``
here: the input projection and the cell's loop kernel, typed by
:class:`~rnndrop.kernels.LSTMRecurrence` / :class:`~rnndrop.kernels.GRURecurrence`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnndrop.cell_specs import GRU_CELL, LSTM_CELL
from rnndrop.kernels import KERNELS, GRURecurrence, LSTMRecurrence, input_projection
from rnndrop.layout import SequenceLayout
from rnndrop.masks import RecurrentMasks
from rnndrop.stack import VariationalRNNStack

__all__ = ["VariationalGRU", "VariationalLSTM"]


_EXTRA_ARGS_DOC = """
    Dropout arguments (keyword-only, probabilities in [0, 1)):
        dropout_input: on the first layer's input.
        dropout_hidden: on the recurrent state ``h_{t-1}`` of every layer and direction.
        dropout_output: on the last layer's output (not on the returned final state).
        mask_scope: ``"sequence"`` (default; Gal & Ghahramani: one mask per sequence,
            the same at every step, fresh at every call), ``"step"`` (naive dropout:
            a fresh mask at every step, the Zaremba et al. baseline) or ``"batch"``
            (the recurrent mask is shared by all sequences of the batch and folded
            into ``W_hh``, so the fused cuDNN / oneDNN kernel runs; input, between-layer
            and output masks stay per sequence).
        per_gate_masks: one mask per gate on the input and recurrent state (Gal's
            untied variant) instead of one mask shared by the gates (a bool).
        noise: ``"bernoulli"`` (inverted dropout, values 0 or 1/(1-p)) or ``"gaussian"``
            (multiplicative N(1, p/(1-p)) noise of the same variance).
        kernel: ``"auto"`` (the fused kernel whenever the masks allow it, else a loop
            kernel) or the name of a loop kernel in ``rnndrop.kernels.KERNELS`` to
            always use.

    ``dropout`` with ``num_layers=1`` has nothing to act on; like ``nn.LSTM`` the
    constructor then warns. In eval mode no mask is drawn: the output equals the
    parent class with the same weights. Masks passed to ``forward`` are always used.
"""


class VariationalLSTM(VariationalRNNStack, nn.LSTM):
    __doc__ = (
        """``nn.LSTM`` with Gal & Ghahramani's tied dropout.

    Same constructor (``input_size, hidden_size, num_layers, bias, batch_first,
    dropout, bidirectional, proj_size, device, dtype``), parameters and forward
    contract as ``nn.LSTM``: ``output, (h_n, c_n) = lstm(input, (h_0, c_0))``.
    ``dropout`` keeps its meaning (the input of every layer but the first).

    Example::

        lstm = VariationalLSTM(650, 650, num_layers=2, dropout=0.5,
                               dropout_input=0.5, dropout_hidden=0.3)
        lstm.load_state_dict(nn_lstm.state_dict())
        out, (h_n, c_n) = lstm(x)
"""
        + _EXTRA_ARGS_DOC
    )

    _cell = LSTM_CELL

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        dropout_input: float = 0.0,
        dropout_hidden: float = 0.0,
        dropout_output: float = 0.0,
        mask_scope: str = "sequence",
        per_gate_masks: bool = False,
        noise: str = "bernoulli",
        kernel: str = "auto",
    ) -> None:
        # nn.LSTM gets dropout=0: it never applies it, and _init_dropout gives its warning.
        super().__init__(
            input_size,
            hidden_size,
            num_layers=num_layers,
            bias=bias,
            batch_first=batch_first,
            dropout=0.0,
            bidirectional=bidirectional,
            proj_size=proj_size,
            device=device,
            dtype=dtype,
        )
        self._init_dropout(
            dropout, dropout_input, dropout_hidden, dropout_output, mask_scope, per_gate_masks, noise, kernel
        )

    def forward(  # type: ignore[override]
        self,
        input: Tensor | PackedSequence,
        hx: tuple[Tensor, Tensor] | None = None,
        masks: RecurrentMasks | None = None,
        *,
        return_raw_output: bool = False,
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        return super().forward(input, hx, masks, return_raw_output=return_raw_output)

    def _layer_loop(
        self,
        x: Tensor,
        layout: SequenceLayout,
        layer: int,
        states: tuple[Tensor, ...],
        in_rows: Tensor | None,
        hidden: list[Tensor | None],
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 3 (:meth:`VariationalRNNStack._layer_loop`): ``gates_x = W_ih x + b_ih + b_hh``
        for every step, then the LSTM kernel per direction."""
        h0, c0 = states
        outs, finals = [], []
        for d, mask in enumerate(hidden):
            w = self._layer_weights(layer, d)
            bias = w["bias_ih"] + w["bias_hh"] if self.bias else None
            gates_x = input_projection(x, in_rows, w["weight_ih"], bias).flatten(0, -2)  # [N, 4H]
            recurrence: LSTMRecurrence = KERNELS[self._loop_kernel(gates_x)]["lstm"]
            out, h, c = recurrence(
                gates_x, layout.batch_sizes, h0[d], c0[d], w["weight_hh"], w.get("weight_hr"), mask, bool(d)
            )
            outs.append(out)
            finals.append((h, c))
        return self._join_directions(outs, finals)


class VariationalGRU(VariationalRNNStack, nn.GRU):
    __doc__ = (
        """``nn.GRU`` with Gal & Ghahramani's tied dropout.

    Same constructor (``input_size, hidden_size, num_layers, bias, batch_first,
    dropout, bidirectional, device, dtype``), parameters and forward contract as
    ``nn.GRU``: ``output, h_n = gru(input, h_0)``. The recurrent mask multiplies
    ``h_{t-1}`` inside ``W_hh h_{t-1}``; the update ``z * h_{t-1}`` uses the
    unmasked state.
"""
        + _EXTRA_ARGS_DOC
    )

    _cell = GRU_CELL

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        dropout_input: float = 0.0,
        dropout_hidden: float = 0.0,
        dropout_output: float = 0.0,
        mask_scope: str = "sequence",
        per_gate_masks: bool = False,
        noise: str = "bernoulli",
        kernel: str = "auto",
    ) -> None:
        super().__init__(
            input_size,
            hidden_size,
            num_layers=num_layers,
            bias=bias,
            batch_first=batch_first,
            dropout=0.0,
            bidirectional=bidirectional,
            device=device,
            dtype=dtype,
        )
        self._init_dropout(
            dropout, dropout_input, dropout_hidden, dropout_output, mask_scope, per_gate_masks, noise, kernel
        )

    def forward(  # type: ignore[override]
        self,
        input: Tensor | PackedSequence,
        hx: Tensor | None = None,
        masks: RecurrentMasks | None = None,
        *,
        return_raw_output: bool = False,
    ) -> tuple[Tensor | PackedSequence, Tensor]:
        return super().forward(input, hx, masks, return_raw_output=return_raw_output)

    def _layer_loop(
        self,
        x: Tensor,
        layout: SequenceLayout,
        layer: int,
        states: tuple[Tensor, ...],
        in_rows: Tensor | None,
        hidden: list[Tensor | None],
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 3 (:meth:`VariationalRNNStack._layer_loop`): ``gates_x = W_ih x + b_ih`` for every
        step (``b_hh`` sits inside ``r * (W_hn h + b_hn)``), then the GRU kernel per direction."""
        (h0,) = states
        outs, finals = [], []
        for d, mask in enumerate(hidden):
            w = self._layer_weights(layer, d)
            gates_x = input_projection(x, in_rows, w["weight_ih"], w.get("bias_ih")).flatten(0, -2)
            recurrence: GRURecurrence = KERNELS[self._loop_kernel(gates_x)]["gru"]
            out, h = recurrence(
                gates_x, layout.batch_sizes, h0[d], w["weight_hh"], w.get("bias_hh"), mask, bool(d)
            )
            outs.append(out)
            finals.append((h,))
        return self._join_directions(outs, finals)
