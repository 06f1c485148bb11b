"""A model under ``torch.compile`` with rnndrop's layers traced into its graphs.

Dynamo leaves every ``nn.LSTM`` / ``nn.GRU`` (rnndrop's layers are such subclasses) out of its
graphs unless ``torch._dynamo.config.allow_rnn`` is set. :func:`compile_model` sets it only while
the compiled model compiles and runs, and picks ``mode="reduce-overhead"`` (the whole step replayed
from CUDA graphs) on CUDA::

    model = rnndrop.compile_model(model)        # instead of torch.compile(model)
    loss = criterion(model(x), y)               # each call one step

What is traced and what still runs eagerly: docs/ecosystem.md, "torch.compile".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rnndrop.kernels import auto_loop_kernel_on

__all__ = ["CompiledModel", "compile_model"]


class CompiledModel(nn.Module):
    """``module`` under ``torch.compile`` (``mode``; ``"auto"``: ``"reduce-overhead"`` on CUDA,
    torch's default elsewhere), with ``torch._dynamo.config.allow_rnn`` on while it compiles and
    runs. Its ``state_dict`` is the module's under ``module.``; save ``module``'s own.

    With CUDA graphs each call is a new step (``torch.compiler.cudagraph_mark_step_begin``): the
    outputs of a call may be overwritten by the next one, so clone what a loop carries over (a
    recurrent state to the next batch, as truncated BPTT does).
    """

    def __init__(self, module: nn.Module, *, mode: str | None = "auto", **compile_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self.module = module
        # kernel="auto"'s choice (with the Triton kernel's first-use check) made now, not while tracing
        for device, dtype in {(p.device, p.dtype) for p in module.parameters()}:
            auto_loop_kernel_on(device, dtype)
        if mode == "auto":
            on_cuda = any(p.is_cuda for p in module.parameters())
            mode = "reduce-overhead" if on_cuda else None
        self.cuda_graphs = mode in ("reduce-overhead", "max-autotune")
        # not a submodule: the compiled wrapper holds the same parameters under other names
        self.__dict__["_compiled"] = torch.compile(module, mode=mode, **compile_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(allow_rnn=True):
            return self._compiled(*args, **kwargs)


def compile_model(module: nn.Module, *, mode: str | None = "auto", **compile_kwargs: Any) -> CompiledModel:
    """``module`` under ``torch.compile`` with rnndrop's layers traced: a :class:`CompiledModel`
    (``compile_kwargs`` go to ``torch.compile``)."""
    return CompiledModel(module, mode=mode, **compile_kwargs)
