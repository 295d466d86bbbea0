"""Gate/up of Llama-3.2-1B as one standalone phase: the Gluon swap-AB prototype (kernels/gluon_matvec.py) against
the megakernel's plain-Triton way and cuBLAS, at 1, 16 and 64 rows (issue 35, bench/NOTES.md "Where the rest is").

    python -m bench gluon-proto [--out DIR] [--rows 1 16 64]      # on an sm_90 GPU, under 2 minutes
    python -m bench gluon-proto --compile-only [--out DIR]         # no GPU: compile for sm_90a, report the code

out [R, 16384] = x [R, 2048] @ [W_gate; W_up]^T, bf16. Each kernel is timed as the median over CUDA-graph replays
of 20 calls that rotate over 4 weight copies (256 MB: nothing stays in L2 between calls, as in a step), against
the streaming-read bandwidth measured in the same run (a float32 sum over 1 GiB of bf16; bench/decode.py's
method) and a device-to-device copy. Before it is timed, each kernel's output on fresh random inputs is compared
with the float32 product (max abs error; cuBLAS's own error beside it).

The baseline (`triton_matvec_kernel`) is the phase as the megakernel streams it, without its task machinery: a
persistent program owns a run of weight tiles, and every step loads its weight tile and reloads the activation
chunk from L2 (plain Triton cannot hold x in shared memory across iterations); the rows padded to 16 as the dot's
M up to 16 rows, the operands swapped (weights as M) at 64, as kernels/tiles.py's defaults. The Gluon kernel runs
in a child process with a time limit: if it fails or hangs, the report still has the baseline, cuBLAS and the
error. Writes DIR/gluon-proto-<device>.json and .md (default bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels import gluon_matvec as gm

N, K = 16384, 2048  # Llama-3.2-1B: 2 x intermediate 8192, hidden 2048
COPIES = 4  # weight copies rotated through: 256 MB, five times the H100's L2
CALLS = 20  # calls per CUDA graph
REPS = 15  # graph replays timed
GLUON = {  # name -> config; "-stream": x's chunks ride in the ring (reread per tile) even where x would fit
    "gluon-128x128x4": gm.SwapABConfig(bm=128, bk=128, stages=4),
    "gluon-128x64x8": gm.SwapABConfig(bm=128, bk=64, stages=8),
    "gluon-64x128x4": gm.SwapABConfig(bm=64, bk=128, stages=4),
    "gluon-64x128x4-stream": gm.SwapABConfig(bm=64, bk=128, stages=4, x_resident=False),
}
BASELINE = {  # name -> (BN weight rows a tile, BK, stages, swapped at 32+ rows)
    "triton-mk": None,  # the megakernel's default tiles for the row count (below)
    "triton-swap-128x128": (128, 128, 3, True),
}
RESULTS = Path(__file__).parent / "results"


def megakernel_tile(rows: int) -> tuple[int, int, int, bool]:
    """kernels/tiles.py's gate/up defaults as (BN, BK, stages, swap): up to 16 rows 16-row runs of gate and of up
    side by side (32 weight rows a tile), k chunk 256, 4 stages; from 32 rows swapped, 32 + 32 rows, 3 stages."""
    return (32, 256, 4, False) if rows <= 16 else (64, 256, 3, True)


@triton.jit
def triton_matvec_kernel(x_ptr, w_ptr, out_ptr, R, N, K: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, SWAP: tl.constexpr, STAGES: tl.constexpr):
    """out = x @ w^T the megakernel's way: program p owns tiles [p T / G, (p+1) T / G) of BN weight rows, one flat
    pipelined loop over (tile, k chunk), the activation chunk reloaded at every step."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    num_tiles = N // BN
    t0 = pid * num_tiles // grid
    t1 = (pid + 1) * num_tiles // grid
    KT: tl.constexpr = K // BK
    rr = tl.arange(0, RP)
    rk = tl.arange(0, BK)
    rn = tl.arange(0, BN)
    if SWAP:
        acc = tl.zeros([BN, RP], tl.float32)
    else:
        acc = tl.zeros([RP, BN], tl.float32)
    for it in tl.range(0, (t1 - t0) * KT, num_stages=STAGES):
        n0 = (t0 + it // KT) * BN
        kk = it % KT
        k0 = kk * BK
        x = tl.load(x_ptr + rr[:, None] * K + (k0 + rk)[None, :], mask=rr[:, None] < R, other=0.0)
        w = tl.load(w_ptr + (n0 + rn)[:, None] * K + (k0 + rk)[None, :])
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if kk == KT - 1:
            if SWAP:
                tl.store(out_ptr + rr[None, :] * N + (n0 + rn)[:, None], acc.to(tl.bfloat16), mask=rr[None, :] < R)
                acc = tl.zeros([BN, RP], tl.float32)
            else:
                tl.store(out_ptr + rr[:, None] * N + (n0 + rn)[None, :], acc.to(tl.bfloat16), mask=rr[:, None] < R)
                acc = tl.zeros([RP, BN], tl.float32)


def baseline_launch(x, w, out, tile: tuple[int, int, int, bool], grid: int):  # noqa: ANN001, ANN201
    bn, bk, stages, swap = tile
    rows = x.shape[0]
    rp = max(16, triton.next_power_of_2(rows))
    g = (max(1, min(grid, w.shape[0] // bn)), )
    return g, (x, w, out, rows, w.shape[0]), {"K": x.shape[1], "RP": rp, "BN": bn, "BK": bk, "SWAP": swap,
                                              "STAGES": stages, "num_warps": 4}


def baseline_tile(name: str, rows: int) -> tuple[int, int, int, bool]:
    return megakernel_tile(rows) if BASELINE[name] is None else BASELINE[name]


# ---- compiling for sm_90a without a GPU ------------------------------------------------------------------------


def compile_sm90(fn, args: tuple, kwargs: dict):  # noqa: ANN001, ANN201
    """triton.compile for GPUTarget("cuda", 90, 32) from the launch's arguments (CPU tensors stand in for the
    device's: only their dtypes and alignment matter); Gluon kernels through Gluon's own AST source."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import mangle_type

    kwargs = dict(kwargs)
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(fn.arg_names, args)) | kwargs | opts  # a Gluon kernel may take num_warps as a constexpr
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        v = values[name]
        if fn.params[i].is_constexpr:
            sig[name], constexprs[name] = "constexpr", v
        else:
            sig[name] = mangle_type(v)
            if isinstance(v, torch.Tensor):
                attrs[(i, )] = [["tt.divisibility", 16]]
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    src = source(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


PTX_PATTERNS = {
    "cp.async.bulk.tensor (TMA)": r"cp\.async\.bulk\.tensor",
    "mbarrier.try_wait": r"mbarrier\.try_wait",
    "mbarrier expect_tx": r"mbarrier\.arrive\.expect_tx",
    "wgmma.mma_async": r"wgmma\.mma_async",
    "wgmma.wait_group": r"wgmma\.wait_group",
    "mma.sync": r"\bmma\.sync",
    "cp.async (Ampere)": r"cp\.async\.(?:cg|ca)\.shared\.global",
    "ld.global": r"\bld\.global",
    "bar.sync": r"\bbar\.sync",
}


def code_report(compiled) -> dict:  # noqa: ANN001
    """Registers, spills, shared memory, the PTX target and counts of the instructions that matter."""
    ptx = compiled.asm["ptx"]
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path(f"/tmp/parley-gluon-proto-{os.getpid()}.cubin")
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                           text=True).stdout
    cubin.unlink()
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    out = {"registers": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(4))} if m else {}
    out["shared_bytes"] = compiled.metadata.shared
    t = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    out["ptx_target"] = t.group(1) if t else "?"
    out["wgmma shapes"] = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx)))
    for what, pat in PTX_PATTERNS.items():
        out[what] = len(re.findall(pat, ptx))
    return out


def compile_all(rows_list: list[int]) -> dict:
    """Every Gluon config and baseline at every row count, compiled for sm_90a on this machine."""
    out = {}
    for rows in rows_list:
        x = torch.empty(rows, K, dtype=torch.bfloat16)
        w = torch.empty(N, K, dtype=torch.bfloat16)
        o = torch.empty(rows, N, dtype=torch.bfloat16)
        for name, cfg in GLUON.items():
            key = f"{name} R={rows}"
            try:
                (g, ), args, kwargs = gm.launch_args(x, w, o, cfg, 132)
                rep = code_report(compile_sm90(gm.swapab_matvec_kernel, args, kwargs))
                rep |= {"grid": g, "x_resident": kwargs["X_RESIDENT"]}
            except Exception as e:  # noqa: BLE001
                rep = {"error": f"{type(e).__name__}: {e}"[:2000]}
            out[key] = rep
            print(key, rep, flush=True)
        for name in BASELINE:
            key = f"{name} R={rows}"
            (g, ), args, kwargs = baseline_launch(x, w, o, baseline_tile(name, rows), 132)
            rep = code_report(compile_sm90(triton_matvec_kernel, args, kwargs)) | {"grid": g}
            out[key] = rep
            print(key, rep, flush=True)
    return out


# ---- timing on the GPU -------------------------------------------------------------------------------------------


def _events_ms(fn, reps: int) -> list[float]:  # noqa: ANN001
    from bench.cuda_timing import events_ms

    return events_ms(fn, reps)


def bandwidth() -> dict[str, float]:
    """Streaming read (a float32-accumulated sum over 1 GiB of bf16) and device-to-device copy, in GB/s."""
    x = torch.randn((1 << 30) // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(3):
        x.sum(dtype=torch.float32)
        y.copy_(x)
    read_ms = statistics.median(_events_ms(lambda: x.sum(dtype=torch.float32), 15))
    copy_ms = statistics.median(_events_ms(lambda: y.copy_(x), 15))
    nbytes = x.numel() * 2
    return {"read_GBps": nbytes / read_ms / 1e6, "copy_GBps": 2 * nbytes / copy_ms / 1e6}


def inputs(rows: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x ~ N(0, 1) [rows, K] and COPIES weight matrices ~ N(0, 1/K) [N, K], bf16, fresh per seed (never zeros)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, K, device="cuda", generator=g).to(torch.bfloat16)
    ws = [(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16) for _ in range(COPIES)]
    return x, ws


def check(fn, x: torch.Tensor, w: torch.Tensor) -> dict:  # noqa: ANN001
    """fn's output against the float32 product: max abs error, and cuBLAS's bf16 error beside it."""
    ref = x.float() @ w.float().t()
    got = fn(x, w).float()
    lib = (x @ w.t()).float()
    err = (got - ref).abs().max().item()
    lib_err = (lib - ref).abs().max().item()
    ok = bool(torch.isfinite(got).all()) and err <= max(2 * lib_err, 1e-2 * ref.abs().max().item())
    return {"max_abs_err": err, "cublas_max_abs_err": lib_err, "ref_max_abs": ref.abs().max().item(), "ok": ok}


def time_calls(fn, x: torch.Tensor, ws: list[torch.Tensor]) -> dict:  # noqa: ANN001
    """µs a call: a CUDA graph of CALLS calls over the rotated weight copies, median over REPS replays."""
    from bench.cuda_timing import graph_of

    outs = [torch.empty(x.shape[0], N, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]

    def calls() -> None:
        for i in range(CALLS):
            fn(x, ws[i % COPIES], outs[i % COPIES])

    g = graph_of(calls)
    for _ in range(3):
        g.replay()
    per = _events_ms(g.replay, REPS)
    return {"us": 1e3 * statistics.median(per) / CALLS, "us_min": 1e3 * min(per) / CALLS}


def _gluon_fn(cfg: gm.SwapABConfig, grid: int):  # noqa: ANN202
    def fn(x, w, out=None):  # noqa: ANN001, ANN202
        return gm.swapab_matvec(x, w, out, cfg, grid)
    return fn


def _baseline_fn(tile: tuple[int, int, int, bool], grid: int):  # noqa: ANN202
    def fn(x, w, out=None):  # noqa: ANN001, ANN202
        if out is None:
            out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        g, args, kwargs = baseline_launch(x, w, out, tile, grid)
        triton_matvec_kernel[g](*args, **kwargs)
        return out
    return fn


def _cublas(x, w, out=None):  # noqa: ANN001, ANN202
    return torch.matmul(x, w.t()) if out is None else torch.matmul(x, w.t(), out=out)


def measure(kernels: dict, rows_list: list[int], seed: int, save: Path | None = None) -> list[dict]:
    """Each kernel (name -> (fn, info)) at each row count: correctness, then time; an error is recorded, not
    raised. With `save`, the records so far are written there after each (a hang killed later keeps them)."""
    recs: list[dict] = []
    for rows in rows_list:
        x, ws = inputs(rows, seed + rows)
        for name, (fn, info) in kernels.items():
            rec = {"kernel": name, "rows": rows, **info(rows)}
            try:
                rec |= check(fn, x, ws[0])
                torch.cuda.synchronize()
                rec |= time_calls(fn, x, ws)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            recs.append(rec)
            if save is not None:
                save.write_text(json.dumps(recs))
            print(f"R={rows:2d} {name:24s} " + (f"{rec['us']:7.2f} us, err {rec['max_abs_err']:.2e} "
                  f"(cuBLAS {rec['cublas_max_abs_err']:.2e}) {'ok' if rec['ok'] else 'WRONG'}" if "us" in rec
                  else rec.get("error", "")[:300]), flush=True)
        del x, ws
        torch.cuda.empty_cache()
    return recs


def gluon_child(path: Path, rows_list: list[int], seed: int, grid: int) -> None:
    """The Gluon measurements (in a child process: a kernel that faults or hangs takes only this one down)."""
    kernels = {name: (_gluon_fn(cfg, grid), lambda r, cfg=cfg: {"config": repr(cfg), "x_resident": cfg.resident(r, K),
                                                                 "programs": min(grid, N // cfg.bm)})
               for name, cfg in GLUON.items()}
    path.write_text("[]")
    measure(kernels, rows_list, seed, save=path)


def run_gluon(rows_list: list[int], seed: int, grid: int, timeout_s: float) -> tuple[list[dict], str | None]:
    path = Path(f"/tmp/parley-gluon-proto-{os.getpid()}.json")
    cmd = [sys.executable, "-m", "bench.gluon_proto", "--gluon-child", str(path), "--seed", str(seed),
           "--grid", str(grid), "--rows", *map(str, rows_list)]
    err = None
    try:
        root = Path(__file__).resolve().parents[1]
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        p = subprocess.run(cmd, timeout=timeout_s, stderr=subprocess.PIPE, text=True, cwd=root, env=env)
        if p.returncode != 0:
            err = f"child exited {p.returncode}: {p.stderr[-3000:]}"
    except subprocess.TimeoutExpired as e:
        tail = e.stderr or b""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        err = f"timed out after {timeout_s:.0f} s (a hang?): {tail[-2000:]}"
    recs = json.loads(path.read_text()) if path.exists() else []
    path.unlink(missing_ok=True)
    return recs, err


def floor_us(rows: int, read_gbps: float) -> float:
    return (N * K + rows * K + rows * N) * 2 / read_gbps / 1e3


def markdown(doc: dict) -> str:
    bw = doc["bandwidth"]
    lines = [f"# Gate/up alone: Gluon swap-AB against the megakernel's Triton way and cuBLAS ({doc['device']})", "",
             f"torch {doc['torch']}, triton {doc['triton']}; out [R, {N}] = x [R, {K}] @ W^T, bf16, {doc['grid']} "
             f"programs. Streaming read {bw['read_GBps']:.0f} GB/s, device-to-device copy {bw['copy_GBps']:.0f} GB/s "
             f"(read + written). Floor = (W + x + out) bytes / streaming read. µs a call: median of CUDA-graph "
             f"replays of {CALLS} calls over {COPIES} weight copies. Error: max abs against the float32 product.", ""]
    if doc.get("gluon_error"):
        lines += [f"**Gluon run failed**: `{doc['gluon_error'][:1500]}`", ""]
    lines += ["| R | kernel | µs | floor µs | share of read bandwidth | max abs err (cuBLAS) | ok | notes |",
              "| ---: | --- | ---: | ---: | ---: | --- | --- | --- |"]
    for r in sorted(doc["records"], key=lambda r: (r["rows"], r["kernel"])):
        fl = floor_us(r["rows"], bw["read_GBps"])
        note = r.get("config", r.get("tile", "")) + (f", {r['programs']} programs" if "programs" in r else "")
        if "us" in r:
            lines.append(f"| {r['rows']} | {r['kernel']} | {r['us']:.2f} | {fl:.2f} | {100 * fl / r['us']:.0f}% | "
                         f"{r['max_abs_err']:.2e} ({r['cublas_max_abs_err']:.2e}) | {'yes' if r['ok'] else 'WRONG'} "
                         f"| {note} |")
        else:
            lines.append(f"| {r['rows']} | {r['kernel']} | – | {fl:.2f} | – | – | – | "
                         f"{r.get('error', '')[:200].replace('|', '/')} |")
    best = {}
    for r in doc["records"]:
        if "us" in r and r["ok"]:
            fam = r["kernel"].split("-")[0]
            k = (r["rows"], fam)
            best[k] = min(best.get(k, float("inf")), r["us"])
    lines += ["", "Best of each family (correct runs only):", "", "| R | floor | cuBLAS | Triton | Gluon |",
              "| ---: | ---: | ---: | ---: | ---: |"]
    for rows in doc["rows"]:
        cells = [f"{best[(rows, f)]:.2f}" if (rows, f) in best else "–" for f in ("cublas", "triton", "gluon")]
        lines.append(f"| {rows} | {floor_us(rows, bw['read_GBps']):.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--seed", type=int, default=None, help="inputs' seed (default: random, reported)")
    ap.add_argument("--grid", type=int, default=None, help="programs (default: the GPU's SMs)")
    ap.add_argument("--gluon-timeout", type=float, default=75.0, help="seconds for the Gluon child process")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a here (no GPU needed)")
    ap.add_argument("--gluon-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    a.out.mkdir(parents=True, exist_ok=True)
    if a.compile_only:
        doc = {"triton": triton.__version__, "torch": torch.__version__, "target": "cuda sm_90 (GPUTarget 90)",
               "code": compile_all(a.rows)}
        path = a.out / f"gluon-proto-sm90-compile{a.tag}.json"
        path.write_text(json.dumps(doc, indent=1))
        print(path)
        return
    if a.gluon_child is not None:
        gluon_child(a.gluon_child, a.rows, seed, a.grid)
        return
    if not torch.cuda.is_available():
        sys.exit("gluon-proto: needs a CUDA GPU (or --compile-only)")
    t_start = time.monotonic()
    grid = a.grid or torch.cuda.get_device_properties(0).multi_processor_count
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}, seed {seed}, grid {grid}", flush=True)
    bw = bandwidth()
    torch.cuda.empty_cache()
    print(f"streaming read {bw['read_GBps']:.0f} GB/s, d2d copy {bw['copy_GBps']:.0f} GB/s", flush=True)
    kernels = {"cublas": (_cublas, lambda r: {})}
    for name in BASELINE:
        kernels[name] = (_baseline_fn_lazy(name, grid), lambda r, name=name: {
            "tile": "(BN, BK, stages, swap) = " + str(baseline_tile(name, r)),
            "programs": min(grid, N // baseline_tile(name, r)[0])})
    recs = measure(kernels, a.rows, seed)
    torch.cuda.synchronize()
    budget = max(20.0, min(a.gluon_timeout, 115.0 - (time.monotonic() - t_start)))
    g_recs, g_err = run_gluon(a.rows, seed, grid, budget)
    doc = {"device": device, "torch": torch.__version__, "triton": triton.__version__, "seed": seed, "grid": grid,
           "rows": a.rows, "bandwidth": bw, "records": recs + g_recs, "gluon_error": g_err,
           "floor_us": {str(r): floor_us(r, bw["read_GBps"]) for r in a.rows},
           "wall_s": time.monotonic() - t_start}
    stem = a.out / f"gluon-proto-{device.replace(' ', '-')}{a.tag}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    stem.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    print(stem.with_suffix(".json"), stem.with_suffix(".md"), f"{doc['wall_s']:.0f} s", flush=True)


def _baseline_fn_lazy(name: str, grid: int):  # noqa: ANN202
    """The baseline with the megakernel's tiles chosen per call's row count."""
    def fn(x, w, out=None):  # noqa: ANN001, ANN202
        return _baseline_fn(baseline_tile(name, x.shape[0]), grid)(x, w, out)
    return fn


if __name__ == "__main__":
    main()
