"""Dropout masks of recurrent layers: their scopes, their sites, and the masks of one call.

The noise itself is drawn in :mod:`rnndrop.noise` (Bernoulli or Gaussian).
How long a mask lives is its *scope*:

``"sequence"``  one mask per sequence, reused at every time step (Gal & Ghahramani 2016)
``"step"``      a fresh mask at every time step (naive dropout, Zaremba et al. 2014)
``"batch"``     one mask shared by the whole batch (what can be folded into a weight;
                the stack's first input and its output stay per sequence)

A recurrent layer's masks: :func:`mask_sites` lists the sites of a stack of layers
(name, shape, probability) in drawing order and the layer draws each with
:func:`rnndrop.noise.draw_mask`, the one sampling function, into a
:class:`RecurrentMasks`. Drawn masks have their shapes by construction; masks a
caller passes in are checked (:meth:`RecurrentMasks.check`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from rnndrop.noise import MaskSite
from rnndrop.tracing import traced_cache
from rnndrop.validation import (
    check_bool,
    check_choice,
    check_positive_int,
    check_tensor_like,
)

__all__ = [
    "MASK_SCOPES",
    "MaskShapes",
    "RecurrentMasks",
    "StackGeometry",
    "check_seq_len",
    "mask_shape",
    "mask_sites",
    "stack_mask_shapes",
]

MASK_SCOPES: tuple[str, ...] = ("sequence", "step", "batch")

def mask_shape(
    scope: str, batch_size: int, size: int, seq_len: int | None = None, gates: int | None = None
) -> tuple[int, ...]:
    """Shape of a mask for ``size`` features.

    ``"sequence"``: ``[batch, size]``; ``"step"``: ``[seq_len, batch, size]``;
    ``"batch"``: ``[1, size]``. With ``gates`` (one mask per gate, Gal's untied
    variant) a gate dimension is inserted before ``size``: ``[..., gates, size]``.
    """
    check_choice("scope", scope, MASK_SCOPES)
    check_seq_len(scope, seq_len)
    return _shape(scope, batch_size, size, seq_len, gates)


def check_seq_len(scope: str, seq_len: int | None) -> None:
    """Raise unless ``seq_len`` is a positive int where ``scope`` (``"step"``) needs one, and
    None or a positive int elsewhere (where it is not used)."""
    if scope == "step" and seq_len is None:
        raise ValueError("seq_len is required for masks with scope 'step', got None")
    if seq_len is not None:
        check_positive_int("seq_len", seq_len)


def _shape(scope: str, batch_size: int, size: int, seq_len: int | None, gates: int | None) -> tuple[int, ...]:
    """:func:`mask_shape` of arguments already checked."""
    if scope == "step":
        lead: tuple[int, ...] = (seq_len, batch_size)  # type: ignore[assignment]
    elif scope == "sequence":
        lead = (batch_size,)
    else:
        lead = (1,)
    return (*lead, gates, size) if gates else (*lead, size)


@dataclass(frozen=True)
class StackGeometry:
    """The sizes that fix the mask shapes of a stack of recurrent layers.

    Attributes:
        input_size: features of the first layer's input.
        state_size: features of ``h`` per direction (``proj_size or hidden_size``).
        num_layers, num_directions: as ``nn.LSTM``.
        gates: gates of the cell (4 LSTM, 3 GRU); the size of a per-gate mask's gate dimension.
    """

    input_size: int
    state_size: int
    num_layers: int
    num_directions: int
    gates: int

    @property
    def layer_output_size(self) -> int:
        """Features of a layer's output, both directions: the input of the next layer."""
        return self.num_directions * self.state_size

    def hidden_site(self, index: int) -> str:
        """Name of the recurrent mask ``index = layer * num_directions + direction``."""
        layer, direction = divmod(index, self.num_directions)
        return f"hidden_l{layer}" + ("_reverse" if direction else "")


@dataclass(frozen=True)
class MaskShapes:
    """The shape of every mask of one forward call (see :func:`stack_mask_shapes`)."""

    inputs: tuple[tuple[int, ...], ...]
    hidden: tuple[tuple[int, ...], ...]
    output: tuple[int, ...]


def stack_mask_shapes(
    geometry: StackGeometry, batch_size: int, seq_len: int | None, scope: str, per_gate: bool
) -> MaskShapes:
    """The shape of every mask of a stack for ``batch_size`` sequences of ``seq_len`` steps.

    Shapes follow :func:`mask_shape` (arguments already checked). ``scope="batch"``
    shares the masks inside the stack across the batch (the recurrent masks and the inputs
    of layers ``1..L-1``: what folds into the weights' columns); the first layer's input and
    the output masks stay per sequence.
    """
    gates = geometry.gates if per_gate else None
    outer = "step" if scope == "step" else "sequence"
    first = _shape(outer, batch_size, geometry.input_size, seq_len, gates)
    between = _shape(scope, batch_size, geometry.layer_output_size, seq_len, gates)
    return MaskShapes(
        inputs=(first, *(between,) * (geometry.num_layers - 1)),
        hidden=(_shape(scope, batch_size, geometry.state_size, seq_len, gates),)
        * (geometry.num_layers * geometry.num_directions),
        output=_shape(outer, batch_size, geometry.layer_output_size, seq_len, None),
    )


@dataclass(frozen=True)
class RecurrentMasks:
    """All the masks one forward call of a recurrent layer uses.

    Sampled by :meth:`VariationalLSTM.sample_masks` (or built by hand) and passed
    as ``forward(..., masks=...)`` to reuse them over several calls (truncated
    BPTT, Monte-Carlo evaluation). ``None`` anywhere means "no dropout there".

    Attributes:
        inputs: one mask per layer on that layer's input, shared by both directions.
            Layer 0's has probability ``dropout_input``; layer ``k >= 1``'s has
            ``dropout``, nn.LSTM's argument for the dropout *between* layers. Sampling
            calls these sites ``input_l{k}`` for every ``k`` (GaussianLSTM's parameters
            ``log_alpha_input_l{k}``).
        hidden: one mask per layer and direction (index ``layer * num_directions +
            direction``) on the recurrent state ``h_{t-1}``.
        output: mask on the last layer's output (``dropout_output``).
        scope: ``"sequence"``, ``"step"`` or ``"batch"``; shapes follow
            :func:`mask_shape`. With ``"batch"`` the ``hidden`` masks and ``inputs[1:]``
            (between layers) are shared by the batch; ``inputs[0]`` and ``output`` are per
            sequence.
        per_gate: whether masks carry a gate dimension ``[..., gates, size]``
            (``inputs`` and ``hidden`` only).
    """

    inputs: tuple[Tensor | None, ...]
    hidden: tuple[Tensor | None, ...]
    output: Tensor | None
    scope: str = "sequence"
    per_gate: bool = False

    def map(self, fn: Callable[[Tensor], Tensor]) -> RecurrentMasks:
        """Apply ``fn`` to every mask that is not None (e.g. ``lambda m: m.to(device)``)."""

        def one(m: Tensor | None) -> Tensor | None:
            return None if m is None else fn(m)

        return RecurrentMasks(
            inputs=tuple(map(one, self.inputs)),
            hidden=tuple(map(one, self.hidden)),
            output=one(self.output),
            scope=self.scope,
            per_gate=self.per_gate,
        )

    @staticmethod
    def shapes(
        geometry: StackGeometry, batch_size: int, seq_len: int | None, scope: str, per_gate: bool
    ) -> MaskShapes:
        """The shape of every mask for ``batch_size`` sequences of ``seq_len`` steps
        (:func:`stack_mask_shapes`)."""
        return stack_mask_shapes(geometry, batch_size, seq_len, scope, per_gate)

    def check(self, geometry: StackGeometry, batch_size: int, seq_len: int, like: Tensor) -> None:
        """Raise unless every mask has its exact shape and ``like``'s dtype and device."""
        check_choice("masks.scope", self.scope, MASK_SCOPES)
        check_bool("masks.per_gate", self.per_gate)
        shapes = self.shapes(geometry, batch_size, seq_len, self.scope, self.per_gate)
        note = f" (scope {self.scope!r}, per_gate={self.per_gate})"
        for name, given, expected in (
            ("masks.inputs", self.inputs, shapes.inputs),
            ("masks.hidden", self.hidden, shapes.hidden),
        ):
            if not isinstance(given, (tuple, list)) or len(given) != len(expected):
                got = len(given) if isinstance(given, (tuple, list)) else type(given).__name__
                raise ValueError(f"{name} must hold {len(expected)} masks, got {got}")
            for i, (mask, shape) in enumerate(zip(given, expected)):
                if mask is not None:
                    check_tensor_like(f"{name}[{i}]", mask, shape, like, shape_note=note)
        if self.output is not None:
            check_tensor_like("masks.output", self.output, shapes.output, like, shape_note=note)

    def in_sorted_order(self, sorted_indices: Tensor | None) -> RecurrentMasks:
        """The masks with their batch dimension permuted to a PackedSequence's sorted order."""
        if sorted_indices is None:
            return self
        dim = 1 if self.scope == "step" else 0

        def to_sorted(mask: Tensor) -> Tensor:
            return mask.index_select(dim, sorted_indices) if mask.shape[dim] > 1 else mask

        return self.map(to_sorted)

    def is_empty(self) -> bool:
        """True when no mask is set anywhere."""
        return self.output is None and all(m is None for m in (*self.inputs, *self.hidden))


def mask_sites(
    geometry: StackGeometry,
    batch_size: int,
    seq_len: int | None,
    scope: str,
    per_gate: bool,
    *,
    input_p: Sequence[float],
    hidden_p: float,
    output_p: float,
) -> tuple[MaskSite, ...]:
    """Every mask site of one forward call, in drawing order (arguments already checked).

    ``input_l{k}`` for every layer (probability ``input_p[k]``), then
    ``hidden_l{k}[_reverse]`` for every layer and direction (``hidden_p``), then
    ``output`` (``output_p``); shapes from :func:`stack_mask_shapes`. The sites are immutable and
    remembered by their arguments (a layer asks for the same ones at every forward pass).
    """
    return _mask_sites(geometry, batch_size, seq_len, scope, per_gate, tuple(input_p), hidden_p, output_p)


@traced_cache(256)
def _mask_sites(
    geometry: StackGeometry,
    batch_size: int,
    seq_len: int | None,
    scope: str,
    per_gate: bool,
    input_p: tuple[float, ...],
    hidden_p: float,
    output_p: float,
) -> tuple[MaskSite, ...]:
    """:func:`mask_sites`, for hashable arguments."""
    shapes = stack_mask_shapes(geometry, batch_size, seq_len, scope, per_gate)
    return (
        *(MaskSite(f"input_l{k}", shape, p) for k, (shape, p) in enumerate(zip(shapes.inputs, input_p))),
        *(MaskSite(geometry.hidden_site(i), shape, hidden_p) for i, shape in enumerate(shapes.hidden)),
        MaskSite("output", shapes.output, output_p),
    )
