"""Learning curves and learned alphas of a job's runs as PNGs (matplotlib, optional: imported where used)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rnndrop.lm.atomic import atomic_write
from rnndrop.lm.run.noise_trace import noise_series
from rnndrop.lm.run.tables import format_dropout

__all__ = ["alpha_figure", "learning_curve_figure", "plot_alphas", "plot_learning_curves"]

log = logging.getLogger(__name__)


def _config_text(cfg: Mapping[str, Any]) -> str:
    cell = str(cfg.get("cell", "lstm")).upper()
    model = (f"{cfg.get('num_layers', '?')}×{cfg.get('hidden_size', '?')} {cell}, "
             f"emb {cfg.get('embedding_size', '?')}")
    train = (f"{cfg.get('optimizer', 'sgd')} lr {cfg.get('lr', '?'):g}, batch {cfg.get('batch_size', '?')}, "
             f"bptt {cfg.get('bptt', '?')}") if isinstance(cfg.get("lr"), (int, float)) else ""
    return f"config {cfg.get('name', '?')}: {model}" + (f"\n{train}" if train else "")


def _shared_config(results: Sequence[Mapping[str, Any]]) -> bool:
    return len({_config_text(r.get("config", {})) for r in results}) <= 1


def _plot_title(results: Sequence[Mapping[str, Any]]) -> str:
    """The corpus, and the config when every run has the same one (else each legend entry names its own)."""
    first = results[0]
    source = Path(str(first.get("corpus", {}).get("source", ""))).name
    what = first.get("dataset") or "corpus"
    if source:
        what += f" ({source})"
    if not _shared_config(results):
        return f"{what}, configs in the legend"
    return f"{what}, {_config_text(first.get('config', {}))}"


def learning_curve_figure(results: Sequence[Mapping[str, Any]]):
    """A matplotlib figure of train (dashed, ×) and validation (solid, ●) perplexity per
    epoch of every run, the best epoch circled, the test perplexity in the legend, titled
    with the corpus and the config (when the runs' configs differ, each legend entry names its
    own; matplotlib required). The log axis is labelled at round values inside the data's
    range, so 150 can be told from 185."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator

    fig, ax = plt.subplots(figsize=(7, 4.8))
    shared_config = _shared_config(results)
    for i, r in enumerate(results):
        color = f"C{i % 10}"
        epochs = [e["epoch"] for e in r["epochs"]]
        valid = [e["valid_ppl"] for e in r["epochs"]]
        ax.plot(epochs, valid, color=color, marker="o", markersize=4, label=_legend_label(r, shared_config))
        ax.plot(epochs, [e["train_ppl"] for e in r["epochs"]], color=color, marker="x",
                markersize=4, linestyle="--")
        if r.get("best_epoch") in epochs:
            best = epochs.index(r["best_epoch"])
            ax.plot([epochs[best]], [valid[best]], color=color, marker="o", markersize=11,
                    fillstyle="none", markeredgewidth=1.5)
    ax.set_xlabel("epoch")
    last = max((e["epoch"] for r in results for e in r["epochs"]), default=1)
    ax.set_xlim(0.5, last + 0.5)  # a range of at least one epoch, so every tick is an epoch
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylabel("perplexity (solid ●: valid, dashed ×: train; ○ best epoch)")
    ax.set_yscale("log")
    values = [e[k] for r in results for e in r["epochs"] for k in ("valid_ppl", "train_ppl")]
    finite = [v for v in values if isinstance(v, (int, float)) and 0 < v < float("inf")]
    if finite:
        ticks = [t for t in MaxNLocator(nbins=8).tick_values(min(finite), max(finite)) if t > 0]
        ax.set_yticks(ticks)
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_title(_plot_title(results), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _legend_label(result: Mapping[str, Any], shared_config: bool = True) -> str:
    label = f"{result['regime']} ({format_dropout(result['dropout'])}, seed {result['seed']})"
    if not shared_config:
        label = _config_text(result.get("config", {})).replace("\n", " · ") + "\n" + label
    if isinstance(result.get("test_ppl"), (int, float)):
        label += f": test {result['test_ppl']:.1f}"
    return label


def plot_learning_curves(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """:func:`learning_curve_figure` as a PNG at ``path`` (written atomically); every epoch
    is a marker, so a one-epoch run shows too.

    Returns the path, or None when matplotlib is not installed or there is nothing to plot.
    """
    return _save_png(learning_curve_figure, results, path) if results else None


def alpha_figure(results: Sequence[Mapping[str, Any]]):
    """A matplotlib figure of the mean learned ``alpha`` of every site per epoch (log axis;
    one colour per site, one line style per run), with ``p = alpha / (1 + alpha)``, the
    Bernoulli dropout of the same variance, on the right axis."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.8))
    styles = ("-", "--", ":", "-.")
    for i, r in enumerate(results):
        for j, (site, points) in enumerate(sorted(noise_series(r["epochs"]).items())):
            ax.plot([e for e, _ in points], [a for _, a in points], color=f"C{j % 10}",
                    linestyle=styles[i % len(styles)], marker="o", markersize=3,
                    label=f"{site} (seed {r['seed']})" if len(results) > 1 else site)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean alpha of the site (noise variance)")
    right = ax.secondary_yaxis("right", functions=(lambda a: a / (1 + a), lambda p: p / (1 - p).clip(1e-9)))
    right.set_ylabel("p of the same variance")
    ax.set_title(_plot_title(results) + f"\nregime {results[0]['regime']}: learned alpha per site",
                 fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return fig


def plot_alphas(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """:func:`alpha_figure` as a PNG at ``path`` (written atomically); None when no run
    learned its noise or matplotlib is not installed."""
    if not any(noise_series(r["epochs"]) for r in results):
        return None
    return _save_png(alpha_figure, results, path)


def _save_png(figure: Any, results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot at %s (pip install 'rnndrop[bench]')", path)
        return None
    fig = figure(results)
    path = Path(path)
    try:
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path
