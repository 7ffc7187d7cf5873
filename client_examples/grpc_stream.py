"""Stream one generation over gRPC (tritonclient.grpc) and print the text as it arrives.

Usage:
    python client_examples/grpc_stream.py --prompt "What is MLA?" --max-tokens 64 \
        --model deepseek-v2-tiny --url localhost:8001

Sends the vLLM-backend inputs (text_input, stream=true, sampling_parameters JSON) and prints each
`text_output` delta; with --stats also the finish reason, prompt / cached tokens and the total
of the per-response `num_output_tokens`. --sampling adds sampling parameters, e.g. a constraint:
    --sampling '{"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}'
Exit code 1 on an error response, 2 when --chat names a tokenizer without a chat template or
--sampling is not a JSON object.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def build_inputs(prompt: str, sampling: dict, stats: bool) -> list[grpcclient.InferInput]:
    """The request tensors: text_input, stream, sampling_parameters, return_* switches."""

    def tensor(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    inputs = [
        # the prompt's bytes as given (a command line's undecodable bytes included: the server
        # answers those with "text_input: not valid UTF-8")
        tensor("text_input", np.array([prompt.encode("utf-8", "surrogateescape")],
                                      dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_),
               "BYTES"),
    ]
    if stats:
        for name in ("return_finish_reason", "return_num_input_tokens",
                     "return_num_output_tokens", "return_cached_tokens"):
            inputs.append(tensor(name, np.array([True]), "BOOL"))
    return inputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument("--model", default="deepseek-v2-tiny")
    ap.add_argument("--prompt",  # (the default model continues texts; it answers no questions)
                    default="Fellow-Citizens of the Senate and House of Representatives:")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--stats", action="store_true", help="print finish reason and token counts")
    ap.add_argument("--sampling", metavar="JSON", default="{}",
                    help="more sampling parameters (a JSON object), over --max-tokens and "
                         "--temperature: structured_outputs, seed, stop, logit_bias, ...")
    ap.add_argument("--chat", metavar="MODEL_DIR",
                    help="wrap the prompt in the chat template of the tokenizer in MODEL_DIR (e.g. "
                         "model_repository/smollm2-135m-instruct/weights); otherwise text_input "
                         "is sent as is, as with Triton's vLLM backend")
    args = ap.parse_args(argv)
    try:
        extra = json.loads(args.sampling)
    except json.JSONDecodeError:
        extra = None
    if not isinstance(extra, dict):
        print(f"error: --sampling must be a JSON object, got {args.sampling!r}", file=sys.stderr)
        return 2
    prompt = args.prompt
    if args.chat:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.chat)
        if not tokenizer.chat_template:
            print(f"error: the tokenizer in {args.chat} has no chat template; leave out --chat "
                  "to send the prompt as text", file=sys.stderr)
            return 2
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, **extra}
    first = None
    last = None
    total_out = 0
    rc = 0
    done = False
    try:
        t0 = time.perf_counter()
        client.async_stream_infer(
            args.model, build_inputs(prompt, sampling, args.stats), request_id="1",
            enable_empty_final_response=True,
        )
        while True:
            result, error = responses.get()
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                rc = 1
                break
            response = result.get_response()
            text = result.as_numpy("text_output")
            if text is not None and len(text):
                first = first or time.perf_counter()
                print(text[0].decode(), end="", flush=True)
            last = result
            n_out = result.as_numpy("num_output_tokens")
            total_out += int(n_out[0]) if n_out is not None else 0
            if response.parameters["triton_final_response"].bool_param:
                break
        done = True
    finally:
        # the stream's thread keeps the process alive until the stream stops; on Ctrl-C or an
        # error here the server cancels the request
        client.stop_stream(cancel_requests=not done)
    print(flush=True)  # before the timings on stderr
    if args.stats and last is not None:
        fields = {n: last.as_numpy(n) for n in ("finish_reason", "num_input_tokens",
                                                "cached_tokens")}
        stats = {k: (v[0].decode() if v is not None and v.dtype == np.object_ else
                     (int(v[0]) if v is not None else None)) for k, v in fields.items()}
        print({**stats, "num_output_tokens": total_out})
    if first is not None:
        print(f"[time to first token {1000 * (first - t0):.0f} ms, "
              f"total {1000 * (time.perf_counter() - t0):.0f} ms]", file=sys.stderr)
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except InferenceServerException as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted (a request in flight was cancelled)", file=sys.stderr)
        sys.exit(130)
