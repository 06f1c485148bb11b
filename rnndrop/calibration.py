"""Calibration of class predictions: reliability diagrams and expected calibration error.

A prediction's *confidence* is its largest class probability; it is *correct* when
that class is the label. Confidences are put into ``n_bins`` equal-width bins of
[0, 1] (bin ``i`` holds ``(i / n, (i + 1) / n]``, the first also holds 0); a
calibrated model is right in a fraction of each bin's predictions equal to the
bin's mean confidence. The expected calibration error (Naeini et al. 2015, Guo et
al. 2017) is the count-weighted mean gap::

    ECE = sum_b (n_b / N) * |accuracy_b - confidence_b|

Works for standard predictions (``logits.softmax(-1)``) and Monte-Carlo ones
(``rnndrop.mc.mc_predict(...).mean``) alike::

    diagram = reliability_diagram(probs, labels)      # diagram.confidence / .accuracy / .count
    ece = expected_calibration_error(probs, labels)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rnndrop.validation import check_positive_int

__all__ = [
    "ReliabilityDiagram",
    "expected_calibration_error",
    "reliability_diagram",
    "reliability_from_predictions",
]


@dataclass(frozen=True)
class ReliabilityDiagram:
    """Per-bin statistics of top-class confidence against accuracy.

    Attributes (``n`` bins, CPU float64 tensors; ``count`` int64):
        bin_edges: ``[n + 1]``, from 0 to 1.
        confidence: mean confidence of the predictions in each bin ``[n]``, NaN when empty.
        accuracy: fraction of correct predictions in each bin ``[n]``, NaN when empty.
        count: number of predictions in each bin ``[n]``.
    """

    bin_edges: Tensor
    confidence: Tensor
    accuracy: Tensor
    count: Tensor

    @property
    def ece(self) -> float:
        """Expected calibration error: ``sum_b (n_b / N) |accuracy_b - confidence_b|``."""
        filled = self.count > 0
        weights = self.count[filled].double() / self.count.sum()
        gaps = (self.accuracy[filled] - self.confidence[filled]).abs()
        return float((weights * gaps).sum())

    @property
    def max_calibration_error(self) -> float:
        """Largest ``|accuracy_b - confidence_b|`` over the non-empty bins."""
        filled = self.count > 0
        return float((self.accuracy[filled] - self.confidence[filled]).abs().max())


def _check_inputs(probs: Tensor, labels: Tensor, n_bins: int) -> tuple[Tensor, Tensor]:
    if not isinstance(probs, Tensor) or not probs.is_floating_point() or probs.dim() < 1:
        if isinstance(probs, Tensor):
            got = f"{probs.dtype} of shape {list(probs.shape)}"
        else:
            got = type(probs).__name__
        raise TypeError(
            f"probs must be a floating-point Tensor [..., C] of class probabilities, got {got}"
        )
    if not isinstance(labels, Tensor) or labels.dtype != torch.long:
        got = labels.dtype if isinstance(labels, Tensor) else type(labels).__name__
        raise TypeError(f"labels must be a LongTensor of class indices, got {got}")
    if tuple(labels.shape) != tuple(probs.shape[:-1]):
        raise ValueError(
            f"labels must have probs' shape without the class dimension, {list(probs.shape[:-1])}, "
            f"got {list(labels.shape)}"
        )
    check_positive_int("n_bins", n_bins)
    if labels.numel() == 0:
        raise ValueError("probs and labels must hold at least one prediction, got none")
    probs = probs.detach().reshape(-1, probs.shape[-1])
    labels = labels.detach().reshape(-1)
    _check_probabilities("probs", probs)
    sums = probs.double().sum(-1)
    tolerance = 1e-3 if probs.dtype in (torch.float32, torch.float64) else 1e-2
    worst = int((sums - 1).abs().argmax())
    if abs(float(sums[worst]) - 1) > tolerance:
        raise ValueError(
            "probs must hold class probabilities whose rows sum to 1 (apply softmax to logits), "
            f"got a row that sums to {float(sums[worst]):.6g}"
        )
    if labels.min() < 0 or labels.max() >= probs.shape[-1]:
        raise ValueError(
            f"labels must be class indices in [0, {probs.shape[-1]}), got values in "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )
    return probs, labels


def _check_probabilities(name: str, values: Tensor) -> None:
    """``values`` must be finite and in [0, 1] (logits, or NaN from a diverged model, are not)."""
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        raise ValueError(f"{name} must be finite probabilities, got {float(values[bad][0])}")
    low, high = float(values.min()), float(values.max())
    if low < 0 or high > 1:
        raise ValueError(
            f"{name} must be probabilities in [0, 1] (apply softmax to logits), got values in "
            f"[{low!r}, {high!r}]"
        )


def reliability_diagram(probs: Tensor, labels: Tensor, n_bins: int = 15) -> ReliabilityDiagram:
    """Bin the predictions by confidence.

    Args:
        probs: class probabilities ``[..., C]`` (rows summing to 1), e.g.
            ``logits.softmax(-1)`` or ``mc_predict(...).mean``.
        labels: true classes ``[...]`` (LongTensor).
        n_bins: the number of equal-width confidence bins.

    Returns:
        A :class:`ReliabilityDiagram`; its ``ece`` property is the expected calibration error.
    """
    probs, labels = _check_inputs(probs, labels, n_bins)
    confidence, predicted = probs.max(-1)
    return reliability_from_predictions(confidence, predicted == labels, n_bins)


def reliability_from_predictions(confidence: Tensor, correct: Tensor, n_bins: int = 15) -> ReliabilityDiagram:
    """Bin top-class predictions given as their confidences and whether they were right.

    For predictions too many to hold as probabilities (a language model's next-word
    distributions over a corpus): keep each token's largest probability and whether
    its class was the target, then bin them all at once.

    Args:
        confidence: the largest class probability of every prediction ``[N]`` (any shape).
        correct: whether that class was the label ``[N]`` (bool or 0/1, same shape).
        n_bins: the number of equal-width confidence bins.
    """
    check_positive_int("n_bins", n_bins)
    for name, value in (("confidence", confidence), ("correct", correct)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(value).__name__}")
    if not confidence.is_floating_point():
        raise TypeError(
            f"confidence must be a floating-point Tensor of probabilities, got {confidence.dtype}"
        )
    if confidence.shape != correct.shape:
        raise ValueError(
            f"confidence and correct must have the same shape, got {list(confidence.shape)} "
            f"and {list(correct.shape)}"
        )
    if confidence.numel() == 0:
        raise ValueError("confidence must hold at least one prediction, got none")
    _check_probabilities("confidence", confidence)
    if correct.dtype != torch.bool and not bool(((correct == 0) | (correct == 1)).all()):
        raise ValueError("correct must be bool or hold only 0 and 1, got other values")
    precision = confidence.dtype
    confidence = confidence.reshape(-1).double().cpu()
    correct = correct.reshape(-1).double().cpu()
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    # Bin i holds (edges[i], edges[i + 1]]; confidence 0 goes to bin 0. The inner edges are
    # rounded to the confidences' precision first: a float32 0.6 (0.6000000238) is the edge 0.6.
    index = torch.bucketize(confidence, edges[1:-1].to(precision).double(), right=False)
    count = torch.bincount(index, minlength=n_bins)
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, confidence)
    correct_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, correct)
    filled = count.double()
    return ReliabilityDiagram(
        bin_edges=edges,
        confidence=conf_sum / filled,  # 0 / 0 = NaN marks an empty bin
        accuracy=correct_sum / filled,
        count=count,
    )


def expected_calibration_error(probs: Tensor, labels: Tensor, n_bins: int = 15) -> float:
    """ECE of top-class predictions with ``n_bins`` equal-width bins (see the module docstring).

    Args:
        probs: class probabilities ``[..., C]``.
        labels: true classes ``[...]`` (LongTensor).
        n_bins: the number of bins.
    """
    return reliability_diagram(probs, labels, n_bins).ece
