import pytest
import torch

from rnndrop.lm.data.corpus import (
    EOS,
    SPLITS,
    UNK,
    CorpusError,
    Vocabulary,
    batchify,
    bptt_batches,
    encode_split,
    find_split_files,
    load_corpus,
    num_bptt_batches,
    sample_dir,
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


def test_a_split_that_is_a_folder_or_two_corpora_in_one_folder_are_named(tmp_path):
    """A folder named ptb.test.txt was reported as "lacks ptb.test.txt"; a folder holding both PTB's
    and WikiText's files gave a wikitext2 job PTB's text under WikiText's name."""
    write_corpus(tmp_path)
    (tmp_path / "ptb.test.txt").unlink()
    (tmp_path / "ptb.test.txt").mkdir()
    with pytest.raises(CorpusError, match="ptb.test.txt is not a file"):
        load_corpus(tmp_path)
    both = tmp_path / "both"
    write_corpus(both)
    write_corpus(both, "{split}.txt")
    with pytest.raises(CorpusError, match=r"splits of two corpora \(ptb.train.txt, .* and train.txt, "):
        find_split_files(both)


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


def test_a_byte_order_mark_is_not_a_word(tmp_path):
    write_corpus(tmp_path)
    text = (tmp_path / "ptb.train.txt").read_text()
    (tmp_path / "ptb.train.txt").write_bytes("\ufeff".encode() + text.encode())
    with_bom = load_corpus(tmp_path)
    assert not any("\ufeff" in w for w in with_bom.vocab.itos)
    (tmp_path / "ptb.train.txt").write_text(text)
    assert load_corpus(tmp_path).vocab.itos == with_bom.vocab.itos


def test_a_file_that_is_not_utf8_is_named_with_the_line(tmp_path):
    write_corpus(tmp_path)
    (tmp_path / "ptb.test.txt").write_bytes(b"the cat\nthe dog\nla caf\xe9\n")
    with pytest.raises(CorpusError, match=r"ptb\.test\.txt' is not UTF-8 text: byte 0xe9 on line 3"):
        load_corpus(tmp_path)


def test_a_validation_split_that_is_mostly_unknown_words_warns(tmp_path, caplog):
    write_corpus(tmp_path)
    load_corpus(tmp_path)
    assert not caplog.records
    (tmp_path / "ptb.valid.txt").write_text("zebra yak gnu the\nokapi tapir\n")  # 5 of 6 words unseen
    load_corpus(tmp_path)
    [record] = caplog.records
    assert "ptb.valid.txt" in record.getMessage() and "83% of its words are <unk>" in record.getMessage()
    load_corpus(tmp_path, warn=False)  # read only to tell which corpus it is (evaluate --data DIR)
    assert len(caplog.records) == 1


def test_encode_split_uses_the_given_vocabulary(tmp_path):
    write_corpus(tmp_path)
    vocab = Vocabulary(["the", "cat", EOS, UNK])
    ids = encode_split(tmp_path, "test", vocab)
    words = vocab.decode(ids)
    assert words[:2] in (["the", "cat"], ["the", UNK]) and set(words) <= {"the", "cat", EOS, UNK}
    with pytest.raises(ValueError, match="split must be one of"):
        encode_split(tmp_path, "dev", vocab)


@pytest.mark.parametrize(("name", "layout"), [("ptb", "ptb.{split}.txt"), ("wikitext-2", "{split}.txt")])
def test_the_bundled_samples_are_real_corpora_with_a_notice(name, layout):
    folder = sample_dir(name)
    assert [p.name for p in find_split_files(folder).values()] == [layout.format(split=s) for s in SPLITS]
    corpus = load_corpus(folder)
    assert corpus.train.numel() > 50_000 and len(corpus.vocab) > 5_000
    notice = (folder.parent / "NOTICE.md").read_text()
    assert "CC BY-SA 3.0" in notice and "simple-examples" in notice and "wikitext-2-v1.zip" in notice
    with pytest.raises(ValueError, match="name must be one of"):
        sample_dir("ptb-full")


def test_a_string_where_words_are_expected_is_refused_not_read_letter_by_letter():
    vocab = Vocabulary(["<unk>", "<eos>", "the", "c", "a", "t"])
    with pytest.raises(TypeError, match=r"words must be a sequence of words, got a string 'the cat'.*split"):
        vocab.encode("the cat")
    assert vocab.encode(["the", "cat"]).tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"ids must be in \[0, 6\).*got \[-1, 6\]"):
        vocab.decode([1, -1, 6])  # -1 read the last word


def test_a_stream_too_short_names_the_split_and_the_setting():
    with pytest.raises(CorpusError, match="the valid split of 3 words is too short for eval_batch_size=10"):
        batchify(torch.arange(3), 10, split="the valid split", size_name="eval_batch_size")
    with pytest.raises(ValueError, match="batch_size must be a positive int, got True"):
        batchify(torch.arange(30), True)
