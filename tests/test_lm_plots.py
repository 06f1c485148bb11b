"""What the plots show, read back from the matplotlib figures: an axis fitted to the validation
curves, best epochs that do not cover each other, the line styles in a legend, the learning-rate
drops, one colour per regime, and reliability bins that show how few predictions they hold
(issue 43, "Plots")."""

import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.text import Annotation, Text

from rnndrop.calibration import reliability_from_predictions
from rnndrop.lm.run.report import (
    FEW_PREDICTIONS,
    learning_curve_figure,
    lr_drops,
    regime_colour,
    reliability_axes,
)


def _run(regime, best, stop, drops, best_epoch, dropout=None):
    """A run like the issue's: valid from ~1000 down to ``best`` at ``best_epoch``, then up."""
    epochs, lr = [], 20.0
    for e in range(1, stop + 1):
        lr = lr / 4 if e in drops else lr
        valid = best + (1000 - best) * 0.45 ** (e - 1) + max(0, e - best_epoch) * 1.2
        epochs.append({"epoch": e, "lr": lr, "valid_ppl": valid, "train_ppl": max(84.0, 0.7 * valid - 2 * e)})
    low = min(epochs, key=lambda r: r["valid_ppl"])
    return {"regime": regime, "dropout": dropout if dropout is not None else {"input": 0.5}, "seed": 1,
            "dataset": "ptb", "corpus": {"source": "/data/ptb-sample"},
            "config": {"name": "mini", "num_layers": 2, "hidden_size": 200, "embedding_size": 200},
            "epochs": epochs, "best_epoch": low["epoch"], "best_valid_ppl": low["valid_ppl"],
            "test_ppl": 150.0}


@pytest.fixture
def issue_figure():
    runs = [_run("none", 172.0, 13, [10, 11, 12, 13], 9, dropout={}), _run("naive", 152.7, 20, [14, 18], 20),
            _run("tied", 151.6, 20, [15, 19], 20)]
    fig = learning_curve_figure(runs)
    fig.canvas.draw()
    yield fig, runs
    plt.close(fig)


def _legends(ax):
    found = [a for a in [*ax.artists, ax.get_legend()] if a is not None and hasattr(a, "get_texts")]
    return {legend.get_title().get_text(): [t.get_text() for t in legend.get_texts()] for legend in found}


def test_the_axis_is_fitted_to_the_validation_curves(issue_figure):
    fig, runs = issue_figure
    ax = fig.axes[0]
    low, high = ax.get_ylim()
    assert ax.get_yscale() == "linear"
    bests = [r["best_valid_ppl"] for r in runs]
    assert low < min(bests) and max(bests) < high < 1.5 * max(bests)  # not up to 1000
    # the best values fill a good part of the axis, not its bottom sixth
    assert (max(bests) - low) / (high - low) > 0.2
    ticks = [t for t in ax.get_yticks() if low <= t <= high]
    assert len(ticks) >= 4 and any(t < min(bests) + 10 for t in ticks)  # labelled ticks where the data is
    assert any("cut off" in t.get_text() for t in ax.texts)  # the early epochs above the axis are said


def test_best_epochs_are_starred_apart_with_their_values_written_apart(issue_figure):
    fig, runs = issue_figure
    ax = fig.axes[0]
    stars = [line for line in ax.lines if line.get_marker() == "*"]
    assert len(stars) == 3
    points = [ax.transData.transform((line.get_xdata()[0], line.get_ydata()[0])) for line in stars]
    for a, b in itertools.combinations(points, 2):  # naive and tied: both at epoch 20, 1.1 apart
        assert abs(a[0] - b[0]) > 10 or abs(a[1] - b[1]) > 10
    labels = [t for t in ax.texts if isinstance(t, Annotation)]
    assert sorted(t.get_text() for t in labels) == [f"{r['best_valid_ppl']:.1f} (epoch {r['best_epoch']})"
                                                    for r in sorted(runs, key=lambda r: r["best_valid_ppl"])]
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(t, renderer) for t in labels]
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    curves = [line.get_transform().transform_path(line.get_path()) for line in ax.lines
              if line.get_marker() == "o" and len(line.get_xdata()) > 1]  # the validation curves
    assert not any(curve.intersects_bbox(box, filled=False) for curve in curves for box in boxes)
    inside = ax.get_window_extent(renderer)
    assert all(inside.x0 <= b.x0 and b.x1 <= inside.x1 and inside.y0 <= b.y0 and b.y1 <= inside.y1
               for b in boxes)


def test_the_line_styles_are_in_a_legend_and_no_dash_means_no_dropout(issue_figure):
    fig, _ = issue_figure
    ax = fig.axes[0]
    assert ax.get_ylabel() == "perplexity"
    legends = _legends(ax)
    assert legends["lines"] == ["validation", "training", "best validation epoch", "learning rate lowered"]
    runs = legends["runs (colour: regime)"]
    assert runs[0].startswith("none (dropout none, seed 1)") and not any("—" in text for text in runs)


def test_learning_rate_drops_are_dotted_vertical_lines_in_the_run_colour(issue_figure):
    fig, runs = issue_figure
    ax = fig.axes[0]
    assert lr_drops(runs[0]["epochs"]) == [10, 11, 12, 13]
    vertical = [(line.get_xdata()[0], line.get_color()) for line in ax.lines
                if line.get_linestyle() == ":" and line.get_xdata()[0] == line.get_xdata()[1]]
    drops = sorted((round(x + 0.5), colour) for x, colour in vertical)
    assert drops == sorted([(e, "C0") for e in (10, 11, 12, 13)] + [(14, "C1"), (18, "C1"), (15, "C2"),
                                                                      (19, "C2")])
    assert all(abs(x + 0.5 - round(x + 0.5)) < 0.2 for x, _ in vertical)  # between the epochs


def test_a_regime_has_the_same_colour_in_every_plot():
    tied = _run("tied", 151.6, 5, [], 5)
    alone = learning_curve_figure([tied])  # a run's curve.png
    together = learning_curve_figure([_run("none", 170.0, 5, [], 5, dropout={}),
                                      _run("naive", 150.0, 5, [], 5), tied])
    try:
        colour = {fig: {line.get_label().split(" ")[0]: line.get_color() for line in fig.axes[0].lines
                        if not line.get_label().startswith("_")} for fig in (alone, together)}
        assert colour[alone]["tied"] == colour[together]["tied"] == regime_colour("tied")
        assert len({regime_colour(r) for r in ("none", "naive", "tied", "untied", "batch")}) == 5
        assert regime_colour("my_regime") == regime_colour("my_regime")
    finally:
        plt.close(alone)
        plt.close(together)


def test_reliability_bins_with_few_predictions_show_their_count_and_are_faded():
    confidence = torch.cat([torch.full((500,), 0.15), torch.full((40,), 0.55), torch.tensor([0.93, 0.97])])
    correct = torch.cat([torch.rand(500) < 0.15, torch.rand(40) < 0.5, torch.tensor([True, True])])
    diagram = reliability_from_predictions(confidence, correct, 10)
    fig, (top, bottom) = plt.subplots(2, 1)
    try:
        reliability_axes(top, bottom, diagram, "test")
        counts = {t.get_text() for t in top.texts}
        assert counts == {"n=2"}  # the bin of few predictions says how few (the others: the panel below)
        bars = {round(p.get_x() + p.get_width() / 2, 2): p for p in top.patches}
        assert bars[0.95].get_alpha() < 0.5 and bars[0.15].get_alpha() == 1.0  # the bin of 2 is faded
        assert FEW_PREDICTIONS > 2 and "faded" in top.get_title()
    finally:
        plt.close(fig)
