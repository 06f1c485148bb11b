"""Argument checks shared by every module: one message style for bad input.

Each check returns the value (normalised: ``float``, ``int``, ``bool``) or raises an
error whose message names the argument, says what was expected and shows what came,
in the manner of ``torch.nn.modules.rnn``. Wrong *types* raise ``TypeError``, values
of the right type that are out of range raise ``ValueError``, except the checks of counts and of
numbers in a range (``check_positive_int``, ``check_nonnegative_int``, ``check_positive_float``,
``check_nonnegative_float``, ``check_fraction``), which raise ``ValueError`` for both: the
configuration checks of ``rnndrop.lm`` report a ``ValueError`` as their one-line message.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "check_bool",
    "check_choice",
    "check_finite_float",
    "check_fraction",
    "check_input_features",
    "check_instance",
    "check_nonnegative_float",
    "check_nonnegative_int",
    "check_positive_float",
    "check_positive_int",
    "check_probability",
    "check_tensor_like",
    "check_word_ids",
    "checked_setting",
    "fix_settings",
]


def _is_real(value: Any) -> bool:
    """A real number, not a bool: Python's, or NumPy's scalars (``np.float32(0.5)``, as torch's
    modules take them)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _is_int(value: Any) -> bool:
    """An integer, not a bool: Python's, or NumPy's scalars (``np.int64(4)``; NumPy's bool is
    neither)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def check_probability(name: str, p: Any) -> float:
    """``p`` as a float if it is a dropout probability in [0, 1), else raise."""
    if not _is_real(p):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(p).__name__} {p!r}")
    if not 0.0 <= p < 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be a probability in [0, 1), got {p!r}")
    return float(p)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``, else a ValueError naming them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1 (not a bool), else a ValueError."""
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def check_positive_float(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real number > 0, else a ValueError."""
    if not _is_real(value) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
    return float(value)


def check_nonnegative_int(name: str, value: Any) -> int:
    """``value`` if it is an int >= 0 (not a bool), else a ValueError."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def check_nonnegative_float(name: str, value: Any) -> float:
    """``value`` as a float if it is a finite real number >= 0 (not a bool), else a ValueError."""
    if not _is_real(value) or not 0 <= value < math.inf:  # also rejects NaN
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def check_fraction(name: str, value: Any, meaning: str = "a probability") -> float:
    """``value`` as a float if it is a real number in [0, 1] (not a bool), else a ValueError:
    ``"warmup must be a fraction of training in [0, 1]"`` with ``meaning`` that fraction."""
    if not _is_real(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be {meaning} in [0, 1], got {value!r}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else a TypeError (``'no'`` is not False)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_finite_float(name: str, value: Any, meaning: str = "a float") -> float:
    """``value`` as a float if it is a finite real number, else raise.

    ``meaning`` completes the message: ``"threshold must be a finite float (a log alpha)"``.
    """
    if not _is_real(value):
        raise TypeError(f"{name} must be {meaning}, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number ({meaning}), got {value!r}")
    return float(value)


def check_instance(name: str, value: Any, cls: type, expected: str) -> Any:
    """``value`` if it is an instance of ``cls``, else a TypeError: ``"{name} must be {expected}"``."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    return value


def check_tensor_like(
    name: str,
    tensor: Any,
    shape: Sequence[int] | None,
    like: Tensor,
    like_name: str = "the input",
    shape_note: str = "",
) -> None:
    """Check that ``tensor`` is a Tensor of exactly ``shape`` with ``like``'s dtype and device.

    Args:
        name: the argument as the user wrote it (``"masks.hidden[1]"``, ``"hx[0]"``).
        shape: the exact shape required (no broadcasting), or None to skip the check.
        like: the tensor whose dtype and device ``tensor`` must share.
        like_name: how to call ``like`` in the message.
        shape_note: appended to the shape message, e.g. ``" (scope 'step')"``.
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(tensor).__name__}")
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}{shape_note}, got {list(tensor.shape)}")
    if tensor.dtype != like.dtype:
        raise TypeError(f"{name} must have {like_name}'s dtype {like.dtype}, got {tensor.dtype}")
    if tensor.device != like.device:
        raise ValueError(f"{name} must be on {like_name}'s device {like.device}, got {tensor.device}")


def check_input_features(owner: str, x: Tensor, input_size: int, weight: Tensor) -> None:
    """An input ``x [..., input_size]`` that the weights can take: its last size ``input_size``, its
    dtype and device the weights' (``owner`` names the module in the message)."""
    if x.shape[-1] != input_size:
        raise ValueError(
            f"{owner}: input.size(-1) must be equal to input_size={input_size}, got {x.shape[-1]}"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"{owner}: input dtype {x.dtype} does not match the weights' dtype {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"{owner}: input is on {x.device} but the weights are on {weight.device}")


def check_word_ids(name: str, tokens: Any, num_embeddings: int) -> None:
    """Raise unless ``tokens`` is an int64 / int32 tensor of ids in ``[0, num_embeddings)``
    (a TypeError for the type, a ValueError naming the first id outside the range)."""
    if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.long, torch.int):
        got = tokens.dtype if isinstance(tokens, Tensor) else type(tokens).__name__
        raise TypeError(f"{name} must be an int64 or int32 tensor of word ids, got {got}")
    if tokens.numel() == 0 or torch.compiler.is_compiling():
        # Traced (torch.export, torch.compile): the ids are data, unknown to the trace; indexing
        # the embedding with a bad id still fails at run time.
        return
    low, high = _id_range(tokens)
    if low < 0 or high >= num_embeddings:
        if tokens._base is not None:  # the tensor it views has an id outside; this view may not
            low, high = int(tokens.min()), int(tokens.max())
        if low >= 0 and high < num_embeddings:
            return
        bad = low if low < 0 else high
        raise ValueError(
            f"{name} must be word ids in [0, {num_embeddings}) (the vocabulary size V = {num_embeddings}), "
            f"got id {bad}"
        )


#: The range of ids of recently checked tensors: ``id(tensor) -> (weak reference, version, low, high)``.
_ID_RANGES: dict[int, tuple[weakref.ref, int, int, int]] = {}


def _id_range(tokens: Tensor) -> tuple[int, int]:
    """``(min, max)`` of the ids ``tokens`` can hold: those of the tensor it views (a language
    model's batches are slices of one tensor of the whole corpus), read once per tensor and
    version and then remembered. Reading them waits for the GPU, so a batch of a tensor already
    read costs no synchronisation; an in-place change of the tensor (or of any view of it) bumps
    its version and it is read again. A change torch does not count (through ``.data``, or memory
    shared with numpy) is not seen: a bad id then fails in the embedding's own lookup, with torch's
    message."""
    whole = tokens if tokens._base is None or tokens._base.dtype != tokens.dtype else tokens._base
    if whole.is_inference():  # no version counter to tell a change by
        return int(tokens.min()), int(tokens.max())
    known = _ID_RANGES.get(id(whole))
    if known is not None and known[0]() is whole and known[1] == whole._version:
        return known[2], known[3]
    low, high = int(whole.min()), int(whole.max())
    if len(_ID_RANGES) >= 8:  # (two threads may evict together: neither fails)
        _ID_RANGES.pop(next(iter(_ID_RANGES), None), None)
    _ID_RANGES[id(whole)] = (weakref.ref(whole), whole._version, low, high)
    return low, high


#: Set in an instance's ``__dict__`` by :func:`fix_settings`: its settings made ``fixed`` refuse changes.
SETTINGS_FIXED = "_settings_fixed"


def checked_setting(name: str, check: Callable[[str, Any], Any], *, fixed: str | None = None) -> property:
    """A class attribute ``name`` that passes every value set on it through ``check(name, value)``
    and keeps what that returns: a setting changed after the constructor (a dropout schedule,
    a typo in a script) is checked as the constructor checked it, not met as a wrong answer or a
    bare ``KeyError`` at the next forward pass. Reading it is an attribute lookup.

    With ``fixed`` (why, in a few words) the setting cannot change once the constructor has called
    :func:`fix_settings`: what the constructor built from it (parameters, noise sites) would no
    longer match, and the change would be silently ignored."""
    # Kept twice in the instance's __dict__: under its own name, which nn.RNNBase's extra_repr
    # formats, and under ``stored``, which the property reads (torch 2.11's dynamo reads
    # ``self.__dict__[name]`` as the attribute itself: the property again, without end).
    stored = f"_checked_{name}"

    def get(self: Any) -> Any:
        values = self.__dict__
        if stored in values:
            return values[stored]
        if name in values:  # a module pickled before the setting was checked: its own name alone
            return values[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def set_(self: Any, value: Any) -> None:
        value = check(name, value)
        if fixed is not None and self.__dict__.get(SETTINGS_FIXED) and value != self.__dict__[stored]:
            owner = type(self).__name__
            raise AttributeError(
                f"{owner}.{name} cannot change after construction ({fixed}): it is "
                f"{self.__dict__[stored]!r}, got {value!r}; build a new {owner} with it"
            )
        self.__dict__[name] = self.__dict__[stored] = value

    return property(get, set_, doc=f"``{name}``, checked whenever it is set.")


def fix_settings(module: Any) -> None:
    """Called at the end of a constructor: from now on the module's settings made with ``fixed``
    (:func:`checked_setting`) refuse another value."""
    module.__dict__[SETTINGS_FIXED] = True
