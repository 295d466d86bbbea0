"""The end-to-end report: fold a raw folder of `python -m bench e2e` into <out>/<name>-<device>.{json,md,png}.

    python -m bench e2e --report-only [--raw bench/results/raw/e2e] [--out bench/results]

The raw folder holds one parley-loadtest JSON per (server, loadtest), named <label>-<kind>.json (`kind` is
single-32, single-1000, sweep-32, or capacity-32: the same sweep against the same model with admission off),
device.json, and plan.json (the servers' flags and the issue's targets). Goodput / capacity is the sweep's highest
rate with 99% of all requests on time over the capacity sweep's: what admission keeps of what the server can serve.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench import admission_trace, loop_metrics, slow_log, token_gaps
from bench.device import describe, file_stem
from bench.publish import publish, pyplot

# A target's figure: the loadtest it is read from, and which way it must hold.
TARGETS = {"goodput_rps": ("sweep-32", ">="), "ttft_ms_p50": ("single-32", "<="),
           "goodput_over_capacity": ("sweep-32", ">="), "admitted_on_time_min": ("sweep-32", ">="),
           "gpu_idle_us_p99_at_goodput": ("sweep-32", "<="), "itl_over_step_p99": ("single-32", "<=")}


def record(label: str, model: str, kind: str, doc: dict[str, Any],
           at_rate: Callable[[dict[str, Any]], dict[str, Any]] = lambda run: {}) -> dict[str, Any]:
    """One loadtest's figures; at_rate(run): the server's engine-loop figures over one rate of a sweep."""
    runs = doc["runs"]
    best = doc["sweep"]["best"] if doc.get("sweep") else runs[0]["summary"]
    s = best or runs[-1]["summary"]
    rec = {
        "backend": label, "model": model, "kind": kind,
        "prompt_tokens": round(s["mean_prompt_tokens"] or 0),
        "requests": s["requests"],
        "ttf64_ms_p50": s["ttfn_ms"]["p50"], "ttf64_ms_p99": s["ttfn_ms"]["p99"],
        "ttft_ms_p50": s["ttft_ms"]["p50"], "ttft_ms_p99": s["ttft_ms"]["p99"],
        "itl_ms_p50": s["itl_ms"]["p50"], "itl_ms_p99": s["itl_ms"]["p99"],
        "sla_attainment": s["sla_attainment"], "rejection_rate": s["rejection_rate"],
        "output_tokens_per_s": s["output_throughput"], "usd_per_1m_tokens": s["usd_per_1m_output_tokens"],
        "reject_ms_p99": s["reject_ms"]["p99"],
        "client_lag_ms_p99": s.get("client_loop_lag_ms", {}).get("p99"),
    }
    if kind.startswith("single"):  # one stream at a time: its gaps taken apart (bench/token_gaps.py)
        rec["gaps"] = token_gaps.of_requests([q for run in runs for q in run.get("requests", [])])
    if doc.get("sweep"):
        rec["goodput_rps"] = doc["sweep"]["best_rate"]
        rec["sweep"] = [{"rate": r["rate"], "requests": r["summary"]["requests"],
                         "sla_attainment": r["summary"]["sla_attainment"],
                         "sla_attainment_all": r["summary"]["sla_attainment_all"],
                         "rejection_rate": r["summary"]["rejection_rate"],
                         "ttf64_ms_p50": r["summary"]["ttfn_ms"]["p50"], "ttf64_ms_p99": r["summary"]["ttfn_ms"]["p99"],
                         "usd_per_1m_tokens": r["summary"]["usd_per_1m_output_tokens"],
                         "client_lag_ms_p99": r["summary"].get("client_loop_lag_ms", {}).get("p99")}
                        | {k: v for k, v in at_rate(r).items() if k in RATE_LOOP}
                        for r in sorted(runs, key=lambda r: r["rate"] or 0)]
        at_goodput = next((p for p in rec["sweep"] if p["rate"] == rec["goodput_rps"]), {})
        rec["gpu_idle_us_p99_at_goodput"] = at_goodput.get("gpu_idle_us_p99")
        rec["host_us_p99_at_goodput"] = at_goodput.get("host_us_p99")
        admitted = [p["sla_attainment"] for p in rec["sweep"] if p["sla_attainment"] is not None]
        rec["min_sla_attainment_over_sweep"] = rec["admitted_on_time_min"] = min(admitted) if admitted else None
    return rec


# the engine loop's figures a sweep's rates each carry (from the server's /metrics around the rate)
RATE_LOOP = ("host_us_p50", "host_us_p99", "gpu_idle_us_p99", "loop_iterations")


def itl_over_step(rec: dict[str, Any]) -> float | None:
    """The client's inter-token p99 over the step's median time on the GPU (#37: <= 1.1): how much the way from a
    step to the client adds to a stream's cadence. None without a GPU's step times."""
    step_us = rec.get("step_gpu_us_p50")
    if not step_us or rec.get("itl_ms_p99") is None:
        return None
    return round(rec["itl_ms_p99"] * 1000.0 / step_us, 3)


def pair_capacity(records: list[dict[str, Any]]) -> None:
    """Each sweep-32 record gets its backend's capacity (the capacity-32 sweep's highest rate with 99% of all on
    time, admission off) and goodput / capacity (0 where no rate held with admission on)."""
    capacity = {r["backend"]: r.get("goodput_rps") for r in records if r["kind"] == "capacity-32"}
    for rec in records:
        if rec["kind"] != "sweep-32" or rec["backend"] not in capacity:
            continue
        cap = rec["capacity_rps"] = capacity[rec["backend"]]
        rec["goodput_over_capacity"] = None if not cap else round((rec.get("goodput_rps") or 0.0) / cap, 3)


def targets(servers: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each server's targets (plan.json) with what was measured and whether it holds (None: nothing measured)."""
    out = []
    for server in servers:
        for figure, goal in server.get("targets", {}).items():
            kind, way = TARGETS[figure]
            rec = next((r for r in records if r["backend"] == server["label"] and r["kind"] == kind), None)
            measured = None if rec is None else rec.get(figure)
            met = None if measured is None else measured >= goal if way == ">=" else measured <= goal
            out.append({"backend": server["label"], "figure": figure, "target": f"{way} {goal:g}",
                        "measured": measured, "met": met})
    return out


def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def build(raw: Path) -> dict[str, Any]:
    info_file = raw / "device.json"  # written on the GPU host; the report may be made elsewhere
    info = json.loads(info_file.read_text()) if info_file.exists() else describe()
    plan_file = raw / "plan.json"
    plan = json.loads(plan_file.read_text()) if plan_file.exists() else {"servers": []}
    servers = plan["servers"]
    if servers:  # the plan's loadtests, in its order (not what an earlier run left in the folder)
        paths = [p for p in (raw / f"{t['name']}.json" for s in servers for t in s["loadtests"]) if p.exists()]
    else:
        paths = [p for p in sorted(raw.glob("*-*.json")) if not p.stem.endswith("-latency-model")]
    records = []
    for path in paths:
        label, kind = path.stem.split("-", 1)
        doc = json.loads(path.read_text())
        records.append(record(label, doc["config"]["model"], kind, doc, partial(loop_metrics.at_rate, raw, path.stem))
                       | loop_metrics.figures(raw, path.stem))
    pair_capacity(records)
    for rec in records:
        rec["itl_over_step_p99"] = itl_over_step(rec)
    serve = {} if plan.get("url") else {s["label"]: s["serve"] for s in servers}  # at a URL: not our flags
    startup = raw / "startup.json"
    return {**info, "servers": serve, "startup_s": json.loads(startup.read_text()) if startup.exists() else {},
            "records": records, "targets": targets(servers, records), "admission": admission_trace.of_raw(raw),
            "slow_iterations": slow_log.of_servers(raw, [s["label"] for s in servers])}


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"# End to end: client-measured latency of `parley serve` on {doc['device']}",
        "",
        f"torch {doc.get('torch')}, Triton {doc.get('triton')}, Parley {doc.get('parley') or '?'}. Model: synthetic "
        "weights with the real shapes (decode cost does not depend on weight values). SLA: 64 tokens within 100 ms. "
        "Measured by parley-loadtest on the same host over loopback; `single` = one stream at a time, `sweep` = "
        "Poisson arrivals at the highest rate where ≥ 99% of all requests met the SLA (goodput).",
        "",
        "| backend | run | prompt tok | TTF64 p50 ms | TTF64 p99 ms | TTFT p50 ms | ITL p50 ms | SLA att. (admitted) "
        "| rejected | goodput req/s | out tok/s | USD / 1M tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["records"]:
        lines.append(
            f"| {r['backend']} | {r['kind']} | {r['prompt_tokens']} | {fmt(r['ttf64_ms_p50'])} | "
            f"{fmt(r['ttf64_ms_p99'])} | {fmt(r['ttft_ms_p50'])} | {fmt(r['itl_ms_p50'], 2)} | "
            f"{fmt(r['sla_attainment'], 3)} | {fmt(r['rejection_rate'], 3)} | {fmt(r.get('goodput_rps'))} | "
            f"{fmt(r['output_tokens_per_s'], 0)} | {fmt(r['usd_per_1m_tokens'], 3)} |")
    gapped = [r for r in doc["records"] if r.get("gaps", {}).get("gaps")]
    if gapped:
        lines += ["", "One stream at a time, its inter-token gaps taken apart (bench/token_gaps.py): each stream's "
                      "last gap apart; a long gap (over 1.1x the median) is transient where the next is short (the "
                      "way to the client), held back where its stream's chunk carried two tokens (text not yet "
                      "whole), else a late step", "",
                  "| backend | run | streams | gap p50 ms | p99 | p99 without the last | last gap p50 "
                  "| long: transient | held back | late step | streams with a held-back token |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['backend']} | {r['kind']} | {g['streams']} | {fmt(g['gap_ms_p50'], 3)} | "
                  f"{fmt(g['gap_ms_p99'], 3)} | {fmt(g['gap_ms_p99_without_last'], 3)} | "
                  f"{fmt(g['last_gap_ms_p50'], 3)} | {g['long_transient']} | {g['long_held_back']} | "
                  f"{g['long_late_step']} | {g['streams_with_held_back_tokens']} |"
                  for r in gapped for g in (r["gaps"],)]
    looped = [r for r in doc["records"] if r.get("loop_iterations")]
    if looped:
        lines += ["", "The engine loop, from each server's /metrics over each loadtest (its warm-up included): the "
                      "host's time per iteration (not blocked on the device), and the GPU's idle time between "
                      "consecutive steps and each step's own time on it (CUDA events; – without a GPU; steps over "
                      "5 ms counted), the SLA budget gone before admission's "
                      "verdict (from arrival: the front end and the forecast; of it, arrival to the engine's receipt, "
                      "the client's own send within that (its x-request-start to the server's first sight), "
                      "and the forecast's own time), and how long a delta of tokens waited "
                      "from the engine's publishing it to the front end's event loop reading it (of it the hop: "
                      "the engine's send to the front end's reader), and the front end's "
                      "event loop's own lateness (a 5 ms sleep's late wake-up; the longest in ms)", "",
                  "| backend | run | iterations | host time per iteration p50 µs | p99 µs | GPU idle between steps "
                  "p50 µs | p99 µs | GPU step p50 µs | p99 µs | steps over 5 ms | arrival to verdict p50 µs | p99 µs "
                  "| arrival to engine p50 µs | of it the client's send p50 µs | forecast p50 µs "
                  "| token delivery p50 µs | p99 µs | of it the hop p50 µs | p99 µs "
                  "| front-end loop lag p99 µs | max ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['backend']} | {r['kind']} | {r['loop_iterations']} | {fmt(r['host_us_p50'])} | "
                  f"{fmt(r['host_us_p99'])} | {fmt(r['gpu_idle_us_p50'])} | {fmt(r['gpu_idle_us_p99'])} | "
                  f"{fmt(r.get('step_gpu_us_p50'))} | {fmt(r.get('step_gpu_us_p99'))} | "
                  f"{fmt(r.get('slow_gpu_steps'))} | "
                  f"{fmt(r.get('verdict_us_p50'))} | {fmt(r.get('verdict_us_p99'))} | "
                  f"{fmt(r.get('received_us_p50'))} | {fmt(r.get('transit_us_p50'))} | "
                  f"{fmt(r.get('forecast_us_p50'))} | "
                  f"{fmt(r.get('delivery_us_p50'))} | {fmt(r.get('delivery_us_p99'))} | "
                  f"{fmt(r.get('hop_us_p50'))} | {fmt(r.get('hop_us_p99'))} | "
                  f"{fmt(r.get('front_lag_us_p99'))} | {fmt(r.get('front_lag_ms_max'))} |"
                  for r in looped]
    gapped = [r for r in looped if r.get("idle_gaps")]
    if gapped:
        lines += ["", "The GPU's idle gaps over 100 µs between consecutive steps and the engine thread's phases they "
                      "overlapped (a gap is the end of the host's path to the step: service/engine/host_path.py): "
                      "gaps counted by the phase each overlapped most, and the idle ms each phase overlapped", "",
                  "| backend | run | gaps | idle ms | by phase: gaps (idle ms) |", "|---|---|---|---|---|"]
        for r in gapped:
            by = r["idle_gaps"]
            lines.append(f"| {r['backend']} | {r['kind']} | {sum(n for n, _ in by.values())} | "
                         f"{fmt(sum(ms for _, ms in by.values()), 1)} | "
                         + ", ".join(f"{k} {n} ({ms:.1f})" for k, (n, ms) in by.items()) + " |")
    paired = [r for r in doc["records"] if "capacity_rps" in r]
    if paired:
        lines += ["", "Goodput beside capacity: the highest rate with 99% of all requests on time, with admission on "
                      "and with it off (`--no-admission`, the same arrivals judged by the client against 100 ms). "
                      "Above 1 where admission refuses the few requests that, served, would come late: with it off "
                      "they count against the rate",
                  "", "| backend | goodput req/s | capacity req/s (admission off) | goodput / capacity | admitted on "
                      "time, worst rate |", "|---|---|---|---|---|"]
        lines += [f"| {r['backend']} | {fmt(r.get('goodput_rps'))} | {fmt(r['capacity_rps'])} | "
                  f"{fmt(r.get('goodput_over_capacity'), 3)} | {fmt(r.get('admitted_on_time_min'), 3)} |"
                  for r in paired]
        for r in paired:
            lines += ["", f"Rate by rate, {r['backend']}: admission on (admitted share, on time of admitted, of all) "
                          "and off (on time of all); TTF64 p99 of what was served", "",
                      "| rate /s | admitted | on time (admitted) | on time (all) | TTF64 p99 ms | off: on time (all) | "
                      "off: TTF64 p99 ms |", "|---|---|---|---|---|---|---|"]
            on = {p["rate"]: p for p in r["sweep"]}
            cap = next(c for c in doc["records"] if c["backend"] == r["backend"] and c["kind"] == "capacity-32")
            off = {p["rate"]: p for p in cap["sweep"]}
            for rate in sorted(set(on) | set(off), key=lambda x: x or 0):
                a, b = on.get(rate, {}), off.get(rate, {})
                admitted = None if a.get("rejection_rate") is None else 1 - a["rejection_rate"]
                lines.append(f"| {fmt(rate)} | {fmt(admitted, 3)} | {fmt(a.get('sla_attainment'), 3)} | "
                             f"{fmt(a.get('sla_attainment_all'), 3)} | {fmt(a.get('ttf64_ms_p99'))} | "
                             f"{fmt(b.get('sla_attainment_all'), 3)} | {fmt(b.get('ttf64_ms_p99'))} |")
    for r in (r for r in doc["records"] if r.get("sweep")):
        lines += ["", f"Sweep, {r['backend']} {r['kind']}: rate → SLA attainment of admitted (of all), rejection "
                      "rate, TTF64 p99, cost, the client's event-loop lag p99; the server's engine loop over the rate "
                      "alone (its /metrics before and after it; the first rate with the warm-up): the host's time "
                      "per iteration and the GPU's idle time between steps",
                  "", "| rate /s | requests | attainment admitted | attainment all | rejected | TTF64 p99 ms | "
                      "USD / 1M tok | client lag p99 ms | host p50 µs | host p99 µs | GPU idle p99 µs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {fmt(p['rate'])} | {p.get('requests', '–')} | {fmt(p['sla_attainment'], 3)} | "
                  f"{fmt(p['sla_attainment_all'], 3)} | {fmt(p['rejection_rate'], 3)} | {fmt(p['ttf64_ms_p99'])} | "
                  f"{fmt(p.get('usd_per_1m_tokens'), 3)} | {fmt(p.get('client_lag_ms_p99'))} | "
                  f"{fmt(p.get('host_us_p50'))} | {fmt(p.get('host_us_p99'))} | {fmt(p.get('gpu_idle_us_p99'))} |"
                  for p in r["sweep"]]
    lines += admission_trace.markdown(doc.get("admission", {}))
    lines += slow_log.section(doc.get("slow_iterations", {}))
    if doc["servers"]:
        startup = doc.get("startup_s", {})
        lines += ["", "Servers (seconds from start to /health 200): " + "; ".join(
            f"{label}: `parley serve {' '.join(flags)}` ({fmt(startup.get(label))} s)"
            for label, flags in doc["servers"].items())]
    if doc["targets"]:
        lines += ["", "Targets:", "", "| target | backend | measured | met |", "|---|---|---|---|"]
        lines += [f"| {t['figure']} {t['target']} | {t['backend']} | {fmt(t['measured'])} | "
                  f"{'–' if t['met'] is None else 'yes' if t['met'] else 'no'} |" for t in doc["targets"]]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """TTF64 p99 and p50 against the arrival rate, one line per swept server."""
    sweeps = [r for r in doc["records"] if r.get("sweep")]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = False
    for r in sweeps:
        points = [p for p in r["sweep"] if p["ttf64_ms_p99"] is not None]  # a rate where nothing was served: none
        rates = [p["rate"] for p in points]
        name = r["backend"] + (" (admission off)" if r["kind"] == "capacity-32" else "")
        ax.plot(rates, [p["ttf64_ms_p99"] for p in points], marker="o", label=f"{name} TTF64 p99")
        ax.plot(rates, [p["ttf64_ms_p50"] for p in points], marker=".", linestyle=":", label=f"{name} TTF64 p50")
        plotted = plotted or bool(points)
    ax.axhline(100, color="red", linestyle="--", label="SLA 100 ms")
    ax.set(xscale="log" if plotted else "linear", xlabel="arrival rate (requests/s)",
           ylabel="ms (admitted requests)", title="Time to the 64th token against load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(raw: Path, out: Path, name: str = "e2e") -> list[Path]:
    """<out>/<name>-<device>.{json,md} and, where a sweep ran, .png; the paths."""
    doc = build(raw)
    draw = (lambda path: plot(doc, path)) if any(r.get("sweep") for r in doc["records"]) else None
    return publish(out, file_stem(name, doc["device"]), doc, markdown(doc), draw)
