"""Issue 41, the product path at full speed: tritonserver serving our model (decoupled, gRPC
streaming, STREAM_INTERVAL 1) under perf_analyzer and our own client, against the in-process engine:
same machine, same engine settings, same requests (ShareGPT lengths, random `input_ids` prompts,
exactly the output length asked). Measures the peak output tok/s (`--num-requests` at once) and,
at each `--concurrency` (closed loop), tok/s, TTFT and ITL p50 / p99 (a request's ITL: (last -
first token) / (tokens - 1), as genai-perf's). The engine and the own client run in child
processes (`--worker`); the engine exits before the server starts (one GPU holds one engine).
The in-process peak also prints its steps by kind with the time they waited for the GPU
(`bench_suite.StepLog`, as bench_profile's steps section): a wait near 0 means host-bound. For
the server side it prints the engine process's loop times (`engine.LoopTimes`) and, per run,
the clients' mean TTFT against the adapter's (from the stub's registration of a request; the
difference is the way in to the stub and the first token's way out). At concurrency 1 it also
prints the median of the per-request TTFT differences (server − in-process, the same prompts in
the same order), which leaves out the spread between prompts; `--log-compiles` prints, per
in-process run, the triton kernels specialized after load and the garbage collections.
The second command below adds an FP8 peak (no sweep) to the first one's JSON file.
`--clients ... genai_perf` adds genai-perf (`find_genai_perf`), which sends requests of its own:
text prompts and output lengths drawn with the run's mean lengths (`genai_perf_argv`); its rows
are genai-perf's own figures (`read_genai_perf`), outside the targets.

    PYTHONPATH=. python3 benchmarks/bench_server_path.py --model deepseek-v2-lite --tokenizer-dir T
    PYTHONPATH=. python3 benchmarks/bench_server_path.py --model deepseek-v2-lite \
        --tokenizer-dir T --quantization fp8 --kv-cache-dtype fp8_e4m3 --concurrency --merge
    .venv/bin/python benchmarks/bench_server_path.py --model deepseek-v2-tiny --device cpu \
        --num-requests 48 --concurrency 1 8 --max-output 32 --json /tmp/server_path.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(REPO), str(HERE), str(REPO / "tests" / "serving")]  # as serving_client

from serving_helpers import engine_config, pbtxt_parameters  # noqa: E402
from sharegpt_lengths import DEFAULT_PATH, load_length_pairs  # noqa: E402

CLIENTS = ("perf_analyzer", "own_client", "genai_perf")
DEFAULT_CLIENTS = ("perf_analyzer", "own_client")
IN_PROCESS = "in_process"
MODEL_NAME = "bench"
WARM_UP_REQUESTS = 256  # bench_suite.warm_up's count: the first prefills of the peak run
WARM_UP_TOKENS = 8
DEFAULT_JSON_GPU = HERE / "results" / "h200_server_path.json"
TARGETS = {"peak_ratio": 0.90, "itl_c1_ratio": 1.05, "ttft_c1_extra_ms": 2.0}
PEAK_KEYS = ("in_process_tok_s", "server_tok_s", "ratio")
SWEEP_LATENCIES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


@dataclasses.dataclass(frozen=True)
class Run:
    """One load: the first `count` requests of the request list, `concurrency` in flight (closed
    loop); `max_tokens` replaces every request's output length (warm-ups); unmeasured runs are
    warm-ups."""

    label: str
    count: int
    concurrency: int
    max_tokens: int | None = None
    measured: bool = True


def plan(num_requests: int, levels: list[int], waves: int, min_requests: int) -> list[Run]:
    """Warm-up (the first prompts, a few tokens each), the peak, then per concurrency level a
    short warm-up wave and the measured run. Every side runs this same list."""
    runs: list[Run] = []
    first = min(WARM_UP_REQUESTS, max([num_requests] + levels))
    runs.append(Run("warm-up", first, first, WARM_UP_TOKENS, False))
    if num_requests:
        runs.append(Run("peak", num_requests, num_requests))
    for c in levels:
        runs.append(Run(f"warm-up c={c}", c, c, WARM_UP_TOKENS, False))
        runs.append(Run(f"c={c}", max(min_requests, waves * c), c))
    return runs


def sampling(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}


def run_jobs(requests: list[list], run: Run) -> list:
    """`serving_client.Job`s of `run`; each prompt is a token-id list (sent as `input_ids`)."""
    from serving_client import Job

    return [Job(None, sampling(run.max_tokens or out), input_ids=prompt)
            for prompt, out in requests[:run.count]]


# ------------------------------------------------------------------------------------- metrics
class Trace:
    """Send time of each request and (arrival time, tokens) of each of its responses with tokens
    (seconds, one clock per trace)."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.arrivals: dict[str, list[tuple[float, int]]] = defaultdict(list)


def load_trace(stats) -> Trace:
    """The Trace of a `serving_client` load run with record_times=True (request id: the job's
    index, as perf_analyzer's requests are numbered)."""
    trace = Trace()
    for i, times in stats.times.items():
        trace.sent[str(i)] = times.sent_ns / 1e9
        trace.arrivals[str(i)] = [(ns / 1e9, n) for ns, n in times.responses]
    return trace


def load_result(stats, jobs: list) -> dict[str, Any]:
    """`trace_result` of a `serving_client` load run of `jobs`, with its errors and CPU time."""
    asked = {str(i): job.sampling["max_tokens"] for i, job in enumerate(jobs)}
    return {**trace_result(load_trace(stats), asked), "errors": stats.errors,
            "client_cpu_s": stats.cpu_s}


def trace_result(trace: Trace, asked: dict[str, int]) -> dict[str, Any]:
    """Per request [TTFT, ITL, end-to-end] (s), the token counts and the run's time span.

    Args:
        asked: request id → output tokens asked for.
    Returns:
        {"requests", "expected_tokens", "output_tokens", "wrong_count" (requests whose token
        count differs from what they asked), "per_request", "span_s": first send → last token}.
    """
    per_request, tokens, wrong, last = [], 0, 0, None
    for rid, n_asked in asked.items():
        got = trace.arrivals.get(rid, [])
        n = sum(k for _, k in got)
        tokens += n
        wrong += n != n_asked
        if not got:
            continue
        t_sent, t_first, t_last = trace.sent[rid], got[0][0], got[-1][0]
        itl = (t_last - t_first) / (n - 1) if n > 1 else 0.0
        per_request.append([t_first - t_sent, itl, t_last - t_sent])
        last = t_last if last is None else max(last, t_last)
    first = min((trace.sent[rid] for rid in asked if rid in trace.sent), default=0.0)
    return {"requests": len(asked), "expected_tokens": sum(asked.values()),
            "output_tokens": tokens, "wrong_count": wrong, "per_request": per_request,
            "span_s": (last - first) if last is not None else 0.0}


def stub_ttft(metrics_url: str) -> tuple[float, float]:
    """(sum s, count) of the adapter's `vllm:time_to_first_token_seconds` for MODEL_NAME: per
    request the engine's first token − the request's registration in the stub (so a client's
    TTFT minus this is the way in to the stub and the first token's way out)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=30) as f:
        text = f.read().decode()
    got = {}
    for name, labels, value in re.findall(
            r"^vllm:time_to_first_token_seconds_(sum|count)\{([^}]*)\}\s+(\S+)$", text, re.M):
        if f'model="{MODEL_NAME}"' in labels:
            got[name] = float(value)
    return got.get("sum", 0.0), got.get("count", 0.0)


def stub_ttft_mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Mean of the `stub_ttft` observations between two readings (ms); None without any."""
    count = after[1] - before[1]
    return 1e3 * (after[0] - before[0]) / count if count > 0 else None


def paired_ttft_ms(server: dict[str, Any], base: dict[str, Any]) -> float | None:
    """Median over requests of (server TTFT - in-process TTFT), ms, from two `trace_result`s of
    the same jobs (per_request in job order); None unless every request of both got tokens. At
    concurrency 1 both sides prefill the same prompts in the same order, so this compares each
    prompt with itself and leaves out the spread between prompts that the p50s carry."""
    import numpy as np

    a, b = server.get("per_request") or [], base.get("per_request") or []
    if not a or len(a) != len(b) or len(a) != server["requests"] or \
            len(b) != base["requests"]:
        return None
    return float(np.median([(x[0] - y[0]) * 1e3 for x, y in zip(a, b)]))


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Output tok/s, TTFT mean and TTFT / ITL / end-to-end p50 and p99 (ms) of a
    `trace_result`."""
    import numpy as np

    out = {"tok_s": result["output_tokens"] / result["span_s"] if result["span_s"] else 0.0}
    per = np.array(result["per_request"], dtype=float).reshape(-1, 3)
    out["ttft_mean_ms"] = float(per[:, 0].mean() * 1e3) if len(per) else float("nan")
    for i, name in enumerate(("ttft", "itl", "e2e")):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = float(np.percentile(per[:, i], q) * 1e3) if len(per) else \
                float("nan")
    return out


# ------------------------------------------------------------------------------------- workers
def hardware() -> str:
    """The GPU (when torch sees one) and the CPU of this machine, in words."""
    import torch

    cpu = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   cpu)
    host = f"{cpu}, {os.cpu_count()} CPU cores"
    if not torch.cuda.is_available():
        return f"{host}, no GPU"
    props = torch.cuda.get_device_properties(0)
    return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), {host}"


def in_process_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """The engine with the server model's settings (its config.pbtxt), in this process, loaded
    by `serving_client.engine_load` (record_times)."""
    import torch
    from bench_profile import CompileLog, GcPauses
    from bench_suite import StepLog, table
    from serving_client import engine_load

    from mla_backend.engine import Engine

    config_path = Path(spec["config"])
    params = pbtxt_parameters(config_path)
    config = engine_config(config_path.parent)
    if params.get("INTRA_OP_THREAD_COUNT", "auto") != "auto":  # as the adapter sets them
        torch.set_num_threads(int(params["INTRA_OP_THREAD_COUNT"]))
    t = time.perf_counter()
    engine = Engine(config)
    print(f"in-process engine up in {time.perf_counter() - t:.1f} s", flush=True)
    requests = json.loads(Path(spec["requests"]).read_text())
    results = []
    for run in (Run(**r) for r in spec["runs"]):
        jobs = run_jobs(requests, run)
        steps = StepLog(engine) if run.label == "peak" else None
        with contextlib.ExitStack() as watch:
            if spec.get("log_compiles"):
                step_count = [0]

                def on_step(dt: float, count=step_count, inner=steps) -> None:
                    count[0] += 1
                    if inner is not None:
                        inner.on_step(dt)
                gcs = watch.enter_context(GcPauses())
                compiles = watch.enter_context(CompileLog(lambda c=step_count: c[0]))
            else:
                on_step = steps.on_step if steps else None
            stats = engine_load(engine, jobs, run.concurrency, record_times=True,
                                on_step=on_step)
        results.append(load_result(stats, jobs))
        print(f"  in-process {run.label}: {stats.tokens_per_s:,.0f} tok/s", flush=True)
        if spec.get("log_compiles"):  # what could hold up one request of this run
            results[-1]["compiles"] = compiles.events
            results[-1]["gc_pauses"] = gcs.summary()
            for name, ms, step in compiles.events:
                print(f"    triton specialized {name} at step {step}: {ms:.0f} ms", flush=True)
            for gen, (n, total, most) in gcs.summary().items():
                if n:
                    print(f"    gc generation {gen}: {n} collections, {total:.0f} ms, the "
                          f"longest {most:.1f} ms", flush=True)
        if steps is not None:  # where the peak's steps spent their time (host or GPU)
            steps.close()
            cgr = engine.runner.cuda_graph_runner
            table(f"In-process peak by kind of step ({stats.wall_s:.1f} s)", StepLog.HEADER,
                  steps.table_rows(cgr.max_bs if cgr else 0, stats.wall_s))
    engine.shutdown()
    return {"hardware": hardware(), "kv_tokens": engine.max_total_tokens, "results": results}


def own_client_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """`serving_client.stream_load` against the server (record_times: each request's send and
    each response's arrival on tritonclient's stream thread), in `spec["procs"]` processes
    (`client_procs_load`)."""
    from serving_client import ProcTree

    requests = json.loads(Path(spec["requests"]).read_text())
    server = ProcTree(spec["server_pid"])
    results = []
    for run in (Run(**r) for r in spec["runs"]):
        jobs = run_jobs(requests, run)
        server_cpu, ttft0 = server.cpu_s(), stub_ttft(spec["metrics_url"])
        stats, procs = client_procs_load(spec, jobs, run.concurrency)
        results.append({**load_result(stats, jobs), "server_cpu_s": server.cpu_s() - server_cpu,
                        "client_procs": procs, "stub_ttft_mean_ms": stub_ttft_mean_ms(
                            ttft0, stub_ttft(spec["metrics_url"]))})
        print(f"  own client {run.label}: {stats.tokens_per_s:,.0f} tok/s ({procs} "
              f"process{'es' * (procs > 1)})", flush=True)
    return {"results": results}


def client_procs_load(spec: dict[str, Any], jobs: list, concurrency: int) -> tuple[Any, int]:
    """One closed-loop load of `jobs` shared by P = min(spec["procs"], concurrency) client
    processes (a Python gRPC client's GIL caps what one process receives): the concurrency is
    shared out, all start together (a barrier), and whichever process frees a slot sends the
    next job of the list (one shared counter), as one client's closed loop would; their results
    merge into one `LoadStats` under the jobs' own indices (perf_counter_ns is CLOCK_MONOTONIC:
    one clock for every process; CPU: the sum). Returns (stats, P)."""
    from serving_client import LoadStats, stream_load

    procs = max(1, min(int(spec.get("procs", 1)), concurrency, len(jobs)))
    if procs == 1:
        return stream_load(spec["url"], spec["model"], jobs, concurrency,
                           timeout_s=spec["timeout_s"], record_times=True), 1
    ctx = mp.get_context("spawn")
    barrier, results, counter = ctx.Barrier(procs), ctx.Queue(), ctx.Value("i", 0)
    children = [ctx.Process(target=_client_part, daemon=True, args=(
        spec["url"], spec["model"], jobs,
        concurrency // procs + (k < concurrency % procs), spec["timeout_s"], barrier, results,
        counter)) for k in range(procs)]
    for child in children:
        child.start()
    stats = LoadStats()
    for _ in children:
        part = results.get(timeout=spec["timeout_s"] + 120)
        stats.times.update(part.times)
        for name in ("requests", "output_tokens", "short", "responses", "cpu_s"):
            setattr(stats, name, getattr(stats, name) + getattr(part, name))
        stats.errors += part.errors
        stats.latency_s += part.latency_s
        stats.wall_s = max(stats.wall_s, part.wall_s)
    for child in children:
        child.join()
    return stats, procs


def _client_part(url: str, model: str, jobs: list, concurrency: int, timeout_s: float,
                 barrier: Any, results: Any, counter: Any) -> None:
    """A client process of `client_procs_load`: the jobs it takes from the shared `counter`,
    then its LoadStats on `results`."""
    from serving_client import stream_load

    def take() -> int | None:
        with counter.get_lock():
            i = counter.value
            if i >= len(jobs):
                return None
            counter.value = i + 1
        return i

    results.put(stream_load(url, model, jobs, concurrency, timeout_s=timeout_s,
                            record_times=True, before_start=barrier.wait, take=take))


WORKERS = {IN_PROCESS: in_process_worker, "own_client": own_client_worker}


def run_worker(kind: str, spec: dict[str, Any], workdir: Path, timeout_s: float
               ) -> dict[str, Any]:
    """Run `WORKERS[kind](spec)` in a child process (this script with --worker)."""
    spec_path, out_path = workdir / f"{kind}-spec.json", workdir / f"{kind}-out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    subprocess.run([sys.executable, __file__, "--worker", kind, str(spec_path), str(out_path)],
                   check=True, timeout=timeout_s)
    return json.loads(out_path.read_text())


# -------------------------------------------------------------------------------- perf_analyzer
def perf_input(requests: list[list], run: Run) -> dict[str, Any]:
    """perf_analyzer's --input-data JSON for `run`: one entry per request."""
    return {"data": [{
        "input_ids": {"content": prompt, "shape": [len(prompt)]},
        "stream": [True], "exclude_input_in_output": [True], "return_num_output_tokens": [True],
        "sampling_parameters": [json.dumps(sampling(run.max_tokens or out))],
    } for prompt, out in requests[:run.count]]}


def _uint32(text: str) -> int:
    """A UINT32 [1] output as perf_analyzer 2.48 exports it: its 4 raw bytes as a JSON string
    (bytes >= 0x80 unescaped, hence read with surrogateescape); "" when absent."""
    raw = text.encode("utf-8", "surrogateescape")
    if raw and len(raw) != 4:
        raise ValueError(f"num_output_tokens: expected 4 bytes, got {raw!r}")
    return int.from_bytes(raw, "little")


def read_profile(path: Path) -> tuple[Trace, dict[str, int]]:
    """A perf_analyzer profile export (one experiment) as a Trace and the tokens each request
    asked for (from its own sampling_parameters)."""
    doc = json.loads(path.read_bytes().decode("utf-8", "surrogateescape"))
    (experiment,) = doc["experiments"]
    trace, asked = Trace(), {}
    for i, req in enumerate(experiment["requests"]):
        rid = str(i)
        asked[rid] = int(json.loads(req["request_inputs"]["sampling_parameters"])["max_tokens"])
        trace.sent[rid] = req["timestamp"] / 1e9
        for ts, out in zip(req["response_timestamps"], req["response_outputs"]):
            n = _uint32(out.get("num_output_tokens", ""))
            if n:
                trace.arrivals[rid].append((ts / 1e9, n))
    return trace, asked


def perf_analyzer_run(binary: str, url: str, requests: list[list], run: Run, workdir: Path,
                      server, timeout_s: float) -> dict[str, Any]:
    """perf_analyzer over gRPC streaming: `run.count` requests, `run.concurrency` in flight."""
    from mla_tools.tritonserver import perf_analyzer_env

    data, export = workdir / "perf_input.json", workdir / "perf_profile.json"
    data.write_text(json.dumps(perf_input(requests, run)))
    export.unlink(missing_ok=True)
    argv = [binary, "-m", MODEL_NAME, "-u", url, "-i", "grpc", "--async", "--streaming",
            "--input-data", str(data), "--concurrency-range", str(run.concurrency),
            "--request-count", str(run.count), "--stability-percentage", "999",
            "--profile-export-file", str(export)]
    log = workdir / f"perf_analyzer-{run.label.replace('=', '')}.log"
    cpu0, server_cpu = resource.getrusage(resource.RUSAGE_CHILDREN), server.cpu_s()
    with open(log, "w") as f:
        f.write(shlex.join(argv) + "\n")
        f.flush()
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT,
                              env=perf_analyzer_env(), timeout=timeout_s)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    errors = [] if proc.returncode == 0 else [f"perf_analyzer exited with {proc.returncode}, "
                                              f"log {log}"]
    if not export.exists():
        raise RuntimeError(f"perf_analyzer wrote no profile export; log {log}:\n"
                           + log.read_text()[-3000:])
    trace, asked = read_profile(export)
    export.unlink()
    result = trace_result(trace, asked)
    expected = sum(run.max_tokens or out for _, out in requests[:run.count])
    if result["requests"] != run.count or result["expected_tokens"] != expected:
        errors.append(f"perf_analyzer sent {result['requests']} requests asking for "
                      f"{result['expected_tokens']} tokens, not {run.count} asking for {expected}")
    result.update(errors=errors, server_cpu_s=server.cpu_s() - server_cpu,
                  client_cpu_s=(cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime))
    return result


def find_perf_analyzer(given: str | None) -> str:
    for candidate in (given, shutil.which("perf_analyzer"),
                      str(Path(sys.executable).parent / "perf_analyzer")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("perf_analyzer not found (--perf-analyzer PATH, or put it on PATH)")


# ----------------------------------------------------------------------------------- genai-perf
GENAI_PERF_METRICS = {"ttft": "time_to_first_token", "itl": "inter_token_latency",
                      "e2e": "request_latency"}


def genai_perf_argv(command: list[str], url: str, requests: list[list], run: Run,
                    tokenizer: str, artifacts: Path, seed: int) -> list[str]:
    """`genai-perf profile` for `run` (KServe gRPC streaming, vLLM-backend inputs). Its prompts
    and output lengths are its own, drawn from normal distributions with the mean of the run's
    requests and their standard deviation capped at a third of the mean (genai-perf sends the
    empty prompt it draws below 1 token, which the server refuses), with min_tokens = max_tokens.
    genai-perf 0.0.16 has no per-request output length for this backend: its payload input sends
    `max_tokens` as a model input, which the vLLM contract does not have."""
    import numpy as np

    def mean_std(values: list[int]) -> tuple[str, str]:
        mean = float(np.mean(values))
        return str(round(mean)), str(round(min(float(np.std(values)), mean / 3)))

    ins = mean_std([len(p) for p, _ in requests[:run.count]])
    outs = mean_std([run.max_tokens or o for _, o in requests[:run.count]])
    return [*command, "profile", "-m", MODEL_NAME, "--endpoint-type", "kserve",
            "--backend", "vllm", "--streaming", "-u", url,
            "--num-prompts", str(run.count), "--request-count", str(run.count),
            "--concurrency", str(run.concurrency),
            "--synthetic-input-tokens-mean", ins[0], "--synthetic-input-tokens-stddev", ins[1],
            "--output-tokens-mean", outs[0], "--output-tokens-stddev", outs[1],
            "--output-tokens-mean-deterministic",
            "--tokenizer", tokenizer, "--random-seed", str(seed),
            "--artifact-dir", str(artifacts)]


def read_genai_perf(artifacts: Path) -> dict[str, Any]:
    """genai-perf's own figures (its profile_export_genai_perf.json) as a summarized result:
    requests, output tokens (genai-perf counts them by tokenizing each request's text) and
    the tokens asked (its inputs.json), output tok/s and its duration (s), TTFT mean and TTFT /
    ITL / end-to-end p50 and p99 (ms)."""
    (summary,) = artifacts.glob("*/profile_export_genai_perf.json")
    (inputs,) = artifacts.glob("*/inputs.json")
    doc = json.loads(summary.read_text())
    asked = [int(json.loads(d["sampling_parameters"][0])["max_tokens"])
             for d in json.loads(inputs.read_text())["data"]]
    requests = round(doc["request_count"]["avg"])
    out = {"requests": requests, "expected_tokens": sum(asked),
           "output_tokens": round(doc["output_sequence_length"]["avg"] * requests),
           "tok_s": doc["output_token_throughput"]["avg"],
           "ttft_mean_ms": doc["time_to_first_token"]["avg"]}
    out["span_s"] = out["output_tokens"] / out["tok_s"]  # genai-perf's duration
    for name, key in GENAI_PERF_METRICS.items():
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = doc[key][f"p{q}"]
    return out


def genai_perf_run(command: list[str], perf_analyzer: str, url: str, requests: list[list],
                   run: Run, workdir: Path, server, tokenizer: str, seed: int,
                   timeout_s: float) -> dict[str, Any]:
    """One `genai_perf_argv` run (the `perf_analyzer` binary's folder first on PATH, where
    genai-perf looks for it), read by `read_genai_perf`, with the CPU time of genai-perf and its
    perf_analyzer and the server's."""
    from mla_tools.tritonserver import perf_analyzer_env

    artifacts = workdir / f"genai_perf-{run.label.replace('=', '')}"
    shutil.rmtree(artifacts, ignore_errors=True)
    argv = genai_perf_argv(command, url, requests, run, tokenizer, artifacts, seed)
    env = perf_analyzer_env()
    env["PATH"] = os.pathsep.join([str(Path(perf_analyzer).parent), env["PATH"]])
    log = workdir / f"{artifacts.name}.log"
    cpu0, server_cpu = resource.getrusage(resource.RUSAGE_CHILDREN), server.cpu_s()
    with open(log, "w") as f:
        f.write(shlex.join(argv) + "\n")
        f.flush()
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout_s)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"genai-perf exited with {proc.returncode}; log {log}:\n"
                           + log.read_text()[-3000:])
    result = read_genai_perf(artifacts)
    errors = [] if result["requests"] == run.count else [
        f"genai-perf measured {result['requests']} requests, not {run.count}"]
    # wrong_count None: genai-perf reports no per-request token counts to check
    result.update(errors=errors, wrong_count=None, server_cpu_s=server.cpu_s() - server_cpu,
                  client_cpu_s=(cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime))
    return result


def find_genai_perf(given: str | None) -> list[str]:
    """The genai-perf command: --genai-perf (a command line, e.g. "python3 -m genai_perf.main"),
    else genai-perf on PATH, else the one `./build.sh setup` installs in .venv-genai-perf."""
    if given:
        return shlex.split(given)
    for candidate in (shutil.which("genai-perf"), str(REPO / ".venv-genai-perf" / "bin" /
                                                      "genai-perf")):
        if candidate and os.access(candidate, os.X_OK):
            return [candidate]
    raise SystemExit("genai-perf not found (--genai-perf COMMAND, or ./build.sh setup)")


# ----------------------------------------------------------------------------- model and server
def model_folder(args, workdir: Path) -> tuple[str, bool]:
    """(HF folder of the model, whether it is a shape with dummy weights)."""
    from mla_tools.model_shapes import SHAPES, write_shape_model

    if args.model in SHAPES:
        if not args.tokenizer_dir:
            raise SystemExit(f"--model {args.model} needs --tokenizer-dir")
        folder = write_shape_model(str(workdir / args.model), args.model, args.tokenizer_dir,
                                   **json.loads(args.shape_overrides))
        return folder, True
    from mla_tools.prepare import DEFAULT_MODEL_REPOSITORY, prepare, weights_dir

    prepare(DEFAULT_MODEL_REPOSITORY, models=[args.model])
    folder = weights_dir(DEFAULT_MODEL_REPOSITORY, args.model)
    if not folder.is_dir():
        raise SystemExit(f"--model {args.model}: no {folder} (a model of model_repository/ or "
                         f"one of {', '.join(SHAPES)})")
    return str(folder), False


def engine_settings(args, folder: str, dummy: bool) -> dict[str, str]:
    """config.pbtxt parameters of the served model (the in-process engine reads them back)."""
    return {"model_path": folder, "load_format": "dummy" if dummy else "auto",
            "dtype": args.dtype, "device": args.device, "tensor_parallel_size": "1",
            "context_length": str(args.context_length),
            "max_total_tokens": args.max_total_tokens,
            "max_running_requests": str(args.max_running), "enable_radix_cache": "false",
            "chunked_prefill_size": str(args.chunked_prefill_size),
            "max_prefill_tokens": str(args.max_prefill_tokens),
            "cuda_graph_max_bs": str(args.graph_max_bs),
            "prefill_min_free_rows": str(args.prefill_min_free_rows),
            "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
            "overlap_schedule": args.overlap_schedule,
            "extend_as_decode": args.extend_as_decode, "STREAM_INTERVAL": "1",
            # the adapter's default (the model folder's copy sets "true"): per-token metric IPC
            # costs peak throughput; --server-param REPORT_CUSTOM_METRICS=true measures it
            "REPORT_CUSTOM_METRICS": "false",
            "INTRA_OP_THREAD_COUNT": str(args.intra_op_threads or "auto")}


def write_repository(root: Path, settings: dict[str, str], device: str) -> Path:
    """A new model repository with MODEL_NAME: the deepseek-v2-tiny folder's config.pbtxt and
    model.py with `settings` (`serving_helpers.write_model`, which also copies deepseek-v2-tiny's
    weights from the checkout's checkpoints/ when missing, whatever `model_path` serves);
    returns its config.pbtxt."""
    from serving_helpers import write_model

    kind = "KIND_CPU" if device == "cpu" else "KIND_MODEL"
    shutil.rmtree(root, ignore_errors=True)
    write_model(root, MODEL_NAME, {}, extra_params=settings, kind=kind)
    return root / MODEL_NAME / "config.pbtxt"


# ------------------------------------------------------------------------------------- reports
def check(side: str, run: Run, result: dict[str, Any]) -> None:
    """Stop on errors or on a request that got another token count than it asked for (where
    the side can tell: genai-perf's wrong_count is None)."""
    if result["errors"] or result["wrong_count"] or result["requests"] != run.count:
        raise SystemExit(f"{side} {run.label}: {result['requests']} requests, "
                         f"{result['wrong_count']} with a wrong token count, errors: "
                         f"{result['errors'][:3]}")


def cpu_per_1k(result: dict[str, Any], key: str) -> float | str:
    value = result.get(key)
    return 1000 * value / result["output_tokens"] if value is not None else ""


def report(args, sides: dict[str, dict[str, dict]], show: bool
           ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The peak (JSON keys) and the sweep rows of what has been measured so far; with `show`,
    print the tables and the targets."""
    from bench_suite import table

    def emit(title: str, header: list[str], rows: list[list]) -> None:
        if show and rows:
            table(title, header, rows)

    base = sides.get(IN_PROCESS, {})

    def vs_base(r: dict, label: str) -> float | str:
        return r["tok_s"] / base[label]["tok_s"] if label in base else ""

    cpu_headers = ["load CPU s / 1k tok (in_process: the engine)", "server CPU s / 1k tok"]
    emit(f"Peak: {args.num_requests:,} requests at once, {args.model}",
         ["side", "requests", "output tokens", "seconds", "output tok/s", "/ in-process",
          "TTFT p50 ms"] + cpu_headers,
         [[side, r["requests"], r["output_tokens"], r["span_s"], r["tok_s"], vs_base(r, "peak"),
           r["ttft_p50_ms"], cpu_per_1k(r, "client_cpu_s"), cpu_per_1k(r, "server_cpu_s")]
          for side, runs in sides.items() if (r := runs.get("peak"))])
    peak = None
    if "peak" in base:
        server = sides.get(args.clients[0], {}).get("peak") if args.clients else None
        tok_s = base["peak"]["tok_s"]
        peak = {"in_process_tok_s": tok_s, "server_tok_s": server["tok_s"] if server else None,
                "ratio": server["tok_s"] / tok_s if server else None}
    sweep, rows = [], []
    for c in args.concurrency:
        label = f"c={c}"
        for side, runs in sides.items():
            if not (r := runs.get(label)):
                continue
            sweep.append({"concurrency": c, "side": side, "tok_s": r["tok_s"],
                          **{k: r[k] for k in SWEEP_LATENCIES}})
            rows.append([c, side, r["requests"], r["tok_s"], vs_base(r, label)]
                        + [r[k] for k in SWEEP_LATENCIES] + [r["e2e_p50_ms"]]
                        + [cpu_per_1k(r, "client_cpu_s"), cpu_per_1k(r, "server_cpu_s")])
    emit(f"Concurrency sweep, {args.model} (closed loop; a request's ITL is (last - first "
         "token) / (tokens - 1))",
         ["concurrency", "side", "requests", "output tok/s", "/ in-process", "TTFT p50 ms",
          "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "e2e p50 ms"] + cpu_headers, rows)
    rows = []
    for client in (c for c in args.clients if c != "genai_perf"):  # (its own requests)
        runs = sides.get(client, {})
        if "peak" in runs and "peak" in base:
            ratio = runs["peak"]["tok_s"] / base["peak"]["tok_s"]
            rows.append([client, f"peak >= {TARGETS['peak_ratio']:.0%} of in-process",
                         f"{ratio:.1%}", "yes" if ratio >= TARGETS["peak_ratio"] else "NO"])
        if "c=1" in runs and "c=1" in base:
            s, b = runs["c=1"], base["c=1"]
            ratio = s["itl_p50_ms"] / b["itl_p50_ms"]
            extra = s["ttft_p50_ms"] - b["ttft_p50_ms"]
            rows.append([client, "c=1: ITL p50 within 5% of in-process", f"{ratio:.3f}x",
                         "yes" if ratio <= TARGETS["itl_c1_ratio"] else "NO"])
            rows.append([client, "c=1: TTFT p50 at most 2 ms above in-process",
                         f"{extra:+.2f} ms",
                         "yes" if extra <= TARGETS["ttft_c1_extra_ms"] else "NO"])
            paired = paired_ttft_ms(s, b)
            if paired is not None:  # the same prompts, one at a time, in the same order
                rows.append([client, "c=1: TTFT, median of the per-request differences "
                             "(server - in-process; not a target)", f"{paired:+.2f} ms", ""])
    emit("Targets (issue 41)", ["client", "target", "measured", "met"], rows)
    emit("genai-perf's own requests: prompts and output lengths drawn with the same means and "
         "standard deviations as the other sides' (min_tokens = max_tokens); output tokens as "
         "genai-perf counts them (tokenizing each request's text) against the tokens asked",
         ["run", "requests", "tokens asked", "tokens counted", "counted / asked"],
         [[label, r["requests"], r["expected_tokens"], r["output_tokens"],
           r["output_tokens"] / r["expected_tokens"]]
          for label, r in sides.get("genai_perf", {}).items()])
    emit("Where the server's TTFT goes (means, ms): at the client; in the stub (registration to "
         "the engine's first token, the adapter's TTFT metric); the rest is the request's way "
         "in to the stub and the first token's way out",
         ["run", "side", "client TTFT", "stub TTFT", "way in + out"],
         [[label, side, r["ttft_mean_ms"], r["stub_ttft_mean_ms"],
           r["ttft_mean_ms"] - r["stub_ttft_mean_ms"]]
          for side, runs in sides.items() for label, r in runs.items()
          if r.get("stub_ttft_mean_ms") is not None])
    return peak, sweep


def git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    return "unknown"


def write_json(path: Path, dtype_key: str, head: dict[str, str], peak: dict | None,
               sweep: list[dict], merge: bool) -> dict[str, Any]:
    """The issue's schema. With `merge`, an existing file keeps its other dtype key, its sweep
    rows of other (concurrency, side) pairs and the peak of this key when this run has none; its
    command is kept in front of this one."""
    empty = dict.fromkeys(PEAK_KEYS)
    old: dict[str, Any] = json.loads(path.read_text()) if merge and path.exists() else {}
    doc = {**head, "bf16": old.get("bf16", empty), "fp8": old.get("fp8", empty), "sweep": sweep}
    if old.get("command"):
        commands = old["command"].split(" && ")
        doc["command"] = " && ".join(commands + [head["command"]] * (head["command"]
                                                                    not in commands))
    if peak is not None:
        doc[dtype_key] = peak
    new = {(r["concurrency"], r["side"]) for r in sweep}
    kept = [r for r in old.get("sweep", []) if (r["concurrency"], r["side"]) not in new]
    order = {s: i for i, s in enumerate((IN_PROCESS,) + CLIENTS)}
    doc["sweep"] = sorted(kept + sweep, key=lambda r: (r["concurrency"],
                                                       order.get(r["side"], len(order))))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# ----------------------------------------------------------------------------------------- main
def add_engine_options(ap: argparse.ArgumentParser) -> None:
    """The model, engine, request and run options shared with `bench_ttft_pairs.py`."""
    from mla_tools.model_shapes import SHAPES

    ap.add_argument("--model", default="deepseek-v2-lite",
                    help=f"a model folder of model_repository/ or a shape: {', '.join(SHAPES)}")
    ap.add_argument("--tokenizer-dir", default=os.environ.get("MLA_DEEPSEEK_TOKENIZER_DIR"),
                    help="tokenizer.json folder of a shaped model (default: "
                         "$MLA_DEEPSEEK_TOKENIZER_DIR, set by benchmarks/gpu_env.sh)")
    ap.add_argument("--shape-overrides", default="{}", help="JSON config.json overrides")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="", choices=["", "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--overlap-schedule", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--extend-as-decode", default="auto", choices=["auto", "true", "false"],
                    help="the engine setting extend_as_decode of both sides (auto: small "
                         "prefills as decode rows through the CUDA graphs)")
    ap.add_argument("--intra-op-threads", type=int, default=None,
                    help="torch threads of both engines (default: on a CPU one fewer than the "
                         "cores, as the adapter's auto; on a GPU torch's default)")
    ap.add_argument("--server-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a config.pbtxt parameter of the served model only (an adapter "
                         "setting, e.g. GIL_SWITCH_INTERVAL_MS=0.5); repeatable")
    ap.add_argument("--max-running", type=int, default=2048)
    ap.add_argument("--graph-max-bs", type=int, default=2048)
    ap.add_argument("--prefill-min-free-rows", type=int, default=64)
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--max-total-tokens", default="", help='KV pool tokens ("": from memory)')
    ap.add_argument("--chunked-prefill-size", type=int, default=8192)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--max-output", type=int, default=None, help="cap on output lengths")
    ap.add_argument("--max-prompt", type=int, default=None, help="cap on prompt lengths")
    ap.add_argument("--lengths", default=str(DEFAULT_PATH))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--details", default=None, help="JSON with every number of every run")
    ap.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    ap.add_argument("--workdir", default=None,
                    help="keep the server log, perf_analyzer logs and inputs here")
    ap.add_argument("--startup-timeout", type=float, default=900.0)


def build_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    add_engine_options(ap)
    ap.add_argument("--no-in-process", action="store_true",
                    help="the server's side only (its engine derives its own KV pool unless "
                         "--max-total-tokens): e.g. one setting against another with "
                         "--server-param, each run a server of its own on the same machine")
    ap.add_argument("--num-requests", type=int, default=4000,
                    help="peak: requests submitted at once (0: no peak run)")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 64, 256, 1024],
                    help="sweep levels (none: no sweep)")
    ap.add_argument("--sweep-waves", type=int, default=2,
                    help="requests per level: max(--sweep-min-requests, waves x concurrency)")
    ap.add_argument("--sweep-min-requests", type=int, default=16)
    ap.add_argument("--client-procs", type=int, default=1,
                    help="processes of the own client (each load's jobs shared out among them)")
    ap.add_argument("--clients", nargs="*", default=list(DEFAULT_CLIENTS), choices=CLIENTS,
                    help="server-side load generators; the first one's peak is server_tok_s")
    ap.add_argument("--perf-analyzer", default=None, help="perf_analyzer binary")
    ap.add_argument("--genai-perf", default=None,
                    help='genai-perf command line (default: genai-perf on PATH, else '
                         '.venv-genai-perf/bin/genai-perf), e.g. "python3 -m genai_perf.main"')
    ap.add_argument("--json", default=None,
                    help=f"results (issue schema); default {DEFAULT_JSON_GPU.relative_to(REPO)} "
                         "with --device cuda")
    ap.add_argument("--merge", action="store_true",
                    help="update --json's file: its other dtype key and its sweep rows of other "
                         "(concurrency, side) pairs stay")
    ap.add_argument("--log-compiles", action="store_true",
                    help="in-process: print (and keep in --details) per run the triton kernels "
                         "specialized after the engine loaded (bench_profile.CompileLog: a "
                         "compile or an on-disk cache read, with the step it came in) and the "
                         "garbage collections (bench_profile.GcPauses)")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="per client call (s)")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser("tritonserver (perf_analyzer, our client) vs the in-process engine: peak "
                      "throughput and a concurrency sweep")
    args = ap.parse_args(argv)
    if not args.num_requests and not args.concurrency:
        ap.error("nothing to run: give --num-requests > 0 or --concurrency levels")
    if args.no_in_process and not args.clients:
        ap.error("--no-in-process leaves nothing to run without --clients")
    bad = [p for p in args.server_param if "=" not in p]
    if bad:
        ap.error(f"--server-param wants KEY=VALUE, got {bad[0]!r}")
    if args.json is None and args.device == "cuda":
        args.json = str(DEFAULT_JSON_GPU)
    if args.intra_op_threads is None and args.device == "cpu":
        args.intra_op_threads = max(1, len(os.sched_getaffinity(0)) - 1)
    return args


def make_requests(args, folder: str, count: int) -> list[list]:
    """[prompt token ids, output length] of the first `count` ShareGPT pairs (with `--seed`),
    capped by --max-prompt / --max-output; random ids as bench_suite draws them."""
    import torch
    from bench_suite import random_prompt

    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed)
    out = []
    for p, o in load_length_pairs(args.lengths, count, seed=args.seed):
        p, o = min(p, args.max_prompt or p), min(o, args.max_output or o)
        out.append([random_prompt(gen, p, vocab), o])
    return out


def write_outputs(args, raw: dict[str, dict[str, dict]], head: dict[str, str],
                  settings: dict[str, str], final: bool) -> None:
    """Summaries of the runs measured so far into --json / --details (rewritten after every
    phase, so that a run cut short keeps what it measured); `final` also prints the tables."""
    sides = {side: {label: {**r, **(summarize(r) if "per_request" in r else {})}
                    for label, r in runs.items()} for side, runs in raw.items() if runs}
    peak, sweep = report(args, sides, show=final)
    dtype_key = "fp8" if (args.quantization, args.kv_cache_dtype) == ("fp8", "fp8_e4m3") \
        else "bf16"
    if args.json:
        doc = write_json(Path(args.json), dtype_key, head, peak, sweep, args.merge)
        if final:
            print(f"\n{args.json}:\n{json.dumps(doc, indent=1)}")
    if args.details:
        for runs in sides.values():
            for label, r in runs.items():
                per = r.pop("per_request", None)
                if label == "c=1" and per:  # each request's TTFT (ms), in the order sent
                    r["ttft_ms"] = [round(x[0] * 1e3, 2) for x in per]
        Path(args.details).write_text(json.dumps(
            {**head, "dtype_key": dtype_key, "args": vars(args), "engine_settings": settings,
             "sides": sides}, indent=1))


def engine_loop_times(server_log: Path) -> dict[str, float] | None:
    """The server's engine process over its whole run, from the adapter's unload line in
    `server_log` (`engine.LoopTimes`): steps and ms per step in `Engine.step`, in sending the
    outputs to the stub (a send blocks while the stub lags) and in taking requests; outputs per
    step and seconds idle (no work) where the line has them. None when the log has no such
    line."""
    found = None
    if server_log.is_file():
        for line in server_log.read_text(errors="replace").splitlines():
            if "unloaded; engine stats" in line and "loop_steps=" in line:
                found = dict(re.findall(r"(loop_\w+)=(\d+)", line))
    if not found or not int(found["loop_steps"]):
        return None
    steps = int(found["loop_steps"])
    loop = {"steps": steps, **{f"{k}_ms_per_step": int(found[f"loop_{k}_ms"]) / steps
                               for k in ("step", "send", "inbox")}}
    if "loop_outputs" in found:
        loop["outputs_per_step"] = int(found["loop_outputs"]) / steps
        loop["idle_s"] = int(found["loop_idle_ms"]) / 1e3
    return loop


def server_groups(runs: list[Run]) -> list[list[Run]]:
    """`runs` cut after each measured run: one own-client call per group (a measured run with
    the warm-ups before it)."""
    groups: list[list[Run]] = [[]]
    for run in runs:
        groups[-1].append(run)
        if run.measured:
            groups.append([])
    return [g for g in groups if g]


def _exit_on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    # A SIGTERM (`timeout`) unwinds the stack below, so the server (a session of its own) stops
    # with the benchmark instead of holding the GPU's memory for the next one.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    from bench_suite import log

    from mla_tools.tritonserver import TritonServer

    runs = plan(args.num_requests, args.concurrency, args.sweep_waves, args.sweep_min_requests)
    binary = (find_perf_analyzer(args.perf_analyzer)
              if {"perf_analyzer", "genai_perf"} & set(args.clients) else "")
    genai = find_genai_perf(args.genai_perf) if "genai_perf" in args.clients else []
    head = {"date": time.strftime("%Y-%m-%d"), "commit": args.commit or git_commit(),
            "hardware": "", "command": "python3 benchmarks/bench_server_path.py "
            + shlex.join(argv)}
    raw: dict[str, dict[str, dict]] = {side: {} for side in (IN_PROCESS, *args.clients)}
    loop: dict[str, float] = {}  # the server's engine loop (`engine_loop_times`)
    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_server_path_")))
        workdir.mkdir(parents=True, exist_ok=True)
        # after the server has stopped (it logs its engine's loop times at unload)
        stack.callback(lambda: loop.update(engine_loop_times(workdir / "server.log") or {}))
        folder, dummy = model_folder(args, workdir)
        requests = make_requests(args, folder, max(r.count for r in runs))
        requests_path = workdir / "requests.json"
        requests_path.write_text(json.dumps(requests))
        settings = engine_settings(args, folder, dummy)
        config = write_repository(workdir / "repository", settings, args.device)
        log(f"{len(requests):,} requests ({sum(o for _, o in requests):,} output tokens); runs: "
            f"{', '.join(r.label for r in runs)}; engine settings (both sides): "
            f"{pbtxt_parameters(config)}")
        spec = {"requests": str(requests_path)}

        pool_given = bool(settings["max_total_tokens"])
        if not args.no_in_process:
            log("in-process engine (a child process)")
            got = run_worker(IN_PROCESS, {**spec, "config": str(config),
                                          "log_compiles": args.log_compiles,
                                          "runs": [dataclasses.asdict(r) for r in runs]},
                             workdir, args.startup_timeout + args.run_timeout * len(runs))
            head["hardware"] = got["hardware"]
            if not pool_given:  # the server's pool: the size this engine derived
                settings["max_total_tokens"] = str(got["kv_tokens"])
                log(f"KV pool of both engines: {got['kv_tokens']:,} tokens")
            for run, result in zip(runs, got["results"]):
                check(IN_PROCESS, run, result)
                if run.measured:
                    raw[IN_PROCESS][run.label] = result
        extra = dict(p.split("=", 1) for p in args.server_param)  # the server's alone
        if extra:
            log(f"the server's own parameters: {extra}")
        if extra or settings["max_total_tokens"] and not pool_given:
            write_repository(workdir / "repository", {**settings, **extra}, args.device)
        write_outputs(args, raw, head, settings, final=False)
        if not args.clients:
            runs = []
        else:
            log("tritonserver")
            server = stack.enter_context(TritonServer(
                workdir / "repository", startup_timeout=args.startup_timeout,
                log_path=workdir / "server.log"))
            from serving_client import ProcTree

            tree = ProcTree(server.proc.pid)
            log(f"server ready at {server.grpc_url}, log {server.log_path}")
        for group in server_groups(runs):
            # the own client warms the server up before each measured run, and measures it
            own = [r for r in group if not r.measured or "own_client" in args.clients]
            got = run_worker("own_client", {
                **spec, "url": server.grpc_url, "model": MODEL_NAME, "procs": args.client_procs,
                "metrics_url": server.metrics_url,
                "server_pid": server.proc.pid, "timeout_s": args.run_timeout,
                "runs": [dataclasses.asdict(r) for r in own]}, workdir, args.run_timeout)
            for run, result in zip(own, got["results"]):
                check("own_client", run, result)
                if run.measured:
                    raw["own_client"][run.label] = result
            for run in group:
                if run.measured and "perf_analyzer" in args.clients:
                    ttft0 = stub_ttft(server.metrics_url)
                    result = perf_analyzer_run(binary, server.grpc_url, requests, run,
                                               workdir, tree, args.run_timeout)
                    result["stub_ttft_mean_ms"] = stub_ttft_mean_ms(
                        ttft0, stub_ttft(server.metrics_url))
                    check("perf_analyzer", run, result)
                    raw["perf_analyzer"][run.label] = result
                    log(f"  perf_analyzer {run.label}: "
                        f"{result['output_tokens'] / result['span_s']:,.0f} tok/s")
                if run.measured and "genai_perf" in args.clients:
                    ttft0 = stub_ttft(server.metrics_url)
                    result = genai_perf_run(genai, binary, server.grpc_url, requests, run,
                                            workdir, tree, folder, args.seed, args.run_timeout)
                    result["stub_ttft_mean_ms"] = stub_ttft_mean_ms(
                        ttft0, stub_ttft(server.metrics_url))
                    check("genai_perf", run, result)
                    raw["genai_perf"][run.label] = result
                    log(f"  genai-perf {run.label}: {result['tok_s']:,.0f} tok/s")
            server.check_alive()
            write_outputs(args, raw, head, settings, final=False)
    if args.no_in_process:
        head["hardware"] = hardware()  # (not before: torch would take GPU memory from the server)
    if loop:
        log(f"server's engine process, whole run: {loop['steps']:,} steps; per step "
            f"{loop['step_ms_per_step']:.2f} ms in Engine.step, {loop['send_ms_per_step']:.2f} "
            f"ms sending outputs, {loop['inbox_ms_per_step']:.2f} ms taking requests"
            + (f", {loop['outputs_per_step']:.0f} outputs; {loop['idle_s']:.1f} s idle"
               if "idle_s" in loop else ""))
    write_outputs(args, raw, head, settings, final=True)
    if loop and args.details:
        details = json.loads(Path(args.details).read_text())
        Path(args.details).write_text(json.dumps({**details, "server_engine_loop": loop},
                                                 indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        kind, spec_file, out_file = sys.argv[2:5]
        result = WORKERS[kind](json.loads(Path(spec_file).read_text()))
        Path(out_file).write_text(json.dumps(result))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
