"""The old home of :class:`~rnndrop.recurrent.VariationalRNNStack`, kept for the imports that
still name it here (:mod:`rnndrop.lm.model.language_model`); the layer is
:mod:`rnndrop.recurrent`. Remove once nothing imports this module."""

from rnndrop.recurrent import VariationalRNNStack

__all__ = ["VariationalRNNStack"]
