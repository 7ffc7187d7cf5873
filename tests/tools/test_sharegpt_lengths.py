"""Tests of the ShareGPT length pairs: benchmarks/prepare_sharegpt_lengths.py (incremental decoder
of a cut JSON array, turn picking, filter) and benchmarks/sharegpt_lengths.py (the committed data
file and its deterministic sampler). CPU only, no network, no tokenizer download."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
DATA = BENCH / "data" / "sharegpt_lengths.json"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


prep = _load("prepare_sharegpt_lengths")
sl = _load("sharegpt_lengths")


def _conv(i: int, turns: list[tuple[str, str]]) -> dict:
    return {"id": f"c{i}_0", "conversations": [{"from": f, "value": v} for f, v in turns]}


ELEMENTS = [
    _conv(0, [("human", "Hi there"), ("gpt", 'Hello! "quoted" \\ back')]),
    _conv(1, [("gpt", "continued"), ("human", "caf\u00e9 \U0001f600 \u4e2d\u6587"), ("gpt", "ok")]),
    _conv(2, [("human", "one turn only")]),
    _conv(3, []),
    _conv(4, [("human", "x" * 40), ("gpt", "y\n" * 20)]),
]


@pytest.mark.parametrize("ensure_ascii", [True, False])
@pytest.mark.parametrize("indent", [None, 2])
def test_decoder_every_cut_point(ensure_ascii, indent):
    """Cut the serialized array at every character: exactly the elements wholly before the cut."""
    full = json.dumps(ELEMENTS, ensure_ascii=ensure_ascii, indent=indent)
    # Character offset just past each element's closing brace.
    ends = []
    for k in range(1, len(ELEMENTS) + 1):
        prefix = json.dumps(ELEMENTS[:k], ensure_ascii=ensure_ascii, indent=indent)
        close = prefix.rstrip()[:-1].rstrip()  # drop the closing ']' of the k-element array
        assert full.startswith(close)
        ends.append(len(close))
    for cut in range(1, len(full) + 1):
        items, info = prep.decode_json_array_prefix(full[:cut])
        want = sum(e <= cut for e in ends)
        assert items == ELEMENTS[:want], cut
        assert info["complete"] == (cut == len(full))
        assert info["end"] + info["tail_chars"] == cut
    items, info = prep.decode_json_array_prefix(full + "\n")
    assert items == ELEMENTS and info["complete"] and info["end"] == ends[-1]


def test_decoder_scalars_and_errors():
    # A scalar running into the end may be cut ("2" of "23"): not taken.
    assert prep.decode_json_array_prefix("[1, 2")[0] == [1]
    assert prep.decode_json_array_prefix("[1, 2]")[0] == [1, 2]
    assert prep.decode_json_array_prefix("[1, 2 ")[0] == [1, 2]
    assert prep.decode_json_array_prefix("[ ")[0] == []
    assert prep.decode_json_array_prefix("[]") == (
        [],
        {"complete": True, "end": 1, "tail_chars": 1},
    )
    assert prep.decode_json_array_prefix('["a\\ud83d\\ude')[0] == []  # cut inside a \u escape
    with pytest.raises(prep.TruncatedJSONError):
        prep.decode_json_array_prefix('{"a": 1}')  # not an array
    with pytest.raises(prep.TruncatedJSONError):
        prep.decode_json_array_prefix('[{"a": 1}, {"b": nope}, ' + "{}, " * 20)  # bad JSON mid-way
    with pytest.raises(prep.TruncatedJSONError):
        prep.decode_json_array_prefix("[1] 2")  # data after the closing ']'


def test_read_text_prefix_drops_cut_character(tmp_path):
    p = tmp_path / "cut.json"
    p.write_bytes('["caf\u00e9 \u4e2d'.encode()[:-1])  # last character cut mid-way
    text = prep.read_text_prefix(p)
    assert text == '["caf\u00e9 '
    assert prep.decode_json_array_prefix(text)[0] == []


def test_first_exchange():
    fx = prep.first_exchange
    assert fx(ELEMENTS[0]) == ("Hi there", 'Hello! "quoted" \\ back')
    assert fx(ELEMENTS[1]) == ("caf\u00e9 \U0001f600 \u4e2d\u6587", "ok")  # first human turn
    assert fx(ELEMENTS[2]) is None and fx(ELEMENTS[3]) is None  # < 2 turns
    assert fx(_conv(5, [("system", "be nice"), ("user", "q"), ("chatgpt", "a")])) == ("q", "a")
    assert fx(_conv(6, [("human", "q1"), ("human", "q2"), ("gpt", "a")])) is None  # no direct reply
    assert fx(_conv(7, [("gpt", "a"), ("gpt", "b")])) is None  # no human turn
    assert fx({"id": "x"}) is None
    assert prep.sglang_exchange(ELEMENTS[1]) == ("continued", "caf\u00e9 \U0001f600 \u4e2d\u6587")


@pytest.mark.parametrize(
    "prompt_len,output_len,kept",
    [
        (4, 4, True),
        (3, 100, False),
        (100, 3, False),
        (1024, 1024, True),
        (1025, 4, False),
        (1024, 1025, False),
        (1000, 1048, True),
        (1000, 1049, False),
        (0, 0, False),
    ],
)
def test_filter(prompt_len, output_len, kept):
    assert prep.passes_filter(prompt_len, output_len) is kept


def test_dumps_document_round_trips():
    doc = {"source": {"a": 1}, "filter": prep.filter_description(), "pairs": [[4, 5], [6, 7]]}
    text = prep.dumps_document(doc)
    assert json.loads(text) == doc
    assert "\n[4,5],\n[6,7]\n" in text
    assert json.loads(prep.dumps_document({"source": {}, "pairs": []})) == {
        "source": {},
        "pairs": [],
    }


def test_committed_data_file():
    assert DATA.stat().st_size < 1_000_000
    doc = sl.read_length_file(DATA)
    pairs = doc["pairs"]
    assert len(pairs) >= 2000
    assert doc["source"]["counts"]["kept"] == len(pairs)
    f = doc["filter"]
    assert (f["min_prompt_len"], f["min_output_len"]) == (4, 4)
    assert (f["max_prompt_len"], f["max_prompt_plus_output_len"]) == (1024, 2048)
    for p, o in pairs:
        assert isinstance(p, int) and isinstance(o, int)
        assert prep.passes_filter(p, o), (p, o)


def test_load_length_pairs_deterministic():
    all_pairs = {tuple(p) for p in sl.read_length_file(DATA)["pairs"]}
    a = sl.load_length_pairs(DATA, 2000, seed=0)
    assert a == sl.load_length_pairs(DATA, 2000, seed=0)
    assert a != sl.load_length_pairs(DATA, 2000, seed=1)
    assert len(a) == 2000 and all(isinstance(x, tuple) and x in all_pairs for x in a)
    assert sl.load_length_pairs(DATA, 10, seed=0) == a[:10]
    assert sl.load_length_pairs(DATA, 0, seed=0) == []
    assert sl.load_length_pairs(seed=0, num=5) == a[:5]  # default path is the committed file


def test_load_length_pairs_cycles(tmp_path):
    p = tmp_path / "small.json"
    p.write_text(json.dumps({"source": {}, "filter": {}, "pairs": [[4, 5], [6, 7], [8, 9]]}))
    got = sl.load_length_pairs(p, 8, seed=3)
    assert len(got) == 8
    assert sorted(got[:3]) == sorted(got[3:6]) == [(4, 5), (6, 7), (8, 9)]  # each used once a pass
    assert sl.load_length_pairs(p, 8, seed=3) == got
    assert sorted(sl.load_length_pairs(p, None, seed=3)) == [(4, 5), (6, 7), (8, 9)]
    with pytest.raises(ValueError):
        sl.load_length_pairs(p, -1)
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"pairs": []}))
    with pytest.raises(ValueError):
        sl.load_length_pairs(empty, 1)
