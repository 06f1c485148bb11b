"""VariationalLSTM and VariationalGRU: nn.LSTM / nn.GRU with tied (variational) dropout.

The layers subclass ``nn.LSTM`` / ``nn.GRU``: same constructor, parameters,
parameter names, initialisation, ``state_dict`` and forward contract (``hx``,
``batch_first``, unbatched input, ``PackedSequence``), plus dropout on

- the first layer's input (``dropout_input``),
- the input of every later layer (``dropout``, nn.LSTM's meaning),
- the recurrent state ``h_{t-1}`` of every layer and direction (``dropout_hidden``),
- the last layer's output (``dropout_output``).

How long a mask lives is ``mask_scope`` (see :mod:`rnndrop.masks`). Input masks
are shared by both directions of a layer; each direction has its own recurrent
mask. Dropout never touches the returned final states except through the
recurrence itself.

Execution: masks outside the recurrence are applied to whole sequences, so a
layer whose recurrent state carries no per-sequence mask runs torch's fused
kernel (oneDNN on CPU, cuDNN on GPU). With a per-sequence or per-step recurrent
mask it runs a loop kernel (:mod:`rnndrop.kernels`) with the input projection of
all steps hoisted out of the loop.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnndrop.cells import GRU_GATES, LSTM_GATES
from rnndrop.kernels import DEFAULT_LOOP_KERNEL, KERNELS, get_kernel, input_projection
from rnndrop.masks import (
    MASK_SCOPES,
    NOISES,
    RecurrentMasks,
    check_choice,
    check_probability,
    mask_shape,
    sample_mask,
)
from rnndrop.stochastic import Stochastic

__all__ = ["VariationalGRU", "VariationalLSTM"]


_COMPACTION_WARNING = "RNN module weights are not part of single contiguous chunk of memory"


@contextmanager
def quiet_weight_compaction(device: torch.device):
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


@dataclass
class _Layout:
    """Where the rows of a time-major, packed batch come from.

    Padded input is handled as packed input whose sequences all have length T.
    """

    batch_sizes: list[int]  # rows per time step, non-increasing
    batch_sizes_tensor: Tensor | None  # the PackedSequence's, None for padded input
    sorted_indices: Tensor | None
    unsorted_indices: Tensor | None
    batch_first: bool
    unbatched: bool

    @property
    def packed(self) -> bool:
        return self.batch_sizes_tensor is not None

    @property
    def seq_len(self) -> int:
        return len(self.batch_sizes)

    @property
    def batch_size(self) -> int:
        return self.batch_sizes[0]

    def mask_rows(self, mask: Tensor, step: bool) -> Tensor:
        """Expand a mask ``[B, ...]`` (``step``: ``[T, B, ...]``) to the rows ``[N, ...]``."""
        T, B = self.seq_len, self.batch_size
        if not step:
            mask = mask.unsqueeze(0).expand(T, *mask.shape)
        if not self.packed:
            return mask.reshape(T * B, *mask.shape[2:])
        return torch.cat([mask[t, :b] for t, b in enumerate(self.batch_sizes)])


class _VariationalRNNMixin(Stochastic):
    """What VariationalLSTM and VariationalGRU share; placed before nn.LSTM / nn.GRU.

    Each layer class supplies ``_gates``, ``_num_states``, ``_fused_kernel`` (``torch.lstm``
    or ``torch.gru``), ``_state_sizes()`` (sizes of its states), ``_input_bias(weights)``
    (the bias hoisted into the input projection) and
    ``_loop(kernel, gates_x, layout, states, weights, hidden_mask, reverse)``.
    """

    _gates: int
    _num_states: int  # 2 for (h, c), 1 for h

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
        self.dropout = dropout
        self.dropout_input = check_probability("dropout_input", dropout_input)
        self.dropout_hidden = check_probability("dropout_hidden", dropout_hidden)
        self.dropout_output = check_probability("dropout_output", dropout_output)
        self.mask_scope = check_choice("mask_scope", mask_scope, MASK_SCOPES)
        self.per_gate_masks = bool(per_gate_masks)
        self.noise = check_choice("noise", noise, NOISES)
        self.kernel = check_choice("kernel", kernel, ("auto", *KERNELS))

    @classmethod
    def from_module(cls, module: nn.RNNBase, **dropout_kwargs):
        """A layer of this class with ``module``'s configuration, device, dtype and weights.

        ``module`` is an ``nn.LSTM`` (for VariationalLSTM) or ``nn.GRU`` (for VariationalGRU);
        ``dropout_kwargs`` are this class's keyword arguments (``dropout_hidden=0.3``, ...).
        ``dropout`` defaults to ``module.dropout``. Example::

            model.rnn = VariationalLSTM.from_module(model.rnn, dropout_hidden=0.3)
        """
        parent = nn.LSTM if cls._gates == LSTM_GATES else nn.GRU
        if not isinstance(module, parent):
            raise TypeError(
                f"{cls.__name__}.from_module: module must be an {parent.__name__}, "
                f"got {type(module).__name__}"
            )
        config = dict(
            num_layers=module.num_layers,
            bias=module.bias,
            batch_first=module.batch_first,
            bidirectional=module.bidirectional,
            device=module.weight_ih_l0.device,
            dtype=module.weight_ih_l0.dtype,
        )
        if parent is nn.LSTM:
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

    def _mask_plan(
        self, batch_size: int, seq_len: int | None, scope: str, per_gate: bool
    ) -> tuple[list[tuple[tuple[int, ...], float]], list[tuple[int, ...]], tuple[int, ...]]:
        """Shapes (and probabilities) of every mask: (inputs, hidden, output)."""
        gates = self._gates if per_gate else None
        outer = "step" if scope == "step" else "sequence"  # "batch" is for h_{t-1} only
        width = self._num_directions * self._out_size
        inputs = [(mask_shape(outer, batch_size, self.input_size, seq_len, gates), self.dropout_input)] + [
            (mask_shape(outer, batch_size, width, seq_len, gates), self.dropout)
            for _ in range(1, self.num_layers)
        ]
        hidden = [
            mask_shape(scope, batch_size, self._out_size, seq_len, gates)
            for _ in range(self.num_layers * self._num_directions)
        ]
        return inputs, hidden, mask_shape(outer, batch_size, width, seq_len)

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
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        weight = self.weight_ih_l0
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        inputs, hidden, output = self._mask_plan(batch_size, seq_len, self.mask_scope, self.per_gate_masks)
        D = self._num_directions

        def draw(site: str, shape: tuple[int, ...], p: float) -> Tensor | None:
            return self._draw_mask(site, shape, p, device=device, dtype=dtype, generator=generator)

        return RecurrentMasks(
            inputs=tuple(draw(f"input_l{k}", shape, p) for k, (shape, p) in enumerate(inputs)),
            hidden=tuple(
                draw(f"hidden_l{i // D}" + ("_reverse" if i % D else ""), shape, self.dropout_hidden)
                for i, shape in enumerate(hidden)
            ),
            output=draw("output", output, self.dropout_output),
            scope=self.mask_scope,
            per_gate=self.per_gate_masks,
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

    def _check_masks(self, masks: RecurrentMasks, layout: _Layout, like: Tensor) -> None:
        if not isinstance(masks, RecurrentMasks):
            raise TypeError(f"masks must be a RecurrentMasks or None, got {type(masks).__name__}")
        check_choice("masks.scope", masks.scope, MASK_SCOPES)
        inputs, hidden, output = self._mask_plan(
            layout.batch_size, layout.seq_len, masks.scope, masks.per_gate
        )
        expected = [
            ("masks.inputs", masks.inputs, [shape for shape, _ in inputs]),
            ("masks.hidden", masks.hidden, hidden),
            ("masks.output", (masks.output,), [output]),
        ]
        for name, given, shapes in expected:
            if len(given) != len(shapes):
                raise ValueError(f"{name} must hold {len(shapes)} masks, got {len(given)}")
            for i, (mask, shape) in enumerate(zip(given, shapes)):
                if mask is None:
                    continue
                where = f"{name}[{i}]" if name != "masks.output" else name
                if tuple(mask.shape) != shape:
                    raise ValueError(
                        f"{where} must have shape {list(shape)} (scope {masks.scope!r}, "
                        f"per_gate={masks.per_gate}), got {list(mask.shape)}"
                    )
                if mask.dtype != like.dtype:
                    raise TypeError(f"{where} must have the input's dtype {like.dtype}, got {mask.dtype}")
                if mask.device != like.device:
                    raise ValueError(
                        f"{where} must be on the input's device {like.device}, got {mask.device}"
                    )

    def _prepare_masks(
        self, masks: RecurrentMasks | None, layout: _Layout, x: Tensor
    ) -> RecurrentMasks | None:
        if masks is None:
            if not (self.training and self._has_dropout()):
                return None
            # Masks are i.i.d. over the batch: no need to sort them for packed input.
            masks = self.sample_masks(layout.batch_size, layout.seq_len, device=x.device, dtype=x.dtype)
        else:
            self._check_masks(masks, layout, x)
            if layout.sorted_indices is not None:
                step = masks.scope == "step"

                def to_sorted(m: Tensor) -> Tensor:
                    dim = 1 if step else 0
                    return m.index_select(dim, layout.sorted_indices) if m.shape[dim] > 1 else m

                masks = masks.map(to_sorted)
        return None if masks.is_empty() else masks

    # ------------------------------------------------------------ input / hx

    def _prepare_input(self, input: Tensor | PackedSequence) -> tuple[Tensor, _Layout]:
        name = type(self).__name__
        if isinstance(input, PackedSequence):
            x = input.data
            batch_sizes = input.batch_sizes
            layout = _Layout(
                batch_sizes.tolist(),
                batch_sizes,
                input.sorted_indices,
                input.unsorted_indices,
                self.batch_first,
                False,
            )
            if x.dim() != 2:
                raise ValueError(f"{name}: PackedSequence data must be 2-D, got {x.dim()}-D")
        else:
            if not isinstance(input, Tensor):
                raise TypeError(
                    f"{name}: input must be a Tensor or PackedSequence, got {type(input).__name__}"
                )
            if input.dim() not in (2, 3):
                batched = "[batch, seq, feature]" if self.batch_first else "[seq, batch, feature]"
                raise ValueError(
                    f"{name}: input must be 3-D {batched} or 2-D unbatched [seq, feature], "
                    f"got {input.dim()}-D with shape {list(input.shape)}"
                )
            unbatched = input.dim() == 2
            x = input.unsqueeze(1) if unbatched else input
            if self.batch_first and not unbatched:
                x = x.transpose(0, 1)
            T, B = x.shape[:2]
            if T == 0 or B == 0:
                raise ValueError(
                    f"{name}: input must have at least one step and one sequence, "
                    f"got shape {list(input.shape)}"
                )
            x = x.reshape(T * B, x.shape[-1])
            layout = _Layout([B] * T, None, None, None, self.batch_first, unbatched)
        if x.shape[-1] != self.input_size:
            raise ValueError(
                f"{name}: input.size(-1) must be equal to input_size={self.input_size}, got {x.shape[-1]}"
            )
        weight = self.weight_ih_l0
        if x.dtype != weight.dtype:
            raise TypeError(f"{name}: input dtype {x.dtype} does not match the weights' dtype {weight.dtype}")
        if x.device != weight.device:
            raise ValueError(f"{name}: input is on {x.device} but the weights are on {weight.device}")
        return x, layout

    def _prepare_hx(self, hx, layout: _Layout, x: Tensor) -> tuple[Tensor, ...]:
        name = type(self).__name__
        L = self.num_layers * self._num_directions
        B = layout.batch_size
        sizes = self._state_sizes()
        if hx is None:
            return tuple(x.new_zeros(L, B, size) for size in sizes)
        states = (hx,) if self._num_states == 1 else hx
        arg_names = ["hx"] if self._num_states == 1 else ["hx[0]", "hx[1]"]
        if self._num_states > 1 and (not isinstance(hx, (tuple, list)) or len(hx) != 2):
            raise TypeError(f"{name}: hx must be a tuple (h_0, c_0) or None, got {type(hx).__name__}")
        out = []
        for state, size, arg in zip(states, sizes, arg_names):
            if not isinstance(state, Tensor):
                raise TypeError(f"{name}: {arg} must be a Tensor, got {type(state).__name__}")
            expected = (L, size) if layout.unbatched else (L, B, size)
            if tuple(state.shape) != expected:
                raise ValueError(
                    f"{name}: {arg} must have shape {list(expected)}"
                    f"{' (unbatched input)' if layout.unbatched else ''}, got {list(state.shape)}"
                )
            if state.dtype != x.dtype:
                raise TypeError(f"{name}: {arg} dtype {state.dtype} does not match the input's {x.dtype}")
            if state.device != x.device:
                raise ValueError(f"{name}: {arg} is on {state.device} but the input is on {x.device}")
            if layout.unbatched:
                state = state.unsqueeze(1)
            elif layout.sorted_indices is not None:
                state = state.index_select(1, layout.sorted_indices)
            out.append(state)
        return tuple(out)

    def _finish(self, out: Tensor, states: tuple[Tensor, ...], layout: _Layout):
        if layout.packed:
            if layout.unsorted_indices is not None:
                states = tuple(s.index_select(1, layout.unsorted_indices) for s in states)
            output = PackedSequence(
                out, layout.batch_sizes_tensor, layout.sorted_indices, layout.unsorted_indices
            )
        else:
            output = out.view(layout.seq_len, layout.batch_size, out.shape[-1])
            if layout.unbatched:
                output = output.squeeze(1)
                states = tuple(s.squeeze(1) for s in states)
            elif layout.batch_first:
                output = output.transpose(0, 1)
        return output, (states if self._num_states > 1 else states[0])

    # --------------------------------------------------------------- forward

    def _layer_weights(self, layer: int, direction: int) -> dict[str, Tensor]:
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        names = ["weight_ih", "weight_hh"]
        if self.bias:
            names += ["bias_ih", "bias_hh"]
        if getattr(self, "proj_size", 0):
            names.append("weight_hr")
        return {n: getattr(self, n + suffix) for n in names}

    def _fused(
        self, x: Tensor, layout: _Layout, states: tuple[Tensor, ...], weights: list[Tensor], num_layers: int
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``num_layers`` layers in torch's fused kernel: rows ``[N, in]`` -> ``[N, D * out]``."""
        hx = states if self._num_states > 1 else states[0]
        common = (weights, self.bias, num_layers, 0.0, self.training, self.bidirectional)
        if layout.packed:
            out, *new_states = self._fused_kernel(x, layout.batch_sizes_tensor, hx, *common)
        else:
            T, B = layout.seq_len, layout.batch_size
            out, *new_states = self._fused_kernel(x.view(T, B, -1), hx, *common, False)
            out = out.reshape(T * B, -1)
        return out, tuple(new_states)

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
        x, layout = self._prepare_input(input)
        states = self._prepare_hx(hx, layout, x)
        masks = self._prepare_masks(masks, layout, x)
        D = self._num_directions
        if masks is None and self.kernel == "auto":
            weights = [
                w
                for layer in range(self.num_layers)
                for d in range(D)
                for w in self._layer_weights(layer, d).values()
            ]
            out, states = self._fused(x, layout, states, weights, self.num_layers)
            return self._finish(out, states, layout)

        loop_kernel = DEFAULT_LOOP_KERNEL if self.kernel == "auto" else self.kernel
        step_masks = masks is not None and masks.scope == "step"
        finals: list[list[Tensor]] = [[] for _ in states]
        for layer in range(self.num_layers):
            in_mask = masks.inputs[layer] if masks is not None else None
            per_gate_input = in_mask is not None and masks.per_gate
            if in_mask is not None:
                rows = layout.mask_rows(in_mask, step_masks)
                if not per_gate_input:
                    x, rows = x * rows, None
            else:
                rows = None
            hidden = [masks.hidden[layer * D + d] if masks is not None else None for d in range(D)]
            layer_states = tuple(s[layer * D : (layer + 1) * D] for s in states)
            fusable = (
                self.kernel == "auto"
                and not per_gate_input
                and all(m is None or (masks.scope == "batch" and not masks.per_gate) for m in hidden)
            )
            if fusable:
                weights = []
                for d in range(D):
                    w = self._layer_weights(layer, d)
                    if hidden[d] is not None:  # one mask for the batch: fold it into W_hh's columns
                        w["weight_hh"] = w["weight_hh"] * hidden[d]
                    weights.extend(w.values())
                with quiet_weight_compaction(x.device):
                    x, new_states = self._fused(x, layout, layer_states, weights, 1)
            else:
                outs, per_dir = [], []
                for d in range(D):
                    w = self._layer_weights(layer, d)
                    gates_x = input_projection(x, rows, w["weight_ih"], self._input_bias(w))
                    mask = hidden[d]
                    if mask is not None and masks.scope != "step":
                        mask = mask.unsqueeze(0)  # a time dimension of 1: the same mask at every step
                    out, st = self._loop(
                        loop_kernel, gates_x, layout, tuple(s[d] for s in layer_states), w, mask, bool(d)
                    )
                    outs.append(out)
                    per_dir.append(st)
                x = torch.cat(outs, dim=-1) if D > 1 else outs[0]
                new_states = tuple(torch.stack(parts) for parts in zip(*per_dir))
            for acc, s in zip(finals, new_states):
                acc.append(s)
        if masks is not None and masks.output is not None:
            x = x * layout.mask_rows(masks.output, step_masks)
        return self._finish(x, tuple(torch.cat(acc) for acc in finals), layout)

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
            untied variant) instead of one mask shared by the gates.
        noise: ``"bernoulli"`` (inverted dropout, values 0 or 1/(1-p)) or ``"gaussian"``
            (multiplicative N(1, p/(1-p)) noise of the same variance).
        kernel: ``"auto"`` (the fused kernel whenever the masks allow it, else a loop
            kernel) or the name of a loop kernel in ``rnndrop.kernels.KERNELS`` to
            always use.

    In eval mode no mask is drawn: the output equals the parent class with the same
    weights. Masks passed to ``forward`` are always used.
"""


class VariationalLSTM(_VariationalRNNMixin, nn.LSTM):
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

    _gates = LSTM_GATES
    _num_states = 2
    _fused_kernel = staticmethod(torch.lstm)

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
        dropout = check_probability("dropout", dropout)
        # nn.LSTM gets dropout=0: it would warn for one layer and must never apply its own.
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
            dropout,
            dropout_input,
            dropout_hidden,
            dropout_output,
            mask_scope,
            per_gate_masks,
            noise,
            kernel,
        )

    def _state_sizes(self) -> tuple[int, ...]:
        return (self._out_size, self.hidden_size)

    def _input_bias(self, weights: dict[str, Tensor]) -> Tensor | None:
        return weights["bias_ih"] + weights["bias_hh"] if self.bias else None

    def _loop(self, kernel, gates_x, layout, states, weights, hidden_mask, reverse):
        h0, c0 = states
        out, h, c = get_kernel(kernel, "lstm")(
            gates_x,
            layout.batch_sizes,
            h0,
            c0,
            weights["weight_hh"],
            weights.get("weight_hr"),
            hidden_mask,
            reverse,
        )
        return out, (h, c)

    def forward(  # type: ignore[override]
        self,
        input: Tensor | PackedSequence,
        hx: tuple[Tensor, Tensor] | None = None,
        masks: RecurrentMasks | None = None,
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        return super().forward(input, hx, masks)


class VariationalGRU(_VariationalRNNMixin, nn.GRU):
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

    _gates = GRU_GATES
    _num_states = 1
    _fused_kernel = staticmethod(torch.gru)

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
        dropout = check_probability("dropout", dropout)
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
            dropout,
            dropout_input,
            dropout_hidden,
            dropout_output,
            mask_scope,
            per_gate_masks,
            noise,
            kernel,
        )

    def _state_sizes(self) -> tuple[int, ...]:
        return (self.hidden_size,)

    def _input_bias(self, weights: dict[str, Tensor]) -> Tensor | None:
        return weights.get("bias_ih")

    def _loop(self, kernel, gates_x, layout, states, weights, hidden_mask, reverse):
        (h0,) = states
        out, h = get_kernel(kernel, "gru")(
            gates_x,
            layout.batch_sizes,
            h0,
            weights["weight_hh"],
            weights.get("bias_hh"),
            hidden_mask,
            reverse,
        )
        return out, (h,)

    def forward(  # type: ignore[override]
        self,
        input: Tensor | PackedSequence,
        hx: Tensor | None = None,
        masks: RecurrentMasks | None = None,
    ) -> tuple[Tensor | PackedSequence, Tensor]:
        return super().forward(input, hx, masks)
