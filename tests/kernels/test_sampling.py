"""`mla_kernels.sampling.greedy_with_logprob` against torch in float64 (CPU: triton's
interpreter; GPU: also the sampler's fused branch against its torch path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_kernels.sampling import greedy_with_logprob

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    xd = x.double()
    ids = torch.argmax(xd, dim=-1)
    lse = torch.logsumexp(xd, dim=-1)
    return ids, xd.gather(1, ids.unsqueeze(1)).squeeze(1) - lse, lse


def _check(x: torch.Tensor, splits: int | None = None) -> None:
    ids, lp, lse = greedy_with_logprob(x, splits)
    rid, rlp, rlse = _reference(x)
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.equal(ids.cpu(), rid.cpu())
    torch.testing.assert_close(lp.double().cpu(), rlp.cpu(), rtol=1e-5, atol=1e-5,
                               equal_nan=True)
    torch.testing.assert_close(lse.double().cpu(), rlse.cpu(), rtol=1e-5, atol=1e-5,
                               equal_nan=True)


# splits None: the default plan (several programs per row below SPLIT_MAX_ROWS rows of more
# than one block); 1: one program per row (the plan from SPLIT_MAX_ROWS rows)
SPLITS = pytest.mark.parametrize("splits", [None, 1], ids=["plan", "one_program"])


@SPLITS
@pytest.mark.parametrize("bs,v", [(1, 7), (3, 1000), (4, 4096), (2, 10_000)])
def test_random_rows(bs, v, splits):
    g = torch.Generator().manual_seed(bs * v)
    _check((torch.randn(bs, v, generator=g) * 4).to(DEV), splits)


@SPLITS
def test_ties_take_the_first_column_across_blocks(splits):
    x = torch.zeros(3, 9000)
    x[0, 5000] = x[0, 8999] = 2.0  # two blocks of 4,096: the earlier block's column wins
    x[1, 17] = x[1, 4113] = 3.0  # same lane in two blocks
    x[2, 4095] = x[2, 4096] = 1.0  # adjacent columns on either side of a block edge
    ids, _, _ = greedy_with_logprob(x.to(DEV), splits)
    assert ids.tolist() == [5000, 17, 4095]
    _check(x.to(DEV), splits)


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """bool [m, V] -> int32 [m, ceil(V / 32)] (bit j of word i = column 32 i + j)."""
    m, v = allowed.shape
    bits = torch.zeros(m, -(-v // 32) * 32, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    words = (bits.view(m, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _check_masked(x: torch.Tensor, allowed: torch.Tensor, mask_rows: list[int],
                  splits: int | None) -> None:
    """The bitmask kernel against torch in float64: the argmax of the row with the tokens its
    mask row disallows set to -inf (mask row -1: the whole row), the logprob of that token and
    the logsumexp from the raw row."""
    ids, lp, lse = greedy_with_logprob(x.to(DEV), splits, bitmask=_pack(allowed).to(DEV),
                                       mask_rows=torch.tensor(mask_rows, device=DEV))
    xd = x.double()
    masked = xd.clone()
    for r, mr in enumerate(mask_rows):
        if mr >= 0:
            masked[r] = xd[r].masked_fill(~allowed[mr], float("-inf"))
    rid = torch.argmax(masked, dim=-1)
    rlse = torch.logsumexp(xd, dim=-1)
    assert torch.equal(ids.cpu(), rid)
    torch.testing.assert_close(lp.double().cpu(), xd.gather(1, rid.unsqueeze(1)).squeeze(1) - rlse,
                               rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(lse.double().cpu(), rlse, rtol=1e-5, atol=1e-5, equal_nan=True)


@SPLITS
@pytest.mark.parametrize("bs,v", [(1, 7), (3, 1000), (4, 4096), (2, 10_000)])
def test_bitmask_rows_take_the_argmax_of_their_allowed_tokens(bs, v, splits):
    gen = torch.Generator().manual_seed(bs * v)
    x = torch.randn(bs, v, generator=gen)
    allowed = torch.rand(bs + 1, v, generator=gen) < 0.3
    allowed[0, :] = False
    allowed[0, v - 1] = True  # one token, the last column (the last word's high bit)
    # rows: the single-token mask, an unmasked row, then masks given out of order
    mask_rows = ([0, -1] + [bs - i for i in range(2, bs)])[:bs]
    _check_masked(x, allowed, mask_rows, splits)


@SPLITS
def test_bitmask_edge_rows_follow_torch(splits):
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(2))
    allowed = torch.ones(5, 300, dtype=torch.bool)
    allowed[0, :] = False  # nothing allowed: torch's argmax of an all -inf row, 0
    allowed[1, 31] = allowed[1, 32] = allowed[1, 63] = False  # word edges and bit 31
    x[1, 31] = x[1, 32] = x[1, 63] = 100.0  # the disallowed maxima are skipped
    x[2, 10] = float("nan")  # a disallowed NaN: not the argmax, the logsumexp is NaN
    allowed[2, 10] = False
    x[3, 7] = float("nan")  # an allowed NaN: the argmax (torch's first NaN)
    x[4, :] = float("-inf")  # an unmasked row of -inf
    _check_masked(x, allowed, [0, 1, 2, 3, -1], splits)
    ids, _, lse = greedy_with_logprob(x.to(DEV), splits, bitmask=_pack(allowed).to(DEV),
                                      mask_rows=torch.tensor([0, 1, 2, 3, -1], device=DEV))
    assert ids.tolist()[:4] == [0, int(torch.argmax(x[1].masked_fill(~allowed[1], -1e9))),
                                int(torch.argmax(x[2].masked_fill(~allowed[2], -1e9))), 7]
    assert lse[2].isnan()


def test_bitmask_bad_input():
    x = torch.zeros(2, 70, device=DEV)
    words = torch.zeros(2, 3, dtype=torch.int32, device=DEV)
    rows = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="bitmask"):
        greedy_with_logprob(x, bitmask=words)  # no mask_rows
    with pytest.raises(ValueError, match="bitmask"):
        greedy_with_logprob(x, bitmask=words[:, :2], mask_rows=rows)  # 64 bits < 70 columns
    with pytest.raises(ValueError, match="bitmask"):
        greedy_with_logprob(x, bitmask=words.float(), mask_rows=rows)
    with pytest.raises(ValueError, match="bitmask"):
        greedy_with_logprob(x, bitmask=words, mask_rows=rows[:1])


@SPLITS
def test_masked_nan_and_empty_rows_follow_torch(splits):
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    x[0, :] = float("-inf")  # torch: index 0, logsumexp -inf, logprob NaN
    x[1, 3:] = float("-inf")  # min_tokens-style masking
    x[2, 40] = float("nan")
    x[2, 200] = float("nan")  # torch.argmax: the first NaN
    ids, lp, lse = greedy_with_logprob(x.to(DEV), splits)
    assert ids.tolist()[:3] == [0, int(torch.argmax(x[1])), 40]
    assert lse[0].item() == float("-inf") and lp[0].isnan() and lp[2].isnan()
    _check(x.to(DEV), splits)


@SPLITS
def test_padded_row_stride_and_bf16(splits):
    g = torch.Generator().manual_seed(2)
    padded = torch.randn(5, 9100, generator=g).to(DEV)
    _check(padded[:, :9030], splits)  # rows 9,100 apart, 9,030 columns (3 blocks) read
    _check((torch.randn(3, 515, generator=g) * 2).to(torch.bfloat16).to(DEV), splits)


@pytest.mark.parametrize("splits", [2, 4, 8])
def test_split_rows_equal_the_reference(splits, monkeypatch):
    """Several programs per row (small batches) and the combine, with 512-column blocks so that
    3,000 columns fill several splits: random rows, a tie between the first and the last split
    (the earlier column wins), NaNs in two splits, an all -inf row, leading splits of only
    -inf, and splits past the row's end (8 splits of 512 columns over 3,000)."""
    import mla_kernels.sampling as sampling_mod

    monkeypatch.setattr(sampling_mod, "GREEDY_BLOCK", 512)
    g = torch.Generator().manual_seed(splits)
    x = torch.randn(5, 3000, generator=g) * 3
    x[1, 100] = x[1, 2900] = 50.0  # tie in the first and the last split
    x[2, 2999] = float("nan")
    x[2, 2500] = float("nan")
    x[3, :] = float("-inf")
    x[4, :2000] = float("-inf")  # the first splits hold only -inf
    ids, lp, lse = greedy_with_logprob(x.to(DEV), splits)
    assert ids.tolist()[1:4] == [100, 2500, 0]
    assert lse[3].item() == float("-inf") and lp[3].isnan()
    _check(x.to(DEV), splits)
    # the default plan splits small batches: bs 1 with a DeepSeek-size row
    _check(torch.randn(1, 102_400, generator=g).to(DEV))


def test_split_plan():
    from mla_kernels.sampling import MAX_SPLITS, num_splits

    assert num_splits(160, 102_400) == 1  # SPLIT_MAX_ROWS: one program each
    assert num_splits(1, 102_400) == 32  # 25 blocks of columns -> 32 (pow 2)
    assert num_splits(64, 102_400) == 8  # cdiv(264, 64) = 5 -> 8
    assert num_splits(128, 102_400) == 4  # cdiv(264, 128) = 3 -> 4
    assert num_splits(1, 10**7) == MAX_SPLITS
    assert num_splits(3, 1000) == 1  # one block per row: nothing to split


def test_plan_batch_sizes_cover_every_plan():
    from mla_kernels.sampling import SPLIT_MAX_ROWS, num_splits, plan_batch_sizes

    v = 102_400
    sizes = plan_batch_sizes(512, v)
    plans = [num_splits(b, v) for b in sizes]
    every = {num_splits(b, v) for b in range(1, 513)}
    assert sorted(plans, reverse=True) == plans and set(plans) == every and 1 in plans
    assert sizes[0] == 1 and sizes[-1] == SPLIT_MAX_ROWS
    assert sizes == [1, 17, 33, 66, 132, 160]  # 32, 16, 8, 4, 2 splits, then one program
    assert plan_batch_sizes(16, v) == [1]  # up to 16 rows: 25 blocks per row -> 32 splits


def test_bad_input():
    with pytest.raises(ValueError, match="bs, V>0"):
        greedy_with_logprob(torch.zeros(3))
    with pytest.raises(ValueError, match="contiguous"):
        greedy_with_logprob(torch.zeros(4, 6).t())
    with pytest.raises(ValueError, match="power of two"):
        greedy_with_logprob(torch.zeros(4, 6), splits=3)
    with pytest.raises(ValueError, match="power of two"):
        greedy_with_logprob(torch.zeros(4, 6), splits=128)
    ids, lp, lse = greedy_with_logprob(torch.zeros(0, 5, device=DEV))
    assert ids.shape == lp.shape == lse.shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bs", [3, 100, 256])  # 32 and 4 splits per row, one program per row
def test_sampler_fused_branch_matches_the_torch_path(monkeypatch, bs):
    import mla_kernels.sampling as sampling_mod
    from mla_backend.model_executor.sampler import Sampler
    from mla_backend.request import Req, SamplingParams

    vocab = 102_400
    logits = torch.randn(bs, vocab + 64, generator=torch.Generator().manual_seed(3)).cuda() * 5
    reqs = [Req(rid=str(i), origin_input_ids=[1, 2, 3],
                sampling_params=SamplingParams(temperature=0.0, max_new_tokens=4,
                                               logprobs=2 if i % 7 == 0 else None))
            for i in range(bs)]
    calls = []
    monkeypatch.setattr(sampling_mod, "greedy_with_logprob",
                        lambda x, **kw: calls.append(x.shape) or greedy_with_logprob(x, **kw))
    sampler = Sampler(set(), vocab, "cuda")
    # the launch plans of 1 .. 512 rows, without and with token bitmasks, compiled once
    assert sampler.warm_up(512) == 12
    assert len(calls) == 12
    calls.clear()
    fused = sampler.sample(logits, reqs)
    assert calls == [(bs, vocab)]  # the fused branch ran
    raw = logits[:, :vocab].double()
    ids = raw.argmax(-1)
    lp = raw.gather(1, ids[:, None]).squeeze(1) - torch.logsumexp(raw, -1)
    assert fused.next_token_ids == ids.tolist()
    torch.testing.assert_close(torch.tensor(fused.token_logprobs, dtype=torch.float64),
                               lp.cpu(), rtol=1e-5, atol=1e-5)
    assert all((d is None) == (i % 7 != 0) for i, d in enumerate(fused.top_logprobs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sampler_reads_16bit_logits_as_their_fp32_form(monkeypatch, dtype):
    """A CUDA graph replay hands the sampler logits in the model dtype: the greedy branch reads
    them as they are (no fp32 copy) and gives what their fp32 form gives, bit for bit (the
    same values); the torch branch (a penalty) converts them first; the warm-up compiles both
    dtypes' variants."""
    import mla_kernels.sampling as sampling_mod
    from mla_backend.model_executor.sampler import Sampler
    from mla_backend.request import Req, SamplingParams

    vocab, bs = 102_400, 40
    low = (torch.randn(bs, vocab, generator=torch.Generator().manual_seed(5)) * 5).to(dtype)
    low = low.cuda()

    def reqs(**kw):
        return [Req(rid=str(i), origin_input_ids=[1, 2, 3],
                    sampling_params=SamplingParams(temperature=0.0, max_new_tokens=4,
                                                   logprobs=3 if i % 5 == 0 else None, **kw))
                for i in range(bs)]

    calls = []
    monkeypatch.setattr(sampling_mod, "greedy_with_logprob",
                        lambda x, **kw: calls.append(x.dtype) or greedy_with_logprob(x, **kw))
    sampler = Sampler(set(), vocab, "cuda")
    assert sampler.warm_up(64, (torch.float32, dtype)) == 2 * 3 * 2  # (without and with masks)
    assert calls.count(dtype) == 3 * 2
    calls.clear()
    got, want = sampler.sample(low, reqs()), sampler.sample(low.float(), reqs())
    assert calls == [dtype, torch.float32]
    assert got.next_token_ids == want.next_token_ids
    assert got.token_logprobs == want.token_logprobs
    assert got.top_logprobs == want.top_logprobs
    calls.clear()
    pen = sampler.sample(low, reqs(repetition_penalty=1.3))
    assert calls == []  # processed logits: the torch branch, on the fp32 form
    assert pen.next_token_ids == sampler.sample(low.float(), reqs(repetition_penalty=1.3)
                                                ).next_token_ids


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(
    st.integers(0, 3),  # min_new_tokens
    st.integers(0, 2),  # output tokens so far
    st.sampled_from([(), (2,), (5, 2)]),  # stop_token_ids
    st.sampled_from([None, 3]),  # logprobs
    st.booleans(),  # make EOS (or the first stop id) the row's argmax
), min_size=1, max_size=7), st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 2**31 - 1), st.booleans())
def test_sampler_fused_branch_with_min_tokens_equals_the_torch_path(rows, dtype, seed,
                                                                    inference):
    """Greedy rows under min_new_tokens take the one-pass kernel with their EOS / stop ids
    excluded by its bitmask (`Sampler._ban_masks`): the same tokens and, within fp32
    rounding, the same logprobs (of the raw logits) as the torch path, and the logits are left
    as they were. `inference`: the logits are an inference tensor, as an eager forward's
    (ModelRunner forwards under inference_mode; a CUDA graph's buffer is a normal tensor)."""
    from mla_backend.model_executor.sampler import Sampler
    from mla_backend.request import Req, SamplingParams

    vocab, eos = 300, 7
    logits = torch.randn(len(rows), vocab + 5, generator=torch.Generator().manual_seed(seed)) * 4
    reqs = []
    for i, (min_new, n_out, stops, logprobs, top_banned) in enumerate(rows):
        if top_banned:
            logits[i, (stops or (eos,))[0]] = logits[i].max() + 1.0
        r = Req(rid=str(i), origin_input_ids=[1, 2], sampling_params=SamplingParams(
            temperature=0.0, max_new_tokens=8, min_new_tokens=min_new,
            stop_token_ids=stops, logprobs=logprobs))
        r.output_ids = [9] * n_out
        reqs.append(r)
    logits = logits.to(dtype).to(DEV)
    if inference:
        with torch.inference_mode():
            logits = logits.clone()
        assert logits.is_inference()
    before = logits.clone()
    torch_path = Sampler({eos}, vocab, DEV)
    torch_path.fused_greedy = False
    fused_path = Sampler({eos}, vocab, DEV)
    fused_path.fused_greedy = True
    want = torch_path.sample(logits, reqs)
    got = fused_path.sample(logits, reqs)
    assert torch.equal(logits, before)
    assert got.next_token_ids == want.next_token_ids
    for i, (min_new, n_out, stops, _, _) in enumerate(rows):
        if n_out < min_new:
            assert got.next_token_ids[i] not in set(stops) | {eos}
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs),
                               rtol=1e-5, atol=1e-5)
    for g, w in zip(got.top_logprobs, want.top_logprobs):
        assert (g is None) == (w is None)
        if g is not None:
            assert list(g) == list(w)
            torch.testing.assert_close(torch.tensor(list(g.values())),
                                       torch.tensor(list(w.values())), rtol=1e-5, atol=1e-5)


def test_engine_with_the_fused_min_tokens_path_equals_the_torch_path():
    """Through `Engine` (eager forwards, whose logits are inference tensors; on the GPU when
    there is one, else under triton's interpreter): greedy requests under min_new_tokens give
    the same tokens with the one-pass kernel as with the torch path, and run to their
    length."""
    from pathlib import Path

    from mla_backend.config import EngineConfig
    from mla_backend.engine import Engine
    from mla_backend.request import SamplingParams

    model = Path(__file__).resolve().parents[2] / "checkpoints" / "deepseek-v2-tiny"
    eng = Engine(EngineConfig.create(model_path=str(model), dtype="float32", device=DEV,
                                     overlap_schedule="false", disable_cuda_graph=True))
    try:
        eng.sampler.fused_greedy = False  # (the default on CUDA is the kernel)
        prompts = ["Once upon a time", "The capital of France is"]
        params = [SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=0.0),
                  SamplingParams(max_new_tokens=5, min_new_tokens=2, temperature=0.0,
                                 stop_token_ids=(11,), logprobs=2)]
        want = eng.generate(prompts, params)
        eng.sampler.fused_greedy = True
        got = eng.generate(prompts, params)
    finally:
        eng.shutdown()
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert len(got[0].token_ids) == 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked_rows", [[0, 1, 2, 3, 4], [1, 3], [4]], ids=["all", "some", "one"])
@pytest.mark.parametrize("inference", [False, True], ids=["tensor", "inference-tensor"])
def test_sampler_fused_branch_with_token_masks_equals_the_torch_path(monkeypatch, dtype,
                                                                      masked_rows, inference):
    """Greedy rows with grammar bitmasks (`TokenMasks`, e.g. structured outputs) take the
    one-pass kernel with the masks; the same tokens and logprobs (of the raw logits) as the torch
    path with the caller's `restrict`, also with a row under min_new_tokens (its bans written
    around the kernel, `_greedy_with_bans`: in place, also on an eager forward's inference
    tensor); the logits are left as they were."""
    pytest.importorskip("xgrammar")  # the GPU machine's server-only bundle has none
    import mla_kernels.sampling as sampling_mod
    from mla_backend.constrained.grammar import apply_bitmask_reference
    from mla_backend.model_executor.sampler import Sampler, TokenMasks
    from mla_backend.request import Req, SamplingParams

    calls = []

    def recorded(x, *args, **kw):
        calls.append(sorted(kw))
        return greedy_with_logprob(x, *args, **kw)

    monkeypatch.setattr(sampling_mod, "greedy_with_logprob", recorded)
    vocab, eos, bs = 300, 7, 5
    gen = torch.Generator().manual_seed(len(masked_rows))
    logits = (torch.randn(bs, vocab + 5, generator=gen) * 4).to(dtype).to(DEV)
    allowed = torch.rand(len(masked_rows), vocab, generator=gen) < 0.2
    allowed[:, eos] = True
    logits[:, eos] = logits.float().max() + 1  # EOS allowed and on top: banned in row 2
    bitmask = _pack(allowed)
    if inference:
        with torch.inference_mode():
            logits = logits.clone()
    reqs = []
    for i in range(bs):
        r = Req(rid=str(i), origin_input_ids=[1, 2], sampling_params=SamplingParams(
            temperature=0.0, max_new_tokens=8, min_new_tokens=3 if i == 2 else 0,
            logprobs=2 if i % 2 else None))
        reqs.append(r)

    def restrict(x: torch.Tensor) -> None:
        idx = torch.tensor(masked_rows, device=x.device)
        picked = x.index_select(0, idx)
        apply_bitmask_reference(picked, bitmask.to(x.device), vocab_size=vocab)
        x.index_copy_(0, idx, picked)

    before = logits.clone()
    torch_path = Sampler({eos}, vocab, DEV)
    torch_path.fused_greedy = False
    fused_path = Sampler({eos}, vocab, DEV)
    fused_path.fused_greedy = True
    want = torch_path.resolve(torch_path.launch(logits, reqs, restrict))
    got = fused_path.resolve(fused_path.launch(logits, reqs, restrict,
                                               TokenMasks(masked_rows, bitmask)))
    assert calls == [["bitmask", "mask_rows"]]  # the fused branch ran, with the masks
    assert torch.equal(logits, before)
    assert got.next_token_ids == want.next_token_ids
    for j, r in enumerate(masked_rows):
        assert allowed[j, got.next_token_ids[r]]
    assert got.next_token_ids[2] != eos
    torch.testing.assert_close(torch.tensor(got.token_logprobs), torch.tensor(want.token_logprobs),
                               rtol=1e-5, atol=1e-5)
    assert [g and list(g) for g in got.top_logprobs] == [w and list(w) for w in want.top_logprobs]
