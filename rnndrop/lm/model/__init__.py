"""Layer 2 of ``rnndrop.lm``: the language model, the dropout regimes and the training configs.

Depends on :mod:`rnndrop.lm.data` and the library; nothing here trains or writes files.
"""
