"""Engine-level equivalence tests: our continuous-batching engine vs Hugging Face `generate`,
cache hit vs cold, chunked vs unchunked, retraction under a tiny pool, stop rules and seeds.

All fp32 on the CPU. HF runs each prompt alone (no padding), greedy; ours runs them together.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mla_backend.config import GC_THRESHOLDS, EngineConfig
from mla_backend.engine import Engine, InvalidRequestError, warmup_lengths
from mla_backend.request import FinishReason, GenerateRequest, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
]
NEW_TOKENS = 32
# min_new_tokens masks EOS exactly as HF's `min_new_tokens` does, so both run the full length.
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=0.0)


def hf_greedy(model_dir: str, prompts: list[str], n: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            g = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=tok.eos_token_id)
        outs.append(g[0, ids.shape[1]:].tolist())
    return outs


def make_engine(path: str, **kw) -> Engine:
    return Engine(EngineConfig.create(model_path=path, dtype="float32", device="cpu", **kw))


@pytest.fixture(scope="module")
def deepseek_dir(tiny_deepseek_factory):
    return tiny_deepseek_factory(seed=1, hidden_size=128, num_hidden_layers=3)


@pytest.fixture(scope="module")
def deepseek_hf(deepseek_dir):
    return hf_greedy(deepseek_dir, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def llama_dir(tiny_llama_factory):
    return tiny_llama_factory(seed=2)


@pytest.fixture(scope="module")
def llama_hf(llama_dir):
    return hf_greedy(llama_dir, PROMPTS, NEW_TOKENS)


def test_warmup_lengths():
    assert warmup_lengths(256) == [1, 16, 17, 32, 33, 64, 65, 128, 129, 256]
    assert warmup_lengths(20) == [1, 16, 17, 20]
    assert warmup_lengths(3) == [1, 3]


def test_warm_up_leaves_the_engine_as_it_was(deepseek_dir, deepseek_hf, caplog):
    """`warmup` "true" on the CPU runs the prefill warm-up at load (it is on by default on CUDA
    only): one prefill per length up to a chunk, a batch of three and an extend over a cached
    prefix. Afterwards every KV slot is free, the prefix cache is empty (a first request hits
    nothing) and greedy outputs still equal Hugging Face's."""
    with caplog.at_level("INFO", logger="mla_backend.engine"):
        eng = make_engine(deepseek_dir, warmup="true", chunked_prefill_size=256,
                          max_total_tokens=4096)
    assert [r.getMessage().split(" in ")[0] for r in caplog.records
            if r.getMessage().startswith("warm-up:")] == ["warm-up: 12 runs"]
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] == 4096
    assert (st["evictable_slots"], st["protected_slots"], st["live"]) == (0, 0, 0)
    res = eng.generate(PROMPTS, GREEDY)
    assert [r.token_ids for r in res] == deepseek_hf
    assert [r.cached_tokens for r in res] == [0] * len(PROMPTS)
    eng.check_invariant()
    # again by hand: the cache now holds the prompts above, which it evicts with its own
    assert eng.warm_up()[0] == 12
    assert eng.stats()["free_slots"] == 4096
    caplog.clear()
    with caplog.at_level("INFO", logger="mla_backend.engine"):
        make_engine(deepseek_dir, max_total_tokens=4096)  # "auto" on the CPU: none
    assert not [r for r in caplog.records if r.getMessage().startswith("warm-up:")]


def test_warm_up_without_the_radix_cache_extends_over_a_second_chunk(deepseek_dir):
    """Radix cache off: instead of a prompt over a cached one, a prompt one chunk and 33 tokens
    long (its second chunk extends over the first); every slot is free after."""
    eng = make_engine(deepseek_dir, enable_radix_cache=False, chunked_prefill_size=64,
                      max_total_tokens=1024)
    assert eng.warm_up()[0] == len(warmup_lengths(64)) + 2  # + the batch + the two chunks
    assert eng.stats()["free_slots"] == 1024
    eng.check_invariant()


def test_warm_up_prefills_eagerly_whatever_extend_as_decode(deepseek_dir, monkeypatch):
    """The warm-up is for the eager prefill kernels: its prefills go to the model as EXTEND
    batches even with `extend_as_decode` "true", which holds again after it (and after a
    failed run)."""
    from mla_backend.forward_batch import ForwardMode

    eng = make_engine(deepseek_dir, chunked_prefill_size=64, extend_as_decode="true")
    modes = []
    real = eng.runner.make_forward_batch

    def make(m, ids, *rest):
        modes.append((m, len(ids)))
        return real(m, ids, *rest)

    monkeypatch.setattr(eng.runner, "make_forward_batch", make)
    runs, _ = eng.warm_up()
    extends = [n for m, n in modes if m == ForwardMode.EXTEND]
    assert len(extends) >= runs and max(extends) == 64
    assert eng.extend_as_decode == "true"
    modes.clear()
    eng.generate(["The capital of France is"], SamplingParams(max_new_tokens=2))
    assert modes[0][0] == ForwardMode.DECODE and modes[0][1] > 1  # its prefill, as rows
    monkeypatch.setattr(eng, "generate", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        eng.warm_up()
    assert eng.extend_as_decode == "true"
    eng.close()


def test_warm_up_failure_names_the_prefill_and_what_to_lower(deepseek_dir, monkeypatch):
    """A warm-up prefill whose forward fails (here: out of memory from 100 tokens on) fails the
    load with the size of that prefill and the settings to lower, and leaves no slot taken."""
    eng = make_engine(deepseek_dir, chunked_prefill_size=256, max_total_tokens=1024)
    forward = eng.runner.forward

    def oom_from_100(fb):
        if fb.input_ids.numel() >= 100:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return forward(fb)

    monkeypatch.setattr(eng.runner, "forward", oom_from_100)
    with pytest.raises(RuntimeError, match=r"the warm-up's prefill of 128 tokens failed \(out "
                       r"of GPU memory.*lower mem_fraction_static, chunked_prefill_size or "
                       r"max_total_tokens\): Error generating stream: .*Tried to allocate"):
        eng.warm_up()
    eng.tree_cache.evict(eng.tree_cache.evictable_size())
    assert eng.stats()["free_slots"] == 1024 and eng.stats()["live"] == 0
    eng.check_invariant()


def test_smollm2_paris(smollm2_dir):
    eng = make_engine(smollm2_dir)
    res = eng.generate(["The capital of France is"],
                       SamplingParams(max_new_tokens=2, temperature=0.0))
    assert res[0].text == " Paris."
    eng.check_invariant()


def test_smollm2_batch_equals_hf(smollm2_dir):
    expected = hf_greedy(smollm2_dir, PROMPTS, NEW_TOKENS)
    eng = make_engine(smollm2_dir)
    got = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
    assert got == expected


@pytest.mark.parametrize("settings", [
    {},
    {"disable_mla": True},
    {"mla_decompress_min_tokens": 0},
    {"mla_decompress_min_tokens": 10_000},
    {"enable_radix_cache": False},
    {"chunked_prefill_size": 8},
    {"extend_as_decode": "true"},
    {"extend_as_decode": "true", "chunked_prefill_size": 8},
])
def test_deepseek_batch_equals_hf(deepseek_dir, deepseek_hf, settings):
    eng = make_engine(deepseek_dir, **settings)
    got = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
    assert got == deepseek_hf
    eng.check_invariant()


@pytest.mark.parametrize("as_decode", ["false", "true"])
def test_llama_batch_equals_hf(llama_dir, llama_hf, as_decode):
    eng = make_engine(llama_dir, chunked_prefill_size=16, extend_as_decode=as_decode)
    got = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
    assert got == llama_hf


@pytest.mark.parametrize("as_decode", ["false", "true"])
@pytest.mark.parametrize("model", ["deepseek", "llama"])
def test_radix_hit_equals_cold(model, as_decode, deepseek_dir, deepseek_hf, llama_dir, llama_hf):
    path, expected = (deepseek_dir, deepseek_hf) if model == "deepseek" else (llama_dir, llama_hf)
    eng = make_engine(path, extend_as_decode=as_decode)
    first = eng.generate(PROMPTS[:1], GREEDY)[0]
    assert first.cached_tokens == 0
    # Same prompt again: all but the last prompt token come from the cache.
    again = eng.generate(PROMPTS[:1], GREEDY)[0]
    n_prompt = again.num_input_tokens
    assert again.cached_tokens == n_prompt - 1
    assert again.token_ids == first.token_ids == expected[0]
    # Prompt extended by its own continuation: prefix hit covers prompt + generated tokens.
    tok = eng.tokenizer
    longer = tok(PROMPTS[0]).input_ids + first.token_ids[:10]
    ext = eng.generate([longer], SamplingParams(max_new_tokens=8, temperature=0.0,
                                                ignore_eos=True))[0]
    assert ext.cached_tokens >= n_prompt
    assert ext.token_ids == first.token_ids[10:18]
    eng.check_invariant()


def test_extends_run_as_decode_rows(deepseek_dir, monkeypatch):
    """`extend_as_decode`: "true" sends every prefill to the model as DECODE rows, a row per
    new token, each with its own request's row and seq_len position + 1, and samples each
    request from its last token's row; "false" (the default) and "auto" (CPU: no graphs) send
    EXTEND batches. The rule of "auto" with graphs of up to 16 rows: at most 16 new tokens and
    at most `EXTEND_AS_DECODE_MAX_READ_BYTES` of KV read."""
    from types import SimpleNamespace

    from mla_backend.engine import EXTEND_AS_DECODE_MAX_READ_BYTES
    from mla_backend.forward_batch import ForwardMode
    from mla_backend.scheduler.schedule_batch import ScheduleBatch

    short = SamplingParams(max_new_tokens=2, temperature=0.0)
    for mode in ("true", "false", "auto"):
        eng = make_engine(deepseek_dir, extend_as_decode=mode)
        n0, n1 = (len(eng.tokenizer(p).input_ids) for p in PROMPTS[:2])
        calls, batches, forwards, sampled = [], [], [], []
        real_make, real_launch = eng.runner.make_forward_batch, eng._launch_batch
        real_forward, real_sample = eng.runner.forward, eng.sampler.launch

        def make(m, ids, pos, rows, seqs, *rest):
            calls.append((m, list(ids), list(pos), list(rows), list(seqs)))
            return real_make(m, ids, pos, rows, seqs, *rest)

        def launch(batch, prev):
            batches.append(list(batch.req_pool_indices))
            return real_launch(batch, prev)

        def forward(fb):
            out = real_forward(fb)
            forwards.append(out.clone())
            return out

        def sample(logits, *rest):
            sampled.append(logits.clone())
            return real_sample(logits, *rest)

        monkeypatch.setattr(eng.runner, "make_forward_batch", make)
        monkeypatch.setattr(eng, "_launch_batch", launch)
        monkeypatch.setattr(eng.runner, "forward", forward)
        monkeypatch.setattr(eng.sampler, "launch", sample)
        eng.generate(PROMPTS[:2], short)
        first = calls[0]  # the prefill of both prompts
        r0, r1 = batches[0]
        assert r0 != r1
        if mode == "true":
            assert first[0] == ForwardMode.DECODE and len(first[1]) == n0 + n1
            assert first[2] == list(range(n0)) + list(range(n1))
            assert first[3] == [r0] * n0 + [r1] * n1  # each token on its request's row
            assert first[4] == [p + 1 for p in first[2]]
            assert forwards[0].shape[0] == n0 + n1  # a logits row per token; sampled: the last
            assert torch.equal(sampled[0], forwards[0][[n0 - 1, n0 + n1 - 1]])
        else:
            assert first[0] == ForwardMode.EXTEND and first[3] == [r0, r1]
            assert first[4] == [n0, n1] and forwards[0].shape[0] == 2
        eng.check_invariant()
        eng.close()

    eng = make_engine(deepseek_dir, extend_as_decode="auto")  # with 16-row graphs: the rule
    eng.runner.cuda_graph_runner = SimpleNamespace(max_bs=16)
    limit = EXTEND_AS_DECODE_MAX_READ_BYTES // eng.runner.token_to_kv_pool.cell_bytes()

    def batch(prefix: int, new: int, mode=ForwardMode.EXTEND) -> ScheduleBatch:
        return ScheduleBatch(mode, [], list(range(new)), list(range(prefix, prefix + new)),
                             [1], [prefix + new], [prefix], [new])

    assert eng._extend_as_decode(batch(0, 16)) and eng._extend_as_decode(batch(100, 1))
    assert not eng._extend_as_decode(batch(0, 17))  # more rows than a graph has
    assert not eng._extend_as_decode(batch(0, 1, ForwardMode.DECODE))
    edge = (limit - 136) // 16  # the longest prefix whose 16 new tokens read <= limit tokens
    assert eng._extend_as_decode(batch(edge, 16))
    assert not eng._extend_as_decode(batch(edge + 1, 16))
    eng.runner.cuda_graph_runner = None
    assert not eng._extend_as_decode(batch(0, 16))
    eng.close()


def test_retraction_tiny_pool_same_outputs(deepseek_dir, deepseek_hf):
    # 4 prompts x (<= 20 + 32) tokens cannot all run at once in 110 slots: decode must retract.
    eng = make_engine(deepseek_dir, max_total_tokens=110)
    got = [r.token_ids for r in eng.generate(PROMPTS, GREEDY)]
    assert eng.scheduler.num_retractions > 0
    assert got == deepseek_hf
    eng.check_invariant()
    st = eng.stats()
    assert st["free_slots"] + st["evictable_slots"] == st["total_slots"]


def test_seeded_sampling_independent_of_batch_mates(llama_dir):
    sp = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234,
                        ignore_eos=True)
    eng = make_engine(llama_dir)
    alone = eng.generate([PROMPTS[2]], sp)[0].token_ids
    mates = [SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)] * 3
    together = eng.generate(PROMPTS[:2] + [PROMPTS[2]] + PROMPTS[3:], mates[:2] + [sp] + mates[2:])
    assert together[2].token_ids == alone
    other_seed = eng.generate([PROMPTS[2]], SamplingParams(
        max_new_tokens=16, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_stop_string_and_max_tokens(smollm2_dir):
    eng = make_engine(smollm2_dir)
    full = eng.generate(["The capital of France is"],
                        SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert full.finish_reason == FinishReason.LENGTH and len(full.token_ids) == 6
    assert full.text.startswith(" Paris.")
    cut = eng.generate(["The capital of France is"],
                       SamplingParams(max_new_tokens=6, temperature=0.0, stop=("ris",)))[0]
    assert cut.text == " Pa" and cut.finish_reason == FinishReason.STOP
    kept = eng.generate(["The capital of France is"],
                        SamplingParams(max_new_tokens=6, temperature=0.0, stop=("ris",),
                                       include_stop_str_in_output=True))[0]
    assert kept.text == " Paris"
    eng.check_invariant()


def test_streamed_text_equals_final(smollm2_dir):
    eng = make_engine(smollm2_dir)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    parts = [o.new_text for o in eng.stream("Write a haiku about the sea:", sp)]
    final = eng.generate(["Write a haiku about the sea:"], sp)[0].text
    assert "".join(parts) == final and len(parts) > 1


def test_bad_requests_rejected(smollm2_dir):
    eng = make_engine(smollm2_dir, context_length=64)
    with pytest.raises(InvalidRequestError, match="text_input"):
        eng.add_request(GenerateRequest(rid="a", text=""))
    with pytest.raises(InvalidRequestError, match="input_ids"):
        eng.add_request(GenerateRequest(rid="b", input_ids=[1, 10**7]))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        eng.add_request(GenerateRequest(rid="c", text="x", input_ids=[1]))
    with pytest.raises(InvalidRequestError, match="context"):
        eng.add_request(GenerateRequest(rid="d", text="hello " * 100))
    eng.generate(["hi"], SamplingParams(max_new_tokens=2, temperature=0.0))
    eng.check_invariant()


def check_abort_mid_decode(eng: Engine, text: str) -> None:
    """Stream request "x" for 4 steps, abort it: exactly one final output (ABORT), nothing
    after it, the pools balance and every slot is free again (radix cache off)."""
    total = eng.stats()["free_slots"]
    eng.add_request(GenerateRequest(rid="x", text=text,
                                    sampling_params=SamplingParams(max_new_tokens=50,
                                                                   ignore_eos=True),
                                    stream=True))
    outs = []
    for _ in range(4):
        outs += eng.step()
    eng.abort("x")
    outs += eng.step()
    finals = [o for o in outs if o.finished]
    assert len(finals) == 1 and finals[0].finish_reason == FinishReason.ABORT
    for _ in range(3):
        assert not [o for o in eng.step() if o.rid == "x"]
    eng.check_invariant()
    st = eng.stats()
    assert st["free_slots"] == total and st["live"] == 0 and st["running"] == 0


def test_abort_frees_slots(smollm2_dir):
    check_abort_mid_decode(make_engine(smollm2_dir, enable_radix_cache=False), "Tell me a story")


def test_engines_freeze_startup_objects_and_release_earlier_garbage(llama_dir):
    """`freeze_startup_objects`: everything alive after an engine's start-up is frozen (full
    collections skip it), and the next engine's start-up unfreezes first, so cyclic garbage
    that was frozen with the first engine is collected."""
    import gc
    import weakref

    class Node:  # a reference cycle: only the cycle collector frees it
        pass

    cyc = Node()
    cyc.self = cyc
    gone = weakref.ref(cyc)
    gc.set_threshold(700, 10, 10)  # Python's default
    eng_a = make_engine(llama_dir)
    assert gc.get_freeze_count() > 10_000  # imports, model, tokenizer
    assert gc.get_threshold() == GC_THRESHOLDS  # the serving thresholds
    del cyc
    gc.collect()
    assert gone() is not None  # frozen: a full collection no longer looks at it
    eng_b = make_engine(llama_dir)
    assert gone() is None  # eng_b's start-up unfroze and collected it
    assert gc.get_freeze_count() > 10_000
    del eng_a, eng_b


def test_step_outputs_take_their_text_from_the_output_processor(smollm2_dir):
    """`Engine.step` emits token ids only; one `OutputProcessor` over its outputs (as the front
    door runs it) gives each request the text of one decode of its ids: streaming and
    non-streaming requests, a stop token id (its text not emitted), a stop string (the request
    cut there and aborted in the engine), special tokens kept, hot seeded sampling (odd tokens,
    UTF-8 split over tokens), an abort after the first output, max_tokens."""
    from mla_backend.tokenizer.output_processor import OutputProcessor, engine_streams

    eng = make_engine(smollm2_dir, enable_radix_cache=False)
    tok = eng.tokenizer
    ids = [tok(p).input_ids for p in PROMPTS]
    probe = eng.generate([ids[0]], SamplingParams(max_new_tokens=8, temperature=0.0))[0]
    cases = [  # (prompt ids, sampling, stream)
        (ids[0], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True), True),
        (ids[0], SamplingParams(max_new_tokens=12, temperature=0.0,
                                stop_token_ids=(probe.token_ids[3],)), True),
        (ids[1], SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True,
                                stop=(" the",)), True),
        (ids[2], SamplingParams(max_new_tokens=24, temperature=1.6, seed=3, ignore_eos=True,
                                skip_special_tokens=False), True),
        (ids[3], SamplingParams(max_new_tokens=16, temperature=1.2, seed=4), False),
        (ids[2], SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True), True),
    ]
    processor = OutputProcessor(tok)
    for i, (p, sp, stream) in enumerate(cases):
        processor.add(f"r{i}", p, sp, stream)
        eng.add_request(GenerateRequest(rid=f"r{i}", input_ids=p, sampling_params=sp,
                                        stream=engine_streams(sp, stream)))
    outs, aborted, stopped = [], False, []
    while eng.has_work():
        step = eng.step()
        assert all(o.new_text == "" for o in step)  # the engine makes no text
        got, ended = processor.process(step)
        for rid in ended:
            eng.abort(rid)
        stopped += ended
        outs += got
        if not aborted and any(o.rid == "r5" for o in got):
            eng.abort("r5")
            aborted = True
    eng.check_invariant()
    assert len(processor) == 0 and stopped == ["r2"]
    by_rid: dict[str, list] = {}
    for o in outs:
        by_rid.setdefault(o.rid, []).append(o)
    for i, (p, sp, stream) in enumerate(cases):
        mine = by_rid[f"r{i}"]
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
        token_ids = [t for o in mine for t in o.new_token_ids]
        text = "".join(o.new_text for o in mine)
        assert mine[-1].num_output_tokens == len(token_ids)
        by_token = mine[-1].finish_reason == FinishReason.STOP and i != 2
        body = token_ids[:-1] if by_token else token_ids
        whole = tok.decode(p + body, skip_special_tokens=sp.skip_special_tokens,
                           clean_up_tokenization_spaces=False)
        head = tok.decode(p, skip_special_tokens=sp.skip_special_tokens,
                          clean_up_tokenization_spaces=False)
        if i == 2:  # cut after the token that completed " the"; the text stops before it
            assert mine[-1].finish_reason == FinishReason.STOP and len(token_ids) < 40
            assert " the" not in text and (whole[len(head):]).startswith(text + " the")
            assert " the" not in tok.decode(p + token_ids[:-1])[len(head):]
        else:
            assert text == whole[len(head):], i
    assert by_rid["r1"][-1].finish_reason == FinishReason.STOP
    assert by_rid["r1"][-1].new_token_ids[-1] == probe.token_ids[3]
    assert by_rid["r5"][-1].finish_reason == FinishReason.ABORT
    assert len(by_rid["r4"]) == 1 and by_rid["r4"][0].new_text  # non-streaming: one output


def test_text_that_tokenizes_past_the_vocabulary_is_refused(tiny_llama_factory, caplog):
    """A model whose tokenizer is larger than its embedding (1,024 rows here, SmolLM2's 49,152
    tokens): a text prompt with an id past it is refused in the caller (an id past the
    embedding fails the batch on a CPU and the engine process on CUDA), with a warning at load;
    a prompt within it runs."""
    path = tiny_llama_factory(vocab_size=1024)
    with caplog.at_level("WARNING", logger="mla_backend.engine"):
        eng = make_engine(path)
    assert "the tokenizer's ids reach 49151, the model's vocabulary 1024" in caplog.text
    top = max(eng.tokenizer("Fellow-Citizens of the Senate").input_ids)
    assert top >= 1024
    with pytest.raises(InvalidRequestError,
                       match=f"tokenizer gives token id {top}, outside the model's vocabulary "
                             r"\[0, 1024\)"):
        eng.add_request(GenerateRequest(rid="past", text="Fellow-Citizens of the Senate"))
    small = eng.tokenizer("a b c").input_ids
    assert max(small) < 1024
    out = eng.generate(["a b c"], SamplingParams(max_new_tokens=4, temperature=0.0,
                                                 ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and max(out.token_ids) < 1024
    eng.check_invariant()
    assert eng.stats()["live"] == 0
