"""DropConnect on the weights of a wrapped module, usually the hidden-to-hidden weights of an RNN.

Wan et al. (2013) drop single weights; Merity et al. (2017, AWD-LSTM) drop the
entries of ``W_hh`` of an LSTM, drawing one weight mask per forward call, so the
same connections are dropped at every time step and the fused cuDNN / oneDNN
kernel still runs. With ``variational=True`` whole columns of the weight are
dropped: for ``W_hh`` that is a unit of ``h_{t-1}`` dropped for every gate, every
step and every sequence of the batch, i.e. Gal & Ghahramani's recurrent dropout
with one mask per batch (what ``VariationalLSTM(mask_scope="batch")`` does).

The parameters stay the module's own: each forward call computes the dropped weights from them
and runs the module with them, so the raw weight is what learns, the state dict is the module's,
and ``.to()``, ``deepcopy`` and ``torch.compile`` need no care. A torch RNN without hooks gets them
through torch's fused op directly; any other module through :func:`torch.func.functional_call`,
which puts them in place for the call's length, so calls of one WeightDrop from several threads
take turns there.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.func import functional_call

from rnndrop.compiling import is_torch_rnn
from rnndrop.flat_weights import forward_with_weights, masked_views, runs_without_hooks, shares_one_buffer
from rnndrop.noise import MaskSite, bernoulli_mask, draw_masks
from rnndrop.recurrent import quiet_weight_compaction
from rnndrop.stochastic import Stochastic
from rnndrop.tracing import eager_under_compile, run_eagerly, tracing_for_compile
from rnndrop.validation import (
    check_bool,
    check_instance,
    check_probability,
    check_tensor_like,
    checked_setting,
    fix_settings,
)

__all__ = ["WeightDrop"]


class WeightDrop(Stochastic, nn.Module):
    """Wrap ``module`` so that the named weights are dropped (DropConnect) in training.

    Args:
        module: the module to wrap, e.g. ``nn.LSTM``, ``nn.GRU``, ``VariationalLSTM``
            or any module with the named parameters; it is ``self.module``.
        weights: names of parameters of ``module`` to drop (``"weight_hh_l0"``,
            ``"weight_hh_l1"``, ...; dotted names reach into submodules). A single
            name may be given as a string.
        p: probability of dropping an entry (a column with ``variational``), in [0, 1).
            Kept entries are scaled by ``1 / (1 - p)``.
        variational: drop whole columns of each (2-D) weight, the same for every row:
            a mask ``[1, in_features]`` instead of one of the weight's shape.

    ``forward(*args, **kwargs)`` is the wrapped module's forward. One mask per
    weight is drawn per call, shared by all time steps and all sequences. In eval
    mode (or with ``p = 0``) it is exactly ``module(*args, **kwargs)``.

    State dict: the module's under the prefix ``module.`` (``module.weight_hh_l0``).
    :meth:`load_state_dict` also takes the module's own keys, so a plain
    ``nn.LSTM`` checkpoint loads as is: ``WeightDrop(lstm, ...).load_state_dict(
    nn.LSTM(...).state_dict())``; ``wd.module.state_dict()`` gives one back.

    Example::

        lstm = WeightDrop(nn.LSTM(400, 1150), ["weight_hh_l0"], p=0.5)
        out, (h, c) = lstm(x)
    """

    #: Under torch.compile a wrapped torch RNN runs eagerly (:meth:`_forward_dropped`), which
    #: :func:`rnndrop.compile_model` reads before it refuses a torch RNN on the CPU.
    runs_torch_rnns_eagerly: ClassVar[bool] = True

    # Checked whenever set (a dropout schedule sets p between epochs); which weights are dropped,
    # and whether by column, are checked against the module once, by the constructor.
    p = checked_setting("p", check_probability)
    variational = checked_setting("variational", check_bool, fixed="its weights were checked for it")

    def __init__(
        self,
        module: nn.Module,
        weights: Iterable[str] | str = ("weight_hh_l0",),
        p: float = 0.5,
        *,
        variational: bool = False,
    ) -> None:
        super().__init__()
        check_instance("module", module, nn.Module, "an nn.Module")
        self.module = module
        self.p = p
        self.variational = variational
        names = (weights,) if isinstance(weights, str) else tuple(weights)
        if not names:
            raise ValueError("weights must name at least one parameter of the module, got none")
        first_name = {id(p): name for name, p in module.named_parameters()}  # a shared one listed once
        available = list(first_name.values())
        tied = {name: first_name[id(p)] for name, p in module.named_parameters(remove_duplicate=False)
                if name not in available}
        for name in names:
            if isinstance(name, str) and name in tied:
                raise ValueError(
                    f"weights: {name!r} is tied to {tied[name]!r} (one parameter): name {tied[name]!r}, "
                    "whose mask then drops the weight at every place it is used"
                )
            if not isinstance(name, str) or name not in available:
                raise ValueError(
                    f"weights: {type(module).__name__} has no parameter {name!r}; "
                    f"its parameters are {', '.join(available) or 'none'}"
                )
            if self.variational and module.get_parameter(name).dim() != 2:
                shape = list(module.get_parameter(name).shape)
                raise ValueError(
                    f"weights: variational=True drops columns of 2-D weights, but {name!r} has shape {shape}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"weights must not repeat a name, got {list(names)}")
        for name in names:
            owner = _dropping_wrapper(module, name)
            if owner is not None:
                raise ValueError(
                    f"weights: {name!r} is already dropped by the WeightDrop at "
                    f"{owner or 'the wrapped module'!r}; a weight can be dropped by one WeightDrop "
                    "only (set the p you want on that one)"
                )
        self.weights = names
        fix_settings(self)

    def _weight(self, name: str) -> Tensor:
        """The wrapped module's weight ``name`` as it is now: a Parameter, or the plain tensor
        that ``torch.func.functional_call`` put in its place (``get_parameter`` refuses those)."""
        owner, _, leaf = name.rpartition(".")
        return getattr(self.module.get_submodule(owner), leaf)

    def is_stochastic(self) -> bool:
        return self.p > 0

    def shares_noise_across_batch(self) -> bool:
        return True  # one weight mask per call

    def mask_shape(self, name: str) -> tuple[int, ...]:
        """The shape of the mask of weight ``name``: the weight's, or ``[1, in_features]``
        with ``variational``."""
        return self._mask_shape(self._weight(name))

    def _mask_shape(self, weight: Tensor) -> tuple[int, ...]:
        return (1, weight.shape[1]) if self.variational else tuple(weight.shape)

    def sample_masks(self, generator: torch.Generator | None = None) -> dict[str, Tensor]:
        """One mask per dropped weight (:meth:`mask_shape`); values 0 or ``1 / (1 - p)``,
        the weight's device and dtype. Weights of one device and dtype get their masks from one
        draw (:func:`~rnndrop.noise.draw_masks`)."""
        return self._sample_masks({name: self._weight(name) for name in self.weights}, generator)

    def _sample_masks(
        self, weights: Mapping[str, Tensor], generator: torch.Generator | None
    ) -> dict[str, Tensor]:
        p = self.p
        first = next(iter(weights.values()))
        if p == 0 or any(w.device != first.device or w.dtype != first.dtype for w in weights.values()):
            return {name: bernoulli_mask(self._mask_shape(w), p, device=w.device, dtype=w.dtype,
                                         generator=generator) for name, w in weights.items()}
        sites = [MaskSite(name, self._mask_shape(w), p) for name, w in weights.items()]
        drawn = draw_masks(sites, "bernoulli", device=first.device, dtype=first.dtype, generator=generator)
        return {site.name: mask for site, mask in zip(sites, drawn) if mask is not None}

    def forward_with_masks(self, masks: Mapping[str, Tensor], /, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward with ``weight * masks[name]`` for each named weight.

        Use it to apply the same masks over several calls (truncated BPTT,
        Monte-Carlo evaluation); it applies them in eval mode too. Each mask must have
        exactly the shape :meth:`mask_shape` gives (no broadcasting) and its weight's
        dtype and device.
        """
        unknown = set(masks) - set(self.weights)
        if unknown:
            raise ValueError(
                f"masks: {sorted(unknown)} are not among the dropped weights {list(self.weights)}"
            )
        weights = {name: self._weight(name) for name in masks}
        for name, mask in masks.items():
            check_tensor_like(f"masks[{name!r}]", mask, self._mask_shape(weights[name]), weights[name],
                              f"the weight {name!r}")
        return self._forward_dropped(weights, masks, args, kwargs)

    def _forward_dropped(self, weights: Mapping[str, Tensor], masks: Mapping[str, Tensor], args: tuple,
                         kwargs: dict) -> Any:
        """The wrapped module's forward with ``weights[name] * masks[name]`` (checked already).
        A flattened cuDNN RNN gets every weight as a view of one buffer laid out as its own
        (:mod:`rnndrop.flat_weights`), which cuDNN runs without copying its weights first, through
        torch's fused op called as its forward calls it (:func:`forward_with_weights`: its forward,
        given other weights, would copy them into a new buffer first) unless it has hooks."""
        if tracing_for_compile() and is_torch_rnn(self.module):
            dropped = {name: weights[name] * m for name, m in masks.items()}
            return run_eagerly(_TORCH_RNN_UNTRACED)(self.module, dropped, args, kwargs)
        # torch's own RNN (not a subclass, whose forward may differ) without hooks: given its weights
        swap_free = type(self.module) in (nn.LSTM, nn.GRU, nn.RNN) and runs_without_hooks(self.module)
        if not masks:
            with self._swaps(swap_free):
                return self.module(*args, **kwargs)
        if (not torch.compiler.is_compiling() and shares_one_buffer(self.module)
                and set(masks) <= set(self.module._flat_weights_names)):  # (torch.compile: as before)
            if swap_free:  # (one buffer: torch's own RNN class, as swap_free asks)
                views = masked_views(self.module, masks)
                return forward_with_weights(self.module, list(views.values()), *args, **kwargs)
            with self._swaps(False):  # (a hook: the module's own forward, given the views for the call)
                return functional_call(self.module, masked_views(self.module, masks), args, kwargs)
        if swap_free and not torch.compiler.is_compiling():  # torch's fused op given the weights
            dropped = {name: weights[name] * m for name, m in masks.items()}
            flat = [dropped.get(name, getattr(self.module, name)) for name in self.module._flat_weights_names]
            with quiet_weight_compaction(flat[0].device):
                return forward_with_weights(self.module, flat, *args, **kwargs)
        with self._swaps(False):  # the weights read inside: another call's are not in place then
            dropped = {name: self._weight(name) * m for name, m in masks.items()}
            return _call_with_weights(self.module, dropped, args, kwargs)

    def _swaps(self, swap_free: bool) -> contextlib.AbstractContextManager:
        """The lock of the calls that put dropped weights into the wrapped module for their length
        (``torch.func.functional_call``), held by every call through this wrapper that runs the
        module's own forward: two threads' calls otherwise read, and put back, each other's dropped
        weights (a Parameter left replaced by a masked tensor for good). None is needed where the
        module is a torch RNN without hooks: its weights are then given to torch's op, never set."""
        if swap_free or torch.compiler.is_compiling():  # a traced call puts nothing in place
            return contextlib.nullcontext()
        with _LOCKS_LOCK:
            lock = _LOCKS.get(self)
            if lock is None:
                lock = _LOCKS[self] = threading.RLock()
        return lock

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and self.p > 0):
            return self._forward_dropped({}, {}, args, kwargs)
        weights = {name: self._weight(name) for name in self.weights}
        return self._forward_dropped(weights, self._sample_masks(weights, None), args, kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Keys of the bare module (an nn.LSTM checkpoint) are read as ``module.<key>``.
        own = prefix + "module."
        for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(own)]:
            state_dict[own + key[len(prefix) :]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        s = f"weights={list(self.weights)}, p={self.p}"
        if self.variational:
            s += ", variational=True"
        return s


_LOCKS: weakref.WeakKeyDictionary[WeightDrop, Any] = weakref.WeakKeyDictionary()  # an RLock each
_LOCKS_LOCK = threading.Lock()  # (kept apart from the module: a lock cannot be copied or pickled)


def _after_fork_in_child() -> None:
    """A forked child's own locks: one held by a parent's thread at the fork stays held in the child
    for good (the thread that would release it is not there)."""
    global _LOCKS_LOCK
    _LOCKS.clear()
    _LOCKS_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _dropping_wrapper(module: nn.Module, name: str) -> str | None:
    """The path of a WeightDrop inside (or equal to) ``module`` that already drops the
    parameter ``name``, else None. ``""`` is ``module`` itself."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        wrapper = module.get_submodule(".".join(parts[:i]))
        if (
            isinstance(wrapper, WeightDrop)
            and parts[i] == "module"
            and ".".join(parts[i + 1 :]) in wrapper.weights
        ):
            return ".".join(parts[:i])
    return None


def _call_with_weights(module: nn.Module, weights: Mapping[str, Tensor], args: tuple, kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` with ``weights`` in place of the parameters of those names."""
    if not weights:
        return module(*args, **kwargs)
    # A dropped weight can never live in cuDNN's flat weight buffer, so cuDNN copies it
    # at every call by design; its warning asks for flatten_parameters(), which cannot help.
    with quiet_weight_compaction(next(iter(weights.values())).device):
        return functional_call(module, weights, args, kwargs)


# rnndrop.compile_model lets dynamo trace nn.LSTM and its subclasses (allow_rnn), and Inductor
# fails on torch's fused RNN ops on the CPU: a wrapped torch RNN runs eagerly, as without the switch.
_TORCH_RNN_UNTRACED = ("torch's own nn.LSTM / nn.GRU / nn.RNN inside WeightDrop runs eagerly: "
                       "Inductor cannot compile torch's fused RNN op")
eager_under_compile(_call_with_weights, _TORCH_RNN_UNTRACED)
