"""Modules that sample noise.

:class:`Stochastic` marks the modules that draw noise in training mode, for Monte-Carlo
prediction. They refuse ``torch.jit.script`` with a reason instead of a parser error: TorchScript
(deprecated in current torch) cannot express what these modules do (masks drawn per call and
passed around as dataclasses, loop kernels that are autograd Functions, keyword-only arguments);
``torch.compile`` runs them (:mod:`rnndrop.compiling`).
``torch.jit.script`` calls ``__prepare_scriptable__`` on a module and each of its submodules
first; :func:`refuse_torchscript` answers there with a one-line :class:`TypeError` that names the
module and the ways that work; :func:`refuse_jit_trace` does the same for ``torch.jit.trace`` of a
call that runs a loop kernel. A module whose noise a batch shares says whether it can draw it per
sequence instead, which :func:`noise_per_sequence` asks of it for a block (Monte-Carlo samples
stacked into one batch).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

import torch

from rnndrop.validation import check_instance


def refuse_torchscript(module: object) -> NoReturn:
    """``__prepare_scriptable__`` of rnndrop's modules: ``torch.jit.script(module)`` (or of a model
    holding it) raises a one-line TypeError. A class takes it as an attribute,
    ``__prepare_scriptable__ = refuse_torchscript``, rather than from a base class, so that it
    adds nothing to the class's MRO."""
    raise TypeError(
        f"{type(module).__name__} cannot be compiled by torch.jit.script (TorchScript cannot express "
        "its per-call masks and loop kernels); use torch.compile, which runs it, or the module as it is"
    )


def refuse_jit_trace(module: object, kernel: str) -> None:
    """Raise a one-line TypeError where ``torch.jit.trace`` records ``module``'s call of a loop
    kernel (``kernel``): its autograd Functions and oneDNN operators stop TorchScript's tracer with
    an internal assertion; the fused op (eval mode with ``kernel="auto"``) traces."""
    if torch.jit.is_tracing():
        raise TypeError(
            f"{type(module).__name__} cannot be traced by torch.jit.trace where it runs a loop kernel "
            f"({kernel!r}: a recurrent mask in training mode, or a kernel named in eval mode): trace it "
            "in eval mode with kernel='auto', or use torch.compile or torch.export, which run it"
        )


class Stochastic:
    """Mixin for modules that draw noise in training mode (dropout masks, Gaussian noise).

    :func:`rnndrop.mc.mc_dropout` switches exactly these modules (and ``nn.Dropout``
    and its siblings) to training mode. A subclass overrides :meth:`is_stochastic`
    to say whether it would draw any noise at all with its present settings.
    ``torch.jit.script`` refuses these modules with a reason (:func:`refuse_torchscript`).
    """

    __prepare_scriptable__ = refuse_torchscript

    def is_stochastic(self) -> bool:
        """True when a forward call in training mode draws noise."""
        return True

    def shares_noise_across_batch(self) -> bool:
        """True when one draw serves every sequence of a batch (a weight mask, a mask
        with scope ``"batch"``): copies of an input in one batch then see the same
        noise, so Monte-Carlo samples must come from separate calls, unless the module
        :meth:`switches_to_noise_per_sequence`."""
        return False

    def switches_to_noise_per_sequence(self) -> bool:
        """True when the module, whose noise is shared by the batch, draws the same noise
        for each sequence of its own instead inside :func:`noise_per_sequence` (masks of
        ``mask_scope="batch"``, word masks of ``scope="batch"``: a mask, not a weight); it reads
        :attr:`_noise_per_sequence` when it draws."""
        return False

    #: Set by :func:`noise_per_sequence` on the modules that switch, for the block.
    _noise_per_sequence: bool = False

    def _scope_to_draw(self, scope: str) -> str:
        """The scope a draw of masks of ``scope`` takes now: ``"sequence"`` for ``"batch"`` inside
        :func:`noise_per_sequence`, else ``scope``."""
        return "sequence" if scope == "batch" and self._noise_per_sequence else scope


_switches: dict[tuple[int, str], list] = {}  # (model, switch) -> [blocks inside, restore]
_switches_lock = threading.RLock()  # (re-entrant: a switch runs the model's train() / eval())


def _after_fork_in_child() -> None:
    """A forked child's own lock and no blocks inside (their threads stayed in the parent)."""
    global _switches_lock
    _switches.clear()
    _switches_lock = threading.RLock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def shared_switch(
    model: torch.nn.Module, name: str, switch: Callable[[], Callable[[], None]]
) -> Iterator[None]:
    """A block under which ``model`` is switched (``switch()`` sets it and returns what puts it
    back), for every thread in it at once: the first block to enter switches, the last to leave
    puts back. Each block saving and restoring for itself, two threads' blocks that overlapped left
    the model as the first one found it switched (a model stuck in training mode after two
    concurrent Monte-Carlo predictions)."""
    key = (id(model), name)
    with _switches_lock:
        entry = _switches.get(key)
        if entry is None:
            entry = _switches[key] = [0, switch()]
        entry[0] += 1
    try:
        yield
    finally:
        with _switches_lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _switches[key]
                entry[1]()


@contextlib.contextmanager
def noise_per_sequence(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """In the block, the modules of ``model`` (itself included) that
    :meth:`~Stochastic.switches_to_noise_per_sequence` draw their noise for each sequence of a batch
    on its own rather than once for the batch; after it, as they did before.

    Sequences are computed independently, so each sequence's output has the same distribution
    either way; only sequences of one call stop sharing a draw. Monte-Carlo prediction
    (:mod:`rnndrop.mc`) uses it to stack copies of a batch into one call, each copy an independent
    sample. The switch is an attribute of each module, as its training mode is: replicas of
    ``nn.DataParallel`` (which run in threads of their own) and torch.compile (which guards on it)
    see it.

    Yields:
        ``model``.
    """
    check_instance("model", model, torch.nn.Module, "an nn.Module")
    def switch() -> Callable[[], None]:
        switching = [m for m in model.modules()
                     if isinstance(m, Stochastic) and m.switches_to_noise_per_sequence()]
        before = [m.__dict__.get("_noise_per_sequence") for m in switching]
        for m in switching:
            m._noise_per_sequence = True

        def restore() -> None:
            for m, value in zip(switching, before):
                if value is None:
                    del m._noise_per_sequence  # back to the class's False
                else:
                    m._noise_per_sequence = value

        return restore

    with shared_switch(model, "noise_per_sequence", switch):
        yield model
