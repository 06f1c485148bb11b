"""Locked (variational) dropout on a sequence tensor: one mask per sequence, shared over time.

The dropout that Gal & Ghahramani (2016) put on the inputs and outputs of a
recurrent layer, and that AWD-LSTM (Merity et al. 2017) calls ``LockedDropout``:
every sequence of the batch draws one mask over the features and applies it at
every time step.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnndrop.layout import mask_packed_sequence, packed_sequence_index
from rnndrop.noise import NOISES, sample_mask
from rnndrop.stochastic import Stochastic
from rnndrop.validation import check_bool, check_choice, check_probability, checked_setting

__all__ = ["LockedDropout", "packed_sequence_index"]


class LockedDropout(Stochastic, nn.Module):
    """Dropout whose mask is drawn once per sequence and reused at every time step.

    Args:
        p: dropout probability in [0, 1); kept values are scaled by ``1 / (1 - p)``.
        batch_first: input is ``[B, T, *]`` instead of ``[T, B, *]``.
        noise: ``"bernoulli"`` or ``"gaussian"`` (multiplicative ``N(1, p / (1 - p))``).

    Shapes:
        input: ``[T, B, *features]`` (``[B, T, *features]`` with ``batch_first``), or a
            ``PackedSequence`` whose data is ``[N, *features]``.
        mask: ``[1, B, *features]`` (``[B, 1, *features]``), one per sequence.
        returns: like ``input`` (a ``PackedSequence`` for a ``PackedSequence``).

    In eval mode (or with ``p = 0``) the input is returned unchanged.
    """

    # checked whenever set (a dropout schedule sets p between epochs)
    p = checked_setting("p", check_probability)
    batch_first = checked_setting("batch_first", check_bool)
    noise = checked_setting("noise", lambda name, value: check_choice(name, value, NOISES))

    def __init__(self, p: float, *, batch_first: bool = False, noise: str = "bernoulli") -> None:
        super().__init__()
        self.p = p
        self.batch_first = batch_first
        self.noise = noise

    def is_stochastic(self) -> bool:
        return self.p > 0

    def forward(self, x: Tensor | PackedSequence) -> Tensor | PackedSequence:
        values = x.data if isinstance(x, PackedSequence) else x
        if isinstance(values, Tensor) and not values.is_floating_point():
            raise TypeError(f"x must hold floating-point values (dropout scales them), got {values.dtype}")
        if isinstance(x, PackedSequence):
            if not (self.training and self.p > 0):
                return x
            data = x.data
            batch = int(x.batch_sizes[0])
            # Masks are i.i.d. over sequences, so the sorted order needs no unsorting.
            mask = sample_mask(
                (batch, *data.shape[1:]), self.p, self.noise, device=data.device, dtype=data.dtype
            )
            return mask_packed_sequence(x, mask)
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a Tensor or PackedSequence, got {type(x).__name__}")
        if x.dim() < 2:
            layout = "[B, T, *features]" if self.batch_first else "[T, B, *features]"
            raise ValueError(f"x must be at least 2-D {layout}, got shape {list(x.shape)}")
        if not (self.training and self.p > 0):
            return x
        time_dim = 1 if self.batch_first else 0
        shape = list(x.shape)
        shape[time_dim] = 1
        mask = sample_mask(shape, self.p, self.noise, device=x.device, dtype=x.dtype)
        return x * mask

    def extra_repr(self) -> str:
        s = f"p={self.p}"
        if self.batch_first:
            s += ", batch_first=True"
        if self.noise != "bernoulli":
            s += f", noise={self.noise!r}"
        return s
