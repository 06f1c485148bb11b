"""rnndrop under ``torch.compile``: what the layers need while it traces, and a model compiled with
its layers traced.

Dynamo leaves every ``nn.LSTM`` / ``nn.GRU`` (rnndrop's layers are such subclasses) out of its
graphs unless ``torch._dynamo.config.allow_rnn`` is set. :func:`compile_model` sets it only while
the compiled model compiles and runs, and picks ``mode="reduce-overhead"`` (the whole step replayed
from CUDA graphs) on CUDA::

    model = rnndrop.compile_model(model)        # instead of torch.compile(model)
    loss = criterion(model(x), y)               # each call one step

The rest serves the library's own code while torch.compile traces it: whether it does
(:func:`tracing_for_compile`), a function whose answer is a constant of the graph
(:func:`constant_for_compile`), caches it traces through (:func:`traced_cache`) and what it runs
eagerly (:func:`run_eagerly`). What is traced and what still runs eagerly: docs/ecosystem.md,
"torch.compile".
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from rnndrop.distributed import ensure_noise_per_rank
from rnndrop.stochastic import Stochastic

__all__ = ["CompiledModel", "compile_model", "constant_for_compile", "eager_under_compile", "exporting",
           "is_torch_rnn", "make_eager_calls", "run_eagerly", "traced_cache", "tracing_for_compile"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

#: Called eagerly with each device and dtype of a model's parameters before :func:`compile_model`
#: traces it: :mod:`rnndrop.kernels` registers ``kernel="auto"``'s choice there, so that the Triton
#: kernel's first-use check runs before tracing, not inside it.
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


class CompiledModel(nn.Module):
    """``module`` under ``torch.compile`` (``mode``; ``"auto"``: ``"reduce-overhead"`` on CUDA,
    torch's default elsewhere), with ``torch._dynamo.config.allow_rnn`` on while it compiles and
    runs. Its ``state_dict`` is the module's under ``module.``; save ``module``'s own. Other
    attributes are the module's (``compiled.rnn`` is ``module.rnn``), as torch.compile's wrapper
    gives them.

    With CUDA graphs each call is a new step (``torch.compiler.cudagraph_mark_step_begin``): the
    outputs of a call may be overwritten by the next one, so clone what a loop carries over (a
    recurrent state to the next batch, as truncated BPTT does).
    """

    def __init__(self, module: nn.Module, *, mode: str | None = "auto", **compile_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self.module = module
        if compile_kwargs.get("backend", "inductor") == "inductor":
            _refuse_torch_rnns_on_the_cpu(module)
        make_eager_calls()
        for device, dtype in {(p.device, p.dtype) for p in module.parameters()}:
            for choose in BEFORE_TRACING:
                choose(device, dtype)
        if mode == "auto":
            on_cuda = any(p.is_cuda for p in module.parameters())
            mode = "reduce-overhead" if on_cuda else None
        self.cuda_graphs = mode in ("reduce-overhead", "max-autotune")
        # not a submodule: the compiled wrapper holds the same parameters under other names
        self.__dict__["_compiled"] = torch.compile(module, mode=mode, **compile_kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ensure_noise_per_rank()  # under DDP: the check cannot run inside the graph
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(allow_rnn=True):
            return self._compiled(*args, **kwargs)


def is_torch_rnn(module: nn.Module) -> bool:
    """Whether ``module`` is torch's own ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` (not one of rnndrop's
    layers, which are subclasses)."""
    return isinstance(module, nn.RNNBase) and not isinstance(module, Stochastic)


def _refuse_torch_rnns_on_the_cpu(model: nn.Module) -> None:
    """A one-line error for a model whose torch RNN on the CPU Inductor would fail on at its first
    call (``mkldnn_rnn_layer``, torch 2.11-2.13), once ``allow_rnn`` lets dynamo trace it; what a
    module that says it runs the torch RNNs it wraps eagerly (``runs_torch_rnns_eagerly``, as
    :class:`~rnndrop.WeightDrop` does) is let through."""
    wrapped = {id(child) for m in model.modules() if getattr(m, "runs_torch_rnns_eagerly", False)
               for child in m.children()}
    for name, sub in model.named_modules():
        if (is_torch_rnn(sub) and id(sub) not in wrapped
                and any(p.device.type == "cpu" for p in sub.parameters())):
            where = f"submodule {name!r}" if name else "the model"
            kind = sub.mode if sub.mode in ("LSTM", "GRU") else "RNN"
            swap = (f"make it rnndrop.Variational{kind}.from_module(...) (no dropout: the same function, "
                    "run eagerly in the graph), or " if kind != "RNN" else "")
            raise ValueError(
                f"compile_model: {where} is torch's nn.{kind} on the CPU, which Inductor cannot compile "
                f"once rnndrop's layers are traced (torch._dynamo.config.allow_rnn); {swap}compile "
                "with torch.compile (rnndrop's layers then run eagerly)"
            )


def compile_model(module: nn.Module, *, mode: str | None = "auto", **compile_kwargs: Any) -> CompiledModel:
    """``module`` under ``torch.compile`` with rnndrop's layers traced: a :class:`CompiledModel`
    (``compile_kwargs`` go to ``torch.compile``)."""
    return CompiledModel(module, mode=mode, **compile_kwargs)
