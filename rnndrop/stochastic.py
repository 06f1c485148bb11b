"""The marker that tells Monte-Carlo prediction which modules sample noise."""

from __future__ import annotations

from rnndrop.scripting import refuse_torchscript


class Stochastic:
    """Mixin for modules that draw noise in training mode (dropout masks, Gaussian noise).

    :func:`rnndrop.mc.mc_dropout` switches exactly these modules (and ``nn.Dropout``
    and its siblings) to training mode. A subclass overrides :meth:`is_stochastic`
    to say whether it would draw any noise at all with its present settings.
    ``torch.jit.script`` refuses these modules with a reason (:mod:`rnndrop.scripting`).
    """

    __prepare_scriptable__ = refuse_torchscript

    def is_stochastic(self) -> bool:
        """True when a forward call in training mode draws noise."""
        return True

    def shares_noise_across_batch(self) -> bool:
        """True when one draw serves every sequence of a batch (a weight mask, a mask
        with scope ``"batch"``): copies of an input in one batch then see the same
        noise, so Monte-Carlo samples must come from separate calls."""
        return False
