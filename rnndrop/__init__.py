"""rnndrop: variational (tied) dropout and other regularizers for recurrent networks."""

from rnndrop.activation_regularization import (
    ActivationRegularization,
    RecurrentOutputs,
    activation_regularization,
    temporal_activation_regularization,
)
from rnndrop.averaging import NonMonotoneTrigger, NTAveraging
from rnndrop.bptt import VariableBPTT, scaled_learning_rate
from rnndrop.calibration import ReliabilityDiagram, expected_calibration_error, reliability_diagram
from rnndrop.cells import VariationalGRUCell, VariationalLSTMCell
from rnndrop.compiling import CompiledModel, compile_model
from rnndrop.deploy import prune, to_torch
from rnndrop.embedding_dropout import EmbeddingDropout
from rnndrop.gaussian import GaussianGRU, GaussianLockedDropout, GaussianLSTM
from rnndrop.kl import KLRegularized, KLRegularizer, model_kl, negative_elbo
from rnndrop.locked_dropout import LockedDropout
from rnndrop.masks import RecurrentMasks
from rnndrop.mc import (
    LanguageModelLoss,
    MCPrediction,
    mc_dropout,
    mc_language_model_loss,
    mc_perplexity,
    mc_predict,
)
from rnndrop.noise import bernoulli_mask, gaussian_mask, sample_mask
from rnndrop.recurrent import VariationalGRU, VariationalLSTM
from rnndrop.sparse import SparseEmbedding, SparseGRU, SparseLinear, SparseLSTM, sparsity_report
from rnndrop.weight_drop import WeightDrop

__version__ = "0.1.0"

__all__ = [
    "ActivationRegularization",
    "CompiledModel",
    "EmbeddingDropout",
    "GaussianGRU",
    "GaussianLSTM",
    "GaussianLockedDropout",
    "KLRegularized",
    "KLRegularizer",
    "LanguageModelLoss",
    "LockedDropout",
    "MCPrediction",
    "NTAveraging",
    "NonMonotoneTrigger",
    "RecurrentMasks",
    "RecurrentOutputs",
    "ReliabilityDiagram",
    "SparseEmbedding",
    "SparseGRU",
    "SparseLSTM",
    "SparseLinear",
    "VariableBPTT",
    "VariationalGRU",
    "VariationalGRUCell",
    "VariationalLSTM",
    "VariationalLSTMCell",
    "WeightDrop",
    "activation_regularization",
    "bernoulli_mask",
    "compile_model",
    "expected_calibration_error",
    "gaussian_mask",
    "mc_dropout",
    "mc_language_model_loss",
    "mc_perplexity",
    "mc_predict",
    "model_kl",
    "negative_elbo",
    "prune",
    "reliability_diagram",
    "sample_mask",
    "scaled_learning_rate",
    "sparsity_report",
    "temporal_activation_regularization",
    "to_torch",
]
