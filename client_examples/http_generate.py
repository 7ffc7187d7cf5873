"""Generate over HTTP: `v2/models/<m>/generate` (one JSON answer) or `generate_stream` (SSE).

Usage:
    python client_examples/http_generate.py --prompt "Hello" --max-tokens 32            # one answer
    python client_examples/http_generate.py --prompt "Hello" --max-tokens 32 --stream   # SSE

JSON keys that name a model input become tensors (text_input, stream, exclude_input_in_output,
return_*); other scalar keys (max_tokens, temperature, ...) become request parameters, which the
model uses as sampling parameters when no `sampling_parameters` input is given.
Exit code 1 on an error.
"""

from __future__ import annotations

import argparse
import json
import sys

import requests


def generate(url: str, model: str, body: dict, timeout: float = 300.0) -> dict:
    """POST generate; returns the response JSON (raises RuntimeError with the server's error)."""
    r = requests.post(f"{url}/v2/models/{model}/generate", json=body, timeout=timeout)
    data = r.json()
    if r.status_code != 200 or "error" in data:
        raise RuntimeError(f"HTTP {r.status_code}: {data.get('error', data)}")
    return data


def generate_stream(url: str, model: str, body: dict, timeout: float = 300.0):
    """POST generate_stream; yields each SSE event's JSON (raises RuntimeError on an error event).

    Triton sends `data: {json}` lines and no `[DONE]` marker; an error after the first event
    arrives as `data: {"error": ...}` with HTTP 200.
    """
    with requests.post(f"{url}/v2/models/{model}/generate_stream", json=body, stream=True,
                       timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):])
            if "error" in event:
                raise RuntimeError(event["error"])
            yield event


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://localhost:8000")
    ap.add_argument("--model", default="deepseek-v2-tiny")
    ap.add_argument("--prompt",  # (the default model continues texts; it answers no questions)
                    default="Fellow-Citizens of the Senate and House of Representatives:")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--stream", action="store_true", help="use generate_stream (SSE)")
    args = ap.parse_args(argv)
    body = {"text_input": args.prompt, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "return_finish_reason": True,
            "return_num_output_tokens": True}
    try:
        if args.stream:
            body["stream"] = True
            for event in generate_stream(args.url, args.model, body):
                print(event["text_output"], end="", flush=True)
            print(f"\n[finish_reason: {event.get('finish_reason')}]")
        else:
            data = generate(args.url, args.model, body)
            print(data["text_output"])
            print(f"[finish_reason: {data.get('finish_reason')}, "
                  f"output tokens: {data.get('num_output_tokens')}]")
    except (RuntimeError, requests.RequestException) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
