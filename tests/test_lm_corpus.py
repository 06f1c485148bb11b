import pytest
import torch

from rnndrop.lm.corpus import (
    EOS,
    UNK,
    CorpusError,
    Vocabulary,
    batchify,
    bptt_batches,
    find_split_files,
    load_corpus,
    num_bptt_batches,
)
from tests.lm_helpers import write_corpus


def test_ptb_layout_eos_and_unknown_words(tmp_path):
    (tmp_path / "ptb.train.txt").write_text("a b a a\nc\n")
    (tmp_path / "ptb.valid.txt").write_text("a z\n")
    (tmp_path / "ptb.test.txt").write_text("\nb\n")
    corpus = load_corpus(tmp_path)
    v = corpus.vocab
    assert v.itos[0] == "a"  # the most frequent word first
    assert set(v.itos) == {"a", "b", "c", EOS, UNK}
    assert v.decode(corpus.train) == ["a", "b", "a", "a", EOS, "c", EOS]
    assert v.decode(corpus.valid) == ["a", UNK, EOS]  # unseen 'z' maps to <unk>
    assert v.decode(corpus.test) == [EOS, "b", EOS]  # an empty line still ends a sentence
    assert corpus.unseen == {"valid": 1, "test": 0}


def test_empty_test_line_is_allowed_but_a_split_without_words_is_not(tmp_path):
    (tmp_path / "ptb.train.txt").write_text("a b\n")
    (tmp_path / "ptb.valid.txt").write_text("a\n")
    (tmp_path / "ptb.test.txt").write_text("\n\n")
    with pytest.raises(CorpusError, match="test split file .* holds no words"):
        load_corpus(tmp_path)


def test_empty_train_file(tmp_path):
    write_corpus(tmp_path)
    (tmp_path / "ptb.train.txt").write_text("")
    with pytest.raises(CorpusError, match="train split file .*ptb.train.txt.* holds no words"):
        load_corpus(tmp_path)


@pytest.mark.parametrize("layout", ["{split}.txt", "wiki.{split}.tokens"])
def test_wikitext_layouts(tmp_path, layout):
    write_corpus(tmp_path, layout)
    paths = find_split_files(tmp_path)
    assert paths["valid"].name == layout.format(split="valid")
    corpus = load_corpus(tmp_path)
    assert corpus.train.dtype == torch.long and corpus.train.numel() > 0


def test_missing_directory(tmp_path):
    with pytest.raises(CorpusError, match="does not exist.*ptb.\\{train,valid,test\\}.txt"):
        load_corpus(tmp_path / "nope")


def test_missing_split_file_is_named(tmp_path):
    write_corpus(tmp_path)
    (tmp_path / "ptb.valid.txt").unlink()
    with pytest.raises(CorpusError, match="lacks ptb.valid.txt"):
        load_corpus(tmp_path)


def test_directory_without_corpus_files(tmp_path):
    (tmp_path / "notes.md").write_text("hi")
    with pytest.raises(CorpusError, match="holds no corpus split files.*notes.md"):
        load_corpus(tmp_path)


def test_vocabulary_needs_unk():
    with pytest.raises(ValueError, match="<unk>"):
        Vocabulary(["a", "b"])


def test_batchify_is_contiguous_per_column():
    data = torch.arange(23)
    b = batchify(data, 4)
    assert b.shape == (5, 4)
    assert b[:, 1].tolist() == [5, 6, 7, 8, 9]  # column 1 continues where column 0 stops
    with pytest.raises(CorpusError, match="too short for batch_size=20"):
        batchify(torch.arange(30), 20)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        batchify(data, 0)


def test_bptt_batches_shift_targets_and_cover_the_stream():
    b = batchify(torch.arange(40), 2)  # [20, 2]
    segments = list(bptt_batches(b, 6))
    assert [x.shape[0] for x, _ in segments] == [6, 6, 6, 1]
    assert len(segments) == num_bptt_batches(b, 6)
    for x, y in segments:
        assert torch.equal(y, x + 1)  # arange: the next word is id + 1
    assert torch.equal(torch.cat([x for x, _ in segments]), b[:-1])
