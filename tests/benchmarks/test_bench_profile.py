"""benchmarks/bench_profile.py's ttft section on the CPU (a V2-Lite-shaped model cut small):
every run of the `extend_as_decode` side took the decode-row path, the other none, and both
gave each prompt the same greedy first token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_bench_structured import SMALL

REPO = Path(__file__).resolve().parents[2]


def test_ttft_section_compares_eager_prefill_with_decode_rows(tmp_path, tokenizer_dir):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_profile.py"),
         "--model", "deepseek-v2-lite", "--tokenizer-dir", tokenizer_dir, "--device", "cpu",
         "--sections", "ttft", "--ttft-lengths", "1", "16", "64", "--ttft-reps", "3",
         "--graph-max-bs", "64", "--shape-overrides", json.dumps(SMALL), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())["ttft"]
    assert sorted(doc, key=int) == ["1", "16", "64"]
    for n in ("1", "16", "64"):
        assert len(doc[n]["eager_ms"]) == len(doc[n]["as_decode_ms"]) == 3
        assert all(t > 0 for t in doc[n]["eager_ms"] + doc[n]["as_decode_ms"])
        assert doc[n]["as_decode_runs"] == 3
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |")
            or line.startswith("| 16 |") or line.startswith("| 64 |")]
    assert len(rows) == 3 and all(r.endswith("| 3/3 | 3/3 |") for r in rows), rows


def test_steps_window_reports_its_steps(tmp_path, tokenizer_dir):
    """`--window START COUNT` on the CPU: the window's steps are timed and their host functions
    and ops profiled; no CUDA runtime calls or allocator counters there."""
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_profile.py"),
         "--model", "deepseek-v2-lite", "--tokenizer-dir", tokenizer_dir, "--device", "cpu",
         "--sections", "steps", "--num-requests", "4", "--window", "3", "2",
         "--shape-overrides", json.dumps(SMALL), "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    win = json.loads(out.read_text())["window"]
    assert (win["start"], win["count"]) == (3, 2)
    assert win["wall_ms"] > 0 and win["kernel_ms"] > 0 and win["outputs_per_step"] == 4
    assert win["host_top"] and win["runtime_calls"] == {} and win["allocator"] == {}
    assert json.loads(out.read_text())["steps"]["allocator"] == {}
    assert "none (no CUDA)" in proc.stdout and "caching allocator" not in proc.stdout
