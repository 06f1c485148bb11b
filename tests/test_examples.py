"""The examples: --help works without their extras, a data error is one line (exit 2)."""

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, argv: list[str], monkeypatch) -> int:
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    return exit_info.value.code


@pytest.mark.parametrize("script", ["mc_forecast.py", "mc_language_model.py"])
def test_help_works_without_the_extras(script, monkeypatch, capsys):
    for extra in ("statsmodels", "statsmodels.api", "pandas", "matplotlib", "matplotlib.pyplot"):
        monkeypatch.setitem(sys.modules, extra, None)  # as if not installed
    assert _run(script, ["--help"], monkeypatch) == 0
    assert "--out" in capsys.readouterr().out


def test_forecast_without_statsmodels_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "statsmodels", None)
    monkeypatch.setitem(sys.modules, "statsmodels.api", None)
    assert _run("mc_forecast.py", ["--out", str(tmp_path)], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "statsmodels" in err and ".[examples]" in err


def test_language_model_example_data_error_is_one_line(monkeypatch, capsys, tmp_path):
    assert _run("mc_language_model.py", ["--data", str(tmp_path / "missing"), "--out", str(tmp_path)],
                monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: data directory") and "does not exist" in err


def test_language_model_example_defaults_to_the_bundled_sample(monkeypatch, capsys):
    _run("mc_language_model.py", ["--help"], monkeypatch)
    assert "../shared" not in capsys.readouterr().out
    assert "shared" not in (EXAMPLES / "mc_language_model.py").read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (["--samples", "0"], "--samples must be a positive integer, got 0"),
    (["--layers", "0"], "--layers must be a positive integer, got 0"),
    (["--threads", "0"], "--threads must be a positive integer, got 0"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
])
def test_language_model_example_numbers_are_checked_in_one_line(monkeypatch, capsys, tmp_path, argv, message):
    """They were tracebacks from the library (n_samples, num_layers, set_num_threads)."""
    assert _run("mc_language_model.py", [*argv, "--out", str(tmp_path)], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize(("script", "argv", "message"), [
    ("mc_language_model.py", ["--batch-size", "100000"], "too short for --batch-size=100000"),
    ("mc_language_model.py", ["--out", "{a_file}"], "--out '{a_file}': it is a file, expected a folder"),
    ("mc_forecast.py", ["--samples", "0"], "--samples must be a positive integer, got 0"),
    ("mc_forecast.py", ["--horizon", "-5"], "--horizon must be a positive integer, got -5"),
    ("mc_forecast.py", ["--p-hidden", "1.5"], "--p-hidden must be a probability in [0, 1), got 1.5"),
    ("mc_forecast.py", ["--out", "{a_file}"], "--out '{a_file}': it is a file, expected a folder"),
])
def test_the_examples_check_their_numbers_and_output_in_one_line(monkeypatch, capsys, tmp_path, script, argv,
                                                                  message):
    """Tracebacks from the library (batchify, mc_predict, torch.cat), or after the training."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    argv = [a.format(a_file=a_file) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    assert _run(script, [*argv, *out], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(a_file=a_file) in err, err

