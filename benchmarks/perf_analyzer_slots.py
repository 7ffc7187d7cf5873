"""How many requests perf_analyzer keeps in flight with `--request-count`, against our client.

perf_analyzer's concurrency mode gives each of its C contexts the requests whose index is
k mod C (from `--input-data`), and a context sends its next request only when its previous one
has ended. With lengths that vary, the contexts holding the long requests run on alone at the
end, so fewer than C requests are in flight and output tok/s falls (the closed-loop sweeps of
bench_server_path.py: perf_analyzer at concurrency 8 with 32 requests). Our client
(`serving_client.stream_load`) sends the next request of one shared list whenever any request
ends. Both run the same requests against one tritonserver (the tiny DeepSeek-V2 model, CPU):
one long request (--long tokens) then C - 1 short ones (--short), repeated; printed: each
client's time-weighted mean of requests in flight, and its wall time.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python benchmarks/perf_analyzer_slots.py \
        [--concurrency 4] [--requests 16] [--long 48] [--short 6]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import Job, stream_load, temp_repository  # noqa: E402
from serving_overhead import settings  # noqa: E402


def mean_in_flight(spans: list[tuple[float, float]]) -> tuple[float, float]:
    """(time-weighted mean of the spans open at once, wall time) of (start, end) spans (s)."""
    t0, end = min(s for s, _ in spans), max(e for _, e in spans)
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    area, open_, last = 0.0, 0, t0
    for t, step in events:
        area += open_ * (t - last)
        open_, last = open_ + step, t
    return area / (end - t0), end - t0


def perf_analyzer_spans(url: str, jobs: list[Job], concurrency: int, tmp: Path) -> list:
    from mla_tools.tritonserver import perf_analyzer_env

    data = {"data": [{"text_input": [job.prompt], "stream": [True],
                      "sampling_parameters": [json.dumps(job.sampling)]} for job in jobs]}
    (tmp / "input.json").write_text(json.dumps(data))
    binary = str(Path(sys.executable).parent / "perf_analyzer")
    argv = [binary, "-m", "m", "-u", url, "-i", "grpc", "--async", "--streaming",
            "--input-data", str(tmp / "input.json"), "--concurrency-range", str(concurrency),
            "--request-count", str(len(jobs)), "--stability-percentage", "999",
            "--profile-export-file", str(tmp / "export.json")]
    run = subprocess.run(argv, capture_output=True, text=True, env=perf_analyzer_env())
    if run.returncode != 0:
        raise SystemExit(f"perf_analyzer failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    doc = json.loads((tmp / "export.json").read_bytes().decode("utf-8", "surrogateescape"))
    return [(r["timestamp"] / 1e9, max(r["response_timestamps"]) / 1e9)
            for r in doc["experiments"][0]["requests"]]


def own_client_spans(url: str, jobs: list[Job], concurrency: int) -> list:
    stats = stream_load(url, "m", jobs, concurrency, record_times=True)
    return [(t.sent_ns / 1e9, t.responses[-1][0] / 1e9) for t in stats.times.values()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--long", type=int, default=48, help="output tokens of the long requests")
    ap.add_argument("--short", type=int, default=6, help="output tokens of the others")
    args = ap.parse_args()
    c = args.concurrency

    from mla_tools.tritonserver import TritonServer

    def job(i: int) -> Job:
        n = args.long if i % c == 0 else args.short
        return Job(f"request {i}: tell a story", {"max_tokens": n, "min_tokens": n,
                                                  "ignore_eos": True, "temperature": 0})

    jobs = [job(i) for i in range(args.requests)]
    print("| client | requests | concurrency | mean in flight | wall s |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="perf-analyzer-slots-") as tmp:
        repo = temp_repository(Path(tmp) / "repo",
                               {"m": ("deepseek-v2-tiny", settings(2 * c, args.long))},
                               {"m": {"ENGINE_PROCESS": "true"}})
        with TritonServer(repo, startup_timeout=600) as server:
            own_client_spans(server.grpc_url, jobs[:c], c)  # warm-up
            for name, spans in (
                    ("perf_analyzer", perf_analyzer_spans(server.grpc_url, jobs, c, Path(tmp))),
                    ("own client", own_client_spans(server.grpc_url, jobs, c))):
                mean, wall = mean_in_flight(spans)
                print(f"| {name} | {len(spans)} | {c} | {mean:.2f} | {wall:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
