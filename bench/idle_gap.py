"""Steps after the GPU idles: does a decode step run slower after the GPU has waited, and what do its clocks say?

    python -m bench idle-gap [--weights bf16 fp8] [--gaps-ms 0 1 5 20 50 100 300 1000] [--bursts 6] [--tag NAME]

Why: at light load the engine logs tens of steps every two seconds at 1.5-2x their recent median (CUDA events around
each step), and in one bf16 sweep three requests got a token every 2.6 ms for 150 ms with no host stall logged
(bench/NOTES.md, s45). A light load gives the GPU bursts (one reply's 64 steps) with idle gaps between them. This
replays that pattern with the 1-row decode step of Llama-3.2-1B (synthetic weights, context 128) in a CUDA graph: for
each gap, `--bursts` times: the host sleeps the gap (the GPU idles), then launches 64 steps back to back, each timed
by CUDA events. Meanwhile `nvidia-smi` samples the SM and memory clocks, the power and the clock-event reasons every
20 ms; each sample is put in a gap or a burst by its time. Reports per gap: the first step of a burst, the median
and the slowest of the rest, against the steps with no gap; and the clocks seen in bursts.
Writes bench/results/idle-gap-<device>[-TAG].{json,md}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from bench.device import describe, file_stem
from bench.variants import VARIANTS
from service.backends.megakernel import MegakernelDecoder
from service.model.synthetic import load_synthetic

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,pstate,clocks_event_reasons.active"
STEPS = 64  # a burst: one reply's SLA tokens
CONTEXT = 128


def sampler(path: Path) -> subprocess.Popen | None:
    """nvidia-smi sampling every 20 ms into `path` (None where it is missing)."""
    try:
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "20"],
                                stdout=path.open("w"), stderr=subprocess.DEVNULL)
    except OSError:
        return None


def read_samples(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 6:
            continue
        try:  # nvidia-smi's timestamp is the local time: "2026/11/28 19:40:01.123"
            t = dt.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            sm, mem = float(f[1]), float(f[2])
        except ValueError:  # a line cut short as the sampler was stopped
            continue
        out.append({"t": t, "sm_mhz": sm, "mem_mhz": mem, "power_w": _number(f[3]), "pstate": f[4], "reasons": f[5]})
    return out


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]"
        return None


def burst(replay, steps: int) -> list[float]:  # noqa: ANN001
    """`steps` replays launched back to back, each between two events; ms per step."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    ev[0].record()
    for i in range(steps):
        replay()
        ev[i + 1].record()
    ev[-1].synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(steps)]


def run(fmt: str, gaps_ms: list[float], bursts: int, samples: Path) -> dict:
    config, weights, _ = load_synthetic("llama-3.2-1b", device="cuda", dtype=torch.bfloat16)
    dec = MegakernelDecoder(config, weights, max_slots=1, max_context=CONTEXT + 64, weight_format=fmt, max_rows=1,
                            max_batch=1).with_kernel_config(VARIANTS["default"](fmt))
    dec.reference.cache.k.normal_()  # random K/V, never zeros
    dec.reference.cache.v.normal_()
    k = dec.kernel
    k.tokens[:1] = torch.randint(0, config.vocab_size, (1,), device="cuda", dtype=torch.int32)
    k.slots[:1] = 0
    k.positions[:1] = CONTEXT
    dec.run_step(1)
    torch.cuda.synchronize()
    dec.check_errors()
    replay = dec.graph(1).replay
    burst(replay, 200)  # warm
    proc = sampler(samples)
    time.sleep(0.2)
    windows: list[tuple[float, float, float]] = []  # (gap ms, burst start, burst end): wall clock
    rows = []
    order = [g for _ in range(bursts) for g in gaps_ms]  # interleaved: drift falls on every gap alike
    per_gap: dict[float, list[list[float]]] = {g: [] for g in gaps_ms}
    for g in order:
        if g:
            time.sleep(g / 1e3)
        t0 = time.time()
        ms = burst(replay, STEPS)
        windows.append((g, t0, time.time()))
        per_gap[g].append(ms)
    time.sleep(0.1)
    if proc is not None:
        proc.terminate()
        proc.wait()
    dec.check_errors()
    clocks = read_samples(samples) if proc is not None else []
    for g in gaps_ms:
        firsts = [b[0] for b in per_gap[g]]
        rest = [x for b in per_gap[g] for x in b[1:]]
        inside = [s for s in clocks for gg, a, b in windows if gg == g and a <= s["t"] <= b]
        rows.append({"gap_ms": g, "first_ms": statistics.median(firsts), "first_max_ms": max(firsts),
                     "rest_median_ms": statistics.median(rest), "rest_max_ms": max(rest),
                     "rest_over_1p5x": sum(x > 1.5 * statistics.median(rest) for x in rest), "rest_n": len(rest),
                     "burst_sm_mhz": sorted({s["sm_mhz"] for s in inside}),
                     "burst_mem_mhz": sorted({s["mem_mhz"] for s in inside}),
                     "burst_reasons": sorted({s["reasons"] for s in inside}), "samples_in_bursts": len(inside)})
        print(f"{fmt} gap {g:7.1f} ms: first {rows[-1]['first_ms']:.3f} (max {rows[-1]['first_max_ms']:.3f}), rest "
              f"median {rows[-1]['rest_median_ms']:.3f} max {rows[-1]['rest_max_ms']:.3f}; SM MHz in bursts "
              f"{rows[-1]['burst_sm_mhz']}", flush=True)
    all_sm = [s["sm_mhz"] for s in clocks]
    return {"weights": fmt, "gaps": rows, "samples": len(clocks),
            "sm_mhz_range": [min(all_sm), max(all_sm)] if all_sm else None,
            "pstates": sorted({s["pstate"] for s in clocks}), "reasons": sorted({s["reasons"] for s in clocks})}


def markdown(doc: dict) -> str:
    lines = [f"# Steps after the GPU idles, on {doc['device']['device']}", "",
             f"torch {doc['device']['torch']}, Triton {doc['device']['triton']}, Parley {doc['device']['parley']}. "
             f"Llama-3.2-1B (synthetic weights), 1 row, context {CONTEXT}, CUDA graph; bursts of {STEPS} steps after "
             "the host slept the gap; ms per step (CUDA events). SM clock: nvidia-smi every 20 ms, the samples that "
             "fell inside the gap's bursts.", ""]
    for run_ in doc["runs"]:
        lines += [f"## {run_['weights']} (SM clock {run_['sm_mhz_range']} MHz over the run; P-states "
                  f"{run_['pstates']}; clock-event reasons {run_['reasons']})", "",
                  "| gap (ms) | first step | first, slowest | the rest: median | the rest: slowest | rest over 1.5x "
                  "median | SM MHz in bursts |", "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| {r['gap_ms']:g} | {r['first_ms']:.3f} | {r['first_max_ms']:.3f} | {r['rest_median_ms']:.3f} | "
                  f"{r['rest_max_ms']:.3f} | {r['rest_over_1p5x']} of {r['rest_n']} | "
                  f"{', '.join(f'{m:g}' for m in r['burst_sm_mhz'])} |" for r in run_["gaps"]]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--gaps-ms", nargs="+", type=float, default=[0, 1, 5, 20, 50, 100, 300, 1000])
    ap.add_argument("--bursts", type=int, default=6)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = describe()
    stem = file_stem("idle-gap", str(device["device"])) + (f"-{args.tag}" if args.tag else "")
    doc = {"device": device, "runs": []}
    for fmt in args.weights:
        doc["runs"].append(run(fmt, args.gaps_ms, args.bursts, out / f"{stem}-{fmt}-clocks.csv"))
        (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
        (out / f"{stem}.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
