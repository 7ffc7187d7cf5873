"""Tokenizer loading, detokenization and stop strings: the text side of the engine.

`load_tokenizer(path)` is the one place a model folder's Hugging Face tokenizer is loaded (the
engine and the process client's side). The engine enforces its own context length
(`request.validate_request`), so the tokenizer's `model_max_length` is lifted: otherwise encoding a
prompt longer than it logs transformers' "indexing errors" warning for a request that is then
refused with a clear error anyway.
"""

from __future__ import annotations

import sys
from typing import Any


def load_tokenizer(path: str) -> Any:
    """`transformers.AutoTokenizer.from_pretrained(path)` with no length limit of its own.

    Raises:
        OSError / ValueError: as transformers does for a folder without a usable tokenizer.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = sys.maxsize
    return tokenizer
