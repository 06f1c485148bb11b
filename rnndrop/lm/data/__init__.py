"""Layer 1 of ``rnndrop.lm``: text in, token tensors out (corpora, vocabulary, batching, download).

Depends on nothing else in ``rnndrop.lm``. The samples shipped with the package
(``ptb-sample/``, ``wikitext-2-sample/``) live in this folder.
"""
