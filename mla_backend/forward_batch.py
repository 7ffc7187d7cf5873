"""`ForwardMode` and `ForwardBatch`: what one model forward pass runs over.

Built by the engine from a `ScheduleBatch` (scheduler side) each step, read by the model, its
`RadixAttention` layers and the attention backend. Plain tensors only; no scheduler objects. It
sits below `layers/` (which read it) and above `mem_cache/` (whose pools it carries); the
scheduler takes `ForwardMode` from here.

Token order in every per-token tensor: requests in batch order, and inside one request its new
tokens in position order (extend) or its single new token (decode).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mla_backend.host_tensors import int64_on

if TYPE_CHECKING:  # imported for annotations only
    from mla_backend.mem_cache.memory_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill of new tokens on top of a (possibly empty) cached prefix, per request
    DECODE = 2  # exactly one new token per request, attending to all its cached tokens
    MIXED = 3  # extend and decode requests in one batch (reserved: not produced yet)
    IDLE = 4  # no tokens (reserved for TP ranks with nothing to do)

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One forward pass. Filled by: `Engine` (via `ForwardBatch.create`).

    Shapes: bs = requests in the batch, T = new tokens in the batch (T = bs for DECODE).
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device: absolute position of each new token
    req_pool_indices: torch.Tensor  # [bs] int64, device: rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64, device: prefix + new tokens, after this pass
    out_cache_loc: torch.Tensor  # [T] int64, device: KV slot each new token is written to
    # CPU copies for backends that loop on the host (torch_native) and for the model's path choice.
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # [bs]: cached tokens before the new ones (DECODE: seq_len-1)
    extend_seq_lens_cpu: list[int]  # [bs]: new tokens per request (DECODE: 1)
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "KVPool"
    # The step's `layers.attention.base.AttentionBackend` (set by the `ModelRunner`). Typed Any:
    # naming the class here would import a layer above this module.
    attn_backend: Any
    # True: the model returns logits for every new token (tests); False: last new token per request.
    return_all_logits: bool = False
    # The CPU int64 tensor the device's index tensors were copied from (set by
    # `ModelRunner.make_forward_batch`): input_ids [T] | positions [T] | out_cache_loc [T] |
    # req_pool_indices [bs] | seq_lens [bs]. Tensor-parallel step messages send its bytes
    # instead of copying the device tensors back. None when the batch was built another way.
    host_packed: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def extend_start_loc_cpu(self) -> list[int]:
        """[bs] offset of each request's first new token in the per-token tensors."""
        out, acc = [], 0
        for n in self.extend_seq_lens_cpu:
            out.append(acc)
            acc += n
        return out

    def last_token_indices(self) -> torch.Tensor:
        """[bs] int64, device: index of each request's last new token in the per-token tensors."""
        ends, acc = [], 0
        for n in self.extend_seq_lens_cpu:
            acc += n
            ends.append(acc - 1)
        return int64_on(ends, self.input_ids.device)
