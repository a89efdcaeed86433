#!/usr/bin/env bash
# `flowyard` against `vllm` and `distserve` on the real engine (embedded SmolLM2-135M, CPU):
# for each policy, in one process and on Ray, start `flowyard serve --instances 2`, replay a
# slice of the Azure conversation trace with `flowyard bench`, stop the server; then print
# one markdown table from the saved JSON. Usage: bash scripts/flowyard_engine_bench.sh [OUT_DIR]
set -euo pipefail
OUT=${1:-$(mktemp -d -t flowyard-bench.XXXX)}
mkdir -p "$OUT"
PORT=${PORT:-8765}
NUM=${NUM:-24}
RATE=${RATE:-1.5}
for mode in local ray; do
  for policy in vllm distserve flowyard; do
    extra=""
    [ "$mode" = ray ] && extra="--ray"
    LOG="$OUT/serve-$policy-$mode.log"
    flowyard serve --port "$PORT" --instances 2 --policy "$policy" $extra >"$LOG" 2>&1 &
    SERVER=$!
    for _ in $(seq 1 240); do
      curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
      kill -0 $SERVER 2>/dev/null || { cat "$LOG"; echo "the server exited" >&2; exit 1; }
      sleep 1
    done
    flowyard bench --base-url "http://127.0.0.1:$PORT" --trace azure-conv --num-prompts "$NUM" \
      --max-input-len 256 --max-output-len 48 --request-rate "$RATE" --seed 0 \
      --goodput ttft:2000 tpot:250 --quiet --json "$OUT/$policy-$mode.json" >/dev/null
    kill $SERVER; wait $SERVER 2>/dev/null || true
  done
done
python - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| policy | executor | req/s | goodput (req/s) | TTFT mean / P99 (ms) | TPOT mean / P99 (ms) |")
print("|---|---|---|---|---|---|")
for mode in ("local", "ray"):
    for p in ("vllm", "distserve", "flowyard"):
        d = json.loads((out / f"{p}-{mode}.json").read_text())
        print(f"| `{p}` | {'one process' if mode == 'local' else 'Ray actors'} | {d['request_throughput']:.2f} | "
              f"{d.get('request_goodput', float('nan')):.2f} | {d['mean_ttft_ms']:.0f} / {d['p99_ttft_ms']:.0f} | "
              f"{d['mean_tpot_ms']:.0f} / {d['p99_tpot_ms']:.0f} |")
PYEOF
