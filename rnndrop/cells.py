"""LSTM and GRU cells that apply the dropout masks they are given.

Cells never sample: a mask is a tensor the caller passes (see :mod:`rnndrop.masks`).
A mask multiplies the input or the previous hidden state *before* the gate
matmuls, the form of Gal & Ghahramani (2016). A mask of shape ``[batch, size]``
is shared by all gates; a mask of shape ``[batch, gates, size]`` gives every
gate its own mask (Gal's "untied" variant). No mask means no dropout.

The gate arithmetic (:func:`~rnndrop.kernels.gates.masked_linear`,
:func:`~rnndrop.kernels.gates.lstm_pointwise`, :func:`~rnndrop.kernels.gates.gru_pointwise`)
lives in :mod:`rnndrop.kernels.gates`, which the reference loop kernel also runs; the other loop
kernels are held to it. A layer (:mod:`rnndrop.recurrent`) computes at every step what these
cells compute with the same weights and masks (``tests/test_recurrent.py``, stack against cells).
"""

from __future__ import annotations

from torch import Tensor, nn

from rnndrop.kernels.gates import GRU_GATES, LSTM_GATES, gru_pointwise, lstm_pointwise, masked_linear
from rnndrop.stochastic import refuse_torchscript
from rnndrop.validation import check_input_features, check_tensor_like

__all__ = [
    "VariationalGRUCell",
    "VariationalLSTMCell",
    "check_cell_mask",
]


def check_cell_mask(name: str, mask: Tensor | None, x: Tensor, size: int, gates: int) -> None:
    """Check a cell mask against its input ``x`` (``[batch, size]`` or unbatched ``[size]``).

    Accepted: ``[batch or 1, size]`` or ``[batch or 1, gates, size]`` (without the
    batch dimension for unbatched input), same dtype and device as ``x``.
    """
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a Tensor or None, got {type(mask).__name__}")
    lead = x.shape[:-1]
    batch = lead[0] if lead else None
    ok_shapes = [(*lead, size), (*lead, gates, size)]
    if batch is not None:
        ok_shapes += [(1, size), (1, gates, size)]
    if tuple(mask.shape) not in ok_shapes:
        expected = " or ".join(str(list(s)) for s in ok_shapes)
        raise ValueError(f"{name} must have shape {expected}, got {list(mask.shape)}")
    check_tensor_like(name, mask, None, x)


def _check_cell_input(cell: nn.Module, input: Tensor) -> None:
    if input.dim() not in (1, 2):
        raise ValueError(
            f"{type(cell).__name__}: input must be 1-D [input_size] or 2-D [batch, input_size], "
            f"got {input.dim()}-D with shape {list(input.shape)}"
        )
    check_input_features(type(cell).__name__, input, cell.input_size, cell.weight_ih)


def _check_cell_state(cell: nn.Module, name: str, state: Tensor, input: Tensor) -> None:
    check_tensor_like(f"{type(cell).__name__}: {name}", state, (*input.shape[:-1], cell.hidden_size), input)


class VariationalLSTMCell(nn.LSTMCell):
    """An ``nn.LSTMCell`` that takes dropout masks.

    Parameters, their names, shapes and initialisation are those of ``nn.LSTMCell``,
    so state dicts interchange.

    Shapes:
        input: ``[batch, input_size]`` or ``[input_size]``.
        hx: ``(h, c)``, each ``[batch, hidden_size]`` (``[hidden_size]`` unbatched); zeros if None.
        input_mask: ``[batch, input_size]`` or per gate ``[batch, 4, input_size]``.
        hidden_mask: ``[batch, hidden_size]`` or per gate ``[batch, 4, hidden_size]``.
        returns: ``(h', c')``, each like ``h``.

    Its step is the one :class:`~rnndrop.VariationalLSTM` runs at every step of every layer,
    whichever loop kernel runs it (the class docstring there has the equations).
    """

    __prepare_scriptable__ = refuse_torchscript

    def forward(  # type: ignore[override]
        self,
        input: Tensor,
        hx: tuple[Tensor, Tensor] | None = None,
        input_mask: Tensor | None = None,
        hidden_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        _check_cell_input(self, input)
        if hx is None:
            zeros = input.new_zeros((*input.shape[:-1], self.hidden_size))
            hx = (zeros, zeros)
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            got = f"{len(hx)} values" if isinstance(hx, (tuple, list)) else type(hx).__name__
            raise TypeError(f"{type(self).__name__}: hx must be a tuple (h, c) of two Tensors, got {got}")
        h, c = hx
        _check_cell_state(self, "hx[0]", h, input)
        _check_cell_state(self, "hx[1]", c, input)
        check_cell_mask("input_mask", input_mask, input, self.input_size, LSTM_GATES)
        check_cell_mask("hidden_mask", hidden_mask, h, self.hidden_size, LSTM_GATES)
        gates = masked_linear(input, input_mask, self.weight_ih, self.bias_ih) + masked_linear(
            h, hidden_mask, self.weight_hh, self.bias_hh
        )
        return lstm_pointwise(gates, c)


class VariationalGRUCell(nn.GRUCell):
    """An ``nn.GRUCell`` that takes dropout masks.

    The hidden mask multiplies ``h_{t-1}`` inside ``W_hh h_{t-1}`` only; the
    interpolation ``z * h_{t-1}`` uses the unmasked state.

    Shapes:
        input: ``[batch, input_size]`` or ``[input_size]``.
        hx: ``[batch, hidden_size]`` (``[hidden_size]`` unbatched); zeros if None.
        input_mask: ``[batch, input_size]`` or per gate ``[batch, 3, input_size]``.
        hidden_mask: ``[batch, hidden_size]`` or per gate ``[batch, 3, hidden_size]``.
        returns: ``h'`` like ``hx``.

    Its step is the one :class:`~rnndrop.VariationalGRU` runs at every step of every layer,
    whichever loop kernel runs it (the class docstring there has the equations).
    """

    __prepare_scriptable__ = refuse_torchscript

    def forward(  # type: ignore[override]
        self,
        input: Tensor,
        hx: Tensor | None = None,
        input_mask: Tensor | None = None,
        hidden_mask: Tensor | None = None,
    ) -> Tensor:
        _check_cell_input(self, input)
        if hx is None:
            hx = input.new_zeros((*input.shape[:-1], self.hidden_size))
        _check_cell_state(self, "hx", hx, input)
        check_cell_mask("input_mask", input_mask, input, self.input_size, GRU_GATES)
        check_cell_mask("hidden_mask", hidden_mask, hx, self.hidden_size, GRU_GATES)
        gates_x = masked_linear(input, input_mask, self.weight_ih, self.bias_ih)
        gates_h = masked_linear(hx, hidden_mask, self.weight_hh, self.bias_hh)
        return gru_pointwise(gates_x, gates_h, hx)
