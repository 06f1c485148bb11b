"""What rnndrop's own code needs while ``torch.compile`` traces it: whether it does
(:func:`tracing_for_compile`, :func:`exporting`), a function whose answer is a constant of the graph
(:func:`constant_for_compile`), caches it traces through (:func:`traced_cache`), what it runs
eagerly and why (:func:`eager_under_compile`, :func:`run_eagerly`), and what runs before a model is
traced (:data:`BEFORE_TRACING`). A model compiled with its layers traced: :mod:`rnndrop.compiling`.
What is traced and what still runs eagerly: docs/ecosystem.md, "torch.compile".
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["BEFORE_TRACING", "constant_for_compile", "eager_under_compile", "exporting", "make_eager_calls",
           "run_eagerly", "traced_cache", "tracing_for_compile"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

#: Called eagerly with each device and dtype of a model's parameters before
#: :func:`rnndrop.compile_model` traces it: :mod:`rnndrop.kernels` registers ``kernel="auto"``'s
#: choice there, so that the Triton kernel's first-use check runs before tracing, not inside it.
BEFORE_TRACING: list[Callable[[torch.device, torch.dtype], object]] = []


def tracing_for_compile() -> bool:
    """Whether torch.compile is tracing this call (and not torch.export, whose programs must run
    without rnndrop's operators: the layers export as before)."""
    return torch.compiler.is_compiling() and not exporting()


def exporting() -> bool:
    """Whether torch.export is tracing this call: ``torch.compiler.is_exporting()``, read from the
    flag torch.export sets, for torch 2.11's dynamo answers the call itself with True under
    torch.compile too (later versions read the flag), which sent every layer there down the
    export path."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else bool(flag)


def traced_cache(maxsize: int | None) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``functools.lru_cache(maxsize)`` for a pure function of hashable arguments that a forward
    pass calls, which torch.compile may trace: while it traces, the function itself runs (what
    dynamo does with a cached function anyway, here without its warning that it does so)."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize)(fn)

        @functools.wraps(fn)
        def call(*args: Any) -> T:
            return fn(*args) if torch.compiler.is_compiling() else cached(*args)

        return call

    return decorate


#: What the layers run eagerly under torch.compile, by the reason dynamo's error names when
#: ``fullgraph=True`` forbids the graph break: ``reason -> (function, its torch.compiler.disable
#: wrapper or None until made)``. Filled by :func:`eager_under_compile` at import.
_EAGER_CALLS: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]] = {}


def eager_under_compile(fn: Callable[..., Any], *reasons: str) -> None:
    """Register ``fn`` as run eagerly under torch.compile (:func:`run_eagerly`) for each of
    ``reasons``: one sentence each, which dynamo prints when ``fullgraph=True`` forbids the break."""
    for reason in reasons:
        _EAGER_CALLS[reason] = (fn, None)
    if "torch._dynamo" in sys.modules:  # torch.compile has run: making the wrappers costs nothing
        make_eager_calls()


def make_eager_calls() -> None:
    """Make every registered function's ``torch.compiler.disable`` wrapper now, outside a trace
    (:class:`CompiledModel` calls this before it compiles). Made inside one, the call that makes it
    would itself be dynamo's graph break, and with ``fullgraph=True`` its error would name
    ``torch.compiler.disable`` instead of the reason."""
    for reason, (fn, made) in _EAGER_CALLS.items():
        if made is None:
            _EAGER_CALLS[reason] = (fn, torch.compiler.disable(fn, reason=_explained(reason)))


def _explained(reason: str) -> str:
    return f"rnndrop: {reason}; compile without fullgraph=True to let it break the graph"


def run_eagerly(reason: str) -> Callable[..., Any]:
    """The function registered for ``reason`` under ``torch.compiler.disable``: the layers call it
    only while torch.compile traces them (``torch.compiler.is_compiling()``), so ``import rnndrop``
    does not import torch._dynamo (seconds). torch.compile then runs the call eagerly, as it runs
    nn.LSTM (a graph break): the loop kernels are autograd Functions over a Python time loop, and
    tracing torch's fused RNN ops fails in Inductor."""
    fn, made = _EAGER_CALLS[reason]
    if made is None:  # not made ahead (torch.compile called directly): made here, while tracing
        made = torch.compiler.disable(fn, reason=_explained(reason))
    return made


def constant_for_compile(fn: F) -> F:
    """Mark ``fn`` (of arguments dynamo holds as constants: devices, dtypes) as one whose answer
    torch.compile calls while it traces and keeps as a constant of the graph. It sets what
    ``torch.compiler.assume_constant_result`` sets (torch/_dynamo/decorators.py) without importing
    torch._dynamo (seconds at ``import rnndrop``); tests/test_traced_layers.py fails (a graph break
    in ``fullgraph=True``) if torch stops reading it."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn
