"""Helpers for the FP8 KV-cache accuracy tests: teacher-forced logits through `ModelRunner` and a
checkpoint rewrite that moves K/V into a range only the checkpoint's KV scales make fit FP8."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from mla_backend.config import EngineConfig
from mla_backend.forward_batch import ForwardMode
from mla_backend.model_executor.model_runner import ModelRunner


def make_runner(path: str, kv_cache_dtype: str = "auto", backend: str = "torch_native",
                **kw) -> ModelRunner:
    return ModelRunner(EngineConfig.create(
        model_path=path, dtype="float32", device="cpu", max_total_tokens=256,
        max_running_requests=4, kv_cache_dtype=kv_cache_dtype, attention_backend=backend, **kw))


@torch.inference_mode()
def teacher_forced_logits(r: ModelRunner, tokens: list[int], chunks: tuple[int, ...],
                          decode_steps: int) -> torch.Tensor:
    """Feed `tokens` as prefill chunks (the first without a prefix, later ones over the cached
    prefix) then one token per decode step; logits of every fed token, [T, V] fp32."""
    assert sum(chunks) + decode_steps <= len(tokens)
    row = r.req_to_token_pool.alloc(1)[0]
    outs, pos = [], 0
    sizes = [(ForwardMode.EXTEND, n) for n in chunks] + [(ForwardMode.DECODE, 1)] * decode_steps
    for mode, n in sizes:
        slots = r.token_to_kv_pool_allocator.alloc(n)
        r.req_to_token_pool.req_to_token[row, pos:pos + n] = slots.to(torch.int32)
        fb = r.make_forward_batch(mode, tokens[pos:pos + n], range(pos, pos + n), [row],
                                  [pos + n], [pos], [n], slots, return_all_logits=True)
        outs.append(r.forward(fb))
        pos += n
    r.req_to_token_pool.free(row)
    return torch.cat(outs)


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| over all positions and the vocabulary."""
    return float((x - ref).abs().max() / ref.abs().max())


def scaled_kv_checkpoint(src: str, dst: str, factors: list[float]) -> str:
    """Copy checkpoint `src` to `dst` with every layer's cached K/V multiplied by factors[i] and
    the consumers divided by it (same model function), plus `self_attn.k_scale` / `v_scale` =
    factors[i]: without those scales the cache saturates (|K|, |V| >> 448).

    Llama: k_proj, v_proj × f; q_proj, o_proj ÷ f. DeepSeek MLA: the latent (kv_a_layernorm
    weight, the k_pe rows of kv_a_proj_with_mqa) × f; kv_b_proj and the q_pe rows of q_proj ÷ f.
    """
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    path = os.path.join(dst, "model.safetensors")
    sd = load_file(path)
    for i, f in enumerate(factors):
        a = f"model.layers.{i}.self_attn"
        if cfg["model_type"].startswith("deepseek"):
            lora, rope, nope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"]
            sd[f"{a}.kv_a_layernorm.weight"] = sd[f"{a}.kv_a_layernorm.weight"] * f
            w = sd[f"{a}.kv_a_proj_with_mqa.weight"].clone()
            w[lora:] *= f
            sd[f"{a}.kv_a_proj_with_mqa.weight"] = w
            sd[f"{a}.kv_b_proj.weight"] = sd[f"{a}.kv_b_proj.weight"] / f
            q = sd[f"{a}.q_proj.weight"].clone()
            q.view(cfg["num_attention_heads"], nope + rope, -1)[:, nope:] /= f
            sd[f"{a}.q_proj.weight"] = q
        else:
            for name, mul in (("k_proj", f), ("v_proj", f), ("q_proj", 1 / f), ("o_proj", 1 / f)):
                sd[f"{a}.{name}.weight"] = sd[f"{a}.{name}.weight"] * mul
        sd[f"{a}.k_scale"] = torch.tensor(f, dtype=torch.float32)
        sd[f"{a}.v_scale"] = torch.tensor(f, dtype=torch.float32)
    save_file(sd, path, metadata={"format": "pt"})
    return dst
