#!/usr/bin/env bash
# flowyard's main demo, from a fresh checkout: install, serve the embedded SmolLM2-135M-Instruct
# on the real engine, ask it one chat question, load-test it with a slice of the Azure LLM
# conversation trace through `flowyard bench`, print the results table, and stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/install.sh --runtime | tail -n 1)  # the checkout's .venv (scripts/install.sh)
BIN=$(dirname "$PY")
PORT=${PORT:-$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
LOG=$(mktemp -t flowyard-serve.XXXX.log)
"$BIN/flowyard" serve --port "$PORT" ${SERVE_ARGS:-} >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do
  "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
    "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $SERVER 2>/dev/null || { cat "$LOG"; echo "demo: the server exited" >&2; exit 1; }
  sleep 1
done
echo "== chat =="
$PY - "$PORT" <<'PYEOF'
import sys, httpx
r = httpx.post(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", timeout=120, json={
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "max_tokens": 48, "temperature": 0})
r.raise_for_status()
body = r.json()
print("user:      What is the capital of France? Answer in one sentence.")
print("assistant:", body["choices"][0]["message"]["content"].strip())
print(f"({body['usage']['completion_tokens']} tokens)")
PYEOF
echo "== flowyard bench: 16 requests of the Azure conversation trace (lengths capped for a 2-core CPU) =="
"$BIN/flowyard" bench --base-url "http://127.0.0.1:$PORT" --trace azure-conv --num-prompts 16 \
  --max-input-len 256 --max-output-len 48 --request-rate 1.5 --goodput ttft:2000 tpot:250 --quiet ${BENCH_ARGS:-}
