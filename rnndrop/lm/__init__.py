"""Word-level language modelling with recurrent dropout: corpora, model, training, benchmark.

The command line is ``rnndrop-lm`` (``python -m rnndrop.lm``, :mod:`rnndrop.lm.cli`);
:func:`load_model` reads a trained run back, :func:`generate` samples text from it;
:func:`save_pretrained` / :func:`from_pretrained` write a trained model into a folder and read it
back in one call each (safetensors or plain weights, a JSON config, a manifest of hashes).

LM protocol: ``model(tokens [T, B] LongTensor, hidden=None) -> (logits [T, B, V], hidden)``,
time-major; ``hidden`` is opaque (None = zeros) and carried by the caller across
truncated-BPTT segments.
"""

from rnndrop.lm.data.corpus import (
    Corpus,
    CorpusError,
    Vocabulary,
    batchify,
    bptt_batches,
    encode_split,
    load_corpus,
    sample_dir,
)
from rnndrop.lm.data.download import DownloadError, download_corpus
from rnndrop.lm.model.build import build_model
from rnndrop.lm.model.language_model import RNNLanguageModel, detach_hidden
from rnndrop.lm.model.presets import CONFIGS, get_config
from rnndrop.lm.model.pretrained import PretrainedError, PretrainedModel, from_pretrained, save_pretrained
from rnndrop.lm.model.regimes import REGIMES, Regime
from rnndrop.lm.model.train_config import TrainConfig
from rnndrop.lm.run.checkpoint import LoadedModel, load_model
from rnndrop.lm.run.evaluate import evaluate, evaluate_mc, generate
from rnndrop.lm.run.train import TrainingDiverged, train_run

__all__ = [
    "CONFIGS",
    "REGIMES",
    "Corpus",
    "CorpusError",
    "DownloadError",
    "LoadedModel",
    "PretrainedError",
    "PretrainedModel",
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
    "encode_split",
    "evaluate",
    "evaluate_mc",
    "from_pretrained",
    "generate",
    "get_config",
    "load_corpus",
    "load_model",
    "sample_dir",
    "save_pretrained",
    "train_run",
]
