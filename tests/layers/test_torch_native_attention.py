"""`TorchNativeAttnBackend` vs a float64 per-query reference, over real slot pools.

Pools get scattered (shuffled) slots so the req_to_token indirection is exercised; prefixes are
written straight into the pool buffers, new tokens go through the backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mla_backend.forward_batch import ForwardBatch, ForwardMode
from mla_backend.layers.attention.torch_native import TorchNativeAttnBackend
from mla_backend.layers.radix_attention import RadixAttention
from mla_backend.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)

POOL_SIZE = 64


@dataclass
class Case:
    fb: ForwardBatch
    keys: list[torch.Tensor]  # per request [seq_len, KV, D]: all keys in position order
    values: list[torch.Tensor]  # per request [seq_len, KV, Dv]
    k_new: torch.Tensor  # [T, KV, D]
    v_new: torch.Tensor | None  # [T, KV, Dv]


def _build(pool, mode, prefix_lens, new_lens, kv_heads, head_dim, v_head_dim, mla_rank=None,
           seed=0, dtype=torch.float32) -> Case:
    g = torch.Generator().manual_seed(seed)
    req_pool = ReqToTokenPool(8, 32)
    slots = (torch.randperm(POOL_SIZE, generator=g) + 1)  # shuffled real slots 1..64
    rows = [5, 0, 3, 7][: len(prefix_lens)]
    next_slot = 0
    keys, values, k_new, v_new, out_loc, input_pos = [], [], [], [], [], []
    for row, p, n in zip(rows, prefix_lens, new_lens):
        s = slots[next_slot: next_slot + p + n]
        next_slot += p + n
        req_pool.req_to_token[row, : p + n] = s.to(torch.int32)
        k = torch.randn(p + n, kv_heads, head_dim, generator=g).to(dtype)
        if mla_rank is None:
            v = torch.randn(p + n, kv_heads, v_head_dim, generator=g).to(dtype)
            pool.set_kv_buffer(0, s[:p], k[:p], v[:p])
            v_new.append(v[p:])
        else:
            v = k[..., :mla_rank]
            pool.set_kv_buffer(0, s[:p], k[:p], None)
        keys.append(k)
        values.append(v)
        k_new.append(k[p:])
        out_loc.append(s[p:])
        input_pos += list(range(p, p + n))
    seq = [p + n for p, n in zip(prefix_lens, new_lens)]
    t = sum(new_lens)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=len(seq), input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.tensor(input_pos), req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq), out_cache_loc=torch.cat(out_loc).long(), seq_lens_cpu=seq,
        extend_prefix_lens_cpu=list(prefix_lens), extend_seq_lens_cpu=list(new_lens),
        req_to_token_pool=req_pool, token_to_kv_pool=pool, attn_backend=TorchNativeAttnBackend())
    return Case(fb, keys, values, torch.cat(k_new),
                torch.cat(v_new) if mla_rank is None else None)


def _reference(q, case: Case, scaling: float, pool_free: bool = False) -> torch.Tensor:
    """[T, H, Dv] float64, one query and one head at a time."""
    fb = case.fb
    heads, kv = q.shape[1], case.keys[0].shape[1]
    outs = []
    for i, (start, n) in enumerate(zip(fb.extend_start_loc_cpu, fb.extend_seq_lens_cpu)):
        p = fb.extend_prefix_lens_cpu[i]
        k_all, v_all = case.keys[i].double(), case.values[i].double()
        if pool_free:
            k_all, v_all, p = k_all[-n:], v_all[-n:], 0
        for j in range(n):
            row = []
            for h in range(heads):
                kh = k_all[: p + j + 1, h // (heads // kv)]
                vh = v_all[: p + j + 1, h // (heads // kv)]
                w = torch.softmax((kh @ q[start + j, h].double()) * scaling, dim=0)
                row.append(w @ vh)
            outs.append(torch.stack(row))
    return torch.stack(outs)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,v_head_dim",
    [(4, 2, 16, 16), (4, 4, 8, 8), (6, 1, 24, 16)],  # GQA, MHA, MQA with v_head_dim < head_dim
)
def test_extend_mha_pool(heads, kv_heads, head_dim, v_head_dim):
    pool = MHATokenToKVPool(POOL_SIZE, torch.float32, kv_heads, head_dim, v_head_dim, 1, "cpu")
    case = _build(pool, ForwardMode.EXTEND, [0, 3, 5], [4, 1, 6], kv_heads, head_dim, v_head_dim)
    layer = RadixAttention(heads, head_dim, 0.3, kv_heads, 0, v_head_dim)
    q = torch.randn(case.fb.num_tokens, heads, head_dim, generator=torch.Generator().manual_seed(9))
    case.fb.attn_backend.init_forward_metadata(case.fb)
    out = layer(q, case.k_new, case.v_new, case.fb)
    assert out.shape == (case.fb.num_tokens, heads * v_head_dim)
    want = _reference(q, case, 0.3)
    torch.testing.assert_close(out.double(), want.reshape(out.shape), atol=1e-5, rtol=1e-5)
    # The new tokens' K/V are now in the pool at out_cache_loc.
    loc = case.fb.out_cache_loc
    torch.testing.assert_close(pool.get_key_buffer(0)[loc], case.k_new, atol=0, rtol=0)
    torch.testing.assert_close(pool.get_value_buffer(0)[loc], case.v_new, atol=0, rtol=0)
    assert pool.get_key_buffer(0)[0].abs().sum() == 0  # the sink slot is never written


def test_decode_mha_pool():
    pool = MHATokenToKVPool(POOL_SIZE, torch.float32, 2, 16, 16, 1, "cpu")
    case = _build(pool, ForwardMode.DECODE, [0, 6, 12, 2], [1, 1, 1, 1], 2, 16, 16, seed=1)
    layer = RadixAttention(4, 16, 0.25, 2, 0)
    q = torch.randn(4, 4 * 16, generator=torch.Generator().manual_seed(3))  # flat q accepted
    case.fb.attn_backend.init_forward_metadata(case.fb)
    out = layer(q, case.k_new.reshape(4, -1), case.v_new.reshape(4, -1), case.fb)
    want = _reference(q.reshape(4, 4, 16), case, 0.25)
    torch.testing.assert_close(out.double(), want.reshape(out.shape), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_mla_pool_value_is_latent_view(mode):
    rank, rope = 32, 8
    pool = MLATokenToKVPool(POOL_SIZE, torch.float32, rank, rope, 1, "cpu")
    new = [3, 2, 5] if mode == ForwardMode.EXTEND else [1, 1, 1]
    case = _build(pool, mode, [4, 0, 7], new, 1, rank + rope, rank, mla_rank=rank, seed=2)
    layer = RadixAttention(4, rank + rope, 0.11, 1, 0, v_head_dim=rank)
    q = torch.randn(case.fb.num_tokens, 4, rank + rope, generator=torch.Generator().manual_seed(4))
    case.fb.attn_backend.init_forward_metadata(case.fb)
    out = layer(q, case.k_new, None, case.fb)
    want = _reference(q, case, 0.11)
    torch.testing.assert_close(out.double(), want.reshape(out.shape), atol=1e-5, rtol=1e-5)


def test_pool_free_attends_only_new_tokens_and_leaves_pool_alone():
    pool = MHATokenToKVPool(POOL_SIZE, torch.float32, 4, 12, 8, 1, "cpu")
    case = _build(pool, ForwardMode.EXTEND, [0, 0], [5, 3], 4, 12, 8, seed=5)
    before = pool.get_key_buffer(0).clone()
    layer = RadixAttention(4, 12, 0.2, 4, 0, v_head_dim=8, pool_free=True)
    q = torch.randn(8, 4, 12, generator=torch.Generator().manual_seed(6))
    case.fb.attn_backend.init_forward_metadata(case.fb)
    out = layer(q, case.k_new, case.v_new, case.fb)
    want = _reference(q, case, 0.2, pool_free=True)
    torch.testing.assert_close(out.double(), want.reshape(out.shape), atol=1e-5, rtol=1e-5)
    assert torch.equal(pool.get_key_buffer(0), before)


def test_no_save_reads_kv_already_in_pool():
    pool = MHATokenToKVPool(POOL_SIZE, torch.float32, 2, 8, 8, 1, "cpu")
    case = _build(pool, ForwardMode.EXTEND, [2, 1], [3, 2], 2, 8, 8, seed=7)
    pool.set_kv_buffer(0, case.fb.out_cache_loc, case.k_new, case.v_new)  # caller wrote them
    layer = RadixAttention(2, 8, 0.35, 2, 0)
    q = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(8))
    case.fb.attn_backend.init_forward_metadata(case.fb)
    out = layer(q, None, None, case.fb, save_kv_cache=False)
    want = _reference(q, case, 0.35)
    torch.testing.assert_close(out.double(), want.reshape(out.shape), atol=1e-5, rtol=1e-5)


def test_bf16_pool_and_queries():
    pool = MHATokenToKVPool(POOL_SIZE, torch.bfloat16, 2, 16, 16, 1, "cpu")
    case = _build(pool, ForwardMode.EXTEND, [3, 0], [2, 4], 2, 16, 16, seed=10,
                  dtype=torch.bfloat16)
    layer = RadixAttention(4, 16, 0.25, 2, 0)
    q = torch.randn(6, 4, 16, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    case.fb.attn_backend.init_forward_metadata(case.fb)
    out = layer(q, case.k_new, case.v_new, case.fb)
    assert out.dtype == torch.bfloat16
    want = _reference(q, case, 0.25)
    torch.testing.assert_close(out.double(), want.reshape(out.shape), atol=2e-2, rtol=2e-2)


def test_rows_not_matching_out_cache_loc_is_an_error():
    pool = MHATokenToKVPool(POOL_SIZE, torch.float32, 2, 8, 8, 1, "cpu")
    case = _build(pool, ForwardMode.EXTEND, [1], [2], 2, 8, 8)
    case.fb.out_cache_loc = case.fb.out_cache_loc.flip(0)
    with pytest.raises(ValueError, match="out_cache_loc"):
        case.fb.attn_backend.init_forward_metadata(case.fb)


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_pool_free_preconditions_are_checked_alike(backend):
    """`base.check_pool_free`, shared by every backend: a pool_free extend without v, or over a
    request with a cached prefix, is refused before anything is computed or stored."""
    from mla_backend.layers.attention.triton_backend import TritonAttnBackend

    pool = MHATokenToKVPool(POOL_SIZE, torch.float32, 4, 12, 8, 1, "cpu")
    layer = RadixAttention(4, 12, 0.2, 4, 0, v_head_dim=8, pool_free=True)
    for prefix, drop_v, message in (([0, 0], True, "needs the new k and v"),
                                    ([2, 0], False, "without a cached prefix")):
        case = _build(pool, ForwardMode.EXTEND, prefix, [5, 3], 4, 12, 8, seed=7)
        if backend == "triton":
            case.fb.attn_backend = TritonAttnBackend(torch.device("cpu"))
        case.fb.attn_backend.init_forward_metadata(case.fb)
        before = pool.get_key_buffer(0).clone()
        q = torch.randn(8, 4, 12, generator=torch.Generator().manual_seed(8))
        with pytest.raises(ValueError, match=message):
            layer(q, case.k_new, None if drop_v else case.v_new, case.fb)
        assert torch.equal(pool.get_key_buffer(0), before)
