"""benchmarks/bench_host_step.py with the overlap schedule and a free forward (the set-up of its
GPU-peak-batch table in docs/benchmarks.md): every request decodes in the timed steps and each
host part is timed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_overlap_with_a_free_forward_times_every_request():
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_host_step.py"), "--requests", "64",
         "--warmup", "4", "--steps", "5", "--overlap", "--free-forward",
         "--max-total-tokens", "8192"],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("### Decode step on the CPU, deepseek-v2-tiny, 64 streaming "
                               "requests") for line in lines), proc.stdout[-2000:]
    header = next(line for line in lines if line.startswith("| step |"))
    row = lines[lines.index(header) + 2]
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")],
                     [float(c) for c in row.strip("|").split("|")]))
    for part in ("schedule", "forward batch", "commit", "flush", "host parts"):
        assert cells[part] > 0, cells
    assert cells["forward"] < cells["host parts"]  # (zero logits: no model ran)
