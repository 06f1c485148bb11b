"""Deployment: the eval-mode layers as plain nn.LSTM / nn.GRU (``to_plain``, ``rnndrop.to_torch``),
dynamic quantization of the converted model, ``torch.export`` with a dynamic batch dimension of the
layers and the language model, and the legacy (TorchScript-based) ONNX exporter."""

import io
import warnings

import pytest
import torch
from torch import nn

import rnndrop
from rnndrop import (
    GaussianGRU,
    GaussianLSTM,
    SparseGRU,
    SparseLSTM,
    VariationalGRU,
    VariationalLSTM,
    WeightDrop,
)
from rnndrop.lm import RNNLanguageModel

LAYERS = [
    pytest.param(lambda: VariationalLSTM(4, 6, num_layers=2, dropout=0.3, dropout_hidden=0.3,
                                         dropout_input=0.2, dropout_output=0.2), id="lstm"),
    pytest.param(lambda: VariationalLSTM(4, 6, bidirectional=True, proj_size=3, batch_first=True,
                                         dropout_hidden=0.3), id="lstm-proj-bidir-batch-first"),
    pytest.param(lambda: VariationalLSTM(4, 6, bias=False, dropout_hidden=0.3, kernel="manual"),
                 id="lstm-no-bias-manual"),
    pytest.param(lambda: VariationalGRU(4, 6, num_layers=2, dropout_hidden=0.3, per_gate_masks=True),
                 id="gru"),
    pytest.param(lambda: GaussianLSTM(4, 6, dropout_hidden=0.3, dropout_input=0.2), id="gaussian-lstm"),
    pytest.param(lambda: GaussianGRU(4, 6, dropout_hidden=0.3), id="gaussian-gru"),
    pytest.param(lambda: SparseLSTM(4, 6, num_layers=2), id="sparse-lstm"),
    pytest.param(lambda: SparseGRU(4, 6), id="sparse-gru"),
]


def _input(layer: nn.Module, batch: int = 3) -> torch.Tensor:
    x = torch.randn(5, batch, 4)
    return x.transpose(0, 1) if layer.batch_first else x


def _sparsify(layer: nn.Module) -> None:
    if isinstance(layer, (SparseLSTM, SparseGRU)):  # prune some weights, so that it shows
        with torch.no_grad():
            for name in layer.sparse_weight_names():
                getattr(layer, "log_sigma2_" + name).uniform_(-10, 10)


@pytest.mark.parametrize("make", LAYERS)
def test_to_plain_is_an_nn_rnn_with_the_eval_function(make):
    layer = make()
    _sparsify(layer)
    plain = layer.to_plain()
    assert type(plain) is (nn.LSTM if isinstance(layer, nn.LSTM) else nn.GRU)
    assert not plain.training and layer.training  # the layer keeps its mode
    x = _input(layer)
    expected = layer.eval()(x)
    got = plain(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not any(p.data_ptr() == q.data_ptr() for p in plain.parameters() for q in layer.parameters())


@pytest.mark.parametrize("torch_cls", [nn.LSTM, nn.GRU])
def test_from_module_and_to_plain_give_back_the_module_they_started_from(torch_cls):
    """nn.LSTM -> from_module -> to_plain: the same configuration, ``dropout`` included (between
    layers: the one dropout both have), and the same weights."""
    start = torch_cls(4, 6, 3, dropout=0.25, batch_first=True, bidirectional=True)
    back = (VariationalLSTM if torch_cls is nn.LSTM else VariationalGRU).from_module(start).to_plain()
    for setting in ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout",
                    "bidirectional"):
        assert getattr(back, setting) == getattr(start, setting), setting
    torch.testing.assert_close(back.state_dict(), start.state_dict(), rtol=0, atol=0)


@pytest.mark.parametrize("cls", [GaussianLSTM, GaussianGRU, SparseLSTM, SparseGRU])
def test_gaussian_and_sparse_layers_start_from_a_torch_module_with_their_own_parameters_initialised(cls):
    """from_module loaded nn.LSTM's state strictly: the log alphas / log sigmas it lacks failed it."""
    start = (nn.LSTM if "LSTM" in cls.__name__ else nn.GRU)(4, 6, 2)
    layer = cls.from_module(start)
    fresh = cls(4, 6, 2)
    for name, value in layer.state_dict().items():
        if name in start.state_dict():
            assert torch.equal(value, start.state_dict()[name]), name
        else:  # the subclass's own: its initialisation
            assert torch.equal(value, fresh.state_dict()[name]), name


def test_to_plain_refuses_a_class_that_overrides_the_forward_pass():
    class Custom(VariationalLSTM):
        def _forward(self, *args):
            return super()._forward(*args)

    class Scaled(VariationalGRU):  # the public forward: its copy computed half of this
        def forward(self, x, *args, **kwargs):
            out, state = super().forward(x, *args, **kwargs)
            return out * 2, state

    for custom in (Custom(4, 6), Scaled(4, 6)):
        with pytest.raises(TypeError, match=f"{type(custom).__name__}.to_plain: the class overrides"):
            custom.to_plain()
        with pytest.raises(TypeError, match="overrides the forward pass"):
            rnndrop.to_torch(nn.Sequential(custom))


def _language_model() -> RNNLanguageModel:
    return RNNLanguageModel(30, 8, 8, 2, dropout_embedding=0.1, dropout_input=0.3, dropout_hidden=0.3,
                            dropout_output=0.3, weight_drop=0.2, tie_weights=True)


def test_to_torch_converts_every_layer_and_keeps_the_model_and_its_outputs():
    model = _language_model()
    converted = rnndrop.to_torch(model)
    kinds = {type(m) for m in converted.modules()}
    assert not any(issubclass(k, (rnndrop.VariationalLSTM, WeightDrop)) for k in kinds)
    assert nn.LSTM in kinds and model.training  # the original is unchanged
    tokens = torch.randint(0, 30, (6, 3))
    logits, _ = model.eval()(tokens)
    torch.testing.assert_close(converted(tokens)[0], logits, rtol=0, atol=1e-6)
    assert isinstance(rnndrop.to_torch(WeightDrop(nn.LSTM(3, 4), ["weight_hh_l0"], p=0.3)), nn.LSTM)
    assert isinstance(rnndrop.to_torch(VariationalGRU(3, 4)), nn.GRU)


def test_to_torch_of_a_compiled_model_is_the_plain_copy_of_what_it_compiles():
    """A compiled wrapper's deep copy ran the compiled function of the original module, in
    training mode: two calls gave two outputs, neither the eval-mode model's."""
    layer = VariationalLSTM(5, 7, dropout_hidden=0.3, dropout_output=0.5)
    x = torch.randn(4, 2, 5)
    expected = layer.eval()(x)[0]
    layer.train()
    outer = nn.Sequential(nn.Linear(5, 5), torch.compile(VariationalLSTM(5, 7, dropout_hidden=0.3),
                                                          backend="eager"))
    for compiled in (rnndrop.compile_model(layer, mode=None, backend="eager"),
                     torch.compile(layer, backend="eager")):
        compiled(x)  # a training call first
        deployed = rnndrop.to_torch(compiled)
        assert type(deployed) is nn.LSTM and not deployed.training
        torch.testing.assert_close(deployed(x)[0], expected, rtol=0, atol=1e-6)
    deployed = rnndrop.to_torch(outer)
    assert type(deployed[1]) is nn.LSTM and layer.training  # a compiled part too; the originals unchanged
    torch.testing.assert_close(deployed(x)[0], outer.eval()(x)[0], rtol=0, atol=1e-6)


def test_to_torch_of_a_whole_compiled_model_converts_the_layers_inside():
    """A compiled container (not a compiled layer): its layers were left rnndrop's, so
    quantize_dynamic skipped them. And the compiled wrapper gives the model's attributes."""
    model = nn.Sequential(VariationalLSTM(5, 7, dropout_hidden=0.3))
    x = torch.randn(4, 2, 5)
    expected = model.eval()(x)[0]
    model.train()
    for compiled in (rnndrop.compile_model(model, mode=None, backend="eager"),
                     torch.compile(model, backend="eager")):
        deployed = rnndrop.to_torch(compiled)
        assert type(deployed) is nn.Sequential and type(deployed[0]) is nn.LSTM
        torch.testing.assert_close(deployed(x)[0], expected, rtol=0, atol=1e-6)
    named = nn.Module()
    named.rnn = VariationalLSTM(5, 7)
    assert rnndrop.compile_model(named, mode=None, backend="eager").rnn is named.rnn
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(rnndrop.compile_model(named, mode=None, backend="eager"), "nope")  # noqa: B009


def test_to_torch_of_a_data_parallel_model_is_the_plain_copy_of_its_module(tmp_path):
    """DistributedDataParallel was copied whole: the copy kept its process group (torch.export
    refused it, torch.save failed once the group was gone)."""
    model = nn.Sequential(VariationalLSTM(5, 7, dropout_hidden=0.3))
    x = torch.randn(4, 2, 5)
    expected = model.eval()(x)[0]
    group = f"file://{tmp_path / 'group'}"
    torch.distributed.init_process_group("gloo", init_method=group, rank=0, world_size=1)
    try:
        wrappers = [nn.parallel.DistributedDataParallel(model), nn.DataParallel(model)]
        for wrapped in (*wrappers, rnndrop.compile_model(wrappers[0], mode=None, backend="eager")):
            deployed = rnndrop.to_torch(wrapped)
            assert type(deployed) is nn.Sequential and type(deployed[0]) is nn.LSTM, type(deployed)
            torch.testing.assert_close(deployed(x)[0], expected, rtol=0, atol=1e-6)
    finally:
        torch.distributed.destroy_process_group()
    torch.save(deployed, io.BytesIO())  # no process group in the copy


def test_to_torch_keeps_a_layer_registered_twice_one_module():
    shared = VariationalLSTM(4, 4, dropout_hidden=0.3)
    model = nn.ModuleDict({"encoder": shared, "decoder": shared})
    deployed = rnndrop.to_torch(model)
    assert deployed["encoder"] is deployed["decoder"] and type(deployed["encoder"]) is nn.LSTM
    assert sum(p.numel() for p in deployed.parameters()) == sum(p.numel() for p in model.parameters())


def test_prune_keeps_a_sparse_layer_registered_twice_one_pruned_layer():
    """Twice in one parent (named_children skips the repeat) and in two parents (replacing each
    place on its own would untie them): one nn.Linear in every place."""
    shared = rnndrop.SparseLinear(3, 3)
    twice = nn.Module()
    twice.a = twice.b = shared
    pruned = rnndrop.prune(twice)
    assert type(pruned.a) is nn.Linear and pruned.a is pruned.b
    two_parents = nn.ModuleDict({"left": nn.Sequential(shared), "right": nn.Sequential(shared)})
    pruned = rnndrop.prune(two_parents)
    assert type(pruned["left"][0]) is nn.Linear and pruned["left"][0] is pruned["right"][0]
    assert type(shared) is rnndrop.SparseLinear  # the original unchanged


def test_quantize_dynamic_quantizes_the_converted_layers():
    """quantize_dynamic swaps modules by exact type: it leaves rnndrop's layers in float, and
    quantizes the nn.LSTM of the converted model."""
    quantize_dynamic = torch.ao.quantization.quantize_dynamic
    model = RNNLanguageModel(30, 16, 16, 2, dropout_hidden=0.3, dropout_output=0.3).eval()
    tokens = torch.randint(0, 30, (7, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # quantize_dynamic points at torchao
        untouched = quantize_dynamic(model, {nn.LSTM}, dtype=torch.qint8)
        quantized = quantize_dynamic(rnndrop.to_torch(model), {nn.LSTM, nn.Linear}, dtype=torch.qint8)
    assert type(untouched.rnn) is VariationalLSTM  # why the conversion exists
    assert type(quantized.rnn) is torch.ao.nn.quantized.dynamic.LSTM
    torch.testing.assert_close(quantized(tokens)[0], model(tokens)[0], atol=0.05, rtol=0.05)


EXPORTED = [
    pytest.param(lambda: VariationalLSTM(4, 6, num_layers=2, dropout_hidden=0.3, dropout=0.2), id="lstm"),
    pytest.param(lambda: VariationalLSTM(4, 6, bidirectional=True, proj_size=3, dropout_hidden=0.3),
                 id="lstm-proj-bidir"),
    pytest.param(lambda: VariationalGRU(4, 6, dropout_hidden=0.3), id="gru"),
    pytest.param(lambda: GaussianLSTM(4, 6, dropout_hidden=0.3), id="gaussian"),
]


@pytest.mark.parametrize("make", EXPORTED)
def test_torch_export_of_the_eval_layer_with_a_dynamic_batch(make):
    layer = make().eval()
    batch = torch.export.Dim("batch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own, about nn.RNNBase._flat_weights
        program = torch.export.export(layer, (torch.randn(5, 3, 4),), dynamic_shapes=({1: batch},))
    for b in (1, 2, 9):
        x = torch.randn(5, b, 4)
        torch.testing.assert_close(program.module()(x), layer(x), rtol=0, atol=1e-6)


def test_torch_export_of_the_language_model_with_a_dynamic_batch():
    model = _language_model().eval()
    batch = torch.export.Dim("batch")
    tokens = torch.randint(0, 30, (6, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        program = torch.export.export(model, (tokens,), dynamic_shapes=({1: batch},))
    for b in (1, 5):
        tokens = torch.randint(0, 30, (6, b))
        torch.testing.assert_close(program.module()(tokens)[0], model(tokens)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("make", [lambda: VariationalLSTM(4, 6, num_layers=2, dropout_hidden=0.3),
                                  _language_model], ids=["lstm", "language-model"])
def test_legacy_onnx_export(make):
    """``torch.onnx.export(dynamo=False)`` passes every parameter with a default positionally: the
    extra ones are positional-or-keyword."""
    pytest.importorskip("onnx")  # the legacy exporter needs it
    model = make().eval()
    args = (torch.randint(0, 30, (6, 3)),) if isinstance(model, RNNLanguageModel) else (torch.randn(5, 3, 4),)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, f, dynamo=False, input_names=["input"], output_names=["output"])
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    (got, *_) = session.run(["output"], {"input": args[0].numpy()})
    torch.testing.assert_close(torch.from_numpy(got), model(*args)[0], rtol=1e-4, atol=1e-5)


def test_to_plain_never_switches_the_layer_itself_to_eval_mode():
    """It read the eval-mode weights by flipping the layer's own ``training`` for a moment, which a
    call in another thread would have run under (test_autocast.py: an autocast call keeps nothing
    on the layer either)."""
    seen = []

    class Spy(VariationalLSTM):
        def _layer_weights(self, layer, direction):
            seen.append((self.training, spied.training))
            return super()._layer_weights(layer, direction)

    spied = Spy(3, 4, num_layers=2, dropout_hidden=0.3).train()
    spied.to_plain()
    assert seen and all(copy_mode is False and own is True for copy_mode, own in seen)


def test_parametrized_and_pruned_layers_convert_both_ways():
    """to_plain / to_torch of a layer with a parametrization (copy.copy refused it), and from_module
    of a pruned or parametrized nn.LSTM (its state dict holds weight_orig and the mask): the
    weights it computes with, as plain parameters; eval outputs equal."""
    from torch.nn.utils import parametrizations, prune

    layer = VariationalLSTM(5, 6, dropout_hidden=0.3)
    parametrizations.orthogonal(layer, "weight_hh_l0")
    x = torch.randn(4, 2, 5)
    plain = rnndrop.to_torch(layer)
    assert type(plain) is nn.LSTM and layer.training
    torch.testing.assert_close(plain(x)[0], layer.eval()(x)[0], rtol=0, atol=1e-6)
    for treat in (lambda m: prune.l1_unstructured(m, "weight_hh_l0", amount=0.5),
                  lambda m: parametrizations.weight_norm(m, "weight_ih_l0")):
        module = nn.LSTM(5, 6)
        treat(module)
        ours = VariationalLSTM.from_module(module, dropout_hidden=0.3).eval()
        torch.testing.assert_close(ours(x)[0], module.eval()(x)[0], rtol=0, atol=1e-6)


def test_from_module_of_a_sparse_layer_keeps_what_its_state_dict_holds():
    """The weights a module computes with are read by name, and the rest of its state dict still
    goes over: a SparseLSTM's log sigmas to a SparseLSTM, and a VariationalLSTM refuses them (it
    would compute with the unpruned weights)."""
    sparse = rnndrop.SparseLSTM(3, 4)
    with torch.no_grad():
        sparse.log_sigma2_weight_hh_l0.fill_(-1.25)
    again = rnndrop.SparseLSTM.from_module(sparse)
    assert torch.all(again.log_sigma2_weight_hh_l0 == -1.25)
    with pytest.raises(RuntimeError, match="gives other weights than the layer takes: log_sigma2_"):
        VariationalLSTM.from_module(sparse)
