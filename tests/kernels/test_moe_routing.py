"""`mla_kernels.moe_routing.softmax_topk` vs its twin `reference.softmax_topk_ref`, and the
router's dispatch to it (`mla_backend.layers.moe.select_experts` on CUDA).

CPU (CI): under TRITON_INTERPRET=1 (tests/kernels/conftest.py) in fp32. GPU (`gpu` marker):
bf16 logits against the fp32 reference, and `select_experts` on CUDA (the kernel) against the
same function on the CPU copy (the torch path).
"""

from __future__ import annotations

import pytest
import torch

from mla_backend.layers.moe import select_experts
from mla_kernels.moe_routing import softmax_topk
from mla_kernels.reference import softmax_topk_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

FP32 = dict(atol=1e-6, rtol=1e-5)


def _logits(t: int, e: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(t, e, generator=g)).to(device=DEVICE, dtype=dtype)


def _check(logits: torch.Tensor, k: int, renorm: bool, scale: float, exact_ids: bool = True
           ) -> None:
    """The kernel's weights equal the reference's (descending order); its ids are the
    reference's (`exact_ids`: distinct fp32 scores) or, where scores tie (bf16 logits do), k
    distinct experts whose scores are the reference's top k."""
    w, ids = softmax_topk(logits, k, renorm, scale)
    w_ref, ids_ref = softmax_topk_ref(logits.float().cpu(), k, renorm, scale)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert w.shape == ids.shape == (logits.shape[0], k)
    torch.testing.assert_close(w.cpu(), w_ref, **FP32)
    ids = ids.cpu()
    if exact_ids:
        assert torch.equal(ids, ids_ref)
        return
    p = torch.softmax(logits.float().cpu(), dim=-1)
    assert all(len(set(row)) == k for row in ids.tolist())
    torch.testing.assert_close(p.gather(-1, ids), p.gather(-1, ids_ref), **FP32)


# E: V2-Lite (64), DeepSeek-V2 (160), V3's count (256), tiny models (8), not a power of two (72)
@pytest.mark.parametrize("e,k", [(64, 6), (160, 6), (256, 8), (8, 2), (72, 1), (8, 8)])
@pytest.mark.parametrize("renorm,scale", [(False, 1.0), (True, 2.5)])
@pytest.mark.parametrize("t", [1, 5])
def test_softmax_topk_vs_ref(t, e, k, renorm, scale):
    _check(_logits(t, e, seed=31 * e + 7 * k + t), k, renorm, scale)


def test_strided_rows_and_empty_batch():
    wide = _logits(4, 100, seed=3)
    _check(wide[:, 10:74], 6, False, 1.0)  # row stride 100, last dim contiguous
    w, ids = softmax_topk(wide[:0, :64], 6)
    assert w.shape == ids.shape == (0, 6)


def test_ties_go_to_the_lower_expert_id():
    logits = torch.zeros(2, 16, device=DEVICE)
    logits[1, 9] = logits[1, 3] = 5.0  # two equal best experts, then 14 equal ones
    w, ids = softmax_topk(logits, 4)
    assert ids.cpu().tolist() == [[0, 1, 2, 3], [3, 9, 0, 1]]
    torch.testing.assert_close(w[0].cpu(), torch.full((4,), 1 / 16))


def test_renormalized_weights_sum_to_the_scale():
    w, _ = softmax_topk(_logits(3, 64, seed=5), 6, renormalize=True, scale=2.5)
    torch.testing.assert_close(w.sum(-1).cpu(), torch.full((3,), 2.5))


@pytest.mark.parametrize("shape,k,match", [((64,), 6, "must be"), ((2, 64), 0, "top_k"),
                                            ((2, 64), 65, "top_k"), ((2, 2048), 6, "experts")])
def test_bad_arguments(shape, k, match):
    with pytest.raises(ValueError, match=match):
        softmax_topk(torch.zeros(shape, device=DEVICE), k)


def test_strided_last_dim_rejected():
    with pytest.raises(ValueError, match="contiguous"):
        softmax_topk(torch.zeros(64, 2, device=DEVICE).t(), 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 3000])
def test_softmax_topk_bf16_on_gpu(t):
    logits = _logits(t, 64, seed=t, dtype=torch.bfloat16)
    _check(logits, 6, True, 1.0, exact_ids=False)  # the same bf16 inputs, fp32 math


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("renorm,scale", [(False, 1.0), (True, 16.0)])
def test_select_experts_cuda_matches_the_torch_path(renorm, scale):
    logits = _logits(37, 160, seed=11)
    w, ids = select_experts(logits, 6, "greedy", norm_topk_prob=renorm,
                            routed_scaling_factor=scale)
    w_cpu, ids_cpu = select_experts(logits.cpu(), 6, "greedy", norm_topk_prob=renorm,
                                    routed_scaling_factor=scale)
    order, order_cpu = ids.cpu().argsort(-1), ids_cpu.argsort(-1)  # torch's top-k is unsorted
    assert torch.equal(ids.cpu().gather(-1, order), ids_cpu.gather(-1, order_cpu))
    torch.testing.assert_close(w.cpu().gather(-1, order), w_cpu.gather(-1, order_cpu), **FP32)
