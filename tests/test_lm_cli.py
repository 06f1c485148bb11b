"""The ``rnndrop-lm`` command: entry points, the offline sample, flags, errors, Ctrl-C."""

import contextlib
import csv
import json
import math
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rnndrop.kernels.compiled_cache import extensions_root
from rnndrop.lm import cli
from rnndrop.lm.data.corpus import batchify, load_corpus, sample_dir
from rnndrop.lm.run import job
from rnndrop.lm.run.checkpoint import load_model
from rnndrop.lm.run.evaluate import score
from tests.lm_helpers import ctrl_c_reaches, run_cli, write_corpus

ROOT = Path(__file__).resolve().parent.parent


def _env(tmp_path: Path) -> dict[str, str]:
    """An empty HOME, no cache, and every network route pointing nowhere; the compiled kernel's
    build is the test process's (not compiled again under the empty HOME)."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNDROP_")}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), RNNDROP_DATA_MIRROR="http://127.0.0.1:9/",
               http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9",
               HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(extensions_root()))
    return env


def _rnndrop_lm(args, tmp_path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rnndrop.lm", *args], env=_env(tmp_path), cwd=tmp_path,
                          capture_output=True, text=True, preexec_fn=lambda: os.umask(0o022), **kwargs)


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_console_script_and_module_entry_point_offer_data_and_resume(tmp_path, capsys):
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '[project.scripts]\nrnndrop-lm = "rnndrop.lm.cli:main"' in pyproject and callable(cli.main)
    top = _help(["--help"], capsys)
    assert "ptb" in top and "wikitext2" in top and "--data sample" in top and "--resume" in top
    for corpus in ("ptb", "wikitext2"):
        sub = _help([corpus, "--help"], capsys)
        assert "--data" in sub and "--resume" in sub
    module = _rnndrop_lm(["ptb", "--help"], tmp_path)
    assert module.returncode == 0 and module.stdout == _help(["ptb", "--help"], capsys)
    for corpus in ("ptb", "wikitext2"):  # the scripts the docs cite are the same command
        script = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{corpus}.py"), "--help"],
                                env=_env(tmp_path), capture_output=True, text=True)
        assert script.returncode == 0 and script.stdout == _help([corpus, "--help"], capsys)
    assert not hasattr(job, "main")  # one entry point: the job module is no command of its own


@pytest.mark.slow
def test_sample_run_offline_with_an_empty_home_then_evaluate_and_generate(tmp_path, capsys):
    out = tmp_path / "out"
    done = _rnndrop_lm(["ptb", "--data", "sample", "--epochs", "1", "--regimes", "none", "--mc-samples", "0",
                        "--out", str(out), "--no-progress"], tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "should take about" in done.stderr  # the estimate comes first
    assert re.search(r"^none\s+—\s+1\s+1\s", done.stdout, re.M)  # the table, aligned for a terminal
    assert "| none | — | 1 | 1 |" in (out / "results.md").read_text()  # the Markdown, in the file
    assert done.stdout.rstrip().endswith(f"Learning curves: {out / 'learning_curves.png'}")
    assert not (tmp_path / "home" / ".cache" / "rnndrop").exists()  # nothing was downloaded or cached
    run = next((out / "none").iterdir())
    for path in [*out.iterdir(), *run.iterdir()]:
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path  # the umask, not 0600
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [r["epoch"] for r in rows] == ["1"] and float(rows[0]["words_per_second"]) > 0
    reported = json.loads((run / "results.json").read_text())

    # The saved run loads with load_model and scores the test perplexity it reported.
    loaded = load_model(run)
    corpus = load_corpus(sample_dir("ptb"))
    assert loaded.vocab.itos == corpus.vocab.itos
    torch.set_num_threads(1)
    test = batchify(corpus.test, loaded.config.eval_batch_size)
    assert math.isclose(score(loaded.model, test, loaded.config.bptt).perplexity, reported["test_ppl"],
                        rel_tol=1e-6)
    assert cli.main(["evaluate", str(run)]) == 0
    assert f"perplexity      {reported['test_ppl']:.2f}" in capsys.readouterr().out
    # A shell pattern naming several runs (seeds, a grid): each scored in turn (was "unrecognized arguments").
    assert cli.main(["evaluate", str(run), str(run / "best.pt")]) == 0
    assert capsys.readouterr().out.count(f"perplexity      {reported['test_ppl']:.2f}") == 2
    assert cli.main(["generate", str(run), "--words", "12", "--prompt", "the company"]) == 0
    words = capsys.readouterr().out.split()
    assert words[:2] == ["the", "company"] and 2 < len(words) <= 14
    assert set(words) <= set(corpus.vocab.itos)
    # Two prompts, one seed: drawn apart (the same random numbers gave them the same words).
    continuations = []
    for prompt in ("the company", "stock prices fell"):
        assert cli.main(["generate", str(run), "--words", "12", "--prompt", prompt]) == 0
        continuations.append(capsys.readouterr().out.split()[len(prompt.split()):])
    assert continuations[0] != continuations[1]

    # The same command again: a refusal naming --resume; with --resume the finished run is reused.
    again = ["ptb", "--data", "sample", "--epochs", "1", "--regimes", "none", "--mc-samples", "0",
             "--out", str(out), "--no-progress"]
    assert cli.main(again) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "add --resume" in err


def _job_args(data: Path, out: Path) -> list[str]:
    return ["ptb", "--data", str(data), "--regimes", "tied", "--epochs", "4", "--mc-samples", "0",
            "--hidden-size", "16", "--emb-size", "16", "--layers", "1", "--batch-size", "8", "--bptt", "10",
            "--lr", "1", "--out", str(out), "--no-progress"]


def _result(out: Path) -> dict:
    run = next((out / "tied").iterdir())
    return json.loads((run / "results.json").read_text())




@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line_and_resume_reproduces_the_uninterrupted_run(tmp_path):
    data = write_corpus(tmp_path / "data", sizes=(3000, 100, 100))
    assert run_cli(_job_args(data, tmp_path / "whole")) == 0

    out = tmp_path / "cut"
    process = subprocess.Popen([sys.executable, "-m", "rnndrop.lm", *_job_args(data, out)],
                               env=_env(tmp_path), cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        metrics = list(out.glob("tied/*/metrics.csv"))
        if metrics and len(metrics[0].read_text().splitlines()) >= 2:  # header + epoch 1
            break
        time.sleep(0.005)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: interrupted in epoch ") and "--resume" in last
    assert not list(out.glob("tied/*/results.json"))  # it was stopped before the end

    assert run_cli([*_job_args(data, out), "--resume"]) == 0
    a, b = _result(tmp_path / "whole"), _result(out)

    def timeless(epochs):
        return [{k: v for k, v in e.items() if "second" not in k} for e in epochs]

    assert timeless(a["epochs"]) == timeless(b["epochs"]) and len(a["epochs"]) == 4
    assert a["test_ppl"] == b["test_ppl"] and a["best_valid_ppl"] == b["best_valid_ppl"]
    rows = list(csv.DictReader(next(out.glob("tied/*/metrics.csv")).open()))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _job_with_two_workers(tmp_path: Path) -> tuple[subprocess.Popen, set[int], Path]:
    """A job of two runs in two worker processes, started and waited for until both train
    and one has saved an epoch: (the main process, the workers' pids from their run.lock, out)."""
    data = write_corpus(tmp_path / "data", sizes=(3000, 100, 100))
    out = tmp_path / "out"
    args = [*_job_args(data, out), "--regimes", "none,tied", "--jobs", "2", "--epochs", "40"]
    process = subprocess.Popen([sys.executable, "-m", "rnndrop.lm", *args], env=_env(tmp_path),
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=ctrl_c_reaches)
    workers: set[int] = set()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        for lock in out.glob("*/*/run.lock"):
            with contextlib.suppress(OSError, ValueError, KeyError):  # being written
                workers.add(json.loads(lock.read_text())["pid"])
        if len(workers) == 2 and list(out.glob("*/*/checkpoint.pt")):
            break
        time.sleep(0.01)
    assert len(workers) == 2 and process.pid not in workers
    return process, workers, out


def _all_end(pids: set[int]) -> bool:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(map(_alive, pids)):
        time.sleep(0.1)
    return not any(map(_alive, pids))


@pytest.mark.slow
def test_sigterm_stops_a_job_with_workers_as_ctrl_c_does(tmp_path):
    """SIGTERM to the main process of --jobs 2: one line, exit 130, workers gone, epochs kept
    (before: the main process died at once and its workers hung forever)."""
    process, workers, out = _job_with_two_workers(tmp_path)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith("error: interrupted")
    assert _all_end(workers)
    assert list(out.glob("*/*/checkpoint.pt"))  # what finished is kept


@pytest.mark.slow
def test_ctrl_c_under_jobs_leaves_no_lock_behind(tmp_path):
    """The workers that Ctrl-C stops release their run folders (before: run.lock files were
    left, and the next run reported them as stale)."""
    process, workers, out = _job_with_two_workers(tmp_path)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert _all_end(workers)
    assert not list(out.glob("*/*/run.lock")) and list(out.glob("*/*/checkpoint.pt"))


@pytest.mark.slow
def test_workers_end_when_their_main_process_is_killed(tmp_path):
    """After kill -9 of the main process of --jobs 2 the workers unwind their runs (no lock
    left) and end, rather than wait for work forever."""
    process, workers, out = _job_with_two_workers(tmp_path)
    process.kill()
    process.communicate(timeout=120)
    assert _all_end(workers)
    assert not list(out.glob("*/*/run.lock")) and list(out.glob("*/*/checkpoint.pt"))


@pytest.mark.slow
def test_a_worker_that_dies_is_one_line_and_the_other_stops(tmp_path):
    process, workers, _ = _job_with_two_workers(tmp_path)
    os.kill(min(workers), signal.SIGKILL)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: a worker process died while it ran ") and "--resume" in last
    assert _all_end(workers)


@pytest.mark.slow
def test_flags_override_the_config_and_are_recorded(tmp_path, capsys):
    data = write_corpus(tmp_path / "data")
    out = tmp_path / "out"
    code = run_cli(["ptb", "--data", str(data), "--regimes", "none", "--mc-samples", "0",
                         "--epochs", "2", "--lr", "0.01", "--hidden-size", "12", "--emb-size", "10",
                         "--layers", "1", "--batch-size", "4", "--bptt", "6", "--clip", "0.5",
                         "--optimizer", "adam",
                         "--model", "gru", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    config = json.loads(next(out.glob("none/*/results.json")).read_text())["config"]
    assert {k: config[k] for k in ("lr", "hidden_size", "embedding_size", "num_layers", "batch_size", "bptt",
                                   "clip", "optimizer", "cell", "epochs")} == {
        "lr": 0.01, "hidden_size": 12, "embedding_size": 10, "num_layers": 1, "batch_size": 4, "bptt": 6,
        "clip": 0.5, "optimizer": "adam", "cell": "gru", "epochs": 2}
    assert config["min_lr"] == pytest.approx(0.1 * 0.01 / 20)  # mini's floor, scaled with --lr
    model = load_model(next(out.glob("none/*"))).model
    assert isinstance(model.rnn, torch.nn.GRU)


def test_a_valid_split_too_short_for_the_evaluation_batch_is_named_in_one_line(tmp_path, capsys):
    """Was: "a split of 18 words is too short for batch_size=10" (the job's cost estimate), which
    named neither the split nor the setting, and pointed at --batch-size, which cannot fix it."""
    data = write_corpus(tmp_path / "data", sizes=(160, 30, 30))
    (data / "ptb.valid.txt").write_text("the cat sat on a mat dog ran to house big small red blue green\n")
    code = run_cli(["ptb", "--data", str(data), "--regimes", "tied", "--epochs", "1", "--emb-size", "8",
                    "--hidden-size", "8", "--batch-size", "4", "--bptt", "10", "--mc-samples", "0",
                    "--no-progress", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert ("the valid split of 16 words is too short for eval_batch_size=10 (the config's evaluation batch, "
            "not --batch-size): 10 columns of at least 2 words need 20") in err


@pytest.mark.slow
def test_compile_trains_under_torch_compile_records_it_and_resumes(tmp_path, capsys):
    """``--compile``: the runs train under ``rnndrop.compile_model`` (a variable BPTT length and
    the last, shorter segment: one graph for them), the result says so, and a second epoch
    resumes from the first's checkpoint."""
    data = write_corpus(tmp_path / "data")
    out = tmp_path / "out"
    common = ["ptb", "--data", str(data), "--regimes", "tied", "--mc-samples", "0", "--hidden-size", "12",
              "--emb-size", "12", "--layers", "2", "--batch-size", "4", "--bptt", "6", "--compile",
              "--out", str(out), "--no-progress"]
    assert run_cli([*common, "--epochs", "1"]) == 0, capsys.readouterr().err
    assert run_cli([*common, "--epochs", "2", "--resume"]) == 0, capsys.readouterr().err
    result = json.loads(next(out.glob("tied/*/results.json")).read_text())
    assert result["compiled"] is True and [e["epoch"] for e in result["epochs"]] == [1, 2]
    assert all(math.isfinite(e["valid_ppl"]) for e in result["epochs"])


def test_compile_is_left_to_the_run_unless_asked_either_way():
    """``--compile`` / ``--no-compile`` ask for one mode; neither leaves it to the run (None:
    compiled where it is faster, :func:`rnndrop.compiling.speeds_up_under_compile`)."""
    from rnndrop.lm.cli.parser import corpus_parser

    parse = corpus_parser("ptb").parse_args
    assert parse([]).compile is None
    assert parse(["--compile"]).compile is True and parse(["--no-compile"]).compile is False


def _write_non_utf8(folder: Path) -> Path:
    write_corpus(folder)
    (folder / "ptb.valid.txt").write_bytes(b"the cat\nthe caf\xe9 sees\n")
    return folder


def _awkward_files(folder: Path) -> dict[str, Path]:
    """Awkward inputs a user may pass: a JSON list as --dropout-from, a grid summary that chose
    for regime none only, a symbolic link to nowhere as --out, another corpus' job as --out, a
    folder of the user's own notes as --out."""
    (folder / "list.json").write_text("[1, 2]")
    (folder / "grid.json").write_text(json.dumps({"grid": True, "runs": [{"regime": "none", "dropout": {}}]}))
    (folder / "dangling").symlink_to(folder / "nowhere")
    (folder / "wikitext-job").mkdir()
    (folder / "wikitext-job" / "summary.json").write_text(json.dumps({"dataset": "wikitext-2", "runs": []}))
    (folder / "notes").mkdir()
    for name in ("results.md", "summary.json"):
        (folder / "notes" / name).write_text("my own notes\n")
    return {"a_list": folder / "list.json", "grid_of_none": folder / "grid.json",
            "dangling": folder / "dangling", "wikitext_job": folder / "wikitext-job",
            "notes": folder / "notes"}


@pytest.mark.parametrize(("config", "given", "expected"), [
    ("awd", "hidden=0.3", {"embedding": 0.1, "input": 0.3, "between": 0.25, "hidden": 0.3, "output": 0.3}),
    ("mini", "hidden=0.3,input=0", {"embedding": 0.1, "input": 0.0, "between": 0.5, "hidden": 0.3,
                                    "output": 0.5}),
    ("zaremba-small", "hidden=0.3", {"hidden": 0.3}),  # no dropout in the config: only what is named
])
def test_dropout_sets_the_sites_it_names_and_keeps_the_configs_others(tmp_path, config, given, expected):
    """``--dropout hidden=P`` (the AWD table's flag for the recurrent rate) keeps the config's
    embedding, input, between and output dropout; it set them to 0."""
    from rnndrop.lm.cli.checks import checked_job
    from rnndrop.lm.cli.parser import corpus_parser

    data = write_corpus(tmp_path / "data")
    args = corpus_parser("ptb").parse_args(["--data", str(data), "--config", config, "--dropout", given,
                                            "--out", str(tmp_path / "out")])
    dropout = checked_job(args, "ptb")[3]
    assert {site: p for site, p in dropout.items() if p or site in given} == expected


def _grid_summary(path: Path, **fields) -> Path:
    path.write_text(json.dumps({"grid": True, "dataset": "ptb", "runs": [{"regime": "tied", "dropout": {}}],
                                **fields}))
    return path


def test_dropout_tuned_on_text_of_the_test_split_is_refused_unless_allowed(tmp_path, capsys, caplog):
    """ptb-mini's validation lines are a fifth of ptb-144k's test split (both are cut from PTB's
    validation file): a grid's choice carried over with --dropout-from tuned on test text."""
    from rnndrop.lm.cli.checks import checked_job
    from rnndrop.lm.cli.parser import corpus_parser
    from rnndrop.lm.data.overlap import shared_lines, split_fingerprints

    data = write_corpus(tmp_path / "data")
    tuned = write_corpus(tmp_path / "tuned", sizes=(40, 30, 30))
    (tuned / "ptb.valid.txt").write_text((data / "ptb.test.txt").read_text())  # its test text
    shared = len(split_fingerprints(data, "test"))
    recorded = _grid_summary(tmp_path / "recorded.json", tuned_on={
        "data": str(tuned), "valid_lines": sorted(split_fingerprints(tuned, "valid"))})
    older = _grid_summary(tmp_path / "older.json", command=f"rnndrop-lm ptb --data {tuned} --grid")
    for summary in (recorded, older):  # fingerprints recorded, or read from the folder its command names
        argv = ["ptb", "--data", str(data), "--regimes", "tied", "--dropout-from", str(summary),
                "--out", str(tmp_path / "out"), "--no-progress"]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        expected = f"whose lines are in the test split of {str(data)!r} ({shared} of its "
        assert err.count("\n") == 1 and expected in err, err
        assert "--allow-tuning-overlap" in err and not (tmp_path / "out" / "tied").exists()
        args = corpus_parser("ptb").parse_args([*argv[1:], "--allow-tuning-overlap"])
        assert checked_job(args, "ptb")[4] == {"tied": {}}  # allowed: checked, with a warning
        assert "is not of text nobody tuned on" in caplog.text
    # its own validation split: some sentences of the small grammar recur in the test split, most do not
    apart = _grid_summary(tmp_path / "apart.json", command=f"rnndrop-lm ptb --data {data} --grid")
    assert shared_lines(split_fingerprints(data, "valid"), split_fingerprints(data, "test")) > 0
    args = corpus_parser("ptb").parse_args(["--data", str(data), "--regimes", "tied", "--dropout-from",
                                            str(apart), "--out", str(tmp_path / "out2")])
    assert checked_job(args, "ptb")[4] == {"tied": {}}


@pytest.mark.parametrize(("args", "message"), [
    (["--allow-tuning-overlap"], "--allow-tuning-overlap goes with --dropout-from"),
    (["--regimes", ""], "--regimes must name at least one regime"),
    (["--regimes", "none,nonsense"], "regime must be one of"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--jobs", "0"], "--jobs must be >= 1, got 0"),
    (["--lr", "1", "--min-lr", "2"], "min_lr must be a number in [0, lr = 1.0), got 2.0"),
    (["--seeds", "one"], "--seeds takes comma-separated integers"),
    (["--mc-samples", "-1"], "--mc-samples must be >= 0"),
    (["--hidden-size", "0"], "hidden_size must be a positive int, got 0"),
    (["--dropout", "hidden=2"], "dropout"),
    (["--data", "{missing}"], "does not exist"),
    (["--init-from", "{missing}"], "--init-from: expected a finished run's folder (holding best.pt)"),
    (["--kl-weight", "-1"], "kl_weight must be a finite number >= 0, got -1.0"),
    (["--data", "{latin1}"], "ptb.valid.txt' is not UTF-8 text: byte 0xe9 on line 2"),
    # a repeated seed or regime is refused before anything trains (not a failure on its folder)
    (["--seeds", "1,2,1", "--epochs", "1"], "--seeds names 1 more than once, got '1,2,1'"),
    (["--regimes", "tied,none,tied", "--epochs", "1"], "--regimes names tied more than once"),
    (["--seeds", str(2**70)], "--seeds must be seeds in ["),  # was torch's "Overflow when unpacking"
    (["--seeds", "1,4294967297"], "a wider one repeats another seed's run), got 4294967297"),  # seed 1's run
    (["--seeds", "-1"], "--seeds must be seeds in [0, 4294967295]"),
    (["--dropout", "input=abc"], "--dropout takes site=p pairs with p a number, got 'input=abc'"),
    (["--dropout", "input=0.5,input=0.3"], "--dropout names site 'input' more than once"),
    (["--dropout-from", "{a_list}"], "it is not the summary of a --grid run"),  # was a traceback
    (["--dropout-from", "{grid_of_none}", "--regimes", "none,tied"], "holds no choice for regime(s) tied"),
    (["--device", "tpu"], "--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'"),
    (["--out", "{dangling}"], "is a symbolic link to"),
    # its report would have mixed the two corpora's runs under one title
    (["--out", "{wikitext_job}", "--resume"], "holds a wikitext-2 job (its summary.json); a ptb job writes"),
    (["--threads", "100000"], "--threads must be <= 1024, got 100000"),  # OpenMP crashed the process
    # trained naive dropout without the recurrent site asked for, saying nothing
    (["--regimes", "naive", "--dropout", "hidden=0.3"], "--dropout names hidden, where none of the"),
    (["--regimes", "foo"], "--regimes: regime must be one of none, naive"),
    (["--out", ""], "--out must name a folder, got ''"),  # trained into the default folder
    (["--dropout", "input=2"], "--dropout input: expected a probability in [0, 1), got 2"),
    # a folder of the user's own (or a report whose runs are gone) was written over
    (["--out", "{notes}"], "already holds results.md, summary.json, which the job would write over"),
])
def test_usage_and_data_errors_are_one_line_with_exit_2(tmp_path, capsys, args, message):
    data = write_corpus(tmp_path / "data")
    files = _awkward_files(tmp_path)
    args = [a.format(missing=tmp_path / "missing", latin1=_write_non_utf8(tmp_path / "latin1"), **files)
            for a in args]
    argv = ["ptb", "--data", str(data), "--out", str(tmp_path / "out"), "--no-progress", *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


@pytest.mark.parametrize(("argv", "message"), [
    (["ptb", "--hidden-size", str(2**70)], "--hidden-size: expected an integer of at most 2147483647"),
    (["ptb", "--mc-samples", str(10**20)], "argument --mc-samples: expected an integer of at most"),
    (["ptb", "--epochs", "abc"], "argument --epochs: expected an integer, got 'abc'"),
    (["generate", "run", "--threads", str(10**11)], "argument --threads: expected an integer of at most"),
])
def test_an_integer_flag_beyond_what_torch_takes_is_named_by_argparse(capsys, argv, message):
    """Sizes and counts past 64 bits overflowed in torch: a traceback, or an error naming no flag."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried "
                 "to allocate 160000000000 bytes"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB"),
    MemoryError(),
])
def test_a_model_too_large_for_memory_is_one_line_not_a_traceback(monkeypatch, capsys, error):
    def too_large(*args):
        raise error

    monkeypatch.setattr(cli, "train", too_large)
    assert cli.main(["ptb", "--data", "sample"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of memory") and "--hidden-size" in err
    monkeypatch.setattr(cli, "train", lambda *args: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # any other error is not dressed up as memory
        cli.main(["ptb", "--data", "sample"])


def test_a_failed_download_names_the_sample_and_a_folder(tmp_path, capsys):
    argv = ["ptb", "--cache-dir", str(tmp_path / "cache"), "--mirror", "http://127.0.0.1:9/",
            "--source", "url", "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--data sample" in err and "--data DIR" in err


def test_evaluate_and_generate_errors_are_one_line(tmp_path, capsys):
    assert cli.main(["evaluate", str(tmp_path / "nothing")]) == 2
    assert cli.main(["generate", str(tmp_path / "nothing"), "--words", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "nothing" in err and "--words must be >= 0" in err
    text = tmp_path / "ptb.train.txt"  # the error names no training flag (such as --resume)
    text.write_text("the cat sees the dog .\n")
    assert cli.main(["evaluate", str(text)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not an rnndrop checkpoint" in err and "resume" not in err, err
    for command in ("evaluate", "generate"):  # one line, not torch's overflow as a traceback
        assert cli.main([command, str(tmp_path / "nothing"), "--seed", str(2**70)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--seed must be seeds in [" in err, err


def test_a_malformed_world_size_is_one_line(tmp_path, capsys, monkeypatch):
    """WORLD_SIZE=abc is one line, not a traceback from the SIGTERM handler's set-up."""
    monkeypatch.setenv("WORLD_SIZE", "abc")
    argv = ["ptb", "--data", str(write_corpus(tmp_path / "data")), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "WORLD_SIZE must be an integer" in err, err


@pytest.mark.slow
def test_parallel_runs_print_one_whole_line_per_event(tmp_path, capfd, caplog):
    caplog.set_level("INFO")
    data = write_corpus(tmp_path / "data")
    argv = ["ptb", "--data", str(data), "--regimes", "none,naive", "--epochs", "2", "--hidden-size", "8",
            "--emb-size", "8", "--layers", "1", "--batch-size", "4", "--bptt", "6", "--mc-samples", "0",
            "--jobs", "2", "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    err = capfd.readouterr().err
    assert "\r" not in err and "it/s" not in err  # no progress bars
    epoch_lines = [line for line in err.splitlines() if "] " in line and " epoch " in line]
    assert len(epoch_lines) == 4
    for regime, label in (("none", "run 1/2 none"), ("naive", "run 2/2 naive")):
        mine = [line for line in epoch_lines if label in line]
        assert [f"{regime} epoch {e}:" in line for e, line in enumerate(mine, 1)] == [True, True]
    assert caplog.text.count("finished: best valid ppl") == 2  # the main process's lines
    # the main process hears every epoch of the workers and says how far the job is
    assert caplog.text.count("/2 done (valid ppl") == 4 and "job ETA" in caplog.text


@pytest.mark.slow
def test_a_diverging_run_exits_3_with_one_line(tmp_path, capsys):
    data = write_corpus(tmp_path / "data")
    argv = ["ptb", "--data", str(data), "--regimes", "none", "--epochs", "2", "--hidden-size", "8",
            "--emb-size", "8", "--layers", "1", "--batch-size", "4", "--bptt", "6", "--mc-samples", "0",
            "--lr", "1e30", "--clip", "1e30", "--out", str(tmp_path / "out"), "--no-progress"]
    assert run_cli(argv) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: training stopped: ") and "epoch 1" in err
