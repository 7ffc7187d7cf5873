"""Pools: shapes, dtypes, the MLA value view, the sink slot, alloc/free round trips."""

from __future__ import annotations

import pytest
import torch

from mla_backend.mem_cache.memory_pool import (
    KVPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)


def test_req_to_token_pool_alloc_free_round_trip():
    pool = ReqToTokenPool(4, 16, "cpu")
    assert pool.req_to_token.shape == (4, 16) and pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(3)
    assert rows is not None and sorted(rows) == [0, 1, 2] and pool.available_size() == 1
    assert pool.alloc(2) is None and pool.available_size() == 1  # nothing taken on failure
    pool.free(rows[1])
    pool.free([rows[0], rows[2]])
    assert pool.available_size() == 4
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        pool.free(7)
    pool.free(0)
    with pytest.raises(ValueError, match="already free"):
        pool.free(0)


def test_allocator_never_hands_out_the_sink_and_round_trips():
    alloc = TokenToKVPoolAllocator(10, "cpu")
    a = alloc.alloc(4)
    b = alloc.alloc(6)
    assert a.dtype == torch.int64 and a.device.type == "cpu"
    got = sorted(torch.cat([a, b]).tolist())
    assert got == list(range(1, 11))  # slot 0 is the sink
    assert alloc.available_size() == 0 and alloc.alloc(1) is None
    assert alloc.alloc(0).numel() == 0
    alloc.free(b[2:])
    alloc.free(a)
    assert alloc.available_size() == 8
    again = alloc.alloc(8)
    assert sorted(again.tolist()) == sorted(a.tolist() + b[2:].tolist())
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([0]))
    with pytest.raises(ValueError):
        alloc.free(torch.tensor([11]))


def test_allocator_frees_lazily_in_free_order():
    """Freed slots are kept aside and merged only when an alloc needs them: they come back after
    every never-used slot, in the order they were freed, and count as available at once."""
    alloc = TokenToKVPoolAllocator(10, "cpu")
    first = alloc.alloc(6)  # slots 1..6; 7..10 stay free
    alloc.free(first[4:])  # 5, 6
    alloc.free(first[:2])  # 1, 2
    assert alloc.available_size() == 8
    assert alloc.alloc(3).tolist() == [7, 8, 9]  # served from the never-used slots
    assert alloc.alloc(5).tolist() == [10, 5, 6, 1, 2]  # then the freed ones, in free order
    assert alloc.available_size() == 0 and alloc.alloc(1) is None


def test_req_to_token_writes_reach_both_copies_and_reads_use_the_host():
    pool = ReqToTokenPool(3, 8, "cpu")
    assert pool.req_to_token_host is pool.req_to_token  # on a CPU device: one table
    pool.write_row(1, 2, torch.tensor([5, 6, 7]))
    pool.write_positions([0, 2], [7, 0], torch.tensor([9, 4]))
    assert pool.read_row(1, 0, 6).tolist() == [0, 0, 5, 6, 7, 0]
    assert pool.read_row(1, 2, 5).dtype == torch.int64
    assert int(pool.req_to_token[0, 7]) == 9 and int(pool.req_to_token[2, 0]) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_req_to_token_host_copy_mirrors_the_device_table():
    pool = ReqToTokenPool(3, 8, "cuda")
    assert pool.req_to_token_host.device.type == "cpu"
    pool.write_row(1, 2, torch.tensor([5, 6, 7]))
    pool.write_positions([0, 2], [7, 0], torch.tensor([9, 4]))
    assert torch.equal(pool.req_to_token.cpu(), pool.req_to_token_host)
    assert pool.read_row(1, 2, 5).tolist() == [5, 6, 7]


def test_mha_pool_shapes_and_writes():
    pool = MHATokenToKVPool(8, torch.float32, head_num=2, head_dim=4, v_head_dim=3,
                            layer_num=3, device="cpu")
    assert isinstance(pool, KVPool)
    k, v = pool.get_kv_buffer(1)
    assert k.shape == (9, 2, 4) and v.shape == (9, 2, 3) and k.dtype == torch.float32
    loc = torch.tensor([3, 5])
    ck, cv = torch.randn(2, 2, 4, dtype=torch.float64), torch.randn(2, 2, 3)
    pool.set_kv_buffer(1, loc, ck, cv)
    torch.testing.assert_close(pool.get_key_buffer(1)[loc], ck.float())
    torch.testing.assert_close(pool.get_value_buffer(1)[loc], cv)
    assert pool.get_key_buffer(0).abs().sum() == 0  # other layers untouched
    assert pool.get_key_buffer(1)[0].abs().sum() == 0  # sink untouched
    assert pool.cell_bytes() == 2 * (4 + 3) * 4 * 3
    with pytest.raises(ValueError):
        pool.set_kv_buffer(0, loc, ck, None)


def test_mla_pool_value_is_a_view_of_the_latent():
    rank, rope = 6, 2
    pool = MLATokenToKVPool(5, torch.float32, kv_lora_rank=rank, qk_rope_head_dim=rope,
                            layer_num=2, device="cpu")
    k, v = pool.get_kv_buffer(0)
    assert k.shape == (6, 1, rank + rope) and v.shape == (6, 1, rank)
    assert v.data_ptr() == k.data_ptr()  # same storage, first kv_lora_rank columns
    loc = torch.tensor([1, 4])
    ck = torch.randn(2, 1, rank + rope)
    pool.set_kv_buffer(0, loc, ck, torch.full((2, 1, rank), 99.0))  # cache_v ignored
    torch.testing.assert_close(pool.get_value_buffer(0)[loc], ck[..., :rank])
    torch.testing.assert_close(pool.get_key_buffer(0)[loc], ck)
    assert pool.get_key_buffer(1).abs().sum() == 0
    # DeepSeek-V2-Lite geometry: 576 values per layer
    big = MLATokenToKVPool(1, torch.bfloat16, 512, 64, 27, "cpu")
    assert big.cell_bytes() == 576 * 2 * 27
