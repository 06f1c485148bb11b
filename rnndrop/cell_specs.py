"""What a recurrent layer needs to know about its cell: gates, states, fused op, loop kernel.

A :class:`CellSpec` is the Cell of PyTorch's Cell -> Layer -> Stack design
(``benchmarks/fastrnns/custom_lstms.py``): the layers of :mod:`rnndrop.stack`
are written once against it, and a new cell type is one more spec plus its
kernels. The pointwise math itself lives in :mod:`rnndrop.cells` and in the
kernels; a spec only says how to call them.

- ``fused``: torch's whole-sequence op (``torch.lstm`` / ``torch.gru``; oneDNN on
  CPU, cuDNN on GPU), used when no mask varies across the batch inside the recurrence.
- ``loop``: the call of a loop kernel of :mod:`rnndrop.kernels` for one layer and
  direction, under the kernel contract documented there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from rnndrop.cells import GRU_GATES, LSTM_GATES
from rnndrop.kernels import KERNELS, auto_loop_kernel, get_kernel
from rnndrop.layout import SequenceLayout

__all__ = ["GRU_CELL", "LSTM_CELL", "CellSpec", "loop_kernel_names", "quiet_weight_compaction", "run_fused"]

#: One layer's weights by their nn.LSTM names without the suffix: ``weight_ih``,
#: ``weight_hh``, optionally ``bias_ih``, ``bias_hh``, ``weight_hr``.
LayerWeights = dict[str, Tensor]
#: ``loop(kernel_name, gates_x, batch_sizes, states, weights, hidden_mask, reverse) -> (out, states)``
LoopHook = Callable[
    [str, Tensor, list[int], tuple[Tensor, ...], LayerWeights, Tensor | None, bool],
    tuple[Tensor, tuple[Tensor, ...]],
]


@dataclass(frozen=True)
class CellSpec:
    """A recurrent cell as the layers see it.

    Attributes:
        name: ``"lstm"`` or ``"gru"``, the cell's name in the kernel registry.
        mode: ``nn.RNNBase.mode`` of the torch module with this cell (``"LSTM"``, ``"GRU"``);
            ``from_module`` takes only modules of this mode.
        gates: gate blocks in ``W_ih`` / ``W_hh`` (4 LSTM: i, f, g, o; 3 GRU: r, z, n).
        state_names: names of the states in ``hx`` (``("h", "c")`` or ``("h",)``).
        fused: torch's fused op for whole sequences and stacks of layers.
        input_bias: the bias folded into the input projection ``W_ih x + b`` hoisted
            out of the loop (LSTM: both biases; GRU: ``b_ih`` only, since ``b_hh``
            sits inside ``r * (W_hn h + b_hn)``).
        loop: runs a loop kernel for one layer and direction (see :data:`LoopHook`).
    """

    name: str
    mode: str
    gates: int
    state_names: tuple[str, ...]
    fused: Callable
    input_bias: Callable[[LayerWeights], Tensor | None]
    loop: LoopHook

    @property
    def num_states(self) -> int:
        return len(self.state_names)


def loop_kernel_names() -> tuple[str, ...]:
    """Names accepted by a layer's ``kernel`` argument besides ``"auto"``."""
    return tuple(KERNELS)


def _loop_kernel(kernel_name: str, cell: str, x: Tensor) -> Callable:
    """The recurrence function of loop kernel ``kernel_name`` (``"auto"``: the one for tensors
    like ``x``, see :func:`rnndrop.kernels.auto_loop_kernel`) for ``cell`` (``"lstm"`` or
    ``"gru"``): the one lookup in the kernel registry."""
    return get_kernel(auto_loop_kernel(x) if kernel_name == "auto" else kernel_name, cell)


def _lstm_loop(kernel_name, gates_x, batch_sizes, states, weights, hidden_mask, reverse):
    h0, c0 = states
    kernel = _loop_kernel(kernel_name, "lstm", gates_x)
    out, h, c = kernel(
        gates_x, batch_sizes, h0, c0, weights["weight_hh"], weights.get("weight_hr"), hidden_mask, reverse
    )
    return out, (h, c)


def _gru_loop(kernel_name, gates_x, batch_sizes, states, weights, hidden_mask, reverse):
    (h0,) = states
    kernel = _loop_kernel(kernel_name, "gru", gates_x)
    out, h = kernel(
        gates_x, batch_sizes, h0, weights["weight_hh"], weights.get("bias_hh"), hidden_mask, reverse
    )
    return out, (h,)


def _lstm_input_bias(weights: LayerWeights) -> Tensor | None:
    return weights["bias_ih"] + weights["bias_hh"] if "bias_ih" in weights else None


def _gru_input_bias(weights: LayerWeights) -> Tensor | None:
    return weights.get("bias_ih")


LSTM_CELL = CellSpec("lstm", "LSTM", LSTM_GATES, ("h", "c"), torch.lstm, _lstm_input_bias, _lstm_loop)
GRU_CELL = CellSpec("gru", "GRU", GRU_GATES, ("h",), torch.gru, _gru_input_bias, _gru_loop)


def run_fused(
    cell: CellSpec,
    x: Tensor,
    layout: SequenceLayout,
    states: tuple[Tensor, ...],
    weights: list[Tensor],
    *,
    num_layers: int,
    bias: bool,
    bidirectional: bool,
    training: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``num_layers`` layers in torch's fused op: rows ``[N, in]`` -> ``[N, D * out]``.

    ``weights`` are the flat weights of every layer and direction in nn.LSTM's order;
    the op's own dropout is always 0 (the layers apply theirs as masks).
    """
    hx = states if cell.num_states > 1 else states[0]
    common = (weights, bias, num_layers, 0.0, training, bidirectional)
    if layout.packed:
        out, *new_states = cell.fused(x, layout.packed_batch_sizes, hx, *common)
    else:
        T, B = layout.seq_len, layout.batch_size
        out, *new_states = cell.fused(x.view(T, B, -1), hx, *common, False)
        out = out.reshape(T * B, -1)
    return out, tuple(new_states)


_COMPACTION_WARNING = "RNN module weights are not part of single contiguous chunk of memory"


@contextmanager
def quiet_weight_compaction(device: torch.device) -> Iterator[None]:
    """Silence cuDNN's warning about weights outside the module's flat buffer.

    A weight computed in forward (a masked ``W_hh``) can never live in that buffer,
    so cuDNN copies it at every call by design; the warning would only tell the user
    to call ``flatten_parameters()``, which cannot help. Other warnings pass.
    """
    if device.type != "cuda":
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_COMPACTION_WARNING)
        yield
