"""benchmarks/pyspy_top.py on a raw py-spy file written here in py-spy 0.4.3's `--threads` format
(`thread (TID): NAME` or `thread (TID)` first, then `function (file:line)` frames, then the
count): the samples per thread, by function (self and inclusive, a recursive function once per
stack), per thread, and through `--match`ed functions."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pyspy_top.py"

MAIN = "thread (101): MainThread;<module> (serve.py:10);Engine.loop (engine.py:{})"
RESP = ("thread (202): Thread-1 (respond);Thread._bootstrap (threading.py:1002);"
        "Thread.run (threading.py:982);Responder._respond (/srv/app/responder.py:{})")
FOLDED = "\n".join([
    MAIN.format(40) + ";Engine.step (engine.py:55) 30",
    MAIN.format(41) + ";fib (fib.py:2);fib (fib.py:3);fib (fib.py:3) 20",
    # the same thread before py-spy had its name
    "thread (101);<module> (serve.py:10);Engine.loop (engine.py:41);fib (fib.py:2) 5",
    "thread (101): MainThread 3",  # no Python frame
    RESP.format(77) + ";fib (fib.py:3) 10",
    RESP.format(80) + " 12",
]) + "\n"


def _run(path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(path), *args],
                          capture_output=True, text=True, timeout=60)


def _table(out: str, heading: str) -> list[str]:
    """The rows of the table under the heading line starting with `heading`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("| ") and not line.startswith("| function |") \
                and not line.startswith("| thread |") and not line.startswith("| match |"):
            rows.append(line)
    return rows


def test_threads_functions_and_matches(tmp_path):
    path = tmp_path / "out.folded"
    path.write_text(FOLDED)
    proc = _run(path, "--rate", "10", "--top", "3", "--match", "fib", "Responder", "nowhere")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.splitlines()[0].startswith("80 samples, 8.00 s at 10 samples/s")
    assert _table(out, "## Samples per thread") == [
        "| 101 | MainThread | 58 | 5.80 | 72.5 |",
        "| 202 | Thread-1 (respond) | 22 | 2.20 | 27.5 |",
    ]
    assert "3 samples had no Python frame" in out
    assert _table(out, "## Top 3 functions by self samples") == [
        "| fib (fib.py) | 35 | 3.50 | 43.8 |",
        "| Engine.step (engine.py) | 30 | 3.00 | 37.5 |",
        "| Responder._respond (responder.py) | 12 | 1.20 | 15.0 |",
    ]
    # fib recurs 3 times in a stack of 20 samples: counted 20 there, not 60
    assert _table(out, "## Top 3 functions by inclusive samples") == [
        "| <module> (serve.py) | 55 | 5.50 | 68.8 |",
        "| Engine.loop (engine.py) | 55 | 5.50 | 68.8 |",
        "| fib (fib.py) | 35 | 3.50 | 43.8 |",
    ]
    assert "thread (" not in out.split("## Top 3 functions by self")[1]
    assert _table(out, "### 101 MainThread (58 samples)") == [
        "| Engine.step (engine.py) | 30 | 3.00 | 51.7 |",
        "| fib (fib.py) | 25 | 2.50 | 43.1 |",
    ]
    assert _table(out, "### 202 Thread-1 (respond) (22 samples)") == [
        "| Responder._respond (responder.py) | 12 | 1.20 | 54.5 |",
        "| fib (fib.py) | 10 | 1.00 | 45.5 |",
    ]
    assert _table(out, "## Stacks through a function whose name contains") == [
        "| fib | 35 | 3.50 | 43.8 | 1 |",
        "| Responder | 22 | 2.20 | 27.5 | 1 |",
        "| nowhere | 0 | 0.00 | 0.0 | 0 |",
    ]


def test_gzip_and_default_rate(tmp_path):
    path = tmp_path / "out.folded.gz"
    with gzip.open(path, "wt") as f:
        f.write(FOLDED)
    proc = _run(path)
    assert proc.returncode == 0, proc.stderr
    assert "| 101 | MainThread | 58 | 0.58 | 72.5 |" in proc.stdout
    assert "## Stacks through" not in proc.stdout


def test_no_samples(tmp_path):
    path = tmp_path / "empty.folded"
    path.write_text("")
    proc = _run(path)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "no samples" in proc.stderr
