"""The "triton" loop kernel (a cuBLAS product and a fused Triton kernel per step) against the
reference kernel, forward and backward, for every mask kind and layout, in the layers and under
autocast.

Not collected by the default run: ``tests/test_triton_kernel.py`` runs this file in a subprocess,
under Triton's interpreter on CPU tensors where there is no GPU (``TRITON_INTERPRET=1`` must be set
before Triton is imported, and ``import torch._dynamo``, which ``import rnndrop`` runs, imports
it), and compiled on CUDA tensors where there is one. By hand::

    TRITON_INTERPRET=1 python -m pytest tests/triton_checks.py    # CPU
    python -m pytest tests/triton_checks.py                        # GPU
"""

import contextlib
import random
import warnings

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

from rnndrop import VariationalGRU, VariationalLSTM
from rnndrop.kernels import get_kernel, gpu, persistent, triton_gru, triton_lstm
from rnndrop.kernels.cuda_graphs import GraphCache
from rnndrop.kernels.first_order import SecondOrderGradientError
from rnndrop.kernels.triton_plan import interpreted
from tests import helpers
from tests.helpers import assert_close, fake_capture

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported")



@pytest.fixture(scope="module", autouse=True)
def device():
    """CUDA where there is a GPU, else CPU tensors under Triton's interpreter."""
    if not torch.cuda.is_available() and not interpreted():
        pytest.fail("without a GPU this file runs under TRITON_INTERPRET=1 (see tests/test_triton_kernel.py)")
    gpu.load()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def ieee_float32():
    """Float32 products in IEEE float32 (cuDNN's switch, which the persistent loop follows, is on by
    default: TF32 keeps 10 bits of mantissa), so that 1e-5 against the reference means something."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


def inputs(kind, batch_sizes, mask_shape, proj, device, dtype=torch.float64, mask_grad=True, H=helpers.H):
    """``helpers.kernel_inputs`` on ``device``; float32 weights on nn.LSTM's scale (1 / sqrt(size)):
    unscaled random weights saturate the gates and amplify float32 rounding beyond 1e-5."""
    args = helpers.kernel_inputs(kind, batch_sizes, mask_shape, proj, dtype=dtype, mask_grad=mask_grad, H=H)
    if dtype == torch.float32:
        with torch.no_grad():
            for weight in args[3:5] if kind == "lstm" else args[2:3]:
                if weight is not None:
                    weight /= weight.shape[1] ** 0.5
    return [None if a is None else a.detach().to(device).requires_grad_(a.requires_grad) for a in args]


def run(name, kind, batch_sizes, args, reverse, output_only=False):
    """Outputs and the gradients of a random functional of them (of the output alone, the final
    states without a gradient, where ``output_only``), on CPU."""
    outputs = get_kernel(name, kind)(args[0], batch_sizes, *args[1:], reverse)
    g = torch.Generator().manual_seed(1)
    # drawn in float32 whatever the outputs' dtype: CPU draws in bfloat16 / float16 follow another
    # path and give other numbers, and the low-precision runs must see the reference's functional
    loss = sum((o * torch.randn(o.shape, generator=g).to(o.device, o.dtype)).sum()
               for o in (outputs[:1] if output_only else outputs))
    leaves = [a for a in args if a is not None and a.requires_grad]
    return [o.cpu() for o in outputs], [d.cpu() for d in torch.autograd.grad(loss, leaves)]


def compare(kind, batch_sizes, mask_shape, proj, reverse, device, dtype, mask_grad=True, tol=1e-10):
    args = inputs(kind, batch_sizes, mask_shape, proj, device, dtype, mask_grad)
    ours = run("triton", kind, batch_sizes, args, reverse)
    ref = run("autograd", kind, batch_sizes, args, reverse)
    assert len(ours[1]) == len(ref[1])
    where = f"{kind} {batch_sizes} mask {mask_shape} proj {proj} reverse {reverse} mask_grad {mask_grad}"
    assert_close(ours, ref, atol=tol, rtol=tol, msg=where)


# ------------------------------------------------ the kernel against the reference kernel


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_every_mask_kind_and_layout_matches_reference_in_float64(kind, reverse, device):
    """Every mask shape (shared / per gate, T' and B' in {1, full}) on two packed layouts, with a
    projection on every other case, with and without the mask's gradient; outputs, final states
    and the gradients of every input."""
    for i, mask_shape in enumerate(helpers.MASK_SHAPES):
        for batch_sizes in (helpers.BATCH_SIZES[i % 4], helpers.BATCH_SIZES[(i + 1) % 4]):
            proj = 3 if kind == "lstm" and i % 2 else 0
            compare(kind, batch_sizes, mask_shape, proj, reverse, device, torch.float64, mask_grad=i % 3 != 2)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_every_mask_kind_and_layout_matches_reference_in_float32(kind, device):
    """The same at 1e-5 in float32, each mask shape with another layout and direction (the first:
    no mask, a projection, sequences joining in reverse direction)."""
    for i, mask_shape in enumerate(helpers.MASK_SHAPES):
        proj = 3 if kind == "lstm" and i % 3 == 0 else 0
        compare(kind, helpers.BATCH_SIZES[(i + 1) % 4], mask_shape, proj, i % 2 == 0, device, torch.float32,
                tol=1e-5)


def persistent_calls(monkeypatch) -> list[str]:
    """The names of the persistent loop's kernels launched from now on."""
    calls: list[str] = []
    launch = persistent._run

    def spy(kernel, *args, **kwargs):
        calls.append(kernel.__name__ if hasattr(kernel, "__name__") else str(kernel))
        return launch(kernel, *args, **kwargs)

    monkeypatch.setattr(persistent, "_run", spy)
    return calls


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_persistent_loop_over_several_programs_matches_reference(kind, device, monkeypatch):
    """Three programs of 16 hidden units (40 units: the last program's block runs past the end) for
    every mask shape, both directions, with and without the mask's gradient, at 1e-5 in float32: on
    a GPU one launch per pass with a grid barrier between steps, under the interpreter one launch
    per step (programs run one after another there, so a barrier would wait for ever)."""
    calls = persistent_calls(monkeypatch)
    with persistent.launched_as(persistent.Launch(3, 16, per_step=device.type != "cuda")):
        for i, mask_shape in enumerate(helpers.MASK_SHAPES):
            for reverse in (False, True):
                batch_sizes = helpers.BATCH_SIZES[(i + reverse) % 4]
                args = inputs(kind, batch_sizes, mask_shape, 0, device, torch.float32, i % 3 != 2, H=40)
                where = f"{kind} {batch_sizes} mask {mask_shape} reverse {reverse}"
                ours = run("triton", kind, batch_sizes, args, reverse)
                assert_close(ours, run("autograd", kind, batch_sizes, args, reverse), atol=1e-5, rtol=1e-5,
                             msg=where)
    assert calls.count(f"_{kind}_forward") == calls.count(f"_{kind}_backward") == 2 * len(helpers.MASK_SHAPES)


def check_every_mask_shape(kind, how, batch_sizes, device, reverse_first=False, H=40, shapes=None):
    """The loop launched as ``how`` against the reference kernel at 1e-5 in float32, for every mask
    shape (or those of ``shapes``): the directions in turn (reversed first where ``reverse_first``),
    the mask's gradient asked for two shapes in three."""
    with persistent.launched_as(how):
        for i, mask_shape in enumerate(helpers.MASK_SHAPES if shapes is None else shapes):
            reverse = i % 2 == (0 if reverse_first else 1)
            args = inputs(kind, batch_sizes, mask_shape, 0, device, torch.float32, i % 3 != 2, H=H)
            ours = run("triton", kind, batch_sizes, args, reverse)
            assert_close(ours, run("autograd", kind, batch_sizes, args, reverse), atol=1e-5, rtol=1e-5,
                         msg=f"{kind} {how} mask {mask_shape} reverse {reverse}")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_every_vector_width_of_the_hidden_size_matches_reference(kind, device, monkeypatch):
    """Hidden sizes whose largest power-of-two divisor (the loops' ``VEC``: rows of ``W_hh``, of the
    gates and of the masked states loaded in vectors of that many values) is 1, 2, 4, 8 and 16, over
    three programs of 16 units, tied and per-gate masks (masked states ``G·H`` values a row), both
    directions, at 1e-5 in float32."""
    calls = persistent_calls(monkeypatch)
    hidden_sizes = (17, 18, 20, 24, 48)
    assert [persistent._vector(H) for H in hidden_sizes] == [1, 2, 4, 8, 16]
    with persistent.launched_as(persistent.Launch(3, 16, per_step=device.type != "cuda")):
        for H in hidden_sizes:
            for mask_shape, reverse in (((1, "B", "P"), False), (("T", "B", "G", "P"), True)):
                batch_sizes = [4, 3, 3, 1]
                args = inputs(kind, batch_sizes, mask_shape, 0, device, torch.float32, True, H=H)
                ours = run("triton", kind, batch_sizes, args, reverse)
                assert_close(ours, run("autograd", kind, batch_sizes, args, reverse), atol=1e-5, rtol=1e-5,
                             msg=f"{kind} H {H} mask {mask_shape}")
    assert calls.count(f"_{kind}_forward") == calls.count(f"_{kind}_backward") == 2 * len(hidden_sizes)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_programs_that_own_fewer_units_than_their_tile_match_reference(kind, device, monkeypatch):
    """Programs of 12 units in tiles 16 wide (``persistent.SPREAD``: program ``p`` owns units
    ``12p .. 12p + 11``, and row block ``p div 4``): four programs over 40 units, then with two
    blocks of rows (20 sequences, packed), every mask shape, both directions, at 1e-5 in float32
    (one launch per step under the interpreter)."""
    calls = persistent_calls(monkeypatch)
    per_step = device.type != "cuda"
    for how, batch_sizes in ((persistent.Launch(4, 12, per_step=per_step), [4, 3, 3, 1]),
                             (persistent.Launch(4, 12, per_step=per_step, row_blocks=2), [20, 20, 17, 9, 2])):
        assert persistent._tiles(how, batch_sizes[0], 40, False)["BH"] == 16
        check_every_mask_shape(kind, how, batch_sizes, device)
    assert calls.count(f"_{kind}_forward") == calls.count(f"_{kind}_backward") == 2 * len(helpers.MASK_SHAPES)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_programs_of_32_and_64_units_match_reference(kind, device, monkeypatch):
    """Programs of 32 units (three over 80: the last block runs past the end) and of 64 units (two over
    100, two blocks of rows of 20 packed sequences): what ``persistent.plan`` launches on a GPU of
    fewer multiprocessors than hidden units / 16 (a T4's 40 at hidden 650, an L4's 58 at 1500; an
    H100's 132 past hidden 2112). A tied mask and a per-step mask a gate with their gradients, and no
    mask (the masked states' three layouts), both directions, at 1e-5 in float32 (one launch per
    step under the interpreter)."""
    calls = persistent_calls(monkeypatch)
    per_step = device.type != "cuda"
    wide = persistent.Launch(2, 64, per_step=per_step, row_blocks=2)
    for how, batch_sizes, H in ((persistent.Launch(3, 32, per_step=per_step), [4, 3, 3, 1], 80),
                                (wide, [20, 20, 17, 9, 2], 100)):
        assert persistent._tiles(how, batch_sizes[0], H, False)["BH"] == how.units
        check_every_mask_shape(kind, how, batch_sizes, device, H=H,
                               shapes=[(1, "B", "P"), ("T", "B", "G", "P"), None])
    assert calls.count(f"_{kind}_forward") == calls.count(f"_{kind}_backward") == 6


def mask_shape_cases(kind, device, shift):
    """``(how, mask shape, reverse, batch sizes, kernel inputs)`` of every mask shape (directions and
    layouts in turn, ``shift`` picking which come first), run inside ``launched_as(how)``: three
    programs (a launch a step under the interpreter, which keeps the running state in memory) and,
    under the interpreter, one (one launch a pass); float32, 40 units."""
    programs = [persistent.Launch(3, 16, per_step=device.type != "cuda")]
    if device.type != "cuda":
        programs.append(persistent.Launch(1, 64))
    for how in programs:
        with persistent.launched_as(how):
            for i, mask_shape in enumerate(helpers.MASK_SHAPES):
                reverse, batch_sizes = i % 2 == 1 - shift, helpers.BATCH_SIZES[(i + shift) % 4]
                args = inputs(kind, batch_sizes, mask_shape, 0, device, torch.float32, i % 3 != 2, H=40)
                yield how, mask_shape, reverse, batch_sizes, args


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_backward_without_final_state_gradients_starts_from_zeros_of_its_own(kind, device, monkeypatch):
    """A loss of the output alone (the usual training step): the backward loop starts its running
    gradients from zeros of its own instead of a filled buffer, in one program and in three, every
    mask shape, both directions, at 1e-5 in float32."""
    calls = persistent_calls(monkeypatch)
    runs = 0
    for how, mask_shape, reverse, batch_sizes, args in mask_shape_cases(kind, device, 0):
        ours = run("triton", kind, batch_sizes, args, reverse, output_only=True)
        assert_close(ours, run("autograd", kind, batch_sizes, args, reverse, output_only=True),
                     atol=1e-5, rtol=1e-5, msg=f"{kind} {how} mask {mask_shape} reverse {reverse}")
        runs += 1
    programs = 2 if device.type != "cuda" else 1
    assert calls.count(f"_{kind}_backward") == runs == programs * len(helpers.MASK_SHAPES)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_masked_states_read_in_float16_round_only_the_products(kind, device, monkeypatch):
    """``tuning["half_state"]``: the forward loop's products read the masked states from a float16
    copy. Against the reference kernel every output and gradient is within float16's rounding of
    the states (TF32 rounds them the same where they are normal), yet not equal to the float32
    reading (the copy is what ran); backward still reads the float32 states. One and three
    programs, every mask shape, both directions; a mask a step (``T' > 1``) reads float32 as without
    the setting (the loop checks float16's range of one mask before the first step)."""
    calls = persistent_calls(monkeypatch)
    runs = 0
    for how, mask_shape, reverse, batch_sizes, args in mask_shape_cases(kind, device, 1):
        exact = run("triton", kind, batch_sizes, args, reverse)
        monkeypatch.setitem(persistent.tuning, "half_state", True)
        half = run("triton", kind, batch_sizes, args, reverse)
        monkeypatch.delitem(persistent.tuning, "half_state")
        where = f"{kind} {how} mask {mask_shape} reverse {reverse}"
        assert_close(half, run("autograd", kind, batch_sizes, args, reverse), atol=2e-3, rtol=2e-3, msg=where)
        per_step = mask_shape is not None and mask_shape[0] == "T" and len(batch_sizes) > 1
        assert all(map(torch.equal, half[0], exact[0])) == per_step, where
        runs += 2
    programs = 2 if device.type != "cuda" else 1
    assert calls.count(f"_{kind}_forward") == runs == 2 * programs * len(helpers.MASK_SHAPES)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_masked_states_beyond_float16_are_read_in_float32_by_every_program(kind, device, monkeypatch):
    """``tuning["half_state"]`` where a masked state could leave float16's range (beyond 65504): a
    mask value of 1e5 in the last program's block (tied masks, shared by the batch, per gate), or no
    mask and an initial state of 1e5 there. Every program then reads the float32 states: outputs and
    gradients equal the float32 reading bit for bit. One program, and three (a launch a step under
    the interpreter, where the first launch's flag reaches the later ones)."""
    programs = [persistent.Launch(3, 16, per_step=device.type != "cuda")]
    if device.type != "cuda":
        programs.append(persistent.Launch(1, 64))
    batch_sizes = [4, 3, 3, 1]
    for how in programs:
        for mask_shape in (None, (1, "B", "P"), (1, 1, "P"), (1, "B", "G", "P")):
            args = inputs(kind, batch_sizes, mask_shape, 0, device, torch.float32, mask_grad=True, H=40)
            with torch.no_grad():
                if mask_shape is None:
                    args[1][-1, -1] = 1e5  # h_0: the last sequence's last unit
                else:
                    args[-1][(0,) * (args[-1].dim() - 1) + (-1,)] = 1e5
            with persistent.launched_as(how):
                exact = run("triton", kind, batch_sizes, args, False)
                monkeypatch.setitem(persistent.tuning, "half_state", True)
                half = run("triton", kind, batch_sizes, args, False)
                monkeypatch.delitem(persistent.tuning, "half_state")
            where = f"{kind} {how} mask {mask_shape}"
            assert all(map(torch.equal, half[0], exact[0])), where
            assert all(map(torch.equal, half[1], exact[1])), where
            assert all(torch.isfinite(t).all() for t in exact[0]), where


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_persistent_loop_over_blocks_of_rows_matches_reference(kind, device, monkeypatch):
    """Two blocks of 16 rows times three blocks of 16 units (20 sequences, 40 units: the last block
    of each runs past the end), packed sequences that leave the second row block before the end,
    every mask shape, both directions, at 1e-5 in float32 (one launch per step under the
    interpreter)."""
    calls = persistent_calls(monkeypatch)
    how = persistent.Launch(3, 16, per_step=device.type != "cuda", row_blocks=2)
    check_every_mask_shape(kind, how, [20, 20, 17, 9, 2], device)
    assert calls.count(f"_{kind}_forward") == calls.count(f"_{kind}_backward") == len(helpers.MASK_SHAPES)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_resident_weight_tiles_match_reference(kind, device, monkeypatch):
    """With ``W_hh``'s tiles loaded once per launch and kept across steps (``Launch.resident``), over
    three programs and two blocks of rows, packed sequences, every mask shape (per-gate masks take
    backward's gate-by-gate sums), both directions, at 1e-5 in float32; every launch was resident."""
    constexprs = []
    launch = persistent._run

    def spy(kernel, how, steps, args, backward, **kwargs):
        constexprs.append((kwargs["RESIDENT"], kwargs["BK"]))
        return launch(kernel, how, steps, args, backward, **kwargs)

    monkeypatch.setattr(persistent, "_run", spy)
    how = persistent.Launch(3, 16, per_step=device.type != "cuda", row_blocks=2, resident=True)
    check_every_mask_shape(kind, how, [20, 20, 17, 9, 2], device, reverse_first=True)
    assert len(constexprs) == 2 * len(helpers.MASK_SHAPES) and set(constexprs) == {(True, 64)}


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_forward_without_autograd_keeps_nothing_for_backward_and_matches(kind, device, monkeypatch):
    """Under ``torch.no_grad`` (Monte-Carlo sampling) the persistent loop writes none of the buffers
    backward reads, and no autograd Function runs: the same outputs as a forward that keeps them."""
    kept = []
    real = getattr(persistent, f"{kind}_forward")

    def spy(*args, keep=True):
        kept.append(keep)
        return real(*args, keep=keep)

    monkeypatch.setattr(persistent, f"{kind}_forward", spy)
    recurrence = get_kernel("triton", kind)
    sizes = [20, 17, 9]
    with persistent.launched_as(persistent.Launch(3, 16, per_step=device.type != "cuda", row_blocks=2)):
        for mask_shape in helpers.MASK_SHAPES:
            args = inputs(kind, sizes, mask_shape, 0, device, torch.float32, True, H=40)
            expected = recurrence(args[0], sizes, *args[1:], True)
            with torch.no_grad():
                got = recurrence(args[0], sizes, *args[1:], True)
            assert all(o.grad_fn is None for o in got) and all(e.grad_fn is not None for e in expected)
            assert_close(got, [e.detach() for e in expected], atol=0, rtol=0, msg=str(mask_shape))
    assert kept == [True, False] * len(helpers.MASK_SHAPES)


def test_persistent_loop_runs_where_it_can_and_the_step_kernel_elsewhere(device, monkeypatch):
    """float32 and half types without a projection run persistent; float64 and a projection run the
    step kernel, and a batch over ``MAX_BATCH`` does under the interpreter (on a GPU it runs in
    blocks of rows); ``turned_off`` sends everything to the step kernel."""
    calls = persistent_calls(monkeypatch)
    big = persistent.MAX_BATCH + 1
    for dtype, proj, sizes, expected in [
        (torch.float32, 0, [3, 2], 2), (torch.float16, 0, [3, 2], 2), (torch.float64, 0, [3, 2], 0),
        (torch.float32, 3, [3, 2], 0), (torch.float32, 0, [big, 1], 2 if device.type == "cuda" else 0),
    ]:
        calls.clear()
        args = inputs("lstm", sizes, (1, "B", "P"), proj, device, dtype, H=16)
        run("triton", "lstm", sizes, args, False)
        assert len(calls) == expected, (dtype, proj, sizes, calls)
    calls.clear()
    with persistent.turned_off():
        run("triton", "gru", [3, 2], inputs("gru", [3, 2], None, 0, device, torch.float32, H=16), False)
    assert calls == []


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_per_step_masks_beyond_32_bit_offsets_run_the_step_kernel(kind, device, monkeypatch):
    """A packed batch's per-step masks span its longest sequence for every row: masks beyond
    ``MAX_ELEMENTS`` (lowered here between the gates' size and the masks') send the call, forward
    and backward, to the step kernel, whose offsets stay within a step, and it matches."""
    calls = persistent_calls(monkeypatch)
    sizes = [3, 1, 1, 1]  # gates [6, G * 16], per-gate per-step masks [4, 3, G, 16]
    monkeypatch.setattr(persistent, "MAX_ELEMENTS", 500)  # LSTM gates 384 (GRU 288) < 500 <= masks
    args = inputs(kind, sizes, ("T", "B", "G", "P"), 0, device, torch.float32, H=16)
    assert args[0].numel() < 500 <= args[-1].numel()
    ours = run("triton", kind, sizes, args, False)
    assert calls == []
    assert_close(ours, run("autograd", kind, sizes, args, False), atol=1e-5, rtol=1e-5)
    run("triton", kind, sizes, inputs(kind, sizes, (1, "B", "G", "P"), 0, device, torch.float32, H=16), False)
    assert len(calls) == 2  # a mask of the whole sequence runs persistent


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_each_cell_plans_its_launches_as_itself(kind, device, monkeypatch):
    """A cell's measured launch settings apply to its calls alone (``persistent.SPREAD``: the
    LSTM's programs spread over idle multiprocessors, not the GRU's): forward and backward plan
    their launches naming their cell."""
    cells, plan = [], persistent.plan
    monkeypatch.setattr(persistent, "plan", lambda *args, **kwargs: cells.append(kwargs.get("cell"))
                        or plan(*args, **kwargs))
    args = inputs(kind, [3, 2], (1, "B", "P"), 0, device, torch.float32, H=16)
    run("triton", kind, [3, 2], args, False)  # autograd's: backward runs forward's plan
    assert cells == [kind]
    module = triton_lstm if kind == "lstm" else triton_gru  # the traced operators' two passes
    with torch.no_grad():
        forward = module.forward_saving(args[0], [3, 2], *args[1:], False, True)
        out, saved, states = forward[0], forward[-1], len(forward) - 2
        module.backward_saved([3, 2], False, [a is not None for a in args], *args[1:], out, saved,
                              torch.ones_like(out), *[None] * states)
    assert cells == [kind] * 3


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_barrier_that_gives_up_reruns_the_step_kernel_with_one_warning(kind, device, monkeypatch):
    """A launch whose barrier gave up (simulated: the launch reports it) is rerun by the step kernel,
    right, with one warning; later calls on the device go to the step kernel directly."""
    monkeypatch.setattr(persistent, "_given_up", set())
    launches = []

    def gives_up(kernel, *args, **kwargs):
        launches.append(kernel)
        return "a grid barrier gave up waiting"

    monkeypatch.setattr(persistent, "_launch", gives_up)
    args = inputs(kind, [4, 3, 3, 1], ("T", "B", "P"), 0, device, torch.float32, H=16)
    with pytest.warns(RuntimeWarning, match="persistent 'triton' loop failed on .*grid barrier gave up"):
        ours = run("triton", kind, [4, 3, 3, 1], args, True)
    assert_close(ours, run("autograd", kind, [4, 3, 3, 1], args, True), atol=1e-5, rtol=1e-5)
    assert not persistent.usable(device) and len(launches) == 1  # the backward did not try either
    run("triton", kind, [4, 3, 3, 1], args, True)
    assert len(launches) == 1  # nor does a later call


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_shape_that_fits_no_shared_memory_runs_the_step_kernel_on_a_device_kept(kind, device, monkeypatch):
    """A forward loop whose loads fit no shared memory at any K block and depth (simulated: every
    launch of it runs out) is that shape's failure: the call runs the step kernel, right, with one
    warning; the device keeps the persistent loop, and the other cell's calls still launch it."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(persistent, "_given_up", set())
    monkeypatch.setattr(persistent, "_stages", {})
    tried = []

    class DoesNotFit:
        __name__ = f"_{kind}_forward"

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tried.append((kwargs["BK"], kwargs["num_stages"]))
                raise OutOfResources(300_000, 232_448, "shared memory")
            return launch

    monkeypatch.setattr(persistent, f"_{kind}_forward", DoesNotFit())
    calls = persistent_calls(monkeypatch)
    sizes = [4, 3, 3, 1]
    args = inputs(kind, sizes, ("T", "B", "P"), 0, device, torch.float32, H=16)
    with pytest.warns(RuntimeWarning, match=f"_{kind}_forward .* fits no shared memory .* of this shape"):
        ours = run("triton", kind, sizes, args, True)
    assert_close(ours, run("autograd", kind, sizes, args, True), atol=1e-5, rtol=1e-5)
    assert persistent.usable(device) and calls == [f"_{kind}_forward"] and tried
    tried.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        run("triton", kind, sizes, args, True)
        assert tried == []  # remembered: not tried again
        other = "gru" if kind == "lstm" else "lstm"
        other_args = inputs(other, sizes, ("T", "B", "P"), 0, device, torch.float32, H=16)
        run("triton", other, sizes, other_args, True)
    assert calls[-2:] == [f"_{other}_forward", f"_{other}_backward"]


def test_persistent_loop_follows_cudnns_tf32_switch(device):
    """Float32 products in TF32 on CUDA exactly when ``torch.backends.cudnn.allow_tf32`` is on (torch's
    default, which nn.LSTM follows), IEEE otherwise and for other dtypes; on a GPU the TF32 run is
    within 2e-2 of the IEEE one and not equal to it."""
    from types import SimpleNamespace

    cuda32 = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    cuda16 = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    cpu32 = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    for allowed, expected in ((True, "tf32"), (False, "ieee")):
        torch.backends.cudnn.allow_tf32 = allowed
        assert persistent._precision(cuda32) == expected
        assert persistent._precision(cuda16) == persistent._precision(cpu32) == "ieee"
    torch.backends.cudnn.allow_tf32 = False
    if device.type != "cuda":
        return
    args = inputs("lstm", [20] * 8, (1, "B", "P"), 0, device, torch.float32, H=200)
    ieee = run("triton", "lstm", [20] * 8, args, False)
    torch.backends.cudnn.allow_tf32 = True
    tf32 = run("triton", "lstm", [20] * 8, args, False)
    assert_close(tf32, ieee, atol=2e-2, rtol=2e-2)
    assert not torch.equal(tf32[0][0], ieee[0][0])


def assert_close_in_norm(actual, expected, tol, msg=""):
    """Each tensor of the nested lists ``actual`` within ``tol`` of ``expected``'s in relative norm,
    ``||a - e|| <= tol ||e||``: reduced precision rounds the entries near zero of a gradient past any
    elementwise tolerance, while a wrong loop is off by the size of the values."""
    if isinstance(actual, (list, tuple)):
        assert len(actual) == len(expected), msg
        for a, e in zip(actual, expected):
            assert_close_in_norm(a, e, tol, msg)
        return
    error = ((actual.float() - expected).norm() / expected.norm().clamp_min(1e-30)).item()
    assert error <= tol, f"{msg}: relative error {error:.3g} over {tol}"


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("hidden, resident", [(8, False), (16, False), (16, True)])
def test_one_program_loops_match_the_reference_in_ieee_and_tf32(kind, hidden, resident, device):
    """One program (a batch of 16 or fewer at a hidden size of one ``K`` block the compiler knows,
    ``H_VEC`` 1; tiles streamed or resident): no loop inside a step and no grid barrier, so the time
    loop is the innermost loop feeding ``tl.dot``, which Triton pipelines unless told not to, loading
    states before they are stored (an H200's bfloat16 outputs at hidden 8 and 16 were unrelated to
    the reference's; IEEE float32 and TF32 compiled to the same early loads). Against the float32
    reference, forward and backward: IEEE products at 1e-5, TF32 within its rounding."""
    batch_sizes = [6, 6, 5, 3, 3, 1]
    args = inputs(kind, batch_sizes, ("T", "B", "P"), 0, device, torch.float32, mask_grad=False, H=hidden)
    ref = run("autograd", kind, batch_sizes, args, False)
    with persistent.tuned(resident=resident):
        ieee = run("triton", kind, batch_sizes, args, False)
        torch.backends.cudnn.allow_tf32 = True  # put back by the ieee_float32 fixture
        tf32 = run("triton", kind, batch_sizes, args, False)
    assert_close(ieee, ref, atol=1e-5, rtol=1e-5)
    assert_close_in_norm(tf32, ref, 1e-2, "tf32")


@pytest.mark.parametrize("seed", range(8))
def test_reduced_precision_at_random_shapes_matches_the_reference(seed, device):
    """TF32 float32 (torch's default on CUDA), bfloat16 and float16 (autocast): the loop's
    tensor-core products, which the IEEE float32 checks above never run, at a random cell, hidden size,
    packed layout, mask kind, direction and launch setting, against the float32 reference kernel
    (IEEE): outputs, final states and gradients within the precision's rounding in relative norm
    (bfloat16 under 1.3e-2 at these draws, float16 under 1e-3, run under the interpreter with the
    products from half loads, as tensor cores compute them). Under the interpreter, small shapes."""
    rng = random.Random(seed)
    cuda = device.type == "cuda"
    kind = rng.choice(["lstm", "gru"])
    hidden = rng.choice([8, 16, 24, 48] + ([200, 650] if cuda else []))
    lengths = sorted((rng.randint(1, 9) for _ in range(rng.randint(1, 40 if cuda else 6))), reverse=True)
    batch_sizes = [sum(length > t for length in lengths) for t in range(lengths[0])]
    mask_shape, reverse = rng.choice(helpers.MASK_SHAPES), rng.random() < 0.5
    setting = rng.choice([{}, {"resident": True}, {"spread": True}])
    args = inputs(kind, batch_sizes, mask_shape, 0, device, torch.float32, mask_grad=False, H=hidden)
    ref = run("autograd", kind, batch_sizes, args, reverse)
    where = f"seed {seed}: {kind} hidden {hidden} {batch_sizes} mask {mask_shape} reverse {reverse} {setting}"
    for precision, tol in (("tf32", 1e-2), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)):
        tf32 = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = tf32  # put back by the ieee_float32 fixture
        cast = contextlib.nullcontext() if tf32 else torch.autocast(device.type, dtype=precision)
        with persistent.tuned(**setting), cast:
            ours = run("triton", kind, batch_sizes, args, reverse)
        assert_close_in_norm(ours, ref, tol, f"{where} {precision}")


def test_the_loops_pointers_hold_the_dtypes_kernel_resources_compiles_them_for(monkeypatch, device):
    """Under autocast (bfloat16) every persistent launch of a training step, with a mask and its
    gradient, passes the products' dtype exactly at the pointers ``benchmarks/kernel_resources.py``
    compiles as such (``COMPUTE_POINTERS``, which ``tests/triton_compile.py`` checks the bfloat16
    loops with), and float32 elsewhere. Read from the file: importing it turns the interpreter off."""
    import ast
    import inspect
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_resources.py").read_text()
    table = next(ast.literal_eval(node.value) for node in ast.parse(source).body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "COMPUTE_POINTERS")
    seen: dict[str, set[str]] = {}
    launch = persistent._run

    def spy(kernel, how, steps, args, backward, **constexprs):
        fn = getattr(kernel, "fn", kernel)
        names = [name for name in inspect.signature(fn).parameters][: len(args)]
        pointers = {name: arg for name, arg in zip(names, args) if name.endswith("_ptr")}
        assert all(arg.dtype in (torch.bfloat16, torch.float32, torch.int32) for arg in pointers.values())
        seen[fn.__name__] = {name for name, arg in pointers.items() if arg.dtype == torch.bfloat16}
        return launch(kernel, how, steps, args, backward, **constexprs)

    monkeypatch.setattr(persistent, "_run", spy)
    for kind in ("lstm", "gru"):
        args = inputs(kind, [4, 3, 3, 1], ("T", "B", "P"), 0, device, torch.float32, mask_grad=True, H=16)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            run("triton", kind, [4, 3, 3, 1], args, False)
    assert seen == table


@pytest.mark.parametrize("reverse", [False, True])
def test_gru_without_recurrent_bias_matches_reference(reverse, device):
    for batch_sizes, mask_shape in [([4, 3, 3, 1], None), ([4, 2, 2, 1, 1], (1, "B", "G", "P"))]:
        args = inputs("gru", batch_sizes, mask_shape, 0, device)
        args[3] = None  # b_hh
        ours = run("triton", "gru", batch_sizes, args, reverse)
        ref = run("autograd", "gru", batch_sizes, args, reverse)
        assert len(ours[1]) == len(ref[1]) == (3 if mask_shape is None else 4)
        assert_close(ours, ref, atol=1e-10, rtol=1e-8)


def test_only_wanted_gradients_are_returned(device):
    """Inputs without requires_grad get None (and the others are still right); no gradient of the
    output rows at all (only of the final states) works too."""
    args = inputs("lstm", [3, 2, 1], ("T", "B", "P"), 2, device, mask_grad=False)
    for frozen in (1, 2, 3):
        args[frozen] = args[frozen].detach()
    ours = run("triton", "lstm", [3, 2, 1], args, True)
    assert len(ours[1]) == 2  # gates_x, w_hr
    assert_close(ours, run("autograd", "lstm", [3, 2, 1], args, True), atol=1e-10, rtol=1e-8)
    for kind in ("lstm", "gru"):
        args = inputs(kind, [3, 3, 1], None, 0, device)
        grads = []
        for name in ("triton", "autograd"):
            h_n = get_kernel(name, kind)(args[0], [3, 3, 1], *args[1:], False)[1]
            grads.append(torch.autograd.grad(h_n.sum(), args[0])[0].cpu())
        assert_close(grads[0], grads[1], atol=1e-10, msg=kind)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_graph_of_the_backward_is_refused_not_silently_wrong(cell, device):
    args = inputs(cell, [2, 2], (1, "B", "P"), 0, device)
    out = get_kernel("triton", cell)(args[0], [2, 2], *args[1:], False)[0]
    out.sum().backward()  # first order works
    with pytest.raises(SecondOrderGradientError, match="'triton' loop kernel"):
        torch.autograd.grad(out.pow(2).sum(), args[0], create_graph=True)


# ------------------------------------------------------------------ mixed precision


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_autocast_runs_the_products_in_low_precision_and_the_state_in_float32(kind, device):
    """Under autocast (bfloat16, float16): outputs in autocast's dtype, the LSTM's c_n in float32,
    values and gradients within low-precision rounding of the float32 reference; the same for
    float16 tensors without autocast (c_n then in float16, like c_0)."""
    dtypes = [torch.bfloat16, torch.float16]
    batch_sizes, reverse = [4, 3, 3, 1], True
    args = inputs(kind, batch_sizes, ("T", "B", "P"), 0, device, torch.float32, mask_grad=False, H=16)
    ref = run("autograd", kind, batch_sizes, args, reverse)
    for dtype in dtypes:
        with torch.autocast(device.type, dtype=dtype):
            outputs = get_kernel("triton", kind)(args[0], batch_sizes, *args[1:], reverse)
        assert outputs[0].dtype == dtype and outputs[1].dtype == dtype
        if kind == "lstm":
            assert outputs[2].dtype == torch.float32
        with torch.autocast(device.type, dtype=dtype):
            ours = run("triton", kind, batch_sizes, args, reverse)
        assert all(g.dtype == torch.float32 for g in ours[1])  # the inputs' dtype
        assert_close([[o.float() for o in ours[0]], ours[1]], ref, atol=5e-2, rtol=5e-2, msg=str(dtype))
    half = [None if a is None else a.detach().half().requires_grad_(a.requires_grad) for a in args]
    ours = run("triton", kind, batch_sizes, half, reverse)
    assert all(o.dtype == torch.float16 for o in ours[0]) and all(g.dtype == torch.float16 for g in ours[1])
    assert_close([[o.float() for o in ours[0]], [g.float() for g in ours[1]]], ref, atol=5e-2, rtol=5e-2)


# ------------------------------------------------------------------ in the layers


def forward_and_grads(layer, x, hx, masks):
    out, state = layer(x, hx, masks=masks)
    data = out.data if hasattr(out, "batch_sizes") else out
    states = state if isinstance(state, tuple) else (state,)
    g = torch.Generator().manual_seed(1)
    loss = sum((t * torch.randn(t.shape, generator=g).to(t.device)).sum() for t in (data, *states))
    leaves = [x.data if hasattr(x, "batch_sizes") else x, *(hx if isinstance(hx, tuple) else (hx,))]
    grads = torch.autograd.grad(loss, [*leaves, *layer.parameters()])
    return [t.cpu() for t in (data, *states)], [d.cpu() for d in grads]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_with_masks_matches_autograd_kernel(kind, device):
    """Two bidirectional layers with every mask site, per-sequence, per-step and batch-shared masks,
    shared and per gate, padded and packed, against the same layer on the reference kernel."""
    cls = VariationalLSTM if kind == "lstm" else VariationalGRU
    proj = dict(proj_size=3) if kind == "lstm" else {}
    for scope, per_gate, packed in [("sequence", False, True), ("step", True, False), ("batch", True, True)]:
        ref, ours = (
            cls(helpers.I, helpers.H, num_layers=2, bidirectional=True, mask_scope=scope,
                per_gate_masks=per_gate, dropout=0.4, dropout_input=0.3, dropout_hidden=0.5,
                dropout_output=0.2, kernel=kernel, device=device, **proj)
            for kernel in ("autograd", "triton")
        )
        ours.load_state_dict(ref.state_dict())
        lengths = [3, helpers.T, 1, 5] if packed else [helpers.T] * 4
        masks = ref.sample_masks(len(lengths), helpers.T)
        hx = helpers.initial_state(kind, ours, len(lengths))
        hx = tuple(h.detach().to(device).requires_grad_() for h in hx) if kind == "lstm" else (
            hx.detach().to(device).requires_grad_())
        if packed:
            x = pack_sequence([torch.randn(n, helpers.I, device=device) for n in lengths],
                              enforce_sorted=False)
            x.data.requires_grad_()
        else:
            x = torch.randn(helpers.T, len(lengths), helpers.I, device=device, requires_grad=True)
        assert_close(forward_and_grads(ours, x, hx, masks), forward_and_grads(ref, x, hx, masks),
                     msg=f"scope {scope} per_gate {per_gate} packed {packed}")


# ------------------------------------------------------------------ CUDA graphs


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_loops_replayed_from_graphs_match_eager_ones(kind, device, monkeypatch):
    """Through the graph cache (on a GPU real CUDA graphs; on CPU a stand-in graph that reruns the
    loop on the captured inputs): three calls per case, the second captures, the third replays
    (forward and backward), and every one equals the eager kernel. The backward pass that computes
    the mask's gradient is never captured."""
    import rnndrop.kernels.triton_gru as triton_gru
    import rnndrop.kernels.triton_lstm as triton_lstm

    capture = {} if device.type == "cuda" else dict(capture=fake_capture, can_capture=lambda inputs: True)
    cache = GraphCache(8, **capture)
    cases = [([4, 3, 3, 1], ("T", "B", "P"), 3 if kind == "lstm" else 0, True, False),
             ([3, 3, 3], (1, "B", "G", "P"), 0, False, False), ([4, 2, 1], None, 0, True, False),
             ([3, 2, 2], (1, "B", "P"), 0, False, True)]
    for batch_sizes, mask_shape, proj, reverse, mask_grad in cases:
        args = inputs(kind, batch_sizes, mask_shape, proj, device, mask_grad=mask_grad)
        monkeypatch.setattr(triton_lstm if kind == "lstm" else triton_gru, "GRAPHS", GraphCache(0))
        eager = run("triton", kind, batch_sizes, args, reverse)
        monkeypatch.setattr(triton_lstm if kind == "lstm" else triton_gru, "GRAPHS", cache)
        for _ in range(3):
            assert_close(run("triton", kind, batch_sizes, args, reverse), eager, atol=1e-12, rtol=1e-12)
    passes = [key[0][0].split()[1] for key in cache.graphs]
    assert passes.count("forward") == 4 and passes.count("backward") == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_first_use_check_passes(device, dtype):
    """The check kernel="auto" runs before it first picks the kernel on a device (compiled on a
    GPU, interpreted on CPU), and in a half type before it first runs it in that type under
    autocast, finds nothing wrong."""
    assert gpu.first_use_failure(device, dtype) is None


@pytest.mark.parametrize("per_gate", [False, True])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_the_tuning_scripts_launches_run_the_loops(device, cell, per_gate):
    """benchmarks/persistent_tuning.py's forward and backward launches (one program here) run the
    loop and give what the loop gives, with a tied mask and with one a gate."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "persistent_tuning.py"
    spec = importlib.util.spec_from_file_location("persistent_tuning", path)
    tuning = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tuning)
    inputs = tuning.loop_inputs(cell, 20, 4, device, per_gate)
    assert inputs[-1].shape == ((1, 4, 4 if cell == "lstm" else 3, 20) if per_gate else (1, 4, 20))
    forward, backward = tuning.launches(cell, persistent.Launch(1, 32), *inputs)
    out, d_gates = forward()[0], backward()[0]
    assert out.shape == (35 * 4, 20) and torch.isfinite(out).all()
    assert d_gates.shape == inputs[1].shape and torch.isfinite(d_gates).all() and d_gates.abs().sum() > 0


@pytest.mark.parametrize("seed", range(12))
def test_random_configurations_on_the_triton_kernel(device, seed):
    """``tests/test_random_configurations.py``'s two properties with the layer on the "triton"
    kernel: against nn.LSTM / nn.GRU without dropout or in eval mode, and against another kernel
    with the same masks."""
    from tests import test_random_configurations as random_configurations

    random_configurations.check_without_dropout_or_in_eval_mode(seed, ("triton",), device)
    random_configurations.check_two_kernels_agree(seed, "triton", device)


# ------------------------------------------------ the kernel as torch operators (torch.compile)


@pytest.mark.parametrize("mask", [None, "tied", "per gate"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_operators_pass_opcheck_on_the_triton_kernel(cell, mask, dtype, device):
    """``rnndrop::lstm_recurrence`` / ``gru_recurrence`` on the "triton" kernel: the persistent loop
    in float32, the step kernel in float64; their fake tensors shaped as what either keeps."""
    from tests.test_traced_layers import operator_arguments

    args = operator_arguments(cell, False, mask, False, dtype, kernel="triton", device=device)
    op = torch.ops.rnndrop.lstm_recurrence if cell == "lstm" else torch.ops.rnndrop.gru_recurrence
    torch.library.opcheck(op.default, args, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_a_compiled_layer_on_the_triton_kernel_computes_what_the_eager_one_computes(device, seed):
    """torch.compile (``aot_eager``, one graph) of a training step of a layer on the "triton"
    kernel, against the same layer eagerly with the same masks."""
    from tests.test_traced_layers import compiled_and_eager, traceable_configuration

    c = traceable_configuration(seed, kernels=("triton",))
    c["dtype"] = torch.float32
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        eager, compiled = compiled_and_eager(c, seed, "aot_eager", device=device)
    torch._dynamo.reset()
    assert_close(compiled, eager, atol=1e-5, rtol=1e-5, msg=str(c))


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_compiled_layer_on_the_triton_kernel_under_autocast_computes_the_eager_result(cell, device):
    """Under autocast (bfloat16) a training step of a layer on the "triton" kernel is traced (the
    loop an operator on bfloat16 rows with a float32 state, as a CUDA model under AMP runs it):
    outputs, states and every gradient as eagerly, with the same masks."""
    torch.manual_seed(0)
    layer = (VariationalLSTM if cell == "lstm" else VariationalGRU)(
        4, 8, 2, dropout_input=0.3, dropout_hidden=0.3, dropout_output=0.3, kernel="triton").to(device)
    masks = layer.sample_masks(3, 5, generator=torch.Generator().manual_seed(1), device="cpu")
    masks = masks.map(lambda m: m.to(device))

    def step(x):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out, state = layer(x, None, masks)
        states = state if isinstance(state, tuple) else (state,)
        loss = sum(t.float().pow(2).sum() for t in (out, *states))
        return [out, *states, *torch.autograd.grad(loss, [x, *layer.parameters()])]

    x = torch.randn(5, 3, 4, device=device, requires_grad=True)
    graphs: list = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    expected = step(x)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        actual = torch.compile(step, backend=keep)(x)
    torch._dynamo.reset()
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert f"rnndrop.{cell}_recurrence.default" in targets, targets
    assert [t.dtype for t in actual] == [t.dtype for t in expected]
    # the same kernels either way; on a GPU cuBLAS may pick another algorithm for a product of the
    # other run, which bfloat16 rounds a step apart
    tolerance = 1e-5 if device.type == "cpu" else 2e-2
    assert_close(actual, expected, atol=tolerance, rtol=tolerance)

