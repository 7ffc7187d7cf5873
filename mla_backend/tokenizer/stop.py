"""Stop strings over streamed text.

Owned by the `output_processor.OutputProcessor`, one `StopStringMatcher` per request with
`sampling_params.stop`; it is fed the detokenizer's deltas and what it emits becomes
`RequestOutput.new_text`.

A stop string may span several deltas, so the matcher holds back the longest tail of the text that
is a prefix of some stop string and emits only text that can no longer become part of a match.
When stops overlap, the one that is completed first wins (earliest end; for the same end, the
earliest start) — the result of feeding text does not depend on how it was split into chunks.
"""

from __future__ import annotations

from typing import Sequence


class StopStringMatcher:
    """Finds the first stop string in text fed in pieces.

    stops: non-empty strings (an empty sequence makes `feed` pass text through).
    include_stop_str: emit the matched stop string itself (True) or drop it (False).
    Raises ValueError for an empty stop string.
    """

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        self.held = ""  # text withheld because it may start a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string found, once stopped

    def feed(self, text: str, can_stop: bool = True) -> tuple[str, bool]:
        """Add text; return (text safe to emit now, whether a stop string matched).

        After a match, the emitted text ends at the stop string (or includes it, with
        include_stop_str) and every later call returns ("", True).
        can_stop=False (e.g. before min_new_tokens is reached): stop strings completed in this
        text do not stop and are emitted as plain text; only a possible start of a stop string
        at the end is held back.
        """
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self.held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops if can_stop else ():
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, stop = best
            self.stopped = True
            self.matched = stop
            self.held = ""
            return (buf[:end] if self.include_stop_str else buf[:start]), True
        keep = self._partial_match_len(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Return (and forget) the held-back text, for a request that ended without a match."""
        rest, self.held = self.held, ""
        return "" if self.stopped else rest

    def _partial_match_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(buf), len(stop) - 1), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
