"""Word-level language modelling with recurrent dropout: corpora, model, training, benchmark.

LM protocol: ``model(tokens [T, B] LongTensor, hidden=None) -> (logits [T, B, V], hidden)``,
time-major; ``hidden`` is opaque (None = zeros) and carried by the caller across
truncated-BPTT segments.
"""

from rnndrop.lm.checkpoint import LoadedModel, load_model
from rnndrop.lm.configs import CONFIGS, REGIMES, Regime, TrainConfig, build_model, get_config
from rnndrop.lm.corpus import Corpus, CorpusError, Vocabulary, batchify, bptt_batches, load_corpus
from rnndrop.lm.download import DownloadError, download_corpus
from rnndrop.lm.model import RNNLanguageModel, detach_hidden
from rnndrop.lm.train import TrainingDiverged, evaluate, evaluate_mc, train_run

__all__ = [
    "CONFIGS",
    "REGIMES",
    "Corpus",
    "CorpusError",
    "DownloadError",
    "LoadedModel",
    "RNNLanguageModel",
    "Regime",
    "TrainConfig",
    "TrainingDiverged",
    "Vocabulary",
    "batchify",
    "bptt_batches",
    "build_model",
    "detach_hidden",
    "download_corpus",
    "evaluate",
    "evaluate_mc",
    "get_config",
    "load_corpus",
    "load_model",
    "train_run",
]
