"""Fixtures: SmolLM2's real tokenizer (byte-level BPE, 49152 ids) and a GrammarCompiler on it.

The tokenizer comes from $MLA_TEST_TOKENIZER_DIR when set, else the model folder written by set-up
(`model_repository/smollm2-135m-instruct/weights`); the tests skip when neither has one.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = REPO / "model_repository" / "smollm2-135m-instruct" / "weights"


@pytest.fixture(scope="session")
def tokenizer():
    folder = Path(os.environ.get("MLA_TEST_TOKENIZER_DIR") or WEIGHTS)
    if not (folder / "tokenizer.json").is_file():
        pytest.skip(f"no SmolLM2 tokenizer in {folder} (run ./build.sh setup, or set "
                    f"MLA_TEST_TOKENIZER_DIR)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="session")
def compiler(tokenizer):
    from mla_backend.constrained.grammar import GrammarCompiler

    comp = GrammarCompiler(tokenizer, len(tokenizer), stop_token_ids=[tokenizer.eos_token_id])
    yield comp
    comp.shutdown()
