"""extend_attention_fwd against the float32 twin `extend_attention_ref`.

CPU (CI): the triton interpreter in fp32, small grids around the interpreter's block sizes.
GPU (`gpu` marker, H200): the same layouts in bf16 against fp32 references of the same bf16 data,
at the CUDA block sizes, plus slots near the end of a pool of more than 2^31 elements.
"""

from __future__ import annotations

import pytest
import torch

from mla_kernels.extend_attention import (
    extend_attention_fwd,
    extend_block_sizes,
    split_head_dim,
)
from mla_kernels.reference import extend_attention_ref

# the interpreter converts 1-element arrays to loop bounds with a numpy deprecation warning
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# bf16 inputs, fp32 reference on the same bf16 values: the error comes from rounding P to bf16
# before the PV product and from rounding the output; |o| <= max|v| ~ 4 for N(0, 1) data.
BF16_ATOL, BF16_RTOL = 2e-2, 2e-2
FP32_ATOL, FP32_RTOL = 2e-5, 1e-5


def make_case(prefix: list[int], extend: list[int], h: int, hkv: int, lq: int, lv: int, *,
              mla: bool = False, dtype: torch.dtype = torch.float32, device: str = "cpu",
              spare_slots: int = 7, slot_base: int = 0, pool_slots: int | None = None,
              seed: int = 0, scale: float = 0.125) -> dict:
    """Random batch with the new tokens' KV already written into the pool (the reference's
    contract). Slots are a random permutation of 1..n (+ slot_base), rows of req_to_token are
    shuffled; MLA (mla=True): v tensors are views of the first lv columns of the k tensors."""
    g = torch.Generator().manual_seed(seed)
    bs, total = len(prefix), sum(prefix) + sum(extend)
    n_slots = pool_slots if pool_slots is not None else slot_base + total + spare_slots + 1

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    k_buffer = torch.zeros(n_slots, hkv, lq, dtype=dtype, device=device)
    v_buffer = k_buffer[..., :lv] if mla else torch.zeros(n_slots, hkv, lv, dtype=dtype,
                                                          device=device)
    slots = (torch.randperm(total + spare_slots, generator=g)[:total] + 1 + slot_base)
    n_rows = bs + 3
    req_to_token = torch.zeros(n_rows, max(prefix[i] + extend[i] for i in range(bs)) + 5,
                               dtype=torch.int32)
    rows = torch.randperm(n_rows, generator=g)[:bs]
    t = sum(extend)
    q = rnd(t, h, lq)
    k = rnd(t, hkv, lq)
    v = k[..., :lv] if mla else rnd(t, hkv, lv)
    starts, used, start = [], 0, 0
    for i in range(bs):
        n = prefix[i] + extend[i]
        s = slots[used:used + n]
        used += n
        req_to_token[rows[i], :n] = s.to(torch.int32)
        s = s.to(device)
        k_buffer[s[:prefix[i]]] = rnd(prefix[i], hkv, lq).to(device)
        if not mla:
            v_buffer[s[:prefix[i]]] = rnd(prefix[i], hkv, lv).to(device)
        k_buffer[s[prefix[i]:]] = k[start:start + extend[i]].to(device)
        if not mla:
            v_buffer[s[prefix[i]:]] = v[start:start + extend[i]].to(device)
        starts.append(start)
        start += extend[i]
    q, k = q.to(device), k.to(device)
    v = k[..., :lv] if mla else v.to(device)
    return dict(q=q, k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer,
                req_to_token=req_to_token.to(device), rows=rows.to(device),
                prefix=torch.tensor(prefix, dtype=torch.int64, device=device),
                extend=torch.tensor(extend, dtype=torch.int32, device=device),
                starts=torch.tensor(starts, dtype=torch.int32, device=device), scale=scale)


def run_kernel(c: dict, *, pool_free: bool = False, out: torch.Tensor | None = None,
               max_extend: int | None = None) -> torch.Tensor:
    t, h, _ = c["q"].shape
    o = out if out is not None else torch.full((t, h, c["v"].shape[2]), float("nan"),
                                               dtype=c["q"].dtype, device=c["q"].device)
    extend_attention_fwd(c["q"], c["k"], c["v"], o,
                         None if pool_free else c["k_buffer"], None if pool_free else c["v_buffer"],
                         c["req_to_token"], c["rows"], c["prefix"], c["extend"], c["starts"],
                         max_extend if max_extend is not None else int(c["extend"].max()),
                         c["scale"])
    return o


def reference(c: dict) -> torch.Tensor:
    # the twin upcasts only the gathered rows (the big-pool buffers are not copied)
    return extend_attention_ref(c["q"].float(), c["k_buffer"], c["v_buffer"],
                                c["req_to_token"], c["rows"], c["prefix"], c["extend"], c["scale"])


def check(c: dict, **kw) -> None:
    out = run_kernel(c, **kw).float()
    ref = reference(c)
    if c["q"].dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=FP32_ATOL, rtol=FP32_RTOL)
    else:
        torch.testing.assert_close(out, ref, atol=BF16_ATOL, rtol=BF16_RTOL)


def boundary_lens(lq: int, device: str) -> list[int]:
    """Lengths at and around this device's BLOCK_N / BLOCK_M for head dim lq."""
    bm, bn, _ = extend_block_sizes(lq, torch.device(device))
    return sorted({1, bn - 1, bn, bn + 1, bm - 1, bm, bm + 1})


# ----------------------------------------------------------------------------- layout grids
def ragged_cases(device: str) -> list[tuple]:
    """(prefix, extend, H, Hkv, Lq, Lv, mla, pool_free) cases at the device's block sizes."""
    b = boundary_lens(128, device)  # interpreter: [1, 15, 16, 17, 31, 32, 33]
    bm, bn, _ = extend_block_sizes(128, torch.device(device))
    bmla = boundary_lens(576, device)
    cases = [
        # MHA, ragged batch: prefix 0 / around BLOCK_N, extend 1 / around both block sizes
        ([0, bn - 1, bn, 2 * bn + 1], [1, bm - 1, bm + 1, bn], 2, 2, 128, 128, False, False),
        ([0, 0, 0], [bn, bm, 1], 2, 2, 64, 64, False, False),  # no prefix, prefix phase runs 0x
        ([bm + bn + 3], [1], 3, 3, 128, 128, False, False),  # decode-like extend of 1 token
        ([b[-1], 0], [2 * bm + 1, 3], 2, 2, 128, 128, False, False),  # several query blocks
    ]
    for hkv, group in ((4, 1), (2, 2), (2, 4), (1, 8), (1, 16)):  # GQA groups; Hkv 1 = MQA
        cases.append(([bn + 1, 0], [bm + 1, bn - 1], hkv * group, hkv, 64, 64, False, False))
    for d in (64, 80, 96, 192, 256):  # head dims via masking / split tails
        cases.append(([bn + 3, 1], [bn + 2, bm + 1], 2, 1, d, d, False, False))
    cases += [
        ([3, 0], [bn, 5], 2, 1, 96, 80, False, False),  # Lq != Lv, both non-power-of-two
        # MLA decompressed prefill: qk 192, v 128, no prefix, pool not read (pool_free)
        ([0, 0, 0], [bm + 1, 1, bn], 4, 4, 192, 128, False, True),
        # MLA absorbed extend: qk 576 = 512 + 64, v = first 512 columns, one KV head
        ([0, bmla[2], bmla[-1]], [bmla[-1], 1, bmla[1]], 4, 1, 576, 512, True, False),
    ]
    return cases


def _ids(case: tuple) -> str:
    p, e, h, hkv, lq, lv, mla, free = case
    return f"p{p}-e{e}-h{h}x{hkv}-{lq}x{lv}{'-mla' if mla else ''}{'-free' if free else ''}"


CPU_CASES = ragged_cases("cpu")


@pytest.mark.parametrize("case", CPU_CASES, ids=[_ids(c) for c in CPU_CASES])
def test_extend_attention_fp32(case):
    p, e, h, hkv, lq, lv, mla, free = case
    c = make_case(p, e, h, hkv, lq, lv, mla=mla, seed=len(p) + lq + h)
    check(c, pool_free=free)


def test_split_head_dim():
    assert split_head_dim(576) == (512, 64)
    assert split_head_dim(192) == (128, 64)
    assert split_head_dim(128) == (128, 0)
    assert split_head_dim(96) == (64, 32)
    assert split_head_dim(80) == (64, 16)
    assert split_head_dim(100) == (64, 64)
    assert split_head_dim(8) == (16, 0)


def test_zero_length_request_and_padding_rows_untouched():
    # request 1 has no new tokens; T is padded by 4 rows the kernel must leave alone
    c = make_case([4, 9, 0], [17, 0, 6], 2, 1, 64, 64, seed=3)
    t = c["q"].shape[0]
    pad = 4
    for key in ("q", "k", "v"):
        x = c[key]
        c[key] = torch.cat([x, torch.randn(pad, *x.shape[1:])])
    out = torch.full((t + pad, 2, 64), 7.0)
    run_kernel(c, out=out, max_extend=40)  # max_extend_len may exceed the true maximum
    c_ref = dict(c, q=c["q"][:t])
    torch.testing.assert_close(out[:t], reference(c_ref), atol=FP32_ATOL, rtol=FP32_RTOL)
    assert bool((out[t:] == 7.0).all())


def test_prefix_read_through_req_to_token():
    # pointing prefix position 2 at position 11's slot must change the output (the kernel
    # gathers through req_to_token) and still match the reference on the new table. (Swapping
    # two entries would not: every new token sees the whole prefix, and attention over a set of
    # keys ignores their order; only fp32 rounding told the two apart.)
    c = make_case([20], [5], 2, 2, 64, 64, seed=4)
    before = run_kernel(c)
    row = int(c["rows"][0])
    c["req_to_token"][row, 2] = c["req_to_token"][row, 11].clone()
    after = run_kernel(c)
    assert (before - after).abs().max() > 1e-3
    check(c)


def test_errors():
    c = make_case([2], [3], 4, 2, 64, 64)
    o = torch.zeros(3, 4, 64)
    args = (c["req_to_token"], c["rows"], c["prefix"], c["extend"], c["starts"], 3, 0.1)
    with pytest.raises(ValueError, match="multiple"):
        extend_attention_fwd(c["q"][:, :3], c["k"], c["v"], o[:, :3], c["k_buffer"],
                             c["v_buffer"], *args)
    with pytest.raises(ValueError, match="both"):
        extend_attention_fwd(c["q"], c["k"], c["v"], o, c["k_buffer"], None, *args)
    with pytest.raises(ValueError, match="o_extend"):
        extend_attention_fwd(c["q"], c["k"], c["v"], o[..., :32], c["k_buffer"], c["v_buffer"],
                             *args)
    v_strided = torch.zeros(3, 2, 128)[..., ::2]
    with pytest.raises(ValueError, match="stride 1"):
        extend_attention_fwd(c["q"], c["k"], v_strided, o, c["k_buffer"], c["v_buffer"], *args)


# ----------------------------------------------------------------------------- GPU
GPU_CASES = ragged_cases("cuda") if torch.cuda.is_available() else []


@pytest.mark.parametrize("case", GPU_CASES, ids=[_ids(c) for c in GPU_CASES])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_extend_attention_bf16_gpu(case):
    p, e, h, hkv, lq, lv, mla, free = case
    c = make_case(p, e, h, hkv, lq, lv, mla=mla, dtype=torch.bfloat16, device="cuda",
                  seed=len(p) + lq + h)
    check(c, pool_free=free)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_extend_attention_fp32_gpu():
    # fp32 on the GPU uses IEEE dots: tight tolerance at the CUDA block sizes
    bm, bn, _ = extend_block_sizes(128, torch.device("cuda"), torch.float32)
    c = make_case([bn + 1, 0], [bm + 1, 3], 4, 2, 128, 128, device="cuda", seed=9)
    check(c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_extend_attention_big_pool_gpu(mla):
    # pool of > 2^31 elements; every slot of the batch lies in its last few thousand rows
    lq, lv, hkv, h = (576, 512, 1, 4) if mla else (128, 128, 8, 8)
    n_slots = (2**31) // (hkv * lq) + 4096
    bm, bn, _ = extend_block_sizes(lq, torch.device("cuda"))
    prefix, extend = [bm + 5, 0], [bn + 1, 2]
    total = sum(prefix) + sum(extend)
    c = make_case(prefix, extend, h, hkv, lq, lv, mla=mla, dtype=torch.bfloat16, device="cuda",
                  slot_base=n_slots - total - 8, pool_slots=n_slots, spare_slots=6, seed=11)
    assert c["k_buffer"].numel() > 2**31
    assert int(c["req_to_token"].max()) * c["k_buffer"].stride(0) > 2**31
    check(c)
    del c
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_pool_wide_block_m_override(monkeypatch):
    """FP8_POOL_WIDE_BLOCK_M replaces BLOCK_M only for wide heads over an FP8 pool on sm_90+."""
    import mla_kernels.extend_attention as ea

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9:
        pytest.skip("the override is for sm_90+")
    base = extend_block_sizes(576, dev)
    assert extend_block_sizes(576, dev, torch.bfloat16, torch.float8_e4m3fn) == base
    monkeypatch.setattr(ea, "FP8_POOL_WIDE_BLOCK_M", 16)
    assert extend_block_sizes(576, dev, torch.bfloat16, torch.float8_e4m3fn) == (16,) + base[1:]
    assert extend_block_sizes(576, dev, torch.bfloat16, torch.float8_e5m2)[0] == 16
    assert extend_block_sizes(576, dev, torch.bfloat16, torch.bfloat16) == base
    assert extend_block_sizes(192, dev, torch.bfloat16, torch.float8_e4m3fn)[0] != 16
