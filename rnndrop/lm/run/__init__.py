"""Layer 3 of ``rnndrop.lm``: training, evaluation, checkpoints, run folders, results, progress.

Depends on :mod:`rnndrop.lm.data` and :mod:`rnndrop.lm.model`; the command line
(:mod:`rnndrop.lm.cli`) sits on top.
"""
