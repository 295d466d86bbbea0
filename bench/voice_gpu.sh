#!/usr/bin/env bash
# The voice benchmark in one GPU call: `parley serve` (synthetic Llama-3.2-1B, the megakernel, 8k context) driven
# from the same host by `parley-loadtest --scenario voice`: voice sessions one at a time over HTTP chat (the whole
# conversation every turn, as Pipecat and LiveKit send it) and over the realtime WebSocket (only the new message),
# fresh prompts of 32 to 4,000 tokens one at a time, and Poisson arrivals of sessions at several rates; then
# bench/voice_report.py. The defaults are sized for about 5 minutes on an H100 (an estimate: the server's start and
# warm-up take 1-2 of them); a GPU call may last 10.
#   bench/voice_gpu.sh [RAW_DIR]   → RAW_DIR/{session,fresh,sweep}-*.json (+ .txt), the server's log, latency model
#                                    and metrics; then <results>/voice-<device>.{json,md,png}
# Env (default):
#   PARLEY_VOICE_URL           measure a server already running there and start none (start one)
#   PARLEY_VOICE_MODEL         synthetic:llama-3.2-1b      PARLEY_VOICE_BACKEND  megakernel
#   PARLEY_VOICE_SERVE_ARGS    more `parley serve` flags (none; it runs --max-batch 8 --max-context 8192)
#   PARLEY_VOICE_ARGS          more parley-loadtest flags for the voice runs, e.g. "--turns 4 --system-len 800"
#                              (none: the scenario's 8 turns, 1,500-token system prompt, 40-token messages,
#                              64-token replies, barge-in and preemptive starts on 30% of the turns)
#   PARLEY_VOICE_SESSIONS      4: sessions one at a time, per endpoint, after PARLEY_VOICE_WARMUP (1)
#   PARLEY_VOICE_THINK_S       0.5: seconds between a reply and the session's next turn
#   PARLEY_VOICE_FRESH         "32 1000 2000 4000": fresh prompt lengths; PARLEY_VOICE_FRESH_N (10) requests each,
#                              of PARLEY_VOICE_FRESH_OUT (64) tokens
#   PARLEY_VOICE_SWEEP_RATES   1,2,4,8: session arrivals per second; PARLEY_VOICE_SWEEP_S (10) seconds of arrivals
#   PARLEY_VOICE_ENDPOINTS     "chat realtime"   PARLEY_VOICE_RESULTS  bench/results   PARLEY_VOICE_PY  python3
set -euo pipefail
RAW=${1:-bench/results/voice-raw}
MODEL=${PARLEY_VOICE_MODEL:-synthetic:llama-3.2-1b}
BACKEND=${PARLEY_VOICE_BACKEND:-megakernel}
SERVE_ARGS=${PARLEY_VOICE_SERVE_ARGS:-}
VOICE_ARGS=${PARLEY_VOICE_ARGS:-}
SESSIONS=${PARLEY_VOICE_SESSIONS:-4}
WARMUP=${PARLEY_VOICE_WARMUP:-1}
THINK_S=${PARLEY_VOICE_THINK_S:-0.5}
FRESH=${PARLEY_VOICE_FRESH:-32 1000 2000 4000}
FRESH_N=${PARLEY_VOICE_FRESH_N:-10}
FRESH_OUT=${PARLEY_VOICE_FRESH_OUT:-64}
SWEEP_RATES=${PARLEY_VOICE_SWEEP_RATES:-1,2,4,8}
SWEEP_S=${PARLEY_VOICE_SWEEP_S:-10}
ENDPOINTS=${PARLEY_VOICE_ENDPOINTS:-chat realtime}
RESULTS=${PARLEY_VOICE_RESULTS:-bench/results}
PY=${PARLEY_VOICE_PY:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$RAW"
$PY -c "
import json, torch
try:
    import triton; version = triton.__version__
except ImportError:
    version = None
json.dump({'device': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',
           'torch': torch.__version__, 'triton': version}, open('$RAW/device.json', 'w'))"

if [ -n "${PARLEY_VOICE_URL:-}" ]; then
  URL=$PARLEY_VOICE_URL
else
  PORT=8012
  URL=http://127.0.0.1:$PORT
  # shellcheck disable=SC2086
  $PY -m service.cli serve --model "$MODEL" --backend "$BACKEND" --max-batch 8 --max-context 8192 $SERVE_ARGS \
      --port $PORT --gpu-hourly-usd 2.5 >"$RAW/server.log" 2>&1 &
  pid=$!
  trap 'kill -TERM $pid 2>/dev/null; wait $pid || true' EXIT
  until $PY -c "import httpx,sys; sys.exit(httpx.get('$URL/health', timeout=1).status_code != 200)" 2>/dev/null; do
    kill -0 $pid 2>/dev/null || { tail -n 50 "$RAW/server.log"; echo "the server died"; exit 1; }
    [ "$SECONDS" -lt 300 ] || { tail -n 50 "$RAW/server.log"; echo "the server is not ready after 300 s"; exit 1; }
    sleep 0.5
  done
  echo "server ready after ${SECONDS} s"
fi

loadtest() {  # NAME ARGS...
  local name=$1; shift
  echo "== $name ($SECONDS s)"
  $PY -m loadtest.cli --url "$URL" --quiet --sla-tokens 64 --sla-ms 100 --timeout 30 --json "$RAW/$name.json" "$@" \
    | tee "$RAW/$name.txt" | tail -n 14
}

# One session at a time: what a single caller gets from an otherwise idle server, turn by turn.
for endpoint in $ENDPOINTS; do
  # shellcheck disable=SC2086
  loadtest "session-$endpoint" --scenario voice --endpoint "$endpoint" --concurrency 1 --num-requests "$SESSIONS" \
    --warmup "$WARMUP" --think-s "$THINK_S" $VOICE_ARGS
done
# Fresh prompts, one at a time (each length its own seed: no prefix in common with the others).
for n in $FRESH; do
  loadtest "fresh-$n" --endpoint completions --concurrency 1 --num-requests "$FRESH_N" --warmup "$WARMUP" \
    --input-len "$n" --output-len "$FRESH_OUT" --seed "$n"
done
# Sessions arriving as a Poisson process (other sessions than above: another seed).
for endpoint in $ENDPOINTS; do
  # shellcheck disable=SC2086
  loadtest "sweep-$endpoint" --scenario voice --endpoint "$endpoint" --sweep --sweep-rates "$SWEEP_RATES" \
    --duration "$SWEEP_S" --warmup "$WARMUP" --think-s "$THINK_S" --seed 1 $VOICE_ARGS
done
$PY -c "import httpx; open('$RAW/latency-model.json', 'w').write(httpx.get('$URL/v1/latency_model').text)" || true
$PY -c "import httpx; open('$RAW/metrics.txt', 'w').write(httpx.get('$URL/metrics').text)" || true
echo "measured in ${SECONDS} s"
$PY bench/voice_report.py "$RAW" --out "$RESULTS"
