"""Issue 41's concurrency-1 TTFT, prompt by prompt: the in-process engine and tritonserver (our
model, its engine process, our own gRPC streaming client) alive together on one machine, each
prompt sent first to the in-process engine and then to the server, one request at a time. The
sweep of `bench_server_path.py` runs the sides one after another, minutes apart, and their TTFT
p50s have moved by more than the 2 ms target between runs; here the two requests of a pair are
seconds apart, so drift of the machine falls on both.

Same engine settings on both sides (`bench_server_path.engine_settings`; radix cache off, so
every request prefills its whole prompt), ShareGPT lengths, random `input_ids` prompts, exactly
the output length asked, every token streamed. The in-process side runs in this process
(`serving_client.engine_load`, one request); the server side on one gRPC stream opened before
the first request (`serving_client.stream_load`), whose `take` hook runs each in-process request
just before sending the same prompt to the server. Both engines hold a KV pool at once, so
`--max-total-tokens` defaults to 65,536 and the graph and running limits to 16.

Prints per side TTFT and ITL p50 / p99, the per-request TTFT differences (server − in-process:
median, mean, p10, p90) and the issue's two concurrency-1 targets; `--details` keeps every pair.
With `--server-param REPORT_CUSTOM_METRICS=true` also the adapter's mean TTFT (from the stub's
registration of a request to the engine's first token): the client's mean minus it is the
request's way in to the stub and the first token's way out.

    PYTHONPATH=. python3 benchmarks/bench_ttft_pairs.py --model deepseek-v2-lite --tokenizer-dir T
    .venv/bin/python benchmarks/bench_ttft_pairs.py --model deepseek-v2-tiny --device cpu \\
        --pairs 16 --max-output 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_server_path as bsp  # noqa: E402  (puts the repository and tests/serving on the path)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="concurrency-1 TTFT of the in-process engine and "
                                 "tritonserver, the same prompts alternating between them")
    bsp.add_engine_options(ap)
    ap.add_argument("--pairs", type=int, default=64, help="measured prompts (each sent to both)")
    ap.add_argument("--warm-up", type=int, default=4,
                    help="prompts sent to both sides first, unmeasured")
    ap.set_defaults(max_total_tokens="65536", max_running=16, graph_max_bs=16)
    args = ap.parse_args(argv)
    if args.pairs < 1 or args.warm_up < 0:
        ap.error("--pairs must be >= 1 and --warm-up >= 0")
    bad = [p for p in args.server_param if "=" not in p]
    if bad:
        ap.error(f"--server-param wants KEY=VALUE, got {bad[0]!r}")
    if args.intra_op_threads is None and args.device == "cpu":
        args.intra_op_threads = max(1, len(os.sched_getaffinity(0)) - 1)
    return args


def request_times(times) -> tuple[float, float] | None:
    """(TTFT, ITL) in ms of one `serving_client.RequestTimes`, None without tokens."""
    if not times.responses:
        return None
    first, last = times.responses[0][0], times.responses[-1][0]
    tokens = sum(n for _, n in times.responses)
    itl = (last - first) / (tokens - 1) / 1e6 if tokens > 1 else 0.0
    return (first - times.sent_ns) / 1e6, itl


def summary(pairs: list[dict[str, float]]) -> dict[str, float]:
    """Per side TTFT / ITL p50 and p99 and the TTFT differences' median, mean, p10 and p90 (ms)."""
    import numpy as np

    out: dict[str, float] = {}
    for side in ("in_process", "server"):
        for name in ("ttft", "itl"):
            values = [p[f"{side}_{name}_ms"] for p in pairs]
            for q in (50, 99):
                out[f"{side}_{name}_p{q}_ms"] = float(np.percentile(values, q))
    diff = [p["server_ttft_ms"] - p["in_process_ttft_ms"] for p in pairs]
    out.update(ttft_diff_median_ms=float(np.median(diff)), ttft_diff_mean_ms=float(np.mean(diff)),
               ttft_diff_p10_ms=float(np.percentile(diff, 10)),
               ttft_diff_p90_ms=float(np.percentile(diff, 90)))
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, bsp._exit_on_sigterm)  # the server stops with the benchmark
    import torch
    from bench_suite import log, table
    from serving_client import engine_load, stream_load
    from serving_helpers import engine_config

    from mla_backend.engine import Engine
    from mla_tools.tritonserver import TritonServer

    total = args.warm_up + args.pairs
    head = {"date": time.strftime("%Y-%m-%d"), "commit": args.commit or bsp.git_commit(),
            "command": "python3 benchmarks/bench_ttft_pairs.py " + shlex.join(argv)}
    pairs: list[dict[str, float]] = []
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_ttft_pairs_")))
        workdir.mkdir(parents=True, exist_ok=True)
        folder, dummy = bsp.model_folder(args, workdir)
        requests = bsp.make_requests(args, folder, total)
        settings = bsp.engine_settings(args, folder, dummy)
        config = bsp.write_repository(workdir / "repository", settings, args.device)
        cfg = engine_config(config.parent)  # the in-process engine: the shared settings
        extra = dict(p.split("=", 1) for p in args.server_param)  # the server's alone
        if extra:
            bsp.write_repository(workdir / "repository", {**settings, **extra}, args.device)
        log(f"{total} prompts ({args.warm_up} to warm up); engine settings: {settings}"
            + (f"; the server's own: {extra}" if extra else ""))
        if args.intra_op_threads:  # as the adapter sets them
            torch.set_num_threads(args.intra_op_threads)
        engine = Engine(cfg)
        stack.callback(engine.close)
        head["hardware"] = bsp.hardware()
        log(f"in-process engine up; tritonserver next ({workdir / 'server.log'})")
        server = stack.enter_context(TritonServer(
            workdir / "repository", startup_timeout=args.startup_timeout,
            log_path=workdir / "server.log"))
        jobs = bsp.run_jobs(requests, bsp.Run("pairs", total, 1))
        local: list[Any] = []
        order = iter(range(total))

        def take() -> int | None:
            """The in-process request of the next prompt, then its index for the server."""
            i = next(order, None)
            if i is not None:
                stats = engine_load(engine, [jobs[i]], 1, record_times=True)
                if stats.errors or stats.output_tokens != requests[i][1]:
                    raise SystemExit(f"in-process request {i}: {stats.output_tokens} of "
                                     f"{requests[i][1]} tokens, errors {stats.errors[:1]}")
                local.append(stats.times[0])
            return i

        stub0 = bsp.stub_ttft(server.metrics_url)
        stats = stream_load(server.grpc_url, bsp.MODEL_NAME, jobs, 1, record_times=True,
                            take=take)
        stub_ms = bsp.stub_ttft_mean_ms(stub0, bsp.stub_ttft(server.metrics_url))
        if stats.errors or stats.short:
            raise SystemExit(f"server: {stats.short} short requests, errors {stats.errors[:3]}")
    for i in range(args.warm_up, total):
        ours, theirs = request_times(local[i]), request_times(stats.times[i])
        pairs.append({"prompt_tokens": len(requests[i][0]), "output_tokens": requests[i][1],
                      "in_process_ttft_ms": ours[0], "in_process_itl_ms": ours[1],
                      "server_ttft_ms": theirs[0], "server_itl_ms": theirs[1]})
    s = summary(pairs)
    table(f"Concurrency 1, {args.pairs} prompts each sent to both sides in turn, {args.model} "
          f"({head['hardware']})",
          ["side", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"],
          [[side] + [s[f"{side}_{k}_ms"] for k in ("ttft_p50", "ttft_p99", "itl_p50",
                                                    "itl_p99")]
           for side in ("in_process", "server")])
    table("TTFT, server − in-process, per prompt (ms)", ["median", "mean", "p10", "p90"],
          [[s["ttft_diff_median_ms"], s["ttft_diff_mean_ms"], s["ttft_diff_p10_ms"],
            s["ttft_diff_p90_ms"]]])
    if stub_ms is not None:  # (all requests, the warm-up's included)
        client_ms = sum(request_times(t)[0] for t in stats.times.values()) / len(stats.times)
        s.update(server_ttft_mean_ms=client_ms, stub_ttft_mean_ms=stub_ms)
        table("Where the server's TTFT goes (means over every request, ms)",
              ["client TTFT", "the adapter's TTFT", "way in + out"],
              [[client_ms, stub_ms, client_ms - stub_ms]])
    itl = s["server_itl_p50_ms"] / s["in_process_itl_p50_ms"]
    extra_ms = s["server_ttft_p50_ms"] - s["in_process_ttft_p50_ms"]
    table("Targets (issue 41, concurrency 1)", ["target", "measured", "met"],
          [["ITL p50 within 5% of in-process", f"{itl:.3f}x",
            "yes" if itl <= bsp.TARGETS["itl_c1_ratio"] else "NO"],
           ["TTFT p50 at most 2 ms above in-process", f"{extra_ms:+.2f} ms",
            "yes" if extra_ms <= bsp.TARGETS["ttft_c1_extra_ms"] else "NO"]])
    if args.details:
        Path(args.details).write_text(json.dumps(
            {**head, "args": vars(args), "engine_settings": settings, "summary": s,
             "pairs": pairs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
