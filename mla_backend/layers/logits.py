"""Vocabulary embedding, LM head and logit-row selection.

`VocabEmbedding` maps token ids to rows (HF name `embed_tokens.weight`); `LMHead` maps final hidden
states to fp32 logits (HF name `lm_head.weight`, or the embedding's weight when tied).
`select_logit_rows` picks the hidden rows that need logits: every new token
(`return_all_logits`) or the last new token of each request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from mla_backend.model_executor.forward_batch import ForwardBatch


class VocabEmbedding(nn.Module):
    """weight [num_embeddings, embedding_dim]. forward(ids [T] int64) -> [T, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Final projection to the vocabulary.

    Args:
        vocab_size, hidden_size: weight is [vocab_size, hidden_size].
        tied_to: an embedding whose weight is shared (tie_word_embeddings); None = own weight.
    """

    def __init__(self, vocab_size: int, hidden_size: int,
                 tied_to: VocabEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight  # same Parameter object
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] fp32."""
        return F.linear(hidden, self.weight).float()


def select_logit_rows(hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
    """Rows of `hidden` [T, hidden] that get logits.

    Returns:
        [T, hidden] if `forward_batch.return_all_logits`, else [bs, hidden] (each request's last
        new token, in batch order).
    """
    if forward_batch.return_all_logits:
        return hidden
    if forward_batch.forward_mode.is_decode():
        return hidden
    return hidden.index_select(0, forward_batch.last_token_indices())
