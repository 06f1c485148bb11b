"""Forecast yearly sunspot numbers with a VariationalLSTM and Monte-Carlo dropout.

Data: the yearly sunspot numbers 1700-2008 that ship with statsmodels
(``statsmodels.api.datasets.sunspots``). The model reads the last ``--window`` years
(square-root transformed and standardised) and predicts the next one. It is trained
on 1700-1928; 1929-1958 is held out to estimate the observation noise; 1959-2008 is
the test period.

Two kinds of prediction, both plotted into ``--out/mc_forecast.png``:

1. One step ahead over the test period with :func:`rnndrop.mc.mc_predict`: the MC
   mean and two bands, the model's own (epistemic) spread ``±2 std`` and the total
   predictive spread ``±2 sqrt(std² + noise²)``, the noise variance estimated on the
   held-out years (Gal & Ghahramani's ``tau⁻¹`` term).
2. A free-running forecast of ``--horizon`` years from 1979: every MC sample is one
   network (its own masks from ``sample_masks``, kept for the whole trajectory) that
   feeds its own predictions back, with observation noise added at each step.

Run::

    pip install -e ".[examples]"
    python examples/mc_forecast.py --out /tmp/mc_forecast

About a minute on one CPU core.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from rnndrop import VariationalLSTM
from rnndrop.atomic import unwritable
from rnndrop.mc import mc_predict

TRAIN_END, VALID_END = 1928, 1958  # last year of each split


class Forecaster(nn.Module):
    """``[B, W, 1]`` windows -> next value ``[B, 1]`` (batch-first)."""

    def __init__(self, hidden: int, p: float, p_hidden: float) -> None:
        super().__init__()
        self.lstm = VariationalLSTM(
            1, hidden, batch_first=True, dropout_input=0.0, dropout_hidden=p_hidden,
            dropout_output=p,
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, windows: torch.Tensor, state=None, masks=None):
        out, state = self.lstm(windows, state, masks=masks)
        return self.head(out[:, -1]), state


def windows_of(series: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All windows ``[N, window, 1]`` of ``series`` ``[L]`` and the values that follow ``[N, 1]``."""
    x = series.unfold(0, window, 1)[:-1].unsqueeze(-1)
    return x, series[window:].unsqueeze(-1)


def fail(message: str) -> None:
    """One line on stderr and exit status 2 (a usage problem)."""
    sys.stderr.write(f"error: {message}\n")
    raise SystemExit(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("mc_forecast_out"))
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--p", type=float, default=0.2, help="dropout on the LSTM output")
    parser.add_argument("--p-hidden", type=float, default=0.2, help="dropout on h_{t-1}")
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--horizon", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="a model this small runs best on one")
    args = parser.parse_args()
    for name in ("window", "hidden", "epochs", "samples", "horizon", "threads"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be a positive integer, got {getattr(args, name)}")
    for name in ("p", "p_hidden"):
        if not 0 <= getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be a probability in [0, 1), got {getattr(args, name)}")
    if why := unwritable(args.out, folder=True):
        fail(f"--out {str(args.out)!r}: {why}")
    try:  # the example's extras, imported only to run it (--help works without them)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        import statsmodels.api as sm
    except ImportError as e:
        sys.stderr.write(f"error: this example needs {e.name}: pip install -e \".[examples]\"\n")
        raise SystemExit(2) from None
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    data = sm.datasets.sunspots.load_pandas().data
    years = data["YEAR"].to_numpy().astype(int)
    raw = torch.tensor(data["SUNACTIVITY"].to_numpy(), dtype=torch.float32)
    root = raw.sqrt()  # stabilises the variance of counts
    n_train = int((years <= TRAIN_END).sum())
    if args.window >= n_train:  # no training window would be left
        fail(f"--window must be below the {n_train} years up to {TRAIN_END} it trains on, got {args.window}")
    mean, std = root[:n_train].mean(), root[:n_train].std()
    series = (root - mean) / std

    def to_counts(z: torch.Tensor) -> torch.Tensor:
        return (z * std + mean).clamp_min(0).square()

    x, y = windows_of(series, args.window)
    target_years = years[args.window :]
    train = target_years <= TRAIN_END
    valid = (target_years > TRAIN_END) & (target_years <= VALID_END)
    test = target_years > VALID_END

    model = Forecaster(args.hidden, args.p, args.p_hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3, weight_decay=1e-5)
    start = time.perf_counter()
    model.train()
    for epoch in range(args.epochs):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[train])[0], y[train])
        loss.backward()
        optimizer.step()
        if (epoch + 1) % 250 == 0:
            print(f"epoch {epoch + 1}: train mse {loss.item():.4f}", flush=True)
    print(f"trained in {time.perf_counter() - start:.1f} s")

    # Observation noise: the MC mean's squared error on the held-out years.
    torch.manual_seed(args.seed + 1)
    held_out = mc_predict(model, x[valid], args.samples, task="regression")
    noise_var = ((held_out.mean - y[valid]).square().mean() - held_out.std.square().mean()).clamp_min(1e-4)

    model.eval()
    with torch.no_grad():
        deterministic = model(x[test])[0]
    mc = mc_predict(model, x[test], args.samples, task="regression")
    total_std = (mc.std.square() + noise_var).sqrt()

    truth = y[test]
    rmse_det = to_counts(deterministic).sub(to_counts(truth)).square().mean().sqrt()
    rmse_mc = to_counts(mc.mean).sub(to_counts(truth)).square().mean().sqrt()
    inside = ((truth - mc.mean).abs() <= 2 * total_std).float().mean()
    var = total_std.square()
    nll = 0.5 * (math.log(2 * math.pi) + var.log() + (truth - mc.mean).square() / var)
    print(f"test 1959-2008, one step ahead, RMSE in sunspots: deterministic {rmse_det:.1f}, "
          f"MC mean {rmse_mc:.1f}")
    print(f"MC std (standardised sqrt scale): mean {mc.std.mean():.3f}; noise std {noise_var.sqrt():.3f}")
    print(f"±2σ total band covers {100 * inside:.0f}% of test years; Gaussian NLL {nll.mean():.3f}")

    # Free-running forecast: each sample is one network with its own masks for the
    # whole trajectory (masks passed explicitly are used in eval mode too).
    first = int(np.searchsorted(years, 1979))
    horizon = min(args.horizon, len(series) - first)
    S = args.samples
    masks = model.lstm.sample_masks(S)
    history = series[first - args.window : first].view(1, -1, 1).expand(S, -1, 1)
    paths = []
    with torch.no_grad():
        step, state = model(history, masks=masks)
        for _ in range(horizon):
            value = step + noise_var.sqrt() * torch.randn_like(step)
            paths.append(value)
            step, state = model(value.unsqueeze(1), state, masks=masks)
    paths = to_counts(torch.cat(paths, dim=1))  # [S, horizon]
    lo, med, hi = np.percentile(paths.numpy(), [5, 50, 95], axis=0)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8))
    test_years = target_years[test]
    lower = lambda k, s: to_counts(mc.mean - k * s).squeeze(-1)  # noqa: E731
    upper = lambda k, s: to_counts(mc.mean + k * s).squeeze(-1)  # noqa: E731
    top.fill_between(test_years, lower(2, total_std), upper(2, total_std), color="tab:blue", alpha=0.15,
                     label="±2σ predictive (model + noise)")
    top.fill_between(test_years, lower(2, mc.std), upper(2, mc.std), color="tab:blue", alpha=0.35,
                     label="±2σ model (MC dropout)")
    top.plot(years, raw, color="black", lw=1, label="observed")
    top.plot(test_years, to_counts(mc.mean).squeeze(-1), color="tab:blue", lw=2,
             label=f"MC mean ({S} samples)")
    top.plot(test_years, to_counts(deterministic).squeeze(-1), color="tab:orange", lw=1, ls="--",
             label="deterministic (dropout off)")
    top.axvspan(years[0], TRAIN_END + 0.5, color="grey", alpha=0.08)
    top.set_xlim(1900, years[-1] + 1)
    top.set_title("Yearly sunspots, one step ahead on 1959–2008 (trained on 1700–1928)")
    top.set_ylabel("sunspot number")
    top.legend(loc="upper left", fontsize=8)

    future = years[first : first + horizon]
    bottom.fill_between(future, lo, hi, color="tab:green", alpha=0.25, label="5–95% of MC trajectories")
    for path in paths[:5]:
        bottom.plot(future, path, color="tab:green", lw=0.6, alpha=0.7)
    bottom.plot(future, med, color="tab:green", lw=2, label="median trajectory")
    bottom.plot(years[first - 30 : first + horizon], raw[first - 30 : first + horizon], color="black", lw=1,
                label="observed")
    bottom.axvline(years[first] - 0.5, color="grey", ls=":")
    bottom.set_title(f"Free-running forecast from {years[first]}: one dropout network per trajectory")
    bottom.set_xlabel("year")
    bottom.set_ylabel("sunspot number")
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = args.out / "mc_forecast.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
