"""rnndrop under ``torch.compile``: a model compiled with its layers traced.

Dynamo leaves every ``nn.LSTM`` / ``nn.GRU`` (rnndrop's layers are such subclasses) out of its
graphs unless ``torch._dynamo.config.allow_rnn`` is set. :func:`compile_model` sets it only while
the compiled model compiles and runs, and picks ``mode="reduce-overhead"`` (the whole step replayed
from CUDA graphs) on CUDA::

    model = rnndrop.compile_model(model)        # instead of torch.compile(model)
    loss = criterion(model(x), y)               # each call one step

A compile that fails, or a compiled call that fails where the eager call succeeds (an operator
Inductor cannot lower, a CUDA graph that runs out of memory), does not fail the user's step: the call
runs eagerly, one warning names the error, and the model runs eagerly from then on
(:meth:`CompiledModel.run_eagerly`; for an error raised by the backward, which torch compiles at
its first call, a training loop runs the step again with ``compiled.module`` and, where that
succeeds, calls it itself).

What the library's own code needs while torch.compile traces it: :mod:`rnndrop.tracing`. What is
traced and what still runs eagerly: docs/ecosystem.md, "torch.compile".
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from rnndrop.distributed import ensure_noise_per_rank
from rnndrop.recurrent import VariationalRNNStack
from rnndrop.stochastic import Stochastic
from rnndrop.tracing import BEFORE_TRACING, make_eager_calls

__all__ = ["CompiledModel", "compile_model", "is_torch_rnn", "speeds_up_under_compile"]


class CompiledModel(nn.Module):
    """``module`` under ``torch.compile`` (``mode``; ``"auto"``: ``"reduce-overhead"`` on CUDA,
    torch's default elsewhere), with ``torch._dynamo.config.allow_rnn`` on while it compiles and
    runs. Its ``state_dict`` is the module's under ``module.``; save ``module``'s own. Other
    attributes are the module's (``compiled.rnn`` is ``module.rnn``), as torch.compile's wrapper
    gives them.

    With CUDA graphs each call is a new step (``torch.compiler.cudagraph_mark_step_begin``): the
    outputs of a call may be overwritten by the next one, so clone what a loop carries over (a
    recurrent state to the next batch, as truncated BPTT does).

    With ``fallback`` (the default) a compiled call that raises where the same call eagerly does not
    returns the eager call's result, and the model runs eagerly from then on (:meth:`run_eagerly`,
    one warning); where the eager call raises too, its error is raised (a mistake of the caller's,
    not the compiler's) and the model stays compiled. A graph break under ``fullgraph=True`` is
    raised as asked. ``failure``: None while calls run compiled, else the one-line summary of the
    error that ended it.
    """

    def __init__(self, module: nn.Module, *, mode: str | None = "auto", fallback: bool = True,
                 **compile_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(fallback, bool):
            raise TypeError(f"fallback must be a bool, got {type(fallback).__name__}")
        self.module = module
        self.fallback = fallback
        self.failure: str | None = None
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

    @property
    def compiled(self) -> bool:
        """Whether calls run compiled (False once :meth:`run_eagerly` was called)."""
        return "_compiled" in self.__dict__

    def run_eagerly(self, error: BaseException) -> None:
        """Run ``module`` eagerly from now on, with one warning that names ``error`` (what failed
        compiled). The compiled graphs are released: torch.compile's caches are reset
        (``torch._dynamo.reset()``: other compiled functions of the process compile again at their
        next call) and the CUDA graphs' memory given back to the allocator's cache."""
        if not self.compiled:
            return
        del self.__dict__["_compiled"]
        cuda_graphs, self.cuda_graphs = self.cuda_graphs, False
        self.failure = _one_line(error)
        torch._dynamo.reset()
        if cuda_graphs:
            torch.cuda.empty_cache()
        warnings.warn(f"compile_model: the compiled model failed ({self.failure}); it runs eagerly from "
                      "here on (the same computation, without the compiled speed)", RuntimeWarning,
                      stacklevel=3)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ensure_noise_per_rank()  # under DDP: the check cannot run inside the graph
        if not self.compiled:
            return self.module(*args, **kwargs)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        # allow_rnn set and put back by hand: this runs at every step of a host-bound loop, where
        # config.patch (a context manager object a call) is the slower way
        config = torch._dynamo.config
        allow_rnn, config.allow_rnn = config.allow_rnn, True
        try:
            return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.Unsupported:
            raise  # a graph break under fullgraph=True, which asked for this error
        except Exception as error:
            if not self.fallback:
                raise
            compiled_error = error.with_traceback(None)  # its frames' tensors released before the eager call
        finally:
            config.allow_rnn = allow_rnn
        result = self.module(*args, **kwargs)  # what raises here is the caller's mistake, not the compiler's
        self.run_eagerly(compiled_error)
        return result


def _one_line(error: BaseException) -> str:
    """``error``'s type and the first line of its message (torch's compile errors run to pages),
    with the backend's own error where dynamo wrapped one (``BackendCompilerFailed``)."""
    inner = getattr(error, "inner_exception", None)
    if isinstance(inner, BaseException):
        return f"{type(error).__name__}, {_one_line(inner)}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def speeds_up_under_compile(module: nn.Module, device: torch.device | str | None = None) -> bool:
    """Whether :func:`compile_model` is measured to make a training step of ``module`` faster on
    ``device`` (default: where its parameters are): a CUDA device, and one of its layers running a
    loop kernel of rnndrop's when it trains (:meth:`~rnndrop.recurrent.VariationalRNNStack.trains_in_loop`).
    That loop is bound by the host's launches, which CUDA graphs take away (docs/gpu.md, fifth
    round: a step 0.39-0.52x cuDNN's against 0.78x eagerly; AWD's tied LM 1.9x the words/s). A
    model whose recurrence runs cuDNN gains nothing there (``nn.LSTM`` compiled 0.92-1.08x eager,
    AWD's WeightDrop LM 0.8x), nor does one on the CPU (the same oneDNN products)."""
    if device is None:
        on_cuda = any(p.is_cuda for p in module.parameters())
    else:
        on_cuda = torch.device(device).type == "cuda"
    loops = (m for m in module.modules() if isinstance(m, VariationalRNNStack) and m.trains_in_loop())
    return on_cuda and any(loops)


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


def compile_model(module: nn.Module, *, mode: str | None = "auto", fallback: bool = True,
                  **compile_kwargs: Any) -> CompiledModel:
    """``module`` under ``torch.compile`` with rnndrop's layers traced: a :class:`CompiledModel`
    (``compile_kwargs`` go to ``torch.compile``; ``fallback``: a failed compile runs eagerly)."""
    return CompiledModel(module, mode=mode, fallback=fallback, **compile_kwargs)
