"""Kernels that may be missing (the compiled C++ kernel, the Triton kernel): whether one can
run, with one warning per process that says why not and how to get it."""

from __future__ import annotations

import warnings
from collections.abc import Callable

__all__ = ["available_or_warn"]


def available_or_warn(
    load: Callable[[], object], warned: bool, switch: str, how_to_get: str, instead: str
) -> tuple[bool, bool]:
    """``(whether load() succeeds, whether the one warning has now been given)``.

    ``load`` raises RuntimeError when the kernel cannot run; the first such failure (while
    ``warned`` is False) warns: the reason, that ``kernel="auto"`` runs ``instead``, and how
    to get the kernel (``unset <switch>`` when the environment variable ``switch`` turned it off;
    the error's own ``how`` where it has one, e.g. a read-only cache folder).
    """
    try:
        load()
    except RuntimeError as error:
        if not warned:
            how = f"unset {switch}" if switch in str(error) else getattr(error, "how", None) or how_to_get
            warnings.warn(f"rnndrop: {error}; kernel='auto' runs {instead} instead. To get it: {how}.",
                          RuntimeWarning, stacklevel=3)
        return False, True
    return True, warned
