"""The one mask sampler (every Bernoulli site draws through it) and the argument checks."""

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from rnndrop import (
    EmbeddingDropout,
    LockedDropout,
    VariationalGRU,
    VariationalLSTM,
    WeightDrop,
    bernoulli_mask,
    gaussian_mask,
    sample_mask,
)
from rnndrop.noise import MaskSite, draw_mask, draw_masks
from rnndrop.validation import check_bool, check_finite_float, check_positive_int, check_probability

ROOT = Path(__file__).resolve().parents[1]
NEAR_ONE = [0.999999, 1 - 2**-17, 1 - 2**-20, 1 - 2**-40]


@pytest.mark.parametrize("p", NEAR_ONE, ids=lambda p: f"p=1-{1 - p:.1e}")
def test_p_just_below_one_drops_nearly_everything(p):
    """p just below 1 keeps (almost) nothing, and every kept value is 1 / (1 - p)."""
    mask = bernoulli_mask((1_000_000,), p)
    kept = int((mask > 0).sum())
    assert kept <= 20, f"{kept} of 1e6 kept for p={p}"  # expected <= 1
    assert torch.all((mask == 0) | (mask == 1 / (1 - p)))


def test_locked_dropout_with_p_just_below_one_is_all_zero():
    assert LockedDropout(0.999999)(torch.ones(3, 4, 5)).unique().tolist() == [0.0]


@pytest.mark.parametrize("site", ["layer", "locked", "embedding", "weight"])
def test_every_bernoulli_site_drops_with_p_just_below_one(site):
    p = 0.999999
    if site == "layer":
        layer = VariationalLSTM(4, 6, 2, dropout=p, dropout_input=p, dropout_hidden=p, dropout_output=p)
        masks = layer.sample_masks(8)
        values = torch.cat([m.flatten() for m in (*masks.inputs, *masks.hidden, masks.output)])
    elif site == "locked":
        values = LockedDropout(p)(torch.ones(5, 8, 6))
    elif site == "embedding":
        values = EmbeddingDropout.from_sizes(50, 3, p=p)(torch.randint(0, 50, (5, 8)))
    else:
        values = WeightDrop(nn.LSTM(4, 6), "weight_hh_l0", p=p).sample_masks()["weight_hh_l0"]
    assert values.abs().sum() == 0


@pytest.mark.parametrize("p", [1e-6, 1e-3, 2**-8, 0.1, 0.5, 0.9, 1 - 2**-8, 0.999])
def test_kept_fraction_is_one_minus_p_everywhere_in_range(p):
    n = 4_000_000
    mask = bernoulli_mask((n,), p, dtype=torch.float64)
    dropped = int((mask == 0).sum())
    sd = (n * p * (1 - p)) ** 0.5
    assert abs(dropped - n * p) <= 5 * sd + 2, (dropped, n * p)
    assert torch.all((mask == 0) | (mask == 1 / (1 - p)))


@pytest.mark.parametrize("alpha", [0.25, 4.0, torch.tensor(4.0), torch.full((100_000,), 0.25)],
                         ids=["float 0.25", "float 4", "tensor 4", "tensor of 0.25s"])
def test_gaussian_masks_have_mean_one_and_variance_alpha(alpha):
    """``1 + sqrt(alpha) eps``: a float alpha and a tensor one (a learned variance) alike."""
    mask = gaussian_mask((100_000,), alpha, generator=torch.Generator().manual_seed(0))
    variance = float(alpha.flatten()[0]) if isinstance(alpha, torch.Tensor) else alpha
    assert abs(float(mask.mean()) - 1.0) < 0.02
    assert abs(float(mask.var()) / variance - 1.0) < 0.03


def test_a_mask_keeps_the_entries_whose_float32_uniform_from_the_generator_is_at_least_p():
    """The one draw: ``torch.rand`` in float32 from the generator given (or torch's default one),
    compared with ``p``, times ``1 / (1 - p)``; the same entries kept in every dtype, and the
    generator left where ``torch.rand`` leaves it."""
    for shape, p in [((3, 7), 0.3), ((1029,), 0.5), ((0, 4), 0.1), ((2, 3, 5), 0.999)]:
        theirs = torch.Generator().manual_seed(5)
        keep = torch.rand(shape, generator=theirs) >= p
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            ours = torch.Generator().manual_seed(5)
            mask = bernoulli_mask(shape, p, generator=ours, dtype=dtype)
            assert mask.dtype == dtype and torch.equal(mask, keep.to(dtype) * (1 / (1 - p)))
            assert torch.equal(ours.get_state(), theirs.get_state())
    torch.manual_seed(11)
    expected = (torch.rand(40, 30) >= 0.4) / 0.6
    torch.manual_seed(11)
    assert torch.equal(bernoulli_mask((40, 30), 0.4), expected)


LAYER_MASKS = """
import torch
from rnndrop import VariationalLSTM
torch.manual_seed(3)
layer = VariationalLSTM(3, 5, 2, dropout=0.3, dropout_input=0.2, dropout_hidden=0.5, dropout_output=0.1)
masks = layer.sample_masks(4)
print([m.flatten().tolist() for m in (*masks.inputs, *masks.hidden, masks.output)])
"""


def test_masks_depend_on_the_seed_not_on_the_compiled_extension(compiled_kernel):
    """The same seed draws the same masks whether or not the process has the compiled kernel."""
    assert compiled_kernel is not None
    env = dict(os.environ, RNNDROP_NO_COMPILE="1", PYTHONPATH=str(ROOT))
    without = subprocess.run([sys.executable, "-c", LAYER_MASKS], env=env, capture_output=True, text=True,
                             timeout=300, check=True)
    scope: dict = {}
    exec(LAYER_MASKS.replace("print(", "drawn = ("), scope)
    assert ast.literal_eval(without.stdout.strip()) == scope["drawn"]


def test_masks_under_fake_tensors_and_vmap_with_the_same_randomness():
    """Under a fake-tensor mode a mask has its shape; under ``vmap(randomness="same")`` every
    sample gets the mask drawn outside vmap from the same generator state."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert bernoulli_mask((3, 4), 0.5, device="cpu").shape == (3, 4)
    expected = bernoulli_mask((6,), 0.5, generator=torch.Generator().manual_seed(2))
    generator = torch.Generator().manual_seed(2)
    drawn = torch.func.vmap(lambda x: x * bernoulli_mask((6,), 0.5, generator=generator),
                            randomness="same")(torch.ones(2, 6))
    assert torch.equal(drawn, expected.expand(2, 6))


def test_argument_checks_name_the_argument_what_was_expected_and_what_came():
    with pytest.raises(ValueError, match=r"rate must be a probability in \[0, 1\), got nan"):
        check_probability("rate", float("nan"))
    with pytest.raises(TypeError, match="flag must be True or False, got str 'no'"):
        check_bool("flag", "no")
    with pytest.raises(ValueError, match="n must be a positive int, got True"):
        check_positive_int("n", True)
    with pytest.raises(ValueError, match="t must be a finite number"):
        check_finite_float("t", float("inf"))
    assert check_finite_float("t", 3) == 3.0 and check_bool("flag", False) is False


ALPHA = "alpha must be a finite number >= 0, got"


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: sample_mask((2,), 1.5, "gaussian"), ValueError, "p must be a probability in .* got 1.5"),
        (lambda: sample_mask((2,), 1.0, "gaussian"), ValueError, "p must be a probability in .* got 1.0"),
        (lambda: sample_mask((2,), math.nan, "gaussian"), ValueError, "p must be a probability .* got nan"),
        (lambda: sample_mask((2,), "0.5", "gaussian"), TypeError, "p must be a float in .* got str '0.5'"),
        (lambda: sample_mask((2,), 0.0, "typo"), ValueError, "noise must be one of 'bernoulli', 'gauss"),
        (lambda: gaussian_mask((2,), -1.0), ValueError, f"{ALPHA} -1.0"),
        (lambda: gaussian_mask((2,), math.inf), ValueError, f"{ALPHA} inf"),
        (lambda: gaussian_mask((2,), math.nan), ValueError, f"{ALPHA} nan"),
    ],
    ids=["p>1", "p=1", "p=nan", "p=str", "noise=typo even at p=0", "alpha<0", "alpha=inf", "alpha=nan"],
)
def test_gaussian_masks_check_their_arguments_as_bernoulli_masks_do(call, error, message):
    """The Gaussian path had no check: a math domain error, a ZeroDivisionError, or a NaN mask."""
    with pytest.raises(error, match=message):
        call()
    assert sample_mask((2,), 0.0, "gaussian") is None
    assert torch.isfinite(sample_mask((3,), 0.5, "gaussian")).all() and gaussian_mask((3,), 0).eq(1).all()


def test_numpy_scalars_are_numbers_as_torch_modules_take_them():
    """Values from NumPy grids (``np.float32(0.5)``, ``np.int64(4)``) were refused by every check
    while nn.Dropout / nn.Linear take them; NumPy's bool is no number, as Python's is not."""
    import numpy as np

    from rnndrop.mc import mc_predict

    p, n = check_probability("p", np.float32(0.5)), check_positive_int("n", np.int64(4))
    assert (p, type(p), n, type(n)) == (0.5, float, 4, int)
    assert LockedDropout(np.float32(0.25)).p == 0.25
    model = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.5))
    assert mc_predict(model, torch.randn(5, 3), n_samples=np.int64(4)).n_samples == 4
    with pytest.raises(ValueError, match="n must be a positive int, got (np.)?True"):
        check_positive_int("n", np.bool_(True))
    with pytest.raises(TypeError, match="p must be a float in"):
        check_probability("p", np.bool_(False))


@pytest.mark.parametrize(
    "build",
    [
        lambda: LockedDropout(0.5, batch_first="no"),
        lambda: EmbeddingDropout.from_sizes(5, 2, p=0.5, batch_first="no"),
        lambda: WeightDrop(nn.LSTM(4, 6), "weight_hh_l0", p=0.5, variational="no"),
        lambda: VariationalLSTM(4, 6, per_gate_masks="no"),
    ],
    ids=["LockedDropout.batch_first", "EmbeddingDropout.batch_first", "WeightDrop.variational",
         "VariationalLSTM.per_gate_masks"],
)
def test_flags_must_be_bools(build):
    with pytest.raises(TypeError, match="must be True or False, got str 'no'"):
        build()


@pytest.mark.parametrize(
    "draw",
    [
        lambda: VariationalLSTM(4, 6, dropout_hidden=0.3).sample_masks(2, dtype=torch.int64),
        lambda: LockedDropout(0.5)(torch.ones(3, 2, dtype=torch.long)),
        lambda: bernoulli_mask((3,), 0.5, dtype=torch.bool),
    ],
    ids=["sample_masks(dtype=int64)", "LockedDropout(int tensor)", "bernoulli_mask(dtype=bool)"],
)
def test_masks_of_an_integer_dtype_are_refused_naming_the_dtype(draw):
    """An integer dtype is refused naming it (LockedDropout: naming its input x), not with torch's
    message about a cast to Long."""
    expected = "(masks need a floating-point dtype|x must hold floating-point values) .*, got torch"
    with pytest.raises(TypeError, match=expected):
        draw()


def test_p_whose_scale_overflows_the_dtype_is_refused_instead_of_inf_masks():
    """1 / (1 - p) beyond the dtype's largest value (65504 in float16) is an error, not inf masks."""
    with pytest.raises(ValueError, match=r"p=0.99999 scales the kept values by .* largest torch.float16"):
        LockedDropout(0.99999)(torch.ones(1, 1000, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="beyond the largest torch.float16"):
        VariationalLSTM(4, 6, dropout_hidden=0.99999).half().sample_masks(2)
    mask = bernoulli_mask((100_000,), 0.9999847, dtype=torch.float16)  # the largest p that fits
    assert torch.isfinite(mask).all()


def test_a_stack_draws_its_masks_in_one_draw_each_with_its_own_p_and_shape():
    """``draw_masks``: one tensor of uniforms for every site, each site's mask the draw of its
    own slice (``u >= p`` times ``1 / (1 - p)``), None where p is 0; runs of equal p share one
    comparison. The generator advances as one ``torch.rand`` of every site's entries."""
    sites = [MaskSite("a", (3, 4), 0.5), MaskSite("b", (2, 4), 0.5), MaskSite("off", (5,), 0.0),
             MaskSite("c", (4, 1, 3), 0.2), MaskSite("d", (6,), 0.5)]
    ours = torch.Generator().manual_seed(7)
    masks = draw_masks(sites, "bernoulli", device="cpu", dtype=torch.float32, generator=ours)
    theirs = torch.Generator().manual_seed(7)
    uniform = torch.rand(12 + 8 + 12 + 6, generator=theirs)
    start = 0
    for site, mask in zip(sites, masks):
        if site.p == 0:
            assert mask is None
            continue
        size = mask.numel()
        expected = (uniform[start : start + size] >= site.p).float() / (1 - site.p)
        assert mask.shape == site.shape and torch.equal(mask.flatten(), expected)
        start += size
    assert torch.equal(ours.get_state(), theirs.get_state())


@pytest.mark.parametrize("noise, dtype", [("gaussian", torch.float32), ("bernoulli", torch.float64)])
def test_other_noises_and_dtypes_draw_site_by_site(noise, dtype):
    sites = [MaskSite("a", (3, 4), 0.5), MaskSite("b", (2,), 0.3)]
    ours = torch.Generator().manual_seed(2)
    theirs = torch.Generator().manual_seed(2)
    masks = draw_masks(sites, noise, device="cpu", dtype=dtype, generator=ours)
    for site, mask in zip(sites, masks):
        assert torch.equal(mask, draw_mask(site, noise, device="cpu", dtype=dtype, generator=theirs))


def test_the_masks_of_one_draw_are_independent_and_keep_one_minus_p():
    """Sites drawn together are not copies of one another, and each keeps 1 - p of its entries."""
    torch.manual_seed(0)
    sites = [MaskSite(name, (200, 400), 0.5) for name in ("a", "b", "c")]
    a, b, c = draw_masks(sites, "bernoulli", device="cpu", dtype=torch.float32, generator=None)
    for m in (a, b, c):
        assert abs(float((m > 0).float().mean()) - 0.5) < 0.01
    agree = float(((a > 0) == (b > 0)).float().mean())
    assert abs(agree - 0.5) < 0.01 and not torch.equal(b, c)


def test_a_draw_sites_hook_that_draws_a_wrong_shape_fails_in_forward():
    """Masks a ``_draw_sites`` override draws are checked in ``forward`` like given ones."""

    class Wrong(VariationalLSTM):
        def _draw_sites(self, sites, scope, device, dtype, generator):
            drawn = [draw_mask(site, self.noise, device=device, dtype=dtype, generator=generator)
                     for site in sites]
            return self._assembled([None if m is None else m[..., :-1] for m in drawn], scope)

    with pytest.raises(ValueError, match=r"masks\.hidden\[0\] must have shape \[2, 4\]"):
        Wrong(3, 4, dropout_hidden=0.5).train()(torch.randn(5, 2, 3))


@pytest.mark.parametrize("scope", ["sequence", "step", "batch"])
@pytest.mark.parametrize("per_gate", [False, True])
def test_masks_the_layer_draws_itself_pass_the_check_given_masks_get(scope, per_gate):
    """``forward`` does not check the masks its built-in draw made (their shapes, dtype and device
    are right by construction): every scope, per-gate or not, two layers both ways, float64."""
    for cls in (VariationalLSTM, VariationalGRU):
        layer = cls(3, 4, num_layers=2, bidirectional=True, mask_scope=scope, per_gate_masks=per_gate,
                    dropout=0.3, dropout_input=0.2, dropout_hidden=0.5, dropout_output=0.4,
                    dtype=torch.float64)
        x = torch.randn(5, 2, 3, dtype=torch.float64)
        masks = layer.sample_masks(2, 5, dtype=torch.float64)
        masks.check(layer._geometry, 2, 5, x)
