"""The Gaussian regimes of rnndrop-lm: fixed alpha, learned alpha (Molchanov, Kingma's
constrained setting), and the per-site alpha trace of the epoch history."""

import math
from dataclasses import replace

import pytest
import torch

from rnndrop import VariationalLSTM
from rnndrop.gaussian import GaussianLSTM
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.presets import CONFIGS
from rnndrop.lm.model.regimes import REGIMES
from rnndrop.lm.run.checkpoint import read_result
from rnndrop.lm.run.report import noise_series, plot_alphas
from rnndrop.lm.run.train import learned_noise, train_run
from tests.lm_helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")

P = {"embedding": 0.1, "input": 0.3, "between": 0.3, "hidden": 0.2, "output": 0.3}


def test_fixed_and_learned_regimes_build_what_they_say():
    fixed = build_model(50, TINY, REGIMES["gaussian_fixed"], P).rnn
    assert type(fixed) is VariationalLSTM and fixed.noise == "gaussian"
    assert learned_noise(build_model(50, TINY, REGIMES["gaussian_fixed"], P)) == {}
    for name, granularity in (("gaussian_kingma", "unit"), ("gaussian_kingma_layer", "layer")):
        rnn = build_model(50, TINY, REGIMES[name], P).rnn
        assert isinstance(rnn, GaussianLSTM) and rnn.granularity == granularity
        assert rnn.max_alpha == 1.0 and rnn.kl_approximation == "kingma"
    assert build_model(50, TINY, REGIMES["gaussian"], P).rnn.max_alpha is None


def test_kingma_grids_stay_inside_alpha_le_1():
    for config in ("mini", "cpu-200"):
        for regime in ("gaussian_kingma", "gaussian_kingma_layer"):
            points = CONFIGS[config].grid[regime]
            assert points and all(p[s] <= 0.5 for p in points for s in ("input", "hidden", "output"))


def test_learned_noise_reports_every_site_mean_alpha_and_kl():
    model = build_model(50, TINY, REGIMES["gaussian_kingma_layer"], P)
    with torch.no_grad():
        model.rnn.log_alpha_hidden_l1.fill_(math.log(0.5))
    noise = learned_noise(model)
    assert set(noise["alpha"]) == {"rnn.input_l0", "rnn.input_l1", "rnn.hidden_l0", "rnn.hidden_l1",
                                   "rnn.output"}
    assert noise["alpha"]["rnn.hidden_l1"] == pytest.approx(0.5)
    assert noise["alpha"]["rnn.input_l0"] == pytest.approx(0.3 / 0.7)
    assert sum(noise["kl"].values()) == pytest.approx(model.rnn.kl().item(), rel=1e-5)


def test_alpha_plot_needs_a_learned_noise_trace(tmp_path):
    run = {"regime": "tied", "seed": 1, "epochs": [{"epoch": 1}], "config": {}}
    assert plot_alphas([run], tmp_path / "a.png") is None and not (tmp_path / "a.png").exists()
    run["epochs"] = [{"epoch": e, "noise": {"alpha": {"rnn.hidden_l0": 0.1 * e}}} for e in (1, 2)]
    assert noise_series(run["epochs"]) == {"rnn.hidden_l0": [(1, 0.1), (2, 0.2)]}
    assert plot_alphas([run], tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_kingma_run_records_alphas_within_the_bound_and_plots_them(corpus, tmp_path):
    config = replace(TINY, epochs=2, mc_samples=0, kl_weight=1.0)
    result = train_run(corpus, config, "gaussian_kingma", tmp_path / "run", seed=1, progress=False)
    for epoch in result["epochs"]:
        alphas = epoch["noise"]["alpha"]
        assert len(alphas) == 5 and all(0 < a <= 1.0 for a in alphas.values())
        assert all(math.isfinite(k) for k in epoch["noise"]["kl"].values())
    assert read_result(tmp_path / "run" / "results.json")["epochs"] == result["epochs"]
    assert (tmp_path / "run" / "alphas.png").read_bytes()[:4] == b"\x89PNG"
    fixed = train_run(corpus, replace(config, epochs=1), "gaussian_fixed", tmp_path / "fixed", seed=1,
                      progress=False)
    assert "noise" not in fixed["epochs"][0] and not (tmp_path / "fixed" / "alphas.png").exists()
