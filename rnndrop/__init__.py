"""rnndrop: variational (tied) dropout and other regularizers for recurrent networks."""

from rnndrop.cells import VariationalGRUCell, VariationalLSTMCell
from rnndrop.masks import RecurrentMasks, bernoulli_mask, gaussian_mask, sample_mask
from rnndrop.recurrent import VariationalGRU, VariationalLSTM

__version__ = "0.1.0"

__all__ = [
    "RecurrentMasks",
    "VariationalGRU",
    "VariationalGRUCell",
    "VariationalLSTM",
    "VariationalLSTMCell",
    "bernoulli_mask",
    "gaussian_mask",
    "sample_mask",
]
