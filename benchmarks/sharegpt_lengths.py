"""ShareGPT request lengths for benchmarks: load the precomputed (prompt_len, output_len) pairs.

The pairs live in `benchmarks/data/sharegpt_lengths.json`, made on a CPU machine by
`benchmarks/prepare_sharegpt_lengths.py` (which documents the sources, the tokenizer and the
filter). Both numbers of a pair are counts of DeepSeek-V3 tokenizer tokens, with no special
tokens (no BOS) counted: `prompt_len` is the first human turn of a conversation, `output_len` the
reply right after it. The pairs are stored in the order of the source file; a benchmark draws its
requests with `load_length_pairs(path, num, seed)`, so the same seed gives the same requests.

Pure standard library (json + random) so that a GPU machine needs nothing else to use it:

    from sharegpt_lengths import DEFAULT_PATH, load_length_pairs
    pairs = load_length_pairs(DEFAULT_PATH, num=2000, seed=0)   # [(prompt_len, output_len), ...]
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parent / "data" / "sharegpt_lengths.json"


def read_length_file(path: str | Path = DEFAULT_PATH) -> dict:
    """The whole data file: {"source": {...}, "filter": {...}, "pairs": [[prompt, output], ...]}."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_length_pairs(
    path: str | Path = DEFAULT_PATH, num: int | None = None, seed: int = 0
) -> list[tuple[int, int]]:
    """`num` (prompt_len, output_len) pairs, in tokens, drawn deterministically with `seed`.

    The pairs are put in a random order by `random.Random(seed).shuffle` of the file's list and
    the first `num` are returned: a sample without replacement when `num` <= the number of pairs.
    When `num` is larger, further passes follow, each a new shuffle from the same generator, so
    every pair is used once before any is used again. The result for a smaller `num` is always a
    prefix of the result for a larger one with the same seed. `num=None` returns every pair once,
    shuffled.
    """
    pairs = [(int(p), int(o)) for p, o in read_length_file(path)["pairs"]]
    if not pairs:
        raise ValueError(f"{path}: no length pairs")
    if num is None:
        num = len(pairs)
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    rng = random.Random(seed)
    out: list[tuple[int, int]] = []
    while len(out) < num:
        order = list(pairs)
        rng.shuffle(order)
        out.extend(order[: num - len(out)])
    return out
