"""Tensor parallelism on several GPUs (issue 8): TP=N vs TP=1 correctness and scaling numbers.

Run on a machine with at least max(--tp) GPUs (NCCL; NVLink multicast stays off as the machine
sets it: NCCL_NVLS_ENABLE=0). Prints markdown tables and writes every number to `--out`.

- correctness: a *checkpoint on disk* (so every TP degree loads the same weights) with the real
  published widths but few layers, per `--correctness-models` — DeepSeek-V2-Lite's and
  DeepSeek-V2's (`tools.tiny_deepseek` weights: N(0, 0.02) matrices, LM head std 3/sqrt(hidden),
  so greedy choices are well separated) and Llama-3.1-8B's (`tools.checkpoints.make_tiny_llama`,
  std 0.02) — in bf16 with CUDA graphs. Layers: `--layers`, else `CORRECTNESS_LAYERS` (V2: 2, a
  dense and an MoE layer; one V2 MoE layer is 3.8B parameters, 7.5 GB in bf16). Each
  TP degree generates greedily for the same random prompts with top-5 logprobs; reported: tokens
  equal to TP=1 (and where the first difference is, with TP=1's top-1/top-2 logprob margin
  there) and the largest difference of the chosen tokens' logprobs over the common prefix.
- smoke (first): a tiny model at each TP degree, eager then CUDA graphs, start-up timed, with
  every rank's stacks printed periodically — where a multi-GPU start-up hang shows itself.
- scaling: the full published shapes with random weights (`load_format="dummy"`): peak output
  throughput on ShareGPT lengths (all requests at once, radix off) and bs-1 decode step time,
  per TP degree; degrees whose bf16 weights (`model_shapes.bytes_per_rank`) exceed 90% of a GPU
  are skipped (DeepSeek-V2: 56 GiB per rank at TP 8, 110 GiB at TP 4).

    PYTHONPATH=. python3 benchmarks/bench_tp.py --tokenizer-dir TOK --tp 1 2 --out tp.json
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_suite as suite  # noqa: E402
from sharegpt_lengths import DEFAULT_PATH, load_length_pairs  # noqa: E402

from mla_backend.config import EngineConfig  # noqa: E402
from mla_backend.engine import Engine  # noqa: E402
from mla_backend.request import SamplingParams  # noqa: E402
from mla_tools.model_shapes import (  # noqa: E402
    SHAPES,
    bytes_per_rank,
    shape_config,
    write_shape_model,
)

DEVICE, DTYPE = "cuda", "bfloat16"  # --device cpu (gloo, float32) only smoke-tests the script
log, release = suite.log, suite.release  # release() follows suite.DEVICE, set in main()
# Layers of each correctness checkpoint unless --layers says otherwise.
CORRECTNESS_LAYERS = {"deepseek-v2-lite": 3, "deepseek-v2": 2, "llama-3.1-8b": 3}


def write_checkpoints(root: str, tokenizer_dir: str, models: list[str], layers: int | None,
                      overrides: dict[str, Any]) -> dict[str, str]:
    """Few-layer checkpoints with the published widths of `models` (names of `SHAPES`), bf16
    safetensors: {name: folder}. layers None: `CORRECTNESS_LAYERS`; `overrides` per name win."""
    from safetensors.torch import save_file

    from mla_tools.checkpoints import make_tiny_llama
    from mla_tools.tiny_deepseek import copy_tokenizer_files, tiny_deepseek_v2_state_dict

    out = {}
    for name in models:
        t = time.perf_counter()
        cfg = shape_config(name, **{"num_hidden_layers": layers or CORRECTNESS_LAYERS[name],
                                    **overrides.get(name, {})})
        d = os.path.join(root, f"{name}-few")
        if name.startswith("deepseek"):
            os.makedirs(d)
            sd = {k: v.to(torch.bfloat16)
                  for k, v in tiny_deepseek_v2_state_dict(cfg, seed=0).items()}
            save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
            del sd
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(cfg, f)
        else:
            keep = {k: v for k, v in cfg.items() if k not in (
                "architectures", "model_type", "torch_dtype", "transformers_version")}
            make_tiny_llama(d, seed=0, init_std=0.02, **keep)
        copy_tokenizer_files(tokenizer_dir, d)
        out[name] = d
        log(f"wrote {d} in {time.perf_counter() - t:.0f} s")
    return out


def correctness(model_dir: str, tps: list[int], n_prompts: int, new_tokens: int,
                vocab: int, dtype: str = DTYPE) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    prompts = [suite.random_prompt(gen, 16 + 24 * i, vocab) for i in range(n_prompts)]
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    runs: dict[int, Any] = {}
    for tp in tps:
        t = time.perf_counter()
        eng = Engine(EngineConfig.create(model_path=model_dir, dtype=dtype, device=DEVICE,
                                         tensor_parallel_size=tp, cuda_graph_max_bs=16,
                                         max_running_requests=16, context_length=2048,
                                         max_total_tokens=65536))
        up = time.perf_counter() - t
        res = _generate_with_logprobs(eng, prompts, sp)
        eng.close()
        del eng
        release()
        runs[tp] = res
        log(f"  {dtype} TP={tp}: up in {up:.0f} s, {sum(len(r[0]) for r in res)} tokens")
    report: dict[str, Any] = {}
    base = runs[tps[0]]
    for tp in tps[1:]:
        equal, first_diff, lp_err, margins = 0, [], 0.0, []
        for (bt, blp, btop), (ot, olp, _) in zip(base, runs[tp]):
            n = 0
            while n < min(len(bt), len(ot)) and bt[n] == ot[n]:
                n += 1
            if n == len(bt) == len(ot):
                equal += 1
            else:
                first_diff.append(n)
                top = sorted(btop[n].values(), reverse=True)
                margins.append(top[0] - top[1] if len(top) > 1 else float("nan"))
            for j in range(n):
                lp_err = max(lp_err, abs(blp[j] - olp[j]))
        report[f"tp{tp}"] = {"prompts": len(base), "equal": equal, "first_diff_at": first_diff,
                             "tp1_top2_margin_at_diff": margins,
                             "max_abs_logprob_diff": lp_err}
    return report


def _generate_with_logprobs(eng: Engine, prompts: list[list[int]], sp: SamplingParams):
    """Per prompt: (token ids, chosen-token logprobs, per-step top-5 {id: logprob})."""
    from mla_backend.request import GenerateRequest

    rids = [f"c{i}" for i in range(len(prompts))]
    acc = {r: ([], [], []) for r in rids}
    for r, p in zip(rids, prompts):
        eng.add_request(GenerateRequest(rid=r, input_ids=p, sampling_params=sp, stream=True))
    while eng.has_work():
        for o in eng.step():
            if o.rid not in acc:
                continue
            if o.error:
                raise RuntimeError(o.error)
            toks, lps, tops = acc[o.rid]
            toks += o.new_token_ids
            lps += o.new_token_logprobs or []
            tops += [dict(t) for t in (o.new_logprobs or [])]
    return [acc[r] for r in rids]


def scaling(model: str, tokenizer_dir: str, tps: list[int], n_requests: int,
            graph_max_bs: int, lengths: str, overrides: dict[str, Any],
            work: str) -> dict[str, Any]:
    root = tempfile.mkdtemp(prefix="tpshape_", dir=work)
    mdir = write_shape_model(os.path.join(root, model), model, tokenizer_dir, **overrides)
    cfg = shape_config(model, **overrides)
    vocab = int(cfg["vocab_size"])
    pairs = load_length_pairs(lengths, n_requests, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [suite.random_prompt(gen, p, vocab) for p, _ in pairs]
    outs = [o for _, o in pairs]
    res: dict[str, Any] = {}
    for tp in tps:
        weights = bytes_per_rank(cfg, tp, 2)
        if DEVICE == "cuda" and weights > 0.9 * torch.cuda.get_device_properties(0).total_memory:
            res[f"tp{tp}"] = {"skipped": f"{weights / 2**30:.1f} GiB of bf16 weights per rank"}
            log(f"  {model} TP={tp}: skipped, {res[f'tp{tp}']['skipped']}")
            continue
        t = time.perf_counter()
        eng = suite.make_engine(mdir, tensor_parallel_size=tp, enable_radix_cache=False,
                                cuda_graph_max_bs=graph_max_bs)
        up = time.perf_counter() - t
        suite.run_requests(eng, prompts[:16], [8] * 16)  # warm-up
        bs1 = suite.decode_step_ms(eng, 1, 128, 48, vocab)
        bs64 = suite.decode_step_ms(eng, 64, 128, 24, vocab)
        prof = {f"bs{b}": step_profile(eng, b, vocab) for b in (1, 64)}
        r = suite.run_requests(eng, prompts, outs)
        res[f"tp{tp}"] = {"startup_s": up, "kv_tokens": eng.max_total_tokens,
                          "bs1_ms_per_step": bs1, "bs1_tok_s": 1000 / bs1,
                          "bs64_ms_per_step": bs64, "step_profile_ms": prof,
                          "output_tokens": r["output_tokens"], "seconds": r["seconds"],
                          "output_tok_s": r["output_tokens"] / r["seconds"],
                          "errors": r["errors"], "retractions": eng.stats().get("retractions", 0)}
        log(f"  {model} TP={tp}: {res[f'tp{tp}']}")
        eng.close()
        del eng
        release()
    return res


def step_profile(eng: Engine, bs: int, vocab: int) -> dict[str, float]:
    """Rank 0's decode step at batch size `bs` split (ms, medians over the steps where all `bs`
    rows decode): building the batch, sending the workers their message (TP > 1), the forward
    until its logits are ready (synced: at TP > 1 it includes waiting for the slowest rank at
    each all-reduce), and the rest of the step (scheduler, sampling, outputs)."""
    import statistics

    runner = eng.runner
    acc: dict[str, float] = {}

    def timed(name, fn, synced=False):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            if synced:
                suite.sync()
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    saved = {}
    runner.make_forward_batch = timed("build batch", runner.make_forward_batch)
    runner._forward = timed("forward (synced)", runner._forward, synced=True)
    if runner.tp_workers is not None:
        saved["send"] = runner.tp_workers.send_step
        runner.tp_workers.send_step = timed("send to workers", runner.tp_workers.send_step)
    rows: list[dict[str, float]] = []

    def on_step(dt: float, outs: list) -> None:
        if len(outs) == bs and all(len(o.new_token_ids) == 1 for o in outs):
            rows.append(dict(acc, step=dt))
        acc.clear()

    gen = torch.Generator().manual_seed(7)
    suite.run_requests(eng, [suite.random_prompt(gen, 128, vocab) for _ in range(bs)],
                       [32] * bs, on_step)
    del runner.make_forward_batch, runner._forward  # back to the class's methods
    if saved:
        runner.tp_workers.send_step = saved["send"]
    rows = rows[1:] or rows
    keys = ["build batch", "send to workers", "forward (synced)", "step"]
    out = {k: 1000 * statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    out["rest of step"] = out["step"] - out["build batch"] - out["send to workers"] - out[
        "forward (synced)"]
    return out


def smoke(tokenizer_dir: str, tps: list[int], hang_dump_s: float, work: str) -> dict[str, Any]:
    """Tiny random DeepSeek-V2 (tools.tiny_deepseek defaults) at each TP degree, eager and with
    CUDA graphs, each stage timed; greedy tokens compared with TP=1. Every process prints its
    stacks every `hang_dump_s` seconds (faulthandler; workers via MLA_TP_HANG_DUMP_S), so a hang
    shows where each rank waits."""
    import faulthandler

    from mla_tools.tiny_deepseek import make_tiny_deepseek_v2

    faulthandler.dump_traceback_later(hang_dump_s, repeat=True)
    os.environ["MLA_TP_HANG_DUMP_S"] = str(hang_dump_s)
    d = make_tiny_deepseek_v2(os.path.join(tempfile.mkdtemp(prefix="tpsmoke_", dir=work), "m"),
                              tokenizer_dir=tokenizer_dir)
    vocab = int(json.load(open(os.path.join(d, "config.json")))["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    prompts = [suite.random_prompt(gen, 8 + 5 * i, vocab) for i in range(6)]
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    ref = None
    for tp in tps:
        for graphs in (False, True):
            key = f"tp{tp}-{'graphs' if graphs else 'eager'}"
            log(f"smoke {key}: starting")
            t = time.perf_counter()
            eng = Engine(EngineConfig.create(model_path=d, dtype=DTYPE, device=DEVICE,
                                             tensor_parallel_size=tp,
                                             disable_cuda_graph=not graphs, cuda_graph_max_bs=8,
                                             max_running_requests=8))
            up = time.perf_counter() - t
            log(f"smoke {key}: up in {up:.1f} s ({eng.max_total_tokens} KV tokens)")
            toks = [r.token_ids for r in eng.generate(prompts, sp)]
            eng.close()
            del eng
            release()
            ref = ref or toks
            out[key] = {"startup_s": up, "equal_to_first": sum(a == b for a, b in zip(ref, toks)),
                        "prompts": len(toks)}
            log(f"smoke {key}: {out[key]}")
    faulthandler.cancel_dump_traceback_later()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sections", nargs="+", default=["smoke", "correctness", "scaling"],
                    choices=["smoke", "correctness", "scaling"])
    ap.add_argument("--hang-dump-s", type=float, default=60.0,
                    help="smoke: print every rank's stacks this often (seconds)")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of every correctness checkpoint (default: CORRECTNESS_LAYERS)")
    ap.add_argument("--correctness-models", nargs="+", choices=SHAPES,
                    default=["deepseek-v2-lite", "llama-3.1-8b"])
    ap.add_argument("--correctness-dtypes", nargs="+", default=["bfloat16", "float32"],
                    help="float32 separates real TP differences from bf16 near-ties")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--scaling-models", nargs="+", choices=SHAPES,
                    default=["deepseek-v2-lite", "llama-3.1-8b"])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[1000, 500],
                    help="per scaling model")
    ap.add_argument("--graph-max-bs", type=int, default=160)
    ap.add_argument("--lengths", default=str(DEFAULT_PATH))
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape-overrides", default="{}",
                    help='JSON {model: {config key: value}} (CPU smoke runs: small widths)')
    args = ap.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, "bfloat16" if args.device == "cuda" else "float32"
    suite.DEVICE = DEVICE
    overrides = json.loads(args.shape_overrides)
    res: dict[str, Any] = {"gpus": [torch.cuda.get_device_name(i)
                                    for i in range(torch.cuda.device_count())]
                           if DEVICE == "cuda" else "cpu",
                           "torch": torch.__version__,
                           "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2, default=str)

    work = tempfile.mkdtemp(prefix="bench_tp_")  # model folders; removed when the run ends
    atexit.register(shutil.rmtree, work, True)
    if "smoke" in args.sections:
        res["smoke"] = smoke(args.tokenizer_dir, args.tp, args.hang_dump_s, work)
        save()
    if "correctness" in args.sections:
        root = tempfile.mkdtemp(prefix="tpckpt_", dir=work)
        dirs = write_checkpoints(root, args.tokenizer_dir, args.correctness_models, args.layers,
                                 overrides)
        for name, d in dirs.items():
            vocab = int(json.load(open(os.path.join(d, "config.json")))["vocab_size"])
            for dtype in (args.correctness_dtypes if DEVICE == "cuda" else ["float32"]):
                key = f"{name} {dtype}"
                try:
                    res.setdefault("correctness", {})[key] = correctness(
                        d, args.tp, args.prompts, args.new_tokens, vocab, dtype)
                except Exception as e:  # keep the other numbers
                    res.setdefault("correctness", {})[key] = {"error": repr(e)[:2000]}
                log(f"correctness {key}: {res['correctness'][key]}")
                save()
    if "scaling" in args.sections:
        for model, n in zip(args.scaling_models, args.num_requests):
            try:
                res.setdefault("scaling", {})[model] = scaling(
                    model, args.tokenizer_dir, args.tp, n, args.graph_max_bs, args.lengths,
                    overrides.get(model, {}), work)
            except Exception as e:
                res.setdefault("scaling", {})[model] = {"error": repr(e)[:2000]}
            log(f"scaling {model}: done")
            save()
    # tables
    if "correctness" in res:
        rows = []
        for key, per in res["correctness"].items():
            for tp, r in per.items():
                if isinstance(r, dict) and "equal" in r:
                    diffs = ", ".join(f"{i} ({m:.3g})" for i, m in
                                      zip(r["first_diff_at"], r["tp1_top2_margin_at_diff"]))
                    rows.append([key, tp[2:], f"{r['equal']}/{r['prompts']}", diffs or "-",
                                 f"{r['max_abs_logprob_diff']:.2e}"])
        suite.table("TP vs TP=1, greedy", ["checkpoint, dtype", "TP", "greedy equal to TP=1",
                                           "first difference at token (TP=1 top-2 margin there)",
                                           "max |logprob diff| before it"], rows)
    if "scaling" in res:
        rows = [[model, tp[2:], r["kv_tokens"], f"{r['bs1_ms_per_step']:.2f}",
                 f"{r['bs1_tok_s']:.0f}", f"{r['bs64_ms_per_step']:.2f}",
                 f"{r['output_tok_s']:,.0f}"]
                for model, per in res["scaling"].items() for tp, r in per.items()
                if isinstance(r, dict) and "bs1_ms_per_step" in r]
        suite.table("TP scaling", ["model", "TP", "KV tokens", "bs-1 ms/step", "bs-1 tok/s",
                                   "bs-64 ms/step", "requests' output tok/s"], rows)
        parts = ("build batch", "send to workers", "forward (synced)", "rest of step", "step")
        rows = [[model, tp[2:], b[2:]] + [f"{pr[k]:.2f}" for k in parts]
                for model, per in res["scaling"].items() for tp, r in per.items()
                for b, pr in (r.get("step_profile_ms", {}) if isinstance(r, dict) else {}).items()]
        suite.table("TP step profile (ms)", ["model", "TP", "bs", *parts[:-1], "step (ms)"], rows)
    save()


if __name__ == "__main__":
    main()
