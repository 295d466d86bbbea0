"""The report of `python -m bench router`: the merged phases as <out>/router-<device>-x<N>.{json,md}, with
`goodput_ratio` at the top of the JSON and the issue's targets checked.

    python -m bench router --report-only [--out bench/results]     # rewrite the Markdown of every router-*.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.publish import publish

GOODPUT_RATIO_TARGET = 1.9
CACHED_TARGET = 0.90
ON_TIME_TARGET = 0.99
ROUTER_OUT_TARGET_S = 5.0  # "within seconds": two failed health checks 2 s apart, or the circuit breaker at once


def _met(measured: float | None, ok: bool) -> bool | None:
    return None if measured is None else ok


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with what was measured and whether it holds (None: not measured)."""
    phases = doc.get("phases", {})
    rows: list[dict[str, Any]] = []

    def row(target: str, measured: Any, ok: bool | None) -> None:
        rows.append({"target": target, "measured": measured, "met": ok})

    ratio = phases.get("goodput", {}).get("goodput_ratio")
    row(f"goodput through the router >= {GOODPUT_RATIO_TARGET:g}x one replica's", ratio,
        _met(ratio, ratio is not None and ratio >= GOODPUT_RATIO_TARGET))
    for r in phases.get("voice", {}).get("rates", []):
        cached = r.get("cached_share_metrics")
        row(f"voice at {r['rate']:g} sessions/s: >= {CACHED_TARGET:.0%} of prompt tokens from the cache (replicas' "
            "/metrics)", cached, _met(cached, cached is not None and cached >= CACHED_TARGET))
        on_time = r.get("sla_attainment_admitted")
        row(f"voice at {r['rate']:g} sessions/s: >= {ON_TIME_TARGET:.0%} of admitted turns on time", on_time,
            _met(on_time, on_time is not None and on_time >= ON_TIME_TARGET))
    f = phases.get("failover")
    if f:
        out_s = f.get("router_marked_down_s")
        row(f"failover: the router takes the killed replica out within {ROUTER_OUT_TARGET_S:g} s", out_s,
            _met(out_s, out_s is not None and out_s <= ROUTER_OUT_TARGET_S))
        row("failover: requests sent after the kill that failed", f["failed_sent_after_kill"],
            f["failed_sent_after_kill"] == 0)
        row("failover: requests that hung (ended by the client's timeout)", f["hung"], f["hung"] == 0)
        alone = f["survivor_alone"]["sla_attainment"]
        row(f"failover: the survivor alone keeps its promise (>= {ON_TIME_TARGET:.0%} of admitted on time)", alone,
            _met(alone, alone is not None and alone >= ON_TIME_TARGET))
        back = f["victim_completed_after_restart"]
        row("failover: traffic returns to the restarted replica (requests it served)", back, back > 0)
    return rows


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def markdown(doc: dict[str, Any]) -> str:
    phases = doc.get("phases", {})
    n = doc.get("replicas")
    where = f"{doc.get('device')} ×{n}" if doc.get("gpus") else "the CPU"
    lines = [f"# {n} Parley replicas behind vllm-router on {where}", "",
             f"torch {doc.get('torch')}, Triton {doc.get('triton')}, Parley {doc.get('parley') or '?'}, "
             f"vllm-router {next((p.get('router_version') for p in phases.values()), '?')}. "
             + ("One replica per GPU (`CUDA_VISIBLE_DEVICES`)" if doc.get("gpus") else "The replicas on the CPU")
             + ", started by `python -m bench router` without Docker; the router runs with the "
             "flags docker-compose.yml gives it (`deploy/render_compose.py`), measured by parley-loadtest on the "
             "same host. SLA: 64 tokens within 100 ms.", ""]
    g = phases.get("goodput")
    if g:
        lines += ["## Goodput (Poisson arrivals, 32-token prompts, 64-token replies, >= 99% of all requests on "
                  "time)", "", f"**goodput_ratio = {_f(g.get('goodput_ratio'), 2)}** (target >= "
                  f"{GOODPUT_RATIO_TARGET:g})", "",
                  "| measured | goodput req/s | TTF64 p99 ms at it | admitted on time | USD / 1M tok | completed by "
                  "replica (sweep) |", "|---|---|---|---|---|---|"]
        for key, label in (("single", "one replica, directly"), ("router", f"{n} replicas through the router")):
            r = g[key]
            spread = " / ".join(_f(x.get("completed"), 0) for x in r.get("replicas", []))
            lines.append(f"| {label} | {_f(r['goodput_rps'])} | {_f(r['ttf64_ms_p99'])} | "
                         f"{_f(r['sla_attainment'], 3)} | {_f(r['usd_per_1m_tokens'], 3)} | {spread} |")
        for key in ("single", "router"):
            lines += ["", f"Sweep, {key}: rate → requests, on time of admitted (of all), rejected, TTF64 p99", "",
                      "| rate /s | requests | on time (admitted) | on time (all) | rejected | TTF64 p99 ms |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {_f(p['rate'])} | {p['requests']} | {_f(p['sla_attainment'], 3)} | "
                      f"{_f(p['sla_attainment_all'], 3)} | {_f(p['rejection_rate'], 3)} | {_f(p['ttf64_ms_p99'])} |"
                      for p in g[key]["sweep"]]
        lines.append("")
    v = phases.get("voice")
    if v:
        more = f", with `{v['voice_args']}`" if v.get("voice_args") else ""
        lines += ["## Voice sessions through the router (HTTP chat, `--scenario voice`: one agent's 1,500-token "
                  f"system prompt, 8 turns, barge-in and preemptive starts{more}; {_f(v['voice_s'], 0)} s of arrivals "
                  "per rate; cached = prompt tokens served from a replica's cache)", "",
                  "| sessions/s | sessions | replies | admitted | on time (admitted) | TTFT p99 | TTF64 p99 | cached "
                  "(/metrics) | cached (usage) | completed by replica |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in v["rates"]:
            spread = " / ".join(_f(x.get("completed"), 0) for x in r["replicas"])
            lines.append(f"| {_f(r['rate'], 0)} | {r['sessions']} | {r['requests']} | {_pct(r['admitted_share'])} | "
                         f"{_f(r['sla_attainment_admitted'], 3)} | {_f(r['ttft_ms_p99'])} | {_f(r['ttf64_ms_p99'])} "
                         f"| {_pct(r['cached_share_metrics'])} | {_pct(r['cached_share'])} | {spread} |")
        lines.append("")
    f = phases.get("failover")
    if f:
        m = f["marks_s"]
        lines += [f"## A replica killed under load (Poisson, {_f(f['rate'])} req/s through the router)", "",
                  f"Replica {f['victim']} was SIGKILLed {_f(m.get('kill'))} s into the load and restarted "
                  f"{_f(m['restart'] - m['kill']) if 'restart' in m else '–'} s later on the same port.", "",
                  "| figure | value |", "|---|---|",
                  f"| requests / failed / of them in flight at the kill / sent after the kill | {f['requests']} / "
                  f"{f['failed']} / {f['failed_in_flight_at_kill']} / {f['failed_sent_after_kill']} |",
                  f"| hung (ended by the {_f(f['timeout_s'], 0)} s timeout); longest request s | {f['hung']}; "
                  f"{_f(f['longest_request_s'])} |",
                  f"| kill → router marks it down (health or circuit breaker), s | {_f(f['router_marked_down_s'])} |",
                  f"| kill → the router's last request to it, s | {_f(f['last_sent_to_victim_s'])} |",
                  f"| kill → the last failure a client saw, s | {_f(f['last_client_failure_s'])} |",
                  f"| survivor alone: requests, rejected, on time of admitted, TTF64 p99 ms | "
                  f"{f['survivor_alone']['requests']}, {f['survivor_alone']['rejected']}, "
                  f"{_f(f['survivor_alone']['sla_attainment'], 3)}, {_f(f['survivor_alone']['ttf64_ms_p99'])} |",
                  f"| restart → healthy, s | {_f(f['restart_healthy_s'])} |",
                  f"| healthy → the router's health 1, s; → its first request served, s | {_f(f['router_back_s'])}; "
                  f"{_f(f['traffic_back_s'])} |",
                  f"| requests the restarted replica served | {_f(f['victim_completed_after_restart'], 0)} |", ""]
    lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {_f(t['measured'], 3)} | {'–' if t['met'] is None else 'yes' if t['met'] else 'no'} |"
              for t in doc.get("targets", [])]
    serves = {" ".join(p["serve"]) for p in phases.values() if p.get("serve")}
    if serves:
        lines += ["", "Replicas: " + "; ".join(f"`parley serve {s}`" for s in sorted(serves))]
    command = next((p.get("router_command") for p in phases.values() if p.get("router_command")), None)
    if command:
        lines += ["", f"Router: `{' '.join(command)}`"]
    return "\n".join(lines) + "\n"


def write(doc: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """<out>/<stem>.{json,md}, with goodput_ratio and the targets recomputed from the phases; the paths."""
    doc["goodput_ratio"] = doc.get("phases", {}).get("goodput", {}).get("goodput_ratio")
    doc["targets"] = targets(doc)
    return publish(out, stem, doc, markdown(doc))
