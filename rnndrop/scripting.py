"""TorchScript: rnndrop's modules refuse ``torch.jit.script`` with a reason instead of a parser error.

TorchScript (deprecated in current torch) cannot express what these modules do: masks
drawn per call and passed around as dataclasses, loop kernels that are autograd
Functions, keyword-only arguments. ``torch.jit.script`` calls ``__prepare_scriptable__``
on a module and each of its submodules first; :class:`NotScriptable` answers there with a
one-line :class:`TypeError` that names the module and the ways that work.
"""

from __future__ import annotations

from typing import NoReturn


class NotScriptable:
    """Mixin: ``torch.jit.script(module)`` (or of a model holding it) raises a clear TypeError."""

    def __prepare_scriptable__(self) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} cannot be compiled by torch.jit.script (TorchScript cannot express "
            "its per-call masks and loop kernels); use torch.compile, which runs it, or the module as it is"
        )
