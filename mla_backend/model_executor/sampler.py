"""Sampler: turns a batch's last-position logits into next tokens and their logprobs.

Input: logits [bs, V] (batch order; fp32, or 16-bit from a CUDA graph replay) and the batch's
`Req`s (reads `sampling_params`, `origin_input_ids`, `output_ids`, `num_inflight_tokens`; writes
only `req.generator`, created on first use when `sampling_params.seed` is set). Output:
`SampleOutput` host lists; `launch` queues the work and the host copies, `resolve` waits for them.

`process_logits`, each step only on rows that need it: 0. `logit_bias`, `allowed_token_ids`, the
caller's `restrict` (grammar masks); 1. repetition penalty, Hugging Face semantics (logit / p if
logit > 0 else logit * p, over prompt + output ids); 2. presence / frequency penalties, OpenAI
semantics over output tokens; 3. min_new_tokens: while output_ids plus in-flight tokens are fewer,
EOS and stop_token_ids get -inf (even with ignore_eos); 4. non-greedy rows: temperature, top_k,
top_p (over the top_k survivors), min_p (prob < min_p * max prob) set filtered tokens to -inf.
Greedy rows (temperature < 1e-5 or top_k == 1) take the argmax (ties → lowest id). Others use
Gumbel-max: argmax(logits - log(E)), E ~ Exp(1); a seeded row draws E from its own generator, so
its tokens do not depend on batch mates, position or size; unseeded rows share one generator.

Logprobs: fp32 log_softmax of the raw logits. On CUDA, a batch of greedy rows with no
processing but the min_new_tokens mask and the caller's `TokenMasks` (grammar bitmasks) uses
`mla_kernels.sampling.greedy_with_logprob` (same tokens; logprobs equal up to fp32 summation
order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mla_backend.host_tensors import neg_inf_like
from mla_backend.request import Req, SamplingParams

# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE_EPS = 1e-5
_TINY = torch.finfo(torch.float32).tiny


@dataclass
class SampleOutput:
    """Per request, in batch order: the chosen token, its logprob (raw logits) and, when
    `sampling_params.logprobs = k` is set, {token_id: logprob} of the top k plus the chosen token
    (None when not asked)."""

    next_token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]


@dataclass
class TokenMasks:
    """Allowed tokens of some sampling rows, as bitmasks (the engine's grammar masks):
    bitmask int32 [len(rows), ceil(vocab / 32)] on the CPU (pinned for a copy that does not
    wait) or the logits' device, bit j of word i set = token 32 i + j allowed; its row j
    belongs to sampling row rows[j]."""

    rows: list[int]
    bitmask: torch.Tensor

    def on(self, device: torch.device, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask, mask_rows [bs]: each row's bitmask row, -1 for none) on `device`, for
        `greedy_with_logprob`."""
        mask_rows = [-1] * bs
        for j, r in enumerate(self.rows):
            mask_rows[r] = j
        return (self.bitmask.to(device, non_blocking=True).contiguous(),
                _on(mask_rows, device, torch.int32))


# logits dtypes the one-pass greedy kernel reads as they are
_GREEDY_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

def is_greedy(params: SamplingParams) -> bool:
    """True when the request's next token is the argmax of its penalized logits."""
    return params.temperature < GREEDY_TEMPERATURE_EPS or params.top_k == 1


def _on(values: Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`, copied without waiting for queued device work (a
    pageable source is staged at once)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _padded_ids(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """int64 [n, max_len] of the sequences, right-padded with `pad` (max_len >= 1)."""
    width = max(1, max(len(s) for s in seqs))
    rows = [list(s) + [pad] * (width - len(s)) for s in seqs]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def token_counts(seqs: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """fp32 [n, vocab_size]: how often each token id occurs in each sequence."""
    idx = _padded_ids(seqs, vocab_size, device)
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, reqs: Sequence[Req]) -> None:
    """In place on logits [bs, V] fp32: repetition (HF, prompt + output tokens) and presence /
    frequency (OpenAI, output tokens) penalties, for the rows whose params ask for them."""
    bs, vocab = logits.shape
    dev = logits.device
    params = [r.sampling_params for r in reqs]
    rep_rows = [i for i in range(bs) if params[i].repetition_penalty != 1.0]
    if rep_rows:
        seen = token_counts(
            [reqs[i].origin_input_ids + reqs[i].output_ids for i in rep_rows], vocab, dev
        ) > 0
        pen = torch.tensor([params[i].repetition_penalty for i in rep_rows],
                           dtype=torch.float32, device=dev).unsqueeze(1)
        rows = logits[rep_rows]
        penalized = torch.where(rows > 0, rows / pen, rows * pen)
        logits[rep_rows] = torch.where(seen, penalized, rows)
    pf_rows = [i for i in range(bs)
               if params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0]
    if pf_rows:
        counts = token_counts([reqs[i].output_ids for i in pf_rows], vocab, dev)
        freq = torch.tensor([params[i].frequency_penalty for i in pf_rows],
                            dtype=torch.float32, device=dev).unsqueeze(1)
        pres = torch.tensor([params[i].presence_penalty for i in pf_rows],
                            dtype=torch.float32, device=dev).unsqueeze(1)
        logits[pf_rows] -= freq * counts + pres * (counts > 0).float()


def apply_token_restrictions(logits: torch.Tensor, reqs: Sequence[Req]) -> None:
    """In place on logits [bs, V] fp32: each request's `logit_bias` added, and with
    `allowed_token_ids` every other token set to -inf."""
    vocab = logits.shape[1]
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        if sp.logit_bias:
            ids = [t for t, _ in sp.logit_bias if t < vocab]
            bias = [b for t, b in sp.logit_bias if t < vocab]
            logits[i, _on(ids, logits.device)] += _on(bias, logits.device, torch.float32)
        if sp.allowed_token_ids is not None:
            keep = _on([t for t in sp.allowed_token_ids if t < vocab], logits.device)
            row = torch.full((vocab,), float("-inf"), device=logits.device)
            row[keep] = logits[i, keep]
            logits[i] = row


def min_tokens_bans(reqs: Sequence[Req], eos_token_ids: set[int], vocab: int
                    ) -> list[tuple[list[int], list[int]]]:
    """(rows, banned ids) of the requests that have produced fewer than `min_new_tokens` tokens
    (output_ids plus one in flight): their EOS and stop_token_ids, grouped by stop_token_ids
    (usually one group), ids in [0, vocab) only; [] when no row is banned anything."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(reqs):
        sp = r.sampling_params
        if sp.min_new_tokens and len(r.output_ids) + r.num_inflight_tokens < sp.min_new_tokens:
            groups.setdefault(tuple(sp.stop_token_ids), []).append(i)
    bans = []
    for stops, rows in groups.items():
        banned = sorted(t for t in set(stops) | eos_token_ids if 0 <= t < vocab)
        if banned:
            bans.append((rows, banned))
    return bans


def _ban(logits: torch.Tensor, bans: list[tuple[list[int], list[int]]]) -> None:
    """In place on logits [bs, V]: -inf at each group's (rows, banned ids) of
    `min_tokens_bans`. One indexed write per group, its indices uploaded without waiting (a
    write indexed by a host list, one per row, would upload its index and wait each time)."""
    for rows, banned in bans:
        logits[_on(rows, logits.device).unsqueeze(1), _on(banned, logits.device)] = \
            neg_inf_like(logits)


def _greedy_with_bans(view: torch.Tensor, bans: list[tuple[list[int], list[int]]],
                      greedy: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`greedy(view)` (the one-pass kernel: ids, chosen logprob, logsumexp) with the banned
    ids of each group's rows excluded from the argmax, and the logprobs still those of the raw
    logits: the banned logits are set to -inf in `view` for the kernel and written back after
    it; each banned row's logsumexp is the kernel's combined with theirs (logaddexp)."""
    dev = view.device
    idx = [(_on(rows, dev), _on(banned, dev)) for rows, banned in bans]
    # an eager forward's logits are inference tensors (ModelRunner forwards under
    # inference_mode), which take in-place writes only inside it
    with torch.inference_mode():
        saved = [view[r.unsqueeze(1), c] for r, c in idx]  # copies [rows, banned]
        for r, c in idx:
            view[r.unsqueeze(1), c] = neg_inf_like(view)
        next_ids, chosen_lp, lse_kept = greedy(view)
        lse = lse_kept.clone()
        for (r, c), old in zip(idx, saved):
            view[r.unsqueeze(1), c] = old
            lse[r] = torch.logaddexp(lse_kept[r], old.float().logsumexp(dim=1))
        return next_ids, chosen_lp + (lse_kept - lse), lse


def apply_temperature_and_filters(logits: torch.Tensor,
                                  params: Sequence[SamplingParams]) -> torch.Tensor:
    """New tensor from logits [n, V] fp32 of non-greedy rows: divided by temperature, then
    top_k, top_p and min_p filtered (removed tokens → -inf). At least one token always stays."""
    n, vocab = logits.shape
    dev = logits.device
    temps = _on([p.temperature for p in params], dev, torch.float32)
    out = logits / temps.unsqueeze(1)
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    need_k = any(k < vocab for k in ks)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_k or need_p:
        vals, idx = out.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev).unsqueeze(0)
        remove = rank >= _on(ks, dev).unsqueeze(1)
        if need_p:
            top_p = _on([p.top_p if p.top_p < 1.0 else float("inf") for p in params], dev,
                        torch.float32).unsqueeze(1)
            probs = vals.masked_fill(remove, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            remove |= mass_before >= top_p  # the top token has mass_before 0 < top_p: kept
        out = torch.empty_like(out).scatter_(1, idx, vals.masked_fill(remove, float("-inf")))
    if any(p.min_p > 0.0 for p in params):
        min_p = _on([p.min_p for p in params], dev, torch.float32)
        probs = out.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        out = out.masked_fill(probs < threshold, float("-inf"))
    return out


# The scans below run over the batch when its logits are processed (`process_logits`); plain
# loops, without a generator per scan.
def _penalize(params: Sequence[SamplingParams]) -> bool:
    for p in params:
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            return True
    return False


def _restrict(params: Sequence[SamplingParams]) -> bool:
    for p in params:
        if p.logit_bias or p.allowed_token_ids is not None:
            return True
    return False


def _greedy_unprocessed_but_min(reqs: Sequence[Req]) -> bool:
    """Every row greedy, without restrictions or penalties: at most the min_new_tokens mask
    applies."""
    for r in reqs:  # one scan: this runs every decode step
        p = r.sampling_params
        if (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0 or p.logit_bias or p.allowed_token_ids is not None
                or not is_greedy(p)):
            return False
    return True


def process_logits(logits: torch.Tensor, reqs: Sequence[Req], eos_token_ids: set[int],
                   restrict: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Steps 0-4 of the module docstring on logits [bs, V] fp32; returns a new tensor, or
    `logits` itself when nothing applies (all greedy, no restrictions or penalties,
    min_new_tokens reached). `restrict(logits)`: more masking, in place, after step 0's.

    Greedy rows carry restrictions, penalties and the min_new_tokens mask only; their token is
    the argmax. Non-greedy rows are also tempered and filtered; their token is a draw from
    softmax(row).
    """
    params = [r.sampling_params for r in reqs]
    restricted = _restrict(params)
    penalize = _penalize(params)
    bans = min_tokens_bans(reqs, eos_token_ids, logits.shape[1])
    sampled = [i for i, p in enumerate(params) if not is_greedy(p)]
    if not (restricted or restrict is not None or penalize or bans or sampled):
        return logits
    out = logits.clone()
    if restricted:
        apply_token_restrictions(out, reqs)
    if restrict is not None:
        restrict(out)
    if penalize:
        apply_penalties(out, reqs)
    _ban(out, bans)
    if sampled:
        if len(sampled) == len(reqs):
            out = apply_temperature_and_filters(out, params)
        else:
            idx = _on(sampled, out.device)
            out[idx] = apply_temperature_and_filters(out[idx], [params[i] for i in sampled])
    return out




class Sampler:
    """Samples one token per request from logits [bs, V] (fp32 or 16-bit; see the module
    docstring).

    eos_token_ids: ids masked by min_new_tokens (stopping on them is the engine's job);
    vocab_size: V (logits with more columns, e.g. padded, are cut to V; fewer raise ValueError);
    device: where logits live and generators are made; seed: seed of the generator shared by
    unseeded requests.
    """

    def __init__(self, eos_token_ids: set[int], vocab_size: int,
                 device: torch.device | str, seed: int = 0) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        # greedy batches through the one-pass kernel (tests also run it on the CPU, under
        # triton's interpreter)
        self.fused_greedy = self.device.type == "cuda"
        # `_ban_masks`: a bitmask row per banned id set, on `device` (the 64 last used)
        self._ban_rows: dict[tuple[int, ...], torch.Tensor] = {}

    def _ban_masks(self, bans: list[tuple[list[int], list[int]]], bs: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(bitmask int32 [groups, ceil(V / 32)], mask_rows int32 [bs]) of `min_tokens_bans`
        for `greedy_with_logprob`: every token allowed but each group's banned ids, rows
        outside every group -1. One upload per call (mask_rows)."""
        rows = []
        for _, banned in bans:
            key = tuple(banned)
            row = self._ban_rows.pop(key, None)  # (put back last: least recently used first)
            if row is None:
                words = [-1] * ((self.vocab_size + 31) // 32)
                for t in banned:
                    w = (words[t // 32] & 0xFFFFFFFF) & ~(1 << (t % 32))
                    words[t // 32] = w - (1 << 32) if w >= 1 << 31 else w
                row = _on(words, self.device, torch.int32).unsqueeze(0)  # (no wait)
                if len(self._ban_rows) >= 64:
                    del self._ban_rows[next(iter(self._ban_rows))]
            self._ban_rows[key] = row
            rows.append(row)
        mask_rows = [-1] * bs
        for g, (members, _) in enumerate(bans):
            for i in members:
                mask_rows[i] = g
        bitmask = rows[0] if len(rows) == 1 else torch.cat(rows)
        return bitmask, _on(mask_rows, self.device, torch.int32)

    @torch.no_grad()
    def warm_up(self, max_rows: int,
                dtypes: Sequence[torch.dtype] = (torch.float32,)) -> int:
        """On CUDA, run the one-pass greedy kernel once per launch plan a batch of up to
        `max_rows` rows can take (`mla_kernels.sampling.plan_batch_sizes`), per logits dtype in
        `dtypes` (fp32 from eager forwards, the model dtype from CUDA graph replays), without
        and with token bitmasks (structured outputs' `TokenMasks`): each is a triton variant,
        compiled now rather than inside the first requests' steps (a JIT compile of a fraction
        of a second on a machine without triton's disk cache). Returns the number of variants
        run (0 off CUDA)."""
        if self.device.type != "cuda" or max_rows < 1:
            return 0
        from mla_kernels.sampling import greedy_with_logprob, plan_batch_sizes

        sizes = plan_batch_sizes(max_rows, self.vocab_size)
        words = -(-self.vocab_size // 32)
        for dtype in dict.fromkeys(dtypes):
            for bs in sizes:
                logits = torch.zeros(bs, self.vocab_size, device=self.device, dtype=dtype)
                greedy_with_logprob(logits)
                greedy_with_logprob(
                    logits, bitmask=torch.full((bs, words), -1, dtype=torch.int32,
                                               device=self.device),
                    mask_rows=torch.arange(bs, dtype=torch.int32, device=self.device))
        return 2 * len(sizes) * len(dict.fromkeys(dtypes))

    def _row_generator(self, req: Req) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        if req.generator is None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(seed)
        return req.generator

    def _draw(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """int64 [n]: one Gumbel-max draw per row of processed logits [n, V]."""
        gens = [self._row_generator(r) for r in reqs]
        noise = torch.empty_like(logits)
        unseeded = [i for i, g in enumerate(gens) if g is None]
        if len(unseeded) == len(gens):
            noise.exponential_(generator=self.generator)
        else:
            if unseeded:
                shared = torch.empty(len(unseeded), logits.shape[1], device=logits.device)
                noise[_on(unseeded, logits.device)] = shared.exponential_(
                    generator=self.generator)
            for i, g in enumerate(gens):
                if g is not None:
                    noise[i].exponential_(generator=g)
        return (logits - noise.clamp_min_(_TINY).log_()).argmax(dim=-1)

    @torch.no_grad()
    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> SampleOutput:
        """Next token per request. logits: [bs, V'] float (V' >= vocab_size) on `device`;
        reqs: the bs requests in row order. Raises ValueError on a shape mismatch.
        Same as `resolve(launch(logits, reqs))`."""
        return self.resolve(self.launch(logits, reqs))

    @torch.no_grad()
    def launch(self, logits: torch.Tensor, reqs: Sequence[Req],
               restrict: Callable[[torch.Tensor], None] | None = None,
               token_masks: TokenMasks | None = None) -> "LaunchedSample":
        """Queue the sampling of one token per request on the logits' device without waiting
        for it (no host synchronisation on CUDA); `resolve` returns the tokens. The work is
        queued on the current stream, so more device work (the next forward, which may read
        `next_ids`) can be queued before `resolve`. logits: [bs, V'] float, V' >= vocab_size.
        Every read of the logits is queued (on the current stream) before this returns, and
        no reference to them is kept: a CUDA graph replay's logits (a view of its static
        buffer, `CudaGraphRunner.replay`) may be overwritten by the next replay right after.
        restrict: masks the caller applies in place to the fp32 logits [bs, vocab_size] after
        the token restrictions (the engine's grammar bitmasks); logprobs stay those of the raw
        logits. token_masks: the same masks as bitmasks, for the one-pass greedy kernel, which
        then serves instead of `restrict` (a batch of greedy rows without other processing
        but min_new_tokens).

        Raises:
            ValueError: logits not [len(reqs), V'] or V' < vocab_size.
        """
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits must be [{len(reqs)}, V], got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        view = logits[:, : self.vocab_size]
        params = [r.sampling_params for r in reqs]
        if (self.fused_greedy and view.stride(1) == 1 and view.dtype in _GREEDY_KERNEL_DTYPES
                and not torch.compiler.is_compiling()
                and (restrict is None or token_masks is not None)
                and _greedy_unprocessed_but_min(reqs)):
            # all greedy on unprocessed logits: argmax, logsumexp and the chosen logprob in
            # one read of the logits (`mla_kernels.sampling`), the same values as below (16-bit
            # logits, as a CUDA graph replay gives them, are read as they are: their fp32 form
            # is the same values); faster than torch's passes at every batch size measured
            # (`benchmarks/bench_sampling.py`). Rows under min_new_tokens: their banned ids
            # as bitmask rows (`_ban_masks`), or with grammar masks too `_greedy_with_bans`
            # (no float32 copy of the batch's logits).
            from mla_kernels.sampling import greedy_with_logprob

            greedy = greedy_with_logprob
            if token_masks is not None:  # the argmax over each row's allowed tokens
                bitmask, mask_rows = token_masks.on(view.device, len(reqs))

                def greedy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                    return greedy_with_logprob(x, bitmask=bitmask, mask_rows=mask_rows)
            bans = min_tokens_bans(reqs, self.eos_token_ids, self.vocab_size)
            if bans and token_masks is None:  # the bans as the kernel's masks: one launch
                bitmask, mask_rows = self._ban_masks(bans, len(reqs))
                next_ids, chosen_lp, lse = greedy_with_logprob(view, bitmask=bitmask,
                                                               mask_rows=mask_rows)
            elif bans:
                next_ids, chosen_lp, lse = _greedy_with_bans(view, bans, greedy)
            else:
                next_ids, chosen_lp, lse = greedy(view)
            raw = view
        else:
            raw = view.float()
            processed = process_logits(raw, reqs, self.eos_token_ids, restrict)
            sampled = [i for i, p in enumerate(params) if not is_greedy(p)]
            next_ids = self._next_ids(processed, reqs, sampled)
            lse = torch.logsumexp(raw, dim=-1)
            chosen_lp = raw.gather(1, next_ids.unsqueeze(1)).squeeze(1) - lse
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        top_vals = top_ids = None
        if want:
            kmax = min(max(params[i].logprobs or 0 for i in want), self.vocab_size)
            if kmax > 0:
                idx = _on(want, raw.device)
                vals, top_ids = raw[idx].float().topk(kmax, dim=-1)
                top_vals = vals - lse[idx].unsqueeze(1)
        host = [next_ids, chosen_lp] + ([top_vals, top_ids] if top_vals is not None else [])
        event = None
        if next_ids.is_cuda:  # into pinned memory: copies that do not block the host
            pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in host]
            for dst, src in zip(pinned, host):
                dst.copy_(src, non_blocking=True)
            host = pinned
            event = torch.cuda.Event()
            event.record()
        return LaunchedSample(next_ids, host, event, [params[i].logprobs or 0 for i in want],
                              want)

    def _next_ids(self, processed: torch.Tensor, reqs: Sequence[Req],
                  sampled: list[int]) -> torch.Tensor:
        """int64 [bs]: the argmax of `processed` for greedy rows, a draw (`_draw`) for the rows
        listed in `sampled`."""
        if len(sampled) == len(reqs):
            return self._draw(processed, reqs)
        next_ids = processed.argmax(dim=-1)
        if sampled:
            idx = _on(sampled, processed.device)
            next_ids[idx] = self._draw(processed[idx], [reqs[i] for i in sampled])
        return next_ids

    @staticmethod
    def resolve(launched: "LaunchedSample") -> SampleOutput:
        """Wait for a launched sampling (only for its own work, not for what the device queued
        after it) and return its tokens and logprobs as host lists."""
        if launched.event is not None:
            launched.event.synchronize()
        ids_list: list[int] = launched.host[0].tolist()
        lp_list: list[float] = launched.host[1].tolist()
        top: list[dict[int, float] | None] = [None] * len(ids_list)
        if launched.want:
            n = len(launched.want)
            has_top = len(launched.host) > 2
            vals = launched.host[2].tolist() if has_top else [[]] * n
            ids = launched.host[3].tolist() if has_top else [[]] * n
            for j, (i, k) in enumerate(zip(launched.want, launched.want_k)):
                d = dict(zip(ids[j][:k], vals[j][:k]))
                d.setdefault(ids_list[i], lp_list[i])
                top[i] = d
        return SampleOutput(next_token_ids=ids_list, token_logprobs=lp_list, top_logprobs=top)


@dataclass
class LaunchedSample:
    """A sampling queued by `Sampler.launch` (rows in batch order): `next_ids` int64 [bs] on
    the device (the next batch's input tokens may be read from it there); `host`: CPU copies
    of next_ids, the chosen tokens' logprobs fp32 [bs] and, when a row asked for k > 0 top
    logprobs, their values fp32 and ids int64 [len(want), max k] — on CUDA filled
    asynchronously, complete once `event` has completed. `want`: the rows that asked for
    logprobs, `want_k` their k."""

    next_ids: torch.Tensor
    host: list[torch.Tensor]
    event: "torch.cuda.Event | None"
    want_k: list[int]
    want: list[int]
