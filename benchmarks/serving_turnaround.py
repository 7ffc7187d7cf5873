"""Where a concurrency-1 request's time goes through tritonserver vs the in-process Engine: per
request, time to first token (TTFT: request sent / added -> first token seen) and first -> final
token, median over the requests of a round, rounds alternating between the two sides.

Same model, settings and prompts as `serving_overhead.py` (its `jobs_for` and `settings`); the
in-process engine runs as the adapter runs it (one torch thread, stepped on this thread), the
server has one copy of the model with ENGINE_PROCESS true and the client is one gRPC stream in
this process. At concurrency 1 the engine never waits for a token's delivery while it decodes,
so the server loses throughput in two places only: TTFT (the request's way in and the first
token's way out) and a slower decode step (first -> final, per token).

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python benchmarks/serving_turnaround.py \
        [--model deepseek-v2-tiny] [--requests 16] [--max-tokens 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_client import REPO, Job, _inputs, temp_repository  # noqa: E402
from serving_overhead import jobs_for, settings  # noqa: E402


def in_process(engine, jobs: list[Job]) -> list[tuple[float, float]]:
    """(TTFT s, first -> final s) per job, one request at a time on `engine`."""
    from mla_backend.request import GenerateRequest, SamplingParams

    rows = []
    for i, job in enumerate(jobs):
        rid = f"turnaround-{time.monotonic_ns()}-{i}"
        t0, first, done = time.perf_counter(), None, False
        engine.add_request(GenerateRequest(rid=rid, text=job.prompt, stream=True,
                                           sampling_params=SamplingParams.from_dict(job.sampling)))
        while not done:
            for out in engine.step():
                if out.rid != rid:
                    continue
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
                done = out.finished
        rows.append((first - t0, time.perf_counter() - first))
    return rows


def through_server(url: str, model: str, jobs: list[Job]) -> list[tuple[float, float]]:
    """(TTFT s, first -> final s) per job, one request at a time over one gRPC stream."""
    import tritonclient.grpc as grpcclient

    arrivals: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: arrivals.put(
        (time.perf_counter(), result, error)))
    rows = []
    try:
        for i, job in enumerate(jobs):
            t0, first = time.perf_counter(), None
            client.async_stream_infer(model, _inputs(job), request_id=str(i),
                                      enable_empty_final_response=True)
            while True:
                t, result, error = arrivals.get(timeout=120)
                if error is not None:
                    raise SystemExit(f"request {i}: {error}")
                first = t if first is None else first
                if result.get_response().parameters["triton_final_response"].bool_param:
                    rows.append((first - t0, t - first))
                    break
    finally:
        client.stop_stream()
        client.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek-v2-tiny")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()

    import torch

    from mla_backend.config import EngineConfig
    from mla_backend.engine import Engine
    from mla_tools.tritonserver import TritonServer

    params = settings(64, args.max_tokens)
    weights = REPO / "model_repository" / args.model / "weights"
    torch.set_num_threads(1)  # the adapter's INTRA_OP_THREAD_COUNT "auto" on 2 cores
    engine = Engine(EngineConfig.create(model_path=str(weights), **params))
    per_token = args.max_tokens - 1
    print("| round | side | TTFT ms | first -> final ms | per token ms |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="serving-turnaround-") as tmp:
        repo = temp_repository(Path(tmp) / "repo", {"m": (args.model, params)},
                               {"m": {"ENGINE_PROCESS": "true"}})
        with TritonServer(repo, startup_timeout=600) as server:
            in_process(engine, jobs_for(3, args.max_tokens, "warm"))
            through_server(server.grpc_url, "m", jobs_for(3, args.max_tokens, "warm"))
            for r in range(args.rounds):
                jobs = jobs_for(args.requests, args.max_tokens, f"round{r}")
                for side, rows in (("in-process", in_process(engine, jobs)),
                                   ("server", through_server(server.grpc_url, "m", jobs))):
                    ttft = 1000 * statistics.median(x[0] for x in rows)
                    rest = 1000 * statistics.median(x[1] for x in rows)
                    print(f"| {r} | {side} | {ttft:.2f} | {rest:.2f} | {rest / per_token:.3f} |",
                          flush=True)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
