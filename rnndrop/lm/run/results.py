"""Result files of language-model runs: JSON per run, per-epoch metrics, Markdown, plots.

A run's JSON (``results.json``, schema :data:`SCHEMA`) holds the configuration,
regime, dropout probabilities, seed, per-epoch train / validation perplexity, test
perplexity (standard and Monte-Carlo), words per second, wall time, peak memory and
library versions. It is written atomically. Beside it, :class:`EpochLog` keeps
``metrics.csv`` (one row per epoch) and, when the optional ``tensorboard`` package is
installed, TensorBoard scalars in ``tensorboard/``. A benchmark's tables
(:func:`benchmark_markdown`) and learning curves (:func:`plot_learning_curves`) are
made from the runs' results.

The pieces live in :mod:`~rnndrop.lm.run.result_file` (the JSON),
:mod:`~rnndrop.lm.run.metrics` (``metrics.csv``), :mod:`~rnndrop.lm.run.tables`
(Markdown) and :mod:`~rnndrop.lm.run.plots` (learning curves); this module gathers them.
"""

from rnndrop.lm.run.metrics import METRICS_COLUMNS, EpochLog
from rnndrop.lm.run.plots import learning_curve_figure, plot_learning_curves
from rnndrop.lm.run.result_file import (
    REQUIRED_KEYS,
    SCHEMA,
    peak_memory,
    read_result,
    validate_result,
    versions,
    write_json_atomic,
)
from rnndrop.lm.run.tables import (
    benchmark_markdown,
    comparison_table,
    format_dropout,
    markdown_table,
    paired_differences,
)

__all__ = [
    "METRICS_COLUMNS",
    "REQUIRED_KEYS",
    "SCHEMA",
    "EpochLog",
    "benchmark_markdown",
    "comparison_table",
    "format_dropout",
    "learning_curve_figure",
    "markdown_table",
    "paired_differences",
    "peak_memory",
    "plot_learning_curves",
    "read_result",
    "validate_result",
    "versions",
    "write_json_atomic",
]
