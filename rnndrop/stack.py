"""The stack of recurrent layers behind VariationalLSTM / VariationalGRU: masks in, rows out.

:class:`VariationalRNNStack` is written once for every cell; what differs between
the LSTM and the GRU is a :class:`~rnndrop.cell_specs.CellSpec` (``_cell``: gates,
states, torch's fused op) and the loop path of one layer, ``_layer_loop``, which
:mod:`rnndrop.recurrent` writes per cell with its typed kernel.

The walk of a ``dropout_hidden`` mask, hop by hop (training, no masks passed in, loop path;
10 functions in 5 files, helpers that return at once in brackets):

1. ``recurrent.py`` ``VariationalLSTM.__init__`` hands ``dropout_hidden`` to
2. ``stack_settings.py`` ``StackSettings._init_dropout``: checked once
   [``validation.check_probability``], kept as ``self.dropout_hidden``.
3. ``stack.py`` ``VariationalRNNStack.forward``: no masks given, training: ``_draw_masks``.
4. ``stack.py`` ``VariationalRNNStack._draw_masks``: loops over the sites
   [``masks.mask_sites``: site ``hidden_l{k}``, shape ``[B, P]``, probability
   ``dropout_hidden``] and draws each with ``self._draw_mask``, which is
   :func:`rnndrop.noise.draw_mask` unless a subclass (GaussianLSTM) overrides it.
5. ``noise.py`` ``draw_mask`` -> 6. ``noise.py`` ``_bernoulli``: the mask ``[B, P]`` is drawn.
7. ``stack.py`` ``VariationalRNNStack._forward_by_layer``: the layer's recurrent masks in the
   kernels' form ``[1, B, P]`` (``[T, B, P]`` per step).
8. ``recurrent.py`` ``VariationalLSTM._layer_loop``: per direction, calls the kernel
   ``KERNELS[name]["lstm"]`` (typed :class:`~rnndrop.kernels.LSTMRecurrence`; ``name`` from
   [``StackSettings._loop_kernel`` -> ``kernels.auto_loop_kernel``]).
9. ``kernels/lstm.py`` ``lstm_recurrence`` -> 10. ``_LSTMRecurrence.forward``
   [``Schedule.step_masks``: the mask of each step]: ``m = h_{t-1} * M_t`` at every step.

With the compiled kernel (``kernel="auto"`` on CPU where it builds), hops 9 and 10 are
``kernels/compiled.py`` ``lstm_recurrence`` -> ``_LSTMRecurrence.forward`` -> ``csrc/lstm.cpp``
``lstm_forward`` -> ``lstm_forward_loop`` -> ``csrc/common.h`` ``mask_state`` (the multiply):
13 hops in all, the last three in C++.

Masks passed to ``forward`` are checked (:meth:`RecurrentMasks.check`) and put in a
packed batch's sorted order; masks drawn by ``draw_mask`` have their shapes by
construction and are not checked again; masks drawn by an override of ``_draw_mask``
are checked like passed ones.

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

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from rnndrop.cell_specs import LayerWeights, quiet_weight_compaction, run_fused
from rnndrop.layout import SequenceLayout
from rnndrop.masks import RecurrentMasks, StackGeometry, check_seq_len, mask_sites
from rnndrop.noise import draw_mask
from rnndrop.scripting import run_eagerly
from rnndrop.stack_settings import StackSettings
from rnndrop.validation import check_positive_int

__all__ = ["VariationalRNNStack"]


class VariationalRNNStack(StackSettings, ABC):
    """What VariationalLSTM and VariationalGRU share; placed before nn.LSTM / nn.GRU.

    A subclass sets ``_cell`` (a :class:`CellSpec`) and writes ``_layer_loop`` for its cell;
    the constructor's dropout arguments are :class:`~rnndrop.stack_settings.StackSettings`'.
    """

    #: Draws the mask of one site: ``(site, noise, *, device, dtype, generator) -> Tensor | None``.
    #: Subclasses that draw other noise (GaussianLSTM's learned alpha) override it.
    _draw_mask = staticmethod(draw_mask)

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
        check_seq_len(self.mask_scope, seq_len)
        weight = self.weight_ih_l0
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        return self._draw_masks(batch_size, seq_len, device, dtype, generator)

    def _draw_masks(
        self,
        batch_size: int,
        seq_len: int | None,
        device: torch.device | str,
        dtype: torch.dtype,
        generator: torch.Generator | None,
    ) -> RecurrentMasks:
        """Every mask of one call, site by site in :func:`mask_sites`' order (arguments checked)."""
        sites = mask_sites(
            self._geometry,
            batch_size,
            seq_len,
            self.mask_scope,
            self.per_gate_masks,
            input_p=[self.dropout_input] + [self.dropout] * (self.num_layers - 1),
            hidden_p=self.dropout_hidden,
            output_p=self.dropout_output,
        )
        drawn = [self._draw_mask(site, self.noise, device=device, dtype=dtype, generator=generator)
                 for site in sites]
        L = self.num_layers
        return RecurrentMasks(
            tuple(drawn[:L]), tuple(drawn[L:-1]), drawn[-1], self.mask_scope, self.per_gate_masks
        )

    def _given_masks(self, masks: RecurrentMasks, layout: SequenceLayout, x: Tensor) -> RecurrentMasks:
        """Masks passed to ``forward``, checked (the kernels rely on it) and in sorted batch order."""
        if not isinstance(masks, RecurrentMasks):
            raise TypeError(f"masks must be a RecurrentMasks or None, got {type(masks).__name__}")
        masks.check(self._geometry, layout.batch_size, layout.seq_len, x)
        return masks.in_sorted_order(layout.sorted_indices)

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

    def forward(
        self, input, hx=None, masks: RecurrentMasks | None = None, *, return_raw_output: bool = False
    ):
        """Run the layer; the contract of ``nn.LSTM.forward`` / ``nn.GRU.forward``.

        Args:
            input: ``[T, B, input_size]`` (``[B, T, input_size]`` with ``batch_first``),
                unbatched ``[T, input_size]``, or a ``PackedSequence``.
            hx: initial state(s) ``[num_layers * num_directions, B, size]``
                (without ``B`` for unbatched input); zeros if None.
            masks: masks from :meth:`sample_masks` to use instead of fresh ones. They are
                used in eval mode too. Batch order is that of ``input`` (also for a
                ``PackedSequence`` with ``enforce_sorted=False``).
            return_raw_output: ``output, h_n, raw = layer(...)``: ``raw`` is the last layer's
                output before the output dropout, laid out as ``output`` (for TAR,
                :mod:`rnndrop.activation_regularization`); ``output`` itself without an output mask.
        """
        if torch.compiler.is_compiling():
            return run_eagerly(VariationalRNNStack._forward)(self, input, hx, masks, return_raw_output)
        return self._forward(input, hx, masks, return_raw_output)

    def _forward(self, input, hx, masks: RecurrentMasks | None, return_raw_output: bool):
        owner = type(self).__name__
        x, layout = SequenceLayout.from_input(
            input, batch_first=self.batch_first, input_size=self.input_size, weight=self.weight_ih_l0,
            owner=owner,
        )
        sizes = (self._out_size, self.hidden_size)[: self._cell.num_states]
        states = layout.initial_states(hx, sizes, self.num_layers * self._num_directions, x, owner)
        if masks is not None:
            masks = self._given_masks(masks, layout, x)
        elif self.training and self._has_dropout():
            # Fresh masks are i.i.d. over the batch: they need no sorting.
            masks = self._draw_masks(layout.batch_size, layout.seq_len, x.device, x.dtype, None)
            if type(self)._draw_mask is not draw_mask:  # an override's masks are checked like given ones
                masks.check(self._geometry, layout.batch_size, layout.seq_len, x)
        if masks is not None and masks.is_empty():
            masks = None
        raw: list[Tensor] = []
        if masks is None and self.kernel == "auto":
            out, states = self._forward_fused(x, layout, states)
        else:
            out, states = self._forward_by_layer(x, layout, states, masks, raw if return_raw_output else None)
        output, states = layout.restore(out, states)
        final = states if self._cell.num_states > 1 else states[0]
        return (output, final, layout.restore(raw[0], ())[0] if raw else output) if return_raw_output \
            else (output, final)

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
        return run_fused(self._cell, x, layout, states, weights, num_layers=self.num_layers, bias=self.bias,
                         bidirectional=self.bidirectional, training=self.training)

    def _forward_by_layer(
        self, x: Tensor, layout: SequenceLayout, states: tuple[Tensor, ...], masks: RecurrentMasks | None,
        raw: list[Tensor] | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Layer by layer with masks: each layer takes path 2 (folded-mask) or 3 (loop). With
        ``raw`` (a list), the last layer's rows before the output mask are appended to it."""
        D = self._num_directions
        per_step = masks is not None and masks.scope == "step"
        finals: list[list[Tensor]] = [[] for _ in states]
        for layer in range(self.num_layers):
            in_mask = masks.inputs[layer] if masks is not None else None
            per_gate_input = in_mask is not None and masks.per_gate
            x_in, in_rows = x, None
            if per_gate_input:  # applied in the input projection
                x_in, in_rows = layout.broadcastable(x, in_mask, per_step)
            elif in_mask is not None:
                x = x_in = layout.mask_rows(x, in_mask, per_step)
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
                # the kernels' form [T', B', (G,) P]: a time dimension of 1 unless per step
                loop_masks = [m if m is None or per_step else m.unsqueeze(0) for m in hidden]
                x, new_states = self._layer_loop(x_in, layout, layer, layer_states, in_rows, loop_masks)
            for acc, s in zip(finals, new_states):
                acc.append(s)
        if masks is not None and masks.output is not None:
            if raw is not None:
                raw.append(x)
            x = layout.mask_rows(x, masks.output, per_step)
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
            return run_fused(self._cell, x, layout, states, weights, num_layers=1, bias=self.bias,
                             bidirectional=self.bidirectional, training=self.training)

    @abstractmethod
    def _layer_loop(
        self,
        x: Tensor,
        layout: SequenceLayout,
        layer: int,
        states: tuple[Tensor, ...],
        in_rows: Tensor | None,
        hidden: list[Tensor | None],
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 3 for ``layer``, per direction: the input projection of every step at once (with
        the per-gate input mask ``in_rows``, paired with ``x`` by ``SequenceLayout.broadcastable``),
        then the loop kernel with recurrent mask ``hidden[d]`` ``[T', B', (G,) P]``. Returns the rows
        ``[N, D * P]`` and the final states ``[D, B, size]``; written per cell in :mod:`rnndrop.recurrent`."""

    @staticmethod
    def _join_directions(
        outs: list[Tensor], finals: list[tuple[Tensor, ...]]
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Rows of every direction side by side ``[N, D * P]``; final states stacked ``[D, B, size]``."""
        out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return out, tuple(torch.stack(parts) for parts in zip(*finals))
