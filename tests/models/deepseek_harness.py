"""Test harness: runs `DeepseekV2ForCausalLM` over the real pools and the torch_native backend.

Builds the model from an HF folder, creates `ReqToTokenPool`, `TokenToKVPoolAllocator` and the
KV pool the model asks for (`kv_pool_layout`), and drives extend / decode batches the way the
engine does: rows and slots are allocated here, `req_to_token` is filled before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoConfig

from mla_backend.config import ModelConfig
from mla_backend.forward_batch import ForwardBatch, ForwardMode
from mla_backend.layers.attention.torch_native import TorchNativeAttnBackend
from mla_backend.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from mla_backend.model_executor.model_loader import iterate_weights
from mla_backend.models.deepseek_v2 import DeepseekV2ForCausalLM


@dataclass
class Seq:
    row: int
    tokens: list[int]  # every token whose KV is cached, plus pending ones
    cached: int = 0  # tokens whose KV is in the pool
    slots: list[int] = field(default_factory=list)


class DeepseekHarness:
    def __init__(self, model_path: str, disable_mla: bool = False,
                 decompress_min_tokens: int = 64, pool_tokens: int = 4096,
                 max_context: int = 512, rows: int = 8) -> None:
        self.hf_config = AutoConfig.from_pretrained(model_path)
        mc = ModelConfig(model_path=model_path, disable_mla=disable_mla,
                         mla_decompress_min_tokens=decompress_min_tokens)
        self.model = DeepseekV2ForCausalLM(self.hf_config, mc)
        self.model.load_weights(iterate_weights(model_path))
        self.model.post_load_weights()
        self.model.eval()
        layout = self.model.kv_pool_layout()
        self.req_pool = ReqToTokenPool(rows, max_context)
        self.allocator = TokenToKVPoolAllocator(pool_tokens)
        if layout["kind"] == "mla":
            self.kv_pool = MLATokenToKVPool(pool_tokens, torch.float32, layout["kv_lora_rank"],
                                            layout["qk_rope_head_dim"], layout["num_layers"])
        else:
            self.kv_pool = MHATokenToKVPool(pool_tokens, torch.float32, layout["num_kv_heads"],
                                            layout["head_dim"], layout["v_head_dim"],
                                            layout["num_layers"])
        self.backend = TorchNativeAttnBackend()
        self.last_path: str | None = None

    def new_seq(self, tokens: list[int]) -> Seq:
        (row,) = self.req_pool.alloc(1)
        return Seq(row, list(tokens))

    @torch.inference_mode()
    def step(self, seqs: list[Seq], mode: ForwardMode) -> torch.Tensor:
        """Runs every pending token of each seq (DECODE: exactly one each).

        Returns logits [T, V] fp32 of all new tokens, request by request.
        """
        ids, pos, locs, pre, ext = [], [], [], [], []
        for s in seqs:
            n = len(s.tokens) - s.cached
            assert n >= 1 and (mode != ForwardMode.DECODE or n == 1)
            slots = self.allocator.alloc(n)
            assert slots is not None
            self.req_pool.req_to_token[s.row, s.cached: s.cached + n] = slots.to(torch.int32)
            ids += s.tokens[s.cached:]
            pos += list(range(s.cached, s.cached + n))
            locs.append(slots)
            pre.append(s.cached)
            ext.append(n)
        seq_lens = [p + n for p, n in zip(pre, ext)]
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(seqs),
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            req_pool_indices=torch.tensor([s.row for s in seqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(locs), seq_lens_cpu=seq_lens,
            extend_prefix_lens_cpu=pre, extend_seq_lens_cpu=ext,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            attn_backend=self.backend, return_all_logits=True)
        self.backend.init_forward_metadata(fb)
        self.last_path = self.model.model.attention_path(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        for s, n in zip(seqs, ext):
            s.cached += n
        return self.model.compute_logits(hidden)

    def greedy(self, prompts: list[list[int]], max_new_tokens: int
               ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """One extend batch of all prompts, then decode steps.

        Returns (new tokens per prompt, prefill logits [sum(len(p)), V], logits that chose each
        new token [len(prompts), max_new_tokens, V])."""
        seqs = [self.new_seq(p) for p in prompts]
        prefill = self.step(seqs, ForwardMode.EXTEND)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        steps = [prefill[ends]]
        nxt = steps[0].argmax(-1).tolist()
        out = [[t] for t in nxt]
        for _ in range(max_new_tokens - 1):
            for s, t in zip(seqs, nxt):
                s.tokens.append(t)
            steps.append(self.step(seqs, ForwardMode.DECODE))
            nxt = steps[-1].argmax(-1).tolist()
            for o, t in zip(out, nxt):
                o.append(t)
        return out, prefill, torch.stack(steps, dim=1)
