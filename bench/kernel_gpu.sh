#!/usr/bin/env bash
# The megakernel on one GPU in one call: its GPU tests first (correctness before speed), then the decode bench.
#   bench/kernel_gpu.sh [OUT]          → OUT/kernel-tests.log, OUT/decode-*.{json,md} (default bench/results)
# Env: PARLEY_KERNEL_TESTS (a pytest -k expression; "none" skips the tests; default: all of tests/test_megakernel_gpu.py),
#      PARLEY_DECODE_ARGS (arguments for bench/decode.py; default: its full default run).
set -uo pipefail
OUT=${1:-bench/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
TESTS=${PARLEY_KERNEL_TESTS:-}
if [ "$TESTS" != "none" ]; then
  python3 -m pytest -q -s -p no:cacheprovider tests/test_megakernel_gpu.py ${TESTS:+-k "$TESTS"} 2>&1 \
    | tee "$OUT/kernel-tests.log" | grep -E "passed|failed|Error|error|assert|^[a-z].* \{|^\{" | tail -n 40
fi
# shellcheck disable=SC2086
python3 bench/decode.py --out "$OUT" ${PARLEY_DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" | grep -vE "^\| [a-z]|^\| ---" | tail -n 60
