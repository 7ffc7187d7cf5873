"""Vocabulary embedding, LM head and logit-row selection.

`VocabEmbedding` maps token ids to rows (HF name `embed_tokens.weight`); `LMHead` maps final hidden
states to logits (HF name `lm_head.weight`, or the embedding's weight when tied): fp32, or written
into a given `out` (the CUDA graphs' buffer in the model dtype: by the GEMM itself).
`select_logit_rows` picks the hidden rows that need logits: every new token
(`return_all_logits`) or the last new token of each request.

Tensor parallel twins (same constructor arguments and forward contract, so a model can swap one
for the other; identical results at TP size 1): `VocabParallelEmbedding` and `ParallelLMHead` split
the vocabulary rows across the TP ranks (rank r holds ids [r*V_pad/tp, (r+1)*V_pad/tp), V padded up
to a multiple of tp with zero rows). The embedding all-reduces (each id's row is non-zero on one
rank only); the LM head all-gathers, so every rank gets the full logits [n, V]. Their
`weight_loader` takes the full HF tensor [V, hidden] and copies this rank's rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mla_backend.distributed import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from mla_backend.layers.linear import resolve_tp

if TYPE_CHECKING:
    from mla_backend.forward_batch import ForwardBatch


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

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size], computed in the weight's dtype:
        fp32 (converted), or written into out [n, vocab_size] (contiguous; of the weight's
        dtype: the GEMM writes it, no extra pass; else converted into it)."""
        if out is not None and out.dtype == self.weight.dtype and out.is_contiguous():
            return torch.mm(hidden, self.weight.t(), out=out)
        return _logits_out(F.linear(hidden, self.weight), out)



class VocabParallelEmbedding(nn.Module):
    """Vocabulary embedding with the rows split across TP ranks (twin of `VocabEmbedding`).

    Args:
        num_embeddings: vocabulary size V (HF `vocab_size`).
        embedding_dim: hidden size.
        tp_rank, tp_size: overrides of the TP group's rank/size (for sharding only: the forward's
            all-reduce always uses the process-wide group).

    Rank r's weight is [V_pad/tp, embedding_dim] (V_pad = V rounded up to a multiple of tp) and
    holds ids [vocab_start_index, vocab_end_index); rows past V are padding (zeros).
    forward(ids [T] int64) -> [T, embedding_dim], dtype of the weight: the rows of ids outside
    this rank's range are zero before the all-reduce sums the ranks' parts. At TP size 1 this is
    `F.embedding` on the whole table, like `VocabEmbedding`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_rank: int | None = None,
                 tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        per = -(-num_embeddings // self.tp_size)
        self.num_embeddings_padded = per * self.tp_size
        self.num_embeddings_per_rank = per
        self.vocab_start_index = self.tp_rank * per
        self.vocab_end_index = self.vocab_start_index + per
        self.weight = nn.Parameter(torch.empty(per, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(in_range, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local_ids, self.weight)  # [T, embedding_dim]
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full HF table `loaded` [V, embedding_dim] into `param`
        (padding rows set to zero). `shard_id` is ignored.

        Raises:
            ValueError: `loaded` is not [num_embeddings, embedding_dim].
        """
        _load_vocab_rows(self, param, loaded)

    def extra_repr(self) -> str:
        return (f"ids [{self.vocab_start_index}, {self.vocab_end_index}) of "
                f"{self.num_embeddings} (tp {self.tp_rank}/{self.tp_size}), "
                f"dim={self.embedding_dim}")


class ParallelLMHead(nn.Module):
    """Final projection to the vocabulary with the rows split across TP ranks (twin of `LMHead`).

    Args:
        vocab_size, hidden_size: the full weight is [vocab_size, hidden_size].
        tied_to: a `VocabParallelEmbedding` whose weight is shared (tie_word_embeddings); it must
            split the same vocabulary the same way. None = own weight.
        tp_rank, tp_size: overrides of the TP group's rank/size (ignored when tied: the
            embedding's split is used).

    Rank r's weight is [V_pad/tp, hidden_size] holding vocabulary rows [vocab_start_index,
    vocab_end_index) (V_pad = V rounded up to a multiple of tp; padding rows are zero).

    Raises:
        ValueError: tied_to's weight is not this head's local shape.
    """

    def __init__(self, vocab_size: int, hidden_size: int,
                 tied_to: VocabParallelEmbedding | VocabEmbedding | None = None, *,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        if tied_to is not None and isinstance(tied_to, VocabParallelEmbedding):
            tp_rank, tp_size = tied_to.tp_rank, tied_to.tp_size
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        per = -(-vocab_size // self.tp_size)
        self.num_embeddings_padded = per * self.tp_size
        self.num_embeddings_per_rank = per
        self.vocab_start_index = self.tp_rank * per
        self.vocab_end_index = self.vocab_start_index + per
        self.tied = tied_to is not None
        if tied_to is not None:
            if tuple(tied_to.weight.shape) != (per, hidden_size):
                raise ValueError(
                    f"ParallelLMHead({vocab_size}, {hidden_size}) at tp {self.tp_size} needs a "
                    f"tied weight of shape {(per, hidden_size)}, got "
                    f"{tuple(tied_to.weight.shape)}")
            self.weight = tied_to.weight  # same Parameter object
        else:
            self.weight = nn.Parameter(torch.empty(per, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] fp32, the full vocabulary on every
        rank (local [n, V_pad/tp] logits are all-gathered, then the padding is cut off); or
        written into out [n, vocab_size] (any float dtype; of the weight's dtype at TP 1: by
        the GEMM itself, no extra pass)."""
        if (self.tp_size == 1 and out is not None and out.dtype == self.weight.dtype
                and out.is_contiguous() and self.num_embeddings_padded == self.vocab_size):
            return torch.mm(hidden, self.weight.t(), out=out)
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
            if self.num_embeddings_padded != self.vocab_size:
                logits = logits[..., : self.vocab_size]
        return _logits_out(logits, out)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the full HF `lm_head.weight` [V, hidden_size] into `param`
        (padding rows set to zero). `shard_id` is ignored.

        Raises:
            ValueError: `loaded` is not [vocab_size, hidden_size].
        """
        _load_vocab_rows(self, param, loaded)

    def extra_repr(self) -> str:
        return (f"rows [{self.vocab_start_index}, {self.vocab_end_index}) of {self.vocab_size} "
                f"(tp {self.tp_rank}/{self.tp_size}), hidden={self.hidden_size}, "
                f"tied={self.tied}")


def _load_vocab_rows(layer: VocabParallelEmbedding | ParallelLMHead, param: nn.Parameter,
                     loaded: torch.Tensor) -> None:
    """param [V_pad/tp, D] <- rows [start, min(end, V)) of loaded [V, D]; the rest zero."""
    vocab = layer.num_embeddings if isinstance(layer, VocabParallelEmbedding) else layer.vocab_size
    expected = (vocab, param.shape[1])
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{type(layer).__name__}: expected the full HF tensor of shape "
                         f"{expected}, got {tuple(loaded.shape)}")
    start = layer.vocab_start_index
    n = max(0, min(layer.vocab_end_index, vocab) - start)
    param.data[:n].copy_(loaded.narrow(0, start, n))
    param.data[n:].zero_()


def _logits_out(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """logits [n, V] (any float dtype, any strides) as a contiguous fp32 tensor, or copied into
    out (converted to out's dtype in the same pass): the LM heads' result."""
    if out is None:
        return logits.float().contiguous()
    return out.copy_(logits)


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
