"""NT-ASGD: SGD that switches to weight averaging when validation stops improving.

AWD-LSTM (Merity, Keskar & Socher 2017, section 3) trains with plain SGD at a constant rate
and, once the validation loss has not improved for ``n`` checks (the *non-monotone*
trigger below), keeps the running average of the weights after every step (averaged SGD,
Polyak & Juditsky 1992) and evaluates and saves the averaged weights from then on.

This module does not hold an optimizer: the steps stay the ones of your ``torch.optim.SGD``
and the average is a :class:`torch.optim.swa_utils.AveragedModel`: the mean of the weights
after every step since the switch. That is the average ``torch.optim.ASGD(t0=0, lambd=0)``
keeps, which AWD-LSTM used (ASGD's starts one step later: its ``mu`` is 1 for two steps),
but in a model of its own that can be evaluated and saved without swapping weights in and
out of the trained model, as AWD-LSTM's code does with ASGD's ``ax``.

- :class:`NonMonotoneTrigger`: ``trigger(loss)`` is True when ``loss`` is worse than the
  best loss of all but the last ``n`` checks (and more than ``n`` checks came before);
  the loss is then added to the history. AWD-LSTM: ``len(history) > n and
  loss > min(history[:-n])``, ``n = 5``.
- :class:`NTAveraging`: the trigger and the average of one model. Call :meth:`update`
  after every optimizer step, :meth:`validation` after every validation pass of
  :attr:`~NTAveraging.evaluation_model`; once averaging, the same trigger on the averaged
  model's validation loss says when further training no longer helps
  (:attr:`~NTAveraging.should_stop`). :meth:`restart` is AWD-LSTM's fine-tuning stage:
  averaging starts over (from the first step) at the weights you give it, usually the
  best averaged ones.

Example::

    averaging = NTAveraging(model, nonmono=5)
    for epoch in range(epochs):
        train_one_epoch(model, optimizer, after_step=averaging.update)
        loss = evaluate(averaging.evaluation_model)            # the averaged weights once on
        if loss < best:
            best = loss
            torch.save(averaging.evaluation_model.state_dict(), "best.pt")
        averaging.validation(loss)
        if averaging.should_stop:
            break
    averaging.restart(torch.load("best.pt"))                    # fine-tuning
    ...the same loop again...

Checkpoint :meth:`NTAveraging.state_dict` with the model and the optimizer to resume bit
for bit, before and after the switch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_swa_avg_fn, get_swa_multi_avg_fn

from rnndrop.recurrent import compact_weights
from rnndrop.validation import check_instance, check_positive_int

__all__ = ["NTAveraging", "NonMonotoneTrigger"]


def _check_loss(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"loss must be a number or a one-element tensor, got shape {list(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"loss must be a number (not NaN), got {value!r}")
    return float(value)


class NonMonotoneTrigger:
    """Fires when a validation loss is worse than the best of all but the last ``n``.

    ``trigger(loss)`` returns ``len(history) > n and loss > min(history[:-n])`` and then
    appends ``loss`` to ``history``: a run that has not beaten a loss of more than ``n``
    checks ago has stopped improving, however it moved in between (non-monotone: the last
    ``n`` losses may go up and down).

    Any monotone transform of the loss (perplexity, NLL) fires at the same check.
    """

    def __init__(self, n: int = 5) -> None:
        self.n = check_positive_int("n", n)
        self.history: list[float] = []

    def __call__(self, loss: float) -> bool:
        loss = _check_loss(loss)
        fired = len(self.history) > self.n and loss > min(self.history[: -self.n])
        self.history.append(loss)
        return fired

    def reset(self) -> None:
        """Forget every loss seen (a new phase starts)."""
        self.history = []

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("n") != self.n:
            raise ValueError(f"the state was saved by a NonMonotoneTrigger with n = {state.get('n')!r}, "
                             f"this one has n = {self.n}")
        self.history = [_check_loss(v) for v in state["history"]]

    def __repr__(self) -> str:
        return f"NonMonotoneTrigger(n={self.n}, checks={len(self.history)})"


#: ``averaged += (current - averaged) / (n + 1)``: over lists of weights (``update(averaged, current,
#: n)``, a foreach lerp) and for one weight (``average(averaged, current, n)``), as torch's SWA does.
_SWA_UPDATE = get_swa_multi_avg_fn()
_SWA_AVERAGE = get_swa_avg_fn()


class NTAveraging:
    """The averaging half of NT-ASGD for ``model``, switched on by a :class:`NonMonotoneTrigger`.

    Args:
        model: the trained module (not a DistributedDataParallel wrapper: pass its
            ``.module``; every rank then keeps the same average).
        nonmono: ``n`` of the trigger (AWD-LSTM: 5).
        start: average from the first step instead of waiting for the trigger.

    Attributes:
        active: whether the weights are being averaged.
        averaged: the :class:`~torch.optim.swa_utils.AveragedModel` once active, else None.
        trigger: the :class:`NonMonotoneTrigger`; before the switch it watches the trained
            model's validation loss, after it the averaged model's.
        should_stop: averaging is on and the averaged model's validation loss has fired the
            trigger: it no longer improves (AWD-LSTM's fine-tuning stops there).
        switches: how many times averaging started (the trigger, or :meth:`restart`).
    """

    def __init__(self, model: nn.Module, nonmono: int = 5, *, start: bool = False) -> None:
        check_instance("model", model, nn.Module, "an nn.Module")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise TypeError("model must be the module itself, not its DistributedDataParallel wrapper "
                            "(pass ddp.module)")
        self.model = model
        self.trigger = NonMonotoneTrigger(check_positive_int("nonmono", nonmono))
        self.averaged: AveragedModel | None = None
        self.should_stop = False
        self.switches = 0
        self._steps = 0  # the weights averaged so far (the count AveragedModel keeps as a tensor)
        if start:
            self._start()

    @property
    def active(self) -> bool:
        return self.averaged is not None

    @property
    def evaluation_model(self) -> nn.Module:
        """What to validate, test and save: the averaged weights (a module of the model's class,
        ``averaged.module``) once averaging is on, else the model itself. The average is handed
        out in the modes its model has now (``model.eval()`` then ``evaluation_model`` validates
        without dropout, as it would before the switch)."""
        if self.averaged is None:
            return self.model
        for mine, averaged in zip(self.model.modules(), self.averaged.module.modules()):
            averaged.training = mine.training
        return self.averaged.module

    def update(self) -> None:
        """Add the model's current weights to the average (call after every optimizer step),
        and give it the model's current buffers; nothing before the switch.

        ``AveragedModel.update_parameters``'s arithmetic (a copy first, then ``+= (x - avg) /
        (n + 1)``: one foreach lerp on CUDA, weight by weight elsewhere), with the count ``n``
        kept on the host: torch's method reads its count tensor (on the GPU, a wait for the GPU
        at every step)."""
        if self.averaged is None:
            return
        averaged = [p.detach() for p in self.averaged.parameters()]
        current = [p.detach() for p in self.model.parameters()]
        if self._steps == 0:
            for mine, theirs in zip(averaged, current, strict=True):
                mine.copy_(theirs)
        elif averaged[0].device.type == "cuda":  # one foreach lerp, as torch does there
            _SWA_UPDATE(averaged, current, self._steps)
        else:  # weight by weight, as torch does elsewhere
            for mine, theirs in zip(averaged, current, strict=True):
                mine.copy_(_SWA_AVERAGE(mine, theirs, self._steps))
        self._steps += 1
        self.averaged.n_averaged.fill_(self._steps)  # AveragedModel's own count, for its state dict
        # Buffers (BatchNorm's running statistics) are the model's latest, not an average: the
        # copy was made with use_buffers=False, whose buffers torch leaves as they were copied.
        for mine, theirs in zip(self.averaged.module.buffers(), self.model.buffers(), strict=True):
            mine.copy_(theirs)

    def validation(self, loss: float) -> bool:
        """Feed the validation loss of :attr:`evaluation_model` after a pass; returns True when
        this check switched averaging on (it then starts with the next :meth:`update`). Once
        averaging, a firing trigger sets :attr:`should_stop`."""
        fired = self.trigger(loss)
        if self.averaged is None:
            if fired:
                self._start()
                return True
            return False
        self.should_stop = self.should_stop or fired
        return False

    def restart(self, state_dict: Mapping[str, Any] | None = None) -> None:
        """Fine-tuning: load ``state_dict`` into the model (usually the best averaged weights;
        None keeps its weights), then average anew from the next step, the trigger's history
        and :attr:`should_stop` cleared. Build the optimizer again too if it keeps state."""
        if state_dict is not None:
            self.model.load_state_dict(state_dict)
        self._start()

    def _start(self) -> None:
        # A copy of the model whose weights are replaced by the first update (n_averaged 0).
        self.averaged = self._averaged_copy()
        self._steps = 0
        self.trigger.reset()
        self.should_stop = False
        self.switches += 1

    def _averaged_copy(self) -> AveragedModel:
        averaged = AveragedModel(self.model, use_buffers=False)
        for p in averaged.parameters():
            p.grad = None  # deepcopy copied the model's gradients; the average never needs them
        compact_weights(averaged)  # the copy's recurrent weights in one buffer again (cuDNN)
        return averaged

    def state_dict(self) -> dict[str, Any]:
        """Everything to resume: the trigger, the flags and the averaged weights (tensors and
        plain data only, loadable with ``torch.load(weights_only=True)``)."""
        return {
            "trigger": self.trigger.state_dict(), "should_stop": self.should_stop, "switches": self.switches,
            "averaged": None if self.averaged is None else self.averaged.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the model's own weights are restored by its own
        ``load_state_dict``)."""
        keys = {"trigger", "should_stop", "switches", "averaged"}
        unknown, missing = sorted(set(state) - keys), sorted(keys - set(state))
        if unknown or missing:
            raise ValueError(f"not an NTAveraging state: {'unknown' if unknown else 'missing'} keys "
                             f"{unknown or missing}")
        # Everything is read before anything is set: a state that fails to load leaves this one as it was.
        trigger = NonMonotoneTrigger(self.trigger.n)
        trigger.load_state_dict(state["trigger"])
        averaged = None
        if state["averaged"] is not None:
            averaged = self._averaged_copy()
            averaged.load_state_dict(state["averaged"])
        should_stop, switches = bool(state["should_stop"]), int(state["switches"])
        self.trigger.history, self.averaged = trigger.history, averaged
        self.should_stop, self.switches = should_stop, switches
        if averaged is not None:
            self._steps = int(averaged.n_averaged)

    def __repr__(self) -> str:
        n = None if self.averaged is None else int(self.averaged.n_averaged)
        return (f"NTAveraging(nonmono={self.trigger.n}, active={self.active}, steps_averaged={n}, "
                f"should_stop={self.should_stop})")
