"""What learned noise looks like after an epoch: the mean ``alpha`` and the KL term of every
site of every module that learns its dropout variance (GaussianLSTM / GaussianGRU), for the
epoch history and the alpha plot."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["learned_noise", "noise_series"]


def learned_noise(model: nn.Module) -> dict[str, dict[str, float]]:
    """``{"alpha": {site: mean alpha}, "kl": {site: KL term}}`` over the modules of ``model``
    that have ``alphas()`` and ``site_kl()``; sites are named ``<module>.<site>`` (e.g.
    ``rnn.hidden_l0``), without the ``log_alpha_`` prefix. Empty for a model without them."""
    alphas: dict[str, float] = {}
    kls: dict[str, float] = {}
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if not (callable(getattr(module, "alphas", None)) and callable(getattr(module, "site_kl", None))):
                continue
            for name, alpha in module.alphas().items():
                alphas[_site(prefix, name)] = float(alpha.float().mean())
            for name, kl in module.site_kl().items():
                kls[_site(prefix, name)] = float(kl)
    return {"alpha": alphas, "kl": kls} if alphas else {}


def _site(prefix: str, name: str) -> str:
    site = name.removeprefix("log_alpha_")
    return f"{prefix}.{site}" if prefix else site


def noise_series(epochs: list[dict[str, Any]], key: str = "alpha") -> dict[str, list[tuple[int, float]]]:
    """Per site, ``(epoch, value)`` of ``key`` (``"alpha"`` or ``"kl"``) over a run's epochs."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in epochs:
        for site, value in record.get("noise", {}).get(key, {}).items():
            series.setdefault(site, []).append((record["epoch"], value))
    return series
