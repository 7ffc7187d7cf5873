"""Tokenizer fixtures: the real SmolLM2 tokenizer (byte-level BPE) from the session model folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)
