"""What a recurrent layer needs to know about its cell: gates, states, fused op.

A :class:`CellSpec` is the Cell of PyTorch's Cell -> Layer -> Stack design
(``benchmarks/fastrnns/custom_lstms.py``): the layers of :mod:`rnndrop.stack`
are written once against it. ``fused`` is torch's whole-sequence op (``torch.lstm`` /
``torch.gru``; oneDNN on CPU, cuDNN on GPU), used when no mask varies across the batch
inside the recurrence (:func:`run_fused`).

The loop kernels (:mod:`rnndrop.kernels`) are called by each cell's layer class
(``_layer_loop`` in :mod:`rnndrop.recurrent`), through the protocols that type
:data:`rnndrop.kernels.KERNELS`; the pointwise math is :mod:`rnndrop.kernels.gates`.
A new cell type is one more spec, one more layer class and its kernels.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from rnndrop.kernels import KERNELS
from rnndrop.kernels.gates import GRU_GATES, LSTM_GATES
from rnndrop.layout import SequenceLayout

__all__ = ["GRU_CELL", "LSTM_CELL", "CellSpec", "loop_kernel_names", "quiet_weight_compaction", "run_fused"]

#: One layer's weights by their nn.LSTM names without the suffix: ``weight_ih``,
#: ``weight_hh``, optionally ``bias_ih``, ``bias_hh``, ``weight_hr``.
LayerWeights = dict[str, Tensor]


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
    """

    name: str
    mode: str
    gates: int
    state_names: tuple[str, ...]
    fused: Callable

    @property
    def num_states(self) -> int:
        return len(self.state_names)


def loop_kernel_names() -> tuple[str, ...]:
    """Names accepted by a layer's ``kernel`` argument besides ``"auto"``."""
    return tuple(KERNELS)


LSTM_CELL = CellSpec("lstm", "LSTM", LSTM_GATES, ("h", "c"), torch.lstm)
GRU_CELL = CellSpec("gru", "GRU", GRU_GATES, ("h",), torch.gru)


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
