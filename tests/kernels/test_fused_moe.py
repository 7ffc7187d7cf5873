"""Fused MoE (`mla_kernels.fused_moe`): the expert sort's invariants, both kernel paths (sorted
grouped GEMM and the sort-free GEMV path) vs the fp32 twin `reference.fused_experts_ref`, the
per-expert loop `layers.moe.experts_forward` and each other, the automatic path choice at
`GEMV_MAX_ROWS`, and `DeepseekV2MoE` with the fused path forced vs the loop path.

CPU (CI): kernels run under TRITON_INTERPRET=1 in fp32 (tests/kernels/conftest.py sets it when
CUDA is absent; the interpreter of triton 3.6 computes tl.dot on bf16 operands wrongly, so bf16 is
GPU-only), on small grids with H/I not powers of two and experts that get no tokens.
GPU (`gpu` marker, H200): bf16 at DeepSeek-V2-Lite shapes vs the fp32 reference on both paths,
and a CUDA-graph capture/replay of `fused_experts` on both paths (which must not synchronise with
the host).
"""

from __future__ import annotations

import pytest
import torch

from mla_backend.layers.moe import DeepseekV2MoE, experts_forward, select_experts
import mla_kernels.fused_moe as fused_moe_mod
from mla_kernels.fused_moe import (
    GEMV_MAX_ROWS,
    GemvConfig,
    MoEConfig,
    fused_experts,
    max_padded_rows,
    moe_align_block_size,
    use_gemv_path,
)
from mla_kernels.reference import fused_experts_ref, moe_align_block_size_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# fp32 kernel vs fp32 loops: only the summation order differs.
FP32 = {"atol": 1e-5, "rtol": 1e-5}
H, I = 48, 40  # not powers of two: exercises the column and reduction masks


def _problem(t: int, e: int, k: int, h: int = H, inter: int = I, seed: int = 0,
             dtype=torch.float32, device: str = DEV):
    """x [t, h], w13 [e, 2I, h], w2 [e, h, I] scaled so activations stay O(1); routing from
    random logits through `select_experts` (distinct experts per token, fp32 weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    weights, ids = select_experts(torch.randn(t, e, generator=g), k)
    move = lambda v: v.to(device=device, dtype=dtype)  # noqa: E731
    return move(x), move(w13), move(w2), weights.to(device), ids.to(device)


# ------------------------------------------------------------------ moe_align_block_size
def test_align_hand_example():
    # rows: 0->e2, 1->e0, 2->e2, 3->e2; counts [1, 0, 3, 0]; block_m 2 pads to [2, 0, 4, 0].
    ids = torch.tensor([[2, 0], [2, 2]], device=DEV)
    sorted_ids, expert_ids, used = moe_align_block_size(ids, num_experts=4, block_m=2)
    assert sorted_ids.tolist() == [1, 4, 0, 2, 3, 4, 4, 4]  # 4 = T*k sentinel; P = 4 + 4*1
    assert expert_ids.tolist() == [0, 2, 2, -1]
    assert used.tolist() == [6]
    assert sorted_ids.dtype == expert_ids.dtype == used.dtype == torch.int32


@pytest.mark.parametrize("t,k,e,block_m", [(1, 1, 4, 16), (1, 6, 8, 16), (5, 2, 4, 1),
                                           (17, 6, 8, 4), (40, 2, 64, 16), (64, 6, 64, 16),
                                           (33, 3, 5, 7)])
def test_align_invariants(t, k, e, block_m):
    g = torch.Generator().manual_seed(t * 100 + k)
    # Skewed routing: expert ids drawn from the first half more often, so some experts are empty.
    ids = (torch.rand(t, k, generator=g) ** 2 * e).long().clamp_max(e - 1).to(DEV)
    flat = ids.reshape(-1).cpu()
    n = flat.numel()
    sorted_ids, expert_ids, used = (v.cpu() for v in moe_align_block_size(ids, e, block_m))
    p = max_padded_rows(n, e, block_m)
    assert sorted_ids.shape == (p,) and expert_ids.shape == (p // block_m,) and p % block_m == 0

    counts = torch.bincount(flat, minlength=e)
    n_used = int(used)
    assert n_used == int(((counts + block_m - 1) // block_m * block_m).sum())
    # Every (token, slot) row exactly once; everything else is the sentinel.
    real = sorted_ids[sorted_ids != n]
    assert sorted(real.tolist()) == list(range(n))
    assert (sorted_ids[n_used:] == n).all()
    # Blocks: one expert each, experts increasing, rows increasing within an expert (stable).
    prev_expert, prev_row = -1, -1
    for b in range(p // block_m):
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = block[block != n]
        if b * block_m >= n_used:
            assert expert_ids[b] == -1 and rows.numel() == 0
            continue
        ex = int(expert_ids[b])
        assert rows.numel() > 0, "a used block holds at least one real row"
        assert (flat[rows.long()] == ex).all()
        assert ex >= prev_expert
        if ex != prev_expert:
            prev_row = -1
        assert (rows.diff() > 0).all() and int(rows[0]) > prev_row
        # padding only at the end of an expert's run
        assert (block[:rows.numel()] == rows).all()
        prev_expert, prev_row = ex, int(rows[-1])


@pytest.mark.parametrize("t,k,e,block_m", [(1, 1, 1, 16), (1, 6, 8, 16), (33, 3, 5, 7),
                                           (64, 6, 64, 16), (300, 6, 64, 64), (97, 8, 256, 128),
                                           (700, 2, 20, 1)])
def test_align_kernel_equals_the_torch_twin(t, k, e, block_m):
    """The three-launch triton sort gives exactly the tensors of the stable-sort torch form,
    also with more rows than one program's block (several count / scatter programs: 300 x 6
    rows at E 64 is 15 programs of 128 rows, 97 x 8 at E 256 is 25 of 32), every expert busy,
    E 1, and a non-power-of-two E and block_m."""
    g = torch.Generator().manual_seed(t + e + block_m)
    ids = (torch.rand(t, k, generator=g) ** 2 * e).long().clamp_max(e - 1)
    for dtype in (torch.int64, torch.int32):
        got = moe_align_block_size(ids.to(device=DEV, dtype=dtype), e, block_m)
        want = moe_align_block_size_ref(ids, e, block_m)
        for g_, w_ in zip(got, want):
            assert g_.dtype == w_.dtype == torch.int32
            assert g_.cpu().tolist() == w_.tolist()


def test_tiles_fall_back_where_shared_memory_is_short():
    # The sweep's largest tiles (prefill 128 x 128, FP8 and bf16) take 144 KB by the estimate:
    # they fit an H200 / H100 (232,448 bytes opt-in) and an A100 (166,912), not an sm89 (101,376).
    from mla_kernels.fused_moe import fit_shared_memory, moe_tile_smem_bytes

    big = MoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    assert moe_tile_smem_bytes(big, 2) == 3 * (128 * 64 + 2 * 64 * 128) * 2 == 147456
    fp8 = big._replace(block_k=128)
    assert moe_tile_smem_bytes(fp8, 1) == 147456
    for cfg, eb in ((big, 2), (fp8, 1)):
        assert fit_shared_memory(cfg, eb, 232448) is cfg
        assert fit_shared_memory(cfg, eb, 166912) is cfg
        assert fit_shared_memory(cfg, eb, None) is cfg  # unknown: unchanged
        small = fit_shared_memory(cfg, eb, 101376)
        assert (small.block_m, small.block_n, small.num_stages) == (128, 64, 2)
        assert small.block_k == 128 // eb and moe_tile_smem_bytes(small, eb) <= 65536
    wide_k = MoEConfig(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
    assert moe_tile_smem_bytes(wide_k, 2) == 122880
    assert fit_shared_memory(wide_k, 2, 101376).block_k == 64


def test_float32_tiles_fit_shared_memory(monkeypatch):
    # float32 operands take twice a 16-bit tile's bytes: the 128 x 128 prefill tiles (3-4 stages)
    # would need 288-384 KB, over an H100's 227 KB, so they fall back; bf16 keeps them.
    import mla_kernels.fused_moe as fused_moe_mod
    from mla_kernels.fused_moe import get_default_config, moe_tile_smem_bytes

    monkeypatch.setattr(fused_moe_mod, "_max_shared_memory", lambda device: 232448)
    monkeypatch.setattr(fused_moe_mod, "_compute_capability", lambda device: (9, 0))
    for t in (40, 257, 1024, 8192):  # 16-bit: 32-row (bk 128), 64-row and 128-row tiles
        for down in (False, True):
            bf16 = get_default_config(t, 2, 4, "cuda", down=down, dtype=torch.bfloat16)
            assert bf16 == get_default_config(t, 2, 4, "cuda", down=down)
            fp32 = get_default_config(t, 2, 4, "cuda", down=down, dtype=torch.float32)
            assert fp32.block_m == bf16.block_m
            assert moe_tile_smem_bytes(fp32, 4) <= 232448
    big = get_default_config(1024, 2, 4, "cuda", down=True, dtype=torch.bfloat16)
    assert moe_tile_smem_bytes(big, 4) == 294912  # what triton asked for at 257 tokens


def test_align_of_no_rows():
    sorted_ids, expert_ids, used = moe_align_block_size(
        torch.zeros(0, 6, dtype=torch.long, device=DEV), 64, 16)
    assert sorted_ids.numel() == expert_ids.numel() == 0 and used.tolist() == [0]


def test_align_rejects_bad_args():
    with pytest.raises(ValueError):
        moe_align_block_size(torch.zeros(4, dtype=torch.long), 4, 16)
    with pytest.raises(ValueError):
        moe_align_block_size(torch.zeros(2, 2, dtype=torch.long), 0, 16)


# ------------------------------------------------------------------ fused_experts
PATHS = ("gemv", "sorted")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("e,k", [(4, 1), (4, 2), (8, 1), (8, 2), (8, 6)])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_fused_experts_vs_ref_and_loop(t, e, k, path):
    x, w13, w2, weights, ids = _problem(t, e, k, seed=t + 10 * e + k)
    out = fused_experts(x, w13, w2, weights, ids, path=path)
    assert out.shape == (t, H) and out.dtype == x.dtype
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(out, experts_forward(x, w13, w2, weights, ids), **FP32)
    assert out.abs().max() > 0.05  # the problem is not trivially zero


@pytest.mark.parametrize("t,e,k", [(1, 8, 6), (3, 4, 2), (9, 8, 6)])
def test_gemv_equals_sorted(t, e, k):
    x, w13, w2, weights, ids = _problem(t, e, k, seed=100 + t)
    gemv = fused_experts(x, w13, w2, weights, ids, path="gemv")
    torch.testing.assert_close(gemv, fused_experts(x, w13, w2, weights, ids, path="sorted"),
                               **FP32)


@pytest.mark.parametrize("cfg", [
    GemvConfig(block_n=64, block_k=64, down_block_n=64, down_block_k=64),  # one tile > H, I
    GemvConfig(block_n=8, block_k=16, down_block_n=16, down_block_k=8),  # many small tiles
    GemvConfig(block_n=1, block_k=64, down_block_n=1, down_block_k=64),  # one-wide tiles
])
def test_gemv_tile_configs(cfg):
    x, w13, w2, weights, ids = _problem(2, 8, 6, seed=5)
    out = fused_experts(x, w13, w2, weights, ids, gemv_config=cfg, path="gemv")
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), **FP32)


def test_gemv_duplicated_experts_and_strided_inputs():
    """Experts shared by many tokens (and, beyond what the router produces, repeated within a
    token), non-contiguous x / topk_weights / topk_ids, int32 ids, an `out` buffer."""
    t, e, k = 7, 8, 3
    x, w13, w2, _, _ = _problem(t, e, k, seed=9)
    ids = torch.tensor([[1, 5, 1], [5, 1, 2], [1, 5, 2], [2, 2, 2], [5, 1, 7], [1, 5, 1],
                        [7, 1, 5]], dtype=torch.int32)
    wide_ids = torch.zeros(t, 2 * k, dtype=torch.int32)
    wide_ids[:, ::2] = ids
    wide_w = torch.rand(t, 2 * k, generator=torch.Generator().manual_seed(2)) + 0.1
    ids_s, weights_s = wide_ids.to(DEV)[:, ::2], wide_w.to(DEV)[:, 1::2]  # column stride 2
    wide_x = torch.zeros(2 * H, t, device=DEV)
    wide_x[:H] = x.T
    x_s = wide_x[:H].T  # [t, H] with strides (1, t)
    out = torch.full((t, H), float("nan"), device=DEV)
    res = fused_experts(x_s, w13, w2, weights_s, ids_s, out=out, path="gemv")
    assert res is out
    ref = fused_experts_ref(x, w13, w2, weights_s, ids_s.long())
    torch.testing.assert_close(out, ref, **FP32)
    # The loop (and the sort) reads each (token, slot) pair on its own too, duplicates included.
    torch.testing.assert_close(out, experts_forward(x, w13, w2, weights_s, ids_s.long()), **FP32)
    torch.testing.assert_close(
        fused_experts(x, w13, w2, weights_s.contiguous(), ids_s.contiguous(), path="sorted"),
        ref, **FP32)


def test_auto_path_threshold(monkeypatch):
    """path="auto" takes the GEMV path iff T*k <= GEMV_MAX_ROWS; forced paths override it."""
    calls: list[str] = []
    real_gemv, real_align = fused_moe_mod.gemv_experts, fused_moe_mod.moe_align_block_size

    def gemv_spy(*a, **kw):
        calls.append("gemv")
        return real_gemv(*a, **kw)

    def align_spy(*a, **kw):
        calls.append("sorted")
        return real_align(*a, **kw)

    for k in (1, 2, 6):
        t_max = GEMV_MAX_ROWS // k
        assert use_gemv_path(t_max, k) and not use_gemv_path(t_max + 1, k)
    monkeypatch.setattr(fused_moe_mod, "gemv_experts", gemv_spy)
    monkeypatch.setattr(fused_moe_mod, "moe_align_block_size", align_spy)
    # A smaller threshold (the module constant is read at call time) keeps the interpreter fast.
    monkeypatch.setattr(fused_moe_mod, "GEMV_MAX_ROWS", 8)
    k, t_max = 2, 4
    for t, path, expect in [(t_max, "auto", "gemv"), (t_max + 1, "auto", "sorted"),
                            (1, "sorted", "sorted"), (t_max + 1, "gemv", "gemv")]:
        calls.clear()
        x, w13, w2, weights, ids = _problem(t, 4, k, seed=t)
        out = fused_experts(x, w13, w2, weights, ids, path=path)
        assert calls == [expect], (t, path, calls)
        torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), **FP32)


def _shared_ref(x: torch.Tensor, sw13: torch.Tensor, sw2: torch.Tensor) -> torch.Tensor:
    """The shared experts as one SiLU-gated MLP in fp32 (GatedMLP's math)."""
    gate, up = (x.float() @ sw13.float().T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ sw2.float().T


@pytest.mark.parametrize("t,e,k,n_shared", [(1, 8, 6, 2), (1, 4, 1, 1), (3, 8, 2, 2),
                                            (2, 4, 3, 3)])
def test_gemv_folds_shared_experts(t, e, k, n_shared):
    """Shared experts as extra GEMV slots of weight 1 == routed experts + the shared MLP."""
    x, w13, w2, weights, ids = _problem(t, e, k, seed=t + 10 * n_shared)
    g = torch.Generator().manual_seed(7)
    sw13 = (torch.randn(2 * n_shared * I, H, generator=g) / H ** 0.5).to(DEV)
    sw2 = (torch.randn(H, n_shared * I, generator=g) / (n_shared * I) ** 0.5).to(DEV)
    out = fused_experts(x, w13, w2, weights, ids, path="gemv", shared_w13=sw13, shared_w2=sw2)
    want = fused_experts_ref(x, w13, w2, weights, ids) + _shared_ref(x, sw13, sw2)
    torch.testing.assert_close(out, want, **FP32)
    assert _shared_ref(x, sw13, sw2).abs().max() > 0.05  # the shared part is not negligible


def test_shared_experts_rejected_off_the_gemv_path_and_bad_shapes():
    x, w13, w2, weights, ids = _problem(2, 4, 2)
    sw13, sw2 = torch.zeros(4 * I, H, device=DEV), torch.zeros(H, 2 * I, device=DEV)
    with pytest.raises(ValueError, match="GEMV path only"):
        fused_experts(x, w13, w2, weights, ids, path="sorted", shared_w13=sw13, shared_w2=sw2)
    with pytest.raises(ValueError, match="both shared_w13 and shared_w2"):
        fused_experts(x, w13, w2, weights, ids, shared_w13=sw13)
    with pytest.raises(ValueError, match="must be"):
        fused_experts(x, w13, w2, weights, ids, shared_w13=sw13[:-1], shared_w2=sw2)
    with pytest.raises(ValueError, match="must be"):
        fused_experts(x, w13, w2, weights, ids, shared_w13=sw13, shared_w2=sw2[:, :-2])
    with pytest.raises(ValueError, match="need weights of x's dtype"):
        fused_experts(x, w13, w2, weights, ids, shared_w13=sw13.double(), shared_w2=sw2)


def test_fused_experts_empty_and_single_expert():
    """All tokens on one expert (the others get none; several blocks of one expert), int32 ids,
    a strided x, an `out` buffer and a larger block_m (sorted path; T*k = 74 would take the GEMV
    path by default, which runs here too)."""
    t, e, k = 37, 8, 2
    x, w13, w2, weights, _ = _problem(t, e, k, seed=3)
    ids = torch.tensor([[5, 2]] * t, device=DEV, dtype=torch.int32)  # experts 0,1,3,4,6,7 empty
    wide = torch.zeros(t, 2 * H, device=DEV)
    wide[:, :H] = x
    x_strided = wide[:, :H]  # row stride 2H
    out = torch.full((t, H), float("nan"), device=DEV)
    for path, cfg in [("sorted", None),
                      ("sorted", MoEConfig(block_m=32, block_n=16, block_k=16, group_m=2)),
                      ("gemv", None)]:
        out.fill_(float("nan"))
        res = fused_experts(x_strided, w13, w2, weights, ids, out=out, config=cfg, path=path)
        assert res is out
        torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), **FP32)


@pytest.mark.parametrize("cfg", [MoEConfig(16, 32, 32, 4, b_desc=True),  # masks in N and K
                                 MoEConfig(16, 64, 16, 1, b_desc=True)])  # one N tile > I, H
@pytest.mark.parametrize("t,e,k", [(3, 4, 2), (17, 8, 2)])
def test_sorted_path_weight_descriptor(cfg, t, e, k, monkeypatch):
    """Weight tiles through a tensor descriptor (`MoEConfig.b_desc`; TMA on Hopper): the same
    result as the pointer loads and the reference, with tiles past N and K (the gate tile's
    columns past I read up rows there; the store masks them). Both GEMMs get a descriptor."""
    x, w13, w2, weights, ids = _problem(t, e, k, seed=40 + t)
    made = []
    real = fused_moe_mod._weight_descriptor
    monkeypatch.setattr(fused_moe_mod, "_weight_descriptor",
                        lambda w, c: made.append(real(w, c)) or made[-1])
    out = fused_experts(x, w13, w2, weights, ids, config=cfg, path="sorted")
    assert len(made) == 2 and all(d is not None for d in made)
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), **FP32)
    pointers = fused_experts(x, w13, w2, weights, ids, config=cfg._replace(b_desc=False),
                             path="sorted")
    torch.testing.assert_close(out, pointers, **FP32)


def test_weight_descriptor_falls_back_where_tma_cannot_address():
    """A row of 45 fp32 (180 bytes, not a multiple of 16) or a strided last dim: no descriptor,
    and the kernel takes the pointer loads (still correct)."""
    cfg = MoEConfig(16, 32, 32, 4, b_desc=True)
    x, w13, w2, weights, ids = _problem(5, 4, 2, h=45, seed=11)
    assert fused_moe_mod._weight_descriptor(w13, cfg) is None
    assert fused_moe_mod._weight_descriptor(w13.transpose(1, 2).contiguous().transpose(1, 2),
                                            cfg) is None
    out = fused_experts(x, w13, w2, weights, ids, config=cfg, path="sorted")
    torch.testing.assert_close(out, fused_experts_ref(x, w13, w2, weights, ids), **FP32)


@pytest.mark.parametrize("path", PATHS)
def test_fused_experts_no_tokens(path):
    x, w13, w2, weights, ids = _problem(0, 4, 2)
    assert fused_experts(x, w13, w2, weights, ids, path=path).shape == (0, H)


def test_fused_experts_rejects_bad_shapes():
    x, w13, w2, weights, ids = _problem(3, 4, 2)
    with pytest.raises(ValueError):
        fused_experts(x[:, :-1], w13, w2, weights, ids)  # H mismatch
    with pytest.raises(ValueError):
        fused_experts(x, w13, w2.transpose(1, 2), weights, ids)  # w2 must be [E, H, I]
    with pytest.raises(ValueError):
        fused_experts(x, w13, w2, weights[:, :1], ids)  # weights/ids shapes differ
    with pytest.raises(ValueError):
        fused_experts(x, w13.double(), w2, weights, ids)  # dtype mismatch
    with pytest.raises(ValueError):
        fused_experts(x, w13, w2, weights, ids, out=torch.empty(3, H + 1, device=DEV))
    with pytest.raises(ValueError):
        fused_experts(x, w13, w2, weights, ids, path="dense")  # unknown path
    with pytest.raises(ValueError):  # GEMV tiles must be powers of two
        fused_experts(x, w13, w2, weights, ids, path="gemv",
                      gemv_config=GemvConfig(block_n=24))


# ------------------------------------------------------------------ DeepseekV2MoE
def _moe_layer(fused: bool | None, **kw) -> DeepseekV2MoE:
    layer = DeepseekV2MoE(H, I, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                          fused_moe=fused, **kw)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return layer.to(DEV)


@pytest.mark.parametrize("kw", [dict(), dict(topk_method="group_limited_greedy", n_group=4,
                                             topk_group=2, norm_topk_prob=True,
                                             routed_scaling_factor=2.5)])
def test_deepseek_moe_fused_equals_loop(kw):
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(1)).to(DEV)
    fused_layer, loop_layer = _moe_layer(True, **kw), _moe_layer(False, **kw)
    with torch.no_grad():
        out_fused, out_loop = fused_layer(x), loop_layer(x)
    torch.testing.assert_close(out_fused, out_loop, **FP32)
    assert out_loop.abs().max() > 0.05
    # Default (None): fused only for CUDA tensors.
    default = _moe_layer(None, **kw)
    assert default.fused_moe is None
    with torch.no_grad():
        torch.testing.assert_close(default(x), out_loop, **FP32)


def test_deepseek_moe_folds_shared_experts_at_one_row(monkeypatch):
    """At one token row the fused layer runs its shared experts inside the GEMV launches
    (`_foldable_shared`); the output equals the loop layer's routed + shared sum. Two rows (or
    the fold switched off) take the separate shared MLP and agree too."""
    import mla_backend.layers.moe as moe_mod

    fused_layer, loop_layer = _moe_layer(True), _moe_layer(False)
    calls = []
    real = moe_mod._fused_experts_opaque
    monkeypatch.setattr(moe_mod, "_fused_experts_opaque",
                        lambda *a, **kw: calls.append("shared_w13" in kw) or real(*a, **kw))
    g = torch.Generator().manual_seed(3)
    for t, folded in ((1, True), (2, False)):
        x = torch.randn(t, H, generator=g).to(DEV)
        with torch.no_grad():
            torch.testing.assert_close(fused_layer(x), loop_layer(x), **FP32)
        assert calls[-1] is folded
    monkeypatch.setattr(moe_mod, "SHARED_FOLD_MAX_ROWS", 0)
    with torch.no_grad():
        x = torch.randn(1, H, generator=g).to(DEV)
        torch.testing.assert_close(fused_layer(x), loop_layer(x), **FP32)
    assert calls[-1] is False


# ------------------------------------------------------------------ GPU (H200)
# bf16 kernel vs the fp32 oracle on the same bf16 inputs. The kernel rounds the [T*k, I]
# intermediate, the per-slot outputs and the result to bf16 (2^-9 relative each); a torch emulation
# of exactly that rounding at V2-Lite shapes stays below 0.5% of max|ref|, and the bf16 loop
# `experts_forward` (which also rounds gate/up and each slot's accumulation) below 1%. Tolerances:
# max abs error <= 1% of max|ref| vs the oracle, <= 2% vs the loop.
V2_LITE = {"h": 2048, "inter": 1408, "e": 64, "k": 6}


def _assert_close_rel_max(out: torch.Tensor, ref: torch.Tensor, frac: float) -> None:
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= frac * scale, f"max abs error {err:.3e} > {frac} * max|ref| {scale:.3e}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t,path", [(1, "auto"), (1, "sorted"), (16, "auto"), (16, "sorted"),
                                    (64, "auto"), (64, "gemv"), (512, "auto"),
                                    (1024, "auto")])
def test_gpu_fused_experts_bf16_v2_lite(t, path):
    s = V2_LITE
    x, w13, w2, weights, ids = _problem(t, s["e"], s["k"], h=s["h"], inter=s["inter"], seed=t,
                                        dtype=torch.bfloat16, device="cuda")
    out = fused_experts(x, w13, w2, weights, ids, path=path)
    ref = fused_experts_ref(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    _assert_close_rel_max(out, ref, 1e-2)
    _assert_close_rel_max(out, experts_forward(x, w13, w2, weights, ids), 2e-2)


@pytest.mark.gpu
@gpu
def test_gpu_gemv_folds_shared_experts_v2_lite():
    """bf16 at V2-Lite shapes, T = 1: two shared experts (width 2 x 1408) folded into the GEMV
    launches vs the fp32 routed oracle + shared MLP (tolerance as the routed-only test)."""
    s = V2_LITE
    x, w13, w2, weights, ids = _problem(1, s["e"], s["k"], h=s["h"], inter=s["inter"], seed=5,
                                        dtype=torch.bfloat16, device="cuda")
    g = torch.Generator().manual_seed(9)
    sw13 = (torch.randn(4 * s["inter"], s["h"], generator=g) / s["h"] ** 0.5).to(
        "cuda", torch.bfloat16)
    sw2 = (torch.randn(s["h"], 2 * s["inter"], generator=g) / (2 * s["inter"]) ** 0.5).to(
        "cuda", torch.bfloat16)
    out = fused_experts(x, w13, w2, weights, ids, shared_w13=sw13, shared_w2=sw2)
    ref = fused_experts_ref(x, w13, w2, weights, ids) + _shared_ref(x, sw13, sw2)
    _assert_close_rel_max(out, ref, 1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [1, 2, 8])
def test_gpu_gemv_top_k(k):
    """GEMV path with other slot counts (k_pad 1, 2, 8) and non-power-of-two H / I, bf16."""
    x, w13, w2, weights, ids = _problem(5, 16, k, h=1000, inter=700, seed=k,
                                        dtype=torch.bfloat16, device="cuda")
    out = fused_experts(x, w13, w2, weights, ids, path="gemv")
    _assert_close_rel_max(out, fused_experts_ref(x, w13, w2, weights, ids), 1e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["gemv", "sorted"])
def test_gpu_fused_experts_cuda_graph_replay(path):
    """Captured once with static buffers, replayed with new routing: no host sync inside."""
    s = V2_LITE
    t = 8
    x, w13, w2, weights, ids = _problem(t, s["e"], s["k"], h=s["h"], inter=s["inter"], seed=1,
                                        dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        fused_experts(x, w13, w2, weights, ids, out=out, path=path)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w13, w2, weights, ids, out=out, path=path)
    for seed in (2, 3):
        x2, _, _, w_new, ids_new = _problem(t, s["e"], s["k"], h=s["h"], inter=s["inter"],
                                            seed=seed, dtype=torch.bfloat16, device="cuda")
        x.copy_(x2)
        weights.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        torch.cuda.synchronize()
        _assert_close_rel_max(out, fused_experts_ref(x, w13, w2, weights, ids), 1e-2)


@pytest.mark.gpu
@gpu
def test_gpu_deepseek_moe_dispatches_fused():
    layer = DeepseekV2MoE(256, 192, n_routed_experts=16, num_experts_per_tok=4,
                          n_shared_experts=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    layer = layer.to("cuda", torch.bfloat16)
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = layer(x)  # fused (CUDA default)
        layer.fused_moe = False
        ref = layer(x)
    _assert_close_rel_max(out, ref, 2e-2)
