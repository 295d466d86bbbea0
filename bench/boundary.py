"""What one phase boundary of the megakernel costs with no work around it, by the way programs tell each other that
their outputs are ready (a GPU call; issue "The step at the floor").

Each of `programs` programs runs `phases` phases. A phase reads what every program wrote in the phase before (the
whole vector, `per_program` float32 each: the hidden vector of one row when 132 x 16), adds it up, and writes its
own slice, which depends on that sum. So each phase is one boundary of the megakernel's kind (OPROJ → GATEUP: every
consumer needs every producer) and nothing else, and a phase's time is the boundary's latency chain.

The ways compared:
- `counter` (the megakernel's today, kernels/sync.py): the producer's CTA barrier, an atomic add with release
  semantics on one counter per phase (every program arrives on it), the consumer's acquire polls, then its loads.
- `flags`: a flag per program, stored with release semantics (no read-modify-write on one shared address); the
  consumer polls every program's flag with acquire loads, then loads the data.
- `ll`: NCCL's low-latency protocol: each value travels with its phase in one 8-byte word (value bits, phase), stored
  with no fence; the consumer reloads the words until every one carries the phase it waits for, and has its data.
- `counter-no-data`: `counter` with no loads after the wait: the signalling's share of the chain.
- `one-producer`: each program waits for one other program's flag and reads its values only: a chain with no fan-in
  (what a boundary costs where a consumer needs only a few producers).

Per-phase time = (a launch of 2N phases - one of N phases) / N: launch costs cancel. Writes JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels.sync import _load_acquire, ld_act, wait_counter

MAX_SPIN = tl.constexpr(1 << 22)
WAYS = ("counter", "flags", "ll", "counter-no-data", "one-producer")


@triton.jit
def _store_release(ptr, value):
    """One int32 at ptr, stored by thread 0 with release semantics at GPU scope."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p st.global.release.gpu.b32 [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, value], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_flags(ptrs, target, err):
    """Spin until every flag at ptrs reaches target (acquire loads), then a CTA barrier; a wait that never ends sets
    the error flag."""
    seen = tl.min(_load_acquire(ptrs), axis=0)
    spins = 0
    while (seen < target) & (spins < MAX_SPIN):
        seen = tl.min(_load_acquire(ptrs), axis=0)
        spins += 1
    if seen < target:
        tl.atomic_add(err, 1)
    tl.debug_barrier()


@triton.jit
def _phases(data, words, counters, flags, err, phases, WAY: tl.constexpr, N: tl.constexpr, TOTAL: tl.constexpr,
            PP: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, TOTAL)
    live = r < N * nprog
    mine = tl.arange(0, N)
    progs = tl.arange(0, PP)
    for p in range(phases):
        s = 0.0
        src = (p + 1) % 2 * TOTAL  # the previous phase's half of the double buffer
        if p > 0:
            if WAY == 0:
                wait_counter(counters, p - 1, nprog, err, MAX_SPIN, True)
                s = tl.sum(ld_act(data + src + r, live, True), axis=0)
            elif WAY == 3:
                wait_counter(counters, p - 1, nprog, err, MAX_SPIN, True)
            elif WAY == 4:
                other = (pid + 1) % nprog
                _wait_flags(flags + (p + 1) % 2 * PP + other + tl.zeros([1], tl.int32), p, err)
                s = tl.sum(ld_act(data + src + other * N + mine, mine < N, True), axis=0)
            elif WAY == 1:
                _wait_flags(flags + (p + 1) % 2 * PP + tl.where(progs < nprog, progs, 0), p, err)
                s = tl.sum(ld_act(data + src + r, live, True), axis=0)
            else:
                w = tl.load(words + src + r, mask=live, other=0, volatile=True)
                ready = tl.min(tl.where(live, (w >> 32).to(tl.int32) == p, 1), axis=0)
                spins = 0
                while (ready == 0) & (spins < MAX_SPIN):
                    w = tl.load(words + src + r, mask=live, other=0, volatile=True)
                    ready = tl.min(tl.where(live, (w >> 32).to(tl.int32) == p, 1), axis=0)
                    spins += 1
                if ready == 0:
                    tl.atomic_add(err, 1)
                bits = (w & 0xFFFFFFFF).to(tl.int32)
                s = tl.sum(tl.where(live, bits.to(tl.float32, bitcast=True), 0.0), axis=0)
        out = (pid * N + mine).to(tl.float32) + s * 1e-30  # depends on what was read: the store waits for it
        dst = p % 2 * TOTAL + pid * N + mine
        if WAY == 2:
            word = ((p + 1).to(tl.int64) << 32) | (out.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)
            tl.store(words + dst, word)
        else:
            tl.store(data + dst, out)
            tl.debug_barrier()  # every thread's stores before the release
            if (WAY == 0) or (WAY == 3):
                tl.atomic_add(counters + p, 1, sem="release", scope="gpu")
            else:
                _store_release(flags + p % 2 * PP + pid + tl.zeros([1], tl.int32), tl.full([1], p + 1, tl.int32))


def run(way: str, programs: int, per_program: int, phases: int) -> tuple[float, torch.Tensor]:
    """One launch; (milliseconds by CUDA events, the error flag). The buffers are fresh for each launch."""
    total = triton.next_power_of_2(programs * per_program)
    pp = triton.next_power_of_2(programs)
    dev = "cuda"
    data = torch.zeros(2 * total, dtype=torch.float32, device=dev)
    words = torch.zeros(2 * total, dtype=torch.int64, device=dev)
    counters = torch.zeros(phases, dtype=torch.int32, device=dev)
    flags = torch.zeros(2 * pp, dtype=torch.int32, device=dev)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    _phases[(programs,)](data, words, counters, flags, err, phases, WAY=WAYS.index(way), N=per_program,
                         TOTAL=total, PP=pp, num_warps=4)
    b.record()
    b.synchronize()
    last = (phases - 1) % 2 * total
    got = data[last:last + programs * per_program] if way != "ll" else \
        (words[last:last + programs * per_program] & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    want = torch.arange(programs * per_program, dtype=torch.float32, device=dev)
    if int(err.item()) or not torch.allclose(got, want, rtol=0, atol=1e-3):
        raise RuntimeError(f"{way}: a wait failed or the last phase's values are wrong (err {int(err.item())})")
    return a.elapsed_time(b), err


def per_phase_us(way: str, programs: int, per_program: int, phases: int, reps: int) -> dict[str, float]:
    """Microseconds a phase: the median over `reps` of (a launch of 2 x phases - one of phases) / phases."""
    for n in (phases, 2 * phases):  # compile and warm both
        run(way, programs, per_program, n)
    diffs = []
    for _ in range(reps):
        short, _ = run(way, programs, per_program, phases)
        long, _ = run(way, programs, per_program, 2 * phases)
        diffs.append((long - short) * 1e3 / phases)
    return {"us_per_phase": statistics.median(diffs), "us_min": min(diffs), "us_max": max(diffs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", default="", help="programs (default: one per SM)")
    p.add_argument("--per-program", default="16,64", help="float32 values each program writes a phase, a list")
    p.add_argument("--phases", type=int, default=400)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="bench/results")
    a = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    programs = [int(x) for x in a.programs.split(",")] if a.programs else [props.multi_processor_count]
    rows = []
    for n in programs:
        for per in (int(x) for x in a.per_program.split(",")):
            for way in WAYS:
                res = per_phase_us(way, n, per, a.phases, a.reps)
                rows.append({"way": way, "programs": n, "per_program": per, **res})
                print(f"{way:8s} programs {n:4d} x {per:3d} values: {res['us_per_phase']:.2f} us a phase "
                      f"(min {res['us_min']:.2f}, max {res['us_max']:.2f})", flush=True)
    doc = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__, "phases": a.phases,
           "reps": a.reps, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"boundary-{props.name.replace(' ', '-')}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [f"# One phase boundary, no work ({props.name}; torch {torch.__version__}, triton {triton.__version__})",
             "", f"µs a phase: median of {a.reps} (launch of {2 * a.phases} phases − launch of {a.phases}) / "
             f"{a.phases}; `python -m bench boundary`", "", "| way | programs | values each | µs a phase | min | max |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['way']} | {r['programs']} | {r['per_program']} | {r['us_per_phase']:.2f} | {r['us_min']:.2f} | "
              f"{r['us_max']:.2f} |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
