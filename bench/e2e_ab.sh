#!/usr/bin/env bash
# Two builds end to end on one GPU in one call: machines of one kind differ more than builds do (bench/NOTES.md, s70:
# one build's host read 195 µs an iteration on one H200 and 283 on another), so a build's host time is judged against
# a baseline's measured in the same call. `python -m bench e2e` with the same settings in the baseline tree, then in
# this one, py-spy recording each one's single and sweep loadtests; then `bench host-profile THIS --against BASE` for
# each recording.
#   bench/e2e_ab.sh OUT BASE -- E2E_SETTINGS...
#   e.g. (carry .base, made here by `mkdir .base && git archive 5a8724d service kernels bench loadtest pyproject.toml
#   | tar -x -C .base`)  bench/e2e_ab.sh /var/tmp/ab .base -- --set only=megakernel.fp8 --set capacity=false
# Writes OUT/{base,this}/ (each run's report, its raw folder under raw/), OUT/{base,this}.log and
# OUT/this/raw/<loadtest>.ab.md. PARLEY_ARM_S: each run's limit in seconds (default 280; an FP8 server's cold start
# takes ~80 of them).
set -uo pipefail
OUT=$(realpath -m "$1")
BASE=$(realpath "$2")
shift 3  # OUT, BASE, --
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for arm in base this; do
  dir=$PWD
  [ "$arm" = base ] && dir=$BASE
  start=$SECONDS
  (cd "$dir" && PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" timeout "${PARLEY_ARM_S:-280}" python3 -m bench e2e \
     --set "name=e2e-ab-$arm" "$@" --set profile=single-32,sweep-32 --out "$OUT/$arm" --raw "$OUT/$arm/raw") \
    > "$OUT/$arm.log" 2>&1
  echo "$arm: exit $?, $((SECONDS - start)) s"
done
for f in "$OUT"/this/raw/*.pyspy.txt; do
  [ -f "$f" ] || continue
  base="$OUT/base/raw/$(basename "$f")"
  [ -f "$base" ] && python3 -m bench host-profile "$f" --against "$base" --top 40 > "${f%.pyspy.txt}.ab.md"
done
grep -hE "^\| [a-z0-9.]+ \| (single|sweep)" "$OUT"/base/*.md "$OUT"/this/*.md 2>/dev/null
