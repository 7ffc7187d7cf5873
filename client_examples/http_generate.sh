#!/usr/bin/env bash
# Generate with curl over Triton's HTTP generate endpoints.
# Usage: client_examples/http_generate.sh [MODEL] [PROMPT] [MAX_TOKENS]   (HOST defaults to localhost:8000)
set -euo pipefail
MODEL=${1:-deepseek-v2-tiny}
PROMPT=${2:-Fellow-Citizens of the Senate and House of Representatives:}
MAX_TOKENS=${3:-32}
HOST=${HOST:-localhost:8000}
BODY=$(python3 -c 'import json,sys; print(json.dumps({"text_input": sys.argv[1], "max_tokens": int(sys.argv[2]), "temperature": 0, "return_finish_reason": True}))' "$PROMPT" "$MAX_TOKENS")

echo "== generate (one JSON answer; the prompt is echoed unless exclude_input_in_output is true)"
curl -sS -X POST "http://$HOST/v2/models/$MODEL/generate" -H 'Content-Type: application/json' -d "$BODY"
echo

echo "== generate_stream (server-sent events: one 'data: {...}' line per response, no [DONE])"
STREAM_BODY=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["stream"]=True; print(json.dumps(d))' "$BODY")
curl -sS -N -X POST "http://$HOST/v2/models/$MODEL/generate_stream" -H 'Content-Type: application/json' -d "$STREAM_BODY"
echo

echo "== list-valued sampling fields go in the sampling_parameters string"
curl -sS -X POST "http://$HOST/v2/models/$MODEL/generate" -H 'Content-Type: application/json' \
  -d "{\"text_input\": \"1, 2, 3,\", \"exclude_input_in_output\": true, \"sampling_parameters\": \"{\\\"max_tokens\\\": 16, \\\"temperature\\\": 0, \\\"stop\\\": [\\\"\\\\n\\\", \\\"10\\\"]}\"}"
echo
