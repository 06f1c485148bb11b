"""The "triton" loop kernel: its checks against the reference kernel (``tests/triton_checks.py``,
run in a subprocess: under Triton's interpreter on CPU, compiled on a GPU); kernel="auto" picks it
on CUDA only; rnndrop imports and runs without Triton; the switch that turns it off.
"""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rnndrop import VariationalGRU, VariationalLSTM
from rnndrop.kernels import auto_loop_kernel, auto_loop_kernel_on, get_kernel, gpu
from tests import helpers

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the GPU machine runs it)")


def test_the_kernels_match_the_reference_kernel():
    """``tests/triton_checks.py`` in a fresh process, where ``TRITON_INTERPRET=1`` (no GPU) is set
    before anything imports Triton and leaks into no other test; every check must pass, none skip."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if CUDA:
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/triton_checks.py"]
    if importlib.util.find_spec("xdist") is not None:  # the interpreter's checks are independent
        command += ["-n", str(min(os.cpu_count() or 1, 4))]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in summary and "skipped" not in summary and "deselected" not in summary, summary


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = helpers.kernel_inputs("gru", [2, 2], None, 0)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors .*got gates_x on cpu"):
        get_kernel("triton", "gru")(args[0], [2, 2], *args[1:])


def test_auto_never_picks_it_for_cpu_tensors():
    assert auto_loop_kernel(torch.ones(1)) != "triton"
    assert auto_loop_kernel(torch.ones(1, dtype=torch.float16)) != "triton"


def test_the_switch_turns_it_off_with_one_warning(monkeypatch):
    monkeypatch.setenv("RNNDROP_NO_TRITON", "1")
    for name, value in (("_modules", None), ("_failure", None), ("_warned", False)):
        monkeypatch.setattr(gpu, name, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [gpu.is_available(), gpu.is_available()] == [False, False]
    assert len(caught) == 1 and "unset RNNDROP_NO_TRITON" in str(caught[0].message)
    assert "'manual' kernel on CUDA" in str(caught[0].message)
    args = helpers.kernel_inputs("lstm", [1], None, 0)
    with pytest.raises(RuntimeError, match="not available: disabled by RNNDROP_NO_TRITON"):
        get_kernel("triton", "lstm")(args[0], [1], *args[1:])


WITHOUT_TRITON = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    from rnndrop import VariationalGRU
    from rnndrop.kernels import gpu
    layer = VariationalGRU(3, 4, dropout_hidden=0.5)
    layer(torch.randn(5, 2, 3))[0].sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        answer = gpu.is_available()
    print(json.dumps(dict(answer=answer, warnings=[str(w.message) for w in caught],
                          kernels=sorted(m for m in sys.modules if m.startswith("rnndrop.kernels.triton_")))))
    """
)


def test_rnndrop_imports_and_trains_without_triton(tmp_path):
    """A ``triton`` that cannot be imported (as where it is not installed): the layers still import
    and train on CPU, and the kernel says how to get it."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text("raise ImportError('no triton here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["answer"] is False and result["kernels"] == []
    assert len(result["warnings"]) == 1 and "no triton here" in result["warnings"][0]
    assert 'pip install "rnndrop[gpu]"' in result["warnings"][0]


@cuda_only
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_auto_runs_the_triton_kernel_on_cuda_with_a_mask(kind, monkeypatch):
    import rnndrop.kernels.triton_gru as triton_gru
    import rnndrop.kernels.triton_lstm as triton_lstm

    assert auto_loop_kernel(torch.ones(1, device="cuda")) == "triton"
    function = triton_lstm._LSTMRecurrence if kind == "lstm" else triton_gru._GRURecurrence
    calls = []
    original = function.apply
    monkeypatch.setattr(function, "apply", lambda *a: calls.append(1) or original(*a))
    cls = VariationalLSTM if kind == "lstm" else VariationalGRU
    layer = cls(8, 16, num_layers=2, bidirectional=True, dropout_hidden=0.5, device="cuda")
    layer(torch.randn(5, 3, 8, device="cuda"))[0].sum().backward()
    assert len(calls) == 4  # 2 layers x 2 directions


def _fake_triton(monkeypatch, lstm, gru):
    """The Triton kernel replaced by ``lstm`` / ``gru`` (recurrence functions), unchecked."""
    modules = (SimpleNamespace(lstm_recurrence=lstm), SimpleNamespace(gru_recurrence=gru))
    monkeypatch.setattr(gpu, "_modules", modules)
    monkeypatch.setattr(gpu, "_checked", {})


def test_first_use_check_catches_a_kernel_that_fails_or_is_wrong(monkeypatch):
    """Before kernel="auto" runs the Triton kernel on a device it runs a small LSTM and GRU through
    it: a compiler error, or a result off the reference, sends "auto" to the manual kernel there."""
    reference_lstm, reference_gru = get_kernel("autograd", "lstm"), get_kernel("autograd", "gru")

    def failing(*args):
        raise RuntimeError("PTX assembly failed\nmore lines")

    def wrong_gru(*args):
        out, h_n = reference_gru(*args)
        return out, h_n + 1e-3

    _fake_triton(monkeypatch, reference_lstm, reference_gru)
    state = torch.get_rng_state()
    assert gpu.first_use_failure("cpu") is None
    assert torch.equal(torch.get_rng_state(), state)  # its own generator
    _fake_triton(monkeypatch, failing, reference_gru)
    assert gpu.first_use_failure("cpu") == "RuntimeError: PTX assembly failed"
    _fake_triton(monkeypatch, reference_lstm, wrong_gru)
    assert gpu.first_use_failure("cpu") == "its GRU differs from the reference kernel by 0.001"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [gpu.passes_first_use_check(torch.device("cpu")) for _ in range(2)] == [False, False]
    assert len(caught) == 1
    assert "failed its first-use check on cpu (its GRU differs" in str(caught[0].message)
    assert "runs the 'manual' kernel there instead" in str(caught[0].message)


def test_first_use_check_under_inference_mode_checks_the_kernel_not_the_mode(monkeypatch):
    """A first call under ``torch.inference_mode`` (a server's mc_predict) failed the check with
    "Inference tensors cannot be saved for backward" and sent "auto" to the manual kernel for the
    process; under no_grad and inference_mode the check computes its gradients all the same."""
    _fake_triton(monkeypatch, get_kernel("autograd", "lstm"), get_kernel("autograd", "gru"))
    with torch.inference_mode():
        assert gpu.first_use_failure("cpu") is None
    with torch.no_grad():
        assert gpu.first_use_failure("cpu") is None


def test_first_use_check_allows_tf32_rounding_but_not_a_wrong_kernel(monkeypatch):
    """With TF32 products both kernels round their own way (an H200 measured 1.4e-4 apart):
    1e-3 apart passes, 0.1 apart does not; in IEEE float32 1e-3 apart fails (above)."""
    reference_lstm, reference_gru = get_kernel("autograd", "lstm"), get_kernel("autograd", "gru")

    def off_by(gap):
        return lambda *args: (lambda out, h_n: (out, h_n + gap))(*reference_gru(*args))

    monkeypatch.setattr(gpu, "matmul_precision", lambda: "tf32")
    _fake_triton(monkeypatch, reference_lstm, off_by(1e-3))
    assert gpu.first_use_failure("cpu") is None
    _fake_triton(monkeypatch, reference_lstm, off_by(0.1))
    assert gpu.first_use_failure("cpu") == "its GRU differs from the reference kernel by 0.1"


def test_the_counter_pool_hands_its_counters_in_when_used_up_and_a_give_up_is_read(monkeypatch):
    """Cooperative launches take their barrier counter from a pool of zeros; when every slot has
    served, the pool is handed in to be read once its launches finished, and zeroed. A counter a
    barrier gave up in marks the device (one warning): later calls run the step kernel."""
    from rnndrop.kernels import persistent

    handed = []

    def hand_in(pool):  # instead of a pinned copy and a CUDA event: already finished
        handed.append(pool.values.clone())
        return SimpleNamespace(query=lambda: True), pool.values.clone(), pool.device

    monkeypatch.setattr(persistent, "_pending", [])
    monkeypatch.setattr(persistent, "_given_up", set())
    monkeypatch.setattr(persistent._CounterPool, "_hand_in", hand_in)
    device = torch.device("cpu")
    pool = persistent._CounterPool(device)
    slots = [pool.take() for _ in range(pool.SLOTS)]
    assert all(int(s) == 0 for s in slots) and len({s.data_ptr() for s in slots}) == pool.SLOTS
    assert handed == []
    slots[3].fill_(persistent.GAVE_UP + 5)  # a launch whose barrier gave up
    again = pool.take()
    assert len(handed) == 1 and int(handed[0].max()) >= persistent.GAVE_UP
    assert again.data_ptr() == slots[0].data_ptr() and int(pool.values.abs().sum()) == 0
    assert persistent.usable(device)
    with pytest.warns(RuntimeWarning, match="grid barrier gave up waiting"):
        persistent._read_finished_counters()
    assert not persistent.usable(device) and persistent._pending == []


def test_pooled_counters_are_kept_apart_per_device_and_stream(monkeypatch):
    """A launch on one stream takes the next slot of that stream's pool: launches on another
    stream (or device) never share a pool, whose slots are zeroed in its own stream's order."""
    from rnndrop.kernels import persistent

    streams = {0: 11}
    monkeypatch.setattr(persistent, "_pools", {})
    monkeypatch.setattr(persistent, "_current_raw_stream", lambda index: streams[index])
    first, second = (persistent._taken(persistent._pool(torch.device("cpu", 0))) for _ in range(2))
    streams[0] = 12  # another stream made current
    other = persistent._taken(persistent._pool(torch.device("cpu", 0)))
    streams[1] = 11  # the first stream's handle, on another device
    elsewhere = persistent._taken(persistent._pool(torch.device("cpu", 1)))
    assert sorted(persistent._pools) == [(0, 11), (0, 12), (1, 11)]
    pool = persistent._pools[(0, 11)]
    assert (first.data_ptr(), second.data_ptr()) == (pool.slots[0].data_ptr(), pool.slots[1].data_ptr())
    assert other.data_ptr() == persistent._pools[(0, 12)].slots[0].data_ptr()
    assert elsewhere.data_ptr() == persistent._pools[(1, 11)].slots[0].data_ptr()


def test_a_pooled_counter_is_held_until_its_launch_is_enqueued(monkeypatch):
    """A cooperative launch takes its counter and launches holding its pool's lock: another thread
    launching on the stream in between (a first launch compiles for seconds) could otherwise use
    the pool's 16 slots up, zero them and reuse this one, and the launch would start from a
    finished launch's count (barriers that never wait, silently wrong states)."""
    import threading

    from rnndrop.kernels import persistent

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(persistent, "_pools", {})
    monkeypatch.setattr(persistent, "_pending", [])
    monkeypatch.setattr(persistent, "_COOPERATIVE", True)
    monkeypatch.setattr(persistent, "_current_raw_stream", lambda index: 7)
    slots = persistent._CounterPool.SLOTS
    monkeypatch.setattr(persistent, "_outside_graph_pools",
                        lambda device, allocate: torch.empty(slots, 4, dtype=torch.int32))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    seen = []

    class Kernel:
        __name__ = "_lstm_forward"

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                pool = persistent._pools[(0, 7)]
                other = threading.Thread(target=lambda: seen.append(pool.launching.acquire(blocking=False)))
                other.start()
                other.join()
                seen.append(int(args[1]))  # the counter it was given: a zero slot
            return launch

    gates = SimpleNamespace(device=cuda, dtype=torch.float32)
    blocks = dict(BB=16, BK=16, RESIDENT=False, UNITS=16, BH=16)
    assert persistent._launch(Kernel(), persistent.Launch(2, 16), 3, (gates,), False, **blocks) is None
    assert seen == [False, 0]  # another thread could not take the pool while this launch was issued
    assert persistent._pools[(0, 7)].launching.acquire(blocking=False)  # released after it


class _FakeStreams:
    """CUDA's streams, events and capture as :func:`persistent._step_table` meets them, on the CPU:
    ``raw`` is the current stream's handle, ``capturing`` whether it is capturing a graph; what the
    table's code does to them is appended to ``seen``."""

    def __init__(self, monkeypatch):
        from rnndrop.kernels import persistent

        self.raw, self.capturing, self.seen = 11, False, []
        fakes = self

        class Stream:
            def __init__(self, raw):
                self.raw = raw

            def wait_event(self, event):
                fakes.seen.append(("waits", self.raw, event))

        class Event:
            def record(self, stream):
                fakes.seen.append(("copied", stream.raw, self))

        monkeypatch.setattr(persistent, "_TABLES", persistent.OrderedDict())
        monkeypatch.setattr(persistent, "_CAPTURED_TABLES", {})
        monkeypatch.setattr(persistent, "_current_raw_stream", lambda index: self.raw)
        monkeypatch.setattr(persistent, "_outside_graph_pools",  # a table of two steps, on the CPU
                            lambda device, allocate: torch.empty(3, 8, dtype=torch.int32))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: self.capturing)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(self.raw))
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda tensor, stream: self.seen.append(("recorded", stream.raw)))
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: self.seen.append("pinned") or tensor)


def test_one_step_table_serves_every_stream_each_ordered_after_its_copy(monkeypatch):
    """CUDA-graph captures warm a call up on one stream and record it on another (the H200's sixth
    round: with a table cached per stream the capture made its own, copied from pageable memory,
    which CUDA refuses while capturing, and ``make_graphed_callables`` failed). A stream new to a
    table waits for its copy and is recorded on it, once: its memory is not reused (the table
    evicted from the cache) while that stream may still read it."""
    from rnndrop.kernels import persistent
    from rnndrop.kernels.schedule import Schedule

    fake = _FakeStreams(monkeypatch)
    schedule, cuda = Schedule.of([3, 2], False), torch.device("cuda", 0)
    first, again = (persistent._step_table(schedule, None, cuda) for _ in range(2))
    assert first is again and first.tolist()[1][:4] == [3, 0, 0, 0]
    copied = fake.seen[0][2]
    assert fake.seen == [("copied", 11, copied)]  # made on stream 11, which needs no wait
    fake.raw = 12  # another stream made current
    other, more = (persistent._step_table(schedule, None, cuda) for _ in range(2))
    assert other is first and more is first and len(persistent._TABLES) == 1
    assert fake.seen[1:] == [("waits", 12, copied), ("recorded", 12)]
    fake.capturing, fake.raw = True, 13  # a capture on a third stream reads it as it is
    assert persistent._step_table(schedule, None, cuda) is first and len(fake.seen) == 3


def test_a_step_table_used_while_a_cuda_graph_captures_is_never_freed(monkeypatch):
    """A graph replays the table by address: evicted from the cache of 256 (packed batches of many
    lengths) and freed, the replays read memory reused for other tensors. A table first needed
    while capturing is copied from pinned memory (CUDA refuses pageable memory then), which is kept
    too: each replay copies it again."""
    from rnndrop.kernels import persistent
    from rnndrop.kernels.schedule import Schedule

    fake = _FakeStreams(monkeypatch)
    cuda = torch.device("cuda", 0)
    eager = persistent._step_table(Schedule.of([3, 2], False), None, cuda)
    assert not persistent._CAPTURED_TABLES
    fake.capturing = True
    assert persistent._step_table(Schedule.of([3, 2], False), None, cuda) is eager
    persistent._TABLES.clear()  # evicted
    assert list(persistent._CAPTURED_TABLES.values()) == [(eager,)]
    made = persistent._step_table(Schedule.of([4, 1], False), None, cuda)
    assert fake.seen[-1] == "pinned" and made.tolist()[1][:4] == [4, 0, 0, 0]
    kept, source = persistent._CAPTURED_TABLES[made.data_ptr()]
    assert kept is made and source.tolist() == made.tolist()  # the pinned rows each replay copies
    assert not persistent._TABLES  # made in the graph's memory pool: not cached for calls outside it


def test_buffers_kept_across_calls_are_made_outside_the_callers_cuda_graph_pool(monkeypatch):
    """torch.compile's CUDA graphs route every allocation of the thread warming a graph up into the
    graph's pool, and refuse one that outlives the call (the H200, 2026-11-27: "tensor(s) in the
    cudagraph pool not tracked as outputs"): pooled counters and cached step tables are allocated in
    a thread of their own, the caller's stream made to wait for that thread's (the default) stream
    and recorded on the tensor, except while a graph is being captured."""
    import threading

    from rnndrop.kernels import persistent
    from rnndrop.kernels.schedule import Schedule

    seen = []
    caller, default = SimpleNamespace(wait_stream=lambda s: seen.append(("waits", s))), object()

    class Made:
        def record_stream(self, stream):
            seen.append(("recorded", stream))

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: caller)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda *args: default)
    cuda = torch.device("cuda")
    made = persistent._outside_graph_pools(cuda, lambda: seen.append(threading.current_thread()) or Made())
    assert isinstance(made, Made) and seen[0] is not threading.current_thread()
    assert seen[1:] == [("waits", default), ("recorded", caller)]

    def fails():
        raise ValueError("out of memory")

    with pytest.raises(ValueError, match="out of memory"):  # in the caller's thread
        persistent._outside_graph_pools(cuda, fails)
    here = threading.current_thread()
    assert persistent._outside_graph_pools(torch.device("cpu"), threading.current_thread) is here
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert persistent._outside_graph_pools(cuda, threading.current_thread) is here

    made = []
    monkeypatch.setattr(persistent, "_outside_graph_pools",
                        lambda device, allocate: made.append(device) or allocate())
    monkeypatch.setattr(persistent, "_pools", {})
    monkeypatch.setattr(persistent, "_current_raw_stream", lambda index: 5)
    monkeypatch.setattr(persistent, "_TABLES", persistent.OrderedDict())
    counters = [persistent._taken(persistent._pool(torch.device("cpu", 0))) for _ in range(2)]  # one pool
    tables = [persistent._step_table(Schedule.of([3, 2], False), None, torch.device("cpu")) for _ in range(2)]
    assert len(made) == 2 and all(int(c) == 0 for c in counters)
    assert tables[0] is tables[1] and tables[0].tolist()[1][:4] == [3, 0, 0, 0]


class _WithMasks(torch.nn.Module):
    """``layer(x, masks=masks)`` with fixed masks: a callable of tensors alone, as
    ``torch.cuda.make_graphed_callables`` wants, whose replays can be compared with eager calls."""

    def __init__(self, layer, masks):
        super().__init__()
        self.layer, self.masks = layer, masks

    def forward(self, x):
        return self.layer(x, masks=self.masks)


def _tied(cls, hidden=40, **extra):
    return cls(24, hidden, num_layers=2, dropout=0.3, dropout_input=0.3, dropout_hidden=0.5,
               dropout_output=0.3, device="cuda", **extra)


@cuda_only
@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
def test_a_training_step_on_the_persistent_loop_never_waits_for_the_gpu(cls):
    """The host issues a whole training step (masks, loops, products, backward) without waiting for
    the GPU once: over 20 steps (the barrier counters' pool hands itself in after 16 launches) no
    call synchronises (``torch.cuda.set_sync_debug_mode("error")`` raises at any that would)."""
    from rnndrop.kernels import persistent

    layer = _tied(cls)
    x = torch.randn(35, 20, 24, device="cuda")
    layer(x)[0].sum().backward()  # first use: the check against the reference kernel, compiles
    assert persistent.plan(x.flatten(0, 1), 40, 20, False) is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(20):
            layer.zero_grad(set_to_none=True)
            layer(x)[0].sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


@cuda_only
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_two_programs_a_multiprocessor_run_and_match_reference(kind, monkeypatch):
    """``tuning["per_sm"] = 2`` (``persistent.PER_SM``): a grid of more programs than the GPU has
    multiprocessors (programs of 8 units over 1500, one block of rows) launches, every program
    resident at once, and matches the reference kernel (a tied and a per-gate mask, both
    directions; IEEE float32, 1e-4 over 1500 units). A GPU only: the interpreter runs one program."""
    from rnndrop.kernels import persistent

    monkeypatch.setattr(persistent, "_given_up", set())  # a refusal here must not reach later tests
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # IEEE products: 1e-4 means something
    for name, value in dict(per_sm=2, spread=True, row_blocks=1).items():
        monkeypatch.setitem(persistent.tuning, name, value)
    launched = []
    run = persistent._run
    monkeypatch.setattr(persistent, "_run", lambda kernel, *a, **k: launched.append(kernel.__name__) or run(
        kernel, *a, **k))
    batch_sizes, hidden, device = [20] * 6, 1500, torch.device("cuda")
    how = persistent.plan(torch.empty(1, device=device), hidden, 20, False)
    assert how.grid > torch.cuda.get_device_properties(device).multi_processor_count, how
    for reverse, mask_shape in ((False, (1, "B", "P")), (True, (1, "B", "G", "P"))):
        args = helpers.kernel_inputs(kind, batch_sizes, mask_shape, 0, dtype=torch.float32, H=hidden)
        with torch.no_grad():
            for weight in args[3:4] if kind == "lstm" else args[2:3]:
                weight /= hidden**0.5  # nn.LSTM's scale: saturated gates would amplify rounding
        args = [None if a is None else a.detach().cuda().requires_grad_(a.requires_grad) for a in args]
        ours = helpers.run_kernel("triton", kind, batch_sizes, args, reverse)
        reference = helpers.run_kernel("autograd", kind, batch_sizes, args, reverse)
        helpers.assert_close(ours, reference, atol=1e-4, rtol=1e-4, msg=f"{kind} {how} mask {mask_shape}")
        assert persistent.usable(device), "the launch of two programs a multiprocessor was refused"
    assert launched.count(f"_{kind}_forward") == launched.count(f"_{kind}_backward") == 2


@cuda_only
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_language_model_training_step_never_waits_for_the_gpu(cell):
    """The same for a whole language model on batches of a corpus held on the GPU (embedding
    dropout over word types, tied masks, decoder, loss): the word ids are checked once for the
    corpus, not at every batch (``rnndrop.validation.check_word_ids``)."""
    from rnndrop.lm.model.language_model import RNNLanguageModel

    model = RNNLanguageModel(50, 24, 40, 2, dropout_embedding=0.1, dropout_input=0.3, dropout_between=0.3,
                          dropout_hidden=0.5, dropout_output=0.3, cell=cell).cuda()
    corpus = torch.randint(0, 50, (400, 20), device="cuda")

    def step(start):
        model.zero_grad(set_to_none=True)
        logits, _ = model(corpus[start : start + 35])
        targets = corpus[start + 1 : start + 36].flatten()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets).backward()

    step(0)  # first use: compiles, checks the corpus's ids
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for start in range(1, 300, 35):
            step(start)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@cuda_only
@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
def test_the_whole_layer_replays_from_cuda_graphs_as_eager_computes(cls, monkeypatch):
    """``torch.cuda.make_graphed_callables`` captures a tied-mask layer's forward and backward on
    the persistent loop (no host work left in a step): with the same masks its replays give eager's
    outputs, final states and gradients; without given masks every replay draws fresh ones."""
    import copy

    # IEEE float32 (cuDNN's switch, which the loop follows, is on by default): cuBLAS may pick
    # another algorithm while capturing, and TF32's rounding would then differ by more than 1e-4
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    layer = _tied(cls)
    masks = layer.sample_masks(20)
    eager = _WithMasks(copy.deepcopy(layer), masks)
    sample = (torch.randn(35, 20, 24, device="cuda"),)
    graphed = torch.cuda.make_graphed_callables(_WithMasks(layer, masks), sample)
    for _ in range(2):  # the second replay reuses the graphs' buffers
        x = torch.randn(35, 20, 24, device="cuda")
        weights = [torch.randn(35, 20, 40, device="cuda"), torch.randn(2, 20, 40, device="cuda"),
                   torch.randn(2, 20, 40, device="cuda")]
        results = []
        for module in (graphed, eager):
            module.zero_grad(set_to_none=True)
            out, final = module(x)
            states = final if isinstance(final, tuple) else (final,)
            (sum((w * t).sum() for w, t in zip(weights, (out, *states)))).backward()
            results.append([out.detach().clone(), *(s.detach().clone() for s in states),
                            *(p.grad.clone() for p in module.parameters())])
        for ours, expected in zip(*results, strict=True):
            torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)

    fresh = torch.cuda.make_graphed_callables(_tied(cls), (torch.randn(35, 20, 24, device="cuda"),))
    x = torch.randn(35, 20, 24, device="cuda")
    first, second = fresh(x)[0].detach().clone(), fresh(x)[0].detach().clone()
    assert torch.isfinite(first).all() and not torch.equal(first, second)


def test_auto_runs_the_triton_kernel_for_half_types_on_cuda_where_it_passes_its_check_in_them(monkeypatch):
    """The fifth GPU round (an H200, 2026-11-28) passed the bfloat16 / float16 checks the fourth had
    failed (tests/triton_checks.py: autocast, one program, reduced precision at random shapes), so
    kernel="auto" runs the loop in every dtype on CUDA, as in float32, where the first-use check in
    that dtype passes, and says nothing; where it fails there, the "manual" kernel in that dtype."""
    monkeypatch.setattr(gpu, "is_available", lambda: True)
    asked = []

    def check(device, dtype=torch.float32):
        asked.append(dtype)
        return dtype != torch.float16

    monkeypatch.setattr(gpu, "passes_first_use_check", check)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert auto_loop_kernel_on(torch.device("cuda"), dtype) == "triton"
    assert auto_loop_kernel_on(torch.device("cuda"), torch.float16) == "manual"
    assert asked == [torch.float32, torch.float64, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_first_use_check_in_a_half_type_runs_the_kernel_under_autocast_and_catches_a_wrong_one(
        monkeypatch, dtype):
    """In a half type the check runs the kernel under autocast in it against the float32 reference,
    in relative norm: rounding passes, a kernel wrong only there fails it there alone, with one
    warning naming the dtype, and float32 still passes."""
    reference_lstm, reference_gru = get_kernel("autograd", "lstm"), get_kernel("autograd", "gru")
    seen = []

    def lstm_in_half(*args):  # the reference's products in the half type, as autocast casts them
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return reference_lstm(*args)

    def wrong_in_half(*args):
        out, h_n = reference_gru(*args)
        return (out, -h_n) if torch.is_autocast_enabled("cpu") else (out, h_n)

    _fake_triton(monkeypatch, lstm_in_half, reference_gru)
    assert gpu.first_use_failure("cpu", dtype) is None
    assert seen == [dtype]  # the kernel under autocast; the reference outside it
    _fake_triton(monkeypatch, reference_lstm, wrong_in_half)
    name = str(dtype).removeprefix("torch.")
    assert gpu.first_use_failure("cpu", dtype) == (
        f"its GRU in {name} differs from the float32 reference kernel by 2 in relative norm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gpu.passes_first_use_check(torch.device("cpu"), torch.float32)
        assert [gpu.passes_first_use_check(torch.device("cpu"), dtype) for _ in range(2)] == [False, False]
    assert len(caught) == 1
    assert f"failed its first-use check in {name} on cpu" in str(caught[0].message)
    assert f"runs the 'manual' kernel there in {name} instead" in str(caught[0].message)
