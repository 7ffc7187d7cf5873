"""`mla_kernels.decode_attention_ws` (Gluon, warp-specialized MLA decode) vs `decode_attention_ref`.

CPU (runs in CI): the kernel compiles for sm_90 ahead of time (`benchmarks/compile_ws_report.py`
in a subprocess, no device) into the intended pipeline, and the host-side helpers / argument
checks. GPU (`gpu` marker, sm_90 only): bf16 MLA against the fp32 reference on the cases of
`test_decode_attention` (`make_case`: shuffled pool, NaN in every slot that must not be read,
NaN workspaces): ragged batches, seq_len 0 / 1, lengths around the 64-token tile and split
boundaries, empty splits, padded / multiple head groups, every launch setting the sweep tries,
slot indices near the end of a > 2^31-element pool, and CUDA-graph replay; FP8 pools (e4m3,
e5m2) through both paths against the reference on the dequantized pool with separate k / v
scales: the register-operand path (raw FP8 tiles in shared memory, A operands converted in
registers; two buffers or one, one producer warp, synchronous MMAs) and the converting producer
(fp16 tiles in shared memory), the two bitwise equal to each other, and the dispatch of
`decode_attention_fwd` to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mla_kernels.decode_attention_ws as ws
from mla_backend.mem_cache.memory_pool import quantize_fp8
from mla_kernels.reference import decode_attention_ref
from tests.kernels.test_decode_attention import BF16_ATOL, BF16_RTOL, Case, expected, make_case

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 (Hopper) CUDA GPU")
LK, LV = 576, 512

# (num_bufs, load_warps, load_regs, maxnreg): the default and the settings the sweep tries
SETTINGS = [(2, 4, 64, None), (2, 2, 64, None), (2, 1, 80, None), (1, 4, 64, 128),
            (1, 1, 80, 128)]


# --- CPU: ahead-of-time compile for sm_90 -----------------------------------------------------

def _compile_rows(*specs: str) -> list[list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/compile_ws_report.py"), *specs],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line[:3] in ("| 1", "| 2")]


def test_compiles_for_sm90_as_designed():
    """Default (2 buffers) and the two-programs-per-SM setting (1 buffer, maxnreg 128): no
    spills; 36 + 32 = 68 wgmma (q·K over 512 + 64 columns in k16 steps, P·V over 8 x 4);
    16-byte cp.async per producer thread = 4608 / (32 x load warps); one
    cp.async.mbarrier.arrive; shared memory fits one resp. two programs per SM."""
    rows = _compile_rows(f"{ws.NUM_BUFS},{ws.LOAD_WARPS},{ws.LOAD_REGS}", "1,4,64,128")
    assert len(rows) == 2, rows
    # columns: bufs, load warps, load regs, maxnreg, registers, spill bytes, shared KB, wgmma,
    # cp.async, cp.async.mbarrier.arrive, mbarrier, bar.sync, setmaxnreg, setmaxnreg values
    d, two = rows
    for r, warps in ((d, ws.LOAD_WARPS), (two, 4)):
        assert int(r[5]) == 0 and int(r[7]) == 68 and int(r[9]) == 1, r
        assert int(r[8]) == 64 * 576 // 8 // (32 * warps), r
    assert float(d[6]) <= 227 and float(two[6]) <= 113 and int(two[4]) <= 128, rows


# --- CPU: host helpers and argument checks ----------------------------------------------------

def test_split_plan():
    assert ws.ws_splits_per_request(64, 132, 1) == 2 and ws.ws_splits_per_request(256, 132, 1) == 1
    assert ws.ws_splits_per_request(64, 132, 2) == 4 and ws.ws_splits_per_request(1, 132, 1) == 132
    lens = torch.tensor([0, 1, 64, 65, 1000, 100_000], dtype=torch.int32)
    s = ws.ws_num_kv_splits(lens, 16, 132, 1)
    assert s.dtype == torch.int32 and s.tolist() == [1, 1, 1, 2, 16, 16]
    assert ws.ws_num_kv_splits(lens, 64, 132, 1).tolist() == [1, 1, 1, 2, 16, 22]
    assert ws.programs_per_sm(2) == 1 and ws.programs_per_sm(1) == 2
    assert ws.default_maxnreg(1) == 128


def test_not_supported_raises_value_error():
    q = torch.zeros(2, 16, LK, dtype=torch.bfloat16)
    k = torch.zeros(8, 1, LK, dtype=torch.bfloat16)
    assert not ws.ws_supported(q, k)  # CPU tensors
    assert not ws.ws_supported(q.float(), k.float())
    o = torch.empty(2, 16, LV, dtype=torch.bfloat16)
    r2t = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError):
        ws.mla_decode_ws_fwd(q, k, o, r2t, torch.arange(2), torch.ones(2, dtype=torch.int32),
                             torch.ones(2, dtype=torch.int32), 1, torch.empty(2, 16, 1, LV),
                             torch.empty(2, 16, 1), 0.1)


# --- GPU --------------------------------------------------------------------------------------

def run_ws(case: Case, num_kv_splits, max_kv_splits: int, out_dtype=None, **launch):
    bs, num_heads, _ = case.q.shape
    dev = case.q.device
    if num_kv_splits is None:
        num_kv_splits = ws.ws_num_kv_splits(case.seq_lens, max_kv_splits, 132)
    elif isinstance(num_kv_splits, list):
        num_kv_splits = torch.tensor(num_kv_splits, dtype=torch.int32, device=dev)
    o = torch.full((bs, num_heads, LV), 7.0, dtype=out_dtype or case.q.dtype, device=dev)
    logits = torch.full((bs, num_heads, max_kv_splits, LV), float("nan"), device=dev)
    lse = torch.full((bs, num_heads, max_kv_splits), float("nan"), device=dev)
    ws.mla_decode_ws_fwd(case.q, case.k_buffer, o, case.req_to_token, case.req_pool_indices,
                         case.seq_lens, num_kv_splits, max_kv_splits, logits, lse,
                         case.sm_scale, **launch)
    return o, lse


def check_ws(case: Case, num_kv_splits=None, max_kv_splits: int = 4, **launch) -> None:
    out, _ = run_ws(case, num_kv_splits, max_kv_splits, **launch)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), expected(case), atol=BF16_ATOL, rtol=BF16_RTOL)


def mla_case(lens, heads=16, seed=0, **kw) -> Case:
    return make_case(lens, heads, 1, LK, LV, mla=True, dtype=torch.bfloat16, seed=seed, **kw)


BOUNDARY_LENS = [1, 63, 64, 65, 129, 7 * 64, 16 * 64 + 1, 0, 3, 4000]


@gpu
@needs_sm90
@pytest.mark.parametrize("num_bufs,load_warps,load_regs,maxnreg", SETTINGS)
def test_gpu_boundaries_empty_splits_settings(num_bufs, load_warps, load_regs, maxnreg):
    """Tile (64) and split boundaries, seq_len 0 and 1, 16 splits for short requests (most
    empty: never computed, never merged), every launch setting."""
    launch = dict(num_bufs=num_bufs, load_warps=load_warps, load_regs=load_regs,
                  maxnreg=maxnreg)
    case = mla_case(BOUNDARY_LENS, seed=31)
    check_ws(case, [16] * len(BOUNDARY_LENS), 16, **launch)
    check_ws(case, None, 4, **launch)
    check_ws(case, [1, 2, 3, 4, 1, 2, 3, 4, 5, 6], 8, **launch)


@gpu
@needs_sm90
@pytest.mark.parametrize("heads", [16, 4, 1, 20, 32, 128])
def test_gpu_head_counts(heads):
    """16 heads per program: fewer are zero-padded, more take several head programs."""
    case = mla_case([1, 70, 33, 129, 0, 1000], heads=heads, seed=32 + heads)
    check_ws(case, None, 8)
    check_ws(case, [1, 2, 3, 4, 5, 8], 8)


@gpu
@needs_sm90
def test_gpu_empty_splits_are_not_written():
    """Splits are 64-aligned: lengths <= 64 use split 0 only, 65 uses splits 0 and 1. A request
    with one non-empty split writes o itself and leaves the workspaces alone (its LSEs stay NaN,
    and the merge skips it); the empty splits of the other request stay NaN too (the merge must
    not have read them for the output to be finite)."""
    case = mla_case([1, 2, 5, 63, 65], seed=33)
    out, lse = run_ws(case, [8] * 5, 8)
    torch.testing.assert_close(out.float().cpu(), expected(case), atol=BF16_ATOL, rtol=BF16_RTOL)
    lse = lse.cpu()
    assert torch.isfinite(lse[4, :, :2]).all()
    assert torch.isnan(lse[:4]).all() and torch.isnan(lse[4, :, 2:]).all()


@gpu
@needs_sm90
def test_gpu_seq_len_zero_rows_and_int64_metadata():
    case = mla_case([0, 17, 0, 1, 0], heads=4, seed=34, seq_dtype=torch.int64)
    check_ws(case, [1, 2, 3, 1, 2], 3)
    out, _ = run_ws(case, None, 3)
    assert (out[[0, 2, 4]] == 0).all()
    case.req_pool_indices = case.req_pool_indices.to(torch.int32)
    check_ws(case, None, 3)


@gpu
@needs_sm90
def test_gpu_long_ragged_batch_matches_triton_path():
    """A larger ragged batch against both the fp32 reference and the triton kernel."""
    from mla_kernels.decode_attention import decode_attention_fwd, get_num_kv_splits

    g = torch.Generator().manual_seed(35)
    lens = torch.randint(0, 3000, (40,), generator=g).tolist()
    case = mla_case(lens, seed=35)
    check_ws(case, None, 16)
    out_ws, _ = run_ws(case, None, 16)
    nks = get_num_kv_splits(case.seq_lens, 1, 16, 132, head_dim=LK)
    o = torch.empty_like(out_ws)
    bs = len(lens)
    decode_attention_fwd(case.q, case.k_buffer, case.v_buffer, o, case.req_to_token,
                         case.req_pool_indices, case.seq_lens, nks, 16,
                         torch.empty(bs, 16, 16, LV, device="cuda"),
                         torch.empty(bs, 16, 16, device="cuda"), case.sm_scale)
    torch.testing.assert_close(out_ws.float(), o.float(), atol=BF16_ATOL, rtol=BF16_RTOL)


@gpu
@needs_sm90
def test_gpu_strided_q_and_o_and_fp32_out():
    case = mla_case([10, 70, 300], seed=36)
    wide_q = torch.zeros(3, 16, LK + 64, dtype=torch.bfloat16, device="cuda")
    wide_q[..., 32:32 + LK] = case.q
    case.q = wide_q[..., 32:32 + LK]
    wide_o = torch.full((3, 18, LV), 5.0, device="cuda")
    o = wide_o[:, 1:17]
    nks = torch.tensor([1, 2, 3], dtype=torch.int32, device="cuda")
    ws.mla_decode_ws_fwd(case.q, case.k_buffer, o, case.req_to_token, case.req_pool_indices,
                         case.seq_lens, nks, 3, torch.empty(3, 16, 3, LV, device="cuda"),
                         torch.empty(3, 16, 3, device="cuda"), case.sm_scale)
    torch.testing.assert_close(o.cpu(), expected(case), atol=BF16_ATOL, rtol=BF16_RTOL)
    assert (wide_o[:, 0] == 5).all() and (wide_o[:, 17] == 5).all()


@gpu
@needs_sm90
def test_gpu_cuda_graph_replay_with_new_lengths():
    """Shapes-only grid: a captured call replays correctly after seq_lens / splits change."""
    case = mla_case([100, 1000, 5, 64], seed=37)
    bs = 4
    o = torch.empty(bs, 16, LV, dtype=torch.bfloat16, device="cuda")
    logits = torch.empty(bs, 16, 8, LV, device="cuda")
    lse = torch.empty(bs, 16, 8, device="cuda")
    nks = ws.ws_num_kv_splits(case.seq_lens, 8, 132)

    def call():
        ws.mla_decode_ws_fwd(case.q, case.k_buffer, o, case.req_to_token, case.req_pool_indices,
                             case.seq_lens, nks, 8, logits, lse, case.sm_scale)

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for new in ([1, 999, 0, 64], [64, 128, 5, 2], [100, 1000, 5, 64]):  # <= the cached lengths
        case.seq_lens.copy_(torch.tensor(new, dtype=case.seq_lens.dtype))
        nks.copy_(ws.ws_num_kv_splits(case.seq_lens, 8, 132))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(o.float().cpu(), expected(case), atol=BF16_ATOL,
                                   rtol=BF16_RTOL)


@gpu
@needs_sm90
@pytest.mark.parametrize("pool_dtype,reg_a", [(torch.bfloat16, None),
                                               (torch.float8_e4m3fn, True),
                                               (torch.float8_e4m3fn, False)])
def test_gpu_big_pool_slots_near_the_end(pool_dtype, reg_a):
    """A pool of 4M slots x 576 = 2.4e9 elements (> 2^31): slot x stride overflows int32 (bf16
    pool: the cp.async producer; e4m3: the FP8 tiles' cp.async, and the converting producer)."""
    num_slots, heads = 4 * 1024 * 1024, 16
    try:
        k_buffer = torch.empty(num_slots, 1, LK, dtype=pool_dtype, device="cuda")
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for the pool (4.8 GB bf16, 2.4 GB e4m3)")
    g = torch.Generator().manual_seed(38)
    lens = [300, 77, 1, 1500]
    total = sum(lens)
    slots = num_slots - 1 - torch.randperm(4096, generator=g)[:total]  # last 4096 slots
    assert int(slots.min()) * LK > 2 ** 31
    rows_k = torch.randn(total, 1, LK, generator=g).to("cuda", pool_dtype)
    k_bytes = k_buffer.view(torch.uint8) if pool_dtype != torch.bfloat16 else k_buffer
    k_bytes[slots.cuda()] = rows_k.view(k_bytes.dtype)  # (fp8 indexing through its bytes)
    req_to_token = torch.zeros(5, 1600, dtype=torch.int32)
    remap = torch.zeros(5, 1600, dtype=torch.int32)
    off = 0
    for i, n in enumerate(lens):
        req_to_token[i + 1, :n] = slots[off:off + n].to(torch.int32)
        remap[i + 1, :n] = torch.arange(off, off + n, dtype=torch.int32)
        off += n
    q = torch.randn(4, heads, LK, generator=g).to("cuda", torch.bfloat16)
    rows = torch.tensor([1, 2, 3, 4], device="cuda")
    case = Case(q, k_buffer, k_buffer[..., :LV], req_to_token.cuda(), rows,
                torch.tensor(lens, dtype=torch.int32, device="cuda"), 0.1147)
    out, _ = run_ws(case, None, 8, reg_a=reg_a)
    small_k = rows_k.float().cpu()  # only the used rows, not the whole pool
    ref = decode_attention_ref(q.float().cpu(), small_k, small_k[..., :LV], remap,
                               rows.cpu(), torch.tensor(lens), 0.1147)
    torch.testing.assert_close(out.float().cpu(), ref, atol=BF16_ATOL, rtol=BF16_RTOL)


# --- FP8 pools: FP8 tiles with register operands, and the converting producer -----------------

FP8_POOLS = [pytest.param(torch.float8_e4m3fn, id="e4m3"),
             pytest.param(torch.float8_e5m2, id="e5m2")]


def fp8_case(lens, pool_dtype, k_scale, v_scale, heads=16, seed=0) -> tuple[Case, Case]:
    """(case with an FP8 pool holding N(0, 1) keys quantized with k_scale, reference case over
    the dequantized pool: key = stored x k_scale, value = stored[..., :512] x v_scale). The pool's
    unused slots hold NaN (e4m3 has NaN; e5m2 keeps it), as in `make_case`."""
    case = mla_case(lens, heads=heads, seed=seed)
    k8 = quantize_fp8(case.k_buffer.float(), k_scale, pool_dtype)
    ref = Case(case.q, (k8.float() * k_scale).cpu(), (k8.float() * v_scale)[..., :LV].cpu(),
               case.req_to_token, case.req_pool_indices, case.seq_lens, case.sm_scale)
    return Case(case.q, k8, k8[..., :LV], case.req_to_token, case.req_pool_indices,
                case.seq_lens, case.sm_scale), ref


def test_fp8_pool_compiles_for_sm90_as_designed():
    """The e4m3 and e5m2 pools compile to the converting producer: no cp.async, the same 68
    wgmma, no spills at the launch setting (one buffer, LOAD_REGS_FP8, maxnreg 128: two programs
    per SM)."""
    for pool in ("e4m3", "e5m2"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(ROOT)
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks/compile_ws_report.py"),
                              "--pool", pool, f"1,4,{ws.LOAD_REGS_FP8},128"], capture_output=True,
                             text=True, env=env, timeout=300, check=True).stdout
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
                if line.startswith("| 1")]
        assert len(rows) == 1, out
        r = rows[0]
        assert int(r[5]) == 0 and int(r[7]) == 68 and int(r[8]) == 0 and int(r[9]) == 0, r
        assert float(r[6]) <= 113 and int(r[4]) <= 128, r


def test_fp8_register_operand_path_compiles_for_sm90_as_designed():
    """The register-operand path (FP8 tiles in shared memory, `--reg-a`) for e4m3 and e5m2 at
    its launch setting (NUM_BUFS_REG_A buffers, LOAD_REGS, maxnreg 128): no spills, 68 wgmma,
    the FP8 tile's 16-byte cp.async per producer thread (64 x 576 / 16 / 128 = 18), one
    cp.async.mbarrier.arrive, shared memory for two programs per SM."""
    for pool in ("e4m3", "e5m2"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(ROOT)
        spec = f"{ws.NUM_BUFS_REG_A},{ws.LOAD_WARPS},{ws.LOAD_REGS_REG_A}"
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks/compile_ws_report.py"),
                              "--reg-a", "--pool", pool, spec], capture_output=True,
                             text=True, env=env, timeout=300, check=True).stdout
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
                if line[:3] in ("| 1", "| 2", "| 3")]
        assert len(rows) == 1, out
        r = rows[0]
        assert int(r[5]) == 0 and int(r[7]) == 68, r
        assert int(r[8]) == 64 * 576 // 16 // (32 * ws.LOAD_WARPS) and int(r[9]) == 1, r
        assert float(r[6]) <= 113 and r[3] == "128" and int(r[4]) <= 128, r
    assert ws.programs_per_sm(ws.NUM_BUFS_REG_A, fp8_tiles=True) == 2
    assert ws.default_bufs(torch.float8_e4m3fn, reg_a=True) == ws.NUM_BUFS_REG_A
    assert ws.default_bufs(torch.float8_e4m3fn, reg_a=False) == ws.NUM_BUFS
    assert ws.load_regs_for(torch.float8_e5m2, reg_a=False) == ws.LOAD_REGS_FP8
    assert ws.load_regs_for(torch.float8_e5m2, reg_a=True) == ws.LOAD_REGS_REG_A


# (reg_a, launch overrides): both FP8 paths; the register-operand path also with one buffer,
# with one producer warp (its cp.async producer needs no whole tile of registers) and with its
# chunk MMAs waited for at once
FP8_PATHS = [pytest.param(True, {}, id="reg_a"),
             pytest.param(True, dict(num_bufs=1), id="reg_a-1buf"),
             pytest.param(True, dict(load_warps=1), id="reg_a-1warp"),
             pytest.param(True, dict(async_mma=False), id="reg_a-sync"),
             pytest.param(False, {}, id="convert")]


@gpu
@needs_sm90
@pytest.mark.parametrize("reg_a,launch", FP8_PATHS)
@pytest.mark.parametrize("pool_dtype", FP8_POOLS)
def test_gpu_fp8_pool_against_dequantized_reference(pool_dtype, reg_a, launch):
    """FP8 pool, separate k and v scales (each would change the result if ignored: 0.37 and
    2.5), tile and split boundaries, seq_len 0, empty splits, padded and multiple head groups;
    NaN in every slot that must not be read; each FP8 path."""
    for heads, nks, max_splits in ((16, [16] * len(BOUNDARY_LENS), 16), (20, None, 4)):
        case, ref = fp8_case(BOUNDARY_LENS, pool_dtype, 0.37, 2.5, heads=heads, seed=40 + heads)
        out, _ = run_ws(case, nks, max_splits, k_scale=0.37, v_scale=2.5, reg_a=reg_a, **launch)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.float().cpu(), expected(ref), atol=BF16_ATOL,
                                   rtol=BF16_RTOL)
    # the scales matter: a unit v_scale is off by 2.5x
    out, _ = run_ws(case, None, 4, k_scale=0.37, v_scale=1.0, reg_a=reg_a, **launch)
    assert not torch.allclose(out.float().cpu(), expected(ref), atol=0.1, rtol=0.1)


@gpu
@needs_sm90
@pytest.mark.parametrize("pool_dtype", FP8_POOLS)
def test_gpu_fp8_register_operands_match_the_converting_producer(pool_dtype):
    """Both FP8 paths run fp16 products of the same exactly converted values: on a ragged batch
    of 40 requests (lengths 0-2999, one to 16 splits) they agree to bf16 rounding of o, and
    both equal the dequantized reference."""
    g = torch.Generator().manual_seed(43)
    lens = torch.randint(0, 3000, (40,), generator=g).tolist()
    case, ref = fp8_case(lens, pool_dtype, 0.37, 2.5, seed=43)
    outs = []
    for reg_a in (True, False):
        out, _ = run_ws(case, None, 16, k_scale=0.37, v_scale=2.5, reg_a=reg_a)
        torch.testing.assert_close(out.float().cpu(), expected(ref), atol=BF16_ATOL,
                                   rtol=BF16_RTOL)
        outs.append(out.float())
    diff = (outs[0] - outs[1]).abs()
    print(f"reg_a vs convert: max |diff| {diff.max().item():.3e}, mean {diff.mean().item():.3e}")
    torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=1e-2)


@gpu
@needs_sm90
def test_gpu_fp8_pool_refusals():
    """An fp16 q over an FP8 pool is not the ws kernel's (ws_supported False); fewer than 4
    producer warps with the converting producer is a ValueError."""
    case, _ = fp8_case([5, 70], torch.float8_e4m3fn, 1.0, 1.0, seed=42)
    assert ws.ws_supported(case.q, case.k_buffer)
    assert not ws.ws_supported(case.q.half(), case.k_buffer)
    with pytest.raises(ValueError, match="producer warps"):
        run_ws(case, None, 4, load_warps=1, reg_a=False)


@gpu
@needs_sm90
def test_gpu_fp8_pool_dispatch_and_triton_path_agree(monkeypatch):
    """decode_attention_fwd hands an MLA FP8 pool at bs >= WS_MLA_MIN_BS to the ws kernel (one
    call counted) and, with the switch off, to the converting triton kernel: both equal the
    dequantized reference (distinct k and v scales, so a swap would show), and each other."""
    import mla_kernels.decode_attention as da
    from mla_kernels.decode_attention import decode_attention_fwd, get_num_kv_splits

    g = torch.Generator().manual_seed(41)
    lens = torch.randint(0, 3000, (max(da.WS_MLA_MIN_BS, 24),), generator=g).tolist()
    case, ref = fp8_case(lens, torch.float8_e4m3fn, 0.37, 2.5, seed=41)
    calls = []
    real = ws.mla_decode_ws_fwd
    monkeypatch.setattr(ws, "mla_decode_ws_fwd",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    bs = len(lens)
    nks = get_num_kv_splits(case.seq_lens, 1, 16, 132, head_dim=LK)
    outs = []
    for switch in (da.WS_MLA_MIN_BS, None):
        monkeypatch.setattr(da, "WS_MLA_MIN_BS", switch)
        o = torch.empty(bs, 16, LV, dtype=torch.bfloat16, device="cuda")
        decode_attention_fwd(case.q, case.k_buffer, case.v_buffer, o, case.req_to_token,
                             case.req_pool_indices, case.seq_lens, nks, 16,
                             torch.empty(bs, 16, 16, LV, device="cuda"),
                             torch.empty(bs, 16, 16, device="cuda"), case.sm_scale, 0.37, 2.5)
        torch.testing.assert_close(o.float().cpu(), expected(ref), atol=BF16_ATOL,
                                   rtol=BF16_RTOL)
        outs.append(o.float())
    assert len(calls) == 1
    torch.testing.assert_close(outs[0], outs[1], atol=BF16_ATOL, rtol=BF16_RTOL)
