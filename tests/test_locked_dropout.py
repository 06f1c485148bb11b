import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from rnndrop import LockedDropout
from rnndrop.layout import packed_sequence_index


def test_mask_is_the_same_at_every_step_and_differs_across_the_batch():
    torch.manual_seed(0)
    drop = LockedDropout(0.5)
    out = drop(torch.ones(7, 16, 10))
    assert set(out.unique().tolist()) == {0.0, 2.0}
    assert torch.equal(out, out[:1].expand_as(out))
    assert not all(torch.equal(out[0, 0], out[0, b]) for b in range(1, 16))


def test_batch_first_locks_the_time_dimension():
    torch.manual_seed(1)
    drop = LockedDropout(0.5, batch_first=True)
    out = drop(torch.ones(16, 7, 10))
    assert torch.equal(out, out[:, :1].expand_as(out))
    assert not all(torch.equal(out[0, 0], out[b, 0]) for b in range(1, 16))


def test_extra_feature_dimensions_get_their_own_draws():
    torch.manual_seed(2)
    out = LockedDropout(0.5)(torch.ones(4, 3, 5, 6))
    assert torch.equal(out, out[:1].expand_as(out))
    assert out[0].unique().numel() == 2


def test_packed_sequence_masks_each_sequence_at_all_its_steps():
    torch.manual_seed(3)
    lengths = torch.tensor([3, 6, 1, 5])
    x = torch.ones(6, 4, 8)
    packed = pack_padded_sequence(x, lengths, enforce_sorted=False)
    out = LockedDropout(0.5)(packed)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
    assert torch.equal(out.sorted_indices, packed.sorted_indices)
    padded, out_lengths = pad_packed_sequence(out)
    assert torch.equal(out_lengths, lengths)
    for b, n in enumerate(lengths.tolist()):
        rows = padded[:n, b]
        assert torch.equal(rows, rows[:1].expand_as(rows))
    firsts = padded[0]  # [B, F]
    assert not all(torch.equal(firsts[0], firsts[b]) for b in range(1, 4))


def test_packed_sequence_index():
    assert packed_sequence_index(torch.tensor([3, 2, 2, 1])).tolist() == [0, 1, 2, 0, 1, 0, 1, 0]


def test_eval_and_p_zero_return_the_input():
    x = torch.randn(5, 3, 4)
    drop = LockedDropout(0.5).eval()
    assert drop(x) is x
    packed = pack_padded_sequence(x, [5, 4, 2])
    assert drop(packed) is packed
    off = LockedDropout(0.0)
    assert off(x) is x
    assert not off.is_stochastic() and drop.is_stochastic()


@pytest.mark.parametrize("noise", ["bernoulli", "gaussian"])
def test_expected_value_and_variance(noise):
    torch.manual_seed(4)
    p = 0.3
    out = LockedDropout(p, noise=noise)(torch.full((2, 20000, 5), 3.0))
    assert out.mean().item() == pytest.approx(3.0, abs=0.03)
    # Both noises have variance p / (1 - p) times the squared input.
    assert out[0].var().item() == pytest.approx(9.0 * p / (1 - p), rel=0.03)


def test_gradient_flows_through_the_mask():
    torch.manual_seed(5)
    x = torch.ones(4, 6, 3, requires_grad=True)
    out = LockedDropout(0.5)(x)
    out.sum().backward()
    assert torch.equal(x.grad, out.detach())


def test_bad_arguments():
    with pytest.raises(ValueError, match="p must be a probability"):
        LockedDropout(-0.1)
    with pytest.raises(ValueError, match="noise must be one of"):
        LockedDropout(0.1, noise="uniform")
    with pytest.raises(ValueError, match="at least 2-D"):
        LockedDropout(0.1)(torch.ones(5))
    with pytest.raises(TypeError, match="x must be a Tensor or PackedSequence"):
        LockedDropout(0.1)([1.0, 2.0])


def test_integer_input_is_refused_by_name():
    with pytest.raises(TypeError, match="x must hold floating-point values .*got torch.int64"):
        LockedDropout(0.5)(torch.ones(2, 2, 2, dtype=torch.long))
    drop = LockedDropout(0.5)
    with pytest.raises(ValueError, match="noise must be one of 'bernoulli', 'gaussian', got 'foo'"):
        drop.noise = "foo"  # when set, not at the next call
