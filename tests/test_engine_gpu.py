"""The engine on a CUDA GPU (marker `gpu`): the same greedy tokens as Hugging
Face on the CPU in fp32, bf16 logits close to fp32, and pools sized from free GPU memory.

    MLA_TEST_TOKENIZER_DIR=<folder with SmolLM2's tokenizer files> PYTHONPATH=. \
        python3 -m pytest -m gpu tests/test_engine_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.forward_batch import ForwardMode
from mla_backend.request import SamplingParams
from tests.test_engine import GREEDY, PROMPTS, hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def deepseek_dir(tiny_deepseek_factory):
    return tiny_deepseek_factory(seed=1, hidden_size=128, num_hidden_layers=3)


@pytest.fixture(scope="module")
def llama_dir(tiny_llama_factory):
    return tiny_llama_factory(seed=2)


def _engine(path: str, **kw) -> Engine:
    # A fixed pool: an engine sized from free memory would hold most of the GPU until collected.
    kw.setdefault("max_total_tokens", 4096)
    return Engine(EngineConfig.create(model_path=path, device="cuda", **kw))


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("settings", [
    {},
    {"disable_mla": True},
    {"mla_decompress_min_tokens": 0},
    {"chunked_prefill_size": 8, "max_total_tokens": 110},
    {"extend_as_decode": "auto"},  # prefills as decode rows, through the decode graphs
    {"chunked_prefill_size": 8, "max_total_tokens": 110, "extend_as_decode": "auto"},
])
def test_deepseek_fp32_gpu_equals_hf_cpu(deepseek_dir, settings, backend):
    expected = hf_greedy(deepseek_dir, PROMPTS, 32)
    eng = _engine(deepseek_dir, dtype="float32", attention_backend=backend, **settings)
    as_rows = _count_decode_rows(eng)
    assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == expected
    # with graphs (triton) "auto" runs the prefills as decode rows; torch_native has no graphs
    assert (as_rows[0] > 0) == (settings.get("extend_as_decode") == "auto"
                                and backend == "triton")
    eng.check_invariant()


def _count_decode_rows(eng: Engine) -> list[int]:
    """A counter of the engine's batches that `_extend_as_decode` turns into decode rows."""
    count, real = [0], eng._extend_as_decode

    def counted(batch):
        used = real(batch)
        count[0] += bool(used)
        return used

    eng._extend_as_decode = counted
    return count


@pytest.mark.parametrize("backend,as_decode", [("triton", "false"), ("torch_native", "false"),
                                               ("triton", "auto")])
def test_llama_fp32_gpu_equals_hf_cpu(llama_dir, backend, as_decode):
    expected = hf_greedy(llama_dir, PROMPTS, 32)
    eng = _engine(llama_dir, dtype="float32", attention_backend=backend,
                  extend_as_decode=as_decode)
    as_rows = _count_decode_rows(eng)
    assert [r.token_ids for r in eng.generate(PROMPTS, GREEDY)] == expected
    assert (as_rows[0] > 0) == (as_decode == "auto")


def _prefill_logits(eng: Engine, ids: list[int]) -> torch.Tensor:
    """All-position logits of one prompt run as a single EXTEND on the engine's pools."""
    runner = eng.runner
    row = runner.req_to_token_pool.alloc(1)[0]
    slots = runner.token_to_kv_pool_allocator.alloc(len(ids))
    runner.req_to_token_pool.req_to_token[row, : len(ids)] = slots.to(
        runner.req_to_token_pool.req_to_token.device, torch.int32)
    fb = runner.make_forward_batch(ForwardMode.EXTEND, ids, list(range(len(ids))), [row],
                                   [len(ids)], [0], [len(ids)], slots, return_all_logits=True)
    logits = runner.forward(fb).float().cpu()
    runner.token_to_kv_pool_allocator.free(slots)
    runner.req_to_token_pool.free(row)
    return logits


@pytest.mark.parametrize("model", ["deepseek", "llama"])
def test_bf16_logits_close_to_fp32(model, deepseek_dir, llama_dir):
    path = deepseek_dir if model == "deepseek" else llama_dir
    eng32 = _engine(path, dtype="float32")
    ids = eng32.tokenizer(PROMPTS[2]).input_ids
    ref = _prefill_logits(eng32, ids)
    eng16 = _engine(path, dtype="bfloat16")
    got = _prefill_logits(eng16, ids)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() > 0.995, cos.min()
    res = eng16.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0.0))
    assert all(r.finish_reason is not None and r.error is None for r in res)


def test_pools_sized_from_free_memory(deepseek_dir):
    gc.collect()
    torch.cuda.empty_cache()
    eng = _engine(deepseek_dir, dtype="bfloat16", mem_fraction_static=0.5, max_total_tokens=None)
    runner = eng.runner
    total = torch.cuda.get_device_properties(runner.device).total_memory
    pool_bytes = runner.token_to_kv_pool.cell_bytes() * runner.max_total_num_tokens
    assert runner.max_total_num_tokens > 100_000
    assert pool_bytes < 0.5 * total
    res = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert all(len(r.token_ids) >= 1 for r in res)


def _sync_sites(eng: Engine, prompts: list[list[int]], max_new: list[int]) -> dict[str, int]:
    """Run `prompts` to the end with torch's sync debug mode on ("warn": every torch operation
    that waits for the device, e.g. a pageable or non_blocking=False host-device copy, `.item()`,
    `nonzero`, warns) and return the project call sites that triggered it: "file:line function"
    of the innermost frame under this repository -> count."""
    import os
    import traceback
    import warnings

    from mla_backend.request import GenerateRequest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sites: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing CUDA operation" not in str(message):
            return shown(message, category, filename, lineno, file, line)
        own = [f for f in traceback.extract_stack()[:-1]
               if f.filename.startswith(root) and "/tests/" not in f.filename]
        key = f"{os.path.relpath(own[-1].filename, root)}:{own[-1].lineno} {own[-1].name}" \
            if own else "outside the project"
        sites[key] = sites.get(key, 0) + 1

    for i, (ids, n) in enumerate(zip(prompts, max_new)):
        eng.add_request(GenerateRequest(rid=f"s{i}", input_ids=ids, stream=True,
                                        sampling_params=SamplingParams(
                                            max_new_tokens=n, temperature=0.0,
                                            ignore_eos=True)))
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while eng.has_work():
                eng.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return sites


@pytest.mark.parametrize("settings", [{}, {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}],
                         ids=["bf16", "fp8"])
def test_steps_do_not_wait_for_the_device(deepseek_dir, settings):
    """With the overlap schedule the host must queue step N+1 while the device runs step N: no
    operation of a prefill or decode step may block on the device. The only wait is the
    sampler's event (`Sampler.resolve`), which waits for that batch's own work and is not a torch
    synchronizing operation. A prefill of several requests (the sorted MoE path: 24 x 40 tokens)
    and eager and graph-replayed decode steps (graphs to bs 16; the batch shrinks from 24 to 1 as
    the requests reach their lengths) are covered."""
    eng = _engine(deepseek_dir, dtype="bfloat16", cuda_graph_max_bs=16, **settings)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (40,), generator=gen).tolist() for _ in range(24)]
    eng.generate([p[:8] for p in prompts[:4]], SamplingParams(max_new_tokens=4, temperature=0.0))
    sites = _sync_sites(eng, prompts, [8 + i for i in range(24)])
    assert not sites, f"host-device synchronizations in engine steps: {sites}"
    eng.check_invariant()


_AFTER_LOAD = r"""
import json, sys
import torch
from triton import knobs
from mla_backend.config import EngineConfig
from mla_backend.engine import Engine
from mla_backend.request import SamplingParams

eng = Engine(EngineConfig.create(model_path=sys.argv[1], device="cuda", dtype="bfloat16",
                                 max_total_tokens=4096, warmup=sys.argv[2]))
seen = []
knobs.runtime.jit_cache_hook = lambda fn, **_: seen.append(fn.name)  # before each new one
gen = torch.Generator().manual_seed(0)
ids = lambda n: torch.randint(10, 1000, (n,), generator=gen).tolist()
greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
long = ids(230)
for n in (3, 50, 97, 777):
    eng.generate([ids(n)], greedy)
eng.generate([long], greedy)
eng.generate([ids(11), ids(64), ids(150), ids(400)], greedy)
eng.generate([long + ids(45)], greedy)  # 230 tokens from the prefix cache
print(json.dumps(seen))
"""


def _specialized_after_load(model_dir: str, warmup: str) -> list[str]:
    """The triton kernels a fresh process specializes (compiles or reads from the disk cache)
    while serving prompts of other lengths than the warm-up's, alone, batched and over a cached
    prefix, after an engine with `warmup` has loaded."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [repo] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    proc = subprocess.run([sys.executable, "-c", _AFTER_LOAD, model_dir, warmup], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_kernel_is_specialized_after_the_warm_up(deepseek_dir):
    """After the load-time warm-up (`warmup` auto: on with CUDA) the first requests launch only
    kernels already specialized: none waits for a triton compile. Without it the same requests
    specialize some (so the check can fail)."""
    assert _specialized_after_load(deepseek_dir, "false"), "nothing to warm up"
    assert _specialized_after_load(deepseek_dir, "auto") == []
