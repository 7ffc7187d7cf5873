"""FP8 fused MoE (`mla_kernels.fused_moe.fused_experts` with float8_e4m3fn expert weights): both
paths (sorted grouped GEMM, sort-free GEMV) against the float32 twin
`reference.fused_experts_fp8_ref` (dequantize the weights, quantize-dequantize the activations
the same way, compute in fp32) and the torch loop `layers.moe.experts_forward` (same FP8 math,
dequantizing per expert), for both scale kinds:

- per expert per tensor: w13_scale / w2_scale [E], one dynamic activation scale per row (token,
  resp. intermediate row) of each GEMM;
- DeepSeek-V3 block scales (`weight_scale_inv`) with per-token-group activations; the grid uses
  32x32 blocks (the kernel takes any (bn, bk) with bk a multiple of 16) so H 72 / I 40 have
  ragged blocks in every direction at interpreter cost, plus one case at the real 128x128 with
  H 160 / I 136 (not multiples of 128).

CPU (CI): triton's interpreter, fp32 activations. Tolerance: the kernel and the reference use the
same quantized operands, so only fp32 summation order differs (measured max |diff| <= 1e-6 at
max|ref| ~ 1); FP32 = atol 2e-5, rtol 1e-5. A rounding flip of one activation (an fp32 ulp moving
a value across an e4m3 rounding boundary) could cost ~1e-3; it does not happen at these seeds.
Against the unquantized kernel on the dequantized weights (activation quantization only):
relative RMS <= 0.08 (measured 0.051 per tensor, 0.033 with per-token-group scales, T 12,
both paths).
Sensitivity: scales of 1, experts' scales rolled by one, and block scales flipped along N each
move the output far outside FP32 (checked > 100x).
GPU (`gpu` marker): bf16 activations at DeepSeek-V2-Lite shapes (H 2048, I 1408, E 64, top-6), both
paths and both scale kinds, vs the fp32 reference (max abs error <= 2% of max|ref|: bf16 rounding
of the intermediate and the per-slot outputs plus rare e4m3 rounding flips it causes), and a
CUDA-graph capture/replay on both paths (no host sync).
"""

from __future__ import annotations

import pytest
import torch

from mla_backend.layers.moe import experts_forward, select_experts
from mla_kernels.block_fp8_gemm import quant_weight_block_fp8
from mla_kernels.fused_moe import GemvConfig, fused_experts
from mla_kernels.reference import fused_experts_fp8_ref, fused_experts_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FP32 = {"atol": 2e-5, "rtol": 1e-5}
H, I = 72, 40
BLOCK = (32, 32)
FP8 = torch.float8_e4m3fn


def quant_experts(w: torch.Tensor, block: tuple[int, int] | None, gate_up: bool = False):
    """Stacked float weights [E, N, K] -> (fp8 [E, N, K], scales): per expert per tensor
    (amax / 448, [E]) or per block ([E, nb, kb]; gate and up halves blocked separately)."""
    if block is None:
        s = w.abs().amax(dim=(1, 2)) / 448.0
        return (w / s[:, None, None]).clamp(-448, 448).to(FP8), s
    if gate_up:
        half = w.shape[1] // 2
        (qg, sg), (qu, su) = quant_experts(w[:, :half], block), quant_experts(w[:, half:], block)
        return torch.cat([qg, qu], 1), torch.cat([sg, su], 1)
    pairs = [quant_weight_block_fp8(we, block) for we in w]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def problem(t: int, e: int, k: int, block, h: int = H, inter: int = I, seed: int = 0,
            dtype=torch.float32, device: str = DEV):
    """Random experts whose magnitudes vary per expert and per 32-row/column band (so per-expert
    and per-block scales differ), quantized; routing by `select_experts`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)

    def weights(n: int, kk: int) -> torch.Tensor:
        w = torch.randn(e, n, kk, generator=g) / kk ** 0.5
        band_n = torch.rand(e, -(-n // 32), 1, generator=g).repeat_interleave(32, 1)[:, :n] + 0.5
        band_k = torch.rand(e, 1, -(-kk // 32), generator=g).repeat_interleave(32, 2)[..., :kk]
        return w * band_n * (band_k + 0.5) * (1 + torch.arange(e)[:, None, None] / e)

    w13, w2 = weights(2 * inter, h), weights(h, inter)
    q13, s13 = quant_experts(w13, block, gate_up=True)
    q2, s2 = quant_experts(w2, block)
    topw, ids = select_experts(torch.randn(t, e, generator=g), k)
    dev = lambda v: v.to(device)  # noqa: E731
    return (x.to(device=device, dtype=dtype), dev(q13), dev(q2), dev(topw), dev(ids),
            dev(s13), dev(s2))


# Interpreter GEMV tiles larger than the default (fewer programs: the interpreter's cost is per
# program), still masked in every direction at H 72 / I 40.
CPU_GEMV = GemvConfig(block_n=32, block_k=64, down_block_n=64, down_block_k=32)


def run(x, q13, q2, topw, ids, s13, s2, block, **kw):
    if not x.is_cuda:
        kw.setdefault("gemv_config", CPU_GEMV)
    return fused_experts(x, q13, q2, topw, ids, w13_scale=s13, w2_scale=s2, block_shape=block,
                         **kw)


@pytest.mark.parametrize("path", ["gemv", "sorted"])
@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_tensor", "block32"])
@pytest.mark.parametrize("e,k", [(4, 1), (4, 2), (8, 1), (8, 2)])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_fp8_kernel_vs_reference_and_loop(t, e, k, block, path):
    x, q13, q2, topw, ids, s13, s2 = problem(t, e, k, block, seed=t + 10 * e + k)
    out = run(x, q13, q2, topw, ids, s13, s2, block, path=path)
    assert out.shape == (t, H) and out.dtype == x.dtype
    ref = fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block)
    torch.testing.assert_close(out, ref, **FP32)
    torch.testing.assert_close(
        out, experts_forward(x, q13, q2, topw, ids, s13, s2, block), **FP32)
    assert out.abs().max() > 0.05  # not trivially zero


@pytest.mark.parametrize("path", ["gemv", "sorted"])
def test_fp8_per_tensor_weights_scale_activations_per_row(path):
    """Tokens 1e-4 and 1e3 times the others: each row's output keeps the relative error of the
    unscaled rows (one activation scale for the tensor would flush the small tokens to zero),
    and the kernel still equals the twin."""
    x, q13, q2, topw, ids, s13, s2 = problem(6, 4, 2, None, seed=3)
    x = x * torch.tensor([1.0, 1e-4, 1.0, 1e3, 1e-4, 1.0], device=x.device)[:, None]
    out = run(x, q13, q2, topw, ids, s13, s2, None, path=path)
    twin = fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, None)
    assert float(((out - twin).norm(dim=1) / twin.norm(dim=1)).max()) <= 1e-5  # fp32 order
    w13f, w2f = q13.float() * s13[:, None, None], q2.float() * s2[:, None, None]
    exact = fused_experts_ref(x, w13f, w2f, topw, ids)  # no activation quantization
    rel = (out - exact).norm(dim=1) / exact.norm(dim=1)
    assert float(rel.max()) <= 0.08, rel


@pytest.mark.parametrize("path", ["gemv", "sorted"])
def test_fp8_kernel_block_128_ragged(path):
    """DeepSeek-V3's 128x128 blocks with H 160 / I 136 (second blocks ragged in H, I and 2I)."""
    block = (128, 128)
    x, q13, q2, topw, ids, s13, s2 = problem(3, 4, 2, block, h=160, inter=136, seed=7)
    assert s13.shape == (4, 4, 2) and s2.shape == (4, 2, 2)
    out = run(x, q13, q2, topw, ids, s13, s2, block, path=path)
    torch.testing.assert_close(out, fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block),
                               **FP32)


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_tensor", "block32"])
def test_fp8_down_gemm_takes_its_own_tiles(block, monkeypatch):
    """`fused_experts(down_config=)`: the down GEMM with other N / K tiles than the gate/up GEMM
    (same block_m) still equals the twin, and the tiles reach the second launch; a down_config
    of another block_m is refused (both GEMMs walk one sorted row order)."""
    import mla_kernels.fused_moe as fused_moe_mod
    from mla_kernels.fused_moe import MoEConfig

    x, q13, q2, topw, ids, s13, s2 = problem(9, 4, 2, block, seed=17)
    cfg, down = MoEConfig(16, 32, 32, 4), MoEConfig(16, 64, 16, 1)
    seen = []
    real = fused_moe_mod.grouped_gemm
    monkeypatch.setattr(fused_moe_mod, "grouped_gemm",
                        lambda *a, **kw: seen.append(a[8]) or real(*a, **kw))
    out = run(x, q13, q2, topw, ids, s13, s2, block, path="sorted", config=cfg, down_config=down)
    assert seen == [cfg, down]
    torch.testing.assert_close(out, fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block),
                               **FP32)
    with pytest.raises(ValueError, match="block_m"):
        run(x, q13, q2, topw, ids, s13, s2, block, path="sorted", config=cfg,
            down_config=down._replace(block_m=32))


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_tensor", "block32"])
def test_fp8_weight_descriptor(block, monkeypatch):
    """FP8 weight tiles through a tensor descriptor (`MoEConfig.b_desc`), H 80 / I 48 (FP8 rows
    of a multiple of 16 bytes, which a descriptor needs): equal to the twin and to the pointer
    loads, both scale kinds. BLOCK_K 64: with 32-wide scale blocks the kernel's K step becomes
    32, and so does the descriptor's block."""
    import mla_kernels.fused_moe as fused_moe_mod
    from mla_kernels.fused_moe import MoEConfig

    cfg = MoEConfig(16, 32, 64, 4, b_desc=True)
    x, q13, q2, topw, ids, s13, s2 = problem(9, 4, 2, block, h=80, inter=48, seed=21)
    made = []
    real = fused_moe_mod._weight_descriptor
    monkeypatch.setattr(fused_moe_mod, "_weight_descriptor",
                        lambda w, c: made.append((real(w, c), c.block_k)) or made[-1][0])
    out = run(x, q13, q2, topw, ids, s13, s2, block, path="sorted", config=cfg)
    assert len(made) == 2 and all(d is not None for d, _ in made)
    assert [bk for _, bk in made] == [64 if block is None else 32] * 2
    torch.testing.assert_close(out, fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block),
                               **FP32)
    pointers = run(x, q13, q2, topw, ids, s13, s2, block, path="sorted",
                   config=cfg._replace(b_desc=False))
    torch.testing.assert_close(out, pointers, **FP32)


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_tensor", "block32"])
def test_fp8_close_to_unquantized_and_activation_quant_off(block):
    x, q13, q2, topw, ids, s13, s2 = problem(12, 8, 2, block, seed=3)
    from mla_kernels.reference import dequant_experts_ref

    w13 = dequant_experts_ref(q13, s13, block, fused_gate_up=True)
    w2 = dequant_experts_ref(q2, s2, block)
    full = fused_experts(x, w13, w2, topw, ids, path="sorted")
    out = run(x, q13, q2, topw, ids, s13, s2, block)
    rel = float((out - full).norm() / full.norm())
    assert 1e-4 < rel <= 0.08, rel  # activation quantization costs something, not much
    # Activations unquantized (W8A16): the dequantized weights' math exactly.
    for path in ("sorted", "gemv"):
        off = run(x, q13, q2, topw, ids, s13, s2, block, activation_quant=False, path=path)
        torch.testing.assert_close(off, fused_experts_ref(x, w13, w2, topw, ids), **FP32)


@pytest.mark.parametrize("block", [None, BLOCK], ids=["per_tensor", "block32"])
def test_fp8_scales_matter(block):
    x, q13, q2, topw, ids, s13, s2 = problem(9, 4, 2, block, seed=11)
    ref = fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block)
    wrong = [(torch.ones_like(s13), torch.ones_like(s2)),  # scales ignored
             (s13.roll(1, 0), s2.roll(1, 0))]  # another expert's scales
    if block is not None:  # block scales of the wrong rows
        wrong.append((s13.flip(1), s2.flip(1)))
    for (a, b), path in zip(wrong, ["sorted", "gemv", "sorted"]):
        bad = run(x, q13, q2, topw, ids, a, b, block, path=path)
        assert (bad - ref).abs().max() > 100 * FP32["atol"] * max(1.0, ref.abs().max())


def _fp8_shared(n_shared: int, seed: int):
    """S FP8 shared experts as `Fp8LinearMethod` holds them after load: gate_up [2*S*I, H] and
    down [H, S*I] e4m3, each with one float32 scale per output column (per-tensor scales of
    the gate and up parts repeated, which differ), and their dequantized float weights."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * n_shared * I, H, generator=g) / H ** 0.5
    gate_up[n_shared * I:] *= 3  # the up part's scale differs from the gate part's
    down = torch.randn(H, n_shared * I, generator=g) / (n_shared * I) ** 0.5

    def quant(w: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
        qs, ss = [], []
        for part in w.chunk(parts):
            sc = part.abs().amax() / 448.0
            qs.append((part / sc).clamp(-448, 448).to(FP8))
            ss.append(sc.expand(part.shape[0]))
        return torch.cat(qs), torch.cat(ss).float().contiguous()

    (q13, s13), (q2, s2) = quant(gate_up, 2), quant(down, 1)
    dq13, dq2 = q13.float() * s13[:, None], q2.float() * s2[:, None]
    return [v.to(DEV) for v in (q13, q2, s13, s2, dq13, dq2)]


@pytest.mark.parametrize("t,k,n_shared", [(1, 2, 2), (1, 1, 1), (3, 2, 1)])
@pytest.mark.parametrize("activation_quant", [False, True], ids=["weight_only", "w8a8"])
def test_fp8_gemv_folds_fp8_shared_experts(t, k, n_shared, activation_quant):
    """Per-tensor FP8 routed experts with FP8 shared experts (column scales) folded into the
    GEMV launches == the routed experts' twin + the shared experts' twin: S experts of width I
    and weight 1 over the dequantized shared weights, their activations quantized per row as
    the kernel's slots are (or not: weight-only); the shared column scales matter."""
    x, q13, q2, topw, ids, s13, s2 = problem(t, 8, k, None, seed=20 + t + k)
    sq13, sq2, ss13, ss2, sdq13, sdq2 = _fp8_shared(n_shared, seed=t + n_shared)
    kw = dict(w13_scale=s13, w2_scale=s2, path="gemv", activation_quant=activation_quant,
              shared_w13=sq13, shared_w2=sq2, shared_w2_scale=ss2)
    out = fused_experts(x, q13, q2, topw, ids, shared_w13_scale=ss13, **kw)
    routed = fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2,
                                   activation_quant=activation_quant)
    si = n_shared * I  # shared expert s: gate rows s*I.., up rows S*I + s*I.., down columns s*I..
    w13_s = torch.stack([torch.cat([sdq13[j * I:(j + 1) * I], sdq13[si + j * I:si + (j + 1) * I]])
                         for j in range(n_shared)])
    w2_s = torch.stack([sdq2[:, j * I:(j + 1) * I] for j in range(n_shared)])
    ones = torch.ones(n_shared, device=DEV)
    shared = fused_experts_fp8_ref(
        x, w13_s, w2_s, torch.ones(t, n_shared, device=DEV),
        torch.arange(n_shared, device=DEV).expand(t, n_shared), ones, ones,
        activation_quant=activation_quant)
    torch.testing.assert_close(out, routed + shared, **FP32)
    assert shared.abs().max() > 0.05  # the shared part is not negligible
    bad = fused_experts(x, q13, q2, topw, ids, shared_w13_scale=ss13.flip(0).contiguous(), **kw)
    assert (bad - out).abs().max() > 100 * FP32["atol"]


def test_fp8_shared_expert_argument_errors():
    x, q13, q2, topw, ids, s13, s2 = problem(1, 8, 2, None)
    sq13, sq2, ss13, ss2, sdq13, sdq2 = _fp8_shared(1, seed=0)
    kw = dict(w13_scale=s13, w2_scale=s2, path="gemv")
    with pytest.raises(ValueError, match="column scales"):
        fused_experts(x, q13, q2, topw, ids, shared_w13=sq13, shared_w2=sq2, **kw)
    with pytest.raises(ValueError, match="column scales"):
        fused_experts(x, q13, q2, topw, ids, shared_w13=sq13, shared_w2=sq2,
                      shared_w13_scale=ss13[:-1], shared_w2_scale=ss2, **kw)
    with pytest.raises(ValueError, match="float8_e4m3fn with per-tensor FP8"):
        fused_experts(x, q13, q2, topw, ids, shared_w13=sdq13, shared_w2=sdq2, **kw)
    with pytest.raises(ValueError, match="scales for unquantized shared"):
        fused_experts(x, sdq13[None].expand(8, -1, -1)[:, :2 * I].contiguous(),
                      sdq2[None].expand(8, -1, -1).contiguous(), topw, ids, path="gemv",
                      shared_w13=sdq13, shared_w2=sdq2, shared_w13_scale=ss13,
                      shared_w2_scale=ss2)
    with pytest.raises(ValueError, match="without shared experts"):
        fused_experts(x, q13, q2, topw, ids, shared_w13_scale=ss13, **kw)


def test_fp8_argument_errors():
    x, q13, q2, topw, ids, s13, s2 = problem(3, 4, 2, BLOCK)
    with pytest.raises(ValueError, match="need w13_scale"):
        fused_experts(x, q13, q2, topw, ids)  # FP8 without scales
    with pytest.raises(ValueError, match="block .* scales"):
        run(x, q13, q2, topw, ids, s13[:, :1], s2, BLOCK)
    with pytest.raises(ValueError, match="block .* scales"):
        run(x, q13, q2, topw, ids, s13, s2, (64, 32))  # scales of another block size
    with pytest.raises(ValueError, match="bk % 16"):
        run(x, q13, q2, topw, ids, s13, s2, (32, 24))
    with pytest.raises(ValueError, match="per-tensor"):
        run(x, q13, q2, topw, ids, s13[:, 0, 0], s2[:, 0, 0][:3], None)
    w13 = q13.float()
    with pytest.raises(ValueError, match="unquantized"):
        fused_experts(x, w13, q2.float(), topw, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError):
        fused_experts(x, q13, q2.float(), topw, ids, w13_scale=s13, w2_scale=s2)


def test_fp8_no_tokens():
    x, q13, q2, topw, ids, s13, s2 = problem(0, 4, 2, None)
    assert run(x, q13, q2, topw, ids, s13, s2, None).shape == (0, H)


# ------------------------------------------------------------------ GPU
def _rel_max(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _rel_mean(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().mean() / ref.float().abs().max()).item()


# bf16 kernels against the float32 twin, relative to the output's largest magnitude. The largest
# error is set by FP8 rounding flips of the [T*k, I] intermediate: a value on an e4m3 rounding
# boundary goes one step either way with any change of summation order, and that step times a
# down-projection weight lands in one output. The twin against itself with one extra bf16
# rounding of its gate_up product (`round_gate_up`) moved by up to 4.0%, the kernels by 0.3-3.4%
# (max) and at most 0.09% (mean): `benchmarks/bench_fp8_moe_error.py` on a GPU. Tolerances:
# 5% max, 0.2% mean. Ignored or misplaced scales fail far beyond them (test_fp8_scales_matter).
BF16_REL_MAX, BF16_REL_MEAN = 5e-2, 2e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per_tensor", "block128"])
@pytest.mark.parametrize("t,path", [(1, "auto"), (1, "sorted"), (16, "auto"), (16, "sorted"),
                                    (64, "gemv"), (300, "auto"), (1024, "auto")])
def test_gpu_fp8_fused_experts_bf16(t, path, block):
    x, q13, q2, topw, ids, s13, s2 = problem(t, 64, 6, block, h=2048, inter=1408, seed=t,
                                             dtype=torch.bfloat16, device="cuda")
    out = run(x, q13, q2, topw, ids, s13, s2, block, path=path)
    assert out.dtype == torch.bfloat16
    ref = fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block)
    for got in (out, experts_forward(x, q13, q2, topw, ids, s13, s2, block)):
        assert _rel_max(got, ref) <= BF16_REL_MAX
        assert _rel_mean(got, ref) <= BF16_REL_MEAN


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["gemv", "sorted"])
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per_tensor", "block128"])
def test_gpu_fp8_fused_experts_cuda_graph(block, path):
    t = 8
    x, q13, q2, topw, ids, s13, s2 = problem(t, 64, 6, block, h=2048, inter=1408, seed=1,
                                             dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(x, q13, q2, topw, ids, s13, s2, block, out=out, path=path)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(x, q13, q2, topw, ids, s13, s2, block, out=out, path=path)
    for seed in (2, 3):
        x2, _, _, w_new, ids_new, _, _ = problem(t, 64, 6, block, h=2048, inter=1408, seed=seed,
                                                 dtype=torch.bfloat16, device="cuda")
        x.copy_(x2)
        topw.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        torch.cuda.synchronize()
        ref = fused_experts_fp8_ref(x, q13, q2, topw, ids, s13, s2, block)
        assert _rel_max(out, ref) <= BF16_REL_MAX
        assert _rel_mean(out, ref) <= BF16_REL_MEAN


def test_default_down_tiles(monkeypatch):
    """The FP8 down GEMM's default tiles differ from the gate/up GEMM's at 17-64 rows per expert
    on Hopper (128-wide N blocks through a descriptor, the H200 sweep's pick); from 65 to 256
    rows both dtypes' GEMMs take 128 x 128 tiles, the gate/up one with a stage more; small and
    prefill sizes and other GPUs keep one config for both."""
    import mla_kernels.fused_moe as fused_moe_mod
    from mla_kernels.fused_moe import MoEConfig, get_default_config

    monkeypatch.setattr(fused_moe_mod, "_max_shared_memory", lambda device: 232448)  # H200
    monkeypatch.setattr(fused_moe_mod, "_compute_capability", lambda device: (9, 0))
    for t in (300, 512, 682):  # 28-64 rows per expert
        up = get_default_config(t, 6, 64, "cuda", fp8=True)
        down = get_default_config(t, 6, 64, "cuda", fp8=True, down=True)
        assert up == MoEConfig(64, 64, 128, 8, 4, 3, False)
        assert down == MoEConfig(64, 128, 128, 8, 4, 3, True)
    # above 64 rows per expert: 128 x 128 tiles, the gate/up GEMM one stage deeper to 256 rows
    for t, fp8 in ((683, True), (1024, True), (2730, True), (1024, False)):
        bk = 128 if fp8 else 64
        assert get_default_config(t, 6, 64, "cuda", fp8=fp8) == MoEConfig(128, 128, bk, 8, 8, 4)
        assert (get_default_config(t, 6, 64, "cuda", fp8=fp8, down=True)
                == MoEConfig(128, 128, bk, 8, 8, 3))
    for t, fp8 in ((512, False), (64, True), (4096, True), (4096, False)):
        assert (get_default_config(t, 6, 64, "cuda", fp8=fp8, down=True)
                == get_default_config(t, 6, 64, "cuda", fp8=fp8))
    assert get_default_config(512, 6, 64, "cpu", fp8=True, down=True) == \
        get_default_config(512, 6, 64, "cpu", fp8=True)
    # elsewhere (untimed: an sm89 / sm80 GPU) one config for both GEMMs
    for cap, smem in (((8, 9), 101376), ((8, 0), 166912)):
        monkeypatch.setattr(fused_moe_mod, "_compute_capability", lambda device, c=cap: c)
        monkeypatch.setattr(fused_moe_mod, "_max_shared_memory", lambda device, m=smem: m)
        assert (get_default_config(512, 6, 64, "cuda", fp8=True, down=True)
                == get_default_config(512, 6, 64, "cuda", fp8=True))
