"""`mla_backend.tokenizer.load_tokenizer`: the engine's context check, not the tokenizer's own
`model_max_length`, decides what is too long, so encoding a long prompt logs nothing."""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import AutoTokenizer

from mla_backend.tokenizer import load_tokenizer

TINY = Path(__file__).resolve().parents[2] / "checkpoints" / "deepseek-v2-tiny"


def test_long_prompt_encodes_without_the_length_warning(caplog):
    plain = AutoTokenizer.from_pretrained(TINY)
    text = "hello world " * plain.model_max_length  # past the folder's model_max_length (4096)
    with caplog.at_level(logging.WARNING):
        expected = plain.encode(text)
    assert len(expected) > plain.model_max_length
    assert "longer than the specified maximum" in caplog.text  # what load_tokenizer avoids
    caplog.clear()
    tok = load_tokenizer(str(TINY))
    with caplog.at_level(logging.WARNING):
        assert tok.encode(text) == expected
    assert caplog.text == ""
