"""The dropout settings of a recurrent stack: checked once, in the constructor.

:class:`StackSettings` holds what VariationalLSTM / VariationalGRU take beyond
nn.LSTM / nn.GRU (``dropout_input``, ``dropout_hidden``, ``dropout_output``,
``mask_scope``, ``per_gate_masks``, ``noise``, ``kernel``, and ``dropout`` with
nn.LSTM's meaning), says so in ``repr``, and builds a layer from a plain
``nn.LSTM`` / ``nn.GRU`` (:meth:`StackSettings.from_module`). Everything after the
constructor trusts these attributes; the forward pass is :mod:`rnndrop.stack`.
"""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from rnndrop.cell_specs import CellSpec, loop_kernel_names
from rnndrop.kernels import auto_loop_kernel
from rnndrop.masks import MASK_SCOPES
from rnndrop.noise import NOISES
from rnndrop.stochastic import Stochastic
from rnndrop.validation import check_bool, check_choice, check_probability

__all__ = ["StackSettings"]


class StackSettings(Stochastic):
    """The dropout arguments of a stack of recurrent layers; placed before nn.LSTM / nn.GRU.

    A subclass sets ``_cell`` (a :class:`CellSpec`).
    """

    _cell: CellSpec

    def _init_dropout(
        self,
        dropout: float,
        dropout_input: float,
        dropout_hidden: float,
        dropout_output: float,
        mask_scope: str,
        per_gate_masks: bool,
        noise: str,
        kernel: str,
    ) -> None:
        self.dropout = check_probability("dropout", dropout)  # the input of layers 1..L-1
        if self.dropout > 0 and self.num_layers == 1:  # nn.RNNBase's warning, word for word
            warnings.warn(
                "dropout option adds dropout after all but last recurrent layer, so non-zero dropout "
                f"expects num_layers greater than 1, but got dropout={dropout} and "
                f"num_layers={self.num_layers}",
                stacklevel=3,
            )
        self.dropout_input = check_probability("dropout_input", dropout_input)
        self.dropout_hidden = check_probability("dropout_hidden", dropout_hidden)
        self.dropout_output = check_probability("dropout_output", dropout_output)
        self.mask_scope = check_choice("mask_scope", mask_scope, MASK_SCOPES)
        self.per_gate_masks = check_bool("per_gate_masks", per_gate_masks)
        self.noise = check_choice("noise", noise, NOISES)
        self.kernel = check_choice("kernel", kernel, ("auto", *loop_kernel_names()))

    @classmethod
    def from_module(cls, module: nn.RNNBase, **dropout_kwargs):
        """A layer of this class with ``module``'s configuration, device, dtype and weights.

        ``module`` is an ``nn.LSTM`` (for VariationalLSTM) or ``nn.GRU`` (for VariationalGRU),
        or a subclass with the same cell (``module.mode``); ``dropout_kwargs`` are this
        class's keyword arguments (``dropout_hidden=0.3``, ...). ``dropout`` defaults to
        ``module.dropout``. Example::

            model.rnn = VariationalLSTM.from_module(model.rnn, dropout_hidden=0.3)
        """
        mode = cls._cell.mode
        if not isinstance(module, nn.RNNBase) or module.mode != mode:
            got = type(module).__name__
            if isinstance(module, nn.RNNBase):
                got += f" (mode {module.mode!r})"
            raise TypeError(f"{cls.__name__}.from_module: module must be an {mode}, got {got}")
        config = dict(
            num_layers=module.num_layers,
            bias=module.bias,
            batch_first=module.batch_first,
            bidirectional=module.bidirectional,
            device=module.weight_ih_l0.device,
            dtype=module.weight_ih_l0.dtype,
        )
        if module.proj_size:
            config["proj_size"] = module.proj_size
        dropout_kwargs.setdefault("dropout", module.dropout)
        layer = cls(module.input_size, module.hidden_size, **config, **dropout_kwargs)
        layer.load_state_dict(module.state_dict())
        layer.train(module.training)
        return layer

    @property
    def _num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def _out_size(self) -> int:
        return getattr(self, "proj_size", 0) or self.hidden_size

    def _loop_kernel(self, gates_x: Tensor) -> str:
        """The name in :data:`rnndrop.kernels.KERNELS` of the loop kernel this layer runs on
        ``gates_x``: the one named, or for ``"auto"`` :func:`rnndrop.kernels.auto_loop_kernel`
        (the compiled kernel on CPU where it builds; the autograd one under ``torch.func``)."""
        return auto_loop_kernel(gates_x) if self.kernel == "auto" else self.kernel

    def is_stochastic(self) -> bool:
        return self._has_dropout()

    def shares_noise_across_batch(self) -> bool:
        return self.mask_scope == "batch" and self.dropout_hidden > 0

    def _has_dropout(self) -> bool:
        between = self.dropout if self.num_layers > 1 else 0.0
        return any(p > 0 for p in (self.dropout_input, between, self.dropout_hidden, self.dropout_output))

    def extra_repr(self) -> str:
        s = super().extra_repr()
        for name in ("dropout_input", "dropout_hidden", "dropout_output"):
            if getattr(self, name):
                s += f", {name}={getattr(self, name)}"
        if self.mask_scope != "sequence":
            s += f", mask_scope={self.mask_scope!r}"
        if self.per_gate_masks:
            s += ", per_gate_masks=True"
        if self.noise != "bernoulli":
            s += f", noise={self.noise!r}"
        if self.kernel != "auto":
            s += f", kernel={self.kernel!r}"
        return s
