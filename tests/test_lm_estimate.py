"""How far a job's time estimate is from the time it takes, measured on a scripted run: a fake
clock that the model's forward passes advance (issue 43, "Estimates that swing")."""

import logging
import time
from dataclasses import replace

import pytest
import torch

from rnndrop.lm.model.language_model import RNNLanguageModel
from rnndrop.lm.run import job
from rnndrop.lm.run.report import JobProgress, RunCost
from tests.lm_helpers import TINY, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


class Clock:
    """Fake seconds: every forward pass costs its tokens times ``per_token`` (three times that
    with gradients: forward and backward), times ``load`` (a machine that gets busier)."""

    def __init__(self, per_token: float = 1e-3) -> None:
        self.now, self.per_token, self.load = 1000.0, per_token, 1.0

    def __call__(self) -> float:
        return self.now

    def forward(self, tokens: torch.Tensor) -> None:
        self.now += tokens.numel() * self.per_token * self.load * (3 if torch.is_grad_enabled() else 1)


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    forward = RNNLanguageModel.forward

    def timed(self, tokens, *args, **kwargs):
        clock.forward(tokens)
        return forward(self, tokens, *args, **kwargs)

    monkeypatch.setattr(RNNLanguageModel, "forward", timed)
    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(job, "RUN_OVERHEAD_SECONDS", 0.0)  # files and plots cost no fake time
    return clock


def _job(tmp_path, monkeypatch, clock, config, regimes, *, load_after_estimate=1.0, resume=False, out="out"):
    """Run a job on the fake clock; returns (the up-front ETA, the seconds it took, the ETAs
    the bar showed after each epoch with the true time left then, the log)."""
    seen = {}
    announce, report = job._announce, job._report_estimate

    def spy_announce(*args):
        seen["eta"] = announce(*args)
        clock.load = load_after_estimate
        return seen["eta"]

    def spy_report(eta, seconds, progress):
        seen["took"] = seconds
        return report(eta, seconds, progress)

    etas = []
    epoch_done = JobProgress.epoch_done

    def spy_epoch(self, *args, **kwargs):
        epoch_done(self, *args, **kwargs)
        etas.append((self.eta_seconds(), clock.now))

    monkeypatch.setattr(job, "_announce", spy_announce)
    monkeypatch.setattr(job, "_report_estimate", spy_report)
    monkeypatch.setattr(JobProgress, "epoch_done", spy_epoch)
    data = write_corpus(tmp_path / "data")
    job.run_benchmark(data, "ptb", config, regimes, [1], tmp_path / out, progress=False, estimate=True,
                      resume=resume)
    end = clock.now
    return seen["eta"], seen["took"], [(eta, end - now) for eta, now in etas]


def _error(estimate, truth):
    return abs(estimate - truth) / truth


def test_the_up_front_estimate_is_within_25_percent_of_a_scripted_job(tmp_path, monkeypatch, clock, caplog):
    config = replace(TINY, epochs=4)  # plateau without a floor: every run trains its 4 epochs
    with caplog.at_level(logging.INFO, logger="rnndrop.lm.run"):
        eta, took, etas = _job(tmp_path, monkeypatch, clock, config, ["none", "tied"])
    print(f"estimate {eta:.1f} s, took {took:.1f} s: {100 * _error(eta, took):.1f}% off")
    assert took > 0 and _error(eta, took) < 0.25, (eta, took)
    for bar, left in etas[:-1]:  # the bar agrees with the line, then with the truth
        assert _error(bar, left) < 0.25, (bar, left)
    line = next(r.getMessage() for r in caplog.records if "this job trains" in r.getMessage())
    assert "2 runs, 8 epochs in all at most (up to 4 a run)" in line
    assert "follows the measured speed from the first epoch on" in line


def test_on_a_machine_that_gets_busier_the_bar_follows_the_measured_speed(tmp_path, monkeypatch, clock):
    config = replace(TINY, epochs=4)
    eta, took, etas = _job(tmp_path, monkeypatch, clock, config, ["none", "tied"], load_after_estimate=2.0)
    assert _error(eta, took) > 0.4  # twice as slow as timed: the prior alone is far off
    for bar, left in etas[:-1]:  # from the first epoch on, the measured speed counts
        assert _error(bar, left) < 0.25, (bar, left)


def test_a_resumed_job_estimates_what_is_left(tmp_path, monkeypatch, clock, caplog):
    config = replace(TINY, epochs=4)
    _job(tmp_path, monkeypatch, clock, config, ["none"])  # "none" finished: reused on resume
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rnndrop.lm.run"):
        eta, took, _ = _job(tmp_path, monkeypatch, clock, config, ["none", "tied"], resume=True)
    assert _error(eta, took) < 0.25, (eta, took)
    text = caplog.text
    assert "this job trains 1 run (1 more finished earlier: reused), 4 epochs in all at most" in text
    # the run without dropout has no Monte-Carlo perplexity to add: no line says it is computed
    # (it said "run 1/2 none (no dropout) seed 1: Monte-Carlo test perplexity (3 samples)")
    mc_lines = [r.getMessage() for r in caplog.records if "Monte-Carlo" in r.getMessage()]
    assert mc_lines and not [line for line in mc_lines if "none" in line]


def test_the_monte_carlo_line_is_within_25_percent(tmp_path, monkeypatch, clock, caplog):
    config = replace(TINY, epochs=1, mc_samples=20)
    with caplog.at_level(logging.INFO, logger="rnndrop.lm.run"):
        _job(tmp_path, monkeypatch, clock, config, ["tied"])
    records = caplog.records
    announced = next(i for i, r in enumerate(records) if "Monte-Carlo test perplexity, 20" in r.getMessage())
    said = records[announced].getMessage()
    seconds = float(said.split("(about ")[1].split(" s)")[0])
    from tests.lm_helpers import sentences  # the test split: 30 sentences of 5 words + <eos>

    n_test = sum(len(s.split()) + 1 for s in sentences(30, 2)) + 7
    truth = 20 * n_test * clock.per_token  # every test word, once per sample
    assert _error(seconds, truth) < 0.25, (seconds, truth)


def test_job_progress_speed_is_the_prior_until_an_epoch_is_measured(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    progress = JobProgress(2, 3, bar=False, costs=[RunCost(3, 10.0, 5.0), RunCost(3, 20.0, 0.0)])
    assert progress.eta_seconds() == pytest.approx(35 + 60)
    progress.start_run("run 1/2 none", 1)
    now[0] = 20.0  # twice as slow as the prior
    progress.epoch_done(1, {"valid_ppl": 1.0})
    assert progress.speed() == pytest.approx(2.0)
    assert progress.eta_seconds() == pytest.approx(2 * (25 + 60))
    progress.run_done("run 1/2 none", {"best_valid_ppl": 1.0, "test_ppl": 1.0})  # stopped early
    assert progress.remaining_epochs() == 3 and progress.eta_seconds() == pytest.approx(60 * 20 / 15)


def test_parallel_runs_share_the_wall_time_in_the_prior():
    progress = JobProgress(2, 3, bar=False, costs=[RunCost(3, 10.0, 0.0)] * 2, jobs=2)
    assert progress.eta_seconds() == pytest.approx(30.0, abs=0.1)


def test_with_a_bar_each_run_still_gets_its_result_line(monkeypatch, caplog):
    """Terminal mode (bars drawn) logs the per-run line log mode has, MC included."""
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    progress = JobProgress(2, 3, bar=True, costs=[RunCost(3, 1.0, 0.0)] * 2)
    try:
        assert progress.bar is not None
        with caplog.at_level(logging.INFO, logger="rnndrop.lm.run.report"):
            progress.start_run("run 1/2 tied", 1)
            progress.epoch_done(1, {"valid_ppl": 9.0})
            progress.run_done("run 1/2 tied", {"best_valid_ppl": 9.0, "test_ppl": 9.5, "test_ppl_mc": 9.25,
                                               "mc_samples": 50})
    finally:
        progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        "run 1/2 tied finished: best valid ppl 9.00, test ppl 9.50, MC 9.25 (50 samples); 1 of 2 runs done")
