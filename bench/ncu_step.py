"""Where a decode step's warps wait, line by line: one megakernel step under Nsight Compute's warp-state sampling.

    python -m bench ncu-step [--model llama-3.2-1b] [--weights bf16] [--rows 16 1] [--variant default]
                             [--context 128] [--layout decode|prompt|half|mixed] [--out DIR]

For each row count, runs `ncu` (sampling every warp's stall reason at a fixed interval, per SASS instruction) over
one eager step of the megakernel on synthetic weights, its rows laid out as `bench decode --layouts` lays them (a
prompt's rows take a query-blocks variant's own launch), then folds the samples onto the kernel's Python source
lines (the SASS carries their line info) and onto the instruction each line is (a load from global memory, a spin,
a barrier, a matrix op). Writes DIR/ncu-<model>-<weights>-<variant>-<rows>[-<layout>].json: the samples per stall
reason, the 30 lines with the most samples and what stalls them, and the kernel's duration, DRAM throughput and L2
hit rate as ncu measured them. The timeline (`bench decode --timeline`) says how long each phase took; this says what
its warps were doing meanwhile. A GPU call; ncu replays the step a few times (memory restored between replays).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

NCU = os.environ.get("NCU", "ncu")
SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "WarpStateStats", "SourceCounters")


WARM_STEPS = 4  # eager steps before the profiled one (compiles, first launches)


def run_step(model: str, weights: str, rows: int, variant: str, context: int, layout: str = "decode",
             cubin: Path | None = None) -> None:
    """The profiled program: warm the kernel up (compile, first launches), then one more eager step, whose first
    launch ncu profiles (the layers' where the LM head has a launch of its own); that launch's cubin to `cubin`."""
    import torch

    from bench.decode import blocked, row_layout
    from bench.variants import VARIANTS
    from service.backends.megakernel import MegakernelDecoder
    from service.model.synthetic import load_synthetic

    config, w, _ = load_synthetic(model, device="cuda", dtype=torch.bfloat16)
    dec = MegakernelDecoder(config, w, max_slots=rows, max_context=context + 64, weight_format=weights,
                            max_rows=rows, max_batch=min(rows, 16), kernel_config=VARIANTS[variant](weights),
                            use_cuda_graphs=False)
    dec.reference.cache.k.normal_()
    dec.reference.cache.v.normal_()
    k = dec.kernel
    k.tokens[:rows] = torch.randint(0, config.vocab_size, (rows,), device="cuda", dtype=torch.int32)
    k.slots[:rows], k.positions[:rows] = row_layout(rows, context, layout, min(rows, dec.max_batch))
    k.fill_blocks(rows)
    for _ in range(WARM_STEPS):
        k.step(rows, blocked(dec, rows))
    torch.cuda.synchronize()
    k.step(rows, blocked(dec, rows))
    torch.cuda.synchronize()
    dec.check_errors()
    if cubin is not None:  # the profiled launch's own kernel: with two launches a step, the newest in Triton's cache
        # need not be it (the blocks' launch and the default, the layers' and the LM head's)
        cubin.write_bytes(k.compiled[1 if k.cfg.lm_launch else 0].asm["cubin"])


def report_name(model: str, weights: str, variant: str, rows: int, layout: str) -> str:
    """A profile's file name, without suffix (the decode layout unnamed, as before layouts)."""
    return f"ncu-{model}-{weights}-{variant}-{rows}" + ("" if layout == "decode" else f"-{layout}")


def profile(model: str, weights: str, rows: int, variant: str, context: int, out: Path, layout: str = "decode"
            ) -> dict:
    from bench.variants import VARIANTS

    rep = out / report_name(model, weights, variant, rows, layout)
    per_step = 2 if VARIANTS[variant](weights).lm_launch else 1
    cmd = [NCU, "--clock-control", "none", "--kernel-name", "megakernel", "--launch-skip", str(WARM_STEPS * per_step),
           "--launch-count", "1",
           "--import-source", "no", "-f", "-o", str(rep)]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, "-m", "bench.ncu_step", "--child", "--model", model, "--weights", weights,
            "--rows", str(rows), "--variant", variant, "--context", str(context), "--layout", layout,
            "--cubin", f"{rep}.cubin"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    report = Path(f"{rep}.ncu-rep")
    details = _ncu_page(report, "details")
    source = _ncu_page(report, "source", "--print-source", "sass")
    # the raw pages and the kernel's cubin (SASS address -> Python line: nvdisasm -gi) for reading off the machine
    (out / f"{rep.name}-details.csv").write_text(details)
    (out / f"{rep.name}-sass.csv").write_text(source)
    (out / f"{rep.name}-cuda.csv").write_text(_ncu_page(report, "source", "--print-source", "cuda,sass"))
    result = {"model": model, "weights": weights, "rows": rows, "variant": variant, "context": context,
              "layout": layout, "metrics": summary(details), **fold(source)}
    if Path(f"{rep}.cubin").exists():
        by_line = read(rep)
        result["lines"], result["unmapped"] = by_line["lines"], by_line["unmapped"]
    report.unlink(missing_ok=True)  # large; the pages above keep what is read from it
    return result


def _ncu_page(report: Path, page: str, *extra: str) -> str:
    proc = subprocess.run([NCU, "-i", str(report), "--page", page, "--csv", *extra], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else f"ncu failed: {proc.stderr[-2000:]}"


def summary(details_csv: str) -> dict[str, str]:
    """A few of ncu's headline figures: duration, DRAM throughput, L2 hit rate, achieved occupancy."""
    keep = ("Duration", "DRAM Throughput", "Memory Throughput", "L2 Hit Rate", "L1/TEX Hit Rate",
            "Achieved Occupancy", "Registers Per Thread", "Compute (SM) Throughput", "Warp Cycles Per Issued "
            "Instruction")
    out = {}
    for row in csv.DictReader(io.StringIO(details_csv)):
        name = row.get("Metric Name", "")
        if name in keep:
            out[name] = f"{row.get('Metric Value', '')} {row.get('Metric Unit', '')}".strip()
    return out


def fold(source_csv: str) -> dict:
    """Warp-state samples of each SASS instruction, summed per stall reason, per Python source line and per kind of
    instruction. The source page's CSV has one row per instruction: its address, its SASS text and a column per
    metric; line info comes from ncu's own `Source` correlation where present, else from the nearest preceding
    `//## File` annotation nvdisasm would print (absent in CSV), so lines are matched through the SASS address."""
    rows = list(csv.reader(io.StringIO(source_csv)))
    head = next((i for i, r in enumerate(rows) if r and r[0].strip() in ("#", "Address")), None)
    if head is None:
        return {"error": "no source table", "raw_head": source_csv[:2000]}
    cols = rows[head]
    idx = {c: i for i, c in enumerate(cols)}
    stall_cols = [c for c in cols
                  if c.startswith("stall_") or "Warp Stall Sampling" in c or c.startswith("smsp__pcsamp")]
    src_col = next((c for c in cols if c.lower() in ("source", "sass", "source code")), cols[1])
    by_reason: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = defaultdict(Counter)
    by_text: dict[str, Counter[str]] = defaultdict(Counter)
    total = 0.0
    for r in rows[head + 1:]:
        if len(r) < len(cols):
            continue
        text = r[idx[src_col]].strip()
        kind = re.split(r"[ .]", re.sub(r"^@!?U?P\w+\s+", "", text), maxsplit=1)[0] or "?"
        for c in stall_cols:
            try:
                v = float(r[idx[c]].replace(",", "") or 0)
            except ValueError:
                continue
            if v:
                by_reason[c] += v
                by_kind[kind][c] += v
                by_text[text][c] += v
                total += v
    top_text = sorted(by_text.items(), key=lambda kv: -sum(kv[1].values()))[:40]
    return {
        "columns": cols,
        "samples": total,
        "by_reason": dict(by_reason.most_common()),
        "by_instruction": {k: dict(v.most_common(4)) for k, v in
                           sorted(by_kind.items(), key=lambda kv: -sum(kv[1].values()))[:25]},
        "top_instructions": [[t, dict(v.most_common(4))] for t, v in top_text],
    }


def sass_lines(cubin: Path) -> dict[int, str]:
    """SASS address -> "file:line" of the Python source it was compiled from (nvdisasm's line annotations; the
    innermost inlined line)."""
    import triton

    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    text = subprocess.run([str(nvdisasm), "-gi", str(cubin)], capture_output=True, text=True).stdout
    out, where, in_text = {}, "?", False
    for line in text.splitlines():
        if re.match(r"\s*\.section\s", line):
            in_text = ".text.megakernel" in line
            continue
        if not in_text:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        a = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
        if a:
            out[int(a.group(1), 16)] = where
    return out


def read(prefix: Path, top: int = 40) -> dict:
    """The samples of a profile written by `profile` (prefix: its path without suffix), per Python source line:
    [line, samples, its three largest stall reasons], most samples first."""
    lines = sass_lines(Path(f"{prefix}.cubin"))
    rows = list(csv.reader(io.StringIO(Path(f"{prefix}-sass.csv").read_text())))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[head]
    reasons = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    per_line: dict[str, Counter[str]] = defaultdict(Counter)
    body = [r for r in rows[head + 1:] if len(r) >= len(cols)]
    start = min(int(r[0], 16) for r in body)  # ncu gives run-time addresses; nvdisasm offsets in the section
    for r in body:
        where = lines.get(int(r[0], 16) - start, "?")
        for c in reasons:
            v = float(r[cols.index(c)] or 0)
            if v:
                per_line[where][c.removeprefix("stall_")] += v
    total = sum(sum(v.values()) for v in per_line.values())
    ranked = sorted(per_line.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    # samples on no source line: a share over a few percent says the cubin is not the profiled launch's
    unmapped = sum(per_line["?"].values()) / total if total else 0.0
    return {"samples": total, "unmapped": unmapped,
            "lines": [[w, sum(v.values()), dict(v.most_common(3))] for w, v in ranked]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 1])
    ap.add_argument("--variant", default="default")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--layout", default="decode", choices=("decode", "prompt", "half", "mixed"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cubin", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--read", type=Path, help="fold a written profile (path without suffix) onto source lines")
    a = ap.parse_args()
    if a.read is not None:
        res = read(a.read)
        print(f"samples on no line: {100 * res['unmapped']:.1f}%")
        for w, n, why in res["lines"]:
            print(f"{100 * n / res['samples']:5.1f}%  {w:24s} {why}")
        return
    if a.child:
        run_step(a.model, a.weights, a.rows[0], a.variant, a.context, a.layout, a.cubin)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    for rows in a.rows:
        try:
            res = profile(a.model, a.weights, rows, a.variant, a.context, a.out, a.layout)
        except Exception as e:  # noqa: BLE001
            print(f"ncu {rows} rows failed: {repr(e)[:2000]}", flush=True)
            continue
        path = a.out / f"{report_name(a.model, a.weights, a.variant, rows, a.layout)}.json"
        path.write_text(json.dumps(res, indent=1))
        print(f"ncu {a.model} {a.weights} {a.variant} rows={rows}: {res['metrics']}", flush=True)
        for reason, n in list(res.get("by_reason", {}).items())[:8]:
            print(f"   {reason}: {n:.0f}", flush=True)


if __name__ == "__main__":
    main()
