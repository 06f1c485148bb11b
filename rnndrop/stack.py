"""The stack of recurrent layers behind VariationalLSTM / VariationalGRU: masks in, rows out.

:class:`VariationalRNNStack` is written once for every cell: what differs between
the LSTM and the GRU is a :class:`~rnndrop.cell_specs.CellSpec` (``_cell``).

A mask's way, in order: ``sample_masks`` draws every mask through
:meth:`RecurrentMasks.sample` (shapes from :meth:`RecurrentMasks.shapes`);
``forward`` checks masks passed in (:meth:`RecurrentMasks.check`) and reorders them
for a packed batch, multiplies each input mask into its layer's input rows
(:meth:`SequenceLayout.broadcast_to_rows`) and hands each recurrent mask either to
torch's fused op folded into ``W_hh`` or to the cell's loop kernel
(:attr:`CellSpec.loop`), which multiplies it into ``h_{t-1}`` at every step.

Execution, three paths (:meth:`VariationalRNNStack.forward`):

``fused``        no mask at all: torch's fused op (oneDNN on CPU, cuDNN on GPU) runs
                 every layer in one call.
``folded-mask``  per layer, when its recurrent mask is one for the whole batch
                 (``mask_scope="batch"``, not per gate): the mask is folded into the
                 columns of ``W_hh`` and the fused op runs that layer.
``loop``         otherwise: the input projection of all steps is hoisted out of the
                 loop and a loop kernel (:mod:`rnndrop.kernels`) runs the recurrence.

Site names: ``masks.inputs[k]`` / site ``input_l{k}`` is the input of layer ``k``;
for ``k = 0`` its probability is ``dropout_input``, for ``k >= 1`` it is nn.LSTM's
``dropout`` (the dropout *between* layers). ``masks.hidden[i]`` / ``hidden_l{k}[_reverse]``
is ``h_{t-1}`` of layer ``k`` (``i = k * num_directions + direction``), ``output`` the
last layer's output.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from rnndrop.cell_specs import CellSpec, LayerWeights, loop_kernel_names, quiet_weight_compaction, run_fused
from rnndrop.cells import masked_linear
from rnndrop.layout import SequenceLayout
from rnndrop.masks import MASK_SCOPES, NOISES, RecurrentMasks, StackGeometry, sample_mask
from rnndrop.stochastic import Stochastic
from rnndrop.validation import check_bool, check_choice, check_positive_int, check_probability

__all__ = ["VariationalRNNStack"]


class VariationalRNNStack(Stochastic):
    """What VariationalLSTM and VariationalGRU share; placed before nn.LSTM / nn.GRU.

    A subclass sets ``_cell`` (a :class:`CellSpec`); everything cell-specific goes through it.
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

    # ------------------------------------------------------------------ masks

    @property
    def _num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    @property
    def _out_size(self) -> int:
        return getattr(self, "proj_size", 0) or self.hidden_size

    @property
    def _geometry(self) -> StackGeometry:
        return StackGeometry(
            self.input_size, self._out_size, self.num_layers, self._num_directions, self._cell.gates
        )

    def sample_masks(
        self,
        batch_size: int,
        seq_len: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        generator: torch.Generator | None = None,
    ) -> RecurrentMasks:
        """Draw one set of masks for ``batch_size`` sequences, whatever the mode.

        ``seq_len`` is needed for ``mask_scope="step"``. Pass the result as
        ``forward(..., masks=...)`` to use the same masks for several calls
        (truncated BPTT, Monte-Carlo evaluation). For unbatched input use
        ``batch_size=1``. Device and dtype default to the weights'.
        """
        check_positive_int("batch_size", batch_size)
        weight = self.weight_ih_l0
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype

        def draw(site: str, shape: tuple[int, ...], p: float) -> Tensor | None:
            return self._draw_mask(site, shape, p, device=device, dtype=dtype, generator=generator)

        input_p = [self.dropout_input] + [self.dropout] * (self.num_layers - 1)
        return RecurrentMasks.sample(
            self._geometry,
            input_p=input_p,
            hidden_p=self.dropout_hidden,
            output_p=self.dropout_output,
            batch_size=batch_size,
            seq_len=seq_len,
            scope=self.mask_scope,
            per_gate=self.per_gate_masks,
            draw=draw,
        )

    def _draw_mask(
        self,
        site: str,
        shape: tuple[int, ...],
        p: float,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        generator: torch.Generator | None,
    ) -> Tensor | None:
        """The mask of one site (``input_l{k}``, ``hidden_l{k}[_reverse]`` or ``output``)
        with dropout probability ``p``; subclasses that draw other noise override this."""
        return sample_mask(shape, p, self.noise, device=device, dtype=dtype, generator=generator)

    def is_stochastic(self) -> bool:
        return self._has_dropout()

    def shares_noise_across_batch(self) -> bool:
        return self.mask_scope == "batch" and self.dropout_hidden > 0

    def _has_dropout(self) -> bool:
        between = self.dropout if self.num_layers > 1 else 0.0
        return any(p > 0 for p in (self.dropout_input, between, self.dropout_hidden, self.dropout_output))

    def _masks_for_call(
        self, masks: RecurrentMasks | None, layout: SequenceLayout, x: Tensor
    ) -> RecurrentMasks | None:
        """The masks of this call in sorted batch order: fresh ones in training, ``masks``
        (checked) when given, None when there is no dropout."""
        if masks is not None and not isinstance(masks, RecurrentMasks):
            raise TypeError(f"masks must be a RecurrentMasks or None, got {type(masks).__name__}")
        given = masks is not None
        if not given:
            if not (self.training and self._has_dropout()):
                return None
            masks = self.sample_masks(layout.batch_size, layout.seq_len, device=x.device, dtype=x.dtype)
        # The one check of every mask, sampled ones too (_draw_mask may be overridden):
        # the kernels rely on it.
        masks.check(self._geometry, layout.batch_size, layout.seq_len, x)
        if given:  # fresh masks are i.i.d. over the batch: they need no sorting
            masks = masks.in_sorted_order(layout.sorted_indices)
        return None if masks.is_empty() else masks

    # --------------------------------------------------------------- forward

    def _layer_weights(self, layer: int, direction: int) -> LayerWeights:
        """One layer's and direction's weights by their names without the ``_l{k}`` suffix."""
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        names = ["weight_ih", "weight_hh"]
        if self.bias:
            names += ["bias_ih", "bias_hh"]
        if getattr(self, "proj_size", 0):
            names.append("weight_hr")
        return {n: getattr(self, n + suffix) for n in names}

    def _fused(
        self,
        x: Tensor,
        layout: SequenceLayout,
        states: tuple[Tensor, ...],
        weights: list[Tensor],
        layers: int,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        return run_fused(
            self._cell,
            x,
            layout,
            states,
            weights,
            num_layers=layers,
            bias=self.bias,
            bidirectional=self.bidirectional,
            training=self.training,
        )

    def forward(self, input, hx=None, masks: RecurrentMasks | None = None):
        """Run the layer; the contract of ``nn.LSTM.forward`` / ``nn.GRU.forward``.

        Args:
            input: ``[T, B, input_size]`` (``[B, T, input_size]`` with ``batch_first``),
                unbatched ``[T, input_size]``, or a ``PackedSequence``.
            hx: initial state(s) ``[num_layers * num_directions, B, size]``
                (without ``B`` for unbatched input); zeros if None.
            masks: masks from :meth:`sample_masks` to use instead of fresh ones. They are
                used in eval mode too. Batch order is that of ``input`` (also for a
                ``PackedSequence`` with ``enforce_sorted=False``).
        """
        owner = type(self).__name__
        x, layout = SequenceLayout.from_input(
            input,
            batch_first=self.batch_first,
            input_size=self.input_size,
            weight=self.weight_ih_l0,
            owner=owner,
        )
        sizes = (self._out_size, self.hidden_size)[: self._cell.num_states]
        states = layout.initial_states(hx, sizes, self.num_layers * self._num_directions, x, owner)
        masks = self._masks_for_call(masks, layout, x)
        if masks is None and self.kernel == "auto":
            out, states = self._forward_fused(x, layout, states)
        else:
            out, states = self._forward_by_layer(x, layout, states, masks)
        output, states = layout.restore(out, states)
        return output, (states if self._cell.num_states > 1 else states[0])

    def _forward_fused(
        self, x: Tensor, layout: SequenceLayout, states: tuple[Tensor, ...]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 1, no mask: every layer in one call of torch's fused op."""
        D = self._num_directions
        weights = [
            w
            for layer in range(self.num_layers)
            for d in range(D)
            for w in self._layer_weights(layer, d).values()
        ]
        return self._fused(x, layout, states, weights, self.num_layers)

    def _forward_by_layer(
        self, x: Tensor, layout: SequenceLayout, states: tuple[Tensor, ...], masks: RecurrentMasks | None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Layer by layer with masks: each layer takes path 2 (folded-mask) or 3 (loop)."""
        D = self._num_directions
        per_step = masks is not None and masks.scope == "step"
        finals: list[list[Tensor]] = [[] for _ in states]
        for layer in range(self.num_layers):
            in_mask = masks.inputs[layer] if masks is not None else None
            in_rows = layout.broadcast_to_rows(in_mask, per_step) if in_mask is not None else None
            per_gate_input = in_rows is not None and masks.per_gate
            if in_rows is not None and not per_gate_input:
                x, in_rows = x * in_rows, None
            indices = range(layer * D, (layer + 1) * D)
            layer_states = tuple(s[layer * D : (layer + 1) * D] for s in states)
            hidden = [masks.hidden[i] if masks is not None else None for i in indices]
            foldable = (
                self.kernel == "auto"
                and not per_gate_input
                and all(m is None or (masks.scope == "batch" and not masks.per_gate) for m in hidden)
            )
            if foldable:
                x, new_states = self._layer_folded_mask(x, layout, layer, layer_states, hidden)
            else:
                loop_masks = [masks.hidden_for_kernel(i) if masks is not None else None for i in indices]
                x, new_states = self._layer_loop(x, layout, layer, layer_states, in_rows, loop_masks)
            for acc, s in zip(finals, new_states):
                acc.append(s)
        if masks is not None and masks.output is not None:
            x = x * layout.broadcast_to_rows(masks.output, per_step)
        return x, tuple(torch.cat(acc) for acc in finals)

    def _layer_folded_mask(
        self,
        x: Tensor,
        layout: SequenceLayout,
        layer: int,
        states: tuple[Tensor, ...],
        hidden: list[Tensor | None],
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 2: one recurrent mask ``[1, P]`` for the batch per direction, folded into
        ``W_hh``'s columns (``W_hh (m * h) = (W_hh * m) h``), then the fused op."""
        weights = []
        for d, mask in enumerate(hidden):
            w = self._layer_weights(layer, d)
            if mask is not None:
                w["weight_hh"] = w["weight_hh"] * mask
            weights.extend(w.values())
        with quiet_weight_compaction(x.device):
            return self._fused(x, layout, states, weights, 1)

    def _layer_loop(
        self,
        x: Tensor,
        layout: SequenceLayout,
        layer: int,
        states: tuple[Tensor, ...],
        in_rows: Tensor | None,
        hidden: list[Tensor | None],
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 3: the input projection of every step at once (per-gate input mask
        ``in_rows`` ``[N, G, in]`` applied there), then the cell's loop kernel per direction
        with recurrent masks ``[T', B', (G,) P]``."""
        outs, finals = [], []
        for d, mask in enumerate(hidden):
            w = self._layer_weights(layer, d)
            gates_x = masked_linear(x, in_rows, w["weight_ih"], self._cell.input_bias(w))
            out, final = self._cell.loop(
                self.kernel, gates_x, layout.batch_sizes, tuple(s[d] for s in states), w, mask, bool(d)
            )
            outs.append(out)
            finals.append(final)
        out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return out, tuple(torch.stack(parts) for parts in zip(*finals))

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
