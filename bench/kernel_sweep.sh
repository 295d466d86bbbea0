#!/usr/bin/env bash
# Kernel variants timed in one GPU call: every variant's kernels compiled first, in parallel processes (one per
# variant, into Triton's cache; the cores of the device machine are idle otherwise), then `bench decode` times them
# all one after another in a single process, as usual, on the warm cache. A bucket's compile takes 15-25 s, so a
# sweep of 7 variants x 3 buckets compiled serially would spend most of a 10-minute call compiling.
#   bench/kernel_sweep.sh OUT VARIANTS -- DECODE_ARGS...
#   e.g. bench/kernel_sweep.sh "$OUT" "acq early" -- --models llama-3.2-1b --weights bf16 --batches 1 16 \
#        --wide-batches 64 --contexts 128 --no-peers --no-library-peer --timeline default --timeline-rows 1 16 --tag s1
# Writes what bench decode writes (OUT/decode-<device>-<tag>.{json,md}) and OUT/sweep.log.
# PARLEY_BASE=DIR: another tree (e.g. `git archive main | tar -x -C .base`) whose default is warmed beside the
# variants and timed with the same arguments after them, into OUT/base/: a baseline from the same call and machine.
set -uo pipefail
OUT=$1
VARIANTS=$2
shift 3  # OUT, VARIANTS, --
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/sweep.log"
# warm: each variant (and the default, with the timelines' profiled builds) in its own process, short timings;
# at most PARLEY_WARM_JOBS (4) at once: each holds the model's weights and their float32 copy on the GPU
# PARLEY_WARM_MODELS="m1 m2 ...": one warm-up process per variant and model (a later --models overrides the first), so
# a sweep over several models compiles them side by side rather than one after another in the variant's process.
JOBS=${PARLEY_WARM_JOBS:-4}
for v in default $VARIANTS; do
  if [ "$v" = default ]; then extra=(); else extra=(--variants "$v" --timeline); fi
  for m in ${PARLEY_WARM_MODELS:-all}; do
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
    if [ "$m" = all ]; then only=(); else only=(--models "$m"); fi
    python3 -m bench decode "$@" "${extra[@]}" "${only[@]}" --reps 3 --out /tmp/warm --tag "warm-$v-$m" \
      >"/tmp/warm-$v-$m.log" 2>&1 &
  done
done
BASE=${PARLEY_BASE:-}
if [ -n "$BASE" ]; then
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
  (cd "$BASE" && PYTHONPATH="$BASE:${PYTHONPATH:-}" python3 -m bench decode "$@" --reps 3 --out /tmp/warm --tag warm-base >/tmp/warm-base.log 2>&1) &
fi
wait
echo "warm: ${SECONDS} s" | tee -a "$OUT/sweep.log"
grep -h "failed\|Error\|WRONG" /tmp/warm-*.log | head -n 20 | tee -a "$OUT/sweep.log"
# shellcheck disable=SC2086
python3 -m bench decode "$@" --variants $VARIANTS --out "$OUT" 2>&1 | tee -a "$OUT/sweep.log" \
  | grep -vE "^\| [a-z]|^\| ---" | tail -n 60
if [ -n "$BASE" ]; then
  OUT_ABS=$(cd "$OUT" && pwd)
  (cd "$BASE" && PYTHONPATH="$BASE:${PYTHONPATH:-}" python3 -m bench decode "$@" --out "$OUT_ABS/base") 2>&1 | tee -a "$OUT/sweep.log" \
    | grep -vE "^\| [a-z]|^\| ---" | tail -n 30
fi
echo "kernel_sweep.sh: ${SECONDS} s" | tee -a "$OUT/sweep.log"
