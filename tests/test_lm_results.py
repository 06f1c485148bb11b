"""Result files of language-model runs: plots, metrics.csv, TensorBoard, the job's progress."""

import csv
import sys
import types

import matplotlib.pyplot as plt
import pytest

from rnndrop.lm.run.report import (
    METRICS_COLUMNS,
    EpochLog,
    JobProgress,
    RunCost,
    benchmark_markdown,
    comparison_table,
    format_duration,
    learning_curve_figure,
    markdown_table,
    paired_differences,
    plot_learning_curves,
)


def _result(epochs: int, regime: str = "tied", seed: int = 1) -> dict:
    return {
        "regime": regime, "dropout": {"input": 0.5}, "seed": seed, "dataset": "ptb",
        "corpus": {"source": "/data/ptb-sample", "train_tokens": 100, "valid_tokens": 10,
                   "test_tokens": 10, "vocab_size": 20},
        "config": {"name": "mini", "num_layers": 2, "hidden_size": 200, "embedding_size": 200,
                   "cell": "gru", "optimizer": "adam", "lr": 0.002, "batch_size": 20, "bptt": 35},
        "epochs": [{"epoch": e, "lr": 1.0, "train_ppl": 100.0 / e, "valid_ppl": 120.0 / e, "seconds": 2.0,
                    "words_per_second": 50.0} for e in range(1, epochs + 1)],
        "best_epoch": epochs, "best_valid_ppl": 120.0 / epochs, "test_ppl": 130.0, "test_ppl_mc": None,
        "mc_samples": 0, "words_per_second": 50.0, "wall_seconds": 60.0,
    }


def _runs_legend(ax):
    """The legend of the runs (the other one keys the line styles)."""
    return next(a for a in [*ax.artists, ax.get_legend()] if a.get_title().get_text().startswith("runs"))


def test_a_one_epoch_plot_shows_markers_and_integer_epochs_under_a_title():
    fig = learning_curve_figure([_result(1)])
    try:
        ax = fig.axes[0]
        assert len(ax.lines) == 3  # valid, train, the best epoch's star
        assert all(line.get_marker() not in (None, "None", "") for line in ax.lines)
        assert [list(line.get_xdata()) for line in ax.lines] == [[1], [1], [1]]
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
        title = ax.get_title()
        assert "ptb (ptb-sample)" in title and "mini" in title and "GRU" in title and "adam" in title
    finally:
        plt.close(fig)


def test_the_plot_labels_values_inside_the_range_marks_the_best_epoch_and_names_test_ppl():
    runs = [_result(6), _result(6, "none")]
    for run, low in zip(runs, (150.0, 185.0)):
        run["epochs"] = [{**e, "valid_ppl": low + 5 * e["epoch"], "train_ppl": low - 10 + e["epoch"]}
                         for e in run["epochs"]]
        run["best_epoch"], run["test_ppl"] = 2, low + 3
    fig = learning_curve_figure(runs)
    try:
        ax = fig.axes[0]
        lo, hi = ax.get_ylim()
        labels = [float(t) for t in ax.get_yticks() if lo <= t <= hi]
        assert len(labels) >= 4 and all(140 <= t <= 220 for t in labels)  # not only 10^2
        stars = [line for line in ax.lines if line.get_marker() == "*"]
        points = sorted((list(r.get_xdata()), list(r.get_ydata())) for r in stars)
        assert points == [([2], [160.0]), ([2], [195.0])]
        legend = [t.get_text() for t in _runs_legend(ax).get_texts()]
        assert legend[0].endswith("test 153.0") and legend[1].endswith("test 188.0")
    finally:
        plt.close(fig)


def test_runs_of_different_configs_name_their_own_in_the_legend_not_the_first_in_the_title():
    small, large = _result(2), _result(2, "none")
    large["config"] = {**large["config"], "name": "awd", "num_layers": 3, "hidden_size": 400}
    for runs, shared in (([small, _result(2, "none")], True), ([small, large], False)):
        fig = learning_curve_figure(runs)
        try:
            ax = fig.axes[0]
            legend = [t.get_text() for t in _runs_legend(ax).get_texts()]
            assert ("2×200 GRU" in ax.get_title()) is shared
            assert ("config mini" in legend[0]) is not shared
            if not shared:
                assert "configs in the legend" in ax.get_title()
                awd_config = legend[1].split("\n")[0]
                assert awd_config.startswith("config awd: 3×400 GRU") and "adam lr 0.002" in awd_config
        finally:
            plt.close(fig)


def test_plot_file_is_written(tmp_path):
    path = plot_learning_curves([_result(3), _result(3, "none")], tmp_path / "curves.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_learning_curves([], tmp_path / "nothing.png") is None


def test_metrics_csv_per_epoch_and_rebuilt_from_the_result_after_a_resume(tmp_path):
    result = _result(3)
    log = EpochLog(tmp_path, tensorboard=False)
    for record in result["epochs"][:2]:
        log(record["epoch"], record)
    # A resumed run opens the log again and redoes epoch 2 (it was not checkpointed).
    again = EpochLog(tmp_path, tensorboard=False)
    assert [r["epoch"] for r in again.rows] == [1, 2]
    for record in result["epochs"][1:]:
        again(record["epoch"], record)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert tuple(rows[0]) == METRICS_COLUMNS
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert [float(r["elapsed_seconds"]) for r in rows] == [2.0, 4.0, 6.0]
    (tmp_path / "metrics.csv").write_text("garbage\n1,2\n")
    broken = EpochLog(tmp_path, tensorboard=False)
    broken.finish(result)
    assert [int(r["epoch"]) for r in csv.DictReader((tmp_path / "metrics.csv").open())] == [1, 2, 3]


def test_tensorboard_scalars_when_installed_and_silence_when_not(tmp_path, monkeypatch, caplog):
    written = []

    class Writer:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, tag, value, step):
            written.append((self.log_dir, tag, value, step))

        def flush(self):
            pass

        def close(self):
            written.append("closed")

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    record = _result(1)["epochs"][0]
    log = EpochLog(tmp_path / "a")
    log(1, record)
    log(2, {**record, "epoch": 2})
    log.finish(_result(2))
    assert written[-1] == "closed"
    written.pop()
    assert len(written) == 8
    assert {tag for _, tag, _, _ in written} == {"perplexity/train", "perplexity/valid", "lr",
                                                 "words_per_second"}
    assert all(d == str(tmp_path / "a" / "tensorboard") for d, _, _, _ in written)
    assert [step for _, _, _, step in written] == [1] * 4 + [2] * 4
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    EpochLog(tmp_path / "b")(1, record)
    assert (tmp_path / "b" / "metrics.csv").is_file() and not caplog.records


def test_benchmark_markdown_has_the_table_and_the_grid():
    finals = [_result(2, "tied")]
    grid = [_result(2, "tied"), {**_result(2, "tied"), "dropout": {"input": 0.3}, "best_valid_ppl": 80.0}]
    text = benchmark_markdown("ptb", "mini", finals, grid, command="rnndrop-lm ptb", grid_seed=1)
    assert "rnndrop-lm ptb" in text and "| tied | in 0.5 | 1 | 2 | 60.0 | 130.0 | — |" in text
    assert "Grid (seed 1)" in text and text.count("✓") == 1


def test_the_table_says_which_runs_trained_compiled():
    """words/s of runs trained under torch.compile (rnndrop-lm's default for some regimes on CUDA)
    are marked as such beside eager ones; a run that fell back to eager does not count."""
    eager = _result(2, "none")
    compiled = [{**_result(2, "tied", seed), "compiled": True, "compile_failure": None} for seed in (1, 2)]
    fell_back = {**compiled[1], "compile_failure": "BackendCompilerFailed, RuntimeError: no lowering"}
    table = markdown_table([eager, *compiled])
    assert "| none | in 0.5 | 1 | 2 | 60.0 | 130.0 | — | 50 | 1.0 |" in table
    assert "| — | 50 (compiled; 50 after epoch 1) | 1.0 |" in table
    assert "| — | 50 (1 of 2 compiled) | 1.0 |" in markdown_table([compiled[0], fell_back])


def test_compiled_runs_show_the_words_per_second_they_train_at_after_their_first_epoch():
    """A compiled run's first epoch compiles and records a CUDA graph per truncated-BPTT length:
    over a few short epochs its whole-run words/s is mostly that (an H200's tied gal-medium run on
    the PTB sample: 10k words/s over three epochs, 229k in the last). Its words after the first
    epoch over their seconds say what it trains at; one epoch, or records without timing, say
    nothing more."""
    run = {**_result(3, "tied"), "compiled": True, "compile_failure": None, "words_per_second": 10.0}
    run["epochs"] = [{**r, "seconds": s, "words_per_second": w}
                     for r, s, w in zip(run["epochs"], (60.0, 2.0, 1.0), (1.0, 200.0, 230.0))]
    assert "| 10 (compiled; 210 after epoch 1) |" in markdown_table([run])  # (400 + 230) / 3 s
    seeds = [run, {**run, "seed": 2, "epochs": [{**r, "words_per_second": 2 * r["words_per_second"]}
                                                for r in run["epochs"]]}]
    assert "| 10 (compiled; 315 after epoch 1) |" in markdown_table(seeds)  # the mean of 210 and 420
    one = {**run, "epochs": run["epochs"][:1]}
    untimed = {**run, "epochs": [{k: v for k, v in r.items() if k != "seconds"} for r in run["epochs"]]}
    for result in (one, untimed):
        assert "| 10 (compiled) |" in markdown_table([result])


def test_a_row_names_every_number_of_monte_carlo_samples_its_seeds_used():
    """A row printed the first run's S for every seed's MC perplexity."""
    runs = [{**_result(2, "tied", seed), "test_ppl_mc": 120.0 + seed, "mc_samples": samples}
            for seed, samples in ((1, 2), (2, 5), (3, 5))]
    assert "| 122.0 ± 1.0 (S=2, 5) |" in markdown_table(runs)
    assert "| 121.0 (S=2) |" in markdown_table(runs[:1])
    assert "| 130.0 ± 0.0 |" in markdown_table(runs)  # each seed's test perplexity, averaged
    spread = [{**r, "test_ppl": 100.0 + 10 * k} for k, r in enumerate(runs)]
    assert "| 110.0 ± 10.0 |" in markdown_table(spread)
    partly = [runs[0], {**runs[1], "test_ppl_mc": None}]  # one seed without an MC test: no mean of one
    assert "| — |" in markdown_table(partly) and "121.0" not in markdown_table(partly)


def test_format_duration():
    assert [format_duration(s) for s in (4.4, 89, 600, 3900)] == ["4 s", "89 s", "10 min", "1 h 05 min"]


def test_job_progress_counts_epochs_of_all_runs_and_drops_what_a_reused_run_saves():
    job = JobProgress(3, 4, bar=False, costs=[RunCost(4, 10.0, 0.0)] * 3)
    assert job.total_epochs() == 12 and job.eta_seconds() == pytest.approx(120.0, abs=0.1)
    job.run_done("run 1/3", _result(4), reused=True)  # finished in an earlier job: nothing to train
    assert job.remaining_epochs() == 8 and job.eta_seconds() == pytest.approx(80.0, abs=0.1)
    job.start_run("run 2/3", first_epoch=3)  # resumed after its second epoch
    assert job.remaining_epochs() == 2 + 4
    job.epoch_done(3, _result(4)["epochs"][2])
    assert job.done_epochs == 1 and job.remaining_epochs() == 1 + 4 and job.eta_seconds() > 0


def test_an_estimate_of_only_what_is_left_is_not_discounted_again():
    job = JobProgress(3, 4, bar=False, costs=[None, RunCost(2, 10.0, 0.0), RunCost(4, 10.0, 0.0)])
    assert job.remaining_epochs() == 2 + 4 and job.eta_seconds() == pytest.approx(60.0, abs=0.1)
    job.run_done("run 1/3", _result(4), reused=True)
    job.start_run("run 2/3", first_epoch=3)
    assert job.remaining_epochs() == 2 + 4 and job.eta_seconds() == pytest.approx(60.0, abs=0.1)


@pytest.mark.slow
def test_a_resumed_job_estimates_only_the_runs_and_epochs_left_to_train(tmp_path, monkeypatch, caplog):
    import logging
    from dataclasses import replace

    from rnndrop.lm.run import job
    from tests.lm_helpers import TINY, write_corpus

    data, config, out = write_corpus(tmp_path / "data"), replace(TINY, mc_samples=0), tmp_path / "job"
    job.run_benchmark(data, "ptb", config, ["naive"], [1], out, progress=False, estimate=False)
    finished = next(out.glob("naive/*-seed1"))
    partial = finished.with_name(finished.name.replace("seed1", "seed2"))  # stopped after epoch 1
    partial.mkdir()
    EpochLog(partial, tensorboard=False)(1, {"epoch": 1, "lr": 8.0, "train_ppl": 9.0, "valid_ppl": 9.0,
                                             "words_per_second": 1.0, "seconds": 1.0})
    (partial / "checkpoint.pt").write_bytes(b"")  # epochs count as done only beside a checkpoint
    counted = []
    monkeypatch.setattr(job, "run_costs", lambda corpus, cfg, runs, mc, **kw: (
        counted.append(kw["epochs_left"]) or [RunCost(n, 10.0, 0.0) for n in kw["epochs_left"]]))
    planned = job._Job(str(data), "ptb", config, out, True, "cpu", 1, False, None)
    plan = job._plan(planned, ["naive"], [1, 2, 3], 0, grid=False, dropout=None, dropout_by_regime=None)
    with caplog.at_level(logging.INFO, logger="rnndrop.lm.run.job"):
        costs = job._estimate(planned, plan)
        assert costs == [None, RunCost(2, 10.0, 0.0), RunCost(3, 10.0, 0.0)]
        progress = JobProgress(3, 3, bar=False, costs=costs)
        assert job._announce(planned, progress, 1) == pytest.approx(50.0, abs=0.1)
        # the line counts what the bar counts: 2 + 3 epochs left, not "2 runs of up to 3 epochs"
        assert "this job trains 2 runs (1 more finished earlier: reused), 5 epochs left in all at most " \
               "(up to 3 a run)" in caplog.text
        assert progress.remaining_epochs() == 5
        assert job._estimate(replace(planned, resume=False), plan) == [RunCost(3, 10.0, 0.0)] * 3
        seed1 = job._plan(planned, ["naive"], [1], 0, grid=False, dropout=None, dropout_by_regime=None)
        assert job._estimate(planned, seed1) is None
        assert "all 1 run of this job finished earlier: reusing their results" in caplog.text
    (partial / "checkpoint.pt").unlink()
    assert job._estimate(planned, plan) == [None, RunCost(3, 10.0, 0.0), RunCost(3, 10.0, 0.0)]
    assert counted == [[2, 3], [3, 3, 3], [3, 3]]


def test_the_estimate_scales_the_timed_steps_to_the_job(tmp_path, monkeypatch):
    from rnndrop.lm.data.corpus import load_corpus
    from rnndrop.lm.run import job
    from tests.lm_helpers import TINY, write_corpus

    corpus = load_corpus(write_corpus(tmp_path))
    timed = []
    monkeypatch.setattr(job, "_seconds_per_word", lambda step, batched: timed.append(step) or 1e-3)
    monkeypatch.setattr(job, "_save_seconds", lambda model, optimizer: 0.5)
    monkeypatch.setattr(job, "RUN_OVERHEAD_SECONDS", 2.0)
    none, tied = ("none", {}), ("tied", TINY.dropout)
    n_train, n_valid, n_test = (corpus.split(s).numel() for s in ("train", "valid", "test"))
    epoch = (n_train + n_valid) * 1e-3 + 0.5  # and the checkpoint writes
    one_run = TINY.epochs * epoch + n_test * 1e-3 + 2.0  # and the run's files and plots
    assert job.estimate_seconds(corpus, TINY, [none], 10) == pytest.approx(one_run)  # nothing to sample
    assert job.run_costs(corpus, TINY, [none], 10) == [RunCost(TINY.epochs, epoch, n_test * 1e-3 + 2.0)]
    # a training step, a validation pass, a test pass (no Monte-Carlo pass: no noise), timed once per regime
    assert len(timed) == 3 + 3
    # one Monte-Carlo pass of min(samples, 8) samples, per sample
    with_mc = one_run + 10 * n_test * 1e-3 / 8
    assert job.estimate_seconds(corpus, TINY, [none, tied, tied], 10) == pytest.approx(
        one_run + 2 * with_mc)
    assert len(timed) == 6 + 3 + 4  # "tied" twice is timed once
    assert job.estimate_seconds(corpus, TINY, [none, tied], 10, jobs=2) == pytest.approx(
        (one_run + with_mc) / 2)


def _run(regime: str, seed: int, test_ppl: float, mc: float | None = None, **extra):
    return {"regime": regime, "seed": seed, "test_ppl": test_ppl, "test_ppl_mc": mc,
            "test_nll": 5.0, "test_nll_mc": None, "test_ece": 0.02, "test_ece_mc": None,
            "best_epoch": 10, "epochs_run": 12, "converged": True, "epochs": [], **extra}


def test_paired_differences_pair_runs_of_the_same_seed():
    runs = [_run("naive", 1, 100.0), _run("naive", 2, 110.0), _run("tied", 2, 104.0),
            _run("tied", 1, 99.0), _run("tied", 3, 50.0)]  # seed 3 has no naive partner
    assert paired_differences(runs, "naive") == {"tied": [-6.0, -1.0]}  # in the order given


def test_comparison_table_shows_signed_paired_deltas_and_flags_unconverged_runs():
    runs = [_run("naive", 1, 100.0, 98.0), _run("naive", 2, 110.0, 108.0),
            _run("tied", 1, 99.0, 99.5), _run("tied", 2, 104.0, 103.0, best_epoch=12, converged=False)]
    table = comparison_table(runs, "naive")
    tied = next(line for line in table.splitlines() if line.startswith("| tied"))
    assert "-3.5 ± 3.5" in tied  # paired: -1 and -6
    assert "-1.8 ± 4.6" in tied  # MC: +1.5 and -5.0
    assert "10/12, 12/12 cap" in tied and "| 0 |" in table  # the baseline's own delta


def test_a_baseline_without_monte_carlo_values_has_no_delta_of_them_either():
    """The "none" baseline draws no noise, so it has no MC perplexity: its Δ MC read 0 beside the
    tied row's "—"; both are "—" now, and its standard Δ stays 0."""
    runs = [_run("none", 1, 100.0), _run("tied", 1, 99.0, 99.5)]
    rows = {line.split(" | ")[0]: line.split(" | ") for line in comparison_table(runs, "none").splitlines()}
    assert rows["| none"][3:6] == ["0", "—", "—"]  # Δ, test ppl MC, Δ MC
    assert rows["| tied"][3:6] == ["-1.0", "99.5", "—"]


def test_the_monte_carlo_passes_show_progress_lines(caplog):
    import logging

    import torch

    from rnndrop.lm.model.language_model import RNNLanguageModel
    from rnndrop.lm.run.evaluate import score_mc

    torch.manual_seed(0)
    model = RNNLanguageModel(30, 8, 8, 1, dropout_output=0.5)
    stream = torch.randint(30, (41, 2))  # 40 predictions per column: 10 segments of 4
    with caplog.at_level(logging.INFO, logger="rnndrop.lm.run.report"):
        quiet = score_mc(model, stream, 4, 3)
        assert not caplog.records
        torch.manual_seed(0)
        shown = score_mc(model, stream, 4, 3, progress="MC test, 3 samples")
    lines = [r.getMessage() for r in caplog.records]
    # what the count counts: the test split's segments, each scored with every sample
    assert lines[0].startswith("MC test, 3 samples: 1/10 segments")
    assert lines[-1].startswith("MC test, 3 samples: 10/10 segments")
    assert len(lines) == 10
    torch.manual_seed(0)
    assert score_mc(model, stream, 4, 3).nll == shown.nll and quiet.tokens == shown.tokens


def test_the_job_says_how_far_off_its_estimate_was(caplog):
    import logging

    from rnndrop.lm.run.job import _report_estimate

    job = JobProgress(2, 3, bar=False, costs=[None, RunCost(3, 200.0, 0.0)])
    with caplog.at_level(logging.INFO, logger="rnndrop.lm.run.job"):
        job.run_done("run 1/2", {"best_valid_ppl": 9.0, "test_ppl": 9.0}, reused=True)
        job.run_done("run 2/2", {"best_valid_ppl": 9.0, "test_ppl": 9.0})
        _report_estimate(600.0, 480.0, job)  # the estimate counted only the run it trained
        assert caplog.records[-1].getMessage() == "the job took 8 min; its estimate was 10 min (25% too high)"
        reused = JobProgress(1, 3, bar=False)
        reused.run_done("run 1/1", {"best_valid_ppl": 9.0, "test_ppl": 9.0}, reused=True)
        caplog.clear()
        _report_estimate(600.0, 1.0, reused)  # nothing trained: no comparison
    assert not [r for r in caplog.records if r.name.endswith("benchmark")]


def test_the_public_evaluate_and_evaluate_mc_score_a_stream():
    """rnndrop.lm's evaluate / evaluate_mc: with dropout the Monte-Carlo perplexity is another
    number than the eval-mode one, reproducible from the seed; without, it is refused (all samples
    would be the eval prediction)."""
    import torch

    from rnndrop.lm import RNNLanguageModel, evaluate, evaluate_mc

    torch.manual_seed(0)
    stream = torch.randint(30, (41, 2))
    plain = RNNLanguageModel(30, 8, 8, 1)
    with pytest.raises(ValueError, match="no stochastic module"):
        evaluate_mc(plain, stream, 4, 2)
    noisy = RNNLanguageModel(30, 8, 8, 1, dropout_hidden=0.5, dropout_output=0.5)
    torch.manual_seed(1)
    first = evaluate_mc(noisy, stream, 4, 3)
    torch.manual_seed(1)
    assert evaluate_mc(noisy, stream, 4, 3) == first != evaluate(noisy, stream, 4)
    assert 1 < first < float("inf")
