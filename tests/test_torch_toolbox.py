"""rnndrop's modules under torch's other tools: torch.compile runs them, torch.func
transforms them, torch.jit.script refuses them with a reason."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad

from rnndrop import (
    EmbeddingDropout,
    GaussianLSTM,
    LockedDropout,
    SparseLSTM,
    VariationalGRU,
    VariationalGRUCell,
    VariationalLSTM,
    VariationalLSTMCell,
    WeightDrop,
)
from rnndrop.lm import RNNLanguageModel
from rnndrop.stochastic import noise_per_sequence
from tests.helpers import distinct

LAYERS = [
    pytest.param(lambda: VariationalLSTM(3, 4, num_layers=2, dropout_hidden=0.3, dropout=0.2), id="lstm"),
    pytest.param(lambda: VariationalGRU(3, 4, dropout_hidden=0.3, dropout_input=0.2), id="gru"),
    pytest.param(lambda: VariationalLSTM(3, 4), id="lstm-no-dropout"),
    pytest.param(lambda: GaussianLSTM(3, 4, dropout_hidden=0.3), id="gaussian"),
    pytest.param(lambda: SparseLSTM(3, 4), id="sparse"),
]


def _compiled_equals_eager(layer: nn.Module, backend: str) -> None:
    x = torch.randn(5, 2, 3)
    for training in (True, False):
        layer.train(training)
        torch.manual_seed(1)
        expected = layer(x)[0]
        torch.manual_seed(1)
        got = torch.compile(layer, backend=backend)(x)[0]
        torch.testing.assert_close(got, expected)
        if training:
            got.sum().backward()


@pytest.mark.parametrize("make", LAYERS)
def test_torch_compile_runs_the_layers_with_their_eager_results(make):
    torch._dynamo.reset()
    _compiled_equals_eager(make(), backend="eager")


def test_word_dropout_of_a_batch_scope_compiles_whole_and_follows_noise_per_sequence():
    """``EmbeddingDropout(scope="batch")`` compiles as one graph (``fullgraph=True``), and the
    compiled module follows ``noise_per_sequence`` (Monte-Carlo samples stacked in one batch): the
    switch is an attribute of the module, which torch.compile guards on."""
    torch._dynamo.reset()
    drop = EmbeddingDropout(nn.Embedding(4, 3), 0.5, scope="batch").train()
    compiled = torch.compile(drop, backend="eager", fullgraph=True)
    tokens = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]).unsqueeze(1).expand(8, 32)  # [T, B], V <= T: dense draws
    torch.manual_seed(4)
    shared = compiled(tokens).ne(0).all(-1)
    with noise_per_sequence(drop):
        apart = compiled(tokens).ne(0).all(-1)
    assert all(torch.equal(shared[:, 0], shared[:, b]) for b in range(32))
    assert distinct(apart, 1) > 4


@pytest.mark.slow
@pytest.mark.parametrize("make", LAYERS[:2])
def test_torch_compile_with_the_default_backend_runs_a_model_around_the_layer(make):
    """Inductor compiles the layer compiled on its own (dynamo traces its functions frame by frame:
    without ``allow_rnn`` it leaves the layer's methods out) and what is around a layer held by a
    model (a graph break, as for nn.LSTM). Its masks come from Inductor's random numbers unless
    ``fallback_random`` asks for eager's: with it, the eager layer's results. It failed in every
    mode before."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        _compiled_equals_eager(make(), backend="inductor")
        model = RNNLanguageModel(50, 8, 8, 2, dropout_input=0.3, dropout_hidden=0.2, dropout_output=0.3)
        tokens = torch.randint(50, (6, 2))
        torch.manual_seed(2)
        expected = model(tokens)[0]
        torch.manual_seed(2)
        torch.testing.assert_close(torch.compile(model)(tokens)[0], expected)


@pytest.mark.parametrize("variational", [False, True])
def test_torch_func_grad_of_weight_drop_in_training_equals_autograd(variational):
    module = WeightDrop(nn.LSTM(3, 4), ["weight_hh_l0"], 0.3, variational=variational)
    x = torch.randn(5, 2, 3)

    def loss(parameters):
        return functional_call(module, parameters, (x,))[0].pow(2).sum()

    torch.manual_seed(3)
    got = grad(loss)({name: p.detach() for name, p in module.named_parameters()})
    torch.manual_seed(3)
    loss(dict(module.named_parameters())).backward()
    for name, parameter in module.named_parameters():
        torch.testing.assert_close(got[name], parameter.grad, msg=name)


@pytest.mark.parametrize(
    "make",
    [
        lambda: VariationalLSTM(3, 4, dropout_hidden=0.3),
        lambda: VariationalGRUCell(3, 4),
        lambda: VariationalLSTMCell(3, 4),
        lambda: WeightDrop(nn.LSTM(3, 4), ["weight_hh_l0"], 0.3),
        lambda: LockedDropout(0.3),
        lambda: EmbeddingDropout(nn.Embedding(10, 3), 0.3),
        lambda: RNNLanguageModel(50, 8, 8, 1),  # a model holding them
    ],
)
def test_torch_jit_script_refuses_with_one_line_naming_the_module(make):
    with pytest.raises(TypeError, match=r"cannot be compiled by torch.jit.script .* torch.compile") as error:
        torch.jit.script(make())
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
@pytest.mark.parametrize("kernel", ["auto", "manual", "autograd"])
def test_torch_jit_trace_of_a_loop_kernel_refuses_in_one_line_and_eval_mode_traces(cls, kernel):
    """Traced in training mode with a recurrent mask (or with a kernel named), the loop kernel's
    autograd Functions stopped TorchScript's tracer with an internal assertion, or not, depending on
    what ran before in the process; now one line names the ways that work. Eval mode with
    kernel='auto' (the fused op, as nn.LSTM) traces and equals the layer."""
    x = torch.randn(5, 2, 3)
    layer = cls(3, 4, num_layers=2, dropout_hidden=0.3, kernel=kernel)
    refused = r"cannot be traced by torch.jit.trace .* eval mode with kernel='auto', or use torch.compile"
    with pytest.raises(TypeError, match=refused) as error:
        torch.jit.trace(layer.train(), x, check_trace=False)
    assert "\n" not in str(error.value)
    if kernel == "auto":
        traced = torch.jit.trace(layer.eval(), x)
        torch.testing.assert_close(traced(x), layer(x))


@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
def test_torch_func_grad_of_a_layer_with_masks_runs_the_autograd_kernel_and_equals_autograd(cls):
    """kernel='auto' under torch.func.grad runs the loop kernel written in plain torch ops
    (the hand-written backward passes are autograd Functions torch.func cannot run)."""
    layer = cls(3, 4, num_layers=2, dropout_hidden=0.3, dropout=0.2)
    x = torch.randn(5, 2, 3)
    masks = layer.sample_masks(2)

    def loss(parameters):
        return functional_call(layer, parameters, (x,), {"masks": masks})[0].pow(2).sum()

    got = grad(loss)({name: p.detach() for name, p in layer.named_parameters()})
    loss(dict(layer.named_parameters())).backward()
    for name, parameter in layer.named_parameters():
        torch.testing.assert_close(got[name], parameter.grad, msg=name)


DROPPING = [
    pytest.param(lambda: VariationalLSTM(3, 4, num_layers=2, dropout=0.2, dropout_input=0.3,
                                         dropout_hidden=0.3, dropout_output=0.1), id="lstm"),
    pytest.param(lambda: VariationalGRU(3, 4, num_layers=2, dropout_hidden=0.3, dropout_input=0.2), id="gru"),
]


@pytest.mark.parametrize("make", DROPPING)
def test_torch_export_in_training_draws_fresh_masks_the_eager_ones_of_the_same_seed(make):
    """A layer exported in training mode draws its masks at each call of the exported program,
    through torch's generator: the seed that gives eager mode its masks gives the program the same."""
    layer = make()
    x = torch.randn(5, 2, 3)
    program = torch.export.export(layer, (x,)).module()
    torch.manual_seed(1)
    exported = program(x)
    torch.manual_seed(1)
    eager = layer(x)
    torch.testing.assert_close(exported, eager)
    assert not torch.equal(program(x)[0], exported[0])


@pytest.mark.parametrize("make", DROPPING)
def test_torch_func_vmap_gives_each_sample_its_own_masks_with_different_randomness(make):
    """``vmap(randomness="different")``: each sample of the same input gets masks of its own;
    ``randomness="same"``: every sample gets the masks eager mode draws from the same seed."""
    layer = make()
    x = torch.randn(5, 2, 3)
    xs = x.expand(4, 5, 2, 3)
    different = torch.func.vmap(lambda x: layer(x)[0], randomness="different")(xs)
    assert all(not torch.equal(different[i], different[j]) for i in range(4) for j in range(i))
    torch.manual_seed(2)
    same = torch.func.vmap(lambda x: layer(x)[0], randomness="same")(xs)
    torch.manual_seed(2)
    torch.testing.assert_close(same, layer(x)[0].expand(4, 5, 2, 4))


WITHOUT_RECURRENT_MASKS = [  # the configurations kernel="auto" runs through torch's fused op outside vmap
    pytest.param(lambda: VariationalLSTM(3, 4, num_layers=2, dropout=0.3), id="lstm-between-layers"),
    pytest.param(lambda: VariationalLSTM(3, 4, dropout_input=0.3, dropout_output=0.3), id="lstm-in-out"),
    pytest.param(lambda: VariationalLSTM(3, 4, dropout_hidden=0.3, mask_scope="batch"),
                 id="lstm-batch-scope"),
    pytest.param(lambda: VariationalGRU(3, 4, dropout_input=0.3), id="gru-input"),
    pytest.param(lambda: VariationalGRU(3, 4, dropout_hidden=0.3, mask_scope="batch"), id="gru-batch-scope"),
    pytest.param(lambda: VariationalLSTM(3, 4, num_layers=2, bidirectional=True), id="lstm-no-dropout"),
]


@pytest.mark.parametrize("make", WITHOUT_RECURRENT_MASKS)
def test_torch_func_vmap_runs_the_configurations_torchs_fused_op_would_take(make):
    """torch's fused RNN op has no vmap rule: under vmap those configurations run layer by layer
    on torch's own ops, training and eval mode alike, and in eval give each sample's own output."""
    layer = make()
    xs = torch.randn(4, 5, 2, 3)
    different = torch.func.vmap(lambda x: layer(x)[0], randomness="different")(xs)
    assert different.shape == (4, 5, 2, layer.hidden_size * (2 if layer.bidirectional else 1))
    layer.eval()
    batched = torch.func.vmap(lambda x: layer(x)[0])(xs)
    torch.testing.assert_close(batched, torch.stack([layer(x)[0] for x in xs]))


@pytest.mark.parametrize("make", WITHOUT_RECURRENT_MASKS + DROPPING)
def test_forward_mode_ad_gives_the_tangent_autograd_gives(make):
    """Forward-mode AD (torch.autograd.forward_ad) through a training-mode layer: the hand-written
    Functions have no jvp, so the layer runs torch's own ops; the tangent is the Jacobian-vector
    product double backward gives with the same masks."""
    layer = make().double()
    x, v = torch.randn(5, 2, 3, dtype=torch.float64), torch.randn(5, 2, 3, dtype=torch.float64)
    masks = layer.sample_masks(2)
    with torch.autograd.forward_ad.dual_level():
        dual = layer(torch.autograd.forward_ad.make_dual(x, v), masks=masks)[0]
        tangent = torch.autograd.forward_ad.unpack_dual(dual).tangent
    layer.kernel = "autograd"  # double backward, which the hand-written kernels refuse
    expected = torch.autograd.functional.jvp(lambda x: layer(x, masks=masks)[0], x, v)[1]
    torch.testing.assert_close(tangent, expected)
    layer.kernel = "auto"
    layer.float()
    with torch.autograd.forward_ad.dual_level():  # float32: the input projection's Function too
        dual = layer(torch.autograd.forward_ad.make_dual(x.float(), v.float()))[0]
        assert torch.autograd.forward_ad.unpack_dual(dual).tangent is not None


@pytest.mark.parametrize("kernel", ["manual", "compiled"])
@pytest.mark.parametrize("cls", [VariationalLSTM, VariationalGRU])
def test_hand_written_kernels_refuse_vmap_and_export_in_one_line_naming_the_way_out(cls, kernel):
    layer = cls(3, 4, dropout_hidden=0.3, kernel=kernel)
    x = torch.randn(5, 2, 3)
    refusal = rf"^the '{kernel}' loop kernel cannot run under torch.func .* or kernel='autograd'$"
    with pytest.raises(RuntimeError, match=refusal):
        torch.func.vmap(lambda x: layer(x)[0], randomness="different")(x.expand(2, 5, 2, 3))
    with pytest.raises(RuntimeError, match=refusal):
        torch.export.export(layer, (x,))


def test_import_leaves_torch_dynamo_to_torch_compile():
    """torch._dynamo (and through it triton, when installed) costs seconds to import; only
    torch.compile needs it, so ``import rnndrop`` and a forward pass do not load it."""
    import subprocess
    import sys

    code = ("import sys, torch, rnndrop; "
            "rnndrop.VariationalLSTM(3, 4, dropout_hidden=0.5)(torch.randn(2, 1, 3)); "
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


ENSEMBLE_SETTINGS = [{}, {"dropout_hidden": 0.3}, {"dropout_hidden": 0.3, "mask_scope": "batch"}]


@pytest.mark.parametrize("setting", ENSEMBLE_SETTINGS,
                         ids=["plain", "tied", "batch"])
def test_vmap_over_an_ensembles_stacked_weights_runs_in_eval_mode(setting):
    """torch.func's ensembling (stack_module_state, functional_call, vmap over the weights alone,
    the input shared): the weights are batched and the input is not, so the fused op ran and had no
    vmap rule. Every layer's output equals its own call."""
    import copy

    from torch.func import functional_call, stack_module_state, vmap

    for cls in (VariationalLSTM, VariationalGRU):
        models = [cls(4, 5, 2, **setting).eval() for _ in range(3)]
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")
        x = torch.randn(6, 2, 4)
        def one(p, b, x, base=base):
            return functional_call(base, (p, b), (x,))[0]

        out = vmap(one, in_dims=(0, 0, None))(params, buffers, x)
        torch.testing.assert_close(out, torch.stack([m(x)[0] for m in models]), atol=1e-6, rtol=1e-5)
