#!/usr/bin/env bash
# End to end on one GPU: `parley serve` measured from the client by parley-loadtest, one server per run: by default
# the megakernel on a synthetic Llama-3.2-1B with bf16 and with FP8 weights, the reference decoder as the in-run
# peer, and the megakernel on a synthetic Qwen2.5-1.5B.
#   bench/e2e_gpu.sh [RAW_DIR]      → RAW_DIR/*.json (one loadtest file per run, server logs), then
#                                     bench/results/e2e-<device>.{json,md,png} via bench/e2e_report.py
# Env: PARLEY_E2E_RUNS (lines "LABEL|SWEEP|serve flags": LABEL without '-', SWEEP 1 to run the goodput sweep too),
#      PARLEY_E2E_SWEEP_S (seconds per sweep rate, 6), PARLEY_E2E_PY (python3),
#      PARLEY_E2E_PYSPY (a py-spy binary: profiles the server during the single-stream run),
#      PARLEY_E2E_EXTRA (a JSON object merged into every request, e.g. '{"temperature": 0}'; default: none, so
#      the server's defaults, temperature 1, as the openai SDK sends) and PARLEY_E2E_TAG (prefixes the run names).
set -euo pipefail
RAW=${1:-bench/results/e2e-raw}
RUNS=${PARLEY_E2E_RUNS:-"megakernel.bf16|1|--model synthetic:llama-3.2-1b --backend megakernel --weights bf16
megakernel.fp8|1|--model synthetic:llama-3.2-1b --backend megakernel --weights fp8
reference.bf16|0|--model synthetic:llama-3.2-1b --backend reference
qwen.megakernel.bf16|0|--model synthetic:qwen2.5-1.5b --backend megakernel --weights bf16"}
SWEEP_S=${PARLEY_E2E_SWEEP_S:-6}
PY=${PARLEY_E2E_PY:-python3}
EXTRA=${PARLEY_E2E_EXTRA:-"{}"}
TAG=${PARLEY_E2E_TAG:-}
PORT=8011
URL=http://127.0.0.1:$PORT
mkdir -p "$RAW"
$PY -c "import json, torch, triton; json.dump({'device': torch.cuda.get_device_name(), 'torch': torch.__version__,
'triton': triton.__version__}, open('$RAW/device.json', 'w'))"

wait_ready() {
  for _ in $(seq 600); do
    if $PY -c "import httpx,sys; sys.exit(httpx.get('$URL/health', timeout=1).status_code != 200)" 2>/dev/null; then
      return 0
    fi
    kill -0 "$1" 2>/dev/null || { echo "server died"; return 1; }
    sleep 0.5
  done
  return 1
}

loadtest() {  # NAME ARGS...
  local name=$1; shift
  name="${name/-/-$TAG}"
  $PY -m loadtest.cli --url "$URL" --quiet --sla-tokens 64 --sla-ms 100 --extra-body "$EXTRA" \
    --json "$RAW/$name.json" "$@" \
    | tee "$RAW/$name.txt" | tail -n 25
}

while IFS='|' read -r -u 3 backend sweep flags; do
  [ -n "$backend" ] || continue
  echo "== $backend ($flags) =="
  # shellcheck disable=SC2086
  $PY -m service.cli serve $flags --max-batch 8 --max-context 2048 \
      --port $PORT --gpu-hourly-usd 2.5 >"$RAW/server-$TAG$backend.log" 2>&1 &
  pid=$!
  wait_ready $pid || { tail -n 50 "$RAW/server-$TAG$backend.log"; exit 1; }
  $PY -c "import httpx; open('$RAW/$TAG$backend-latency-model.json','w').write(httpx.get('$URL/v1/latency_model').text)" || true
  # One stream at a time: the product promise, as a single voice session meets it.
  if [ -n "${PARLEY_E2E_PYSPY:-}" ]; then
    "$PARLEY_E2E_PYSPY" record -p $pid -d 6 -r 500 --threads --nonblocking -f speedscope \
      -o "$RAW/$TAG$backend-pyspy.json" >/dev/null 2>&1 &
  fi
  loadtest "$backend-single-32" --concurrency 1 --num-requests 40 --warmup 5 --input-len 32 --output-len 64
  wait %2 2>/dev/null || true
  loadtest "$backend-single-1000" --concurrency 1 --num-requests 20 --warmup 3 --input-len 1000 --output-len 64
  if [ "$sweep" = 1 ]; then
    # Open-loop Poisson arrivals, doubling the rate until fewer than 99% meet the SLA, then bisecting.
    loadtest "$backend-sweep-32" --sweep --duration "$SWEEP_S" --warmup 5 --input-len 32 --output-len 64 \
      --sweep-start 4 --sweep-bisect 2 --plot "$RAW/$backend-sweep-32.png"
  fi
  $PY -c "import httpx; open('$RAW/$TAG$backend-metrics.txt','w').write(httpx.get('$URL/metrics').text)" || true
  kill -TERM $pid; wait $pid || true
done 3<<< "$RUNS"
$PY bench/e2e_report.py "$RAW"
