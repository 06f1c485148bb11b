"""User errors the language-model command and the MC helpers report in one line that names the
problem (issue 44, "Tracebacks and messages that hide the problem")."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from rnndrop.lm.data.corpus import CorpusError, find_split_files
from rnndrop.lm.model.build import build_model, trainable_parameters
from rnndrop.lm.model.regimes import get_regime
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.mc import mc_predict
from tests.lm_helpers import TINY, run_cli

ROOT = Path(__file__).resolve().parent.parent


def _one_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("command", [["evaluate", "nowhere"], ["ptb", "--data", "sample", "--help"]])
def test_a_malformed_cuda_graphs_variable_is_one_line_not_a_traceback(tmp_path, command):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RNNDROP_CUDA_GRAPHS": "abc"}
    importing = subprocess.run([sys.executable, "-c", "import rnndrop, rnndrop.lm"], env=env,
                               capture_output=True, text=True, timeout=120)
    assert importing.returncode == 0, importing.stderr  # the library imports; it reads it at first use
    if "--help" in command:
        return
    done = subprocess.run([sys.executable, "-m", "rnndrop.lm", *command], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    line = _one_line(done.stderr)
    assert done.returncode == 2
    assert "RNNDROP_CUDA_GRAPHS" in line and "whole number" in line and "'abc'" in line


def test_an_overflowing_learning_rate_is_refused_up_front(tmp_path, capsys):
    code = run_cli(["ptb", "--data", "sample", "--regimes", "none", "--epochs", "1", "--lr", "1e308",
                    "--out", str(tmp_path / "out"), "--no-progress"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "lr must be at most" in line and "1e+308" in line
    with pytest.raises(ValueError, match="lr must be at most"):
        replace(TINY, lr=1e39)
    assert replace(TINY, lr=1e30).lr == 1e30


def test_the_meta_device_is_refused_in_one_line(tmp_path, capsys):
    code = run_cli(["ptb", "--data", "sample", "--regimes", "none", "--epochs", "1", "--device", "meta",
                    "--out", str(tmp_path / "out"), "--no-progress"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "--device" in line and "'meta'" in line


def test_carve_names_the_file_and_offset_of_a_latin1_byte(tmp_path, capsys):
    official = tmp_path / "official"
    official.mkdir()
    lines = [f"line {i} of the file\n" for i in range(3370)]
    lines[5] = "caf\xe9 au lait\n"
    (official / "ptb.valid.txt").write_bytes("".join(lines).encode("latin-1"))
    code = run_cli(["carve", "ptb-mini", "--from", str(official), "--out", str(tmp_path / "out")])
    line = _one_line(capsys.readouterr().err)
    offset = "".join(lines[:5]).__len__() + 3
    assert code == 2
    assert "ptb.valid.txt" in line and "not UTF-8" in line and f"offset {offset}" in line and "0xe9" in line
    assert not (tmp_path / "out").exists()


def test_freezing_every_parameter_names_freeze():
    config = replace(TINY, freeze=("embedding.", "rnn.", "decoder."))
    model = build_model(20, config, get_regime("tied"), config.dropout)
    with pytest.raises(ValueError, match=r"freeze \(--freeze\) .* names every parameter"):
        trainable_parameters(model, config)


def test_freezing_every_parameter_on_the_command_line(tmp_path, capsys):
    code = run_cli(["ptb", "--data", "sample", "--regimes", "none", "--epochs", "1", "--freeze",
                    "embedding.,rnn.,decoder.", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert "Traceback" not in err and code == 2
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "--freeze" in errors[0] and "names every parameter" in errors[0]


def test_a_split_file_linked_to_itself_is_a_symlink_loop(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for split in ("valid", "test"):
        (folder / f"ptb.{split}.txt").write_text("a b c\n")
    (folder / "ptb.train.txt").symlink_to("ptb.train.txt")
    with pytest.raises(CorpusError, match="ptb.train.txt.* is a symbolic link loop"):
        find_split_files(folder)
    (folder / "ptb.train.txt").unlink()
    (folder / "ptb.train.txt").symlink_to("gone.txt")
    with pytest.raises(CorpusError, match="symbolic link to 'gone.txt', which does not exist"):
        find_split_files(folder)


class _Classes(nn.Module):
    """Predicts classes (an integer tensor), not logits."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(x).argmax(-1)


@pytest.mark.parametrize("bad", [1.0, "0", True])
def test_mc_predict_names_a_batch_dim_that_is_not_an_int(bad):
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(3, 2))
    with pytest.raises(TypeError, match="batch_dim must be an int"):
        mc_predict(model, torch.randn(4, 3), 2, batch_dim=bad)
    with pytest.raises(TypeError, match="output_batch_dim must be an int"):
        mc_predict(model, torch.randn(4, 3), 2, output_batch_dim=bad)


def test_mc_predict_names_an_integer_output():
    for task in ("classification", "regression"):
        with pytest.raises(TypeError, match=r"model's output is a torch.int64 tensor.*floating point"):
            mc_predict(_Classes(), torch.randn(4, 3), 2, task=task)


def test_the_train_config_lr_bound_is_float32s():
    from rnndrop.lm.model import train_config

    assert torch.finfo(torch.float32).max == train_config._FLOAT32_MAX
    assert TrainConfig.from_dict(replace(TINY, lr=1e38).to_dict()).lr == 1e38
