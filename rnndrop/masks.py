"""Sampling of dropout masks: the one place where rnndrop draws noise.

A mask is a tensor that multiplies an activation. Bernoulli masks hold 0 or
``1 / (1 - p)`` (inverted dropout, so the expected value is 1); Gaussian masks
hold ``1 + sqrt(alpha) * eps`` with ``eps ~ N(0, 1)`` and ``alpha = p / (1 - p)``,
the Gaussian dropout of the same variance (Srivastava et al. 2014, Kingma et al. 2015).

How long a mask lives is its *scope*:

``"sequence"``  one mask per sequence, reused at every time step (Gal & Ghahramani 2016)
``"step"``      a fresh mask at every time step (naive dropout, Zaremba et al. 2014)
``"batch"``     one mask shared by the whole batch (what can be folded into a weight)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rnndrop.validation import (
    check_bool,
    check_choice,
    check_positive_int,
    check_probability,
    check_tensor_like,
)

MASK_SCOPES: tuple[str, ...] = ("sequence", "step", "batch")
NOISES: tuple[str, ...] = ("bernoulli", "gaussian")

#: Probabilities ``p`` with ``min(p, 1 - p)`` below this are drawn exactly (see :func:`bernoulli_mask`).
_FAST_DRAW_MIN = 2.0**-8


def mask_shape(
    scope: str, batch_size: int, size: int, seq_len: int | None = None, gates: int | None = None
) -> tuple[int, ...]:
    """Shape of a mask for ``size`` features.

    ``"sequence"``: ``[batch, size]``; ``"step"``: ``[seq_len, batch, size]``;
    ``"batch"``: ``[1, size]``. With ``gates`` (one mask per gate, Gal's untied
    variant) a gate dimension is inserted before ``size``: ``[..., gates, size]``.
    """
    check_choice("scope", scope, MASK_SCOPES)
    if scope == "step":
        if seq_len is None:
            raise ValueError("seq_len is required for masks with scope 'step', got None")
        check_positive_int("seq_len", seq_len)
        lead: tuple[int, ...] = (seq_len, batch_size)
    elif scope == "sequence":
        lead = (batch_size,)
    else:
        lead = (1,)
    return (*lead, gates, size) if gates else (*lead, size)


def bernoulli_mask(
    shape: Sequence[int],
    p: float,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """A tensor of ``shape`` holding 0 with probability ``p`` and ``1 / (1 - p)`` otherwise.

    For ``2**-8 <= p <= 1 - 2**-8`` (every usual dropout rate) ``p`` is resolved to a
    multiple of 2**-16: each element compares 16 random bits with a threshold. Cutting
    64-bit random integers into four 16-bit draws costs about half of
    ``torch.rand(shape) >= p`` (and a fifth of ``bernoulli_``) on CPU, which matters for
    weight-sized masks (DropConnect on ``W_hh``); the kept fraction is then off by at
    most ``2**-17 / (1 - p) <= 2**-9`` of itself. Outside that range 16 bits cannot
    express ``p`` well (``p`` just below 1 would round to 1, ``p`` below ``2**-17`` to 0),
    so the element is drawn exactly as ``rand >= p`` with 53-bit uniforms instead.
    """
    p = check_probability("p", p)
    dtype = dtype or torch.get_default_dtype()
    if min(p, 1.0 - p) < _FAST_DRAW_MIN:
        uniform = torch.rand(tuple(shape), dtype=torch.float64, device=device, generator=generator)
        keep = uniform >= p
    else:
        numel = math.prod(shape)
        words = torch.empty((numel + 3) // 4, dtype=torch.int64, device=device)
        words.random_(-(2**63), None, generator=generator)  # all 64 bits random
        bits = words.view(torch.int16)[:numel].view(tuple(shape))
        keep = bits >= round(p * 65536) - 32768  # in [-32512, 32512]: no int16 overflow
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


def gaussian_mask(
    shape: Sequence[int],
    alpha: float | Tensor,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``1 + sqrt(alpha) * eps``, ``eps ~ N(0, 1)``: multiplicative noise of mean 1, variance alpha.

    ``alpha`` may be a tensor (a learned variance) broadcastable to ``shape``; the
    result is then differentiable with respect to it.
    """
    if isinstance(alpha, Tensor):
        device = device or alpha.device
        dtype = dtype or alpha.dtype
    dtype = dtype or torch.get_default_dtype()
    eps = torch.randn(tuple(shape), device=device, dtype=dtype, generator=generator)
    if isinstance(alpha, Tensor):
        return 1.0 + alpha.sqrt() * eps
    return eps.mul_(math.sqrt(alpha)).add_(1.0)


def sample_mask(
    shape: Sequence[int],
    p: float,
    noise: str = "bernoulli",
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor | None:
    """A mask of ``shape`` for dropout probability ``p``, or ``None`` when ``p == 0``.

    ``noise="gaussian"`` draws Gaussian noise of the same variance as Bernoulli
    dropout with probability ``p``: ``alpha = p / (1 - p)``.
    """
    if p == 0:
        return None
    if noise == "bernoulli":
        return bernoulli_mask(shape, p, device=device, dtype=dtype, generator=generator)
    if noise == "gaussian":
        return gaussian_mask(shape, p / (1.0 - p), device=device, dtype=dtype, generator=generator)
    raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")


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
    """The shape of every mask of one forward call (see :meth:`RecurrentMasks.shapes`)."""

    inputs: tuple[tuple[int, ...], ...]
    hidden: tuple[tuple[int, ...], ...]
    output: tuple[int, ...]


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
            :func:`mask_shape`. With ``"batch"`` only ``hidden`` masks are shared by
            the batch; ``inputs`` and ``output`` are per sequence.
        per_gate: whether masks carry a gate dimension ``[..., gates, size]``
            (``inputs`` and ``hidden`` only).
    """

    inputs: tuple[Tensor | None, ...]
    hidden: tuple[Tensor | None, ...]
    output: Tensor | None
    scope: str = "sequence"
    per_gate: bool = False

    def map(self, fn) -> RecurrentMasks:
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

    # ---------------------------------------------------------------- planning

    @staticmethod
    def shapes(
        geometry: StackGeometry, batch_size: int, seq_len: int | None, scope: str, per_gate: bool
    ) -> MaskShapes:
        """The shape of every mask for ``batch_size`` sequences of ``seq_len`` steps.

        Shapes follow :func:`mask_shape`. ``scope="batch"`` shares only the recurrent
        masks across the batch; input and output masks stay per sequence.
        """
        gates = geometry.gates if per_gate else None
        outer = "step" if scope == "step" else "sequence"
        sizes = [geometry.input_size] + [geometry.layer_output_size] * (geometry.num_layers - 1)
        return MaskShapes(
            inputs=tuple(mask_shape(outer, batch_size, size, seq_len, gates) for size in sizes),
            hidden=(mask_shape(scope, batch_size, geometry.state_size, seq_len, gates),)
            * (geometry.num_layers * geometry.num_directions),
            output=mask_shape(outer, batch_size, geometry.layer_output_size, seq_len),
        )

    @classmethod
    def sample(
        cls,
        geometry: StackGeometry,
        *,
        input_p: Sequence[float],
        hidden_p: float,
        output_p: float,
        batch_size: int,
        seq_len: int | None,
        scope: str,
        per_gate: bool,
        draw: Callable[[str, tuple[int, ...], float], Tensor | None],
    ) -> RecurrentMasks:
        """Draw every mask with ``draw(site, shape, p)`` (None: no dropout at that site).

        ``input_p[k]`` is the probability on layer ``k``'s input; sites are named
        ``input_l{k}``, ``hidden_l{k}[_reverse]`` and ``output``.
        """
        shapes = cls.shapes(geometry, batch_size, seq_len, scope, per_gate)
        return cls(
            inputs=tuple(
                draw(f"input_l{k}", shape, p) for k, (shape, p) in enumerate(zip(shapes.inputs, input_p))
            ),
            hidden=tuple(
                draw(geometry.hidden_site(i), shape, hidden_p) for i, shape in enumerate(shapes.hidden)
            ),
            output=draw("output", shapes.output, output_p),
            scope=scope,
            per_gate=per_gate,
        )

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

    # ---------------------------------------------------------------- use

    def in_sorted_order(self, sorted_indices: Tensor | None) -> RecurrentMasks:
        """The masks with their batch dimension permuted to a PackedSequence's sorted order."""
        if sorted_indices is None:
            return self
        dim = 1 if self.scope == "step" else 0

        def to_sorted(mask: Tensor) -> Tensor:
            return mask.index_select(dim, sorted_indices) if mask.shape[dim] > 1 else mask

        return self.map(to_sorted)

    def hidden_for_kernel(self, index: int) -> Tensor | None:
        """Recurrent mask ``index`` in the loop kernels' form ``[T', B', (G,) P]``:
        a time dimension of 1 (the same mask at every step) unless the scope is ``"step"``."""
        mask = self.hidden[index]
        if mask is None or self.scope == "step":
            return mask
        return mask.unsqueeze(0)

    def is_empty(self) -> bool:
        """True when no mask is set anywhere."""
        return self.output is None and all(m is None for m in (*self.inputs, *self.hidden))
