"""`mla_kernels.decode_attention` (flash-decoding over the slot pool) vs `decode_attention_ref`.

CPU: fp32 under TRITON_INTERPRET=1 (set by conftest), small grids. GPU (`gpu` marker): the same
grids in bf16 against the fp32 reference, plus slot indices near the end of a > 2^31-element pool.

Every case uses a shuffled pool (slots a random permutation, request rows out of order) and
poisons what must never be read: unused slots, req_to_token entries past seq_len, and the rows of
padded (seq_len 0) requests point at NaN K/V; the fp32 workspaces start as NaN so the merge must
only read splits that stage 1 wrote.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mla_kernels.decode_attention import (
    MIN_TOKENS_PER_SPLIT,
    block_n_for,
    decode_attention_fwd,
    get_num_kv_splits,
    heads_per_program,
    num_head_programs,
    splits_per_request,
)
from mla_kernels.reference import decode_attention_ref

# the interpreter warns about numpy scalar conversion on every runtime loop bound
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@dataclass
class Case:
    q: torch.Tensor  # [bs, H, Lk]
    k_buffer: torch.Tensor  # [S, Hkv, Lk]
    v_buffer: torch.Tensor  # [S, Hkv, Lv] (a view of k_buffer for MLA)
    req_to_token: torch.Tensor  # [R, C] int32
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs]
    sm_scale: float


def make_case(seq_lens: list[int], num_heads: int, num_kv_heads: int, lk: int, lv: int,
              mla: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0,
              device: str = DEVICE, seq_dtype: torch.dtype = torch.int32) -> Case:
    """Random case with a shuffled pool; NaN in every K/V slot no live token uses (slot 0 too)."""
    g = torch.Generator().manual_seed(seed)
    bs, total = len(seq_lens), sum(seq_lens)
    num_slots = total + 1 + 7  # slot 0 sink + 7 unused slots
    if mla:
        assert num_kv_heads == 1 and lv <= lk
        k_buffer = torch.randn(num_slots, 1, lk, generator=g)
        v_buffer = None
    else:
        k_buffer = torch.randn(num_slots, num_kv_heads, lk, generator=g)
        v_buffer = torch.randn(num_slots, num_kv_heads, lv, generator=g)
    perm = torch.randperm(num_slots - 1, generator=g) + 1
    used, unused = perm[:total], torch.cat([perm[total:], torch.zeros(1, dtype=torch.long)])
    k_buffer[unused] = float("nan")
    if v_buffer is not None:
        v_buffer[unused] = float("nan")
    poison = int(unused[0])
    num_rows, ctx = bs + 3, max(seq_lens + [1]) + 5
    req_to_token = torch.full((num_rows, ctx), poison, dtype=torch.int32)
    rows = torch.randperm(num_rows, generator=g)[:bs]
    off = 0
    for i, n in enumerate(seq_lens):
        req_to_token[rows[i], :n] = used[off:off + n].to(torch.int32)
        off += n
    q = torch.randn(bs, num_heads, lk, generator=g)
    k_buffer = k_buffer.to(device=device, dtype=dtype)
    v_buffer = k_buffer[..., :lv] if mla else v_buffer.to(device=device, dtype=dtype)
    return Case(q.to(device=device, dtype=dtype), k_buffer, v_buffer, req_to_token.to(device),
                rows.to(device), torch.tensor(seq_lens, dtype=seq_dtype, device=device),
                lk ** -0.5 if not mla else 0.1147)


def run_kernel(case: Case, num_kv_splits: torch.Tensor | list[int] | None, max_kv_splits: int,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    bs, num_heads, _ = case.q.shape
    lv = case.v_buffer.shape[-1]
    dev = case.q.device
    if num_kv_splits is None:
        num_kv_splits = get_num_kv_splits(
            case.seq_lens, num_head_programs(num_heads, case.k_buffer.shape[1], lv),
            max_kv_splits, 132)
    elif isinstance(num_kv_splits, list):
        num_kv_splits = torch.tensor(num_kv_splits, dtype=torch.int32, device=dev)
    o = torch.full((bs, num_heads, lv), 7.0, dtype=out_dtype or case.q.dtype, device=dev)
    logits = torch.full((bs, num_heads, max_kv_splits, lv), float("nan"), device=dev)
    lse = torch.full((bs, num_heads, max_kv_splits), float("nan"), device=dev)
    decode_attention_fwd(case.q, case.k_buffer, case.v_buffer, o, case.req_to_token,
                         case.req_pool_indices, case.seq_lens, num_kv_splits, max_kv_splits,
                         logits, lse, case.sm_scale)
    return o


def expected(case: Case) -> torch.Tensor:
    """fp32 reference; rows with seq_len 0 are defined as zeros."""
    bs, num_heads, _ = case.q.shape
    out = torch.zeros(bs, num_heads, case.v_buffer.shape[-1], dtype=torch.float32)
    live = [i for i in range(bs) if int(case.seq_lens[i]) > 0]
    if live:
        idx = torch.tensor(live, device=case.q.device)
        ref = decode_attention_ref(case.q[idx].cpu(), case.k_buffer.cpu(), case.v_buffer.cpu(),
                                   case.req_to_token.cpu(), case.req_pool_indices[idx].cpu(),
                                   case.seq_lens[idx].cpu(), case.sm_scale)
        out[live] = ref
    return out


def check(case: Case, num_kv_splits=None, max_kv_splits: int = 4, atol: float = 2e-5,
          rtol: float = 2e-4, out_dtype: torch.dtype | None = None) -> None:
    out = run_kernel(case, num_kv_splits, max_kv_splits, out_dtype)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float().cpu(), expected(case), atol=atol, rtol=rtol)


# --- layouts: MHA, GQA groups, MQA, MLA absorbed ------------------------------------------------

LAYOUTS = [
    # (H, Hkv, Lk, Lv, mla)
    pytest.param(4, 4, 64, 64, False, id="mha-64"),
    pytest.param(2, 2, 128, 128, False, id="gqa-g1-128"),
    pytest.param(4, 2, 128, 128, False, id="gqa-g2-128"),
    pytest.param(8, 2, 64, 64, False, id="gqa-g4-64"),
    pytest.param(8, 1, 128, 128, False, id="gqa-g8-128"),
    pytest.param(16, 1, 64, 64, False, id="gqa-g16-64"),
    pytest.param(6, 1, 64, 64, False, id="mqa-6heads"),
    pytest.param(4, 1, 576, 512, True, id="mla-4heads"),
    pytest.param(16, 1, 576, 512, True, id="mla-16heads"),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,lk,lv,mla", LAYOUTS)
def test_layouts_ragged(num_heads, num_kv_heads, lk, lv, mla):
    case = make_case([1, 70, 33, 129], num_heads, num_kv_heads, lk, lv, mla=mla, seed=1)
    check(case, num_kv_splits=[1, 2, 3, 4], max_kv_splits=4)


@pytest.mark.parametrize("swap,reuse", [(False, True), (False, False), (True, True)],
                         ids=["qk-k-reuse", "qk-v-gather", "swap-ab"])
def test_mla_value_view_with_and_without_k_tile_reuse(swap, reuse, monkeypatch):
    """MLA V = strided view k_buffer[..., :512]: read through the K tile or gathered again on the
    untransposed path; the transposed path (SWAP_AB_WIDE) always reads it through the K tile."""
    import mla_kernels.decode_attention as da

    monkeypatch.setattr(da, "REUSE_K_TILE_AS_V", reuse)
    monkeypatch.setattr(da, "SWAP_AB_WIDE", swap)
    case = make_case([45, 2, 70], 16, 1, 576, 512, mla=True, seed=12)
    assert case.v_buffer.stride() == case.k_buffer.stride()
    check(case, num_kv_splits=[2, 1, 3], max_kv_splits=3)


@pytest.mark.parametrize("swap", [False, True], ids=["qk", "swap-ab"])
def test_wide_heads_with_a_separate_value_pool(swap, monkeypatch):
    """Lk 576 / Lv 512 with V in its own buffer (not a view of K): both paths gather V."""
    import mla_kernels.decode_attention as da

    monkeypatch.setattr(da, "SWAP_AB_WIDE", swap)
    case = make_case([45, 2, 70], 16, 1, 576, 512, mla=False, seed=15)
    check(case, num_kv_splits=[2, 1, 3], max_kv_splits=3)


@pytest.mark.parametrize("swap", [False, True], ids=["qk", "swap-ab"])
def test_mla_fewer_heads_and_two_head_programs(swap, monkeypatch):
    """Swapped MLA path with padded head columns (4 heads in a 16-wide program) and with two head
    programs per latent head (32 heads), ragged lengths crossing 64-token tiles."""
    import mla_kernels.decode_attention as da

    monkeypatch.setattr(da, "SWAP_AB_WIDE", swap)
    monkeypatch.setattr(da, "BLOCK_N_WIDE", 64)
    check(make_case([1, 64, 65, 130], 4, 1, 576, 512, mla=True, seed=13),
          num_kv_splits=[1, 1, 2, 3], max_kv_splits=3)
    check(make_case([129, 7], 32, 1, 576, 512, mla=True, seed=14),
          num_kv_splits=[2, 1], max_kv_splits=2)


def test_gqa_group_larger_than_one_program():
    """MLA with 32 heads: two head programs per KV head (16 heads each)."""
    assert heads_per_program(32, 1, 512) == 16 and num_head_programs(32, 1, 512) == 2
    case = make_case([40, 3], 32, 1, 576, 512, mla=True, seed=2)
    check(case, num_kv_splits=[2, 1], max_kv_splits=2)


def test_group_not_multiple_of_program_heads():
    """Group 24 with Lv 512 (cap 16): programs of 16 + 8 heads must not straddle KV heads."""
    assert num_head_programs(48, 2, 512) == 4
    case = make_case([20, 9], 48, 2, 64, 512, seed=3)
    check(case, num_kv_splits=[1, 1], max_kv_splits=1)


# --- head dims ---------------------------------------------------------------------------------

@pytest.mark.parametrize("lk,lv", [(64, 64), (80, 80), (96, 96), (128, 128), (192, 192),
                                   (256, 256), (192, 128), (72, 40), (100, 100)])
def test_head_dims(lk, lv):
    """Pow2, two-part (80 = 64 + 16, 96, 192) and masked (72, 100, Lv 40) head dims."""
    case = make_case([5, 66], 4, 2, lk, lv, seed=lk + lv)
    check(case, num_kv_splits=[1, 2], max_kv_splits=2)


# --- split / block boundaries, empty splits, seq_len 0/1 --------------------------------------

@pytest.mark.parametrize("lk,lv,mla", [(64, 64, False), (576, 512, True)])
def test_block_and_split_boundaries(lk, lv, mla):
    bn = block_n_for(lk)
    lens = [1, bn - 1, bn, bn + 1, 2 * bn, 2 * bn + 1, 3 * bn - 1, 3 * bn + 1]
    splits = [1, 3, 2, 2, 3, 3, 3, 3]
    case = make_case(lens, 4 if mla else 2, 1, lk, lv, mla=mla, seed=5)
    check(case, num_kv_splits=splits, max_kv_splits=3)


def test_small_batch_wide_tile_boundaries(monkeypatch):
    """Up to SMALL_BS_MAX MLA requests in a 16-bit pool take 64-token tiles on the transposed
    path (more requests, or an fp32 pool, take BLOCK_N_WIDE): lengths around the tile and split
    boundaries of that tile. The interpreter runs them in fp32 (its bf16 dot is wrong), so
    fp32 is admitted to the small-batch tiles here (on a GPU they would not fit)."""
    import mla_kernels.decode_attention as da

    bn = block_n_for(576, da.SMALL_BS_MAX, torch.bfloat16)
    assert bn == da.SMALL_BS_BLOCK_N_WIDE != da.BLOCK_N_WIDE
    assert block_n_for(576, da.SMALL_BS_MAX + 1, torch.bfloat16) == da.BLOCK_N_WIDE
    assert block_n_for(576, 1, torch.float32) == da.BLOCK_N_WIDE
    monkeypatch.setattr(da, "SMALL_BS_DTYPES", (torch.float32,))
    assert block_n_for(576, 1, torch.float32) == bn
    for lens, splits in (([1, bn - 1, bn + 1, 3 * bn + 1], [1, 2, 2, 3]), ([2 * bn], [3])):
        check(make_case(lens, 16, 1, 576, 512, mla=True, seed=len(lens)),
              num_kv_splits=splits, max_kv_splits=3)


def test_empty_splits_short_seqs_many_splits():
    """seq_len < splits * BLOCK_N: most splits are empty and are neither computed nor merged
    (their workspace entries stay NaN, which would poison the output if read)."""
    case = make_case([1, 2, 5, 63, 65], 2, 2, 64, 64, seed=6)
    max_splits = 8
    nks = torch.full((5,), max_splits, dtype=torch.int32)
    bs, h = 5, 2
    o = torch.empty(bs, h, 64, device=DEVICE)
    logits = torch.full((bs, h, max_splits, 64), float("nan"), device=DEVICE)
    lse = torch.full((bs, h, max_splits), float("nan"), device=DEVICE)
    decode_attention_fwd(case.q, case.k_buffer, case.v_buffer, o, case.req_to_token,
                         case.req_pool_indices, case.seq_lens, nks.to(DEVICE), max_splits,
                         logits, lse, case.sm_scale)
    torch.testing.assert_close(o.cpu(), expected(case), atol=2e-5, rtol=2e-4)
    # splits are BLOCK_N (64) aligned: lengths <= 64 use split 0 only, 65 uses splits 0 and 1;
    # the other splits were never written
    lse = lse.cpu()
    assert torch.isfinite(lse[:, :, 0]).all() and torch.isfinite(lse[4, :, 1]).all()
    assert torch.isnan(lse[:4, :, 1:]).all() and torch.isnan(lse[4, :, 2:]).all()


def test_merge_skip_single_leaves_one_split_requests_alone():
    """`decode_merge.merge_splits_kernel(SKIP_SINGLE=True)` (the ws kernel's merge): a request
    with exactly one non-empty split keeps its o row (stage 1 wrote it), a seq_len-0 row gets
    zeros, and one with several merges its splits as without the flag."""
    from mla_kernels.decode_merge import merge_split_block, merge_splits_kernel

    g = torch.Generator().manual_seed(12)
    seq_lens = torch.tensor([10, 100, 0, 200, 50], dtype=torch.int32)
    nks = torch.tensor([1, 2, 4, 1, 4], dtype=torch.int32)  # 50 tokens in 4 splits: one used
    bs, h, lv, max_splits = 5, 2, 64, 4
    mid = torch.randn(bs, h, max_splits, lv, generator=g)
    lse = torch.randn(bs, h, max_splits, generator=g)
    o = torch.full((bs, h, lv), 7.0)
    args = [t.to(DEVICE) for t in (mid, lse, o, seq_lens, nks)]
    merge_splits_kernel[(bs, h)](
        *args, mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
        lse.stride(2), o.stride(0), o.stride(1), Lv=lv, MAX_KV_SPLITS=max_splits, BLOCK_DV=lv,
        SPLIT_ALIGN=64, SPLIT_BLOCK=merge_split_block(max_splits), SKIP_SINGLE=True)
    out = args[2].cpu()
    assert (out[[0, 3, 4]] == 7.0).all()
    assert (out[2] == 0).all()
    w = torch.softmax(lse[1, :, :2], dim=-1)  # 100 tokens, 64-token splits: both used
    torch.testing.assert_close(out[1], (w[..., None] * mid[1, :, :2]).sum(1), atol=1e-5,
                               rtol=1e-5)


def test_seq_len_zero_rows_give_zeros():
    """Padded rows (seq_len 0; their req_to_token row points at NaN slots) give zeros and do not
    disturb the other rows."""
    case = make_case([0, 17, 0, 1, 0], 4, 1, 576, 512, mla=True, seed=7)
    check(case, num_kv_splits=[1, 2, 3, 1, 2], max_kv_splits=3)
    out = run_kernel(case, None, 3)
    assert (out[[0, 2, 4]] == 0).all()


def test_seq_len_one_and_int64_seq_lens():
    case = make_case([1, 1, 2], 8, 2, 128, 128, seed=8, seq_dtype=torch.int64)
    check(case, num_kv_splits=None, max_kv_splits=4)


def test_num_kv_splits_out_of_range_is_clamped():
    """0 splits act as 1; more than max_kv_splits act as max_kv_splits."""
    case = make_case([50, 130, 7], 2, 1, 64, 64, seed=9)
    check(case, num_kv_splits=[0, 99, 2], max_kv_splits=2)


def test_heuristic_splits_end_to_end():
    case = make_case([1, 300, 64, 65], 4, 2, 96, 96, seed=10)
    check(case, num_kv_splits=None, max_kv_splits=8)


def test_strided_q_and_o():
    """q and o as slices of wider tensors (only the last dim is contiguous)."""
    case = make_case([10, 70], 4, 2, 64, 64, seed=11)
    wide_q = torch.zeros(2, 4, 100, device=DEVICE)
    wide_q[..., 3:67] = case.q
    q = wide_q[..., 3:67]
    wide_o = torch.full((2, 6, 64), 5.0, device=DEVICE)
    o = wide_o[:, 1:5]
    logits = torch.empty(2, 4, 2, 64, device=DEVICE)
    lse = torch.empty(2, 4, 2, device=DEVICE)
    nks = torch.tensor([1, 2], dtype=torch.int32, device=DEVICE)
    decode_attention_fwd(q, case.k_buffer, case.v_buffer, o, case.req_to_token,
                         case.req_pool_indices, case.seq_lens, nks, 2, logits, lse,
                         case.sm_scale)
    torch.testing.assert_close(o.cpu(), expected(case), atol=2e-5, rtol=2e-4)
    assert (wide_o[:, 0] == 5).all() and (wide_o[:, 5] == 5).all()


def test_bad_arguments_raise():
    case = make_case([3], 4, 2, 64, 64)
    o = torch.empty(1, 4, 64, device=DEVICE)
    nks = torch.ones(1, dtype=torch.int32, device=DEVICE)
    small = torch.empty(1, 4, 1, 64, device=DEVICE)
    lse = torch.empty(1, 4, 2, device=DEVICE)
    with pytest.raises(ValueError):
        decode_attention_fwd(case.q, case.k_buffer, case.v_buffer, o, case.req_to_token,
                             case.req_pool_indices, case.seq_lens, nks, 2, small, lse, 1.0)
    with pytest.raises(ValueError):
        decode_attention_fwd(case.q[:, :3], case.k_buffer, case.v_buffer, o[:, :3],
                             case.req_to_token, case.req_pool_indices, case.seq_lens, nks, 2,
                             small, lse, 1.0)


# --- get_num_kv_splits -----------------------------------------------------------------------

def test_get_num_kv_splits_properties():
    lens = torch.tensor([0, 1, 64, 65, 1000, 100_000], dtype=torch.int32, device=DEVICE)
    s = get_num_kv_splits(lens, 1, 16, 132)
    assert s.dtype == torch.int32 and s.device == lens.device and s.shape == (6,)
    assert s.cpu().tolist() == [1, 1, 1, 2, 16, 16]  # 6 requests: target 528 -> cap 16
    # big batch: one split each, whatever the length
    big = torch.full((1024,), 50_000, dtype=torch.int64, device=DEVICE)
    assert (get_num_kv_splits(big, 8, 16, 132) == 1).all()
    # bs 64, 1 head group, 132 SMs: cdiv(528, 64) = 9 splits at long context
    mid = torch.full((64,), 32768, dtype=torch.int32, device=DEVICE)
    assert (get_num_kv_splits(mid, 1, 16, 132) == 9).all()
    # length-limited: cdiv(len, MIN_TOKENS_PER_SPLIT)
    short = torch.tensor([3 * MIN_TOKENS_PER_SPLIT], device=DEVICE)
    assert int(get_num_kv_splits(short, 1, 64, 132)) == 3
    # monotone in length, always within [1, max]
    rnd = torch.randint(0, 200_000, (300,), device=DEVICE).sort().values
    for bs_groups, mx in [(1, 8), (4, 32), (16, 1)]:
        r = get_num_kv_splits(rnd, bs_groups, mx, 132)
        assert (r >= 1).all() and (r <= mx).all() and (r[1:] >= r[:-1]).all()
    out = torch.zeros(6, dtype=torch.int32, device=DEVICE)
    assert get_num_kv_splits(lens, 1, 16, 132, out=out) is out and out.cpu().tolist()[4] == 16
    # wide heads (MLA 576) in a 16-bit pool: WIDE_PROGRAMS_PER_SM (2) x 132 = 264 programs,
    # splits rounded down; an FP8 pool too at bs >= WS_MLA_MIN_BS (the ws kernel's plan), the
    # narrow plan below it (the triton kernel's)
    assert (get_num_kv_splits(mid, 1, 16, 132, head_dim=576) == 4).all()  # 256 programs
    assert (get_num_kv_splits(mid, 1, 16, 132, head_dim=576, kv_dtype=torch.bfloat16) == 4).all()
    assert (get_num_kv_splits(mid, 1, 16, 132, head_dim=576,
                              kv_dtype=torch.float8_e4m3fn) == 4).all()
    assert splits_per_request(8, 1, 132, 576, torch.float8_e5m2) == 66  # cdiv(4 x 132, 8)
    assert splits_per_request(8, 1, 132, 576, torch.bfloat16) == 33  # 2 x 132 // 8
    wide256 = torch.full((256,), 4096, dtype=torch.int32, device=DEVICE)
    assert (get_num_kv_splits(wide256, 1, 16, 132, head_dim=576) == 1).all()
    assert (get_num_kv_splits(wide256[:100], 1, 16, 132, head_dim=576) == 2).all()
    assert splits_per_request(64, 1, 132, 576) == 4 and splits_per_request(64, 1, 132, 128) == 9
    assert splits_per_request(64, 1, 132, 576, torch.float8_e5m2) == 4
    import mla_kernels.decode_attention as da

    ws_min = da.WS_MLA_MIN_BS
    try:
        da.WS_MLA_MIN_BS = None  # the ws kernel off: FP8 pools keep the narrow plan
        assert splits_per_request(64, 1, 132, 576, torch.float8_e5m2) == 9
    finally:
        da.WS_MLA_MIN_BS = ws_min
    assert splits_per_request(1000, 8, 132, 576) == 1 and splits_per_request(1000, 8, 132) == 1
    with pytest.raises(ValueError):
        get_num_kv_splits(lens, 1, 0, 132)


def test_transposed_path_selection(monkeypatch):
    """The transposed path: wide heads, 16-bit pool, bs <= SWAP_AB_MAX_BS, switch on."""
    import mla_kernels.decode_attention as da

    assert da.transposed_path(64, 576, torch.bfloat16) and da.transposed_path(1, 576)
    assert not da.transposed_path(da.SWAP_AB_MAX_BS + 1, 576, torch.bfloat16)
    assert not da.transposed_path(8, 576, torch.float8_e4m3fn)
    assert not da.transposed_path(8, 128, torch.bfloat16)
    monkeypatch.setattr(da, "SWAP_AB_WIDE", False)
    assert not da.transposed_path(8, 576, torch.bfloat16)


def test_head_program_helpers():
    assert heads_per_program(16, 1, 512) == 16  # V2-Lite MLA: one program per request/split
    assert heads_per_program(32, 8, 128) == 4
    assert heads_per_program(128, 1, 128) == 64
    assert num_head_programs(128, 1, 512) == 8
    with pytest.raises(ValueError):
        heads_per_program(6, 4, 64)


# --- GPU: bf16 vs fp32 reference, big pool ------------------------------------------------------

BF16_ATOL, BF16_RTOL = 2e-2, 2e-2  # bf16 inputs; p rounded to bf16 before P·V


@gpu
@needs_cuda
def test_gpu_mla_large_batch_dispatches_to_ws_kernel(monkeypatch):
    """MLA bf16 at bs >= WS_MLA_MIN_BS goes to the warp-specialized kernel on sm_90 (one call
    counted), below it and with the switch off to the triton kernel; all equal the reference."""
    import mla_kernels.decode_attention as da
    import mla_kernels.decode_attention_ws as ws

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the ws kernel is sm_90 only")
    lens = [(37 * i) % 700 for i in range(da.WS_MLA_MIN_BS)]  # includes seq_len 0
    case = make_case(lens, 16, 1, 576, 512, mla=True, dtype=torch.bfloat16, seed=5)
    calls = []
    real = ws.mla_decode_ws_fwd
    monkeypatch.setattr(ws, "mla_decode_ws_fwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    check(case, num_kv_splits=None, max_kv_splits=16, atol=BF16_ATOL, rtol=BF16_RTOL)
    assert len(calls) == 1
    monkeypatch.setattr(da, "WS_MLA_MIN_BS", None)
    check(case, num_kv_splits=None, max_kv_splits=16, atol=BF16_ATOL, rtol=BF16_RTOL)
    assert len(calls) == 1


@gpu
@needs_cuda
@pytest.mark.parametrize("num_heads,num_kv_heads,lk,lv,mla", LAYOUTS)
def test_gpu_bf16_layouts(num_heads, num_kv_heads, lk, lv, mla):
    case = make_case([1, 70, 33, 129, 0, 4000], num_heads, num_kv_heads, lk, lv, mla=mla,
                     dtype=torch.bfloat16, seed=21)
    check(case, num_kv_splits=None, max_kv_splits=16, atol=BF16_ATOL, rtol=BF16_RTOL)
    check(case, num_kv_splits=[1, 2, 3, 4, 5, 16], max_kv_splits=16, atol=BF16_ATOL,
          rtol=BF16_RTOL)


@gpu
@needs_cuda
@pytest.mark.parametrize("lk,lv", [(64, 64), (80, 80), (96, 96), (128, 128), (192, 192),
                                   (256, 256), (192, 128), (72, 40), (100, 100)])
def test_gpu_bf16_head_dims(lk, lv):
    case = make_case([5, 66, 1000], 8, 2, lk, lv, dtype=torch.bfloat16, seed=lk)
    check(case, num_kv_splits=None, max_kv_splits=8, atol=BF16_ATOL, rtol=BF16_RTOL)


@gpu
@needs_cuda
def test_gpu_fp32_matches_tightly():
    case = make_case([1, 65, 2049], 16, 1, 576, 512, mla=True, seed=22)
    check(case, num_kv_splits=None, max_kv_splits=16, atol=1e-4, rtol=1e-4)


@gpu
@needs_cuda
def test_gpu_bf16_boundaries_and_empty_splits():
    for mla in (False, True):
        lk, lv = (576, 512) if mla else (128, 128)
        bn = block_n_for(lk)
        lens = [1, bn - 1, bn, bn + 1, 2 * bn + 1, 7 * bn, 16 * bn + 1, 0, 3]
        case = make_case(lens, 16, 1 if mla else 4, lk, lv, mla=mla, dtype=torch.bfloat16,
                         seed=23)
        check(case, num_kv_splits=[16] * len(lens), max_kv_splits=16, atol=BF16_ATOL,
              rtol=BF16_RTOL)


@gpu
@needs_cuda
@pytest.mark.parametrize("bn,warps,stages,mla", [(64, 4, 3, True), (64, 8, 3, True),
                                                 (32, 4, 5, True), (32, 4, 9, True),
                                                 (16, 4, 9, True), (32, 4, 5, False)])
def test_gpu_mla_swap_ab_settings(bn, warps, stages, mla, monkeypatch):
    """The transposed-product path for wide heads (warpgroup MMAs when the tile is >= 64 tokens)
    in bf16 for the launch settings the tuning sweep tries, V a view of K (MLA) or its own buffer:
    tile boundaries, empty splits, padded rows."""
    import mla_kernels.decode_attention as da

    for name, value in (("SWAP_AB_WIDE", True), ("SWAP_AB_MAX_BS", 1 << 30), ("BLOCK_N_WIDE", bn),
                        ("STAGE1_NUM_WARPS", warps), ("STAGE1_NUM_STAGES_SWAP", stages)):
        monkeypatch.setattr(da, name, value)
    lens = [1, bn - 1, bn, bn + 1, 2 * bn + 1, 7 * bn, 16 * bn + 1, 0, 3, 4000]
    for heads in (16, 4):
        case = make_case(lens, heads, 1, 576, 512, mla=mla, dtype=torch.bfloat16, seed=25)
        check(case, num_kv_splits=[16] * len(lens), max_kv_splits=16, atol=BF16_ATOL,
              rtol=BF16_RTOL)
        check(case, num_kv_splits=None, max_kv_splits=4, atol=BF16_ATOL, rtol=BF16_RTOL)


@gpu
@needs_cuda
def test_gpu_big_pool_slots_near_the_end():
    """bf16 MLA pool of 4M slots x 576 = 2.4e9 elements (> 2^31): slot x stride overflows int32."""
    num_slots, lk, lv, heads = 4 * 1024 * 1024, 576, 512, 16
    try:
        k_buffer = torch.empty(num_slots, 1, lk, dtype=torch.bfloat16, device="cuda")
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 4.8 GB pool")
    g = torch.Generator().manual_seed(24)
    lens = [300, 77, 1]
    total = sum(lens)
    slots = num_slots - 1 - torch.randperm(4096, generator=g)[:total]  # last 4096 slots
    assert int(slots.min()) * lk > 2 ** 31
    k_buffer[slots.cuda()] = torch.randn(total, 1, lk, generator=g).to("cuda", torch.bfloat16)
    req_to_token = torch.zeros(4, 400, dtype=torch.int32)
    off = 0
    for i, n in enumerate(lens):
        req_to_token[i + 1, :n] = slots[off:off + n].to(torch.int32)
        off += n
    q = torch.randn(3, heads, lk, generator=g).to("cuda", torch.bfloat16)
    case = Case(q, k_buffer, k_buffer[..., :lv], req_to_token.cuda(),
                torch.tensor([1, 2, 3], device="cuda"),
                torch.tensor(lens, dtype=torch.int32, device="cuda"), 0.1147)
    out = run_kernel(case, None, 8)
    # reference over only the used rows (copying the 4.8 GB pool to the host is wasteful)
    small_k = k_buffer[slots.cuda()].float().cpu()
    remap = torch.zeros(4, 400, dtype=torch.int32)
    off = 0
    for i, n in enumerate(lens):
        remap[i + 1, :n] = torch.arange(off, off + n, dtype=torch.int32)
        off += n
    ref = decode_attention_ref(q.float().cpu(), small_k, small_k[..., :lv], remap,
                               torch.tensor([1, 2, 3]), torch.tensor(lens), 0.1147)
    torch.testing.assert_close(out.float().cpu(), ref, atol=BF16_ATOL, rtol=BF16_RTOL)
