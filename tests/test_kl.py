import math

import numpy as np
import pytest
import torch
from torch import nn

from rnndrop.gaussian import GaussianLockedDropout
from rnndrop.kl import (
    KINGMA_COEFFICIENTS,
    MOLCHANOV_COEFFICIENTS,
    KLRegularizer,
    kl_divergence,
    kl_kingma,
    kl_molchanov,
    kl_warmup,
    model_kl,
    negative_elbo,
)
from rnndrop.sparse import SparseLinear


def exact_kl(log_alpha: float) -> float:
    """KL(N(θ, αθ²) || log-uniform) by quadrature, constant fixed so that it -> 0 as α -> ∞.

    -KL = 0.5 log α − E[log|1 + sqrt(α) ε|] − (γ + log 2) / 2.
    """
    eps = np.linspace(-12.0, 12.0, 2_000_001)
    density = np.exp(-0.5 * eps**2) / math.sqrt(2 * math.pi)
    log_term = np.log(np.abs(1.0 + math.sqrt(math.exp(log_alpha)) * eps) + 1e-300)
    expectation = float((log_term * density).sum() * (eps[1] - eps[0]))
    return -(0.5 * log_alpha - expectation - 0.5 * (np.euler_gamma + math.log(2.0)))


def t64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_published_coefficients():
    assert KINGMA_COEFFICIENTS == (1.16145124, -1.50204118, 0.58629921)
    assert MOLCHANOV_COEFFICIENTS == (0.63576, 1.87320, 1.48695)


def test_kingma_values_at_known_points():
    # alpha = 1: -(0 + c1 + c2 + c3); alpha = 0.25: -(0.5 log 0.25 + c1/4 + c2/16 + c3/64)
    c1, c2, c3 = KINGMA_COEFFICIENTS
    got = kl_kingma(t64([0.0, math.log(0.25)]))
    expected = [-(c1 + c2 + c3), -(0.5 * math.log(0.25) + c1 / 4 + c2 / 16 + c3 / 64)]
    torch.testing.assert_close(got, t64(expected))
    assert got[0].item() == pytest.approx(-0.24570927, abs=1e-8)


def test_molchanov_values_at_known_points():
    k1, k2, k3 = MOLCHANOV_COEFFICIENTS
    sig = 1.0 / (1.0 + math.exp(-k2))
    got = kl_molchanov(t64([0.0, math.log(4.0)]))
    sig4 = 1.0 / (1.0 + math.exp(-(k2 + k3 * math.log(4.0))))
    expected = [k1 - k1 * sig + 0.5 * math.log(2.0), k1 - k1 * sig4 + 0.5 * math.log(1.25)]
    torch.testing.assert_close(got, t64(expected))
    assert got[0].item() == pytest.approx(0.43124, abs=1e-4)


def test_molchanov_matches_exact_kl_everywhere():
    points = [-8.0, -4.0, -2.0, -1.0, 0.0, 1.0, 2.0, 4.0, 8.0]
    approx = kl_molchanov(t64(points))
    for la, value in zip(points, approx.tolist()):
        assert value == pytest.approx(exact_kl(la), abs=0.01), la


def test_molchanov_vanishes_as_alpha_grows():
    values = kl_molchanov(t64([5.0, 10.0, 20.0, 40.0]))
    assert values[-1].item() < 1e-8
    assert torch.all(values[1:] < values[:-1])


def test_sign_and_monotonicity():
    log_alpha = t64(np.linspace(-10, 10, 201))
    molchanov = kl_molchanov(log_alpha)
    assert torch.all(molchanov > 0)
    assert torch.all(molchanov[1:] < molchanov[:-1])  # more noise, closer to the prior
    small = t64(np.linspace(-10, 0, 101))  # Kingma's fit is for alpha <= 1
    kingma = kl_kingma(small)
    assert torch.all(kingma[1:] < kingma[:-1])
    assert kingma[0] > 0


def test_kingma_and_molchanov_agree_up_to_a_constant_for_small_alpha():
    log_alpha = t64(np.linspace(-8, 0, 81))
    difference = kl_molchanov(log_alpha) - kl_kingma(log_alpha)
    assert (difference.max() - difference.min()).item() < 0.05
    assert difference.mean().item() == pytest.approx(MOLCHANOV_COEFFICIENTS[0], abs=0.05)
    # and both follow the exact KL up to a constant
    exact = t64([exact_kl(la) for la in log_alpha[::10].tolist()])
    offset = exact - kl_kingma(log_alpha[::10])
    assert (offset.max() - offset.min()).item() < 0.05


def test_kl_divergence_dispatch_and_bad_name():
    x = t64([-1.0, 0.5])
    torch.testing.assert_close(kl_divergence(x), kl_molchanov(x))
    torch.testing.assert_close(kl_divergence(x, "kingma"), kl_kingma(x))
    with pytest.raises(ValueError, match="approximation"):
        kl_divergence(x, "exact")


def test_gradients_flow_to_log_alpha():
    log_alpha = torch.zeros(3, requires_grad=True)
    kl_molchanov(log_alpha).sum().backward()
    assert torch.all(log_alpha.grad < 0)


def test_model_kl_sums_every_module_once():
    model = nn.Sequential(GaussianLockedDropout(4, 0.5), nn.Linear(4, 4), SparseLinear(4, 3))
    expected = model[0].kl() + model[2].kl()
    torch.testing.assert_close(model_kl(model), expected)
    assert model_kl(nn.Linear(2, 2)).item() == 0.0


def test_warmup_is_linear_then_flat():
    assert kl_warmup(0.0, 0.2) == 0.0
    assert kl_warmup(0.1, 0.2) == pytest.approx(0.5)
    assert kl_warmup(0.5, 0.2) == 1.0
    assert kl_warmup(0.0, 0.0) == 1.0
    with pytest.raises(ValueError, match="warmup"):
        kl_warmup(0.5, 1.5)


def test_negative_elbo_and_regularizer_scale_by_dataset_size():
    model = SparseLinear(3, 2)
    nll = torch.tensor(2.0)
    kl = model_kl(model)
    torch.testing.assert_close(negative_elbo(nll, kl, 1000), nll + kl / 1000)
    torch.testing.assert_close(negative_elbo(nll, kl, 1000, kl_weight=0.5), nll + 0.5 * kl / 1000)
    hook = KLRegularizer(1000, warmup=0.5)
    torch.testing.assert_close(hook(model, 0.25), 0.5 * kl / 1000)
    torch.testing.assert_close(hook(model, 0.9), kl / 1000)
    from_caller = KLRegularizer(warmup=0.5)
    torch.testing.assert_close(from_caller(model, 0.9, 500), kl / 500)
    with pytest.raises(ValueError, match="dataset_size"):
        from_caller(model, 0.9)
    with pytest.raises(ValueError, match="dataset_size"):
        negative_elbo(nll, kl, 0)
    for bad in (-1.0, float("nan")):  # a negative weight rewards the KL; NaN poisons the loss
        with pytest.raises(ValueError, match=f"kl_weight must be a finite number >= 0, got {bad}"):
            negative_elbo(nll, kl, 1000, kl_weight=bad)
    annealed = negative_elbo(nll, kl, 1000, kl_weight=torch.tensor(0.5))
    torch.testing.assert_close(annealed, nll + 0.5 * kl / 1000)


@pytest.mark.slow
@pytest.mark.parametrize("regime", ["gaussian", "sparse_vd"])
def test_language_model_regimes_train_with_the_kl_hook(tmp_path, regime):
    from dataclasses import replace

    from rnndrop.lm.data.corpus import load_corpus
    from rnndrop.lm.model.build import build_model
    from rnndrop.lm.model.regimes import REGIMES, get_hook
    from rnndrop.lm.run.train import train_run
    from tests.lm_helpers import TINY, write_corpus

    corpus = load_corpus(write_corpus(tmp_path / "data"))
    config = replace(TINY, epochs=1)
    hook = get_hook(REGIMES[regime].regularizer)
    model = build_model(len(corpus.vocab), config, REGIMES[regime], config.dropout)
    assert hook(model, 0.0, 1234).item() == 0.0  # warm-up starts at 0
    assert hook(model, 0.5, 1234).item() == pytest.approx(model_kl(model).item() / 1234)
    mc_samples = 2 if regime == "gaussian" else 0  # keep the test fast
    result = train_run(corpus, config, regime, tmp_path / "run", seed=1, progress=False,
                       mc_samples=mc_samples)
    assert math.isfinite(result["test_ppl"])
    assert mc_samples == 0 or math.isfinite(result["test_ppl_mc"])
    assert result["regime_settings"]["regularizer"] == "kl_warmup_0.2"


def test_language_model_learned_alpha_counts_the_decoder_in_the_output_kl():
    """The LM's output site feeds the decoder: its KL counts one weight per word of the
    vocabulary; the hooks of runs made before kept the old count (once per unit)."""
    from rnndrop.lm.model.build import build_model
    from rnndrop.lm.model.regimes import REGIMES, Regime
    from tests.lm_helpers import TINY

    for name in ("gaussian", "gaussian_kingma", "gaussian_kingma_layer"):
        model = build_model(50, TINY, REGIMES[name], TINY.dropout)
        assert model.rnn.output_fan_out == 50, name
        old = build_model(50, TINY, Regime("old", noise="gaussian", rnn_factory=f"{name}_rnn",
                                           sites=REGIMES[name].sites), TINY.dropout)
        assert old.rnn.output_fan_out == 1, name
        ratio = model.rnn.site_kl()["log_alpha_output"] / old.rnn.site_kl()["log_alpha_output"]
        assert ratio.item() == pytest.approx(50)
