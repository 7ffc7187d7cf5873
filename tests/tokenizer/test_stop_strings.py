"""StopStringMatcher: stops split over chunks, overlapping stops, a stop at the very start, and a
property check against a whole-text reference for any chunking."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_backend.tokenizer.stop import StopStringMatcher


def run(stops: list[str], chunks: list[str], include: bool = False) -> tuple[list[str], bool, str]:
    """Feed chunks until stopped; return (emitted pieces, stopped, flushed rest)."""
    m = StopStringMatcher(stops, include)
    pieces, stopped = [], False
    for c in chunks:
        emit, stopped = m.feed(c)
        pieces.append(emit)
        if stopped:
            break
    return pieces, stopped, m.flush()


def reference(stops: list[str], text: str, include: bool) -> tuple[str, bool]:
    """Whole-text answer: the stop completed first (earliest end, then earliest start)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    if best is None:
        return text, False
    end, start = best
    return text[: end if include else start], True


def test_stop_split_over_many_chunks() -> None:
    pieces, stopped, rest = run(["<END>"], ["Hello", " <", "E", "N", "D", "> tail"])
    assert stopped and rest == ""
    assert pieces == ["Hello", " ", "", "", "", ""]
    pieces, stopped, _ = run(["<END>"], ["Hello", " <", "E", "N", "D", "> tail"], include=True)
    assert "".join(pieces) == "Hello <END>" and pieces[-1] == "<END>"


def test_held_prefix_released_when_it_stops_matching() -> None:
    m = StopStringMatcher(["abc"], False)
    assert m.feed("xxab") == ("xx", False)
    assert m.feed("d") == ("abd", False)
    assert m.feed("a") == ("", False)
    assert m.flush() == "a"
    assert m.flush() == ""


def test_stop_at_the_very_start() -> None:
    assert run(["Q:"], ["Q:", " more"]) == ([""], True, "")
    assert run(["Q:"], ["Q", ":x"], include=True) == (["", "Q:"], True, "")


def test_overlapping_stops_first_completed_wins() -> None:
    # "ab" completes before "abc" does.
    assert run(["abc", "ab"], ["xabc"])[0] == ["x"]
    assert run(["abc", "ab"], ["xabc"], include=True)[0] == ["xab"]
    # Same end: the one starting earlier wins (more text removed).
    assert run(["bc", "abc"], ["zabcd"])[0] == ["z"]
    # A stop found inside the held prefix of another stop.
    assert run(["aab", "ab"], ["a", "a", "b"])[0] == ["", "", ""]
    assert run(["aab", "ab"], ["a", "a", "b"], include=True)[0] == ["", "", "aab"]
    # Self-overlapping stop: "aaab" in "aaaab".
    assert "".join(run(["aaab"], ["a", "a", "a", "a", "b", "!"])[0]) == "a"


def test_nothing_after_the_stop() -> None:
    m = StopStringMatcher(["."], True)
    assert m.feed("one. two.") == ("one.", True)
    assert m.feed("three") == ("", True)
    assert m.flush() == ""
    assert m.matched == "."


def test_no_stops_passes_text_through() -> None:
    m = StopStringMatcher([], False)
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""], False)


def test_multibyte_and_newline_stops() -> None:
    assert "".join(run(["\n\n"], ["line 1\n", "\nline 2"])[0]) == "line 1"
    assert "".join(run(["世界"], ["你好", "世", "界", "!"], include=True)[0]) == "你好世界"


def test_can_stop_false_emits_stops_as_text() -> None:
    m = StopStringMatcher(["END"], False)
    assert m.feed("a END b EN", can_stop=False) == ("a END b ", False)  # "EN" may start a stop
    assert m.feed("D!", can_stop=True) == ("", True)
    m = StopStringMatcher(["END"], True)
    assert m.feed("xEN", can_stop=False) == ("x", False)
    assert m.feed("Dy", can_stop=False) == ("ENDy", False)
    assert m.feed("zEND", can_stop=True) == ("zEND", True)


_alpha = st.text(alphabet="ab\nc", min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(
    text=_alpha,
    stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=10),
    include=st.booleans(),
)
def test_any_chunking_matches_whole_text_reference(text: str, stops: list[str], cuts: list[int],
                                                   include: bool) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    pieces, stopped, rest = run(stops, chunks, include)
    want, want_stopped = reference(stops, text, include)
    assert stopped == want_stopped
    assert "".join(pieces) + rest == want
    if stopped:
        assert rest == ""
    # What was emitted before the end never includes text that later turned into a stop.
    assert want.startswith("".join(pieces))
