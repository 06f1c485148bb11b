"""VariationalLSTM and VariationalGRU: ``nn.LSTM`` / ``nn.GRU`` with tied (variational) dropout.

The layers subclass ``nn.LSTM`` / ``nn.GRU``: same constructor, parameters, parameter
names, initialisation, ``state_dict`` and forward contract (``hx``, ``batch_first``,
unbatched input, ``PackedSequence``), plus dropout on

- the first layer's input (``dropout_input``),
- the input of every later layer (``dropout``, nn.LSTM's meaning: "between layers"),
- the recurrent state ``h_{t-1}`` of every layer and direction (``dropout_hidden``),
- the last layer's output (``dropout_output``).

The whole layer is this file, top to bottom:

1. :class:`CellSpec`, and :data:`LSTM_CELL` / :data:`GRU_CELL`: what differs between the two
   layers, as data (gates, states, torch's fused op, and the function that runs one layer
   and direction on a loop kernel of :mod:`rnndrop.kernels`);
2. :class:`VariationalRNNStack`: the dropout settings, checked once in the constructor, and
   the forward pass, written once for both cells;
3. :class:`VariationalLSTM` / :class:`VariationalGRU`: the constructors and typed ``forward``
   of ``nn.LSTM`` / ``nn.GRU``, and the equations in their docstrings.

It builds on the input's layout (:class:`rnndrop.layout.SequenceLayout`: padded, packed,
batch_first, unbatched -> rows and back), the mask sites and shapes (:mod:`rnndrop.masks`),
the one draw of a mask (:func:`rnndrop.noise.draw_mask`) and the loop kernels.

Execution, three paths (:meth:`VariationalRNNStack._forward`):

``fused``        no mask at all: torch's fused op (oneDNN on CPU, cuDNN on GPU) runs
                 every layer in one call.
``folded``       ``mask_scope="batch"`` (not per gate): every mask inside the stack is one
                 for the whole batch, folded into the columns of the weight it multiplies
                 (between-layer masks into ``W_ih``, recurrent masks into ``W_hh``), and the
                 fused op runs every layer in one call; the first input and the output masks
                 (per sequence) multiply the rows. Not for the GRU on the CPU where the compiled
                 loop kernel runs: it takes the loop path, faster there than oneDNN's GRU
                 (:attr:`CellSpec.fused_on_cpu`).
``loop``         otherwise, layer by layer: the fused op for a layer without a recurrent
                 mask (not the GRU's on the CPU, as above), else the input projection of all
                 steps hoisted out of the loop and a loop kernel (:mod:`rnndrop.kernels`) for the
                 recurrence.

Site names: ``masks.inputs[k]`` / site ``input_l{k}`` is the input of layer ``k``;
for ``k = 0`` its probability is ``dropout_input``, for ``k >= 1`` it is nn.LSTM's
``dropout`` (the dropout *between* layers). ``masks.hidden[i]`` / ``hidden_l{k}[_reverse]``
is ``h_{t-1}`` of layer ``k`` (``i = k * num_directions + direction``), ``output`` the
last layer's output. Input masks are shared by both directions of a layer; each direction
has its own recurrent mask. How long a mask lives is ``mask_scope`` (:mod:`rnndrop.masks`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar, overload

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnndrop.flat_weights import masked_weights
from rnndrop.kernels import (
    KERNELS,
    auto_loop_kernel,
    auto_loop_kernel_on,
    input_projection,
    recurrence_of,
    under_transform,
)
from rnndrop.kernels.gates import GRU_GATES, LSTM_GATES
from rnndrop.kernels.ops import TRACEABLE
from rnndrop.layout import SequenceLayout
from rnndrop.masks import MASK_SCOPES, RecurrentMasks, StackGeometry, check_seq_len, mask_sites
from rnndrop.noise import NOISES, MaskSite, draw_masks
from rnndrop.stochastic import Stochastic, refuse_jit_trace
from rnndrop.tracing import (
    constant_for_compile,
    eager_under_compile,
    exporting,
    run_eagerly,
    traced_cache,
    tracing_for_compile,
)
from rnndrop.validation import (
    check_bool,
    check_choice,
    check_instance,
    check_positive_int,
    check_probability,
    checked_setting,
)

__all__ = ["GRU_CELL", "LSTM_CELL", "CellSpec", "VariationalGRU", "VariationalLSTM", "VariationalRNNStack"]

#: One layer's and direction's weights by their nn.LSTM names without the ``_l{k}[_reverse]``
#: suffix: ``weight_ih``, ``weight_hh``, and where the layer has them ``bias_ih``, ``bias_hh``,
#: ``weight_hr``.
LayerWeights = dict[str, Tensor]

#: ``loop(kernel, x, in_rows, weights, batch_sizes, states, hidden_mask, reverse)
#: -> (rows [N, P], final states)``: one layer and direction on a loop kernel (see
#: :meth:`VariationalRNNStack._layer_loop` for the arguments).
LayerLoop = Callable[
    [str, Tensor, Tensor | None, LayerWeights, Sequence[int], tuple[Tensor, ...], Tensor | None, bool],
    tuple[Tensor, tuple[Tensor, ...]],
]


def _kernel_name(kernel: str, gates_x: Tensor, w_hh: Tensor) -> str:
    """The entry of :data:`~rnndrop.kernels.KERNELS` a layer set to ``kernel`` runs on ``gates_x``
    with ``w_hh``: the one named, or for ``"auto"`` :func:`~rnndrop.kernels.auto_loop_kernel`'s choice."""
    return auto_loop_kernel(gates_x, w_hh) if kernel == "auto" else kernel


def _rows(gates_x: Tensor) -> Tensor:
    """The input projection as rows ``[N, G * H]`` (``[T, B, G * H]`` from a per-gate input mask)."""
    return gates_x if gates_x.dim() == 2 else gates_x.flatten(0, -2)


def _lstm_loop(
    kernel: str,
    x: Tensor,
    in_rows: Tensor | None,
    w: LayerWeights,
    batch_sizes: Sequence[int],
    states: tuple[Tensor, ...],
    hidden_mask: Tensor | None,
    reverse: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``gates_x = W_ih x + b_ih + b_hh`` of every step in one product, then the LSTM kernel."""
    bias = w["bias_ih"] + w["bias_hh"] if "bias_ih" in w else None
    gates_x = _rows(input_projection(x, in_rows, w["weight_ih"], bias))  # [N, 4H]
    recurrence = recurrence_of(_kernel_name(kernel, gates_x, w["weight_hh"]), "lstm")
    h0, c0 = states
    out, h, c = recurrence(
        gates_x, batch_sizes, h0, c0, w["weight_hh"], w.get("weight_hr"), hidden_mask, reverse
    )
    return out, (h, c)


def _gru_loop(
    kernel: str,
    x: Tensor,
    in_rows: Tensor | None,
    w: LayerWeights,
    batch_sizes: Sequence[int],
    states: tuple[Tensor, ...],
    hidden_mask: Tensor | None,
    reverse: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """``gates_x = W_ih x + b_ih`` of every step in one product (``b_hh`` sits inside
    ``r * (W_hn h + b_hn)``), then the GRU kernel."""
    gates_x = _rows(input_projection(x, in_rows, w["weight_ih"], w.get("bias_ih")))  # [N, 3H]
    recurrence = recurrence_of(_kernel_name(kernel, gates_x, w["weight_hh"]), "gru")
    (h0,) = states
    out, h = recurrence(gates_x, batch_sizes, h0, w["weight_hh"], w.get("bias_hh"), hidden_mask, reverse)
    return out, (h,)


@traced_cache(256)
def _weight_names(layer: int, direction: int, bias: bool, projected: bool) -> tuple[tuple[str, str], ...]:
    """``(name, attribute)`` of one layer's and direction's weights: ``("weight_hh", "weight_hh_l1")``."""
    suffix = f"_l{layer}" + ("_reverse" if direction else "")
    names = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if bias else [])
    names += ["weight_hr"] if projected else []
    return tuple((name, name + suffix) for name in names)


@dataclass(frozen=True)
class CellSpec:
    """A recurrent cell as the layers see it: everything that differs between LSTM and GRU.

    Attributes:
        mode: ``nn.RNNBase.mode`` of the torch module with this cell (``"LSTM"``, ``"GRU"``);
            ``from_module`` takes only modules of this mode.
        gates: gate blocks in ``W_ih`` / ``W_hh`` (4 LSTM: i, f, g, o; 3 GRU: r, z, n).
        num_states: states in ``hx``: 2 (``h``, ``c``) or 1 (``h``).
        fused: torch's op for whole sequences and stacks of layers (``torch.lstm`` / ``torch.gru``).
        loop: one layer and direction on a loop kernel (:data:`LayerLoop`).
        fused_on_cpu: whether a call with masks uses ``fused`` on the CPU where the compiled loop
            kernel could run it instead (``kernel="auto"``: masks shared by the batch folded into
            the weights, a layer without a recurrent mask): oneDNN's LSTM runs about as fast as
            that kernel, its GRU slower (docs/cpu-speed.md, "The GRU's masked calls"), so the
            GRU's run on the loop kernel there. Calls without masks (eval mode, every ``p`` 0)
            always run ``fused``: they compute ``nn.LSTM`` / ``nn.GRU`` exactly.
    """

    mode: str
    gates: int
    num_states: int
    fused: Callable[..., tuple[Tensor, ...]]
    loop: LayerLoop
    fused_on_cpu: bool


LSTM_CELL = CellSpec("LSTM", LSTM_GATES, 2, torch.lstm, _lstm_loop, fused_on_cpu=True)
GRU_CELL = CellSpec("GRU", GRU_GATES, 1, torch.gru, _gru_loop, fused_on_cpu=False)

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


def compact_weights(model: nn.Module) -> None:
    """Put the weights of every recurrent layer in ``model`` back into one flat buffer where cuDNN
    wants one (``flatten_parameters``, which does nothing elsewhere). A deep copy gives every
    parameter a storage of its own; cuDNN would then copy them all at every call, with a warning."""
    for module in model.modules():
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()


class _Autocast(NamedTuple):
    """A forward pass under autocast (:meth:`VariationalRNNStack._forward_autocast`), passed down
    the call: the dtype the layer computes in, and the caller's autocast (device type, dtype),
    which torch's fused op runs under again, as in ``nn.LSTM``."""

    compute_dtype: torch.dtype
    device_type: str
    caller_dtype: torch.dtype


@constant_for_compile
def _autocast_result_dtype(
    mode: str, device_type: str, weight_dtype: torch.dtype, autocast_dtype: torch.dtype,
    packing: str = "padded", projected: bool = False,
) -> tuple[torch.dtype, ...]:
    """The dtypes of the output and final states (``h_n``, and ``c_n`` for an LSTM) that ``nn.LSTM``
    / ``nn.GRU`` (torch's fused op; ``mode`` ``"LSTM"`` or ``"GRU"``) return under autocast to
    ``autocast_dtype`` on ``device_type``, with weights and input of ``weight_dtype``, for a batch
    ``packing`` ``"padded"``, or packed with sequences of ``"even"`` or ``"uneven"`` lengths, with or
    without a projection (``projected``); the first is the dtype the layer computes in.
    torch.compile keeps the answer as a constant of the graph.

    Asked of torch on a probe of the same kind of call, not hard-coded, since torch decides it per
    kind of call and version: on the CPU torch 2.13 runs ``torch.lstm`` in bfloat16 but a packed
    batch of uneven lengths in float32 (torch 2.11 every packed batch), returns the ``c_n`` of an
    LSTM with a projection in float32, and runs ``torch.gru`` in float32; on CUDA both in the
    autocast dtype.
    Where torch's op cannot run under that autocast (so ``nn.LSTM`` could not either), the layer
    computes in its own dtype, after one warning with torch's reason (once per case: the answer is
    cached).
    """
    return _probed_result_dtypes(LSTM_CELL if mode == "LSTM" else GRU_CELL, device_type, weight_dtype,
                                 autocast_dtype, packing, projected)


@functools.cache
def _probed_result_dtypes(
    cell: CellSpec, device_type: str, weight_dtype: torch.dtype, autocast_dtype: torch.dtype,
    packing: str = "padded", projected: bool = False,
) -> tuple[torch.dtype, ...]:
    """:func:`_autocast_result_dtype` of ``cell``, probed once per case: one layer of 2 units (a
    projection to 1 where ``projected``) over one step of one sequence (padded), or two packed
    sequences of 2 and 2 steps (even) or of 2 and 1 (uneven)."""
    hidden, out_size = 2, 1 if projected else 2
    try:
        with torch.autocast(device_type, dtype=autocast_dtype):
            device = torch.device(device_type)

            def zeros(*shape: int) -> Tensor:
                return torch.zeros(*shape, device=device, dtype=weight_dtype)

            weights = [zeros(cell.gates * hidden, 1), zeros(cell.gates * hidden, out_size)]
            weights += [zeros(cell.gates * hidden), zeros(cell.gates * hidden)]
            weights += [zeros(out_size, hidden)] if projected else []
            batch = 1 if packing == "padded" else 2
            hx = (zeros(1, batch, out_size), zeros(1, batch, hidden)) if cell.num_states > 1 else zeros(
                1, batch, hidden)
            if packing != "padded":
                sizes = [2, 2] if packing == "even" else [2, 1]
                result = cell.fused(zeros(sum(sizes), 1), torch.tensor(sizes), hx, weights, True, 1, 0.0,
                                    False, False)
            else:
                result = cell.fused(zeros(1, 1, 1), hx, weights, True, 1, 0.0, False, False, False)
        return tuple(t.dtype for t in result)
    except (RuntimeError, NotImplementedError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warnings.warn(f"rnndrop: torch's {cell.mode} cannot run under autocast to {autocast_dtype} on "
                      f"{device_type} ({reason}); Variational{cell.mode} computes in {weight_dtype} there",
                      RuntimeWarning, stacklevel=2)
        return (weight_dtype,) * (1 + cell.num_states)


def _autocast_device_type(input: object) -> str | None:
    """The device type of ``input``'s data when autocast is enabled for it, else None."""
    data = input.data if isinstance(input, PackedSequence) else input
    if not isinstance(data, Tensor):
        return None
    device_type = data.device.type
    try:
        return device_type if torch.is_autocast_enabled(device_type) else None
    except (RuntimeError, ValueError):  # a device type autocast does not know
        return None


_Stack = TypeVar("_Stack", bound="VariationalRNNStack")


class VariationalRNNStack(Stochastic):
    """The settings and forward pass of VariationalLSTM and VariationalGRU; placed before
    ``nn.LSTM`` / ``nn.GRU``.

    A subclass sets ``_cell`` (a :class:`CellSpec`), calls the torch constructor with
    ``dropout=0`` (the masks are the dropout) and then :meth:`_init_dropout`, and implements
    the typed ``forward`` of its torch class by calling :meth:`_forward`.

    Hooks for subclasses (:class:`~rnndrop.GaussianLSTM` and :class:`~rnndrop.SparseLSTM`
    override them; plain methods, overridden the usual way):

    ``_draw_sites(sites, scope, device, dtype, generator) -> RecurrentMasks``
        the masks of a call's :class:`~rnndrop.noise.MaskSite` list (:meth:`_mask_sites`: name,
        shape, probability of every site), drawn: :func:`rnndrop.noise.draw_masks` in one draw
        unless overridden (GaussianLSTM draws its learned-variance noise). :meth:`sample_masks`
        and the forward pass's own draw both call it; the forward pass checks what an override
        returns like masks passed in.
    ``_layer_weights(layer, direction) -> LayerWeights``
        the weights one layer and direction computes with, asked once per layer and direction
        in every forward call: the module's parameters unless overridden (SparseLSTM samples
        or prunes them).
    """

    _cell: ClassVar[CellSpec]

    # Attributes of nn.RNNBase, which a subclass also derives from.
    input_size: int
    hidden_size: int
    num_layers: int
    bias: bool
    batch_first: bool
    bidirectional: bool
    training: bool
    weight_ih_l0: Tensor

    # ------------------------------------------------------------------ settings

    # Checked whenever they are set, in the constructor and after it (validation.checked_setting).
    dropout = checked_setting("dropout", check_probability)
    dropout_input = checked_setting("dropout_input", check_probability)
    dropout_hidden = checked_setting("dropout_hidden", check_probability)
    dropout_output = checked_setting("dropout_output", check_probability)
    mask_scope = checked_setting("mask_scope", lambda name, value: check_choice(name, value, MASK_SCOPES))
    per_gate_masks = checked_setting("per_gate_masks", check_bool)
    noise = checked_setting("noise", lambda name, value: check_choice(name, value, NOISES))
    kernel = checked_setting("kernel", lambda name, value: check_choice(name, value, ("auto", *KERNELS)))

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
        """Keep the dropout arguments (each checked as it is set: the class attributes above)."""
        self.dropout = dropout  # the input of layers 1..L-1
        if self.dropout > 0 and self.num_layers == 1:  # nn.RNNBase's warning, word for word
            warnings.warn(
                "dropout option adds dropout after all but last recurrent layer, so non-zero dropout "
                f"expects num_layers greater than 1, but got dropout={dropout} and "
                f"num_layers={self.num_layers}",
                stacklevel=3,
            )
        self.dropout_input = dropout_input
        self.dropout_hidden = dropout_hidden
        self.dropout_output = dropout_output
        self.mask_scope = mask_scope
        self.per_gate_masks = per_gate_masks
        self.noise = noise
        self.kernel = kernel

    @classmethod
    def from_module(cls: type[_Stack], module: nn.RNNBase, **dropout_kwargs: Any) -> _Stack:
        """A layer of this class with ``module``'s configuration, device, dtype and weights.

        ``module`` is an ``nn.LSTM`` (for VariationalLSTM) or ``nn.GRU`` (for VariationalGRU),
        or a subclass with the same cell (``module.mode``); ``dropout_kwargs`` are this
        class's keyword arguments (``dropout_hidden=0.3``, ...). ``dropout`` defaults to
        ``module.dropout``. The parameters a subclass adds (the log alphas of a
        :class:`~rnndrop.GaussianLSTM`, the log sigmas of a :class:`~rnndrop.SparseLSTM`) keep
        their initialisation: Gaussian or sparse training from a trained ``nn.LSTM``. A module
        pruned (``torch.nn.utils.prune``) or parametrized gives the weights it computes with now,
        as plain parameters. Example::

            model.rnn = VariationalLSTM.from_module(model.rnn, dropout_hidden=0.3)
        """
        mode = cls._cell.mode
        if not isinstance(module, nn.RNNBase) or module.mode != mode:
            got = type(module).__name__
            if isinstance(module, nn.RNNBase):
                got += f" (mode {module.mode!r})"
            raise TypeError(f"{cls.__name__}.from_module: module must be an nn.{mode}, got {got}")
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
        layer = cls(module.input_size, module.hidden_size, **config, **dropout_kwargs)  # type: ignore[call-arg]
        # its state dict, with the weights it computes with: a pruned or parametrized module's as they
        # are now (its state dict holds weight_orig and the mask, or the parametrization's original)
        state = {key: value for key, value in module.state_dict().items()
                 if not (key.endswith(("_orig", "_mask")) or key.startswith("parametrizations."))}
        state.update({name: getattr(module, name).detach() for name in module._flat_weights_names})
        loaded = layer.load_state_dict(state, strict=False)  # type: ignore[attr-defined]
        weights = set(layer._flat_weights_names)  # type: ignore[attr-defined]
        lost = [k for k in loaded.missing_keys if k in weights] + list(loaded.unexpected_keys)
        if lost:  # the same configuration: only a subclass's own parameters may be missing
            raise RuntimeError(f"{cls.__name__}.from_module: {module!r} gives other weights than the "
                               f"layer takes: {', '.join(lost)}")
        layer.train(module.training)  # type: ignore[attr-defined]
        return layer

    def to_plain(self) -> nn.RNNBase:
        """A plain ``nn.LSTM`` / ``nn.GRU`` computing this layer's eval-mode function, for deployment.

        Same configuration, device and dtype; its weights are the ones this layer computes with
        in eval mode (its parameters; the pruned weights of a :class:`~rnndrop.SparseLSTM`), so
        in eval mode its outputs equal this layer's. Learned Gaussian noise, like every mask, is
        not drawn in eval mode, so a :class:`~rnndrop.GaussianLSTM` converts too. What the plain
        module cannot do is the stochastic part: it has no dropout masks and no ``masks`` argument
        (Monte-Carlo prediction needs this layer); it keeps ``dropout`` (between layers, which
        ``nn.LSTM`` draws afresh at every step when trained), so that ``from_module`` and
        ``to_plain`` give back the module they started from. Tools made for ``nn.LSTM`` then apply:
        ``torch.ao.quantization.quantize_dynamic``, ``torch.export`` with dynamic shapes, the
        legacy ONNX exporter. The copy is in eval mode and shares no tensor with this layer.
        :func:`rnndrop.to_torch` converts every such layer of a model.
        """
        layer_cls = VariationalLSTM if self._cell.mode == "LSTM" else VariationalGRU
        forward_methods = ("forward", "_forward", "_forward_body")
        if any(getattr(type(self), f) is not getattr(layer_cls, f) for f in forward_methods):
            raise TypeError(
                f"{type(self).__name__}.to_plain: the class overrides the forward pass, so its "
                f"eval-mode function may not be an nn.{self._cell.mode}'s; convert it by hand"
            )
        plain_cls = nn.LSTM if self._cell.mode == "LSTM" else nn.GRU
        proj_size = getattr(self, "proj_size", 0)
        weight = self.weight_ih_l0
        plain = plain_cls(  # type: ignore[call-overload]
            self.input_size, self.hidden_size, self.num_layers, bias=self.bias,
            batch_first=self.batch_first, bidirectional=self.bidirectional,
            dropout=self._dropout_between,  # one layer: nn.RNNBase's warning
            device=weight.device, dtype=weight.dtype, **({"proj_size": proj_size} if proj_size else {}),
        )
        # the weights of eval mode, read from a shallow copy in eval mode (the same parameters): the
        # module itself is never switched, which a call in another thread would see
        evaluating = object.__new__(type(self))  # (copy.copy refuses a parametrized module)
        evaluating.__dict__.update(self.__dict__)
        evaluating.training = False
        with torch.no_grad():
            state = {
                name + f"_l{layer}" + ("_reverse" if d else ""): w.detach().clone()
                for layer in range(self.num_layers)
                for d in range(self._num_directions)
                for name, w in evaluating._layer_weights(layer, d).items()
            }
        plain.load_state_dict(state)
        return plain.eval()

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

    @property
    def _dropout_between(self) -> float:
        """``dropout``, the between-layer probability, where there is a layer after the first."""
        return self.dropout if self.num_layers > 1 else 0.0

    def _has_dropout(self) -> bool:
        return any(p > 0 for p in (self.dropout_input, self._dropout_between, self.dropout_hidden,
                                   self.dropout_output))

    def is_stochastic(self) -> bool:
        return self._has_dropout()

    def shares_noise_across_batch(self) -> bool:
        return self.mask_scope == "batch" and (self.dropout_hidden > 0 or self._dropout_between > 0)

    def switches_to_noise_per_sequence(self) -> bool:
        return self.mask_scope == "batch"

    def trains_in_loop(self) -> bool:
        """Whether a training call runs a loop kernel of rnndrop's rather than one fused op a layer
        (cuDNN / oneDNN), as :meth:`_forward_body` decides: a kernel other than ``"auto"`` always
        does; ``"auto"`` for a recurrent mask per sequence or per step, or per-gate masks (the
        fused op takes no mask, or masks shared by the batch folded into the weights)."""
        if self.kernel != "auto":
            return True
        if self.per_gate_masks:
            return max(self.dropout_input, self._dropout_between, self.dropout_hidden) > 0
        return self.mask_scope != "batch" and self.dropout_hidden > 0

    def extra_repr(self) -> str:
        s = super().extra_repr()  # type: ignore[misc]
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

    # --------------------------------------------------------------------- masks

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
        ``batch_size=1``. Device and dtype default to the weights'. In training,
        ``forward`` draws its fresh masks here.
        """
        check_positive_int("batch_size", batch_size)
        check_seq_len(self.mask_scope, seq_len)
        if generator is not None:
            check_instance("generator", generator, torch.Generator, "a torch.Generator or None")
        return self._sample_masks(batch_size, seq_len, self.mask_scope, device, dtype, generator)

    def _sample_masks(
        self,
        batch_size: int,
        seq_len: int | None,
        scope: str,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        generator: torch.Generator | None = None,
    ) -> RecurrentMasks:
        """:meth:`sample_masks` with masks of ``scope`` (checked arguments)."""
        weight = self.weight_ih_l0
        device = weight.device if device is None else device
        dtype = weight.dtype if dtype is None else dtype
        return self._draw_sites(self._mask_sites(batch_size, seq_len, scope), scope, device, dtype, generator)

    def _draw_sites(
        self, sites: list[MaskSite], scope: str, device: torch.device | str, dtype: torch.dtype,
        generator: torch.Generator | None,
    ) -> RecurrentMasks:
        """The masks of ``sites`` (:meth:`_mask_sites`), drawn: a subclass's hook for a whole draw."""
        drawn = draw_masks(sites, self.noise, device=device, dtype=dtype, generator=generator)
        return self._assembled(drawn, scope)

    def _mask_sites(self, batch_size: int, seq_len: int | None, scope: str) -> list[MaskSite]:
        """The mask sites of a call (:func:`~rnndrop.masks.mask_sites`): every layer's input,
        every layer's and direction's state, the output, in that order."""
        return mask_sites(
            self._geometry,
            batch_size,
            seq_len,
            scope,
            self.per_gate_masks,
            input_p=[self.dropout_input] + [self.dropout] * (self.num_layers - 1),
            hidden_p=self.dropout_hidden,
            output_p=self.dropout_output,
        )

    def _assembled(self, drawn: Sequence[Tensor | None], scope: str) -> RecurrentMasks:
        """The masks drawn for :meth:`_mask_sites`, in its order, as :class:`RecurrentMasks`."""
        L = self.num_layers
        return RecurrentMasks(tuple(drawn[:L]), tuple(drawn[L:-1]), drawn[-1], scope, self.per_gate_masks)

    def _layer_weights(self, layer: int, direction: int) -> LayerWeights:
        """One layer's and direction's weights by their names without the ``_l{k}`` suffix."""
        names = _weight_names(layer, direction, self.bias, bool(getattr(self, "proj_size", 0)))
        return {name: getattr(self, attribute) for name, attribute in names}

    # ------------------------------------------------------------------- forward

    def _forward(
        self,
        input: Tensor | PackedSequence,
        hx: Tensor | tuple[Tensor, ...] | None,
        masks: RecurrentMasks | None,
        return_raw_output: bool,
    ) -> tuple:
        """The forward pass of both cells; ``forward`` of each layer class documents it.

        Returns ``(output, h_n)`` for one state, ``(output, (h_n, c_n))`` for two, and the
        output before the output mask as a third element with ``return_raw_output``.
        """
        if torch.compiler.is_compiling():
            reason = self._untraced_because(input)
            if reason is not None:
                # torch.compile runs the layer eagerly, as it runs nn.LSTM: a graph break, not an error.
                return run_eagerly(reason)(self, input, hx, masks, return_raw_output)
        return self._forward_body(input, hx, masks, return_raw_output)

    def _untraced_because(self, input: Tensor | PackedSequence) -> str | None:
        """Why torch.compile runs this call eagerly (one of :data:`_UNTRACED`), or None where it
        traces it into its graph (it can only where ``torch._dynamo.config.allow_rnn`` is set:
        docs/ecosystem.md): in training mode (masks; eval mode is the fused op, which runs
        eagerly) on a loop kernel that runs as an operator
        (:mod:`rnndrop.kernels.ops`) in the dtype it computes in (under autocast the one
        ``nn.LSTM`` / ``nn.GRU`` would: a half type on CUDA, or a bfloat16 LSTM on the CPU, runs the
        "manual" kernel's loop, which runs eagerly), for a
        padded batch (a packed one's batch sizes are data the graph would depend on), and not while
        torch.export traces (an exported program must not need rnndrop's operators: export runs as
        before). Its masks, projections and states are then part of the graph, and the fused op
        where it still runs (a layer without masks, masks shared by the batch) a graph break."""
        if not tracing_for_compile():
            return _UNTRACED["export"]
        if not self.training:
            return _UNTRACED["eval"]
        if isinstance(input, PackedSequence):
            return _UNTRACED["packed"]
        weight = self.weight_ih_l0
        dtype, device_type = weight.dtype, weight.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = _autocast_result_dtype(self._cell.mode, device_type, dtype,
                                           torch.get_autocast_dtype(device_type),
                                           projected=self._out_size != self.hidden_size)[0]
        kernel = auto_loop_kernel_on(weight.device, dtype) if self.kernel == "auto" else self.kernel
        return None if kernel in TRACEABLE else _UNTRACED["kernel"]

    def _forward_body(
        self,
        input: Tensor | PackedSequence,
        hx: Tensor | tuple[Tensor, ...] | None,
        masks: RecurrentMasks | None,
        return_raw_output: bool,
        autocast: _Autocast | None = None,
    ) -> tuple:
        """:meth:`_forward` without the check for torch.compile (which calls this one eagerly, or
        traces it: :meth:`_untraced_because`); under autocast (:meth:`_forward_autocast`) with the
        dtype it computes in, passed down (never kept on the module: a call in another thread
        would read it)."""
        device_type = _autocast_device_type(input)
        if (exporting() or device_type is not None) and self._computes_as_torch(masks):
            # nn.LSTM's own forward, the same function: torch.export of the eval-mode layer exports
            # it with dynamic shapes (the row layout below would specialise the batch size), and
            # under autocast it is nn.LSTM's function bit for bit (autocast casts the fused op's
            # arguments its own way: batch-first rows, projections).
            torch_forward = (nn.LSTM if self._cell.mode == "LSTM" else nn.GRU).forward
            output, final = torch_forward(self, input, hx)  # type: ignore[call-overload]
            return (output, final, output) if return_raw_output else (output, final)
        if device_type is not None:
            return self._forward_autocast(input, hx, masks, return_raw_output, device_type)
        owner = type(self).__name__
        weight = self.weight_ih_l0
        if autocast is not None:
            weight = weight.new_empty(0, dtype=autocast.compute_dtype)
        x, layout = SequenceLayout.from_input(
            input, batch_first=self.batch_first, input_size=self.input_size, weight=weight, owner=owner,
        )
        sizes = (self._out_size, self.hidden_size)[: self._cell.num_states]
        states = layout.initial_states(hx, sizes, self.num_layers * self._num_directions, x, owner)
        if masks is not None:
            masks = self._given_masks(masks, layout, x)
        elif self.training and self._has_dropout():
            # Fresh masks are drawn in the batch's own order and sorted as given ones are: a seed
            # gives a sequence the same mask packed or padded, drawn here or by sample_masks. A
            # _draw_sites override's are checked like given ones, so that one that draws a wrong shape
            # fails here; the built-in draw gives every site its shape, dtype and device by
            # construction. Masks shared by the batch are drawn per sequence where asked
            # (Monte-Carlo samples stacked in one batch).
            scope = self._scope_to_draw(self.mask_scope)
            masks = self._sample_masks(layout.batch_size, layout.seq_len, scope, x.device, x.dtype)
            if type(self)._draw_sites is not VariationalRNNStack._draw_sites:
                masks.check(self._geometry, layout.batch_size, layout.seq_len, x)
            masks = masks.in_sorted_order(layout.sorted_indices)
        if masks is not None and masks.is_empty():
            masks = None
        raw: list[Tensor] = []
        if masks is None and self.kernel == "auto" and not under_transform(x, *self._transform_probes()):
            out, states = self._forward_fused(x, layout, states, autocast)
        elif (self.kernel == "auto" and masks is not None and masks.scope == "batch" and not masks.per_gate
              and self._fuses(x)):
            out, states = self._forward_folded(x, layout, states, masks, raw if return_raw_output else None,
                                               autocast)
        else:
            out, states = self._forward_by_layer(x, layout, states, masks, raw if return_raw_output else None,
                                                 autocast)
        output, states = layout.restore(out, states)
        final = states if self._cell.num_states > 1 else states[0]
        if not return_raw_output:
            return output, final
        return output, final, layout.restore(raw[0], ())[0] if raw else output

    def _transform_probes(self) -> tuple[Tensor, Tensor]:
        """The first layer's weights, asked with the input whether a call runs under a ``torch.func``
        transform: ``vmap`` over an ensemble's stacked weights (``functional_call``) batches the
        weights alone, and the fused op has no vmap rule."""
        return self.weight_ih_l0, self.weight_hh_l0

    def _fuses(self, x: Tensor) -> bool:
        """Whether ``kernel="auto"`` runs the fused op for a call with masks on rows like ``x``
        (masks shared by the batch folded into the weights, path 2; a layer without a recurrent
        mask in path 3) rather than the loop kernel: everywhere, except for a cell that is not
        :attr:`CellSpec.fused_on_cpu` where the compiled loop kernel runs, and under a
        ``torch.func`` transform or forward-mode AD (the fused op has no vmap rule: the loop of
        torch's own ops runs there)."""
        if under_transform(x, *self._transform_probes()):
            return False
        return self._cell.fused_on_cpu or x.device.type != "cpu" or auto_loop_kernel(x) != "compiled"

    def _computes_as_torch(self, masks: RecurrentMasks | None) -> bool:
        """Whether this call computes exactly ``nn.LSTM.forward`` with the module's parameters:
        eval mode, no masks, the fused kernel and the parameters as they are."""
        return (
            not self.training
            and masks is None
            and self.kernel == "auto"
            and type(self)._layer_weights is VariationalRNNStack._layer_weights
        )

    def _forward_autocast(
        self,
        input: Tensor | PackedSequence,
        hx: Tensor | tuple[Tensor, ...] | None,
        masks: RecurrentMasks | None,
        return_raw_output: bool,
        device_type: str,
    ) -> tuple:
        """:meth:`_forward` under autocast, computing what ``nn.LSTM`` / ``nn.GRU`` compute there.

        Autocast casts the fused op's input, states and weights to one dtype
        (:func:`_autocast_result_dtype`); so does this method, then runs the forward pass with
        autocast off, so that the loop kernels see one dtype throughout. The fused op itself runs
        under the caller's autocast again (:meth:`_run_fused`): on the CPU ``torch.gru`` stays in
        float32 there but its products run in bfloat16, and eval mode stays ``nn.GRU``'s function
        bit for bit. The casts are differentiable: gradients reach the float32 parameters.
        """
        packing = "padded"
        if isinstance(input, PackedSequence):
            packing = "uneven" if bool(input.batch_sizes[0] != input.batch_sizes[-1]) else "even"
        dtypes = _autocast_result_dtype(self._cell.mode, device_type, self.weight_ih_l0.dtype,
                                        torch.get_autocast_dtype(device_type), packing,
                                        self._out_size != self.hidden_size)
        dtype = dtypes[0]

        def cast(t: Tensor) -> Tensor:
            return t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t

        input = input.to(dtype)
        if isinstance(hx, (tuple, list)):
            hx = tuple(cast(s) for s in hx)
        elif hx is not None:
            hx = cast(hx)
        if isinstance(masks, RecurrentMasks):
            masks = masks.map(cast)
        context = _Autocast(dtype, device_type, torch.get_autocast_dtype(device_type))
        with torch.autocast(device_type, enabled=False):
            result = self._forward_body(input, hx, masks, return_raw_output, context)
        if all(d == dtype for d in dtypes):
            return result
        # a state nn.LSTM returns in another dtype than its output (c_n beside a projection, on the CPU)
        final = result[1] if self._cell.num_states > 1 else (result[1],)
        final = tuple(state.to(d) for state, d in zip(final, dtypes[1:]))
        return (result[0], final if self._cell.num_states > 1 else final[0], *result[2:])

    def _weights(self, layer: int, direction: int, autocast: _Autocast | None) -> LayerWeights:
        """:meth:`_layer_weights`, cast to the dtype the layer computes in under autocast."""
        weights = self._layer_weights(layer, direction)
        if autocast is not None:
            weights = {name: w.to(autocast.compute_dtype) for name, w in weights.items()}
        return weights

    def _given_masks(self, masks: RecurrentMasks, layout: SequenceLayout, x: Tensor) -> RecurrentMasks:
        """Masks passed to ``forward``, checked (the kernels rely on it) and in sorted batch order."""
        if not isinstance(masks, RecurrentMasks):
            raise TypeError(f"masks must be a RecurrentMasks or None, got {type(masks).__name__}")
        masks.check(self._geometry, layout.batch_size, layout.seq_len, x)
        return masks.in_sorted_order(layout.sorted_indices)

    def _run_fused(
        self,
        x: Tensor,
        layout: SequenceLayout,
        states: tuple[Tensor, ...],
        weights: list[Tensor],
        num_layers: int,
        autocast: _Autocast | None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``num_layers`` layers in torch's fused op: rows ``[N, in]`` -> ``[N, D * out]``; under
        the caller's autocast again where there was one, as in ``nn.LSTM``.

        ``weights`` are the flat weights of every layer and direction in nn.LSTM's order;
        the op's own dropout is always 0 (the layers apply theirs as masks).
        """
        if tracing_for_compile():  # Inductor cannot compile torch's fused RNN ops
            return run_eagerly(_UNTRACED["fused"])(self, x, layout, states, weights, num_layers, autocast)
        hx = states if self._cell.num_states > 1 else states[0]
        common = (weights, self.bias, num_layers, 0.0, self.training, self.bidirectional)
        if autocast is not None:
            with torch.autocast(autocast.device_type, dtype=autocast.caller_dtype):
                return self._run_fused_op(x, layout, hx, common)
        return self._run_fused_op(x, layout, hx, common)

    def _run_fused_op(
        self, x: Tensor, layout: SequenceLayout, hx: Tensor | tuple[Tensor, ...], common: tuple
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        if layout.packed:
            out, *new_states = self._cell.fused(x, layout.packed_batch_sizes, hx, *common)
        else:
            T, B = layout.seq_len, layout.batch_size
            out, *new_states = self._cell.fused(x.view(T, B, -1), hx, *common, False)
            out = out.reshape(T * B, -1)
        return out, tuple(new_states)

    def _forward_fused(
        self, x: Tensor, layout: SequenceLayout, states: tuple[Tensor, ...], autocast: _Autocast | None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 1, no mask: every layer in one call of torch's fused op."""
        weights = [
            w
            for layer in range(self.num_layers)
            for d in range(self._num_directions)
            for w in self._weights(layer, d, autocast).values()
        ]
        return self._run_fused(x, layout, states, weights, self.num_layers, autocast)

    def _forward_folded(
        self, x: Tensor, layout: SequenceLayout, states: tuple[Tensor, ...], masks: RecurrentMasks,
        raw: list[Tensor] | None, autocast: _Autocast | None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 2, masks shared by the batch (``[1, size]``): ``W (m * v) = (W * m) v``, so layer
        ``k``'s input mask (``k >= 1``) multiplies the columns of its ``W_ih`` and each recurrent
        mask those of its ``W_hh``; then every layer in one call of the fused op. Where the
        weights live in one flat buffer (cuDNN's), the masked ones are views of a copy of it, so
        cuDNN does not copy them again (:mod:`rnndrop.flat_weights`). The first layer's input
        and the output masks stay per sequence and multiply the rows. With ``raw`` (a list), the
        rows before the output mask are appended to it."""
        D = self._num_directions
        if masks.inputs[0] is not None:
            x = layout.mask_rows(x, masks.inputs[0], False)
        weights: list[Tensor] = []
        column_masks: list[Tensor | None] = []
        for layer in range(self.num_layers):
            for d in range(D):
                w = self._weights(layer, d, autocast)
                folded = {"weight_ih": masks.inputs[layer] if layer else None,
                          "weight_hh": masks.hidden[layer * D + d]}
                weights.extend(w.values())
                column_masks.extend(folded.get(name) for name in w)
        weights = masked_weights(weights, column_masks)
        with quiet_weight_compaction(x.device):
            out, new_states = self._run_fused(x, layout, states, weights, self.num_layers, autocast)
        if masks.output is not None:
            if raw is not None:
                raw.append(out)
            out = layout.mask_rows(out, masks.output, False)
        return out, new_states

    def _forward_by_layer(
        self, x: Tensor, layout: SequenceLayout, states: tuple[Tensor, ...], masks: RecurrentMasks | None,
        raw: list[Tensor] | None = None, autocast: _Autocast | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Path 3, layer by layer: the fused op for a layer without recurrent masks, else the
        loop. With ``raw`` (a list), the last layer's rows before the output mask are appended
        to it."""
        D = self._num_directions
        scope = masks.scope if masks is not None else None
        per_step, per_gate = scope == "step", masks is not None and masks.per_gate
        finals: list[list[Tensor]] = [[] for _ in states]  # per state: [B, size] of each layer and direction
        for layer in range(self.num_layers):
            in_mask = masks.inputs[layer] if masks is not None else None
            x_in, in_rows = x, None
            if in_mask is not None and per_gate:  # applied in the input projection
                x_in, in_rows = layout.broadcastable(x, in_mask, per_step)
            elif in_mask is not None:
                x = x_in = layout.mask_rows(x, in_mask, per_step)
            hidden = masks.hidden[layer * D : (layer + 1) * D] if masks is not None else (None,) * D
            plain_layer = in_rows is None and all(m is None for m in hidden)  # no mask inside the layer
            if self.kernel == "auto" and plain_layer and self._fuses(x):
                layer_states = tuple(s[layer * D : (layer + 1) * D] for s in states)
                x, fused_states = self._layer_fused(x, layout, layer, layer_states, autocast)
                new_states: tuple[tuple[Tensor, ...], ...] = tuple(s.unbind() for s in fused_states)
            else:
                # the kernels' form [T', B', (G,) P]: a time dimension of 1 unless per step
                loop_masks = [m if m is None or per_step else m.unsqueeze(0) for m in hidden]
                x, new_states = self._layer_loop(x_in, layout, layer, states, in_rows, loop_masks, autocast)
            for acc, s in zip(finals, new_states):
                acc.extend(s)
        if masks is not None and masks.output is not None:
            if raw is not None:
                raw.append(x)
            x = layout.mask_rows(x, masks.output, per_step)
        return x, tuple(torch.stack(acc) for acc in finals)

    def _layer_fused(
        self, x: Tensor, layout: SequenceLayout, layer: int, states: tuple[Tensor, ...],
        autocast: _Autocast | None,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """One layer (both directions) without recurrent masks through the fused op. cuDNN takes
        a layer's weights without a copy of its own only laid out as a one-layer buffer; in a
        stack's buffer a layer's matrices and its biases lie apart, so they are copied side by side
        into a buffer of their own first (:func:`~rnndrop.flat_weights.masked_weights`: one copy
        instead of cuDNN's one per weight and its host cost)."""
        weights = [w for d in range(self._num_directions) for w in self._weights(layer, d, autocast).values()]
        weights = masked_weights(weights, [None] * len(weights))
        with quiet_weight_compaction(x.device):
            return self._run_fused(x, layout, states, weights, 1, autocast)

    def _layer_loop(
        self,
        x: Tensor,
        layout: SequenceLayout,
        layer: int,
        states: tuple[Tensor, ...],
        in_rows: Tensor | None,
        hidden: list[Tensor | None],
        autocast: _Autocast | None,
    ) -> tuple[Tensor, tuple[tuple[Tensor, ...], ...]]:
        """Path 3: each direction through the cell's loop (:attr:`CellSpec.loop`): the input
        projection of every step at once, with the per-gate input mask ``in_rows`` (paired with
        ``x`` by :meth:`SequenceLayout.broadcastable`), then the loop kernel with the recurrent
        mask ``hidden[d]`` ``[T', B', (G,) P]`` from the initial states ``states`` of the whole
        stack ``[L * D, B, size]``. Returns the rows of both directions side by side ``[N, D * P]``
        and, per state, the final ``[B, size]`` of each direction."""
        refuse_jit_trace(self, self.kernel)
        D = len(hidden)
        outs, finals = [], []
        for d, mask in enumerate(hidden):
            out, final = self._cell.loop(
                self.kernel, x, in_rows, self._weights(layer, d, autocast), layout.batch_sizes,
                tuple(s[layer * D + d] for s in states), mask, bool(d),
            )
            outs.append(out)
            finals.append(final)
        return (outs[0] if D == 1 else torch.cat(outs, dim=-1)), tuple(zip(*finals))


#: Why torch.compile runs a call eagerly (a graph break, the same results; with ``fullgraph=True``
#: dynamo's error quotes the reason): docs/ecosystem.md, "torch.compile".
_UNTRACED = {
    "export": "under torch.export a layer runs without rnndrop's operators (an exported program must "
              "not need them)",
    "eval": "in eval mode a layer runs torch's fused RNN op, as nn.LSTM does, which Inductor cannot "
            "compile: it runs eagerly",
    "packed": "on a packed sequence a layer runs eagerly: its batch sizes are data the graph would "
              "depend on",
    "kernel": "this layer's loop kernel is a Python time loop, not an operator (kernel='manual' or "
              "'autograd', or a bfloat16 LSTM on the CPU under autocast): it runs eagerly",
    "fused": "torch's fused RNN op (a layer without masks, or mask_scope='batch' masks folded into the "
             "weights) runs eagerly: Inductor cannot compile it",
}
eager_under_compile(VariationalRNNStack._forward_body,
                    *(why for case, why in _UNTRACED.items() if case != "fused"))
eager_under_compile(VariationalRNNStack._run_fused, _UNTRACED["fused"])


#: A Tensor in gives a Tensor out, a PackedSequence in a PackedSequence out.
_Sequence = TypeVar("_Sequence", Tensor, PackedSequence)

_DROPOUT_ARGS_DOC = """
    Dropout arguments (keyword-only, probabilities in [0, 1)):
        dropout_input: on the first layer's input.
        dropout_hidden: on the recurrent state ``h_{t-1}`` of every layer and direction.
        dropout_output: on the last layer's output (not on the returned final state).
        mask_scope: ``"sequence"`` (default; Gal & Ghahramani: one mask per sequence,
            the same at every step, fresh at every call), ``"step"`` (naive dropout:
            a fresh mask at every step, the Zaremba et al. baseline) or ``"batch"``
            (the recurrent and between-layer masks are shared by all sequences of the
            batch and folded into ``W_hh`` / ``W_ih``, so the fused cuDNN / oneDNN kernel
            runs every layer in one call; the first input and output masks stay per
            sequence).
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
    """``nn.LSTM`` with Gal & Ghahramani's tied dropout.

    Same constructor (``input_size, hidden_size, num_layers, bias, batch_first,
    dropout, bidirectional, proj_size, device, dtype``), parameters and forward
    contract as ``nn.LSTM``: ``output, (h_n, c_n) = lstm(input, (h_0, c_0))``.
    ``dropout`` keeps its meaning (the input of every layer but the first).

    Each layer computes, at every step ``t``, with its input mask ``M_x`` and its recurrent
    mask ``M_h`` (one per direction)::

        x̃_t = x_t ∘ M_x,    h̃_{t-1} = h_{t-1} ∘ M_h
        i_t = σ(W_ii x̃_t + b_ii + W_hi h̃_{t-1} + b_hi)
        f_t = σ(W_if x̃_t + b_if + W_hf h̃_{t-1} + b_hf)
        g_t = tanh(W_ig x̃_t + b_ig + W_hg h̃_{t-1} + b_hg)
        o_t = σ(W_io x̃_t + b_io + W_ho h̃_{t-1} + b_ho)
        c_t = f_t ∘ c_{t-1} + i_t ∘ g_t
        h_t = o_t ∘ tanh(c_t)                  (W_hr h_t with proj_size > 0)

    and the output of the last layer is ``y_t = h_t ∘ M_y``. ``M_x`` has probability
    ``dropout_input`` on the first layer and ``dropout`` on the others, ``M_h``
    ``dropout_hidden``, ``M_y`` ``dropout_output``. With ``mask_scope="sequence"`` a mask
    is drawn per sequence and call and is the same at every step; with
    ``per_gate_masks=True`` each gate has its own ``M_x`` and ``M_h`` (``W_hi (h_{t-1} ∘
    M_h^i)``, ...). The cell state ``c_t`` is never masked. This is the step of
    :class:`~rnndrop.VariationalLSTMCell` called with ``input_mask=M_x, hidden_mask=M_h``;
    the tests hold every loop kernel to the cell.

    Inputs: input, (h_0, c_0), masks
        * **input**: ``(L, N, H_in)``, ``(N, L, H_in)`` with ``batch_first=True``,
          ``(L, H_in)`` unbatched, or a ``PackedSequence``.
        * **h_0**: ``(D * num_layers, N, H_out)`` (``(D * num_layers, H_out)`` unbatched);
          zeros when ``(h_0, c_0)`` is not given.
        * **c_0**: ``(D * num_layers, N, H_cell)`` (``(D * num_layers, H_cell)`` unbatched).
        * **masks** (optional): a :class:`~rnndrop.RecurrentMasks` from :meth:`sample_masks`,
          used instead of fresh masks, in eval mode too (truncated BPTT, Monte-Carlo
          prediction). Its batch order is that of ``input`` (also for a ``PackedSequence``
          with ``enforce_sorted=False``).
        * **return_raw_output** (keyword, default False): also return the last layer's
          output before ``M_y`` (for TAR, :mod:`rnndrop.activation_regularization`).

    Outputs: output, (h_n, c_n)[, raw_output]
        * **output**: ``(L, N, D * H_out)``, ``(N, L, D * H_out)`` with ``batch_first=True``,
          ``(L, D * H_out)`` unbatched, or a ``PackedSequence`` for a ``PackedSequence`` input.
        * **h_n**: ``(D * num_layers, N, H_out)``: the final hidden state of every layer and
          direction (unbatched: without ``N``); no output mask on it.
        * **c_n**: ``(D * num_layers, N, H_cell)``: the final cell state.
        * **raw_output** (with ``return_raw_output=True``): laid out as ``output``; ``output``
          itself when there is no output mask.

    where ``L`` is the sequence length, ``N`` the batch size, ``D`` 2 if ``bidirectional``
    else 1, ``H_in = input_size``, ``H_cell = hidden_size``, ``H_out = proj_size`` if
    ``proj_size > 0`` else ``hidden_size``.

    Example::

        lstm = VariationalLSTM(650, 650, num_layers=2, dropout=0.5,
                               dropout_input=0.5, dropout_hidden=0.3)
        lstm.load_state_dict(nn_lstm.state_dict())
        out, (h_n, c_n) = lstm(x)
    """

    __doc__ += _DROPOUT_ARGS_DOC
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

    @overload
    def forward(
        self,
        input: _Sequence,
        hx: tuple[Tensor, Tensor] | None = None,
        masks: RecurrentMasks | None = None,
        *,
        return_raw_output: Literal[False] = False,
    ) -> tuple[_Sequence, tuple[Tensor, Tensor]]: ...

    @overload
    def forward(
        self,
        input: _Sequence,
        hx: tuple[Tensor, Tensor] | None = None,
        masks: RecurrentMasks | None = None,
        *,
        return_raw_output: Literal[True],
    ) -> tuple[_Sequence, tuple[Tensor, Tensor], _Sequence]: ...

    def forward(
        self,
        input: Tensor | PackedSequence,
        hx: tuple[Tensor, Tensor] | None = None,
        masks: RecurrentMasks | None = None,
        return_raw_output: bool = False,  # keyword-only in the typed overloads; see _forward
    ) -> tuple:
        """``output, (h_n, c_n) = lstm(input, (h_0, c_0), masks)``; shapes in the class docstring."""
        return self._forward(input, hx, masks, return_raw_output)


class VariationalGRU(VariationalRNNStack, nn.GRU):
    """``nn.GRU`` with Gal & Ghahramani's tied dropout.

    Same constructor (``input_size, hidden_size, num_layers, bias, batch_first,
    dropout, bidirectional, device, dtype``), parameters and forward contract as
    ``nn.GRU``: ``output, h_n = gru(input, h_0)``. ``dropout`` keeps its meaning (the
    input of every layer but the first).

    Each layer computes, at every step ``t``, with its input mask ``M_x`` and its recurrent
    mask ``M_h`` (one per direction)::

        x̃_t = x_t ∘ M_x,    h̃_{t-1} = h_{t-1} ∘ M_h
        r_t = σ(W_ir x̃_t + b_ir + W_hr h̃_{t-1} + b_hr)
        z_t = σ(W_iz x̃_t + b_iz + W_hz h̃_{t-1} + b_hz)
        n_t = tanh(W_in x̃_t + b_in + r_t ∘ (W_hn h̃_{t-1} + b_hn))
        h_t = (1 - z_t) ∘ n_t + z_t ∘ h_{t-1}

    and the output of the last layer is ``y_t = h_t ∘ M_y``. The recurrent mask acts inside
    ``W_hh h_{t-1}`` only: the update ``z_t ∘ h_{t-1}`` uses the unmasked state. The reset
    gate acts after the product, as in ``nn.GRU`` and cuDNN; Gal & Ghahramani's GRU applies it
    before (``W_hn (r_t ∘ h̃_{t-1})``), a different cell with the same masks. Masks,
    scopes and per-gate masks as for :class:`VariationalLSTM`. This is the step of
    :class:`~rnndrop.VariationalGRUCell` called with ``input_mask=M_x, hidden_mask=M_h``;
    the tests hold every loop kernel to the cell.

    Inputs: input, h_0, masks
        * **input**: ``(L, N, H_in)``, ``(N, L, H_in)`` with ``batch_first=True``,
          ``(L, H_in)`` unbatched, or a ``PackedSequence``.
        * **h_0**: ``(D * num_layers, N, H_out)`` (``(D * num_layers, H_out)`` unbatched);
          zeros when not given.
        * **masks** (optional): a :class:`~rnndrop.RecurrentMasks` from :meth:`sample_masks`,
          used instead of fresh masks, in eval mode too. Its batch order is that of ``input``.
        * **return_raw_output** (keyword, default False): also return the last layer's
          output before ``M_y``.

    Outputs: output, h_n[, raw_output]
        * **output**: ``(L, N, D * H_out)``, ``(N, L, D * H_out)`` with ``batch_first=True``,
          ``(L, D * H_out)`` unbatched, or a ``PackedSequence`` for a ``PackedSequence`` input.
        * **h_n**: ``(D * num_layers, N, H_out)``: the final hidden state of every layer and
          direction (unbatched: without ``N``); no output mask on it.
        * **raw_output** (with ``return_raw_output=True``): laid out as ``output``; ``output``
          itself when there is no output mask.

    where ``L`` is the sequence length, ``N`` the batch size, ``D`` 2 if ``bidirectional``
    else 1, ``H_in = input_size``, ``H_out = hidden_size``.

    Example::

        gru = VariationalGRU(200, 200, num_layers=2, dropout=0.3, dropout_hidden=0.2)
        out, h_n = gru(x)
    """

    __doc__ += _DROPOUT_ARGS_DOC
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
        # nn.GRU gets dropout=0: it never applies it, and _init_dropout gives its warning.
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

    @overload
    def forward(
        self,
        input: _Sequence,
        hx: Tensor | None = None,
        masks: RecurrentMasks | None = None,
        *,
        return_raw_output: Literal[False] = False,
    ) -> tuple[_Sequence, Tensor]: ...

    @overload
    def forward(
        self,
        input: _Sequence,
        hx: Tensor | None = None,
        masks: RecurrentMasks | None = None,
        *,
        return_raw_output: Literal[True],
    ) -> tuple[_Sequence, Tensor, _Sequence]: ...

    def forward(
        self,
        input: Tensor | PackedSequence,
        hx: Tensor | None = None,
        masks: RecurrentMasks | None = None,
        return_raw_output: bool = False,  # keyword-only in the typed overloads; see _forward
    ) -> tuple:
        """``output, h_n = gru(input, h_0, masks)``; shapes in the class docstring."""
        return self._forward(input, hx, masks, return_raw_output)
