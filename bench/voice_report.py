"""The voice report: fold a raw folder of `python -m bench voice` into <out>/<name>-<device>.{json,md,png}.

    python -m bench voice --report-only [--raw bench/results/raw/voice] [--out bench/results]

The raw folder holds parley-loadtest JSON files as bench/runs.py names them: session-<endpoint>.json (voice
sessions one at a time), fresh-<tokens>.json (fresh prompts, one at a time), sweep-<endpoint>.json (voice sessions
arriving as a Poisson process, at several rates), capacity-<endpoint>.json (the same arrivals at some of those rates,
the server with admission off), and device.json (bench/device.py, written on the GPU host).
The JSON: {device, torch, triton, model, sla_tokens, sla_ms, records: [one per (endpoint, turn) of the single
sessions and one per fresh prompt length], sweep: [one per (endpoint, rate)], capacity: [the same, admission off],
targets: [...]}. Each sweep row's `on_time_share`: the replies admitted and on time, of all replies (admission off:
those on time by the client's clock, of all): what admission keeps of what the GPU can serve is the one over the
other at a rate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import loop_metrics, slow_log
from bench.device import file_stem
from bench.publish import publish, pyplot
from loadtest.record import RequestRecord
from loadtest.stats import by_turn, conversation_figures

TTFT_TARGET_MS = 15.0  # each turn prefills only its new tokens (bench targets, issue 13)
CANCEL_TARGET_MS = 2.0
ATTAINMENT_TARGET = 0.99
# Many sessions (issue 21): at the sweep's highest rate (16 sessions/s), this share of turns admitted; a fresh
# prompt of FRESH_TARGET_TOKENS admitted and on time on an idle server.
ADMITTED_TARGET = 0.95
FRESH_TARGET_TOKENS = 2000
KEPT_TARGET = 0.9  # admission admits what fits (issue 36): replies on time with it, over those with it off


def _records(run: dict[str, Any]) -> list[RequestRecord]:
    return [RequestRecord(**r) for r in run["requests"]]


def _runs(raw: Path, kind: str) -> list[tuple[str, dict[str, Any]]]:
    """(what follows `kind-` in the file name, the loadtest document) for each RAW/kind-*.json."""
    return [(path.stem.split("-", 1)[1], json.loads(path.read_text())) for path in sorted(raw.glob(f"{kind}-*.json"))]


def build(raw: Path) -> dict[str, Any]:
    info = json.loads((raw / "device.json").read_text())
    docs = [doc for kind in ("session", "fresh", "sweep") for _, doc in _runs(raw, kind)]
    if not docs:
        raise SystemExit(f"no session-*, fresh-* or sweep-*.json in {raw}")
    cfg = docs[0]["config"]
    n = cfg["sla_tokens"]
    records: list[dict[str, Any]] = []
    for endpoint, doc in _runs(raw, "session"):
        records += [{"run": "session", "endpoint": endpoint, **row}
                    for row in by_turn(_records(doc["runs"][0]), n)]
    for length, doc in sorted(_runs(raw, "fresh"), key=lambda x: int(x[0])):
        records.append({"run": "fresh", "endpoint": doc["config"]["endpoint"], "turn": 1,
                        "fresh_prompt_len": int(length), **conversation_figures(_records(doc["runs"][0]), n)})
    sweep, capacity = _swept(raw, "sweep", n), _swept(raw, "capacity", n)
    plan = raw / "plan.json"  # the server's flags (absent where the server was measured at --url only)
    planned: dict[str, Any] = json.loads(plan.read_text()) if plan.exists() else {"url": "?"}
    serve = None if planned.get("url") else planned["servers"][0]["serve"]
    startup = raw / "startup.json"  # seconds from the server's start to /health 200
    startup_s = next(iter(json.loads(startup.read_text()).values()), None) if startup.exists() else None
    labels = [s["label"] for s in planned.get("servers", [])]
    out = {**info, "model": cfg["model"], "serve": serve, "startup_s": startup_s, "sla_tokens": n,
           "sla_ms": cfg["sla_ms"], "records": records, "sweep": sweep, "capacity": capacity,
           "slow_iterations": slow_log.of_servers(raw, labels)}
    return out | {"capacity_rate": capacity_rates(out), "targets": targets(out)}


def _swept(raw: Path, kind: str, n: int) -> list[dict[str, Any]]:
    """One row per (endpoint, rate) of RAW/kind-<endpoint>.json, with its on-time share of all replies."""
    rows = []
    for endpoint, doc in _runs(raw, kind):
        for run in sorted(doc["runs"], key=lambda r: r["rate"]):
            recs = _records(run)
            figures = conversation_figures(recs, n)
            replies = [r for r in recs if r.kind != "preemptive"]
            # the server's engine loop over this rate alone (parley-loadtest's /metrics snapshots around it)
            loop = loop_metrics.at_rate(raw, f"{kind}-{endpoint}", run)
            rows.append({"endpoint": endpoint, "rate": run["rate"], "sessions": len({r.session for r in recs}),
                         "think_s": doc["config"]["think_s"],
                         "after_refusal": doc["config"].get("after_refusal", "hang-up"), **figures,
                         "on_time_share": sum(r.sla_met for r in replies) / len(replies) if replies else None,
                         "host_us_p99": loop.get("host_us_p99"), "gpu_idle_us_p99": loop.get("gpu_idle_us_p99")})
    return rows


def capacity_rates(doc: dict[str, Any]) -> dict[str, float | None]:
    """Per endpoint, the highest rate at which the server with admission off served at least ATTAINMENT_TARGET of
    the replies on time (None: at none of the rates measured): the capacity admission's share is to be read against."""
    out: dict[str, float | None] = {}
    for r in sorted(doc.get("capacity", []), key=lambda r: r["rate"]):
        out.setdefault(r["endpoint"], None)
        if r["on_time_share"] is not None and r["on_time_share"] >= ATTAINMENT_TARGET:
            out[r["endpoint"]] = r["rate"]
    return out


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what was measured and whether it holds (None: nothing measured)."""
    n, sla_ms = doc["sla_tokens"], doc["sla_ms"]
    turns = [r for r in doc["records"] if r["run"] == "session"]

    def worst(rows: list[dict[str, Any]], key: str, low: bool = False) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return (min(values) if low else max(values)) if values else None

    def row(target: str, measured: float | None, ok: bool | None) -> dict[str, Any]:
        return {"target": target, "measured": measured, "met": None if measured is None else ok}

    admitted, ttft, ttfn = worst(turns, "admitted_share", True), worst(turns, "ttft_ms_p99"), \
        worst(turns, f"ttf{n}_ms_p99")
    attainment = worst(doc["sweep"], "sla_attainment_admitted", True)
    cancel = worst([r for r in turns + doc["sweep"] if r["endpoint"] == "realtime"], "cancel_ms_p99")
    top = max((r["rate"] for r in doc["sweep"]), default=None)
    at_top = [r for r in doc["sweep"] if r["rate"] == top]
    top_admitted, top_attainment = worst(at_top, "admitted_share", True), worst(at_top, "sla_attainment_admitted",
                                                                               True)
    fresh = next((r for r in doc["records"] if r.get("fresh_prompt_len") == FRESH_TARGET_TOKENS), None)
    fresh_on_time = None if fresh is None or fresh["admitted_share"] is None else \
        fresh["admitted_share"] * (fresh["sla_attainment_admitted"] or 0.0)
    rate = "–" if top is None else f"{top:g}"
    kept = kept_of_capacity(doc)
    worst_kept = min(kept, key=lambda k: k["kept"], default=None)
    kept_rows = [] if worst_kept is None else [
        row(f"capacity: replies on time with admission on >= {KEPT_TARGET:g} x with it off, at each rate measured "
            f"both ways (worst: {worst_kept['endpoint']} at {worst_kept['rate']:g}/s)", worst_kept["kept"],
            worst_kept["kept"] >= KEPT_TARGET)]
    return [
        row("single session: every turn admitted (lowest admitted share of a turn)", admitted,
            admitted is not None and admitted >= 1.0),
        row(f"single session: TTFT p99 <= {TTFT_TARGET_MS:g} ms at every turn (worst turn)", ttft,
            ttft is not None and ttft <= TTFT_TARGET_MS),
        row(f"single session: TTF{n} p99 <= {sla_ms:g} ms at every turn (worst turn)", ttfn,
            ttfn is not None and ttfn <= sla_ms),
        row(f"sweep: SLA attainment of admitted >= {ATTAINMENT_TARGET:g} at every rate (worst rate)", attainment,
            attainment is not None and attainment >= ATTAINMENT_TARGET),
        row(f"realtime: cancel -> done p99 <= {CANCEL_TARGET_MS:g} ms (worst)", cancel,
            cancel is not None and cancel <= CANCEL_TARGET_MS),
        row(f"sweep at {rate} sessions/s: >= {ADMITTED_TARGET:.0%} of turns admitted (worst endpoint)",
            top_admitted, top_admitted is not None and top_admitted >= ADMITTED_TARGET),
        row(f"sweep at {rate} sessions/s: SLA attainment of admitted >= {ATTAINMENT_TARGET:g} (worst endpoint)",
            top_attainment, top_attainment is not None and top_attainment >= ATTAINMENT_TARGET),
        row(f"fresh {FRESH_TARGET_TOKENS}-token prompt, idle server: every one admitted and on time (share)",
            fresh_on_time, fresh_on_time is not None and fresh_on_time >= 1.0),
        *kept_rows,
    ]


def kept_of_capacity(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (endpoint, rate) measured both ways, where the sessions fell back at a refusal (both servers asked for the
    same turns): the replies on time with admission on over those with it off."""
    on = {(r["endpoint"], r["rate"]): r for r in doc["sweep"] if r.get("after_refusal") == "fall-back"}
    out = []
    for off in doc.get("capacity", []):
        r = on.get((off["endpoint"], off["rate"]))
        if r is not None and off.get("after_refusal") == "fall-back" and off["on_time_share"]:
            out.append({"endpoint": r["endpoint"], "rate": r["rate"],
                        "kept": r["on_time_share"] * r["requests"] / (off["on_time_share"] * off["requests"])})
    return out


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _count(row: dict[str, Any]) -> str:
    """A sweep row's replies on time: how many, and their share of all its replies."""
    share = row["on_time_share"]
    return "–" if share is None else f"{round(share * row['requests'])} ({_pct(share)})"


def markdown(doc: dict[str, Any]) -> str:
    n = doc["sla_tokens"]
    lines = [
        f"# Voice benchmark: `parley serve` on {doc['device']}",
        "",
        f"torch {doc.get('torch', '?')}, Triton {doc.get('triton', '?')}, Parley {doc.get('parley') or '?'}. "
        + (f"`parley serve {' '.join(doc['serve'])}` (healthy {_f(doc.get('startup_s'))} s after its start). "
           if doc.get("serve") else "") +
        f"Model `{doc['model']}`. SLA: {n} tokens "
        f"within {doc['sla_ms']:g} ms. Measured by `parley-loadtest --scenario voice` on the same host: sessions of "
        "a system prompt and turns of user messages, barge-in (the history keeps what was heard) and preemptive "
        "starts on partial transcripts; HTTP chat resends the whole conversation every turn, the realtime "
        "WebSocket sends only the new message. TTFT over every admitted reply, TTF over the replies not barged in; "
        "`early` = preemptive starts (admitted share). Times in ms.",
        "",
        "## One session at a time, by turn",
        "",
        f"| endpoint | turn | replies | prompt tok | cached tok | TTFT p50 | TTFT p99 | TTF{n} p50 | TTF{n} p99 | "
        "admitted | SLA att. (admitted) | barged | early (admitted) | cancel→done p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in doc["records"] if r["run"] == "session"):
        lines.append(
            f"| {r['endpoint']} | {r['turn']} | {r['requests']} | {_f(r['prompt_tokens'], 0)} | "
            f"{_f(r['cached_tokens'], 0)} | {_f(r['ttft_ms_p50'])} | {_f(r['ttft_ms_p99'])} | "
            f"{_f(r[f'ttf{n}_ms_p50'])} | {_f(r[f'ttf{n}_ms_p99'])} | {_pct(r['admitted_share'])} | "
            f"{_f(r['sla_attainment_admitted'], 3)} | {r['barge_ins']} | {r['preemptive']} "
            f"({_pct(r['preemptive_admitted_share'])}) | {_f(r['cancel_ms_p99'], 2)} |")
    lines += ["", "## Fresh prompts, one at a time", "",
              f"| prompt tok | requests | TTFT p50 | TTFT p99 | TTF{n} p50 | TTF{n} p99 | admitted | "
              "SLA att. (admitted) |", "|---|---|---|---|---|---|---|---|"]
    for r in (r for r in doc["records"] if r["run"] == "fresh"):
        lines.append(f"| {r['fresh_prompt_len']} | {r['requests']} | {_f(r['ttft_ms_p50'])} | "
                     f"{_f(r['ttft_ms_p99'])} | {_f(r[f'ttf{n}_ms_p50'])} | {_f(r[f'ttf{n}_ms_p99'])} | "
                     f"{_pct(r['admitted_share'])} | {_f(r['sla_attainment_admitted'], 3)} |")
    lines += ["", "## Poisson arrivals of sessions", "",
              "The server's engine loop at each rate (its /metrics just before and after the rate; the first rate's "
              "with the warm-up): the host's time per iteration, and the GPU's idle time between steps (– on a CPU).",
              "",
              f"| endpoint | sessions/s | sessions | replies | admitted | SLA att. (admitted) | TTFT p99 | "
              f"TTF{n} p99 | cached share | early (admitted) | host p99 µs | GPU idle p99 µs |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["sweep"]:
        lines.append(f"| {r['endpoint']} | {_f(r['rate'], 2)} | {r['sessions']} | {r['requests']} | "
                     f"{_pct(r['admitted_share'])} | {_f(r['sla_attainment_admitted'], 3)} | "
                     f"{_f(r['ttft_ms_p99'])} | {_f(r[f'ttf{n}_ms_p99'])} | {_pct(r['cached_share'])} | "
                     f"{r['preemptive']} ({_pct(r['preemptive_admitted_share'])}) | {_f(r.get('host_us_p99'))} | "
                     f"{_f(r.get('gpu_idle_us_p99'))} |")
    if doc.get("capacity"):
        lines += ["", "## Capacity: the same arrivals, admission off", "",
                  "The server again with `--no-admission` (it admits every turn), the sweep's sessions at some of its "
                  "rates, judged by the client against the same SLA. " + (
                      "A session goes on past a refused turn (an agent's fallback LLM answers it), so both servers are "
                      "asked for the same turns. "
                      if all(r["after_refusal"] == "fall-back" for r in doc["sweep"]) else
                      "A session ends at its first refused turn (the caller hangs up), so with admission on fewer "
                      "replies are asked for: compare the replies on time. ") +
                  f"Capacity: the highest rate with >= {ATTAINMENT_TARGET:g} of replies on time, admission off.", "",
                  f"| endpoint | sessions/s | off: replies | off: on time | off: TTF{n} p99 | on: replies | "
                  "on: admitted | on: on time |", "|---|---|---|---|---|---|---|---|"]
        on = {(r["endpoint"], r["rate"]): r for r in doc["sweep"]}
        for r in doc["capacity"]:
            k = on.get((r["endpoint"], r["rate"]))
            lines.append(f"| {r['endpoint']} | {_f(r['rate'], 2)} | {r['requests']} | {_count(r)} | "
                         f"{_f(r[f'ttf{n}_ms_p99'])} | {'–' if k is None else k['requests']} | "
                         f"{'–' if k is None else _pct(k['admitted_share'])} | {'–' if k is None else _count(k)} |")
        lines += [""] + [f"Capacity, {ep}: " + ("below the lowest rate measured." if rate is None else
                                                 f"{rate:g} sessions/s.") for ep, rate in doc["capacity_rate"].items()]
    lines += slow_log.section(doc.get("slow_iterations", {}))
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {_f(t['measured'], 3)} | {'–' if t['met'] is None else 'yes' if t['met'] else 'no'} |"
              for t in doc["targets"]]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """By turn: TTFT and TTF-N p99 per endpoint; fresh prompts: p50 against length; the sweep: SLA attainment of
    admitted replies and the admitted share against the rate."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    n, sla_ms = doc["sla_tokens"], doc["sla_ms"]
    fig, (by_turn_ax, fresh_ax, sweep_ax) = plt.subplots(1, 3, figsize=(16, 4.5))
    sessions = [r for r in doc["records"] if r["run"] == "session"]
    for endpoint in sorted({r["endpoint"] for r in sessions}):
        rows = [r for r in sessions if r["endpoint"] == endpoint]
        turns = [r["turn"] for r in rows]
        by_turn_ax.plot(turns, [r["ttft_ms_p99"] for r in rows], marker="o", label=f"{endpoint} TTFT p99")
        by_turn_ax.plot(turns, [r[f"ttf{n}_ms_p99"] for r in rows], marker="s", label=f"{endpoint} TTF{n} p99")
    by_turn_ax.axhline(sla_ms, color="red", linestyle="--", label=f"SLA {sla_ms:g} ms")
    by_turn_ax.axhline(TTFT_TARGET_MS, color="gray", linestyle=":", label=f"TTFT target {TTFT_TARGET_MS:g} ms")
    by_turn_ax.set(xlabel="turn", ylabel="ms", title="One session at a time", ylim=(0, None))
    by_turn_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_turn_ax.legend(fontsize=7)
    fresh = [r for r in doc["records"] if r["run"] == "fresh"]
    lengths = [r["fresh_prompt_len"] for r in fresh]
    fresh_ax.plot(lengths, [r["ttft_ms_p50"] for r in fresh], marker="o", label="TTFT p50")
    fresh_ax.plot(lengths, [r[f"ttf{n}_ms_p50"] for r in fresh], marker="s", label=f"TTF{n} p50")
    fresh_ax.axhline(sla_ms, color="red", linestyle="--")
    fresh_ax.set(xscale="log", xlabel="prompt tokens (admitted share)", ylabel="ms (admitted requests)",
                 title="Fresh prompts", ylim=(0, None))
    fresh_ax.set_xticks(lengths, [f"{r['fresh_prompt_len']}\n({_pct(r['admitted_share'])})" for r in fresh])
    fresh_ax.minorticks_off()
    fresh_ax.legend(fontsize=7)
    for endpoint in sorted({r["endpoint"] for r in doc["sweep"]}):
        rows = [r for r in doc["sweep"] if r["endpoint"] == endpoint]
        rates = [r["rate"] for r in rows]
        sweep_ax.plot(rates, [r["sla_attainment_admitted"] for r in rows], marker="o",
                      label=f"{endpoint} SLA attainment, admitted")
        sweep_ax.plot(rates, [r["admitted_share"] for r in rows], marker="x", linestyle=":",
                      label=f"{endpoint} admitted share")
    sweep_ax.axhline(ATTAINMENT_TARGET, color="red", linestyle="--")
    sweep_ax.set(xlabel="session arrivals per second", ylabel="share of replies", title="Poisson arrivals",
                 ylim=(0, 1.05))
    sweep_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(raw: Path, out: Path, name: str = "voice") -> list[Path]:
    """<out>/<name>-<device>.{json,md,png}; the paths."""
    doc = build(raw)
    return publish(out, file_stem(name, doc["device"]), doc, markdown(doc), lambda path: plot(doc, path))
