"""benchmarks/speed.py: its arguments, and a tiny run of the whole path on CPU; the CUDA-only parts
(the GPU line of the header, the table against the goals) on made-up inputs."""

import importlib.metadata
import importlib.util
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def speed():
    spec = importlib.util.spec_from_file_location("speed_benchmark", ROOT / "benchmarks" / "speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_time_the_kernels_that_run_on_the_device(speed):
    cpu = speed.parse_args([])
    assert cpu.device == torch.device("cpu") and cpu.batch == [20]
    assert "triton" not in cpu.kernels and "compiled" in cpu.kernels
    cuda = speed.parse_args(["--device", "cuda", "--batch", "20,64,128", "--shapes", "small,medium,large"])
    assert cuda.device.type == "cuda" and cuda.batch == [20, 64, 128]
    assert "triton" in cuda.kernels and "compiled" not in cuda.kernels
    assert speed.parse_args(["--device", "cuda:1", "--kernels", "triton"]).kernels == ["triton"]


@pytest.mark.parametrize("argv, message", [
    (["--kernels", "triton"], "on cpu expected one of"),
    (["--device", "cuda", "--kernels", "compiled"], "on cuda expected one of"),
    (["--kernels", "nope"], "expected names from"),
    (["--batch", "20,x"], "--batch: expected comma-separated positive integers, got '20,x'"),
    (["--batch", "0"], "--batch: expected comma-separated positive integers"),
    (["--device", "tpu"], "--device: expected cpu or cuda"),
    (["--shapes", "huge"], "--shapes: expected names from"),
    # tracebacks from deep inside torch, or nothing timed, before they were checked here
    (["--shapes", ","], "--shapes and --models: expected a name each at least"),
    (["--p", "1.5"], "--p: expected a probability in [0, 1), got 1.5"),
    (["--layers", "0"], "--layers: expected a positive integer, got 0"),
    (["--seq-len", "0"], "--seq-len: expected a positive integer, got 0"),
    (["--threads", "0"], "--threads: expected a positive integer, got 0"),
    (["--variants", "sequence/manual,bogus"], "--variants: expected names among "),
    (["--autocast", "float32"], "--autocast: invalid choice: 'float32'"),
])
def test_bad_arguments_are_refused_naming_the_flag(speed, capsys, argv, message):
    with pytest.raises(SystemExit):
        speed.parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_gpu_this_machine_lacks_is_one_line(speed, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as done:
        speed.main(["--device", "cuda"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "--device 'cuda'" in err


def test_a_tiny_run_prints_a_table_per_shape_model_and_batch(speed, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(speed.SHAPES, "small", 8)
    out = tmp_path / "speed.json"
    speed.main(["--shapes", "small", "--models", "gru", "--kernels", "manual", "--batch", "2,3",
                "--seq-len", "3", "--rounds", "2", "--warmup", "1", "--json", str(out)])
    printed = capsys.readouterr().out
    assert printed.count("sequence/manual") == 2 and "batch/fused" in printed
    results = json.loads(out.read_text())["results"]
    assert {r["batch"] for r in results} == {2, 3}
    assert all(r["ratio"] > 0 for r in results)


def test_each_shape_shuffles_its_rounds_in_orders_of_its_own(speed, capsys, monkeypatch):
    """The same orders at every shape turned what a variant's place in a round costs into a
    difference of the variants at every shape alike (the sixth H200 round: two variants of one
    launch 3-9% apart throughout)."""
    import random

    seeds = []

    class Recorded(random.Random):
        def __init__(self, seed):
            seeds.append(seed)
            super().__init__(seed)

    monkeypatch.setitem(speed.SHAPES, "small", 8)
    monkeypatch.setattr(speed.random, "Random", Recorded)
    speed.main(["--shapes", "small", "--models", "gru,lstm", "--kernels", "manual", "--batch", "2,3",
                "--seq-len", "3", "--rounds", "2", "--warmup", "1", "--variants", "sequence/manual"])
    capsys.readouterr()
    assert len(seeds) == 4 and len(set(seeds)) == 4


def test_autocast_runs_every_forward_under_autocast_and_the_backward_outside(
        speed, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(speed.SHAPES, "small", 8)
    seen = []
    real = speed.train_step

    def spy(module, x):
        seen.append(type(module.module).__name__)
        real(module, x)

    monkeypatch.setitem(speed.STEPS, "train", spy)
    out = tmp_path / "speed.json"
    speed.main(["--shapes", "small", "--models", "lstm", "--kernels", "manual", "--batch", "2",
                "--seq-len", "3", "--rounds", "1", "--warmup", "1", "--no-memory", "--autocast", "bfloat16",
                "--variants", "sequence/manual,weight_drop", "--json", str(out)])
    assert "forward under autocast in bfloat16" in capsys.readouterr().out
    assert set(seen) == {"LSTM", "VariationalLSTM", "WeightDrop"}
    assert [r["variant"] for r in json.loads(out.read_text())["results"]] == ["nn.LSTM", "sequence/manual",
                                                                              "weight_drop"]
    lstm = speed.VariationalLSTM(4, 4, dropout_hidden=0.5, kernel="manual")
    layer = speed.UnderAutocast(lstm, torch.bfloat16)
    output = layer(torch.randn(3, 2, 4))[0]
    assert output.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
    output.float().sum().backward()
    assert layer.module.weight_hh_l0.grad.dtype == torch.float32


def test_variants_times_the_baseline_and_the_variants_named(speed, capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(speed.SHAPES, "small", 8)
    out = tmp_path / "speed.json"
    speed.main(["--shapes", "small", "--models", "lstm", "--kernels", "manual", "--batch", "2",
                "--seq-len", "3", "--rounds", "1", "--warmup", "1", "--no-memory", "--variants",
                "step/manual,batch/fused", "--json", str(out)])
    names = [r["variant"] for r in json.loads(out.read_text())["results"]]
    assert names == ["nn.LSTM", "step/manual", "batch/fused"]


def test_a_variant_that_fails_is_left_out_and_a_failed_case_does_not_stop_the_others(
        speed, capsys, monkeypatch, tmp_path):
    """A lease's first run of a variant (a capture, a launch setting) may fail: that variant is
    left out with a line; a case whose baseline fails is left out and the next cases run; --json
    holds the finished cases and the failures, and the exit code says something failed."""
    monkeypatch.setitem(speed.SHAPES, "small", 8)
    real = speed.with_switches

    def failing(name, fn):
        def call():
            if name == "step/manual" or (name == "nn.LSTM" and failing.batch == 3):
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return fn()
        return real(name, call)

    real_bench = speed.bench_shape

    def bench(model, shape, batch, *args, **kwargs):
        failing.batch = batch
        return real_bench(model, shape, batch, *args, **kwargs)

    monkeypatch.setattr(speed, "with_switches", failing)
    monkeypatch.setattr(speed, "bench_shape", bench)
    out = tmp_path / "speed.json"
    with pytest.raises(SystemExit) as done:
        speed.main(["--shapes", "small", "--models", "lstm", "--kernels", "manual", "--batch", "2,3,4",
                    "--seq-len", "3", "--rounds", "1", "--warmup", "1", "--no-memory", "--variants",
                    "step/manual,batch/fused", "--json", str(out)])
    assert done.value.code == 1
    err = capsys.readouterr().err
    assert "step/manual left out, the first call failed: RuntimeError: CUDA error" in err
    assert "lstm small batch 3: failed, left out: RuntimeError" in err
    saved = json.loads(out.read_text())
    assert [(r["batch"], r["variant"]) for r in saved["results"]] == [
        (2, "nn.LSTM"), (2, "batch/fused"), (4, "nn.LSTM"), (4, "batch/fused")]
    assert [f["batch"] for f in saved["failed"]] == [3] and saved["complete"]


def test_json_holds_the_finished_cases_when_a_run_is_stopped(speed, capsys, monkeypatch, tmp_path):
    """gpu_check.sh's time limits stop speed.py mid-run: the cases done are in --json already."""
    monkeypatch.setitem(speed.SHAPES, "small", 8)
    real_bench = speed.bench_shape

    def bench(model, shape, batch, *args, **kwargs):
        if batch == 3:
            raise KeyboardInterrupt  # what SIGTERM raises too
        return real_bench(model, shape, batch, *args, **kwargs)

    monkeypatch.setattr(speed, "bench_shape", bench)
    out = tmp_path / "speed.json"
    with pytest.raises(SystemExit) as done:
        speed.main(["--shapes", "small", "--models", "gru", "--kernels", "manual", "--batch", "2,3",
                    "--seq-len", "3", "--rounds", "1", "--warmup", "1", "--no-memory", "--json", str(out)])
    assert done.value.code == 130
    saved = json.loads(out.read_text())
    assert {r["batch"] for r in saved["results"]} == {2} and not saved["complete"]


def test_mc_eval_mode_times_forward_passes_with_fresh_masks_and_no_graph(speed, capsys, monkeypatch):
    monkeypatch.setitem(speed.SHAPES, "small", 8)
    seen = []
    real = speed.mc_eval_step

    def spy(module, x):
        real(module, x)
        seen.append(module.training)

    monkeypatch.setitem(speed.STEPS, "mc-eval", spy)
    speed.main(["--shapes", "small", "--models", "lstm", "--kernels", "manual", "--batch", "2",
                "--seq-len", "3", "--rounds", "2", "--warmup", "1", "--mode", "mc-eval"])
    printed = capsys.readouterr().out
    assert "mc-eval" in printed and "sequence/manual" in printed
    assert seen and all(seen)  # the masks are drawn: training mode
    lstm = speed.VariationalLSTM(4, 4, dropout_hidden=0.5, kernel="manual").train()
    x = torch.randn(3, 2, 4)
    with torch.no_grad():
        first, second = lstm(x)[0], lstm(x)[0]
    assert not torch.equal(first, second)  # every call draws fresh masks
    with pytest.raises(SystemExit):
        speed.parse_args(["--mode", "eval"])


def test_the_gpu_line_names_gpu_driver_cuda_torch_and_triton(speed, monkeypatch):
    props = SimpleNamespace(name="Made-up GPU", total_memory=80 * 2**30, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(speed.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout="555.42\n"))
    line = speed.gpu_setup(torch.device("cuda"))
    assert "GPU Made-up GPU (80 GiB, capability 9.0), driver 555.42" in line
    assert f"torch {torch.__version__}" in line
    assert f"Triton {importlib.metadata.version('triton')}" in line

    def no_smi(*args, **kwargs):
        raise subprocess.SubprocessError("no nvidia-smi")

    monkeypatch.setattr(speed.subprocess, "run", no_smi)
    assert "driver ? (no nvidia-smi)" in speed.gpu_setup(torch.device("cuda"))


@pytest.mark.parametrize("choice, cudnn, cublas", [("default", True, False), ("on", True, True),
                                                   ("off", False, False)])
def test_tf32_sets_cudnn_and_cublas_alike_and_the_header_says_so(speed, choice, cudnn, cublas):
    # set and restored by assignment: torch's switch modules answer through __getattr__, which
    # monkeypatch cannot restore
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
    try:
        speed.set_tf32(speed.parse_args(["--tf32", choice]).tf32)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (cudnn, cublas)
        mode = {True: "TF32", False: "IEEE float32"}
        assert speed.float32_products() == (f"float32 products: cuDNN (nn.LSTM / nn.GRU) and the Triton "
                                            f"kernel {mode[cudnn]}, other cuBLAS {mode[cublas]}")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_the_goal_table_checks_time_and_memory(speed):
    """Issue 41's goals: tied masks within 0.5x cuDNN (1.0x at hidden 1500) and no more memory,
    per-gate masks within 10% of tied in the same case, batch-shared masks within 1.05x."""
    def row(variant, hidden, ratio, memory):
        return dict(model="lstm", hidden=hidden, batch=20, variant=variant, ratio=ratio, memory_ratio=memory)

    rows = [
        row("nn.LSTM", 650, 1.0, 1.0),
        row("sequence/triton*", 650, 0.45, 0.9),  # met
        row("sequence/triton*", 200, 0.6, 0.5),  # over 0.5x
        row("sequence/triton*", 1500, 0.9, 1.2),  # time met (1.0x at 1500), memory over cuDNN's
        row("gates/triton*", 650, 0.54, None),  # 1.2x tied's 0.45: over 10%
        row("gates/triton*", 1500, 0.95, None),  # 1.06x tied's 0.9: met
        row("sequence/manual", 650, 5.0, 1.0),  # not the auto kernel: no goal
        row("batch/fused", 650, 1.07, 1.0),  # over 1.05x
    ]
    lines = speed.goal_rows(rows, "triton")
    assert len(lines) == 7  # the header and the six rows with a goal
    assert [line.split()[-1] for line in lines[1:]] == ["yes", "NO", "NO", "NO", "yes", "NO"]
    assert "1.00" in lines[3] and "1.20" in lines[4]


def test_the_graphed_variant_runs_the_triton_kernel_with_graphs_on_for_it_only(speed, monkeypatch):
    variants = speed.build_variants("lstm", 8, 2, 0.5, ["manual", "triton"], "triton")
    assert variants[speed.GRAPHED].kernel == "triton" and "sequence/triton*" in variants
    assert speed.GRAPHED not in speed.build_variants("gru", 8, 2, 0.5, ["manual"], "compiled")
    # the whole layer from CUDA graphs: cuDNN's and the per-sequence masks on kernel="auto"
    assert type(variants["nn.LSTM+graph"]) is torch.nn.LSTM
    whole = variants["sequence+graph"]
    assert whole.kernel == "auto" and whole.mask_scope == "sequence" and whole.dropout_hidden == 0.5
    assert "nn.GRU+graph" not in speed.build_variants("gru", 8, 2, 0.5, ["manual"], "compiled")
    monkeypatch.setattr(speed.cuda_graphs.GRAPHS, "max_graphs", 0)
    seen = []

    def probe():
        seen.append(speed.cuda_graphs.GRAPHS.max_graphs)

    speed.with_switches(speed.GRAPHED, probe)()
    speed.with_switches("sequence/triton*", probe)()
    assert seen == [8, 0] and speed.cuda_graphs.GRAPHS.max_graphs == 0


def test_no_dropout_on_the_loop_compiled_is_a_variant_where_triton_runs(speed):
    """What the LM regimes without a recurrent mask would train at on the loop, compiled: a layer
    without dropout whose recurrence runs the loop all the same (``kernel="triton"``)."""
    variants = speed.build_variants("lstm", 8, 2, 0.5, ["triton"], "triton", compiled=True)
    plain = variants[speed.PLAIN_LOOP]
    assert plain.kernel == "triton" and plain.trains_in_loop()
    assert (plain.dropout_input, plain.dropout_hidden, plain.dropout_output, plain.dropout) == (0, 0, 0, 0)
    on_cpu = speed.build_variants("lstm", 8, 2, 0.5, ["manual"], "compiled", compiled=True)
    assert speed.PLAIN_LOOP not in on_cpu
    assert speed.PLAIN_LOOP not in speed.build_variants("lstm", 8, 2, 0.5, ["triton"], "triton")


def test_the_tuned_variants_ask_for_their_launch_setting_for_themselves_only(speed):
    from rnndrop.kernels import persistent

    variants = speed.build_variants("gru", 8, 2, 0.5, ["triton"], "triton")
    assert variants[speed.RESIDENT].kernel == variants[speed.SPREAD].kernel == "triton"
    seen = []

    def probe():
        seen.append(dict(persistent.tuning))

    for name in (speed.RESIDENT, speed.SPREAD, speed.UNSPREAD, speed.HALF, "sequence/triton*"):
        speed.with_switches(name, probe)()
    assert seen == [{"resident": True}, {"spread": True}, {"spread": False}, {"half_state": True}, {}]
    assert persistent.tuning == {}


def test_the_persistent_plan_of_a_shape_is_named_on_cuda_and_nothing_elsewhere(speed, monkeypatch):
    from rnndrop.kernels import persistent

    assert speed.persistent_plan(torch.zeros(35, 20, 200), 20) == ""
    monkeypatch.setattr(persistent, "_multiprocessors", lambda device: 132)
    on_cuda = SimpleNamespace(device=torch.device("cuda", 0), shape=(35, 128, 650),
                              new_empty=lambda *shape: SimpleNamespace(dtype=torch.float32,
                                                                       device=torch.device("cuda", 0),
                                                                       numel=lambda: 0))
    gru = speed.persistent_plan(on_cuda, 128, "gru")
    assert gru == "; persistent loop: 41 x 2 programs of 16 units x 64 rows"
    # the LSTM's programs spread over the multiprocessors the row blocks leave (persistent.SPREAD)
    assert speed.persistent_plan(on_cuda, 128) == "; persistent loop: 55 x 2 programs of 12 units x 64 rows"
    monkeypatch.setattr(persistent, "_multiprocessors", lambda device: 4)  # 650 units do not fit
    assert speed.persistent_plan(on_cuda, 128) == "; persistent loop: no (the step kernel runs)"


def test_mc_predict_mode_times_samples_through_mc_predict_per_sample(speed, capsys, monkeypatch, tmp_path):
    """``--mode mc-predict``: each variant's call draws ``--samples`` samples through
    ``rnndrop.mc.mc_predict`` (the baseline's call is one inference forward), and every time is per
    sample."""
    monkeypatch.setitem(speed.SHAPES, "small", 8)
    drawn, real = [], speed.mc_predict

    def spy(module, x, **kwargs):
        drawn.append(kwargs["n_samples"])
        return real(module, x, **kwargs)

    monkeypatch.setattr(speed, "mc_predict", spy)
    out = tmp_path / "speed.json"
    speed.main(["--shapes", "small", "--models", "lstm", "--kernels", "manual", "--batch", "2",
                "--seq-len", "3", "--rounds", "2", "--warmup", "1", "--mode", "mc-predict", "--samples", "3",
                "--variants", "sequence/manual", "--json", str(out)])
    rows = {r["variant"].rstrip("*"): r for r in json.loads(out.read_text())["results"]}
    assert drawn == [3, 3, 3]  # the variant alone draws: its first call, then one a round
    assert rows["nn.LSTM"]["samples_per_call"] == 1 and rows["sequence/manual"]["samples_per_call"] == 3
    assert "times per sample" in capsys.readouterr().out
    drawn.clear()  # one sample a call is still drawn through mc_predict (it timed mc-eval's step)
    speed.main(["--shapes", "small", "--models", "lstm", "--kernels", "manual", "--batch", "2",
                "--seq-len", "3", "--rounds", "1", "--warmup", "1", "--mode", "mc-predict", "--samples", "1",
                "--variants", "sequence/manual", "--no-memory"])
    assert drawn == [1, 1]
    with pytest.raises(SystemExit):
        speed.parse_args(["--mode", "mc-predict", "--samples", "0"])
    with pytest.raises(SystemExit):  # it wrote nothing, silently
        speed.parse_args(["--count-ops", "--json", str(tmp_path / "ops.json")])
    assert "--count-ops prints the ops per step and exits: it writes no --json" in capsys.readouterr().err


def test_the_k_block_and_pipeline_each_persistent_launch_kept_are_named_once(speed, monkeypatch):
    """What ``persistent._run`` fitted into shared memory, once per launch shape (a GPU run's log
    says where a launch took a narrower K block or a shallower pipeline than planned)."""
    pytest.importorskip("triton")
    from rnndrop.kernels import persistent

    key = ("_lstm_forward", (("BB", 128), ("BK", 64), ("MASK_GATES", 4)), 8, torch.float32, 3, False)
    other = ("_gru_backward", (("BB", 16), ("BK", 64), ("MASK_GATES", 1)), 4, torch.float32, 3, False)
    monkeypatch.setattr(persistent, "_stages", {key: (32, 3), other: None})
    shown: set = set()
    assert speed.fitted_pipelines(shown) == ("lstm_forward (rows 128, mask gates 4, K 64): K 32 x 3 stages; "
                                             "gru_backward (rows 16, mask gates 1, K 64): nothing fits")
    assert speed.fitted_pipelines(shown) == ""
