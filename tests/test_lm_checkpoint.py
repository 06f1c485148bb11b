"""Checkpoints that prove they are intact, run identity, locks, interrupts, load_model: a
corrupted checkpoint is refused, a huge loss is a divergence, one writer per run folder, resume
checks what makes the run the same run, and nothing a killed write left behind survives."""

import json
import math
import os
import stat
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from rnndrop.lm.data.corpus import load_corpus
from rnndrop.lm.run.checkpoint import CheckpointError, load_checkpoint, load_model, save_checkpoint
from rnndrop.lm.run.train import train_run
from tests.lm_helpers import TINY, ctrl_c_reaches, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

ONE = replace(TINY, epochs=1, mc_samples=0)




@pytest.mark.slow
def test_load_model_rebuilds_the_best_model_with_its_vocabulary(corpus, tmp_path):
    result = train_run(corpus, ONE, "tied", tmp_path / "run", seed=4, progress=False)
    run = load_model(tmp_path / "run")
    assert not run.model.training and run.regime == "tied" and run.config == ONE
    assert run.vocab.itos == corpus.vocab.itos and run.dropout == result["dropout"]
    assert run.epoch == result["best_epoch"] and run.path == tmp_path / "run" / "best.pt"
    with pytest.raises(AttributeError):
        run.epoch = 3  # frozen
    # The rebuilt model scores the test split exactly as the run did.
    from rnndrop.lm.data.corpus import batchify
    from rnndrop.lm.run.evaluate import score

    test = score(run.model, batchify(corpus.test, ONE.eval_batch_size), ONE.bptt)
    assert test.nll == pytest.approx(result["test_nll"], rel=1e-6)
    assert load_model(tmp_path / "run" / "best.pt").vocab.itos == corpus.vocab.itos


def test_the_test_split_is_scored_with_the_best_epochs_weights_not_the_last(corpus, tmp_path, monkeypatch):
    """The reported test perplexity is the best epoch's (``best.pt``): the model's weights at the
    end of training (here disturbed before the test, as a later and worse epoch would leave them)
    are replaced by the best ones first."""
    from rnndrop.lm.data.corpus import batchify
    from rnndrop.lm.run import train
    from rnndrop.lm.run.evaluate import score

    finish = train.finish_run

    def after_a_worse_epoch(run, **kwargs):
        with torch.no_grad():
            for parameter in run.model.parameters():
                parameter.add_(torch.randn_like(parameter))
        return finish(run, **kwargs)

    monkeypatch.setattr(train, "finish_run", after_a_worse_epoch)
    result = train_run(corpus, ONE, "tied", tmp_path / "run", seed=4, progress=False)
    best = load_model(tmp_path / "run")
    test = score(best.model, batchify(corpus.test, ONE.eval_batch_size), ONE.bptt)
    assert test.nll == pytest.approx(result["test_nll"], rel=1e-6)


def test_each_epoch_trains_at_the_rate_the_schedule_gives_it(corpus, tmp_path, monkeypatch):
    """The rate an epoch records is the one its optimizer steps with (a fixed decay by 4 after
    epoch 1: 8, then 2)."""
    from rnndrop.lm.run import train

    rates, epoch_of = [], train._train_epoch

    def spy(run, *args, **kwargs):
        rates.append([group["lr"] for group in run.optimizer.param_groups])
        return epoch_of(run, *args, **kwargs)

    monkeypatch.setattr(train, "_train_epoch", spy)
    config = replace(ONE, epochs=2, schedule="fixed", lr=8.0, lr_decay=4.0, decay_after=1)
    result = train_run(corpus, config, "tied", tmp_path / "run", seed=4, progress=False)
    assert [record["lr"] for record in result["epochs"]] == [8.0, 2.0]
    assert [set(r) for r in rates] == [{8.0}, {2.0}]
    # the run's speed is over all its epochs: their words over their seconds
    seconds = [record["seconds"] for record in result["epochs"]]
    words = sum(record["words_per_second"] * record["seconds"] for record in result["epochs"])
    assert result["train_seconds"] == pytest.approx(sum(seconds))
    assert result["words_per_second"] == pytest.approx(words / sum(seconds))


class _Killed(Exception):
    pass


def _kill_after(n):
    def callback(epoch, record):
        if epoch == n:
            raise _Killed

    return callback


def _weights_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- corrupted checkpoints are refused, the previous one takes over ----------------------------

@pytest.mark.slow
def test_corrupt_checkpoint_is_refused_with_the_file_named(corpus, tmp_path):
    """Resuming (--resume) a run whose only checkpoint is damaged: the file and the damage named,
    and what to do (not the advice to resume, which the user was doing)."""
    config = replace(TINY, epochs=2, mc_samples=0)
    with pytest.raises(_Killed):
        train_run(corpus, config, "tied", tmp_path / "run", progress=False, on_epoch_end=_kill_after(1))
    ckpt = tmp_path / "run" / "checkpoint.pt"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2: len(data) // 2 + 500] = bytes(500)  # zero a block inside the payload
    ckpt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"checkpoint '.*checkpoint.pt' is corrupted: "
                       r"(the SHA-256|torch cannot read it)"
                       r".*; no checkpoint.prev.pt beside it, the run cannot resume: start it again"):
        train_run(corpus, config, "tied", tmp_path / "run", progress=False, resume=True)


def test_a_checkpoint_damaged_on_its_way_to_disk_never_replaces_the_last_one(tmp_path, monkeypatch):
    """The new file is read back and checked before it is moved into place: bytes that reach the
    disk damaged (a failing disk, a bad network file system) raise, and the checkpoint before it,
    and nothing else, stays."""
    from rnndrop.lm.run import checkpoint

    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"epoch": 1, "weights": torch.ones(300)}, path)
    before = path.read_bytes()
    encode = checkpoint._encode

    def damaged(obj):
        data = bytearray(encode(obj))
        data[len(data) // 2: len(data) // 2 + 200] = bytes(200)
        return bytes(data)

    monkeypatch.setattr(checkpoint, "_encode", damaged)
    with pytest.raises(CheckpointError, match="is corrupted"):
        save_checkpoint({"epoch": 2, "weights": torch.full((300,), 2.0)}, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def _resaved(data, change):
    import io

    obj = torch.load(io.BytesIO(data), weights_only=True)
    change(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _with_integrity(data, **fields):
    return _resaved(data, lambda obj: obj["rnndrop_checkpoint"].update(fields))


@pytest.mark.parametrize("damage, message", [
    (lambda data: b"", r"is empty \(0 bytes\)"),
    (lambda data: data[: len(data) - 100], r"is truncated"),
    (lambda data: b"PK\x03\x04" + os.urandom(4096), r"is not an rnndrop checkpoint"),
    (lambda data: _with_integrity(data, format=9), r"has format 9"),
    (lambda data: _with_integrity(data, sha256="0" * 64), r"is corrupted: the SHA-256"),
    (lambda data: _resaved(data, lambda obj: obj.pop("rnndrop_checkpoint")),
     r"is not an rnndrop checkpoint \(a file torch.save wrote, without"),
    (lambda data: b"the cat sees the dog .\n", r"is not an rnndrop checkpoint"),
])
def test_empty_truncated_foreign_files_are_clear_errors(tmp_path, damage, message):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"model": {"w": torch.ones(3)}}, path)
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(3))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_a_hostile_payload_with_a_valid_checksum_is_refused_without_weights_only_advice(tmp_path):
    import hashlib
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    payload = pickle.dumps(Evil(), protocol=2)  # not even torch's zip layout
    path = tmp_path / "best.pt"
    path.write_bytes(b"RNNDROP-CHECKPOINT\nformat 2\nsha256 " + hashlib.sha256(payload).hexdigest().encode()
                     + f"\nsize {len(payload)}\n".encode() + payload)
    with pytest.raises(CheckpointError, match="cannot be loaded as plain tensors") as info:
        load_checkpoint(path)
    assert "weights_only=False" not in str(info.value)


@pytest.mark.slow
def test_resume_falls_back_to_the_previous_checkpoint_and_stays_bit_identical(corpus, tmp_path, caplog):
    config = replace(TINY, epochs=3, schedule="fixed", decay_after=1, lr_decay=2.0, mc_samples=0)
    full = train_run(corpus, config, "tied", tmp_path / "full", seed=5, progress=False)
    with pytest.raises(_Killed):
        train_run(corpus, config, "tied", tmp_path / "cut", seed=5, progress=False,
                  on_epoch_end=_kill_after(2))
    cut = tmp_path / "cut"
    assert load_checkpoint(cut / "checkpoint.prev.pt")["progress"]["epoch"] == 1
    (cut / "checkpoint.pt").write_bytes(os.urandom(4096))
    with caplog.at_level("WARNING"):
        resumed = train_run(corpus, config, "tied", cut, seed=5, progress=False, resume=True)
    assert "resuming from the previous checkpoint" in caplog.text
    assert (cut / "checkpoint.corrupt.pt").exists()
    assert [e["valid_ppl"] for e in resumed["epochs"]] == [e["valid_ppl"] for e in full["epochs"]]
    assert _weights_equal(load_checkpoint(cut / "checkpoint.pt")["model"],
                          load_checkpoint(tmp_path / "full" / "checkpoint.pt")["model"])


def test_a_progress_record_from_before_best_criterion_keeps_its_best_epoch_best():
    """Progress written before ``best_criterion`` existed compares later epochs with its best
    validation perplexity (the criterion then), not with infinity: a worse epoch after the resume
    does not replace the best one."""
    from rnndrop.lm.run.checkpoint import RunState

    progress = RunState().to_dict()
    progress.update(epoch=2, best_epoch=2, best_valid_ppl=90.0)
    del progress["best_criterion"]
    state = RunState.from_dict(progress, "checkpoint.pt")
    assert state.best_criterion == 90.0
    assert not state.keep_if_best(3, 95.0, 95.0) and state.best_epoch == 2
    assert state.keep_if_best(3, 85.0, 85.0) and state.best_epoch == 3


@pytest.mark.slow
def test_a_checkpoint_from_before_best_criterion_and_init_from_resumes_bit_for_bit(corpus, tmp_path):
    config = replace(TINY, epochs=3, mc_samples=0)  # plateau: the best so far sets the next rate
    full = train_run(corpus, config, "tied", tmp_path / "full", seed=4, progress=False)
    with pytest.raises(_Killed):
        train_run(corpus, config, "tied", tmp_path / "cut", seed=4, progress=False,
                  on_epoch_end=_kill_after(1))
    path = tmp_path / "cut" / "checkpoint.pt"
    ckpt = load_checkpoint(path)
    assert ckpt["progress"]["best_criterion"] == ckpt["progress"]["best_valid_ppl"]
    later = ("best_criterion", "init_from", "averaging_since", "finetune_from", "finetune_stopped")
    for later_field in later:
        del ckpt["progress"][later_field]
    save_checkpoint(ckpt, path)
    resumed = train_run(corpus, config, "tied", tmp_path / "cut", seed=4, progress=False, resume=True)
    assert [(e["lr"], e["valid_ppl"]) for e in resumed["epochs"]] == \
        [(e["lr"], e["valid_ppl"]) for e in full["epochs"]]
    assert resumed["test_ppl"] == full["test_ppl"] and resumed["init_from"] is None
    assert _weights_equal(load_checkpoint(path)["model"],
                          load_checkpoint(tmp_path / "full" / "checkpoint.pt")["model"])


@pytest.mark.slow
@pytest.mark.parametrize("change, message", [
    ({"epochs_done": 1}, r"lacks nothing and has unknown fields \['epochs_done'\]"),
    ({"history": None}, r"progress field history must be of type list, got None"),
    ({"epoch": "1"}, r"progress field epoch must be of type int, got '1'"),
    ({"best_epoch": True}, r"progress field best_epoch must be of type int, got True"),
])
def test_a_checkpoint_whose_progress_is_not_ours_is_refused(corpus, tmp_path, change, message):
    train_run(corpus, ONE, "tied", tmp_path / "run", seed=1, progress=False)
    path = tmp_path / "run" / "checkpoint.pt"
    ckpt = load_checkpoint(path)
    ckpt["progress"].update(change)
    save_checkpoint(ckpt, path)  # a valid SHA-256: only the check of the progress can refuse it
    with pytest.raises(CheckpointError, match=message):
        train_run(corpus, replace(ONE, epochs=2), "tied", tmp_path / "run", seed=1, progress=False,
                  resume=True)
    del ckpt["progress"]["epoch"]
    save_checkpoint(ckpt, path)
    with pytest.raises(CheckpointError, match=r"the checkpoint in '.*run': its progress lacks \['epoch'\]"):
        train_run(corpus, replace(ONE, epochs=2), "tied", tmp_path / "run", seed=1, progress=False,
                  resume=True)


@pytest.mark.slow
def test_divergence_message_does_not_vouch_for_a_corrupt_checkpoint(corpus, tmp_path):
    from rnndrop.lm.model.regimes import Regime, registered
    from rnndrop.lm.run.train import TrainingDiverged

    def nan_in_epoch_2(model, progress, train_tokens):
        return torch.tensor(float("nan") if progress >= 0.5 else 0.0)

    def corrupt(epoch, record):
        (tmp_path / "run" / "checkpoint.pt").write_bytes(b"\0" * 64)

    regimes = {"nan2": Regime("nan in epoch 2", sites=("input",), regularizer="nan2")}
    with (registered(regimes, hooks={"nan2": nan_in_epoch_2}),
          pytest.raises(TrainingDiverged, match="epoch 1 failed verification.*not an rnndrop") as info):
        train_run(corpus, replace(TINY, epochs=2), "nan2", tmp_path / "run", progress=False,
                  on_epoch_end=corrupt)
    assert "was verified" not in str(info.value)


# -- a huge finite loss is a divergence; clip and lr must be positive -------------------------

class _Loud(torch.nn.Module):
    """An LSTM whose output is scaled so far that the cross-entropy is in the thousands."""

    def __init__(self, input_size, hidden_size, num_layers, probabilities, cell):
        super().__init__()
        self.lstm = torch.nn.LSTM(input_size, hidden_size, num_layers)

    def forward(self, x, hidden=None):
        out, hidden = self.lstm(x, hidden)
        return out * 1e6, hidden


@pytest.mark.slow
def test_a_large_finite_loss_stops_as_divergence_not_overflow(corpus, tmp_path):
    from rnndrop.lm.model.regimes import Regime, registered
    from rnndrop.lm.run.evaluate import Score
    from rnndrop.lm.run.train import TrainingDiverged

    assert Score(1000.0, 1).perplexity == math.inf
    with (registered({"loud": Regime("huge logits", rnn_factory="loud")}, hooks={"loud": _Loud}),
          pytest.raises(TrainingDiverged, match=r"nats per word \(the perplexity overflows\)")):
        train_run(corpus, ONE, "loud", tmp_path / "run", progress=False)


@pytest.mark.parametrize("field, value", [("clip", -1.0), ("clip", 0.0), ("lr", 0.0), ("lr", -2.0)])
def test_config_rejects_non_positive_clip_and_lr(field, value):
    with pytest.raises(ValueError, match=rf"{field} must be a finite number > 0, got {value}"):
        replace(TINY, **{field: value}, min_lr=0.0)


# -- one writer per run folder ----------------------------------------------------------------

@pytest.mark.slow
def test_a_second_writer_is_refused_naming_the_holder(corpus, tmp_path):
    from rnndrop.lm.run.checkpoint import RunLocked

    refused = []

    def second_writer(epoch, record):
        with pytest.raises(RunLocked, match=rf"in use by pid {os.getpid()} on "):
            train_run(corpus, ONE, "tied", tmp_path / "run", progress=False)
        refused.append(epoch)

    train_run(corpus, ONE, "tied", tmp_path / "run", progress=False, on_epoch_end=second_writer)
    assert refused == [1]
    assert not (tmp_path / "run" / "run.lock").exists()  # released at the end


@pytest.mark.slow
def test_a_stale_lock_of_a_dead_process_is_taken_over(corpus, tmp_path, caplog):
    import socket

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.lock").write_text(json.dumps(
        {"pid": int(child.stdout), "host": socket.gethostname(), "since": "earlier"}))
    with caplog.at_level("WARNING"):
        result = train_run(corpus, ONE, "none", tmp_path / "run", progress=False)
    assert "removing a stale lock" in caplog.text and result["epochs_run"] == 1


# -- resume checks the corpus, the whole config, results and the epoch cap ---------------------

@pytest.mark.slow
def test_resume_refuses_another_corpus_and_names_only_the_differing_fields(corpus, tmp_path):
    train_run(corpus, ONE, "tied", tmp_path / "run", progress=False)
    other = load_corpus(write_corpus(tmp_path / "other", sizes=(150, 30, 30)))
    assert len(other.vocab) == len(corpus.vocab)
    with pytest.raises(ValueError, match="belongs to another run") as info:
        train_run(other, replace(ONE, epochs=2), "tied", tmp_path / "run", progress=False, resume=True)
    assert "corpus:" in str(info.value) and "config." not in str(info.value)
    with pytest.raises(ValueError, match=r"config\.clip: 2\.0 here vs 1\.0 there") as info:
        train_run(corpus, replace(ONE, epochs=2, clip=2.0), "tied", tmp_path / "run", progress=False,
                  resume=True)
    assert "config.bptt" not in str(info.value) and "corpus" not in str(info.value)


@pytest.mark.slow
def test_tampered_or_truncated_results_are_not_reused_and_resume_rewrites_them(corpus, tmp_path, caplog):
    from rnndrop.lm.run.checkpoint import finished_result, run_identity

    result = train_run(corpus, ONE, "tied", tmp_path / "run", seed=3, progress=False)
    identity = run_identity(corpus, ONE, "tied", None, 3)
    assert finished_result(tmp_path / "run", identity, epochs=1)["test_ppl"] == result["test_ppl"]
    assert finished_result(tmp_path / "run", run_identity(corpus, ONE, "tied", None, 4)) is None
    assert finished_result(tmp_path / "run", identity, epochs=2) is None
    path = tmp_path / "run" / "results.json"
    tampered = json.loads(path.read_text())
    tampered["test_ppl"] = -5
    path.write_text(json.dumps(tampered))
    with caplog.at_level("WARNING"):
        assert finished_result(tmp_path / "run", identity) is None
    assert "do not match their checksum" in caplog.text
    path.write_text(path.read_text()[:100])  # truncated
    assert finished_result(tmp_path / "run", identity) is None
    again = train_run(corpus, ONE, "tied", tmp_path / "run", seed=3, progress=False, resume=True)
    assert again["test_ppl"] == result["test_ppl"]
    assert finished_result(tmp_path / "run", identity)["test_ppl"] == result["test_ppl"]


@pytest.mark.slow
def test_resume_with_fewer_epochs_than_already_run_is_an_error(corpus, tmp_path):
    two = replace(ONE, epochs=2)
    train_run(corpus, two, "none", tmp_path / "run", progress=False)
    before = (tmp_path / "run" / "results.json").read_bytes()
    with pytest.raises(ValueError, match=r"epochs must be >= 2, .*got 1"):
        train_run(corpus, ONE, "none", tmp_path / "run", progress=False, resume=True)
    assert (tmp_path / "run" / "results.json").read_bytes() == before


@pytest.mark.slow
def test_a_finished_run_trained_on_to_a_higher_cap_keeps_what_it_finished_with(corpus, tmp_path, capsys):
    """Nothing finished is lost: ``--resume --epochs 2`` on a run that finished after 1 epoch trains
    on, and its 1-epoch results.json and best.pt stay, byte for byte, in
    ``finished-after-1-epochs/``, which ``rnndrop-lm evaluate`` reads as a run."""
    from rnndrop.lm import cli

    run = tmp_path / "run"
    first = train_run(corpus, ONE, "tied", run, progress=False)
    before = {name: (run / name).read_bytes() for name in ("results.json", "best.pt")}
    second = train_run(corpus, replace(ONE, epochs=2), "tied", run, progress=False, resume=True)
    assert first["epochs_run"] == 1 and second["epochs_run"] == 2
    kept = run / "finished-after-1-epochs"
    assert {name: (kept / name).read_bytes() for name in before} == before
    assert json.loads((run / "results.json").read_text())["epochs_run"] == 2
    capsys.readouterr()
    assert cli.main(["evaluate", str(kept), "--data", str(tmp_path / "data")]) == 0
    assert f"the run reported {first['test_ppl']:.2f}" in capsys.readouterr().out
    # the same command again reuses the finished 2-epoch run: nothing trains, nothing moves
    again = train_run(corpus, replace(ONE, epochs=2), "tied", run, progress=False, resume=True)
    assert again["test_ppl"] == second["test_ppl"] and not (run / "finished-after-2-epochs").exists()


# -- leftovers, permissions, a read-only folder -------------------------------------------------

@pytest.mark.slow
def test_stale_temporaries_are_removed_and_files_honour_the_umask(corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    stale = run / ".checkpoint.pt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    old = os.umask(0o022)
    try:
        train_run(corpus, ONE, "none", run, progress=False)
    finally:
        os.umask(old)
    assert not stale.exists() and not list(run.glob(".*.tmp"))
    for name in ("checkpoint.pt", "best.pt", "results.json"):
        assert stat.S_IMODE((run / name).stat().st_mode) == 0o644, name


def test_an_unwritable_output_folder_fails_before_training(corpus, tmp_path, monkeypatch):
    # Permission bits do not stop root, so the refusal of the first write is simulated.
    from rnndrop.lm.run import checkpoint

    def refuse(path, flags, mode=0o777):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint.os, "open", refuse)
    epochs = []
    with pytest.raises(PermissionError, match=r"output folder '.*run' is not writable"):
        train_run(corpus, ONE, "none", tmp_path / "run", progress=False,
                  on_epoch_end=lambda e, r: epochs.append(e))
    assert epochs == [] and not (tmp_path / "run" / "checkpoint.pt").exists()


# -- interrupts -------------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_is_reraised_with_the_epoch_and_resume_continues_bit_for_bit(corpus, tmp_path):
    from rnndrop.lm.run.train import RunInterrupted

    config = replace(TINY, epochs=2, mc_samples=0)
    full = train_run(corpus, config, "tied", tmp_path / "full", seed=9, progress=False)

    def ctrl_c(epoch, record):
        raise KeyboardInterrupt

    with pytest.raises(RunInterrupted) as info:
        train_run(corpus, config, "tied", tmp_path / "cut", seed=9, progress=False, on_epoch_end=ctrl_c)
    assert info.value.epoch == 1 and info.value.folder == tmp_path / "cut"
    assert isinstance(info.value, KeyboardInterrupt)
    assert not (tmp_path / "cut" / "run.lock").exists()
    resumed = train_run(corpus, config, "tied", tmp_path / "cut", seed=9, progress=False, resume=True)
    assert resumed["epochs"][0]["valid_ppl"] == full["epochs"][0]["valid_ppl"]
    assert resumed["test_ppl"] == full["test_ppl"]


_CHILD = """
import sys, time
from dataclasses import replace
import torch
from rnndrop.lm.data.corpus import load_corpus
from rnndrop.lm.run.train import RunInterrupted, train_run
from tests.lm_helpers import TINY

torch.set_num_threads(1)
data, out, marker = sys.argv[1:4]

def wait_for_ctrl_c(epoch, record):
    open(marker, "w").close()
    time.sleep(60)

try:
    train_run(load_corpus(data), replace(TINY, epochs=2, mc_samples=0), "tied", out, seed=9,
              progress=False, on_epoch_end=wait_for_ctrl_c)
except RunInterrupted as e:
    print(f"interrupted epoch={e.epoch} folder={e.folder}")
    sys.exit(130)
"""


@pytest.mark.slow
def test_a_real_sigint_leaves_a_run_that_resumes_bit_for_bit(corpus, tmp_path):
    import signal
    import time

    marker = tmp_path / "epoch-done"
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, corpus.source, str(tmp_path / "cut"), str(marker)],
        cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, preexec_fn=ctrl_c_reaches,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never finished its first epoch"
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        stdout, stderr = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, stderr
    assert f"interrupted epoch=1 folder={tmp_path / 'cut'}" in stdout
    config = replace(TINY, epochs=2, mc_samples=0)
    resumed = train_run(corpus, config, "tied", tmp_path / "cut", seed=9, progress=False, resume=True)
    full = train_run(corpus, config, "tied", tmp_path / "full", seed=9, progress=False)
    assert resumed["epochs"][1]["valid_ppl"] == full["epochs"][1]["valid_ppl"]
    assert _weights_equal(load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["model"],
                          load_checkpoint(tmp_path / "full" / "checkpoint.pt")["model"])


@pytest.mark.slow
def test_load_model_of_a_gru_run_and_of_a_file_without_the_config(corpus, tmp_path):
    train_run(corpus, replace(ONE, cell="gru"), "naive", tmp_path / "gru", progress=False)
    run = load_model(tmp_path / "gru")
    logits, hidden = run.model(run.vocab.encode(["the", "cat", "sees"])[:, None])
    assert logits.shape == (3, 1, len(corpus.vocab)) and isinstance(hidden, torch.Tensor)
    save_checkpoint({"model": {}}, tmp_path / "bare.pt")
    with pytest.raises(CheckpointError, match=r"lacks config, regime, regime_settings, dropout, vocab"):
        load_model(tmp_path / "bare.pt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


# -- the format: plain torch.load reads it; files of the older format still load ------------------

def _old_format_bytes(obj):
    """What save_checkpoint wrote before format 3 (rnndrop <= the consolidation of lm/run): a text
    header, then the payload torch.save wrote. Copied from that writer, as a fixture."""
    import hashlib
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    header = (f"format 2\nsha256 {hashlib.sha256(payload).hexdigest()}\n"
              f"size {len(payload)}\n").encode("ascii")
    return b"RNNDROP-CHECKPOINT\n" + header + payload


def test_a_checkpoint_loads_with_plain_torch_load_and_keeps_its_integrity_check(tmp_path):
    import random

    from rnndrop.lm.run.checkpoint import run_id

    path = tmp_path / "best.pt"
    identity = {"seed": 1, "regime": "tied"}
    obj = {"model": {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)},
           "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
           "progress": {"epoch": 2, "history": [{"lr": 1.0}], "stopped": None}, "identity": identity}
    save_checkpoint(obj, path)
    plain = torch.load(path, weights_only=True)  # what a PyTorch user does
    assert torch.equal(plain["model"]["w"], obj["model"]["w"]) and plain["progress"] == obj["progress"]
    assert plain["rnndrop_checkpoint"]["format"] == 3
    assert plain["rnndrop_checkpoint"]["run_id"] == run_id(identity)
    loaded = load_checkpoint(path)
    assert "rnndrop_checkpoint" not in loaded and torch.equal(loaded["model"]["b"], obj["model"]["b"])
    plain["model"]["w"][0, 0] += 1  # a changed weight, saved back with torch.save
    torch.save(plain, path)
    with pytest.raises(CheckpointError, match="is corrupted: the SHA-256 of its content"):
        load_checkpoint(path)


def test_checkpoints_of_the_older_header_format_still_load(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(_old_format_bytes({"model": {"w": torch.arange(6.0)}, "epoch": 3}))
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0)) and loaded["epoch"] == 3
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="is corrupted: the SHA-256 of its payload"):
        load_checkpoint(path)
    path.write_bytes(_old_format_bytes({"model": {}}).replace(b"format 2", b"format 9", 1))
    with pytest.raises(CheckpointError, match="has format 9"):
        load_checkpoint(path)


@pytest.mark.slow
def test_a_best_pt_of_the_older_format_still_loads_as_a_model(corpus, tmp_path):
    train_run(corpus, ONE, "tied", tmp_path / "run", seed=4, progress=False)
    best = tmp_path / "run" / "best.pt"
    new = load_model(best)
    best.write_bytes(_old_format_bytes(load_checkpoint(best)))  # as an earlier version wrote it
    old = load_model(best)
    assert all(torch.equal(a, b) for a, b in zip(new.model.state_dict().values(),
                                                 old.model.state_dict().values()))
    assert old.vocab.itos == new.vocab.itos
