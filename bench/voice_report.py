"""Fold the runs of bench/voice_gpu.sh into <out>/voice-<device>.{json,md,png}: the voice benchmark.

    python bench/voice_report.py RAW_DIR [--out bench/results]

RAW_DIR holds parley-loadtest JSON files as voice_gpu.sh names them: session-<endpoint>.json (voice sessions one
at a time), fresh-<tokens>.json (fresh prompts, one at a time), sweep-<endpoint>.json (voice sessions arriving as
a Poisson process, at several rates), and device.json ({"device", "torch", "triton"}, written on the GPU host).
The JSON: {device, torch, triton, model, sla_tokens, sla_ms, records: [one per (endpoint, turn) of the single
sessions and one per fresh prompt length], sweep: [one per (endpoint, rate)], targets: [...]}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # loadtest, run as a script from anywhere

from loadtest.record import RequestRecord  # noqa: E402
from loadtest.stats import by_turn, conversation_figures  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TTFT_TARGET_MS = 15.0  # each turn prefills only its new tokens (bench targets, issue 13)
CANCEL_TARGET_MS = 2.0
ATTAINMENT_TARGET = 0.99


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
    sweep = []
    for endpoint, doc in _runs(raw, "sweep"):
        for run in sorted(doc["runs"], key=lambda r: r["rate"]):
            recs = _records(run)
            sweep.append({"endpoint": endpoint, "rate": run["rate"], "sessions": len({r.session for r in recs}),
                          "think_s": doc["config"]["think_s"], **conversation_figures(recs, n)})
    out = {**info, "model": cfg["model"], "sla_tokens": n, "sla_ms": cfg["sla_ms"], "records": records,
           "sweep": sweep}
    return out | {"targets": targets(out)}


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
    ]


def _f(x: Any, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def markdown(doc: dict[str, Any]) -> str:
    n = doc["sla_tokens"]
    lines = [
        f"# Voice benchmark: `parley serve` on {doc['device']}",
        "",
        f"torch {doc.get('torch', '?')}, Triton {doc.get('triton', '?')}. Model `{doc['model']}`. SLA: {n} tokens "
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
              f"| endpoint | sessions/s | sessions | replies | admitted | SLA att. (admitted) | TTFT p99 | "
              f"TTF{n} p99 | cached share | early (admitted) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["sweep"]:
        lines.append(f"| {r['endpoint']} | {_f(r['rate'], 2)} | {r['sessions']} | {r['requests']} | "
                     f"{_pct(r['admitted_share'])} | {_f(r['sla_attainment_admitted'], 3)} | "
                     f"{_f(r['ttft_ms_p99'])} | {_f(r[f'ttf{n}_ms_p99'])} | {_pct(r['cached_share'])} | "
                     f"{r['preemptive']} ({_pct(r['preemptive_admitted_share'])}) |")
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {_f(t['measured'], 3)} | {'–' if t['met'] is None else 'yes' if t['met'] else 'no'} |"
              for t in doc["targets"]]
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """By turn: TTFT and TTF-N p99 per endpoint; fresh prompts: p50 against length; the sweep: SLA attainment of
    admitted replies and the admitted share against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path, help="the folder of bench/voice_gpu.sh's runs")
    p.add_argument("--out", type=Path, default=RESULTS, help="where voice-<device>.{json,md,png} go")
    args = p.parse_args(argv)
    doc = build(args.raw)
    stem = f"voice-{doc['device'].replace(' ', '-')}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    (args.out / f"{stem}.md").write_text(text)
    plot(doc, args.out / f"{stem}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
