#!/usr/bin/env bash
# The megakernel on one GPU in one 10-minute call: its GPU tests first (correctness before speed), then the decode
# bench (every model and weight format at 1 and 8 rows, Llama bf16 also at 32 and 64 rows, the reference decoder
# and the gpt-fast compiled peer beside it), which starts no new model run past the call's budget.
#   bench/kernel_gpu.sh [OUT]   → OUT/gpu.txt, OUT/kernel-tests.log, OUT/decode.log, OUT/decode-*.{json,md}
#                                 (default OUT: bench/results)
# Env: PARLEY_KERNEL_TESTS (a pytest -k expression; "none" skips the tests; default: all of tests/test_megakernel_gpu.py),
#      PARLEY_DECODE_ARGS (more arguments for bench/decode.py; default: the per-phase timeline of Llama bf16's 64-row
#      step), PARLEY_CALL_S (the call's seconds, default 590).
set -uo pipefail
OUT=${1:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
TESTS=${PARLEY_KERNEL_TESTS:-}
if [ "$TESTS" != "none" ]; then
  python3 -m pytest -q -s -p no:cacheprovider --durations=0 tests/test_megakernel_gpu.py ${TESTS:+-k "$TESTS"} 2>&1 \
    | tee "$OUT/kernel-tests.log" | grep -E "passed|failed|Error|error|assert|^[a-z].* \{|^\{|s call" | tail -n 40
  echo "GPU tests: ${SECONDS} s"
fi
# a (model, weights) run of the bench takes up to ~90 s (its compiles, peers and timings): start none past that
BUDGET=$(( ${PARLEY_CALL_S:-590} - SECONDS - 90 ))
DECODE_ARGS=${PARLEY_DECODE_ARGS---timeline default --timeline-rows 64 --timeline-models llama-3.2-1b --timeline-weights bf16}
# shellcheck disable=SC2086
python3 -m bench decode --out "$OUT" --budget-s "$BUDGET" $DECODE_ARGS 2>&1 | tee "$OUT/decode.log" \
  | grep -vE "^\| [a-z]|^\| ---" | tail -n 60
echo "kernel_gpu.sh: ${SECONDS} s"
