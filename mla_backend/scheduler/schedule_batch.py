"""`ScheduleBatch`: what the scheduler hands the engine for one forward pass.

Filled by `Scheduler.get_next_batch` (plain CPU lists plus the slot tensor); the engine turns it
into a `ForwardBatch` (`ModelRunner.make_forward_batch`), samples, appends tokens to
`req.output_ids` where `sample_mask` is True, and returns it to `Scheduler.process_batch_result`.

Token order in the per-token fields: requests in `reqs` order, each request's new tokens in
position order (EXTEND) or its single new token (DECODE).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mla_backend.forward_batch import ForwardMode
from mla_backend.request import Req


@dataclass
class ScheduleBatch:
    """One step's work. Shapes: bs = len(reqs), T = sum(extend_lens) (= bs for DECODE)."""

    forward_mode: ForwardMode
    reqs: list[Req]
    input_ids: list[int]  # [T] token ids of the new tokens
    positions: list[int]  # [T] absolute positions of the new tokens
    req_pool_indices: list[int]  # [bs] req_to_token rows
    seq_lens: list[int]  # [bs] prefix + new tokens (KV length after this pass)
    prefix_lens: list[int]  # [bs] tokens whose KV is already in the pool
    extend_lens: list[int]  # [bs] new tokens per request (1 for DECODE)
    out_cache_loc: torch.Tensor = field(  # [T] int64 cpu: slot each new token is written to
        default_factory=lambda: torch.empty((0,), dtype=torch.int64))
    # [bs] False for a request whose prefill chunk is not its last: its sampled token is dropped
    sample_mask: list[bool] = field(default_factory=list)
    # DECODE with the overlap schedule: rows whose input token is still on the GPU (sampled by
    # the batch in flight); their `input_ids` entry is a placeholder the engine fills on device.
    future_rows: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def is_extend(self) -> bool:
        return self.forward_mode.is_extend()

    def is_decode(self) -> bool:
        return self.forward_mode.is_decode()


__all__ = ["ScheduleBatch"]
