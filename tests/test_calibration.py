import math

import pytest
import torch
from torch import nn

from rnndrop import VariationalLSTM
from rnndrop.calibration import expected_calibration_error, reliability_diagram, reliability_from_predictions
from rnndrop.mc import mc_predict


def test_hand_computed_ece_and_bins():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.5, 0.5]])
    labels = torch.tensor([0, 1, 1, 0])
    diagram = reliability_diagram(probs, labels, n_bins=4)
    assert diagram.count.tolist() == [0, 1, 1, 2]
    assert math.isnan(diagram.confidence[0]) and math.isnan(diagram.accuracy[0])
    torch.testing.assert_close(diagram.confidence[1:], torch.tensor([0.5, 0.7, 0.85], dtype=torch.float64))
    torch.testing.assert_close(diagram.accuracy[1:], torch.tensor([1.0, 1.0, 0.5], dtype=torch.float64))
    # 1/4 * 0.5 + 1/4 * 0.3 + 2/4 * 0.35
    assert diagram.ece == pytest.approx(0.375)
    assert expected_calibration_error(probs, labels, n_bins=4) == pytest.approx(0.375)
    assert diagram.max_calibration_error == pytest.approx(0.5)
    torch.testing.assert_close(diagram.bin_edges, torch.linspace(0, 1, 5, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_confidence_on_an_edge_falls_in_the_bin_below_in_every_precision(dtype):
    """Bin i holds (i/n, (i+1)/n]: a float32 0.6 (0.6000000238 as a double) is the edge 0.6."""
    probs = torch.tensor([[0.6, 0.4]] * 2 + [[0.7, 0.3]] * 2, dtype=dtype)
    labels = torch.tensor([0, 0, 1, 1])
    diagram = reliability_diagram(probs, labels, n_bins=5)
    assert diagram.count.tolist() == [0, 0, 2, 2, 0]
    assert diagram.ece == pytest.approx(0.55, abs=0.01)  # 2/4 * (1 - 0.6) + 2/4 * 0.7


def test_calibrated_and_overconfident_cases():
    calibrated = torch.tensor([[0.75, 0.25]] * 4)
    assert expected_calibration_error(calibrated, torch.tensor([0, 0, 0, 1])) == pytest.approx(0.0)
    sure = torch.tensor([[1.0, 0.0, 0.0]] * 4)
    assert expected_calibration_error(sure, torch.tensor([0, 1, 2, 0])) == pytest.approx(0.5)
    # Bins are (lo, hi]: a confidence on an edge goes to the lower bin.
    edge = reliability_diagram(torch.tensor([[0.5, 0.5], [0.6, 0.4]]), torch.tensor([0, 0]), n_bins=2)
    assert edge.count.tolist() == [1, 1]


def test_leading_dimensions_are_flattened():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(5, 3, 4, generator=g).softmax(-1)
    labels = torch.randint(4, (5, 3), generator=g)
    a = reliability_diagram(probs, labels, n_bins=5)
    b = reliability_diagram(probs.reshape(15, 4), labels.reshape(15), n_bins=5)
    assert a.count.tolist() == b.count.tolist() and a.count.sum() == 15
    assert a.ece == pytest.approx(b.ece)


def test_mc_predictions_with_p_zero_have_the_standard_ece():
    torch.manual_seed(1)
    lstm = VariationalLSTM(3, 5, batch_first=True)
    head = nn.Linear(5, 4)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = lstm, head

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    model = Model().eval()
    x, labels = torch.randn(30, 4, 3), torch.randint(4, (30,))
    with torch.no_grad():
        standard = model(x).softmax(-1)
    mc = mc_predict(model, x, n_samples=3, strict=False).mean
    assert expected_calibration_error(mc, labels) == pytest.approx(
        expected_calibration_error(standard, labels), abs=1e-6
    )


def test_bad_inputs_are_named():
    probs = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="labels must have probs' shape"):
        reliability_diagram(probs, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"class indices in \[0, 2\)"):
        reliability_diagram(probs, torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="LongTensor"):
        reliability_diagram(probs, torch.zeros(3))
    with pytest.raises(TypeError, match="floating-point"):
        reliability_diagram(torch.ones(3, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="n_bins"):
        reliability_diagram(probs, torch.zeros(3, dtype=torch.long), n_bins=0)


def test_reliability_from_predictions_bins_what_reliability_diagram_bins():
    torch.manual_seed(0)
    probs = torch.randn(300, 7).softmax(-1)
    labels = torch.randint(7, (300,))
    confidence, predicted = probs.max(-1)
    a = reliability_diagram(probs, labels, n_bins=10)
    b = reliability_from_predictions(confidence, predicted == labels, n_bins=10)
    assert torch.equal(a.count, b.count) and a.ece == b.ece
    with pytest.raises(ValueError, match="same shape"):
        reliability_from_predictions(confidence, (predicted == labels)[:5])


@pytest.mark.parametrize(
    "probs, match",
    [
        (torch.tensor([[2.0, -1.0], [0.5, 0.3]]), "in \\[0, 1\\]"),  # logits
        (torch.tensor([[0.6, 0.6], [0.5, 0.5]]), "sum to 1"),
        (torch.tensor([[float("nan"), 0.5], [0.5, 0.5]]), "finite"),
        (torch.tensor([[float("inf"), 0.0], [0.5, 0.5]]), "finite"),
    ],
)
def test_what_is_not_a_probability_is_refused(probs, match):
    labels = torch.tensor([0, 1])
    with pytest.raises(ValueError, match=match):
        expected_calibration_error(probs, labels)
    with pytest.raises(ValueError, match=match):
        reliability_diagram(probs, labels)


@pytest.mark.parametrize(
    "confidence, correct, error, match",
    [
        (torch.tensor([1.5, 0.5]), torch.tensor([True, False]), ValueError, "in \\[0, 1\\]"),
        (torch.tensor([-0.1, 0.5]), torch.tensor([True, False]), ValueError, "in \\[0, 1\\]"),
        (torch.tensor([float("nan"), 0.5]), torch.tensor([True, False]), ValueError, "finite"),
        (torch.tensor([0.7, 0.5]), torch.tensor([2, 0]), ValueError, "only 0 and 1"),
        (torch.tensor([1, 0]), torch.tensor([True, False]), TypeError, "floating-point"),
        ([0.7, 0.5], torch.tensor([True, False]), TypeError, "must be a Tensor"),
    ],
)
def test_reliability_from_predictions_refuses_what_is_not_a_confidence(confidence, correct, error, match):
    with pytest.raises(error, match=match):
        reliability_from_predictions(confidence, correct)


def test_probabilities_in_half_precision_and_mc_means_are_accepted():
    probs = torch.randn(50, 7).softmax(-1)
    labels = torch.randint(7, (50,))
    expected = expected_calibration_error(probs.double(), labels)
    assert expected_calibration_error(probs.half().float(), labels) == pytest.approx(expected, abs=1e-2)
    samples = torch.randn(20, 50, 7).softmax(-1).mean(0)  # an MC mean sums to 1 up to rounding
    assert 0 <= expected_calibration_error(samples, labels) <= 1
