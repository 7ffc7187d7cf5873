"""Tensor-parallel layers vs their single-process twins.

Multi-process tests: 2 CPU ranks (gloo, `tp_harness.TpWorkers`, started once for the module) each
build the parallel layer, load the same full HF-layout weights through `weight_loader`, run the
same input, and return their outputs; the parent compares them with `ReplicatedLinear`,
`MergedLinear`, `QKVLinear`, `VocabEmbedding`, `LMHead` (fp32, 1e-5). Single-process tests: TP 1
is exactly the replicated behaviour, the shard layout of other ranks (through the layers'
`tp_rank`/`tp_size` overrides), and the error messages.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from tp_harness import TpRankError, TpWorkers, run_tp

from mla_backend.distributed import (
    destroy_tensor_parallel,
    divide,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
    is_tensor_parallel_initialized,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from mla_backend.layers.activation import SiluAndMul
from mla_backend.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    MergedLinear,
    QKVLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from mla_backend.layers.logits import (
    LMHead,
    ParallelLMHead,
    VocabEmbedding,
    VocabParallelEmbedding,
)

TP = 2
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(layer: torch.nn.Module, **tensors: torch.Tensor) -> None:
    """Load full HF tensors through the layer's weight_loader ("weight", "bias")."""
    for name, t in tensors.items():
        layer.weight_loader(getattr(layer, name), t)


def _load_shards(layer: torch.nn.Module, shards: dict, bias: dict | None = None) -> None:
    for sid, w in shards.items():
        layer.weight_loader(layer.weight, w, sid)
    for sid, b in (bias or {}).items():
        layer.weight_loader(layer.bias, b, sid)


@pytest.fixture(scope="module")
def tp2():
    with TpWorkers(TP, timeout=60.0) as workers:
        yield workers


# ------------------------------------------------------------------ rank-side functions
def _rank_collectives() -> dict:
    r = get_tp_rank()
    x = torch.full((2, 3), float(r + 1))
    y = torch.arange(6.0).reshape(2, 3)[:, ::2]  # non-contiguous
    ret = tensor_model_parallel_all_reduce(y)
    # Same rank/size again is a no-op; another size is an error.
    init_tensor_parallel(r, TP, "file:///nonexistent")
    try:
        init_tensor_parallel(r, TP + 1, "file:///nonexistent")
        reinit_error = ""
    except RuntimeError as e:
        reinit_error = str(e)
    return {"rank": r, "size": get_tp_size(), "gather_last": tensor_model_parallel_all_gather(x),
            "gather_0": tensor_model_parallel_all_gather(x, dim=0), "reduced": y,
            "same_object": ret is y, "reinit_error": reinit_error}


def _rank_column(w, b, x) -> torch.Tensor:
    layer = ColumnParallelLinear(w.shape[1], w.shape[0], bias=True, gather_output=True)
    _load(layer, weight=w, bias=b)
    return layer(x)


def _rank_merged(shards: dict, biases: dict, x) -> tuple:
    sizes = [shards["gate"].shape[0], shards["up"].shape[0]]
    layer = MergedColumnParallelLinear(x.shape[-1], sizes, bias=True, shard_names=("gate", "up"))
    _load_shards(layer, dict(reversed(shards.items())), biases)  # order must not matter
    fused = MergedColumnParallelLinear(x.shape[-1], sizes, bias=True, shard_names=("gate", "up"))
    _load(fused, weight=torch.cat([shards["gate"], shards["up"]]),
          bias=torch.cat([biases["gate"], biases["up"]]))
    return layer(x), fused(x), layer.output_sizes, layer.shard_offsets


def _rank_qkv(head_dim: int, num_heads: int, num_kv_heads: int, shards: dict, biases: dict,
              x) -> tuple:
    layer = QKVParallelLinear(x.shape[-1], head_dim, num_heads, num_kv_heads, bias=True)
    _load_shards(layer, shards, biases)
    meta = (layer.num_heads, layer.num_kv_heads, layer.q_size, layer.kv_size)
    return layer(x), meta


def _rank_row(w, b, x) -> tuple:
    r, n = get_tp_rank(), w.shape[1] // TP
    x_local = x[:, r * n:(r + 1) * n]
    layer = RowParallelLinear(w.shape[1], w.shape[0], bias=True)
    _load(layer, weight=w, bias=b)
    partial = RowParallelLinear(w.shape[1], w.shape[0], bias=True, reduce_results=False)
    _load(partial, weight=w, bias=b)
    return layer(x_local), tensor_model_parallel_all_reduce(partial(x_local))


def _rank_mlp(w1, w2, b2, gate, up, down, x) -> tuple:
    # Megatron pair: column (no gather) -> elementwise -> row (one all-reduce).
    col = ColumnParallelLinear(w1.shape[1], w1.shape[0])
    row = RowParallelLinear(w2.shape[1], w2.shape[0], bias=True)
    _load(col, weight=w1)
    _load(row, weight=w2, bias=b2)
    plain = row(F.gelu(col(x)))
    # Llama's gated MLP: merged gate/up -> SiluAndMul -> down.
    gate_up = MergedColumnParallelLinear(x.shape[-1], [gate.shape[0]] * 2,
                                         shard_names=("gate", "up"))
    _load_shards(gate_up, {"gate": gate, "up": up})
    down_proj = RowParallelLinear(down.shape[1], down.shape[0])
    _load(down_proj, weight=down)
    return plain, down_proj(SiluAndMul()(gate_up(x)))


def _rank_embedding(table, ids) -> tuple:
    emb = VocabParallelEmbedding(*table.shape)
    _load(emb, weight=table)
    return emb(ids), emb.weight.clone(), (emb.vocab_start_index, emb.vocab_end_index)


def _rank_lm_head(w, hidden) -> tuple:
    head = ParallelLMHead(*w.shape)
    _load(head, weight=w)
    emb = VocabParallelEmbedding(*w.shape)
    _load(emb, weight=w)
    tied = ParallelLMHead(*w.shape, emb)
    # into a given buffer (the CUDA graphs' path): the padded, gathered logits copied in
    out = torch.full((hidden.shape[0] + 2, w.shape[0]), float("nan"))
    into = head(hidden, out=out[1:-1])
    return (head(hidden), tied(hidden), tied.weight is emb.weight,
            (into.data_ptr() == out[1:-1].data_ptr(), out))


def _rank_fail_on_1() -> int:
    if get_tp_rank() == 1:
        raise ZeroDivisionError("rank one is broken")
    tensor_model_parallel_all_reduce(torch.ones(1))  # never completes: rank 1 is gone
    return 0


# ------------------------------------------------------------------ multi-process tests
def test_collectives_and_state(tp2):
    out = tp2.run(_rank_collectives)
    for r, o in enumerate(out):
        assert (o["rank"], o["size"]) == (r, TP)
        torch.testing.assert_close(o["gather_last"],
                                   torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], 1))
        torch.testing.assert_close(o["gather_0"],
                                   torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)], 0))
        torch.testing.assert_close(o["reduced"], 2 * torch.arange(6.0).reshape(2, 3)[:, ::2])
        assert o["same_object"]
        assert "already initialized as rank" in o["reinit_error"]


def test_column_parallel_gather_output(tp2):
    w, b, x = _rand(24, 16, seed=1), _rand(24, seed=2), _rand(5, 16, seed=3)
    ref = ReplicatedLinear(16, 24, bias=True)
    _load(ref, weight=w, bias=b)
    for y in tp2.run(_rank_column, w, b, x):
        assert y.shape == (5, 24)
        torch.testing.assert_close(y, ref(x), **TOL)


def test_merged_column_parallel_gate_up(tp2):
    inter, hidden = 20, 16
    shards = {"gate": _rand(inter, hidden, seed=4), "up": _rand(inter, hidden, seed=5)}
    biases = {"gate": _rand(inter, seed=6), "up": _rand(inter, seed=7)}
    x = _rand(5, hidden, seed=8)
    ref = MergedLinear(hidden, [inter, inter], bias=True, shard_names=("gate", "up"))
    _load_shards(ref, shards, biases)
    full = ref(x)  # [5, gate 20 | up 20]
    n = inter // TP
    for r, (y, y_fused, sizes, offsets) in enumerate(tp2.run(_rank_merged, shards, biases, x)):
        want = torch.cat([full[:, r * n:(r + 1) * n], full[:, inter + r * n:inter + (r + 1) * n]],
                         dim=1)
        torch.testing.assert_close(y, want, **TOL)
        torch.testing.assert_close(y_fused, want, **TOL)
        assert sizes == [n, n] and offsets == {"gate": (0, n), "up": (n, n)}


@pytest.mark.parametrize("num_kv_heads", [4, 1], ids=["kv_split", "kv_replicated"])
def test_qkv_parallel(tp2, num_kv_heads):
    hidden, d, nh = 16, 4, 8
    shards = {"q": _rand(nh * d, hidden, seed=9), "k": _rand(num_kv_heads * d, hidden, seed=10),
              "v": _rand(num_kv_heads * d, hidden, seed=11)}
    biases = {k: _rand(v.shape[0], seed=12 + i) for i, (k, v) in enumerate(shards.items())}
    x = _rand(5, hidden, seed=15)
    ref = QKVLinear(hidden, d, nh, num_kv_heads, bias=True)
    _load_shards(ref, shards, biases)
    q, k, v = ref(x).split([ref.q_size, ref.kv_size, ref.kv_size], dim=-1)
    local_q = nh // TP * d
    for r, (y, meta) in enumerate(tp2.run(_rank_qkv, d, nh, num_kv_heads, shards, biases, x)):
        if num_kv_heads >= TP:
            kv_heads = range(r * num_kv_heads // TP, (r + 1) * num_kv_heads // TP)
        else:
            kv_heads = [r * num_kv_heads // TP]
        cols = torch.tensor([h * d + i for h in kv_heads for i in range(d)])
        want = torch.cat([q[:, r * local_q:(r + 1) * local_q], k[:, cols], v[:, cols]], dim=1)
        assert meta == (nh // TP, len(kv_heads), local_q, len(kv_heads) * d)
        torch.testing.assert_close(y, want, **TOL)


def test_row_parallel_with_bias(tp2):
    w, b, x = _rand(16, 24, seed=16), _rand(16, seed=17), _rand(5, 24, seed=18)
    ref = ReplicatedLinear(24, 16, bias=True)
    _load(ref, weight=w, bias=b)
    for y, y_caller_reduced in tp2.run(_rank_row, w, b, x):
        torch.testing.assert_close(y, ref(x), **TOL)
        torch.testing.assert_close(y_caller_reduced, ref(x), **TOL)  # bias counted once


def test_column_row_mlp_pair(tp2):
    hidden, inter = 16, 32
    w1, w2 = _rand(inter, hidden, seed=19), _rand(hidden, inter, seed=20)
    b2 = _rand(hidden, seed=21)
    gate, up = _rand(inter, hidden, seed=22), _rand(inter, hidden, seed=23)
    down, x = _rand(hidden, inter, seed=24), _rand(5, hidden, seed=25)
    l1, l2 = ReplicatedLinear(hidden, inter), ReplicatedLinear(inter, hidden, bias=True)
    _load(l1, weight=w1)
    _load(l2, weight=w2, bias=b2)
    gu = MergedLinear(hidden, [inter, inter], shard_names=("gate", "up"))
    _load_shards(gu, {"gate": gate, "up": up})
    dn = ReplicatedLinear(inter, hidden)
    _load(dn, weight=down)
    want_plain, want_gated = l2(F.gelu(l1(x))), dn(SiluAndMul()(gu(x)))
    for plain, gated in tp2.run(_rank_mlp, w1, w2, b2, gate, up, down, x):
        torch.testing.assert_close(plain, want_plain, **TOL)
        torch.testing.assert_close(gated, want_gated, **TOL)


def test_vocab_parallel_embedding_uneven_vocab(tp2):
    vocab, dim = 13, 8  # padded to 14: rank 0 holds ids 0..6, rank 1 ids 7..12 + one zero row
    table, ids = _rand(vocab, dim, seed=26), torch.tensor([0, 6, 7, 12, 3, 7, 0, 11])
    ref = VocabEmbedding(vocab, dim)
    ref.weight.data.copy_(table)
    out = tp2.run(_rank_embedding, table, ids)
    for r, (y, local_w, (start, end)) in enumerate(out):
        assert (start, end) == (7 * r, 7 * r + 7)
        assert local_w.shape == (7, dim)
        torch.testing.assert_close(y, ref(ids), **TOL)
    assert torch.equal(out[1][1][6], torch.zeros(dim))  # the padding row


def test_parallel_lm_head(tp2):
    vocab, hidden = 13, 8
    w, h = _rand(vocab, hidden, seed=27), _rand(4, hidden, seed=28)
    ref = LMHead(vocab, hidden)
    ref.weight.data.copy_(w)
    for logits, tied_logits, shares, (same, out) in tp2.run(_rank_lm_head, w, h):
        assert logits.shape == (4, vocab) and logits.dtype == torch.float32
        assert logits.is_contiguous()
        torch.testing.assert_close(logits, ref(h), **TOL)
        torch.testing.assert_close(tied_logits, ref(h), **TOL)
        assert shares
        assert same and torch.equal(out[1:-1], logits)  # rows written in place
        assert out[0].isnan().all() and out[-1].isnan().all()  # nothing else touched


def test_harness_reports_rank_exception_without_hanging():
    t0 = time.monotonic()
    with pytest.raises(TpRankError) as info:
        run_tp(TP, _rank_fail_on_1, timeout=30.0)
    msg = str(info.value)
    assert "rank 1 raised" in msg and "ZeroDivisionError: rank one is broken" in msg
    assert "_rank_fail_on_1" in msg  # the traceback names the failing function
    assert time.monotonic() - t0 < 25.0  # rank 0, stuck in its all-reduce, was terminated


# ------------------------------------------------------------------ single process
def test_not_initialized_is_single_rank():
    assert not is_tensor_parallel_initialized()
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    x = torch.ones(3)
    assert tensor_model_parallel_all_reduce(x) is x
    assert tensor_model_parallel_all_gather(x) is x


def test_init_world_size_one_and_errors():
    with pytest.raises(ValueError, match="rank 2 out of range"):
        init_tensor_parallel(2, 2, "file:///unused")
    try:
        init_tensor_parallel(0, 1, "file:///unused")  # no process group needed
        assert is_tensor_parallel_initialized() and get_tp_size() == 1
        init_tensor_parallel(0, 1, "file:///unused")  # idempotent
        with pytest.raises(RuntimeError, match="already initialized as rank 0 of 1"):
            init_tensor_parallel(0, 2, "file:///unused")
    finally:
        destroy_tensor_parallel()
    assert not is_tensor_parallel_initialized()
    destroy_tensor_parallel()  # harmless when not initialized


def test_tp1_equals_replicated_classes():
    x = _rand(5, 16, seed=30)
    w, b = _rand(24, 16, seed=31), _rand(24, seed=32)
    ref = ReplicatedLinear(16, 24, bias=True)
    _load(ref, weight=w, bias=b)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(16, 24, bias=True)
        _load(layer, weight=w, bias=b)
        assert layer.weight.shape == ref.weight.shape
        assert torch.equal(layer(x), ref(x))
    merged_ref = MergedLinear(16, [12, 12], bias=True, shard_names=("gate", "up"))
    merged = MergedColumnParallelLinear(16, [12, 12], bias=True, shard_names=("gate", "up"))
    for layer in (merged_ref, merged):
        _load_shards(layer, {"gate": w[:12], "up": w[12:]}, {"gate": b[:12], "up": b[12:]})
    assert merged.shard_offsets == merged_ref.shard_offsets
    assert merged.output_sizes == merged_ref.output_sizes
    assert torch.equal(merged(x), merged_ref(x))
    qkv_ref, qkv = QKVLinear(16, 4, 4, 1, bias=True), QKVParallelLinear(16, 4, 4, 1, bias=True)
    for layer in (qkv_ref, qkv):
        _load_shards(layer, {"q": w[:16], "k": w[16:20], "v": w[20:]},
                     {"q": b[:16], "k": b[16:20], "v": b[20:]})
    assert (qkv.q_size, qkv.kv_size, qkv.shard_offsets) == (16, 4, qkv_ref.shard_offsets)
    assert torch.equal(qkv(x), qkv_ref(x))

    table, ids = _rand(13, 16, seed=33), torch.tensor([0, 12, 5])
    emb_ref, emb = VocabEmbedding(13, 16), VocabParallelEmbedding(13, 16)
    emb_ref.weight.data.copy_(table)
    _load(emb, weight=table)
    assert emb.weight.shape == emb_ref.weight.shape and torch.equal(emb(ids), emb_ref(ids))
    for tied in (False, True):
        head_ref = LMHead(13, 16, emb_ref if tied else None)
        head = ParallelLMHead(13, 16, emb if tied else None)
        if not tied:
            head_ref.weight.data.copy_(table)
            _load(head, weight=table)
        assert head.tied == head_ref.tied
        assert torch.equal(head(x), head_ref(x)) and head(x).dtype == torch.float32
        # into a buffer: of the weight's dtype the GEMM writes it (TP 1), of another dtype the
        # logits are converted into it; the same values either way
        for dtype in (torch.float32, torch.bfloat16):
            buf = torch.zeros(x.shape[0], 13, dtype=dtype)
            for h_ in (head, head_ref):
                assert h_(x, out=buf) is buf
                assert torch.equal(buf, head_ref(x).to(dtype))


def test_shard_layout_of_other_ranks():
    """Which rows each rank takes, through the tp_rank/tp_size overrides (no processes)."""
    hidden, d = 3, 2
    q = torch.arange(8 * d * hidden, dtype=torch.float32).reshape(8 * d, hidden)
    k = 1000 + torch.arange(2 * d * hidden, dtype=torch.float32).reshape(2 * d, hidden)
    v = -k
    for r in range(4):  # 8 q heads / 2 kv heads on 4 ranks: kv head r // 2, held by 2 ranks
        layer = QKVParallelLinear(hidden, d, 8, 2, tp_rank=r, tp_size=4)
        _load_shards(layer, {"q": q, "k": k, "v": v})
        kv = slice((r // 2) * d, (r // 2 + 1) * d)
        assert layer.num_kv_head_replicas == 2
        assert torch.equal(layer.weight, torch.cat([q[r * 2 * d:(r + 1) * 2 * d], k[kv], v[kv]]))
    row = RowParallelLinear(6, 2, tp_rank=2, tp_size=3)
    full = torch.arange(12.0).reshape(2, 6)
    _load(row, weight=full)
    assert torch.equal(row.weight, full[:, 4:6])
    emb = VocabParallelEmbedding(10, 2, tp_rank=3, tp_size=4)  # padded 12, 3 per rank
    _load(emb, weight=torch.ones(10, 2))
    assert (emb.vocab_start_index, emb.vocab_end_index) == (9, 12)
    assert torch.equal(emb.weight, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))


def test_divide_error_message():
    assert divide(8, 2) == 4
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide "
                                         "num_attention_heads=8"):
        divide(8, 3, "num_attention_heads")


@pytest.mark.parametrize("heads, kv_heads, tp, match", [
    (8, 8, 3, "tensor parallel size 3 does not divide num_heads=8"),
    (8, 6, 4, "tensor parallel size 4 does not divide num_kv_heads=6"),
    (12, 3, 4, "num_kv_heads=3 does not divide tensor parallel size 4"),
])
def test_qkv_head_split_errors(heads, kv_heads, tp, match):
    with pytest.raises(ValueError, match=match):
        QKVParallelLinear(16, 4, heads, kv_heads, tp_rank=0, tp_size=tp)


def test_loader_and_split_errors():
    col = ColumnParallelLinear(4, 6, tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match=r"full HF tensor of shape \(6, 4\), got \(3, 4\)"):
        _load(col, weight=torch.zeros(3, 4))  # a pre-sliced shard is refused
    with pytest.raises(ValueError, match="does not divide out_features=6"):
        ColumnParallelLinear(4, 6, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="does not divide in_features=6"):
        RowParallelLinear(6, 4, tp_rank=0, tp_size=4)
    merged = MergedColumnParallelLinear(4, [6, 6], shard_names=("gate", "up"), tp_rank=0,
                                        tp_size=2)
    with pytest.raises(KeyError, match="unknown shard 'down'"):
        merged.weight_loader(merged.weight, torch.zeros(6, 4), "down")
    with pytest.raises(ValueError, match="shard 'up'"):
        merged.weight_loader(merged.weight, torch.zeros(3, 4), "up")
    emb = VocabParallelEmbedding(10, 2, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="tied weight of shape"):
        ParallelLMHead(10, 3, emb)
    with pytest.raises(ValueError, match=r"\(10, 2\)"):
        _load(emb, weight=torch.zeros(5, 2))
