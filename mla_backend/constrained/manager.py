"""`GrammarManager`: the engine's side of structured outputs, one per engine.

Owns the grammar compiler (`grammar.GrammarCompiler`, made for the first constrained request:
xgrammar is imported only then, so an engine without it serves everything else) and the requests
waiting for their grammar. The engine hands it each constrained `Req` (`submit`), takes back those
whose grammar is ready (`take_ready`: `req.grammar` set to a `GrammarState`, or the compile
error), and asks it for the masks of a batch's rows (`start_masks`). The bitmask of a large
batch is filled on a thread of its own while the engine thread goes on with other host work; no
grammar state of the batch may be touched until `PendingMasks.restrict` returns. Engine thread
only, apart from the compile threads of the compiler and that fill thread.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Sequence

import torch

from mla_backend.host_tensors import int64_on
from mla_backend.request import Req

_WAIT_S = 0.01  # `wait` with nothing else to run: how long it blocks for a compile (s)
# `start_masks` fills on the fill thread from this many constrained rows on (fewer: at once, on
# the caller's thread; the hand-off costs more than such a fill)
BACKGROUND_MIN_ROWS = 64


class PendingMasks:
    """The bitmask of a batch's constrained rows, being filled (`GrammarManager.start_masks`).
    `restrict()` waits for the fill and returns the sampler's `restrict`; it raises what the
    fill raised (e.g. RuntimeError: a terminated grammar state)."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor, vocab_size: int,
                 fill: concurrent.futures.Future | None, single: list[int] | None = None) -> None:
        self.rows = rows  # the constrained rows among the batch's sampling rows
        self.bitmask = bitmask  # CPU int32 [len(rows), words]
        self.vocab_size = vocab_size
        self._fill = fill  # None: already filled
        self._single = single  # (filled now, with `find_single`)

    def single(self) -> list[int]:
        """After `wait()`: the positions in `rows` whose mask allows exactly one token (only
        when `start_masks` was asked to find them, else [])."""
        if self._fill is not None:
            return self._fill.result() or []
        return self._single or []

    def wait(self) -> None:
        """Wait for the fill (its error, if any, is raised)."""
        if self._fill is not None:
            self._fill.result()

    def restrict(self) -> Callable[[torch.Tensor], None]:
        from mla_backend.constrained.grammar import apply_bitmask

        self.wait()
        rows, bitmask, vocab = self.rows, self.bitmask, self.vocab_size

        def restrict(logits: torch.Tensor) -> None:
            if len(rows) == logits.shape[0]:  # every row constrained: in place
                apply_bitmask(logits, bitmask, vocab_size=vocab)
                return
            idx = int64_on(rows, logits.device)
            picked = logits.index_select(0, idx)
            apply_bitmask(picked, bitmask, vocab_size=vocab)
            logits.index_copy_(0, idx, picked)

        return restrict


class GrammarManager:
    """Args:
        tokenizer: the engine's tokenizer.
        vocab_size: the logits' width (tokens).
        stop_token_ids: the ids a grammar allows once complete (the model's EOS ids).
        pin_memory: the step's bitmask in pinned memory (its upload to a GPU does not wait).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 pin_memory: bool = False) -> None:
        self.tokenizer = tokenizer
        self.pin_memory = pin_memory
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(t for t in stop_token_ids if 0 <= t < vocab_size)
        self._compiler: Any = None
        self._filler: Any = None
        self._fill_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._waiting: dict[str, tuple[Req, concurrent.futures.Future]] = {}

    def __bool__(self) -> bool:
        """Some request waits for its grammar."""
        return bool(self._waiting)

    @property
    def active(self) -> bool:
        """Some request has had a grammar (else no batch needs masks)."""
        return self._compiler is not None

    def submit(self, req: Req) -> None:
        """Start compiling `req`'s grammar (`sampling_params.structured_outputs`), off this
        thread; `take_ready` returns the request once it is done.

        Raises:
            ValueError: xgrammar or jsonschema is not installed (the message says what to
                install).
        """
        if self._compiler is None:
            try:
                from mla_backend.constrained.grammar import BitmaskFiller, GrammarCompiler
            except ImportError as e:
                raise ValueError(
                    f"structured_outputs: this server cannot constrain outputs ({e}); install "
                    "the xgrammar and jsonschema packages (requirements.txt pins them)") from None
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size,
                                             stop_token_ids=self.stop_token_ids)
            self._filler = BitmaskFiller()
        self._waiting[req.rid] = (req, self._compiler.submit(req.sampling_params
                                                             .structured_outputs))

    def drop(self, rid: str) -> None:
        """Forget a waiting request (aborted or failed). A compile that no other waiting
        request shares and that has not started yet is cancelled (one already running
        finishes: xgrammar's compile cannot be stopped)."""
        entry = self._waiting.pop(rid, None)
        if entry is not None and all(f is not entry[1] for _, f in self._waiting.values()):
            entry[1].cancel()  # (its cache entry goes with it: GrammarCompiler._on_done)

    def wait(self) -> None:
        """Block a little (`_WAIT_S`) for a compile to finish: the engine has nothing else."""
        concurrent.futures.wait([f for _, f in self._waiting.values()], timeout=_WAIT_S,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    def take_ready(self) -> list[tuple[Req, str | None]]:
        """The waiting requests whose compile has finished: (req, None) with `req.grammar` set,
        or (req, the error's message: a bad schema / regex / grammar)."""
        ready = []
        for rid, (req, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[rid]
            try:
                req.grammar = self._compiler.new_state(future.result())
            except Exception as e:  # noqa: BLE001 - the client's grammar: its request's error
                ready.append((req, str(e)))
                continue
            ready.append((req, None))
        return ready

    def start_masks(self, reqs: Sequence[Req], background: bool = True,
                    find_single: bool = False) -> PendingMasks | None:
        """Start filling the next-token bitmasks of the constrained requests among `reqs` (a
        batch's sampling rows, in order; a request that has ended is left alone: its token is
        dropped) on the host (`BitmaskFiller`: on several threads for a large batch). With
        `background` and at least BACKGROUND_MIN_ROWS rows the fill runs on the fill thread
        and this returns at once; until `restrict()` of the result returns, the caller must not
        touch those requests' grammar states. `find_single`: also find the rows that allow
        exactly one token (`PendingMasks.single`), in the same fill. None when no row needs a
        mask."""
        from mla_backend.constrained.grammar import allocate_bitmask, single_allowed_rows

        rows = [i for i, r in enumerate(reqs) if r.grammar is not None
                and r.finished_reason is None and not r.grammar.is_terminated()]
        if not rows:
            return None
        bitmask = allocate_bitmask(len(rows), self.vocab_size, pin_memory=self.pin_memory,
                                   all_allowed=False)  # the filler writes every row
        states = [reqs[i].grammar for i in rows]
        filler = self._filler

        def run() -> list[int] | None:
            filler.fill(states, bitmask)
            return single_allowed_rows(bitmask) if find_single else None

        if background and len(rows) >= BACKGROUND_MIN_ROWS:
            if self._fill_thread is None:
                self._fill_thread = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="grammar-fill")
            return PendingMasks(rows, bitmask, self.vocab_size, self._fill_thread.submit(run))
        return PendingMasks(rows, bitmask, self.vocab_size, None, run())

    def accept_tokens(self, states: Sequence[Any], token_ids: Sequence[int]) -> list[bool]:
        """Each `GrammarState` in `states` takes its token (`GrammarState.accept_tokens`: one
        call into xgrammar); returns whether each was allowed (a refused one leaves its state
        unchanged)."""
        from mla_backend.constrained.grammar import GrammarState

        return GrammarState.accept_tokens(states, token_ids)

    def shutdown(self) -> None:
        """Stop the fill thread (after its current fill) and the compile threads."""
        if self._fill_thread is not None:
            self._fill_thread.shutdown(wait=True)
            self._fill_thread = None
        if self._compiler is not None:
            self._compiler.shutdown(wait=False)


__all__ = ["BACKGROUND_MIN_ROWS", "GrammarManager", "PendingMasks"]
