"""The third hostile probe (``docs/reliability-probe.md``, 2026-11-26, third round) as tests: the
cases that are cheap to automate, by their numbers in that table."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from rnndrop import VariationalGRU, VariationalLSTM, to_torch
from rnndrop.kernels import persistent
from rnndrop.kernels.persistent import Launch
from rnndrop.lm import PretrainedError, build_model, from_pretrained, save_pretrained
from rnndrop.lm.model.regimes import get_regime
from rnndrop.mc import mc_predict
from tests.lm_helpers import TINY

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["<unk>", "<eos>", "the", "cat", "sees", "a", "dog"]


# -- the persistent Triton loop's host side (cases 316-343) ------------------------------------

@pytest.mark.parametrize("value, off", [("0", True), ("", True), ("false", True), ("No", True), ("off", True),
                                        ("1", False), (" true ", False), ("yes", False)])
def test_case_337_the_persistent_switch_reads_the_usual_spellings(monkeypatch, value, off):
    monkeypatch.setenv("RNNDROP_PERSISTENT", value)
    assert persistent.disabled() is off


def test_case_339_a_bogus_persistent_switch_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("RNNDROP_PERSISTENT", "abc")
    with pytest.raises(ValueError, match=r"RNNDROP_PERSISTENT must be 0 \(off\) or 1 \(on\), got 'abc'"):
        persistent.disabled()


def test_case_322_several_programs_with_a_barrier_on_cpu_are_refused_not_spun():
    """Was: 395 s of spinning in the interpreter, then NaN outputs without a warning."""
    with pytest.raises(ValueError, match="grid barrier between programs never opens"):
        persistent._run(None, Launch(3, 16), 2, (torch.zeros(1),), False, BB=16, BK=16, MASK_GATES=0,
                        RESIDENT=False)


def test_cases_333_335_launched_as_and_turned_off_nest_and_restore():
    x = torch.zeros(1, 1, 32)
    with persistent.turned_off():
        assert persistent.plan(x, 8, 2, False) is None
    with persistent.launched_as(Launch(2, 16)):
        with persistent.launched_as(Launch(1, 16, True)):
            assert persistent.plan(x, 8, 2, False) == Launch(1, 16, True)
        assert persistent.plan(x, 8, 2, False) == Launch(2, 16)
    with pytest.raises(KeyError), persistent.launched_as(Launch(2, 16)):
        raise KeyError
    assert persistent._forced is None
    assert persistent.plan(x.double(), 8, 2, False) is None  # float64
    assert persistent.plan(x, 8, 2, True) is None  # a projection
    assert persistent.plan(x, 8, persistent.MAX_BATCH + 1, False) is None


@pytest.fixture
def on_cuda(monkeypatch):
    """What ``persistent.plan`` reads of a float32 CUDA tensor, on a 132-multiprocessor GPU (an H100
    / H200): no GPU needed to plan a launch."""
    monkeypatch.setattr(persistent, "_multiprocessors", lambda device: 132)
    return type("Like", (), {"dtype": torch.float32, "device": torch.device("cuda", 0),
                             "elements": 35 * 20 * 4 * 650, "numel": lambda self: self.elements})()


def test_gates_too_large_for_32_bit_offsets_run_the_step_kernel(on_cuda):
    """The loops' row offsets are 32-bit: an LSTM of 1500 units, batch 128, 2800 steps (gates of
    2^31 elements, 8.6 GB: it fits an 80 GB GPU) wrapped them to negative addresses."""
    on_cuda.elements = persistent.MAX_ELEMENTS - 1
    assert persistent.plan(on_cuda, 1500, 128, False) == Launch(94, 16)
    on_cuda.elements = 2800 * 128 * 4 * 1500
    assert on_cuda.elements >= persistent.MAX_ELEMENTS and persistent.plan(on_cuda, 1500, 128, False) is None


def test_a_packed_batchs_per_step_masks_too_large_for_32_bit_offsets_run_the_step_kernel(on_cuda):
    """A packed batch's per-step masks ``[T, B, G, H]`` span its longest sequence for every row:
    256 sequences of hidden 1000, 40 of 2600 steps and 216 of 1000, have gates of 1.28e9 elements
    but per-gate masks of 2.66e9, whose offsets wrapped in 32 bits (the step table refused them
    with an int32 overflow; a little shorter, the kernel read beside the mask)."""
    on_cuda.elements = 320_000 * 4 * 1000
    mask = type("Mask", (), {"numel": lambda self: 2600 * 256 * 4 * 1000})()
    assert persistent.plan(on_cuda, 1000, 256, False) is not None
    assert persistent.plan(on_cuda, 1000, 256, False, mask) is None
    mask.numel = lambda: persistent.MAX_ELEMENTS - 1
    assert persistent.plan(on_cuda, 1000, 256, False, mask) is not None


@pytest.mark.parametrize("hidden, batch, expected", [
    (200, 20, Launch(13, 16, row_blocks=2)),     # 32 rows -> two blocks of 16
    (200, 128, Launch(13, 16, row_blocks=8)),    # 104 programs of 16 rows
    (650, 128, Launch(41, 16, row_blocks=2)),    # 164 would not fit on 132 multiprocessors
    (650, 8, Launch(41, 16)),                    # 16 rows: nothing to split
    (1500, 128, Launch(94, 16)),                 # no room
    (3000, 20, Launch(94, 32)),                  # wider blocks first, then no room for rows
    (200, 1000, Launch(13, 16, row_blocks=8)),   # over MAX_BATCH rows: blocks of at most 256 (125)
    (200, 257, Launch(13, 16, row_blocks=8)),
])
def test_the_plan_splits_rows_while_the_grid_has_room(on_cuda, monkeypatch, hidden, batch, expected):
    """Which launch a CUDA call of a 132-multiprocessor GPU gets (no GPU needed to plan it)."""
    how = persistent.plan(on_cuda, hidden, batch, False)
    assert how == expected and how.grid <= 132
    assert persistent._batch_block(batch, how.row_blocks) * how.row_blocks >= batch
    monkeypatch.setitem(persistent.tuning, "row_blocks", 1)  # a measurement's setting wins, where it can
    least = 1 << (-(-batch // persistent.MAX_BATCH) - 1).bit_length()  # blocks of at most MAX_BATCH rows
    assert persistent.plan(on_cuda, hidden, batch, False).row_blocks == least


@pytest.mark.parametrize("hidden, batch, expected, width", [
    (1500, 20, Launch(125, 12), 16),                 # 94 programs of 16 leave 38 idle
    (1500, 128, Launch(125, 12), 16),
    (650, 20, Launch(55, 12, row_blocks=2), 16),     # 41 x 2 programs -> 55 x 2 (units in fours)
    (200, 20, Launch(50, 4, row_blocks=2), 16),
    (200, 128, Launch(13, 16, row_blocks=8), 16),    # 16 x 8 would need 13 units: 16 in fours
    (3000, 20, Launch(125, 24), 32),                 # blocks of 32 units -> 24 of a tile 32 wide
])
def test_spread_gives_programs_fewer_units_to_fill_the_multiprocessors(on_cuda, monkeypatch, hidden, batch,
                                                                       expected, width):
    """:data:`persistent.SPREAD` (the LSTM's calls; every cell's or none under ``tuning["spread"]``):
    as many programs as the multiprocessors the row blocks leave, each owning fewer units than its
    tile is wide."""
    assert persistent.plan(on_cuda, hidden, batch, False, cell="lstm") == expected
    for cell in ("gru", None):  # the GRU's steps at hidden 1500 were slower spread
        assert persistent.plan(on_cuda, hidden, batch, False, cell=cell).units in (16, 32)
    monkeypatch.setitem(persistent.tuning, "spread", True)
    assert persistent.plan(on_cuda, hidden, batch, False, cell="gru") == expected
    monkeypatch.setitem(persistent.tuning, "spread", False)
    assert persistent.plan(on_cuda, hidden, batch, False, cell="lstm").units in (16, 32)
    monkeypatch.setitem(persistent.tuning, "spread", True)
    how = persistent.plan(on_cuda, hidden, batch, False)
    assert how == expected and how.grid <= 132 and how.programs * how.units >= hidden and how.units % 4 == 0
    tiles = persistent._tiles(how, batch, hidden, False)
    assert (tiles["BH"], tiles["UNITS"]) == (width, how.units)


@pytest.mark.parametrize("setting, expected", [
    ({}, Launch(94, 16)),                                            # one program a multiprocessor
    (dict(per_sm=2), Launch(94, 16, row_blocks=2)),                  # room for the rows in two blocks
    (dict(per_sm=2, spread=True), Launch(125, 12, row_blocks=2)),
    (dict(per_sm=2, row_blocks=1, spread=True), Launch(188, 8)),     # 2 x 94 programs of 8 units
])
def test_two_programs_a_multiprocessor_only_where_asked(on_cuda, monkeypatch, setting, expected):
    """``tuning["per_sm"]`` (1 by default, :data:`persistent.PER_SM`): the grid may hold that many
    programs a multiprocessor (hidden 1500, batch 20 on 132 multiprocessors)."""
    for name, value in setting.items():
        monkeypatch.setitem(persistent.tuning, name, value)
    how = persistent.plan(on_cuda, 1500, 20, False)
    assert how == expected and how.grid <= 132 * setting.get("per_sm", 1) and how.programs * how.units >= 1500
    monkeypatch.setitem(persistent.tuning, "per_sm", 0)
    with pytest.raises(ValueError, match=r'tuning\["per_sm"\] must be 1, 2, 3 or 4 .*got 0'):
        persistent.plan(on_cuda, 1500, 20, False)


@pytest.mark.parametrize("hidden, batch, forward_k, backward_k", [
    (650, 128, 32, 64),   # row blocks of 64: the forward loop in K blocks of 32
    (1500, 20, 32, 64),   # 32 rows
    (1500, 128, 64, 64),  # 128 rows
    (200, 128, 64, 64),   # blocks of 16 rows
    (20, 20, 32, 32),     # 20 units: a K block of 32 either way
])
def test_the_forward_loop_takes_k_blocks_of_32_for_32_to_64_rows(on_cuda, monkeypatch, hidden, batch,
                                                                  forward_k, backward_k):
    how = persistent.plan(on_cuda, hidden, batch, False)
    forward, backward = (persistent._tiles(how, batch, hidden, b) for b in (False, True))
    assert (forward["BK"], backward["BK"]) == (forward_k, backward_k)
    assert forward["BB"] == backward["BB"] and forward["BH"] == backward["BH"] == how.units
    monkeypatch.setitem(persistent.tuning, "block_k", 16)  # a measurement's setting wins
    assert {persistent._tiles(how, batch, hidden, b)["BK"] for b in (False, True)} == {16}


@pytest.mark.parametrize("hidden, resident", [(200, True), (256, True), (257, False), (650, False)])
def test_resident_tiles_only_where_asked_and_they_fit(on_cuda, monkeypatch, hidden, resident):
    """Tiles of ``W_hh`` kept in registers across steps: off by default (not yet timed on a GPU);
    asked for, only up to MAX_RESIDENT hidden units, with one K block over the whole hidden size
    and 8 warps (the same tiles in twice the threads)."""
    assert not persistent.plan(on_cuda, hidden, 20, False).resident
    monkeypatch.setitem(persistent.tuning, "resident", True)
    how = persistent.plan(on_cuda, hidden, 20, False)
    assert how.resident is resident
    tiles = persistent._tiles(how, 20, hidden, False)
    assert tiles["RESIDENT"] is resident
    if resident:
        assert tiles["BK"] == persistent._tiles(how, 20, hidden, True)["BK"] >= hidden
        assert persistent._warps(tiles["BB"], True) == 8
    assert persistent._warps(16, False) == 4


class _Loop:
    """A stand-in for a persistent loop kernel: records ``(RESIDENT, BK, num_stages)`` of every
    launch and runs out of shared memory where ``too_large(resident, stages, block_k)``."""

    __name__ = "_fake_loop"

    def __init__(self, too_large):
        self.too_large, self.launches = too_large, []

    def __getitem__(self, grid):
        def launch(*args, RESIDENT, BK, num_stages, **kwargs):
            from triton.runtime.errors import OutOfResources

            self.launches.append((RESIDENT, BK, num_stages))
            if self.too_large(RESIDENT, num_stages, BK):
                raise OutOfResources(300_000, 232_448, "shared memory")
        return launch


def _launch(kernel, resident, block_k):
    return persistent._run(kernel, Launch(1, 16, resident=resident), 3, (torch.zeros(1),), False,
                           **persistent._sizes(4, 200, 12), BB=16, BK=block_k, MASK_GATES=1,
                           RESIDENT=resident)


def test_resident_tiles_that_do_not_fit_stream_w_hh_instead_and_are_not_tried_again(monkeypatch):
    """A resident launch whose tiles and loads need more shared memory than a multiprocessor has at
    every pipeline depth runs as before (streaming W_hh, the plan's K block), not the step kernel,
    and later calls go there at once."""
    monkeypatch.setattr(persistent, "_stages", {})
    kernel = _Loop(lambda resident, stages, block_k: resident)
    for _ in range(2):
        assert _launch(kernel, True, 256)
    assert kernel.launches == [(True, 256, 3), (True, 256, 2), (True, 256, 1), (False, 64, 3), (False, 64, 3)]


def test_a_deeper_load_pipeline_is_tried_first_where_a_measurement_asks(monkeypatch):
    """``tuning["stages"]``: launches try that depth, then shallower ones where shared memory runs
    out (the depth that fitted is kept per block shape and asked-for depth); without it, 3."""
    monkeypatch.setattr(persistent, "_stages", {})
    kernel = _Loop(lambda resident, stages, block_k: stages > 4)
    monkeypatch.setitem(persistent.tuning, "stages", 6)
    for _ in range(2):
        assert _launch(kernel, False, 64)
    assert kernel.launches == [(False, 64, 6), (False, 64, 5), (False, 64, 4), (False, 64, 4)]
    del persistent.tuning["stages"]
    assert _launch(kernel, False, 64) and kernel.launches[-1] == (False, 64, 3)
    monkeypatch.setitem(persistent.tuning, "stages", 0)
    with pytest.raises(ValueError, match=r'tuning\["stages"\] must be a positive number of stages, got 0'):
        _launch(kernel, False, 64)


def test_a_shape_that_fits_no_shared_memory_runs_the_step_kernel_without_giving_the_device_up(monkeypatch):
    """A launch whose loads fit no shared memory even unpipelined is that shape's failure, not the
    device's: its calls run the step kernel (one warning, the shape not tried again) while launches
    of other shapes still run persistent on that device."""
    monkeypatch.setattr(persistent, "_stages", {})
    monkeypatch.setattr(persistent, "_given_up", set())
    kernel = _Loop(lambda resident, stages, block_k: block_k == 64)  # the 64-wide K block fits nothing
    monkeypatch.setitem(persistent.tuning, "block_k", 64)  # (kept as it is: no narrower block tried)
    with pytest.warns(RuntimeWarning, match=r"_fake_loop .* fits no shared memory of cpu, even unpipelined; "
                      "calls of this shape there run the per-step Triton kernel"):
        assert not _launch(kernel, False, 64)
    assert kernel.launches == [(False, 64, 3), (False, 64, 2), (False, 64, 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _launch(kernel, False, 64)  # remembered: neither launched nor said again
        assert kernel.launches == [(False, 64, 3), (False, 64, 2), (False, 64, 1)]
        assert persistent.usable(torch.device("cpu"))
        del persistent.tuning["block_k"]
        assert _launch(kernel, False, 32)  # another shape on the same device
    assert kernel.launches[-1] == (False, 32, 3)


def test_a_k_block_too_wide_to_pipeline_is_halved_before_the_loads_go_unpipelined(monkeypatch):
    """Where the planned K block fits no pipeline of two stages or more (per-gate masks at hidden 1500,
    batch 128 on sm_90: 144 KiB a stage at K 64), launches try K blocks half as wide at every depth
    before the planned one unpipelined, and keep what fitted; a measurement's ``block_k`` is kept as
    it is, only shallower."""
    monkeypatch.setattr(persistent, "_stages", {})
    kernel = _Loop(lambda resident, stages, block_k: block_k * stages > 96)  # a stage's loads ~ K
    for _ in range(2):
        assert _launch(kernel, False, 64)
    assert kernel.launches == [(False, 64, 3), (False, 64, 2), (False, 32, 3), (False, 32, 3)]
    monkeypatch.setitem(persistent.tuning, "block_k", 64)
    kernel.launches.clear()
    assert _launch(kernel, False, 64)
    assert kernel.launches == [(False, 64, 3), (False, 64, 2), (False, 64, 1)]
    halved = ((64, 3), (64, 2), (32, 3), (32, 2), (16, 3), (16, 2), (64, 1))
    assert persistent._fittings(64, 3, False) == halved
    assert persistent._fittings(16, 1, False) == ((16, 1),)


def test_a_batch_whose_blocks_of_rows_do_not_fit_runs_the_step_kernel(on_cuda):
    assert persistent.plan(on_cuda, 650, 256, False) == Launch(41, 16, row_blocks=2)
    assert persistent.plan(on_cuda, 650, 1000, False) is None  # 41 x 4 blocks of 256 rows > 132
    assert persistent.plan(on_cuda, 1500, 257, False) is None  # 94 x 2


INTERPRETED = """
import warnings, torch
from torch.nn.utils.rnn import pack_sequence
from rnndrop import VariationalLSTM, VariationalGRU
from rnndrop.kernels import gpu, persistent
from rnndrop.kernels.persistent import Launch
gpu.load()
def pair(cls, I, H):
    a = cls(I, H, dropout_hidden=0.3, dropout_input=0.2, kernel="triton")
    b = cls(I, H, dropout_hidden=0.3, dropout_input=0.2, kernel="manual")
    b.load_state_dict(a.state_dict())
    return a, b
def same(cls, H=8, T=3, B=2, how=None):
    torch.manual_seed(0)
    a, b = pair(cls, 5, H)
    x = torch.randn(T, B, 5, requires_grad=True)
    m = a.sample_masks(B)
    grads = []
    for layer in (a, b):
        if how is not None and layer is a:
            with persistent.launched_as(how):
                y = layer(x, masks=m)[0]
        else:
            y = layer(x, masks=m)[0]
        y.sum().backward()
        grads.append((y.detach(), x.grad.clone()))
        x.grad = None
    (y1, g1), (y2, g2) = grads
    assert torch.allclose(y1, y2, atol=1e-5) and torch.allclose(g1, g2, atol=1e-5), cls
for cls in (VariationalLSTM, VariationalGRU):
    same(cls, H=20)                                  # 318-319: H not a multiple of 16
    same(cls, T=1, B=1)                              # 320-321
    same(cls, H=20, how=Launch(2, 16, True))         # 323-324: 2 programs, one launch per step
    same(cls, B=17, T=2)                             # 325
    torch.manual_seed(1)
    a, b = pair(cls, 4, 8)
    seqs = [torch.randn(n, 4) for n in (5, 3, 3, 1)]  # 326-327: odd batch sizes, packed
    m = a.sample_masks(4)
    y1 = a(pack_sequence(seqs, enforce_sorted=False), masks=m)[0].data
    y2 = b(pack_sequence(seqs, enforce_sorted=False), masks=m)[0].data
    assert torch.allclose(y1, y2, atol=1e-5)
# 340-341: a barrier that gave up (simulated) warns once, and later calls (and a backward whose
# forward ran persistent) run the step kernel with the same results
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.manual_seed(0)
    a, b = pair(VariationalLSTM, 5, 8)
    x = torch.randn(3, 2, 5, requires_grad=True)
    m = a.sample_masks(2)
    y = a(x, masks=m)[0]
    persistent.gave_up(torch.device("cpu"), "simulated")
    persistent.gave_up(torch.device("cpu"), "simulated again")
    y.sum().backward()
    g1, x.grad = x.grad.clone(), None
    b(x, masks=m)[0].sum().backward()
    assert torch.allclose(g1, x.grad, atol=1e-5)
    assert not persistent.usable(torch.device("cpu"))
    assert sum("persistent 'triton' loop failed" in str(w.message) for w in caught) == 1
print("interpreted cases ok")
"""


def test_cases_318_341_the_persistent_loop_under_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(INTERPRETED)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "interpreted cases ok" in done.stdout


# -- save_pretrained / from_pretrained (cases 369-391) -----------------------------------------

def _model(regime="tied", seed=0):
    torch.manual_seed(seed)
    return build_model(len(WORDS), TINY, get_regime(regime), TINY.dropout).eval()


@pytest.fixture
def saved(tmp_path):
    folder = tmp_path / "lm"
    save_pretrained(folder, _model(), vocab=WORDS, config=TINY, regime="tied", safetensors=False)
    return folder


def _rehash(folder, name):
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["sha256"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_case_374_a_hostile_pickle_with_a_forged_manifest_is_refused_in_one_line(saved):
    """Was: torch's many-line UnpicklingError, not a PretrainedError (nothing ran either way)."""
    torch.save({"x": _Evil()}, saved / "model.pt")
    _rehash(saved, "model.pt")
    with pytest.raises(PretrainedError, match="cannot be loaded as plain tensors"):
        from_pretrained(saved)
    (saved / "model.pt").write_bytes(pickle.dumps(_Evil()))
    _rehash(saved, "model.pt")
    with pytest.raises(PretrainedError, match="cannot be loaded as plain tensors"):
        from_pretrained(saved)


def test_case_378_a_weights_file_that_is_a_symlink_loop_is_named_as_such(saved):
    """Was: "is missing"."""
    (saved / "model.pt").unlink()
    (saved / "model.pt").symlink_to(saved / "model.pt")
    with pytest.raises(PretrainedError, match="symlink that leads to no file"):
        from_pretrained(saved)


def test_case_385_saving_a_model_the_config_does_not_describe_is_refused(tmp_path):
    """Was: written without a word; from_pretrained then failed on it."""
    with pytest.raises(PretrainedError, match="not the model config and regime describe"):
        save_pretrained(tmp_path / "a", nn.Linear(2, 2), vocab=WORDS, config=TINY, regime="tied")
    other = TINY.replace(hidden_size=8) if hasattr(TINY, "replace") else None
    if other is not None:
        with pytest.raises(PretrainedError, match="not the model config"):
            save_pretrained(tmp_path / "b", _model(), vocab=WORDS, config=other, regime="tied")
    assert not (tmp_path / "a").exists()
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        save_pretrained(tmp_path / "c", "model", vocab=WORDS, config=TINY, regime="tied")


def test_case_388_an_unknown_device_is_named_as_the_device_argument(saved):
    """Was: torch's device-string error, without naming ``device``."""
    with pytest.raises(PretrainedError, match="device must name a torch device.*'tpu'"):
        from_pretrained(saved, device="tpu")


def test_case_389_a_vocabulary_that_lists_a_word_twice_is_refused(tmp_path):
    """Was: saved; the second id of the word could never be its encoding."""
    words = [*WORDS[:-1], WORDS[2]]
    with pytest.raises(PretrainedError, match="more than once"):
        save_pretrained(tmp_path / "lm", _model(), vocab=words, config=TINY, regime="tied", safetensors=False)
    assert not (tmp_path / "lm").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "model.pt").write_bytes((f / "model.pt").read_bytes()[:100]), "was changed after"),
    (lambda f: (f / "manifest.json").write_text("{not json"), "cannot be read"),
    (lambda f: (f / "manifest.json").write_text("[1, 2]"), "is not a manifest"),
    (lambda f: (torch.save(nn.LSTM(3, 4).state_dict(), f / "model.pt"), _rehash(f, "model.pt")),
     "does not fit the model"),
])
def test_cases_369_375_damaged_folders_are_one_line_each(saved, damage, message):
    damage(saved)
    with pytest.raises(PretrainedError, match=message):
        from_pretrained(saved)


def test_cases_376_377_symlinked_folders_and_files_load(saved, tmp_path):
    (tmp_path / "link").symlink_to(saved)
    assert from_pretrained(tmp_path / "link").vocab.itos == WORDS
    files = tmp_path / "files"
    files.mkdir()
    for path in saved.iterdir():
        (files / path.name).symlink_to(path)
    assert from_pretrained(files).vocab.itos == WORDS
    shutil.copy(saved / "manifest.json", tmp_path / "x.json")


# -- deployment, mc_predict, per-rank noise (cases 427-470) ------------------------------------

@pytest.mark.parametrize("regime", ["tied", "weight_drop", "sparse_vd", "gaussian"])
def test_cases_427_431_to_torch_of_each_regime_equals_the_model(regime):
    model = _model(regime)
    plain = to_torch(model)
    tokens = torch.randint(0, len(WORDS), (5, 2))
    with torch.no_grad():
        assert torch.allclose(model(tokens)[0], plain(tokens)[0], atol=1e-6)
    assert not any(isinstance(m, (VariationalLSTM, VariationalGRU)) for m in plain.modules())


def test_case_434_to_plain_of_a_bidirectional_batch_first_gru():
    layer = VariationalGRU(3, 5, num_layers=2, bidirectional=True, batch_first=True, dropout=0.3,
                           dropout_hidden=0.3).eval()
    plain, x = layer.to_plain(), torch.randn(2, 4, 3)
    assert isinstance(plain, nn.GRU) and plain.batch_first
    assert torch.allclose(layer(x)[0], plain(x)[0], atol=1e-6)


def test_case_455_mc_predict_batch_dim_none_names_the_argument():
    """Was: "'<=' not supported between instances of 'int' and 'NoneType'"."""
    net = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    with pytest.raises(TypeError, match="batch_dim must be an int"):
        mc_predict(net, torch.randn(5, 3), n_samples=2, batch_dim=None)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_samples=-3), "n_samples must be a positive int"),
    (dict(n_samples=float("nan")), "n_samples must be a positive int"),
    (dict(chunk_size=-1), "chunk_size must be a positive int"),
    (dict(chunk_size=True), "chunk_size must be a positive int"),
    (dict(memory_budget=0), "memory_budget must be a positive int"),
    (dict(memory_budget=1.5), "memory_budget must be a positive int"),
    (dict(task="REGRESSION"), "task must be one of"),
    (dict(method=None), "method must be one of"),
    (dict(batch_dim=5), "batch_dim=5 is out of range"),
    (dict(output_batch_dim="0"), "output_batch_dim must be an int"),
    (dict(strict="yes"), "strict must be True or False"),  # cases 457-458: were taken as true
    (dict(return_samples=1), "return_samples must be True or False"),
])
def test_cases_442_456_mc_predict_argument_checks(kwargs, message):
    net = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))
    with pytest.raises((ValueError, TypeError), match=message):
        mc_predict(net, torch.randn(5, 3), **({"n_samples": 2} | kwargs))


# -- generate's sampling options (cases 402-426) -----------------------------------------------

@pytest.mark.parametrize("top_k, top_p", [(0, None), (-1, None), (True, None), (None, 0),
                                          (None, float("nan")), (None, -0.1), (None, 1.0000001),
                                          (None, float("inf"))])
def test_cases_402_414_bad_top_k_top_p_are_refused_naming_them(top_k, top_p):
    from rnndrop.lm.run.evaluate import check_sampling
    with pytest.raises(ValueError, match="top_k" if top_k is not None else "top_p"):
        check_sampling(top_k, top_p)


def test_cases_404_412_top_k_beyond_the_vocabulary_and_a_tiny_top_p_keep_the_likeliest():
    from rnndrop.lm.run.evaluate import truncated
    probs = torch.tensor([0.1, 0.6, 0.3])
    assert torch.equal(truncated(probs, 100000, None), probs)
    assert torch.equal(truncated(probs, None, 1e-9), torch.tensor([0.0, 0.6, 0.0]))
    assert torch.equal(truncated(probs, 1, 1e-9), torch.tensor([0.0, 0.6, 0.0]))
    assert torch.equal(truncated(probs, None, 1.0), probs)


def test_the_loops_get_the_hidden_size_as_a_multiple_of_its_widest_vector(monkeypatch):
    """``H = H_VEC · VEC`` with ``VEC`` the largest power of two up to 16 dividing the hidden size
    (Triton then loads rows in vectors); ``tuning["vector"]`` narrows it for a measurement."""
    for hidden, vec in ((200, 8), (650, 2), (1500, 4), (1024, 16), (17, 1)):
        assert persistent._sizes(20, hidden, 700) == dict(B=20, H_VEC=hidden // vec, N=700, VEC=vec)
    monkeypatch.setitem(persistent.tuning, "vector", 1)
    assert persistent._sizes(20, 200, 700)["VEC"] == 1
    monkeypatch.setitem(persistent.tuning, "vector", 3)
    with pytest.raises(ValueError, match=r'tuning\["vector"\] must be a power of two, got 3'):
        persistent._sizes(20, 200, 700)
