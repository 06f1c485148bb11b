"""Learning curves of a job's runs as a PNG (matplotlib, optional: imported where used)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rnndrop.lm.atomic import atomic_write
from rnndrop.lm.run.tables import format_dropout

__all__ = ["learning_curve_figure", "plot_learning_curves"]

log = logging.getLogger(__name__)


def _plot_title(results: Sequence[Mapping[str, Any]]) -> str:
    first = results[0]
    cfg = first.get("config", {})
    corpus = first.get("corpus", {})
    source = Path(str(corpus.get("source", ""))).name
    what = first.get("dataset") or "corpus"
    if source:
        what += f" ({source})"
    cell = str(cfg.get("cell", "lstm")).upper()
    model = (f"{cfg.get('num_layers', '?')}×{cfg.get('hidden_size', '?')} {cell}, "
             f"emb {cfg.get('embedding_size', '?')}")
    train = (f"{cfg.get('optimizer', 'sgd')} lr {cfg.get('lr', '?'):g}, batch {cfg.get('batch_size', '?')}, "
             f"bptt {cfg.get('bptt', '?')}") if isinstance(cfg.get("lr"), (int, float)) else ""
    return f"{what}, config {cfg.get('name', '?')}: {model}" + (f"\n{train}" if train else "")


def learning_curve_figure(results: Sequence[Mapping[str, Any]]):
    """A matplotlib figure of train (dashed, ×) and validation (solid, ●) perplexity per
    epoch of every run, titled with the corpus and the config (matplotlib required)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.8))
    for i, r in enumerate(results):
        epochs = [e["epoch"] for e in r["epochs"]]
        label = f"{r['regime']} ({format_dropout(r['dropout'])}, seed {r['seed']})"
        color = f"C{i % 10}"
        ax.plot(epochs, [e["valid_ppl"] for e in r["epochs"]], color=color, marker="o",
                markersize=4, label=label)
        ax.plot(epochs, [e["train_ppl"] for e in r["epochs"]], color=color, marker="x",
                markersize=4, linestyle="--")
    ax.set_xlabel("epoch")
    last = max((e["epoch"] for r in results for e in r["epochs"]), default=1)
    ax.set_xlim(0.5, last + 0.5)  # a range of at least one epoch, so every tick is an epoch
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_ylabel("perplexity (solid ●: valid, dashed ×: train)")
    ax.set_yscale("log")
    ax.set_title(_plot_title(results), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_learning_curves(results: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """:func:`learning_curve_figure` as a PNG at ``path`` (written atomically); every epoch
    is a marker, so a one-epoch run shows too.

    Returns the path, or None when matplotlib is not installed or there is nothing to plot.
    """
    if not results:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no learning curves at %s "
                    "(pip install 'rnndrop[bench]')", path)
        return None
    fig = learning_curve_figure(results)
    path = Path(path)
    try:
        with atomic_write(path) as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path

