import pytest
import torch
from torch import nn

from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.language_model import RNNLanguageModel, detach_hidden
from rnndrop.lm.model.regimes import REGIMES, Regime, regime_probabilities, registered
from rnndrop.mc import sampling_modules
from rnndrop.recurrent import VariationalLSTM
from tests.lm_helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")

V = 30



ALL = {"embedding": 0.2, "input": 0.3, "between": 0.3, "hidden": 0.25, "output": 0.4}


def _lstm(model):
    rnn = model.rnn
    return rnn.module if not isinstance(rnn, VariationalLSTM) else rnn


def test_lm_protocol_shapes_and_state_carry():
    model = build_model(V, TINY, REGIMES["tied"], ALL).eval()
    tokens = torch.randint(V, (7, 3))
    logits, hidden = model(tokens)
    assert logits.shape == (7, 3, V)
    h, c = hidden
    assert h.shape == c.shape == (TINY.num_layers, 3, TINY.hidden_size)
    # Carrying the state over two segments equals one pass over both.
    first, state = model(tokens[:4])
    second, _ = model(tokens[4:], detach_hidden(state))
    torch.testing.assert_close(torch.cat([first, second]), logits)
    with pytest.raises(ValueError, match=r"tokens must be a \[T, B\] tensor"):
        model(tokens[0])


def test_none_regime_has_no_dropout_anywhere():
    model = build_model(V, TINY, REGIMES["none"], ALL)
    assert sampling_modules(model) == []
    lstm = _lstm(model)
    assert (lstm.dropout, lstm.dropout_input, lstm.dropout_hidden, lstm.dropout_output) == (0, 0, 0, 0)
    assert model.embedding.p == 0
    tokens = torch.randint(V, (5, 2))
    model.train()
    torch.testing.assert_close(model(tokens)[0], model.eval()(tokens)[0], rtol=0, atol=0)


def test_naive_and_tied_regimes_build_different_models():
    naive = build_model(V, TINY, REGIMES["naive"], ALL)
    tied = build_model(V, TINY, REGIMES["tied"], ALL)
    untied = build_model(V, TINY, REGIMES["untied"], ALL)
    n, t, u = _lstm(naive), _lstm(tied), _lstm(untied)
    # Zaremba: fresh masks every step, non-recurrent connections only, no word dropout.
    assert n.mask_scope == "step" and n.dropout_hidden == 0 and naive.embedding.p == 0
    assert (n.dropout_input, n.dropout, n.dropout_output) == (0.3, 0.3, 0.4)
    # Gal: per-sequence masks, recurrent dropout and word-type embedding dropout.
    assert t.mask_scope == "sequence" and t.dropout_hidden == 0.25 and tied.embedding.p == 0.2
    assert not t.per_gate_masks and u.per_gate_masks
    # The masks drawn differ in kind: per step for naive, one per sequence for tied.
    assert n.sample_masks(2, seq_len=5).inputs[0].shape == (5, 2, TINY.embedding_size)
    assert t.sample_masks(2).inputs[0].shape == (2, TINY.embedding_size)
    assert t.sample_masks(2).hidden[0] is not None and n.sample_masks(2, seq_len=5).hidden[0] is None
    # With the same parameters and seed, their training-mode outputs differ.
    tied.load_state_dict(naive.state_dict())
    tokens = torch.randint(V, (6, 2))
    torch.manual_seed(3)
    out_naive = naive.train()(tokens)[0]
    torch.manual_seed(3)
    out_tied = tied.train()(tokens)[0]
    assert not torch.allclose(out_naive, out_tied)
    torch.testing.assert_close(naive.eval()(tokens)[0], tied.eval()(tokens)[0])


def test_fast_path_regimes():
    batch = _lstm(build_model(V, TINY, REGIMES["batch"], ALL))
    assert batch.mask_scope == "batch" and batch.dropout_hidden == 0.25
    wd_model = build_model(V, TINY, REGIMES["weight_drop"], ALL)
    assert type(wd_model.rnn).__name__ == "WeightDrop"
    assert wd_model.rnn.p == 0.25 and _lstm(wd_model).dropout_hidden == 0
    tokens = torch.randint(V, (6, 2))
    assert wd_model.train()(tokens)[0].shape == (6, 2, V)


def test_regime_probabilities_zero_the_unused_sites():
    p = regime_probabilities(REGIMES["naive"], ALL)
    assert p == {"embedding": 0.0, "input": 0.3, "between": 0.3, "hidden": 0.0, "output": 0.4}
    with pytest.raises(ValueError, match="dropout sites must be among"):
        regime_probabilities(REGIMES["tied"], {"recurrent": 0.1})
    with pytest.raises(ValueError, match=r"dropout\['input'\] must be a probability"):
        regime_probabilities(REGIMES["tied"], {"input": 1.5})
    with pytest.raises(ValueError, match="sites must be among"):
        Regime("bad", sites=("gates",))


def test_weight_tying_and_init_scale():
    model = RNNLanguageModel(V, 16, 16, 1, tie_weights=True, init_scale=0.05)
    assert model.decoder.weight is model.embedding.embedding.weight
    assert all(p.abs().max() <= 0.05 for p in model.parameters())
    values = torch.cat([p.detach().flatten() for p in model.parameters()])  # uniform in [-0.05, 0.05]
    assert abs(float(values.mean())) < 0.005 and float((values < 0).float().mean()) > 0.4
    with pytest.raises(ValueError, match="embedding_size == hidden_size"):
        RNNLanguageModel(V, 8, 16, tie_weights=True)
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        RNNLanguageModel(0, 8, 16)


def test_custom_rnn_factory_keeps_its_own_initialisation():
    marker = {}

    def factory(input_size, hidden_size, num_layers, probabilities, cell):
        marker["p"], marker["cell"] = probabilities, cell
        lstm = nn.LSTM(input_size, hidden_size, num_layers)
        nn.init.constant_(lstm.weight_hh_l0, 0.5)
        return lstm

    regime = Regime("custom", sites=("embedding", "hidden"), rnn_factory="constant-lstm")
    with registered(hooks={"constant-lstm": factory}):
        model = build_model(V, TINY, regime, ALL)
    with pytest.raises(ValueError, match="hook must be one of .*got 'constant-lstm'"):
        build_model(V, TINY, regime, ALL)  # the registration ended with the block
    assert marker["p"]["hidden"] == 0.25 and marker["p"]["input"] == 0 and marker["cell"] == "lstm"

    def wide_factory(input_size, hidden_size, num_layers, probabilities, cell, **options):
        marker["options"] = options
        return nn.LSTM(input_size, hidden_size, num_layers)

    with registered(hooks={"constant-lstm": wide_factory}):
        build_model(V, TINY, regime, ALL)
    assert marker["options"] == {"output_fan_out": V}  # a factory that takes it learns the decoder's width
    assert torch.all(model.rnn.weight_hh_l0 == 0.5)
    assert model(torch.randint(V, (4, 2)))[0].shape == (4, 2, V)
    with pytest.raises(ValueError, match="custom rnn.*dropout_hidden must be 0"):
        RNNLanguageModel(V, 8, 8, rnn=nn.LSTM(8, 8), dropout_hidden=0.1)


def test_a_config_made_from_a_preset_never_changes_the_preset():
    """dataclasses.replace shared the preset's dropout and grid dicts: changing a copy's dropout
    changed the preset's for every later get_config in the process."""
    from dataclasses import replace

    from rnndrop.lm.model.presets import CONFIGS, get_config

    mine = replace(get_config("mini"), hidden_size=32)
    mine.dropout["hidden"] = 0.9
    mine.grid.clear()
    again = get_config("mini")
    assert again.dropout["hidden"] == CONFIGS["mini"].dropout["hidden"] != 0.9 and again.grid
    got = get_config("mini")
    got.dropout["hidden"] = 0.8
    assert CONFIGS["mini"].dropout["hidden"] != 0.8


@pytest.mark.parametrize(("field", "value", "message"), [
    ("tie_weights", "no", "tie_weights must be True or False, got 'no'"),
    ("decay_after", float("nan"), "decay_after must be an int >= 0, got nan"),
    ("decay_after", -3, "decay_after must be an int >= 0, got -3"),
    ("decay_after", "4", "decay_after must be an int >= 0, got '4'"),
    ("mc_samples", -5, "mc_samples must be an int >= 0, got -5"),
    ("name", None, "name must be a string, got None"),
    ("min_lr", True, "min_lr must be a number"),
    ("lr_decay", 0.5, "lr_decay must be >= 1 (the rate is divided by it), got 0.5"),
    ("dropout", {"hidden": "0.2"}, "dropout['hidden'] must be a float in [0, 1), got str '0.2'"),
    ("dropout", {"hidden": b"0.2"}, "dropout['hidden'] must be a float in [0, 1), got bytes"),
    ("grid", {"tied": ({"hidden": 2.0},)}, "dropout['hidden'] must be a probability in [0, 1), got 2.0"),
    ("grid", {"nonsense": ()}, "grid: regime must be one of"),
])
def test_every_config_field_is_checked(field, value, message):
    """Fields that were taken as they came: "no" tied the weights, a NaN decay_after never decayed,
    -3 started decayed, lr_decay 0.5 made the plateau schedule raise the rate."""
    from dataclasses import replace

    with pytest.raises((ValueError, TypeError)) as error:
        replace(TINY, **{field: value})
    assert message in str(error.value)


def test_a_language_model_names_its_own_arguments():
    with pytest.raises(ValueError, match=r"dropout_embedding must be a probability in \[0, 1\), got 1.0"):
        RNNLanguageModel(10, 4, 4, 1, dropout_embedding=1.0)
    with pytest.raises(TypeError, match="tie_weights must be True or False, got str 'no'"):
        RNNLanguageModel(10, 4, 4, 1, tie_weights="no")
