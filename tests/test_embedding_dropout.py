import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rnndrop import EmbeddingDropout
from rnndrop.embedding_dropout import word_keep_mask
from rnndrop.stochastic import Stochastic, noise_per_sequence
from tests.helpers import distinct


def _repeated_tokens(T: int = 30, B: int = 16, V: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (T, B), generator=g)  # few types: many repeats


def _embed(p: float = 0.5, V: int = 6, E: int = 5, **kwargs) -> EmbeddingDropout:
    torch.manual_seed(0)
    return EmbeddingDropout.from_sizes(V, E, p, **kwargs)


def _assert_word_types_dropped_together(keep: torch.Tensor, rows: torch.Tensor) -> None:
    """keep, rows: [B, T]; equal ids in a row must have equal keep values."""
    for b in range(rows.shape[0]):
        for word in rows[b].unique():
            values = keep[b][rows[b] == word]
            assert torch.all(values == values[0]), (b, int(word), values)


@pytest.mark.parametrize("dense", [True, False])
def test_word_keep_mask_drops_types_per_sequence(dense):
    torch.manual_seed(1)
    rows = _repeated_tokens().t()  # [B, T]
    keep = word_keep_mask(rows, 6, 0.5, dense=dense)
    assert keep.shape == rows.shape
    assert set(keep.unique().tolist()) == {0.0, 2.0}
    _assert_word_types_dropped_together(keep, rows)
    # Every sequence holds every word type; the draws differ between sequences.
    same = torch.tensor([[torch.equal(keep[a], keep[b]) for b in range(16)] for a in range(16)])
    assert same.sum() < 16 * 16 / 2


@pytest.mark.parametrize("dense", [True, False])
def test_word_keep_mask_keeps_a_fraction_1_minus_p(dense):
    torch.manual_seed(2)
    V, B = 50, 64
    rows = torch.arange(V).repeat(B, 1)  # each (sequence, word) pair exactly once
    kept = torch.stack([word_keep_mask(rows, V, 0.3, dense=dense) > 0 for _ in range(20)])
    assert kept.float().mean().item() == pytest.approx(0.7, abs=0.01)


def test_forward_zeroes_every_occurrence_of_a_dropped_word():
    embed = _embed(0.5)
    tokens = _repeated_tokens()
    out = embed(tokens)
    plain = embed.embedding(tokens)
    assert out.shape == (30, 16, 5)
    ratio = (out / plain)[..., 0]  # [T, B]: 0 or 2 for every token
    assert torch.allclose(out, plain * ratio.unsqueeze(-1))
    assert set(ratio.round().unique().tolist()) == {0.0, 2.0}
    _assert_word_types_dropped_together(ratio.t(), tokens.t())


def test_other_sequences_get_other_draws():
    embed = _embed(0.5)
    tokens = torch.arange(1, 6).repeat(32, 1).t()  # 32 identical sequences [5, 32]
    kept = embed(tokens)[..., 0] != 0  # [T, B]
    patterns = {tuple(kept[:, b].tolist()) for b in range(32)}
    assert len(patterns) > 8


def test_batch_scope_uses_one_mask_for_the_batch():
    embed = _embed(0.5, scope="batch")
    tokens = _repeated_tokens()
    ratio = (embed(tokens) / embed.embedding(tokens))[..., 0].round()
    for word in tokens.unique():
        values = ratio[tokens == word]
        assert torch.all(values == values[0])
    # A different call draws a different mask.
    column = torch.arange(1, 6).unsqueeze(1)
    masks = {tuple((embed(column)[:, 0, 0] != 0).tolist()) for _ in range(20)}
    assert len(masks) > 1


def test_batch_first_drops_per_row():
    embed = _embed(0.5, batch_first=True)
    tokens = _repeated_tokens().t()  # [B, T]
    ratio = (embed(tokens) / embed.embedding(tokens))[..., 0]
    _assert_word_types_dropped_together(ratio, tokens)


def test_one_sequence_1d():
    embed = _embed(0.5)
    tokens = torch.tensor([1, 2, 1, 3, 2, 1])
    out = embed(tokens)
    assert out.shape == (6, 5)
    ratio = (out / embed.embedding(tokens))[:, 0]
    _assert_word_types_dropped_together(ratio.unsqueeze(0), tokens.unsqueeze(0))


@pytest.mark.parametrize("scope", ["sequence", "batch"])
def test_expected_value_is_the_embedding(scope):
    embed = _embed(0.4, V=8, E=3, scope=scope)
    tokens = torch.tensor([[1, 2], [3, 1], [1, 7]])
    torch.manual_seed(3)
    mean = torch.stack([embed(tokens) for _ in range(4000)]).mean(0)
    plain = embed.embedding(tokens)
    # std of the mean of 4000 draws: |e| * sqrt(p / (1 - p)) / sqrt(4000) ~ 0.013 |e|
    assert torch.allclose(mean, plain, atol=0.06 * plain.abs().max().item())


def test_padding_idx_stays_zero_and_gets_no_gradient():
    embed = _embed(0.3, V=10, E=4, padding_idx=0)
    tokens = torch.tensor([[0, 3], [4, 0], [0, 0]])
    out = embed(tokens)
    assert torch.all(out[tokens == 0] == 0)
    out.sum().backward()
    assert torch.all(embed.embedding.weight.grad[0] == 0)


def test_gradient_is_scaled_by_the_mask():
    embed = _embed(0.5, V=10, E=4)
    tokens = torch.tensor([[3], [3], [3]])  # one word three times in one sequence
    out = embed(tokens)
    out.sum().backward()
    kept = bool(out[0, 0, 0] != 0)
    expected = torch.full((4,), 3 * 2.0 if kept else 0.0)
    assert torch.equal(embed.embedding.weight.grad[3], expected)


def test_eval_and_p_zero_are_the_plain_embedding():
    embed = _embed(0.5)
    tokens = _repeated_tokens()
    embed.eval()
    assert torch.equal(embed(tokens), embed.embedding(tokens))
    off = EmbeddingDropout(embed.embedding, 0.0).train()
    assert torch.equal(off(tokens), embed.embedding(tokens))
    assert isinstance(off, Stochastic)
    assert not off.is_stochastic() and embed.is_stochastic()


def test_wraps_the_given_embedding_and_keeps_its_state_dict_keys():
    base = nn.Embedding(7, 3)
    embed = EmbeddingDropout(base, 0.1)
    assert embed.embedding is base
    assert list(embed.state_dict()) == ["embedding.weight"]
    decoder = nn.Linear(3, 7, bias=False)
    decoder.weight = embed.embedding.weight  # weight tying
    assert decoder.weight is base.weight


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtype_follows_the_embedding(dtype):
    """The mask is drawn in the embedding's dtype: a half-precision embedding stays in it (a mask
    in the default float32 promoted its output, doubling its memory)."""
    embed = _embed(0.5).to(dtype)
    assert embed(_repeated_tokens()).dtype == dtype


def test_bad_arguments():
    base = nn.Embedding(5, 2)
    with pytest.raises(ValueError, match="p must be a probability"):
        EmbeddingDropout(base, 1.0)
    with pytest.raises(ValueError, match="scope must be one of 'sequence', 'batch'"):
        EmbeddingDropout(base, 0.1, scope="step")
    with pytest.raises(TypeError, match=r"embedding must be an nn\.Embedding"):
        EmbeddingDropout(nn.Linear(2, 2), 0.1)
    embed = EmbeddingDropout(base, 0.1)
    with pytest.raises(TypeError, match="tokens must be an int64 or int32"):
        embed(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"tokens must be 2-D \[T, B\]"):
        embed(torch.zeros(3, 2, 1, dtype=torch.long))


@pytest.mark.parametrize("bad_id", [10, 11, -1])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_ids_outside_the_vocabulary_are_named_with_the_vocabulary_size(bad_id, mode):
    embed = EmbeddingDropout.from_sizes(10, 3, p=0.5)
    embed.train(mode == "train")
    tokens = torch.tensor([[1, 2], [bad_id, 4]])
    with pytest.raises(ValueError, match=rf"word ids in \[0, 10\) .*V = 10.*got id {bad_id}"):
        embed(tokens)


class _CountReductions(TorchDispatchMode):
    """Counts the min / max reductions run inside the block (each waits for the GPU there)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.min, torch.ops.aten.max):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_batches_of_a_checked_corpus_are_not_reduced_again():
    """A language model's batches are views of one tensor of the corpus: its ids are read once
    (a wait for the GPU there), not at every forward; a change of the corpus is seen."""
    embed = EmbeddingDropout.from_sizes(10, 3, p=0.5)
    corpus = torch.arange(40).remainder(10).view(10, 4)
    embed(corpus[0:3])
    with _CountReductions() as counted:
        for start in range(1, 8):
            embed(corpus[start : start + 3])
    assert counted.count == 0
    corpus[8, 1] = 10  # in place: the corpus's version changes, so it is read again
    embed(corpus[0:3])  # ids outside the corpus's range lie outside this view: still accepted
    with pytest.raises(ValueError, match=r"word ids in \[0, 10\) .*got id 10"):
        embed(corpus[7:10])
    with _CountReductions() as counted:
        embed(torch.tensor([[1, 2], [3, 4]]))  # a tensor of its own is read at every call
        embed(torch.tensor([[1, 2], [3, 4]]))
    assert counted.count == 4
    with torch.inference_mode():
        held = torch.tensor([[1, 2], [3, 11]])
    with pytest.raises(ValueError, match="got id 11"):
        embed(held[0:2])


@pytest.mark.parametrize("scope", ["sequence", "batch"])
def test_word_keep_mask_rejects_ids_that_would_alias(scope):
    """Id V in sequence 0 would share the key of id 0 in sequence 1."""
    with pytest.raises(ValueError, match="got id 5"):
        word_keep_mask(torch.tensor([[5, 1], [0, 2]]), 5, 0.5, scope)


def test_a_batch_scope_draws_per_sequence_when_asked():
    """``scope="batch"`` inside ``noise_per_sequence`` (Monte-Carlo samples stacked in one batch):
    each sequence drops words of its own, each word still the same at every occurrence."""
    torch.manual_seed(3)
    drop = EmbeddingDropout(nn.Embedding(4, 3), 0.5, scope="batch").train()
    assert drop.switches_to_noise_per_sequence()
    tokens = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]).unsqueeze(1).expand(8, 64)  # [T, B]: 64 equal rows
    with torch.no_grad():
        shared = drop(tokens).ne(0).all(-1)  # [T, B]: kept
        with noise_per_sequence(drop):
            apart = drop(tokens).ne(0).all(-1)
    assert all(torch.equal(shared[:, 0], shared[:, b]) for b in range(64))
    assert torch.equal(apart[:4], apart[4:])  # a word's occurrences agree within a sequence
    assert distinct(apart, 1) > 8  # sequences differ
