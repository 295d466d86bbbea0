"""The loader's prototype (issue 35, bench/NOTES.md "which waits the overlap needs"): Llama-3.2-1B's four layer
matrices chained for 16 layers in one persistent Gluon kernel (kernels/gluon_chain.py), every phase waiting for the
whole previous one, timed three ways: the ring running across phase boundaries (a phase's first weight tiles in
flight into shared memory while its program waits: the loader), drained at each boundary (nothing of a phase issued
before its wait: the megakernel's order today), and with no waits at all (the bound; wrong sums by design).

    python -m bench gluon-chain [--out DIR] [--rows 1 16] [--weights bf16 fp8]     # on an sm_90 GPU, ~1 minute
    python -m bench gluon-chain --compile-only [--out DIR]                          # no GPU: compile for sm_90a

FP8 is W8A8 here (e4m3 weights and activations on wgmma), bf16 is bf16 x bf16. Every variant that waits is first
checked against the same chain in torch (kernels/gluon_chain.reference) on fresh random inputs; then all of them
are timed in turns (bench/cuda_timing.time_in_turns) as CUDA graphs of CALLS launches, each launch preceded by the
zeroing of its float32 outputs and counters, less a graph of the zeroing alone. The floor is the layer's weight
bytes at the streaming-read bandwidth measured in the same run. Writes DIR/gluon-chain-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from kernels import gluon_chain as gc

LAYERS = 16
CALLS = 4  # launches a graph
REPS = 40  # graph replays timed (in turns)
PROGRAMS = 128  # every phase's tasks split evenly over them (kernels/gluon_chain.splits_for)
STAGES = {"bf16": (4, 6), "fp8": (8, 12)}  # ring depths tried (those that fit shared memory)
# `steal` variants: K chunks a task, by kind (kernels/gluon_chain.build_tasks); tasks claimed at run time
STEAL = {"steal-1": {"qkv": 1, "o": 1, "gate_up": 1, "down": 1},
         "steal-2": {"qkv": 2, "o": 2, "gate_up": 2, "down": 2},
         "steal-mix": {"qkv": 1, "o": 1, "gate_up": 4, "down": 2}}
SMEM = 227 * 1024
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
RESULTS = Path(__file__).parent / "results"


def smem_bytes(stages: int, rows: int, itemsize: int, max_chunks: int, bm: int = 128, bk: int = 128) -> int:
    """The kernel's shared memory: the ring, the task's activation chunks, the output tile's layout change."""
    rp = gc.padded_rows(rows)
    return stages * bm * bk * itemsize + max_chunks * rp * bk * itemsize + bm * rp * 4 + 1024


def variants(weights: str, rows: int, max_chunks: int, modes: list[str] | None = None) -> list[tuple[str, str, int]]:
    """(name, mode, stages): each mode at the shallow ring; ring and drain again at the deepest ring that fits; the
    claimed tasks at the shallow ring."""
    shallow, deep = STAGES[weights]
    out = [(f"{mode}-{shallow}", mode, shallow) for mode in gc.MODES]
    while deep > shallow and smem_bytes(deep, rows, DTYPES[weights].itemsize, max_chunks) > SMEM:
        deep -= 1
    if deep > shallow:
        out += [(f"{mode}-{deep}", mode, deep) for mode in ("ring", "drain")]
    out += [(f"{name}-{shallow}", name, shallow) for name in STEAL]
    return [v for v in out if modes is None or v[1] in modes]


def layer_bytes(itemsize: int) -> int:
    return sum(n * k for n, k in gc.LLAMA_1B.values()) * itemsize


class Chain:
    """One weight format's stacked weights, input and buffers at one row count, and its launches."""

    def __init__(self, weights: str, rows: int, layers: int, seed: int) -> None:
        self.rows, self.layers = rows, layers
        g = torch.Generator(device="cuda").manual_seed(seed)
        dtype = DTYPES[weights]
        self.weights = [(torch.randn(layers * n, k, device="cuda", generator=g) * k ** -0.5).to(dtype)
                        for n, k in gc.LLAMA_1B.values()]
        self.sched = gc.build_schedule(layers, rows, PROGRAMS)
        self.sched.table = self.sched.table.cuda()
        self.act = torch.zeros(self.sched.act_elems, device="cuda")
        x0 = torch.randn(rows, gc.LLAMA_1B["qkv"][1], device="cuda", generator=g)
        self.act[:x0.numel()] = x0.flatten()
        self.x0 = x0
        # counters: the static schedule's per-phase arrivals (per output tile: `tiles`); the claimed tasks' claim
        # and done counts
        self.cnt = torch.zeros(3, self.sched.phases * gc.TILE_SLOTS, device="cuda", dtype=torch.int32)
        self.err = torch.zeros(1, device="cuda", dtype=torch.int32)
        self.outs_from = self.sched.out_base[0]
        self.tasks: dict[str, gc.Tasks] = {}
        self.claims: dict[str, torch.Tensor] = {}

    def zero(self) -> None:
        self.act[self.outs_from:].zero_()
        self.cnt.zero_()

    def launch_args(self, mode: str, stages: int, prof: torch.Tensor | None = None):  # noqa: ANN201
        """(kernel, grid, args, kwargs) of the variant."""
        if mode not in STEAL:
            return (gc.chain_kernel, *gc.launch_args(self.sched, self.weights, self.act, self.cnt[0], self.err,
                                                     self.rows, mode, stages, prof=prof))
        if mode not in self.tasks:
            tk = gc.build_tasks(self.layers, self.rows, STEAL[mode])
            tk.table, tk.first, tk.count = tk.table.cuda(), tk.first.cuda(), tk.count.cuda()
            self.tasks[mode] = tk
        tk = self.tasks[mode]
        if mode not in self.claims:  # alive as long as its graphs
            self.claims[mode] = torch.zeros(PROGRAMS, tk.table.shape[0], device="cuda", dtype=torch.int32)
        claims = self.claims[mode]
        return (gc.chain_steal_kernel, *gc.steal_launch_args(tk, self.weights, self.act, self.cnt[1], self.cnt[2],
                                                             self.err, claims, self.rows, PROGRAMS, stages,
                                                             prof=prof))

    def launcher(self, mode: str, stages: int):  # noqa: ANN201
        kernel, grid, args, kwargs = self.launch_args(mode, stages)

        def launch() -> None:
            self.zero()
            kernel[grid](*args, **kwargs)
        return launch

    def output(self, ph: int) -> torch.Tensor:
        """Phase ph's float32 output [rows, N] (ph = -1: the input x)."""
        if ph < 0:
            return self.x0
        b, w = self.sched.out_base[ph], self.sched.out_width[ph]
        return self.act[b:b + self.rows * w].view(self.rows, w)

    def check(self, launch) -> dict:  # noqa: ANN001
        """Every phase's output against torch's on the kernel's own input of that phase (max abs error over the
        max abs value, the worst phase); the waits' error flag."""
        self.err.zero_()
        launch()
        torch.cuda.synchronize()
        worst = 0.0
        top = 0.0
        for ph in range(self.sched.phases):
            ref = gc.reference_phase(self.output(ph - 1), self.weights, ph)
            scale = ref.abs().max().item()
            top = max(top, scale)
            worst = max(worst, (self.output(ph) - ref).abs().max().item() / max(scale, 1e-30))
        return {"rel_err": worst, "ref_max_abs": top, "wait_errors": int(self.err.item()),
                "ok": worst <= 1e-2 and self.err.item() == 0}

    def timeline(self, mode: str, stages: int, launches: int = 5) -> dict:
        """Per phase kind (the median over its layers and the launches), µs: `imbalance`, the last program's release
        after the median program's; `signal`, the median program's wait ending after the last release;
        `work_p50` / `work_max`, a program's time from its wait's end to its release. And per program, for reading
        the tail: `late_us_by_program`, its release after the phase's median release (mean over layers and launches;
        a program that took none of a phase's claimed tasks counts 0), `sm_by_program` (the last launch's)."""
        prof = torch.zeros(PROGRAMS, self.sched.phases, 4, device="cuda", dtype=torch.int64)
        kernel, grid, args, kwargs = self.launch_args(mode, stages, prof)
        per: dict[str, dict[str, list[float]]] = {k: {} for k in gc.KINDS}
        late = {k: torch.zeros(PROGRAMS, dtype=torch.float64) for k in gc.KINDS}
        seen = dict.fromkeys(gc.KINDS, 0)
        for _ in range(launches):
            self.zero()
            prof.zero_()
            kernel[grid](*args, **kwargs)
            torch.cuda.synchronize()
            t = prof.double() / 1e3  # µs
            for ph in range(1, self.sched.phases):
                rel = t[:, ph - 1, 2]
                rel = rel[rel > 0]  # programs that took none of the phase's tasks (claimed tasks) wrote nothing
                took = t[:, ph, 2] > 0
                work = t[took, ph, 2] - t[took, ph, 1]
                stats = {"imbalance": (rel.max() - rel.median()).item(),
                         "signal": (t[took, ph, 1].median() - rel.max()).item(),
                         "work_p50": work.median().item(), "work_max": work.max().item()}
                kind = gc.KINDS[ph % len(gc.KINDS)]  # the phase whose programs wait (for the one before)
                for k, v in stats.items():
                    per[kind].setdefault(k, []).append(v)
                released = t[:, ph, 2]
                late[kind] += torch.where(released > 0, released - released[released > 0].median(), 0.0)
                seen[kind] += 1
        sm = prof[:, :, 3].max(dim=1).values.tolist()
        return {kind: {k: statistics.median(v) for k, v in d.items()} |
                {"late_us_by_program": [round(x, 3) for x in (late[kind] / max(seen[kind], 1)).tolist()],
                 "sm_by_program": sm} for kind, d in per.items()}


def measure(weights: str, rows: int, layers: int, seed: int, read_gbps: float, save,  # noqa: ANN001
            modes: list[str] | None = None) -> list[dict]:
    from bench.cuda_timing import graph_of, time_in_turns

    chain = Chain(weights, rows, layers, seed)
    recs, replays = [], {}
    for name, mode, stages in variants(weights, rows, chain.sched.max_chunks, modes):
        rec = {"weights": weights, "rows": rows, "variant": name, "mode": mode, "stages": stages,
               "smem_estimate": smem_bytes(stages, rows, DTYPES[weights].itemsize, chain.sched.max_chunks)}
        try:
            launch = chain.launcher(mode, stages)
            rec |= chain.check(launch) if mode != "nowait" else {"ok": None}
            replays[name] = graph_of(lambda launch=launch: [launch() for _ in range(CALLS)]).replay
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
        recs.append(rec)
        save(recs)
        print(f"{weights} R={rows:2d} {name:10s} " + (rec.get("error", "")[:300] or (
            f"rel err {rec['rel_err']:.1e}, wait errors {rec['wait_errors']} {'ok' if rec['ok'] else 'WRONG'}"
            if rec["ok"] is not None else "timing only")), flush=True)
    replays["zeroing"] = graph_of(lambda: [chain.zero() for _ in range(CALLS)]).replay
    timed = time_in_turns(replays, REPS)
    zero_ms = timed["zeroing"]["step_ms"]
    floor = layer_bytes(DTYPES[weights].itemsize) / read_gbps / 1e3
    for rec in recs:
        if rec["variant"] in timed:
            t = timed[rec["variant"]]
            us = 1e3 * (t["step_ms"] - zero_ms) / CALLS
            rec |= {"us_call": us, "us_layer": us / layers, "floor_us_layer": floor,
                    "us_over_floor_per_boundary": (us / layers - floor) / len(gc.KINDS),
                    "round_medians_ms": t.get("round_medians_ms")}
    for rec in recs:
        if rec["stages"] == STAGES[weights][0] and "error" not in rec and "us_layer" in rec:
            rec["timeline"] = chain.timeline(rec["mode"], rec["stages"])
    save(recs)
    return recs


def markdown(doc: dict) -> str:
    bw = doc["bandwidth"]
    lines = [f"# The loader's prototype: four chained layer matrices, waits and all ({doc['device']})", "",
             f"torch {doc['torch']}, triton {doc['triton']}, seed {doc['seed']}. Llama-3.2-1B's QKV → O → gate/up → "
             f"down for {doc['layers']} layers in one persistent Gluon kernel of {PROGRAMS} programs (attention left "
             f"out: 4 boundaries a layer). Streaming read {bw['read_GBps']:.0f} GB/s; floor = a layer's weight bytes "
             f"at it. µs: median of CUDA-graph replays timed in turns, less the outputs' zeroing.", "",
             "| weights | rows | variant | µs a layer | floor | over the floor a boundary | vs drain at the same ring "
             "| check |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    recs = doc["records"]
    for r in recs:
        if "us_layer" not in r:
            lines.append(f"| {r['weights']} | {r['rows']} | {r['variant']} | – | – | – | – | "
                         f"{r.get('error', '')[:200].replace('|', '/')} |")
            continue
        drain = next((d for d in recs if d["weights"] == r["weights"] and d["rows"] == r["rows"]
                      and d["mode"] == "drain" and d["stages"] == r["stages"] and "us_layer" in d), None)
        vs = f"{r['us_layer'] - drain['us_layer']:+.2f}" if drain and drain is not r else ""
        check = {None: "timing only", True: f"ok ({r.get('rel_err', 0):.0e})", False: "WRONG"}[r["ok"]]
        lines.append(f"| {r['weights']} | {r['rows']} | {r['variant']} | {r['us_layer']:.2f} | "
                     f"{r['floor_us_layer']:.2f} | {r['us_over_floor_per_boundary']:.2f} | {vs} | {check} |")
    lines += ["", "Where a boundary's time goes (each program's %globaltimer at its wait's start and end and at its "
              "release; µs, per waiting phase, the median over its layers and 5 launches): imbalance = the last "
              "program's release of the phase before after the median program's; signal = the median program's wait "
              "ending after that last release; work = a program's wait end to its release (median, slowest).", "",
              "| weights | rows | variant | phase (waits for the one before) | imbalance | signal | work p50 | "
              "work max |", "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in recs:
        for kind, t in r.get("timeline", {}).items():
            lines.append(f"| {r['weights']} | {r['rows']} | {r['variant']} | {kind} | {t['imbalance']:.2f} | "
                         f"{t['signal']:.2f} | {t['work_p50']:.2f} | {t['work_max']:.2f} |")
    lines += ["", "The latest programs of each phase (mean µs after the phase's median release; program (SM)); the "
              "JSON has every program's:", "", "| weights | rows | variant | phase | latest five |",
              "| --- | ---: | --- | --- | --- |"]
    for r in recs:
        for kind, t in r.get("timeline", {}).items():
            late = t.get("late_us_by_program", [])
            top = sorted(range(len(late)), key=lambda p: -late[p])[:5]
            cells = ", ".join(f"{late[p]:.2f} p{p} (SM {t['sm_by_program'][p]})" for p in top)
            lines.append(f"| {r['weights']} | {r['rows']} | {r['variant']} | {kind} | {cells} |")
    return "\n".join(lines) + "\n"


def compile_launches(weights: str, rows: int, layers: int = 2) -> list[tuple[str, object, tuple, dict]]:
    """(variant, kernel, args, kwargs) of every variant with CPU tensors standing in (for compile_sm90)."""
    dtype = DTYPES[weights]
    sched = gc.build_schedule(layers, rows, PROGRAMS)
    ws = [torch.empty(layers * n, k, dtype=dtype) for n, k in gc.LLAMA_1B.values()]
    act, err = torch.empty(sched.act_elems), torch.zeros(1, dtype=torch.int32)
    out = []
    for name, mode, stages in variants(weights, rows, sched.max_chunks):
        cnt = torch.zeros(sched.phases, dtype=torch.int32)
        if mode in STEAL:
            tk = gc.build_tasks(layers, rows, STEAL[mode])
            claims = torch.zeros(PROGRAMS, tk.table.shape[0], dtype=torch.int32)
            _, args, kwargs = gc.steal_launch_args(tk, ws, act, cnt, cnt, err, claims, rows, PROGRAMS, stages)
            out.append((name, gc.chain_steal_kernel, args, kwargs))
        else:
            _, args, kwargs = gc.launch_args(sched, ws, act, cnt, err, rows, mode, stages)
            out.append((name, gc.chain_kernel, args, kwargs))
    return out


def compile_only(out: Path, tag: str) -> None:
    from bench.gluon_proto import code_report, compile_sm90

    code = {}
    for weights in DTYPES:
        for rows in (1, 16):
            for name, kernel, args, kwargs in compile_launches(weights, rows):
                code[f"{weights} R={rows} {name}"] = rep = code_report(compile_sm90(kernel, args, kwargs))
                print(f"{weights} R={rows} {name}", rep, flush=True)
    path = out / f"gluon-chain-sm90-compile{tag}.json"
    path.write_text(json.dumps({"triton": triton.__version__, "code": code}, indent=1))
    print(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--weights", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--modes", nargs="+", choices=[*gc.MODES, *STEAL], help="only these variants' modes")
    ap.add_argument("--seed", type=int, default=None, help="inputs' seed (default: random, reported)")
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a here (no GPU needed)")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.compile_only:
        compile_only(a.out, a.tag)
        return
    if not torch.cuda.is_available():
        sys.exit("gluon-chain: needs a CUDA GPU (or --compile-only)")
    from bench.gluon_proto import bandwidth

    seed = a.seed if a.seed is not None else int.from_bytes(os.urandom(4), "little")
    t0 = time.monotonic()
    device = torch.cuda.get_device_name()
    bw = bandwidth()
    torch.cuda.empty_cache()
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}, seed {seed}; streaming read "
          f"{bw['read_GBps']:.0f} GB/s", flush=True)
    doc = {"device": device, "torch": torch.__version__, "triton": triton.__version__, "seed": seed,
           "layers": a.layers, "bandwidth": bw, "records": []}
    stem = a.out / f"gluon-chain-{device.replace(' ', '-')}{a.tag}"

    def save(recs: list[dict], done: list[dict] = doc["records"]) -> None:
        stem.with_suffix(".json").write_text(json.dumps(doc | {"records": done + recs}, indent=1))

    for weights in a.weights:
        for rows in a.rows:
            doc["records"] += measure(weights, rows, a.layers, seed + rows, bw["read_GBps"], save, a.modes)
            torch.cuda.empty_cache()  # the format's weights and graphs, gone with measure's frame
    doc["wall_s"] = time.monotonic() - t0
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    stem.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    print(stem.with_suffix(".md"), f"{doc['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
