"""save_pretrained / from_pretrained: a trained language model in a folder, one call each way,
weights readable without rnndrop's checkpoint code, every file checked against a manifest
(issue 42 item 6)."""

import json

import pytest
import torch

from rnndrop.lm import PretrainedError, Vocabulary, build_model, from_pretrained, save_pretrained
from rnndrop.lm.model.regimes import get_regime
from tests.lm_helpers import TINY

WORDS = ["<unk>", "<eos>", "the", "cat", "sees", "a", "dog"]


def _model(regime="tied", seed=0):
    torch.manual_seed(seed)
    return build_model(len(WORDS), TINY, get_regime(regime), TINY.dropout).eval()


def _same_outputs(a, b):
    tokens = torch.tensor([[2, 3], [4, 5], [6, 2]])
    with torch.no_grad():
        return torch.equal(a(tokens)[0], b(tokens)[0])


@pytest.mark.parametrize("regime", ["tied", "none", "weight_drop", "sparse_vd"])
def test_a_model_round_trips_through_a_folder(tmp_path, regime):
    model = _model(regime)
    files = save_pretrained(tmp_path / "lm", model, vocab=Vocabulary(WORDS), config=TINY, regime=regime,
                            safetensors=False)
    assert sorted(p.name for p in files) == ["config.json", "manifest.json", "model.pt", "vocab.json"]
    weights = torch.load(tmp_path / "lm" / "model.pt", weights_only=True)  # plain torch reads it
    assert weights.keys() == model.state_dict().keys()
    loaded = from_pretrained(tmp_path / "lm")
    assert not loaded.model.training and loaded.vocab.itos == WORDS and loaded.config == TINY
    assert loaded.regime == regime and _same_outputs(model, loaded.model)
    manifest = json.loads((tmp_path / "lm" / "manifest.json").read_text())
    assert set(manifest["sha256"]) == {"config.json", "vocab.json", "model.pt"}


def test_a_changed_or_missing_file_is_refused_naming_it(tmp_path):
    folder = tmp_path / "lm"
    save_pretrained(folder, _model(), vocab=WORDS, config=TINY, regime="tied", safetensors=False)
    weights = torch.load(folder / "model.pt", weights_only=True)
    next(iter(weights.values())).add_(1)
    torch.save(weights, folder / "model.pt")
    with pytest.raises(PretrainedError, match=r"model.pt' was changed after it was written"):
        from_pretrained(folder)
    (folder / "model.pt").unlink()
    with pytest.raises(PretrainedError, match=r"model.pt' is missing"):
        from_pretrained(folder)
    with pytest.raises(PretrainedError, match="holds no manifest.json"):
        from_pretrained(tmp_path)
    with pytest.raises(PretrainedError, match="already holds"):
        save_pretrained(folder, _model(), vocab=WORDS, config=TINY, regime="tied")
    save_pretrained(folder, _model(seed=3), vocab=WORDS, config=TINY, regime="tied", overwrite=True,
                    safetensors=False)
    assert _same_outputs(_model(seed=3), from_pretrained(folder).model)


def test_a_vocabulary_of_another_size_is_refused(tmp_path):
    with pytest.raises(PretrainedError, match="vocab has 3 words, the model predicts 7"):
        save_pretrained(tmp_path, _model(), vocab=WORDS[:3], config=TINY, regime="tied")


def test_a_vocabulary_without_its_unknown_word_is_refused_when_saved_not_when_loaded():
    """Was: saved (all four files, manifest included), then refused by from_pretrained, blaming
    config.json."""
    vocab = ["a", "b", "c", "d", "e", "f", "g"]
    with pytest.raises(PretrainedError, match="vocab is not a vocabulary from_pretrained could read back: "
                       "words must contain the unknown-word token '<unk>'"):
        save_pretrained("never-written", _model(), vocab=vocab, config=TINY, regime="tied")


def _rehashed(folder, name, write) -> None:
    """``name`` in ``folder`` rewritten by ``write(path)``, its SHA-256 recorded again in the manifest
    (a folder edited by hand or written by something else passes the hash check)."""
    from rnndrop.atomic import file_sha256

    write(folder / name)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["sha256"][name] = file_sha256(folder / name)
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(("name", "write", "message"), [
    ("model.pt", lambda p: torch.save([torch.zeros(1)], p), r"model.pt' does not fit .* holds a list, not a"),
    ("model.pt", lambda p: torch.save(torch.zeros(1), p), r"model.pt' does not fit .* holds a Tensor"),
    ("config.json", lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "regime_settings": "x"})),
     r"config.json' does not describe a model"),
    ("config.json", lambda p: p.write_text(json.dumps({**json.loads(p.read_text()), "vocab_size": 999})),
     r"config.json' does not describe a model \(vocab_size 999, but vocab.json holds 7 words\)"),
    ("vocab.json", lambda p: p.write_text("3"), r"vocab.json' is not a vocabulary"),
])
def test_files_that_pass_the_manifest_but_are_malformed_are_one_error_naming_the_file(tmp_path, name, write,
                                                                                       message):
    """Was: TypeError, AttributeError, a plain ValueError naming no file, or a load of a config whose
    vocab_size disagreed with its vocabulary."""
    folder = tmp_path / "lm"
    save_pretrained(folder, _model(), vocab=WORDS, config=TINY, regime="tied", safetensors=False)
    _rehashed(folder, name, write)
    with pytest.raises(PretrainedError, match=message):
        from_pretrained(folder)


def test_a_manifest_naming_files_outside_the_model_is_refused_before_reading_them(tmp_path):
    folder = tmp_path / "lm"
    save_pretrained(folder, _model(), vocab=WORDS, config=TINY, regime="tied", safetensors=False)
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("not the model's")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["sha256"][str(outside)] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest))
    refused = r"lists files a pretrained model does not hold: '.*elsewhere.txt'"
    with pytest.raises(PretrainedError, match=refused):
        from_pretrained(folder)


def test_the_safetensors_layout_when_it_is_installed(tmp_path):
    pytest.importorskip("safetensors")
    model = _model("tied")  # tied weights: one tensor under two names
    save_pretrained(tmp_path / "lm", model, vocab=WORDS, config=TINY, regime="tied", safetensors=True)
    assert (tmp_path / "lm" / "model.safetensors").is_file()
    assert _same_outputs(model, from_pretrained(tmp_path / "lm").model)


@pytest.mark.slow
def test_a_trained_run_saves_and_loads_in_one_call_each(tmp_path):
    from dataclasses import replace

    from rnndrop.lm import load_corpus, load_model, train_run
    from tests.lm_helpers import write_corpus

    corpus = load_corpus(write_corpus(tmp_path / "data"))
    train_run(corpus, replace(TINY, epochs=1, mc_samples=0), "tied", tmp_path / "run", progress=False)
    run = load_model(tmp_path / "run")
    save_pretrained(tmp_path / "lm", run.model, vocab=run.vocab, config=run.config,
                    regime=run.regime_settings, dropout=run.dropout)
    loaded = from_pretrained(tmp_path / "lm")
    assert loaded.vocab.itos == run.vocab.itos and loaded.regime == "tied"
    assert _same_outputs(run.model, loaded.model)
