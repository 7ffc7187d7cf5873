"""Where the GPU time goes (issues 4 and 6): a kernel-level profile of decode steps and a
step-level log of a peak-throughput run, for the same random-weight model shapes as
`bench_suite.py` (whose engine and request helpers this script reuses).

Sections (`--sections`):
- kernels: for each `--bs`, `--steps` decode steps of `--bs` requests (prompt `--prompt`
  tokens) under `torch.profiler` with CUDA activity, CUDA graphs on (the kernels inside graph
  replays are recorded by CUPTI; if none are, the engine is rebuilt eager). Prints, per decode
  step: wall time, summed kernel time, kernel count, then time by category (MoE, attention,
  GEMM, quantization, norms/rotary, elementwise, ...) and the top kernels by time. Programmatic
  dependent launch (mla_kernels/pdl.py) is off here unless `--pdl`: under PDL a kernel's programs
  start early and wait at `griddepcontrol.wait`, and CUPTI counts that wait in its duration
  (at bs 1 the kernel time summed to more than the step's wall time), so the durations only mean
  something without it; the step wall time printed is then the PDL-off step.
- prefill: the kernels of an eager prefill of `--prefill-requests` x `--prompt` tokens (in
  chunks of `--prefill-chunk` tokens if given: the later chunks then extend a cached prefix),
  then a cProfile (host side, Python functions by own and cumulative time) of a small prefill
  (`--small-prefill REQUESTS TOKENS`, default 4 x 94: the common case under load).
- ttft: the time to first token of one request alone (random prompt, one greedy output token,
  radix cache off) for each of `--ttft-lengths`, with prefill steps eager (`extend_as_decode`
  false) and as decode rows through the graphs (`auto`; on a CPU `true`: eager decode rows),
  the two alternating prompt by prompt (each first in turn) `--ttft-reps` times on one engine
  (graphs to `--graph-max-bs`: a length above it stays eager on both sides). Prints per
  length both TTFT p50s, their ratio, how many runs took the decode-row path, and how many
  gave both modes the same first token.
- steps: `--num-requests` ShareGPT requests all at once (radix off, as bench_suite's throughput
  section), every step logged (mode, batch size, tokens, wall seconds), after a warm-up that also
  runs an extend with a cached prefix where the context allows it (so that the kernels compiled at
  first use are not timed in the run). Prints the time share (mean and longest step) of prefill
  steps and of decode steps by batch-size range (graph replay or eager) with the mean time each kind
  of step waited for the GPU (near 0: the host set the pace), mean decode batch, and the output
  tok/s of the run, and the run's garbage collections (count, total and longest pause per
  generation; `--gc-unfreeze` undoes the engine's start-up `gc.freeze` first, to see what it saves;
  `--gc-threshold G0 G1 G2` sets the collector's thresholds), and the triton JIT compiles inside the
  timed run (kernel, ms, step: a compile there is a first-use cost the warm-up missed).
  `--graph-max-bs`, `--max-running` and `--prefill-min-free-rows` set the engine's graph limit,
  request rows and the scheduler's `prefill_min_free_rows` (`--prefill-chunk`: its
  `chunked_prefill_size`). `--window START COUNT` also profiles steps START .. START+COUNT-1 of the
  run (torch.profiler for the GPU's kernel time, cProfile for the host's Python functions): the
  GPU's busy share of those steps' wall time, their kernel time by category, the top host
  functions and the host's time inside each kind of CUDA runtime / driver call (a call that
  waits for the device shows there), and the CUDA caching allocator's retries, device
  allocations and frees in the window (each waits for the device; the same counts are printed
  for the whole timed run). `--prefill-host N` cProfiles the host side of the run's
  first N prefill steps after its eighth (functions by own and cumulative time, ms per step).

`--quantization fp8 --kv-cache-dtype fp8_e4m3` profiles the FP8 engine (issue 6);
`--fp8-fast-accum true|false` sets `layers.quantization.FP8_FAST_ACCUM` for the run.
`--detokenize process` processes every step's outputs (text) in a child process instead of the
stepping loop (`bench_suite.DetokenizerProcess`; the step's wall time includes pickling and
sending them), which is how the engine process and the stub's front door run.

    PYTHONPATH=. python3 benchmarks/bench_profile.py --model deepseek-v2-lite \
        --tokenizer-dir TOK --sections kernels steps --bs 1 64 --num-requests 800
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_suite as bs_  # noqa: E402
from bench_suite import (StepLog, log, make_engine, random_prompt, release, run_requests,  # noqa: E402
                         run_sections, table, warm_up)
from sharegpt_lengths import DEFAULT_PATH, load_length_pairs  # noqa: E402

from mla_backend.request import SamplingParams  # noqa: E402
from mla_tools.model_shapes import SHAPES, write_shape_model  # noqa: E402

# (category, substrings of the kernel name, lower case); first match wins.
CATEGORIES = [
    ("MoE (fused experts)", ("fused_moe", "_grouped_gemm", "_gemv_gate_up", "_gemv_down",
                             "moe_")),
    ("attention decode", ("_decode_split", "_merge_splits", "decode_att", "_mla_decode_ws")),
    ("attention extend", ("extend",)),
    ("KV store", ("store_kv", "_store")),
    ("FP8 quantize / scaled GEMM", ("fp8", "scaled_mm", "quant", "e4m3", "_amax_partials",
                                    "qqtst")),
    ("GEMM (cuBLAS / cutlass)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90", "bmm",
                                 "splitk", "dot_kernel")),
    ("norm / rotary / activation", ("rmsnorm", "rms_norm", "rotary", "silu", "act_and_mul",
                                    "layer_norm", "norm")),
    ("top-k / routing / sort", ("topk", "sort", "radix", "scan", "argmax", "cumsum")),
    ("reduction", ("reduce",)),
    ("copy / cat / index", ("copy", "cat", "index", "gather", "scatter", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton_poi", "triton_per")),
]


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def _kernel_events(prof, device: str) -> list[tuple[str, float]]:
    """(name, microseconds) of every CUDA kernel / memcpy / memset event in the profile (on a
    CPU device, for a smoke test only: the aten ops)."""
    out = []
    for e in prof.events():
        on_gpu = "CUDA" in str(getattr(e, "device_type", ""))
        if (on_gpu if device == "cuda" else e.name.startswith("aten::")):
            out.append((e.name, float(e.time_range.end - e.time_range.start)))
    return out


def _runtime_calls(prof) -> dict[str, list[float]]:
    """{name: [calls, total µs, longest µs]} of the host-side CUDA runtime and driver API calls
    in the profile (events named cuda* / cu*, as CUPTI reports them: kernel and graph launches,
    copies, event and stream syncs, host allocations): the host's time inside each kind of call.
    A call that waits for the device is a long one; the engine's own wait is its
    `cudaEventSynchronize`. Empty on a CPU device."""
    out: dict[str, list[float]] = {}
    for e in prof.events():
        if "CUDA" in str(getattr(e, "device_type", "")) or not e.name.startswith("cu"):
            continue
        us = float(e.time_range.end - e.time_range.start)
        row = out.setdefault(e.name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += us
        row[2] = max(row[2], us)
    return out


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free",
                    "num_sync_all_streams", "num_ooms")


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's event counters (`torch.cuda.memory_stats`): retries after a
    failed allocation (each frees cached blocks, which waits for the device), device
    allocations and frees (cudaMalloc / cudaFree; a free waits too), syncs of all streams. {}
    without CUDA."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def allocator_delta(before: dict[str, int]) -> dict[str, int]:
    """`allocator_counts()` now less `before` ({} without CUDA)."""
    return {k: v - before.get(k, 0) for k, v in allocator_counts().items()}


def log_allocator(what: str, counts: dict[str, int]) -> None:
    """One log line of `allocator_delta` counts (nothing without CUDA)."""
    if counts:
        log(f"{what}: CUDA caching allocator: "
            + ", ".join(f"{k[4:]} {v}" for k, v in counts.items()))


def profile_decode(eng, bs: int, prompt: int, steps: int, vocab: int) -> dict:
    """Profile `steps` full-batch decode steps of `bs` requests. Returns per-step numbers."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(bs)
    prompts = [random_prompt(gen, prompt, vocab) for _ in range(bs)]
    walls: list[float] = []
    state = {"prof": None, "n": 0}

    def on_step(dt: float, outs: list) -> None:
        full = len(outs) == bs and all(len(o.new_token_ids) == 1 for o in outs)
        if not full:
            return
        state["n"] += 1
        if state["n"] == 2:  # start after one full decode step (past the last prefill)
            bs_.sync()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bs_.DEVICE == "cuda"
                                             else [])
            state["prof"] = profile(activities=acts)
            state["prof"].__enter__()
        elif 2 < state["n"] <= 2 + steps:
            walls.append(dt)
            if state["n"] == 2 + steps:
                bs_.sync()
                state["prof"].__exit__(None, None, None)

    run_requests(eng, prompts, [steps + 8] * bs, on_step)
    prof = state["prof"]
    if prof is None or len(walls) < steps:
        raise RuntimeError(f"bs {bs}: only {len(walls)} full decode steps profiled")
    evs = _kernel_events(prof, bs_.DEVICE)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in evs:
        by_name[name][0] += 1
        by_name[name][1] += us
    return {"bs": bs, "steps": steps, "wall_ms": 1000 * sum(walls) / steps,
            "kernel_ms": sum(us for _, us in evs) / 1000 / steps,
            "kernels_per_step": len(evs) / steps,
            "by_name": {k: [v[0] / steps, v[1] / 1000 / steps] for k, v in by_name.items()}}


HOST_COLUMNS = ["function", "calls", "own ms/step", "cumulative ms/step"]


def host_rows(stats, steps: int, key: str, top: int) -> list[list[Any]]:
    """The `top` functions of a pstats.Stats by "own" or "cumulative" time, as HOST_COLUMNS rows
    (milliseconds per step over `steps` steps)."""
    col = {"own": 2, "cumulative": 3}[key]
    funcs = sorted(stats.stats.items(), key=lambda kv: -kv[1][col])[:top]
    return [[f"{os.path.basename(f)}:{line}({name})", v[1], 1000 * v[2] / steps,
             1000 * v[3] / steps] for (f, line, name), v in funcs]


class StepWindow:
    """Profiles steps [start, start + count) of an engine's run: wraps `eng.step` (an instance
    attribute shadowing the method) with torch.profiler (GPU kernels) and cProfile (host)."""

    def __init__(self, eng, start: int, count: int) -> None:
        import cProfile

        self.start, self.count, self.n = start, count, 0
        self.walls: list[float] = []
        self.batches: list[int] = []
        self.prof = None
        self.alloc0: dict[str, int] = {}
        self.alloc: dict[str, int] = {}  # allocator_delta over the window
        self.host = cProfile.Profile()
        inner = eng.step

        def step():
            from torch.profiler import ProfilerActivity, profile

            self.n += 1
            inside = self.start <= self.n < self.start + self.count
            if self.n == self.start:
                bs_.sync()
                self.alloc0 = allocator_counts()
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                                 if bs_.DEVICE == "cuda" else [])
                self.prof = profile(activities=acts)
                self.prof.__enter__()
            if not inside:
                return inner()
            t = time.perf_counter()
            self.host.enable()
            outs = inner()
            self.host.disable()
            self.walls.append(time.perf_counter() - t)
            self.batches.append(len(outs))
            if self.n == self.start + self.count - 1:
                bs_.sync()
                self.prof.__exit__(None, None, None)
                self.alloc = allocator_delta(self.alloc0)
            return outs

        eng.step = step

    def report(self, top: int) -> dict:
        """Print and return: wall ms per step, GPU kernel ms per step, busy share, top host
        functions by own time (ms per step)."""
        import pstats

        if self.prof is None or len(self.walls) < self.count:
            log(f"window: the run had only {self.n} steps")
            return {}
        evs = _kernel_events(self.prof, bs_.DEVICE)
        wall = 1000 * sum(self.walls) / self.count
        kern = sum(us for _, us in evs) / 1000 / self.count
        cats = print_categories(
            f"Steps {self.start}-{self.start + self.count - 1}: GPU kernel ms per step by "
            "category", ((name, us / 1000 / self.count) for name, us in evs), kern)
        rows = host_rows(pstats.Stats(self.host), self.count, "own", top)
        table(f"Steps {self.start}-{self.start + self.count - 1} of the run: {wall:.2f} ms per "
              f"step, GPU kernels {kern:.2f} ms ({100 * kern / wall:.0f}% busy), "
              f"{sum(self.batches) / self.count:.0f} outputs per step; host functions",
              HOST_COLUMNS, rows)
        calls = _runtime_calls(self.prof)
        n = self.count
        table(f"Steps {self.start}-{self.start + n - 1}: CUDA runtime / driver calls, host time",
              ["call", "calls per step", "host ms per step", "longest µs"],
              [[name, c / n, us / 1000 / n, longest] for name, (c, us, longest)
               in sorted(calls.items(), key=lambda kv: -kv[1][1])[:top]]
              or [["none (no CUDA)", 0, 0.0, 0.0]])
        log_allocator(f"Steps {self.start}-{self.start + n - 1}", self.alloc)
        return {"start": self.start, "count": self.count, "wall_ms": wall, "kernel_ms": kern,
                "allocator": self.alloc,
                "categories_ms": cats,
                "outputs_per_step": sum(self.batches) / self.count, "host_top": rows,
                "runtime_calls": {k: {"calls_per_step": v[0] / n, "host_ms_per_step":
                                      v[1] / 1000 / n, "longest_us": v[2]}
                                  for k, v in calls.items()}}


def section_kernels(args, model_dir: str, vocab: int, res: dict) -> None:
    import mla_kernels.pdl as pdl

    out = res.setdefault("kernels", {})
    max_bs = max(args.bs)
    with pdl.override(args.pdl):
        on = pdl.ENABLED
        results, graphs = _profile_kernels(args, model_dir, vocab, max_bs)
    mode = "CUDA graphs" if graphs and bs_.DEVICE == "cuda" else "eager"
    mode += ", PDL" if on else ", PDL off"
    for r in results:
        r["mode"] = mode
        out[str(r["bs"])] = r
        print_kernel_tables(
            f"Decode step, {args.model}{args.tag}, bs {r['bs']}, prompt {args.prompt} ({mode}): "
            f"wall {r['wall_ms']:.2f} ms, kernels {r['kernel_ms']:.2f} ms, "
            f"{r['kernels_per_step']:.0f} kernels/step (per step below)", r, args.top)


def _profile_kernels(args, model_dir: str, vocab: int, max_bs: int) -> tuple[list, bool]:
    """(profile_decode results per --bs, whether they ran as graph replays)."""
    for graphs in (True, False):
        eng = make_engine(model_dir, cuda_graph_max_bs=max_bs, max_running_requests=max_bs,
                          disable_cuda_graph=not graphs)
        run_requests(eng, [[bs_.TOKEN_LO + i for i in range(16)]] * 4, [4] * 4)  # warm-up
        results = [profile_decode(eng, bs, args.prompt, args.steps, vocab) for bs in args.bs]
        del eng
        release()
        if graphs and bs_.DEVICE == "cuda" and all(r["kernels_per_step"] < 10 for r in results):
            log("no kernels recorded inside graph replays: profiling eager instead")
            continue
        break
    return results, graphs


def print_categories(title: str, kernels: Iterable[tuple[str, float]],
                     kernel_ms: float) -> dict[str, float]:
    """Print and return the kernel time by category: kernels are (name, ms) pairs, kernel_ms
    their total (the percentages' base)."""
    cats: dict[str, float] = defaultdict(float)
    for name, ms in kernels:
        cats[category(name)] += ms
    table(title, ["category", "ms", "% of kernel time"],
          [[c, ms, 100 * ms / max(kernel_ms, 1e-9)]
           for c, ms in sorted(cats.items(), key=lambda kv: -kv[1])])
    return dict(cats)


def print_kernel_tables(title: str, r: dict, top: int) -> None:
    r["categories_ms"] = print_categories(
        title, ((name, ms) for name, (_, ms) in r["by_name"].items()), r["kernel_ms"])
    table("Top kernels", ["kernel", "category", "calls", "ms", "us/call"],
          [[name[:90], category(name), n, ms, 1000 * ms / max(n, 1e-9)]
           for name, (n, ms) in sorted(r["by_name"].items(), key=lambda kv: -kv[1][1])[:top]])


def section_prefill(args, model_dir: str, vocab: int, res: dict) -> None:
    """Kernels of the prefill of `--prefill-requests` requests of `--prompt` tokens each (one
    new token each; radix cache off; chunks of `--prefill-chunk` tokens, default the engine's:
    a chunk smaller than the batch makes the steps after the first extends with a cached
    prefix, DeepSeek's absorbed path)."""
    from torch.profiler import ProfilerActivity, profile

    chunk = {} if args.prefill_chunk is None else {"chunked_prefill_size": args.prefill_chunk}
    eng = make_engine(model_dir, enable_radix_cache=False, disable_cuda_graph=True, **chunk)
    gen = torch.Generator().manual_seed(7)
    run_requests(eng, [random_prompt(gen, args.prompt, vocab)] * 2, [1] * 2)  # warm-up
    prompts = [random_prompt(gen, args.prompt, vocab) for _ in range(args.prefill_requests)]
    steps: list[float] = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bs_.DEVICE == "cuda" else [])
    bs_.sync()
    with profile(activities=acts) as prof:
        run_requests(eng, prompts, [1] * len(prompts), lambda dt, _o: steps.append(dt))
        bs_.sync()
    # Host side of a small prefill (the common case under load): Python functions by own time.
    import cProfile
    import pstats

    n_small, len_small = args.small_prefill
    small = [random_prompt(gen, len_small, vocab) for _ in range(n_small)]
    small_steps: list[float] = []
    pr = cProfile.Profile()
    pr.enable()
    run_requests(eng, small, [1] * n_small, lambda dt, _o: small_steps.append(dt))
    pr.disable()
    del eng
    release()
    log(f"small prefill ({n_small} x {len_small} tokens, eager, cProfile on): "
        f"{1000 * sum(small_steps):.1f} ms in {len(small_steps)} steps; top functions by own time:")
    pstats.Stats(pr).sort_stats("tottime").print_stats(args.top + 10)
    pstats.Stats(pr).sort_stats("cumulative").print_stats(args.top + 10)
    evs = _kernel_events(prof, bs_.DEVICE)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, us in evs:
        by_name[name][0] += 1
        by_name[name][1] += us / 1000
    ntok = args.prompt * args.prefill_requests
    r = {"tokens": ntok, "steps": len(steps), "wall_ms": 1000 * sum(steps),
         "kernel_ms": sum(us for _, us in evs) / 1000, "by_name": dict(by_name)}
    res["prefill"] = r
    print_kernel_tables(
        f"Prefill, {args.model}{args.tag}: {args.prefill_requests} x {args.prompt} tokens in "
        f"{len(steps)} steps, wall {r['wall_ms']:.1f} ms ({ntok / sum(steps):,.0f} tok/s, "
        f"profiled), kernels {r['kernel_ms']:.1f} ms", r, args.top)


def section_ttft(args, model_dir: str, vocab: int, res: dict) -> None:
    """One request's time to first token, prefill eager against prefill as decode rows (see the
    module docstring); "ttft" in the results: per length both modes' TTFTs (ms)."""
    import numpy as np

    eng = make_engine(model_dir, enable_radix_cache=False, cuda_graph_max_bs=args.graph_max_bs,
                      max_running_requests=max(args.graph_max_bs, 16))
    fast = "auto" if bs_.DEVICE == "cuda" else "true"
    modes = ("false", fast)
    took = [0]
    real = eng._extend_as_decode

    def counted(batch, _real=real):
        used = _real(batch)
        took[0] += bool(used)
        return used

    eng._extend_as_decode = counted
    gen = torch.Generator().manual_seed(11)
    rows, out = [], {}
    for n in args.ttft_lengths:
        if n + 1 > eng.context_len:
            log(f"ttft: {n} tokens do not fit the context ({eng.context_len}); skipped")
            continue
        ms: dict[str, list[float]] = {m: [] for m in modes}
        used = same = 0
        for rep in range(args.ttft_reps + 1):  # the first pass warms up, unmeasured
            prompt = random_prompt(gen, n, vocab)
            first = {}
            for mode in (modes if rep % 2 else modes[::-1]):  # each side first in turn
                eng.extend_as_decode = mode
                took[0] = 0
                r = run_requests(eng, [prompt], [1])
                first[mode] = r["first_ids"][0]
                if rep:
                    ms[mode].append(1000 * r["ttft"][0])
                    if mode == fast and took[0]:
                        used += 1
            if rep and first[modes[0]] == first[modes[1]]:
                same += 1
        eager, rows_ms = (float(np.median(ms[m])) for m in modes)
        out[str(n)] = {"eager_ms": ms["false"], "as_decode_ms": ms[fast], "as_decode_runs": used}
        rows.append([n, eager, rows_ms, eager / rows_ms, f"{used}/{args.ttft_reps}",
                     f"{same}/{args.ttft_reps}"])
    eng.close()
    del eng
    release()
    res["ttft"] = out
    table(f"Time to first token, one request alone, {args.model}{args.tag} "
          f"(extend_as_decode false vs {fast}; p50 of {args.ttft_reps})",
          ["prompt tokens", "eager prefill ms", "as decode rows ms", "eager / rows",
           "runs as decode rows", "same first token"], rows)


class GcPauses:
    """Context manager: every garbage collection inside it (gc.callbacks), as per-generation
    count, total and longest pause (ms)."""

    def __enter__(self) -> "GcPauses":
        self.pauses: list[tuple[int, float]] = []
        self._t0 = 0.0
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append((info["generation"], 1000 * (time.perf_counter() - self._t0)))

    def summary(self) -> dict[int, tuple[int, float, float]]:
        """generation -> (collections, total ms, max ms)."""
        out = {}
        for g in (0, 1, 2):
            ms = [d for gen, d in self.pauses if gen == g]
            out[g] = (len(ms), sum(ms), max(ms, default=0.0))
        return out


class CompileLog:
    """Context manager: the triton JIT compiles of this process while it is active (kernel
    name, milliseconds, and `step()` at the time: the caller's step counter), from triton's
    `knobs.runtime.jit_cache_hook` (called before a kernel is built for a new specialization)
    and `jit_post_compile_hook` (after). A kernel found in triton's on-disk cache passes through
    both hooks too, in a few milliseconds; a real compile takes 0.1-2 s. Both hooks return None,
    so triton always goes on to build the kernel."""

    def __init__(self, step) -> None:
        self.step = step
        self.events: list[tuple[str, float, int]] = []
        self._t0 = 0.0

    def __enter__(self) -> "CompileLog":
        from triton import knobs

        self._rt = knobs.runtime
        self._saved = (self._rt.jit_cache_hook, self._rt.jit_post_compile_hook)
        self._rt.jit_cache_hook = self._before
        self._rt.jit_post_compile_hook = self._after
        return self

    def __exit__(self, *exc: Any) -> None:
        self._rt.jit_cache_hook, self._rt.jit_post_compile_hook = self._saved

    def _before(self, **_kw: Any) -> None:
        self._t0 = time.perf_counter()

    def _after(self, **kw: Any) -> None:
        name = getattr(kw.get("fn"), "name", "?")
        self.events.append((name, 1000 * (time.perf_counter() - self._t0), self.step()))


class PrefillHost:
    """Host profile of prefill steps only: wraps `eng.step` (an instance attribute shadowing
    the method) with a fresh cProfile per step from step `skip` on, and keeps the statistics of
    the first `count` steps that scheduled a prefill / extend batch (`is_prefill()`, asked after
    the step). Under the overlap schedule such a step launches the prefill and then waits for
    the previous decode batch's tokens, so its wall time is the prefill's host work plus that
    wait (the prefill's own GPU time shows in the next step)."""

    def __init__(self, eng, skip: int, count: int, is_prefill) -> None:
        import cProfile

        self.count, self.n = count, 0
        self.walls: list[float] = []
        self.stats = None
        inner = eng.step

        def step():
            self.n += 1
            if self.n < skip or len(self.walls) >= count:
                return inner()
            prof = cProfile.Profile()
            t = time.perf_counter()
            prof.enable()
            outs = inner()
            prof.disable()
            dt = time.perf_counter() - t
            if is_prefill():
                import pstats

                self.walls.append(dt)
                if self.stats is None:
                    self.stats = pstats.Stats(prof)
                else:
                    self.stats.add(prof)
            return outs

        eng.step = step

    def report(self, top: int) -> dict:
        """Print and return: wall ms per profiled prefill step and the top host functions by
        own time and by cumulative time (ms per step)."""
        if not self.walls:
            log("prefill host profile: no prefill step after the skipped ones")
            return {}
        n = len(self.walls)
        wall = 1000 * sum(self.walls) / n
        out = {"steps": n, "wall_ms": wall}
        for key in ("own", "cumulative"):
            out[key] = host_rows(self.stats, n, key, top)
            table(f"Host side of {n} prefill steps of the run (cProfile on): {wall:.2f} ms per "
                  f"step; functions by {key} time", HOST_COLUMNS, out[key])
        return out


def section_steps(args, model_dir: str, vocab: int, res: dict) -> None:
    pairs = load_length_pairs(args.lengths, args.num_requests, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [random_prompt(gen, p, vocab) for p, _ in pairs]
    outs = [o for _, o in pairs]
    chunk = {} if args.prefill_chunk is None else {"chunked_prefill_size": args.prefill_chunk}
    eng = make_engine(model_dir, enable_radix_cache=False, cuda_graph_max_bs=args.graph_max_bs,
                      max_running_requests=args.max_running,
                      prefill_min_free_rows=args.prefill_min_free_rows, **chunk)
    graph_max = eng.runner.cuda_graph_runner.max_bs if eng.runner.cuda_graph_runner else 0
    if args.gc_threshold:  # the collector's generation thresholds for the run
        gc.set_threshold(*args.gc_threshold)
        log(f"gc thresholds {gc.get_threshold()}")
    if args.gc_unfreeze:  # undo `Engine.__init__`'s freeze: the pauses it saves, measured
        gc.unfreeze()
    warm_up(eng, prompts)
    # and an extend with a cached prefix (the absorbed path's kernels, compiled at first use):
    # one prompt 1,000 tokens longer than a prefill chunk, so it continues in a second step
    # (where the context allows it; otherwise no prompt is ever cut, so no run extends a prefix)
    chunk = eng.config.scheduler.chunked_prefill_size
    if 0 < chunk and chunk + 1000 + 2 <= eng.context_len:
        wgen = torch.Generator().manual_seed(1)
        run_requests(eng, [random_prompt(wgen, chunk + 1000, vocab)], [2])
    steps = StepLog(eng)
    window = StepWindow(eng, *args.window) if args.window else None
    pre_host = (PrefillHost(eng, 8, args.prefill_host,
                            lambda: bool(steps.batches) and steps.batches[-1][0] == "prefill")
                if args.prefill_host else None)
    log_rows = steps.rows

    sampling = None
    if args.min_tokens:  # as genai-perf and bench_server_path send fixed output lengths
        sampling = [SamplingParams(max_new_tokens=o, min_new_tokens=o, temperature=0.0,
                                   ignore_eos=True) for o in outs]
    sync_debug = args.sync_debug and torch.cuda.is_available()  # (nothing waits on a CPU)
    if sync_debug:  # a warning (with its stack) for each op that waits for the device
        torch.cuda.set_sync_debug_mode("warn")
    alloc0 = allocator_counts()
    try:
        with GcPauses() as gcp, CompileLog(lambda: len(log_rows)) as compiles:
            r = run_requests(eng, prompts, outs, steps.on_step, sampling)
    finally:
        if sync_debug:
            torch.cuda.set_sync_debug_mode("default")
    alloc = allocator_delta(alloc0)
    steps.close()
    stats = eng.stats()
    del eng
    release()
    if window is not None:
        res["window"] = window.report(args.top)
    if pre_host is not None:
        res["prefill_host"] = pre_host.report(args.top)
    total = r["seconds"]
    groups = steps.groups(graph_max)
    dec = [b for m, b, *_ in log_rows if m == "decode"]
    dec_rows, n_dec = sum(dec), len(dec)
    rows = steps.table_rows(graph_max, total)
    out_tok_s = r["output_tokens"] / total
    res["steps"] = {"seconds": total, "output_tokens": r["output_tokens"],
                    "output_tok_s": out_tok_s, "graph_max_bs": graph_max,
                    "mean_decode_bs": dec_rows / max(n_dec, 1), "groups": dict(groups),
                    "retractions": stats.get("retractions", 0)}
    table(f"Peak-throughput run, {args.model}{args.tag}: {len(pairs)} requests, "
          f"{r['output_tokens']:,} output tokens in {total:.1f} s = {out_tok_s:,.0f} tok/s; "
          f"mean decode batch {dec_rows / max(n_dec, 1):.0f}; graphs to bs {graph_max}; "
          f"retractions {stats.get('retractions', 0)}",
          StepLog.HEADER, rows)
    res["steps"]["allocator"] = alloc
    log_allocator("The timed run", alloc)
    res["steps"]["gc"] = gcp.summary()
    table(f"Garbage collections during the run ({gc.get_freeze_count():,} objects frozen)",
          ["generation", "collections", "total ms", "max ms"],
          [[g, n, tot, mx] for g, (n, tot, mx) in sorted(gcp.summary().items())])
    res["steps"]["compiles"] = compiles.events
    table(f"Triton JIT compiles inside the timed run ({len(compiles.events)}; a disk-cache hit "
          "takes a few ms)", ["kernel", "ms", "step"],
          [[name, ms, step] for name, ms, step in compiles.events] or [["none", 0.0, ""]])
    slow = sorted(range(len(log_rows)), key=lambda i: -log_rows[i][3])[:5]
    res["steps"]["slowest"] = [[i, *log_rows[i]] for i in slow]
    table("Slowest steps (position in the run's step log)",
          ["step", "mode", "batch size", "tokens", "ms", "GPU wait ms"],
          [[i, log_rows[i][0], log_rows[i][1], log_rows[i][2], 1000 * log_rows[i][3],
            1000 * log_rows[i][4]] for i in slow])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=SHAPES, required=True)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--sections", nargs="+", choices=("kernels", "prefill", "ttft", "steps"),
                    default=["kernels", "steps"])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--pdl", action="store_true",
                    help="kernels: keep programmatic dependent launch on (durations then "
                         "include each kernel's wait for the one in front)")
    ap.add_argument("--num-requests", type=int, default=800)
    ap.add_argument("--graph-max-bs", type=int, default=256)
    ap.add_argument("--max-running", type=int, default=None,
                    help="request rows (default: derived from the pools, 1,024 here)")
    ap.add_argument("--prefill-min-free-rows", type=int, default=1,
                    help="steps: the scheduler setting prefill_min_free_rows")
    ap.add_argument("--prefill-requests", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill and steps sections: the engine's chunked_prefill_size "
                         "(tokens; also the most new tokens of one prefill batch)")
    ap.add_argument("--small-prefill", type=int, nargs=2, default=[4, 94],
                    metavar=("REQUESTS", "TOKENS"),
                    help="prefill: also cProfile an eager prefill of this many requests")
    ap.add_argument("--ttft-lengths", type=int, nargs="+",
                    default=[1, 16, 128, 512, 1024, 2048], help="ttft: prompt lengths")
    ap.add_argument("--ttft-reps", type=int, default=10, help="ttft: prompts per length")
    ap.add_argument("--lengths", default=str(DEFAULT_PATH))
    ap.add_argument("--quantization", default="", choices=["", "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto",
                    choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--shape-overrides", default="{}")
    ap.add_argument("--window", type=int, nargs=2, default=None, metavar=("START", "COUNT"),
                    help="steps: profile these steps of the run (GPU kernels and host)")
    ap.add_argument("--prefill-host", type=int, default=0, metavar="N",
                    help="steps: also cProfile the host side of the run's first N prefill "
                         "steps after its eighth step (wall ms per step, top functions)")
    ap.add_argument("--overlap-schedule", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--extend-as-decode", default="auto", choices=["auto", "true", "false"],
                    help="the engine setting extend_as_decode (small prefills as decode rows, "
                         "through the graphs)")
    ap.add_argument("--min-tokens", action="store_true",
                    help="steps: min_tokens = max_tokens on every request (fixed lengths)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="steps: torch.cuda.set_sync_debug_mode('warn') during the run")
    ap.add_argument("--gc-threshold", type=int, nargs=3, default=None, metavar=("G0", "G1", "G2"),
                    help="steps: gc.set_threshold for the run (Python's default 700 10 10)")
    ap.add_argument("--gc-unfreeze", action="store_true",
                    help="steps: undo the engine's gc.freeze of its start-up objects "
                         "(engine.freeze_startup_objects) before the run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--detokenize", default="engine", choices=["engine", "process"],
                    help="process: every step's outputs get their text in a child process, as "
                         "in the stub's front door (bench_suite.DetokenizerProcess)")
    ap.add_argument("--fp8-fast-accum", default=None, choices=["true", "false"],
                    help="layers.quantization.FP8_FAST_ACCUM for the run (default: as set)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: smoke-test this script (with --shape-overrides)")
    args = ap.parse_args()
    if args.ttft_reps < 1:
        ap.error("--ttft-reps must be >= 1")
    if args.fp8_fast_accum is not None:
        from mla_backend.layers import quantization

        quantization.FP8_FAST_ACCUM = args.fp8_fast_accum == "true"
    args.tag = (f" [{args.quantization or 'bf16'} weights, {args.kv_cache_dtype} KV]"
                if args.quantization or args.kv_cache_dtype != "auto" else "")
    bs_.DETOKENIZE = args.detokenize
    if args.detokenize != "engine":
        args.tag += f" [detokenized in a {args.detokenize}]"
    if args.fp8_fast_accum is not None:
        args.tag += f" [FP8 fast accumulation {args.fp8_fast_accum}]"
    if args.extend_as_decode != "auto":
        args.tag += f" [extend_as_decode {args.extend_as_decode}]"
    bs_.DEVICE = args.device
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_profile.py needs a CUDA GPU (or --device cpu for a smoke test)")
    bs_.ENGINE_SETTINGS.update(quantization=args.quantization,
                               kv_cache_dtype=args.kv_cache_dtype,
                               overlap_schedule=args.overlap_schedule,
                               extend_as_decode=args.extend_as_decode)
    model_dir = write_shape_model(os.path.join(tempfile.mkdtemp(), args.model), args.model,
                                  args.tokenizer_dir, **json.loads(args.shape_overrides))
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    res: dict[str, Any] = {"model": args.model, "device": (torch.cuda.get_device_name()
                                                           if args.device == "cuda" else "cpu"),
                           "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                           "command": "python3 benchmarks/bench_profile.py "
                                      + " ".join(sys.argv[1:])}
    funcs = {"kernels": section_kernels, "prefill": section_prefill, "ttft": section_ttft,
             "steps": section_steps}
    run_sections(args.sections, {name: (lambda fn=fn: fn(args, model_dir, vocab, res))
                                 for name, fn in funcs.items()}, res, args.out)


if __name__ == "__main__":
    main()
