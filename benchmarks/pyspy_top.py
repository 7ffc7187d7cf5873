"""Where a process's sampled time goes, per thread and per function, from py-spy's raw output.

Reads py-spy's `--format raw` file (`.gz` allowed): one line per distinct stack, frames root
first and `;`-separated, then a space and the stack's sample count. With `--threads` the first
frame is the thread, `thread (TID): NAME` (or `thread (TID)` when py-spy has no name for it),
and each further frame is `function (file:line)` (`function (file)` under `--nolineno`).
Prints markdown tables: samples per thread; the top `--top` functions by self samples (the
stack's leaf) and by inclusive samples (a function counted once per stack however often it
recurs in it); each thread's top functions by self samples; and, for each `--match` string, the
samples of the stacks having a function whose name contains it. A function is keyed by its
name and file basename, lines merged: `Responder._respond (responder.py)`. Seconds are samples
over `--rate`; the threads' seconds add up, so their sum can exceed the wall time (under
`--gil` only the thread holding the GIL is sampled: the sum is the GIL's busy time).

    py-spy record --pid PID --duration 12 --rate 100 --format raw --nonblocking --threads \\
        [--gil] [--idle] -o out.folded
    python3 benchmarks/pyspy_top.py out.folded [--rate 100] [--top 25] [--match STR ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pyspy_steps import open_folded  # noqa: E402

_THREAD = re.compile(r"thread \(([^)]*)\)(?:: (.*))?$")
_FRAME = re.compile(r"(.*?) \((.*)\)$")
_LINE = re.compile(r":\d+$")

NO_THREAD = "-"  # the thread of stacks recorded without --threads



def frame_key(frame: str) -> tuple[str, str]:
    """(function name, `name (file basename)`) of a py-spy frame `name (file:line)`."""
    m = _FRAME.match(frame)
    if not m:
        return frame, frame
    name, path = m.group(1), _LINE.sub("", m.group(2))
    return name, f"{name} ({os.path.basename(path) or path})"


class Profile:
    """The samples of a raw py-spy file, by thread and by function."""

    def __init__(self, matches: list[str] | None = None) -> None:
        self.total = 0
        self.no_frame = 0  # samples whose stack is the thread frame alone
        self.thread: collections.Counter = collections.Counter()
        self.names: dict[str, list[str]] = {}  # thread id -> the names py-spy gave it
        self.self_: collections.Counter = collections.Counter()
        self.incl: collections.Counter = collections.Counter()
        self.thread_self: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)
        self.matches = list(matches or [])
        self.match: collections.Counter = collections.Counter()
        self.matched: dict[str, set] = collections.defaultdict(set)

    def add(self, line: str) -> None:
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            return
        count = int(n)
        frames = stack.split(";")
        while frames and frames[0].startswith("process "):  # --subprocesses: its processes
            frames.pop(0)
        tid = NO_THREAD
        m = _THREAD.match(frames[0]) if frames else None
        if m:
            frames.pop(0)
            tid = m.group(1)
            names = self.names.setdefault(tid, [])
            if m.group(2) and m.group(2) not in names:
                names.append(m.group(2))
        self.total += count
        self.thread[tid] += count
        if not frames:
            self.no_frame += count
            return
        keys = [frame_key(f) for f in frames]
        leaf = keys[-1][1]
        self.self_[leaf] += count
        self.thread_self[tid][leaf] += count
        for key in {k for _, k in keys}:
            self.incl[key] += count
        for s in self.matches:
            hit = {k for name, k in keys if s in name}
            if hit:
                self.match[s] += count
                self.matched[s] |= hit

    def thread_label(self, tid: str) -> str:
        return "/".join(self.names.get(tid, [])) or ("(no --threads)" if tid == NO_THREAD
                                                     else "")


def read(path: str, matches: list[str] | None = None) -> Profile:
    prof = Profile(matches)
    with open_folded(path) as f:
        for line in f:
            prof.add(line)
    return prof


def _top(counter: collections.Counter, n: int) -> list[tuple[str, int]]:
    return sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def report(prof: Profile, rate: float, top: int) -> str:
    total = prof.total
    out: list[str] = []

    def row(label: str, n: int, of: int = total) -> str:
        return f"| {_cell(label)} | {n} | {n / rate:.2f} | {100 * n / of:.1f} |"

    out.append(f"{total} samples, {total / rate:.2f} s at {rate:g} samples/s "
               f"(threads' seconds add up)")
    out += ["", "## Samples per thread", "", "| thread | name | samples | s | % |",
            "|---|---|---|---|---|"]
    for tid, n in _top(prof.thread, len(prof.thread)):
        out.append(f"| {tid} | {_cell(prof.thread_label(tid))} | {n} | {n / rate:.2f} | "
                   f"{100 * n / total:.1f} |")
    if prof.no_frame:
        out += ["", f"{prof.no_frame} samples had no Python frame (the thread frame alone)."]
    for title, counter in ((f"Top {top} functions by self samples", prof.self_),
                           (f"Top {top} functions by inclusive samples", prof.incl)):
        out += ["", f"## {title}", "", "| function | samples | s | % |", "|---|---|---|---|"]
        out += [row(key, n) for key, n in _top(counter, top)]
    out += ["", "## Per thread: top 8 functions by self samples"]
    for tid, n_thread in _top(prof.thread, len(prof.thread)):
        counter = prof.thread_self.get(tid)
        if not counter:
            continue
        label = prof.thread_label(tid)
        out += ["", f"### {tid}{' ' + label if label else ''} ({n_thread} samples)", "",
                "| function | samples | s | % of thread |", "|---|---|---|---|"]
        out += [row(key, n, n_thread) for key, n in _top(counter, 8)]
    if prof.matches:
        out += ["", "## Stacks through a function whose name contains", "",
                "| match | samples | s | % | functions matched |", "|---|---|---|---|---|"]
        for s in prof.matches:
            n = prof.match[s]
            out.append(f"{row(s, n)} {len(prof.matched[s])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folded", help="py-spy --format raw output (.gz allowed)")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's --rate (samples/s)")
    ap.add_argument("--top", type=int, default=25, help="functions in each top table")
    ap.add_argument("--match", nargs="+", default=[], metavar="STR",
                    help="also print the samples of stacks through a function whose name "
                         "contains STR")
    args = ap.parse_args(argv)
    prof = read(args.folded, args.match)
    if not prof.total:
        print(f"no samples in {args.folded}", file=sys.stderr)
        return 1
    print(report(prof, args.rate, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
