"""rnndrop under ``torch.compile``: a model compiled with its layers traced.

Dynamo leaves every ``nn.LSTM`` / ``nn.GRU`` (rnndrop's layers are such subclasses) out of its
graphs unless ``torch._dynamo.config.allow_rnn`` is set. :func:`compile_model` sets it only while
the compiled model compiles and runs, and picks ``mode="reduce-overhead"`` (the whole step replayed
from CUDA graphs) on CUDA::

    model = rnndrop.compile_model(model)        # instead of torch.compile(model)
    loss = criterion(model(x), y)               # each call one step

What the library's own code needs while torch.compile traces it: :mod:`rnndrop.tracing`. What is
traced and what still runs eagerly: docs/ecosystem.md, "torch.compile".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rnndrop.distributed import ensure_noise_per_rank
from rnndrop.stochastic import Stochastic
from rnndrop.tracing import BEFORE_TRACING, make_eager_calls

__all__ = ["CompiledModel", "compile_model", "is_torch_rnn"]


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
