"""benchmarks/bench_stub_calls.py on the CPU: the probe model runs inside a real stub and
reports every call it times, with the stub's own switch interval restored after."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.e2e
def test_probe_times_each_call(tmp_path):
    out = tmp_path / "calls.json"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_stub_calls.py"), "--calls", "20",
                           "--switch-intervals", "2", "0.2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["calls"] == 20 and doc["own_interval_ms"] == pytest.approx(5.0)
    names = [(name, ms) for name, ms, _, _ in doc["rows"]]
    assert names == [("histogram observe", None), ("counter increment", None),
                     ("Tensor, BYTES [1]", None), ("Tensor, UINT32 [1]", None),
                     ("InferenceResponse", None), ("is_cancelled", None),
                     ("send (Tensor + response + send)", None),
                     ("histogram observe, busy thread", 2.0), ("send, busy thread", 2.0),
                     ("histogram observe, busy thread", 0.2), ("send, busy thread", 0.2)]
    for name, _, wall, cpu in doc["rows"]:
        assert wall > 0 and cpu > 0, name
    assert "| send, busy thread | 0.2 |" in proc.stdout
