"""Monte-Carlo dropout: predict with dropout kept on and average the samples.

A network trained with tied dropout is an approximate Bayesian model (Gal &
Ghahramani 2016): every dropout mask is a draw of the weights from the
approximate posterior. Keeping dropout on at test time and averaging ``S``
stochastic forward passes estimates the predictive distribution::

    result = mc_predict(model, inputs, n_samples=100)   # result.mean, result.mutual_information
    ppl = mc_perplexity(language_model, bptt_batches(test, 35), n_samples=100)

Which modules sample: every :class:`rnndrop.stochastic.Stochastic` whose
``is_stochastic()`` is True (the variational layers, embedding, locked and weight
dropout) and every ``nn.Dropout`` sibling (``torch.nn.modules.dropout._DropoutNd``:
Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout) with ``p > 0``. All
other modules stay in eval mode (BatchNorm keeps its running statistics), and so do
the children of a sampling module unless they sample themselves. ``nn.LSTM``'s own
``dropout`` argument is *not* switched on: it is not a module of its own and draws
fresh, untied masks at every step; use :class:`rnndrop.VariationalLSTM`.

Sampling strategies (``method``):

``"batched"``  the batch is replicated ``k`` times along its batch dimension and run
               in one forward call, ``k`` bounded by ``chunk_size`` or a memory budget,
               and on the CPU by a cache's worth (``CPU_STACKED_ROWS`` rows and
               ``CPU_CHUNK_BYTES`` of outputs in :mod:`rnndrop.mc.sampling`).
               Masks are drawn per sequence, so every copy gets masks of its own.
``"loop"``     one forward call per sample.
``"auto"``     batched, unless a sampling module shares noise on its weights across the
               batch (a weight-dropped layer): copies in one batch would then share one
               draw and the samples would not be independent, so it loops. With masks a
               call shares across its batch (below), batched on CUDA and looped elsewhere.

The same holds for sampled weights (``SparseLSTM``, ``SparseGRU``, ``SparseEmbedding``,
``SparseLinear(local_reparameterization=False)``). Masks that a call shares across its batch
(``mask_scope="batch"``, an embedding dropout with ``scope="batch"``) are drawn per sequence in
a batched call instead (:func:`rnndrop.stochastic.noise_per_sequence`): sequences are computed
independently, so each sequence's samples keep their distribution. Every module says which it
does through :meth:`rnndrop.stochastic.Stochastic.shares_noise_across_batch` and
:meth:`~rnndrop.stochastic.Stochastic.switches_to_noise_per_sequence`.

All randomness comes from torch's global generator: seed it with ``torch.manual_seed``.

The package: :mod:`rnndrop.mc.sampling` (which modules sample, :func:`mc_dropout`,
replicating a batch, chunk planning), :mod:`rnndrop.mc.predict` (:func:`mc_predict`)
and :mod:`rnndrop.mc.language_model` (:func:`mc_language_model_loss`, :func:`mc_perplexity`).
"""

from rnndrop.mc.language_model import LanguageModelLoss, mc_language_model_loss, mc_perplexity
from rnndrop.mc.predict import MCPrediction, mc_predict
from rnndrop.mc.sampling import DEFAULT_MEMORY_BUDGET, mc_dropout, sampling_modules

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "LanguageModelLoss",
    "MCPrediction",
    "mc_dropout",
    "mc_language_model_loss",
    "mc_perplexity",
    "mc_predict",
    "sampling_modules",
]
