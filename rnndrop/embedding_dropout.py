"""Word dropout on an embedding: drop word *types*, not embedding units.

Gal & Ghahramani (2016, section 4.2) drop rows of the embedding matrix: when a
word is dropped, every occurrence of it in the sequence becomes the zero
vector, so the network cannot learn to rely on any single word. Merity et al.
(2017, AWD-LSTM) use the same idea with one row mask for the whole batch.

``scope="sequence"``  each sequence draws its own mask over the vocabulary
``scope="batch"``     one mask over the vocabulary for the whole batch (AWD-LSTM)

Kept words are scaled by ``1 / (1 - p)`` so the expected embedding is unchanged.

Cost of ``scope="sequence"``: the keep/drop decision is only needed for the
(sequence, word) pairs that occur, so one value is drawn per unique pair of the
batch (``torch.unique`` over ``T * B`` keys), whatever the vocabulary size: far
cheaper than a dense ``[B, V]`` mask for a word vocabulary (docs/speed.md,
"Embedding dropout's mask"). The dense mask is drawn only when it is no larger
than the batch itself (``V <= T``, e.g. characters), and on a GPU up to
``B * V = 2**22`` values: there ``torch.unique`` makes the host wait for the GPU
(it reads how many pairs there are), which costs a host-bound training step more
than a few million uniforms cost the GPU. While torch.compile traces, the dense mask
too (``torch.unique``'s output shape depends on the data: a graph break).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rnndrop.noise import bernoulli_mask
from rnndrop.stochastic import Stochastic
from rnndrop.tracing import tracing_for_compile
from rnndrop.validation import (
    check_bool,
    check_choice,
    check_instance,
    check_probability,
    check_word_ids,
    checked_setting,
)

__all__ = ["EmbeddingDropout", "word_keep_mask"]

EMBEDDING_SCOPES: tuple[str, ...] = ("sequence", "batch")


#: The most draws of a dense ``[B, V]`` word mask on a GPU (16 MiB of float32 uniforms): below it
#: the dense draw runs, which the host issues without waiting for the GPU.
DENSE_ON_GPU = 2**22


def word_keep_mask(
    tokens: Tensor,
    num_embeddings: int,
    p: float,
    scope: str = "sequence",
    *,
    dense: bool | None = None,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The word-dropout mask for ``tokens``, one value per token.

    Args:
        tokens: ``[B, T]`` integer word ids in ``[0, V)``, one sequence per row.
        num_embeddings: vocabulary size ``V``.
        p: probability of dropping a word type.
        scope: ``"sequence"`` (one draw per sequence and word type) or ``"batch"``
            (one draw per word type for all sequences).
        dense: for ``scope="sequence"``, draw a ``[B, V]`` mask (True) or a mask
            over the unique (sequence, word) pairs (False); None: dense when
            ``V <= T``, and on a GPU whenever ``B * V <= 2**22`` (the unique pairs'
            count is read by the host: a wait for the GPU at every call). Both give
            the same distribution. While torch.compile traces, dense (``torch.unique``'s
            output shape depends on the data: a graph break).

    Returns:
        ``[B, T]`` holding 0 or ``1 / (1 - p)``; equal ids in a row (all rows with
        ``scope="batch"``) get equal values.
    """
    check_choice("scope", scope, EMBEDDING_SCOPES)
    check_word_ids("tokens", tokens, num_embeddings)
    B = tokens.shape[0]
    draw = {"device": tokens.device, "dtype": dtype, "generator": generator}
    if scope == "batch":
        return bernoulli_mask((num_embeddings,), p, **draw)[tokens]
    if dense is None:  # while torch.compile traces, dense: unique's output shape would be a graph break
        dense = (num_embeddings <= tokens.shape[1] or (tokens.is_cuda and B * num_embeddings <= DENSE_ON_GPU)
                 or tracing_for_compile())
    if dense:
        return bernoulli_mask((B, num_embeddings), p, **draw).gather(1, tokens.long())
    rows = torch.arange(B, device=tokens.device).unsqueeze(1)
    pairs = rows * num_embeddings + tokens.long()  # one key per (sequence, word type)
    unique, inverse = torch.unique(pairs, return_inverse=True)
    return bernoulli_mask(unique.shape, p, **draw)[inverse]


class EmbeddingDropout(Stochastic, nn.Module):
    """An ``nn.Embedding`` whose word types are dropped as a whole.

    Args:
        embedding: the wrapped ``nn.Embedding``; it is ``self.embedding`` (tie
            ``self.embedding.weight`` to a decoder) and its ``padding_idx``,
            ``max_norm`` etc. apply unchanged.
        p: probability of dropping a word type, in [0, 1).
        scope: ``"sequence"`` (default; Gal & Ghahramani: each sequence drops its
            own set of words) or ``"batch"`` (AWD-LSTM: one set for the batch).
        batch_first: tokens are ``[B, T]`` instead of ``[T, B]``.

    Shapes:
        tokens: ``[T, B]`` (``[B, T]`` with ``batch_first``) or one sequence ``[T]``.
        returns: ``[*tokens.shape, embedding_dim]``.

    In eval mode (or with ``p = 0``) the output is exactly ``embedding(tokens)``.
    The state dict is the embedding's under the prefix ``embedding.``.

    Example::

        embed = EmbeddingDropout.from_sizes(10000, 650, p=0.1)
        x = embed(tokens)                      # [35, 20, 650] for tokens [35, 20]
        decoder.weight = embed.embedding.weight
    """

    # checked whenever set (a dropout schedule sets p between epochs)
    p = checked_setting("p", check_probability)
    scope = checked_setting("scope", lambda name, value: check_choice(name, value, EMBEDDING_SCOPES))
    batch_first = checked_setting("batch_first", check_bool)

    def __init__(
        self,
        embedding: nn.Embedding,
        p: float,
        *,
        scope: str = "sequence",
        batch_first: bool = False,
    ) -> None:
        super().__init__()
        check_instance("embedding", embedding, nn.Embedding, "an nn.Embedding")
        self.embedding = embedding
        self.p = p
        self.scope = scope
        self.batch_first = batch_first

    @classmethod
    def from_sizes(
        cls,
        num_embeddings: int,
        embedding_dim: int,
        p: float,
        *,
        scope: str = "sequence",
        batch_first: bool = False,
        **embedding_kwargs: Any,
    ) -> EmbeddingDropout:
        """Build the ``nn.Embedding(num_embeddings, embedding_dim, **embedding_kwargs)`` too."""
        embedding = nn.Embedding(num_embeddings, embedding_dim, **embedding_kwargs)
        return cls(embedding, p, scope=scope, batch_first=batch_first)

    def is_stochastic(self) -> bool:
        return self.p > 0

    def shares_noise_across_batch(self) -> bool:
        return self.scope == "batch"

    def switches_to_noise_per_sequence(self) -> bool:
        return self.scope == "batch"

    def forward(self, tokens: Tensor) -> Tensor:
        if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.long, torch.int):
            got = tokens.dtype if isinstance(tokens, Tensor) else type(tokens).__name__
            raise TypeError(f"tokens must be an int64 or int32 tensor of word ids, got {got}")
        if tokens.dim() not in (1, 2):
            layout = "[B, T]" if self.batch_first else "[T, B]"
            raise ValueError(
                f"tokens must be 2-D {layout} or 1-D [T], got {tokens.dim()}-D "
                f"with shape {list(tokens.shape)}"
            )
        check_word_ids("tokens", tokens, self.embedding.num_embeddings)
        out = self.embedding(tokens)
        if not (self.training and self.p > 0):
            return out
        rows = tokens.unsqueeze(0) if tokens.dim() == 1 else tokens if self.batch_first else tokens.t()
        scope = self._scope_to_draw(self.scope)  # per sequence where asked (Monte-Carlo samples stacked)
        keep = word_keep_mask(rows, self.embedding.num_embeddings, self.p, scope, dtype=out.dtype)  # [B, T]
        if tokens.dim() == 1:
            keep = keep.squeeze(0)
        elif not self.batch_first:
            keep = keep.t()
        return out * keep.unsqueeze(-1)

    def extra_repr(self) -> str:
        s = f"p={self.p}"
        if self.scope != "sequence":
            s += f", scope={self.scope!r}"
        if self.batch_first:
            s += ", batch_first=True"
        return s
