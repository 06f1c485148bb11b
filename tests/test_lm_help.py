"""What ``rnndrop-lm --help`` and ``generate`` say and do: defaults stated once, flags that read
right, top-k and nucleus sampling (issue 43, "Help and logs")."""

import pytest
import torch

from rnndrop.lm.cli.parser import build_parser
from rnndrop.lm.data.corpus import Vocabulary
from rnndrop.lm.model.language_model import RNNLanguageModel
from rnndrop.lm.run.evaluate import generate, truncated
from tests.lm_helpers import run_cli


def _help(*command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    return " ".join(sub[command[0]].format_help().split()) if command else parser.format_help()


@pytest.mark.parametrize("command", ["ptb", "wikitext2", "evaluate", "generate"])
def test_help_never_prints_default_none_nor_a_default_twice(command):
    text = _help(command)
    assert "(default: None)" not in text and "(default: )" not in text
    assert "default: the config's) (default" not in text and "on) (default" not in text


def test_help_states_the_defaults_that_help_does_not_state_itself():
    text = _help("ptb")
    assert "--jobs JOBS runs trained at once (processes) (default: 1)" in text
    assert "--regimes REGIMES comma-separated, among" in text and "(default: none,naive,tied)" in text


def test_tie_weights_help_says_tying_needs_equal_sizes_and_untying_does_not():
    text = _help("ptb")
    start = text.index("--tie-weights, --no-tie-weights")
    flag = text[start:text.index("--ar AR", start)].replace("--no- tie", "--no-tie")  # wrapped
    assert "tying needs --emb-size equal to --hidden-size" in flag
    assert "--no-tie-weights: separate matrices, any sizes" in flag


def test_generate_help_states_the_seed_and_what_a_fixed_seed_means():
    text = _help("generate")
    assert "--seed SEED seed of the draws (default: 1), taken with the prompt: the same run, prompt, " \
           "options and seed give the same text" in text
    assert "--top-k K" in text and "--top-p P nucleus sampling" in text
    assert "--device DEVICE auto, cpu, cuda" in text


def test_truncated_keeps_the_top_k_and_the_nucleus():
    probs = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15], dtype=torch.float64)
    assert truncated(probs).tolist() == probs.tolist()
    assert (truncated(probs, top_k=2) > 0).tolist() == [False, True, False, True, False]
    assert (truncated(probs, top_k=1) > 0).tolist() == [False, True, False, False, False]
    assert (truncated(probs, top_k=99) > 0).all()
    # 0.4 + 0.3 = 0.7 < 0.75: the third likeliest (0.15) completes the nucleus
    assert (truncated(probs, top_p=0.75) > 0).tolist() == [False, True, False, True, True]
    assert (truncated(probs, top_p=0.7) > 0).tolist() == [False, True, False, True, False]
    assert (truncated(probs, top_p=1e-9) > 0).tolist() == [False, True, False, False, False]
    assert (truncated(probs, top_p=1.0) > 0).all()
    # the nucleus within the top 3 (0.85 of the mass): 0.4 + 0.3 >= 0.8 * 0.85
    assert (truncated(probs, top_k=3, top_p=0.8) > 0).tolist() == [False, True, False, True, False]


def _model():
    torch.manual_seed(0)
    vocab = Vocabulary.from_words(list("abcdefghij"))
    return RNNLanguageModel(len(vocab), 8, 8, 1), vocab


def test_generate_with_top_k_1_is_greedy_and_top_k_bounds_the_words_drawn():
    model, vocab = _model()

    def sample(seed, **kw):
        return generate(model, vocab, ["a"], 30, generator=torch.Generator().manual_seed(seed), **kw)

    assert sample(1, top_k=1) == sample(2, top_k=1) == sample(3, temperature=1e-9)
    assert sample(1, top_p=1e-9) == sample(1, top_k=1)
    assert sample(5, top_k=3, top_p=0.9) == sample(5, top_k=3, top_p=0.9)  # the seed decides
    assert len(set(sample(4))) > len(set(sample(4, top_k=2)))


@pytest.mark.parametrize("kw", [{"top_k": 0}, {"top_k": 1.5}, {"top_k": True}, {"top_p": 0.0},
                                {"top_p": 1.5}, {"top_p": float("nan")}])
def test_generate_refuses_bad_top_k_and_top_p(kw):
    model, vocab = _model()
    with pytest.raises(ValueError, match="top_k must be an int >= 1|top_p must be a number in"):
        generate(model, vocab, ["a"], 3, **kw)


@pytest.mark.parametrize("flag,value,says", [("--top-k", "0", "--top-k must be >= 1"),
                                             ("--top-p", "0", "--top-p must be in (0, 1]"),
                                             ("--top-p", "1.1", "--top-p must be in (0, 1]")])
def test_generate_refuses_bad_sampling_flags_in_one_line(tmp_path, capsys, flag, value, says):
    assert run_cli(["generate", str(tmp_path / "nothing"), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


def test_training_help_says_how_the_estimate_adapts():
    from rnndrop.lm.cli.parser import corpus_parser

    for text in (_help("ptb"), " ".join(corpus_parser("ptb").format_help().split())):
        assert "The progress bar's ETA starts from that same number; once the first epoch ends, the " \
               "measured speed replaces the timed one" in text


@pytest.mark.parametrize(("words", "top_p", "kept"),
                         [(10, 0.8, 8), (10, 0.9, 9), (1748, 0.25, 437), (10000, 0.5, 5000)])
def test_top_p_keeps_the_fewest_words_reaching_p_when_the_sum_rounds_below_it(words, top_p, kept):
    """Equal probabilities (a very high temperature): the running sum of the first 8 tenths is
    0.7999..., which kept a ninth word for p 0.8."""
    probs = torch.full((words,), 1 / words, dtype=torch.float64)
    assert int((truncated(probs, top_p=top_p) > 0).sum()) == kept


def test_a_string_prompt_is_refused_not_read_letter_by_letter():
    from rnndrop.lm.data.corpus import Vocabulary
    from rnndrop.lm.model.language_model import RNNLanguageModel

    vocab = Vocabulary(["<unk>", "<eos>", "the", "c", "a"])
    with pytest.raises(TypeError, match="prompt must be a sequence of words, got a string 'the cat'"):
        generate(RNNLanguageModel(5, 4, 4, 1), vocab, "the cat", 3)
