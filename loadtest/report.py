"""What a person reads: rich tables on the terminal, a JSON file with every figure and request, a PNG of CDFs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.record import RequestRecord

Summary = dict[str, Any]
LATENCIES = (("ttft_ms", "time to first token"), ("ttfn_ms", "time to token N"), ("itl_ms", "inter-token"),
             ("tpot_ms", "time per output token"), ("e2e_ms", "end-to-end"), ("reject_ms", "time to 429"),
             ("cancel_ms", "cancel → done"))


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def latency_table(s: Summary, sla_tokens: int) -> Table:
    t = Table(title="Latency (ms), measured at the client")
    for col in ("", "n", "p50", "p90", "p99", "mean"):
        t.add_column(col, justify="left" if not col else "right")
    for key, name in LATENCIES:
        d = s[key]
        if d["n"]:
            label = name.replace("token N", f"token {sla_tokens}")
            t.add_row(label, str(d["n"]), *(_f(d[k]) for k in ("p50", "p90", "p99", "mean")))
    return t


def totals_table(s: Summary, sla_tokens: int, sla_ms: float) -> Table:
    t = Table(title=f"Throughput, SLA (first {sla_tokens} tokens within {sla_ms:g} ms) and cost")
    t.add_column("")
    t.add_column("value", justify="right")
    rows = [
        ("requests (ok / cancelled / rejected / errors)",
         f"{s['requests']} ({s['ok']} / {s['cancelled']} / {s['rejected']} / {s['errors']})"),
        ("window", f"{s['duration_s']:.2f} s"),
        ("requests/s (ok + cancelled)", _f(s["request_throughput"], "{:.2f}")),
        ("output tokens/s", _f(s["output_throughput"], "{:.1f}")),
        ("goodput (requests/s meeting the SLA)", _f(s["goodput"], "{:.2f}")),
        ("rejection rate", _pct(s["rejection_rate"])),
        ("SLA attainment, admitted requests", _pct(s["sla_attainment"])),
        ("SLA attainment, all requests", _pct(s["sla_attainment_all"])),
        ("mean prompt / output tokens", f"{_f(s['mean_prompt_tokens'])} / {_f(s['mean_output_tokens'])}"),
        (f"USD per 1M output tokens (${s['gpu_hourly_usd']:g}/GPU-h × {s['gpus']})",
         _f(s["usd_per_1m_output_tokens"], "${:.4f}")),
        ("USD per 1M tokens of requests meeting the SLA", _f(s["usd_per_1m_good_tokens"], "${:.4f}")),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def sweep_table(points: Sequence[tuple[float, Summary]], best: float | None, target: float) -> Table:
    t = Table(title=f"Sweep: highest rate with ≥ {100 * target:g}% of all requests within the SLA: "
                    + (f"{best:g} sessions/s" if best is not None else "none"))
    for col in ("rate/s", "req/s", "tok/s", "goodput", "rejected", "SLA admitted", "SLA all",
                "TTFT p50 ms", "TTF-N p50 ms", "TTF-N p99 ms", "$/1M tok"):
        t.add_column(col, justify="right")
    for rate, s in sorted(points, key=lambda p: p[0]):
        t.add_row(f"{rate:g}", _f(s["request_throughput"], "{:.2f}"), _f(s["output_throughput"], "{:.0f}"),
                  _f(s["goodput"], "{:.2f}"), _pct(s["rejection_rate"], 1), _pct(s["sla_attainment"], 1),
                  _pct(s["sla_attainment_all"], 1), _f(s["ttft_ms"]["p50"]), _f(s["ttfn_ms"]["p50"]),
                  _f(s["ttfn_ms"]["p99"]), _f(s["usd_per_1m_output_tokens"], "{:.4f}"))
    return t


def turns_table(rows: Sequence[dict[str, Any]], sla_tokens: int) -> Table:
    """stats.by_turn's rows: one line per turn index."""
    t = Table(title="By turn: replies (turns and barge-ins), then their preemptive starts (ms)")
    for col in ("turn", "replies", "barged", "admitted", "prompt tok", "cached tok", "TTFT p50", "TTFT p99",
                f"TTF{sla_tokens} p50", f"TTF{sla_tokens} p99", "SLA adm.", "early (adm.)", "cancel p99"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["turn"]), str(r["requests"]), str(r["barge_ins"]), _pct(r["admitted_share"], 1),
                  _f(r["prompt_tokens"], "{:.0f}"), _f(r["cached_tokens"], "{:.0f}"), _f(r["ttft_ms_p50"]),
                  _f(r["ttft_ms_p99"]), _f(r[f"ttf{sla_tokens}_ms_p50"]), _f(r[f"ttf{sla_tokens}_ms_p99"]),
                  _pct(r["sla_attainment_admitted"], 1),
                  f"{r['preemptive']} ({_pct(r['preemptive_admitted_share'], 0)})", _f(r["cancel_ms_p99"], "{:.2f}"))
    return t


CLIENT_LAG_WARN_MS = 5.0


def print_run(console: Console, s: Summary, sla_tokens: int, sla_ms: float) -> None:
    console.print(latency_table(s, sla_tokens))
    console.print(totals_table(s, sla_tokens, sla_ms))
    turns = s.get("by_turn") or []
    if len(turns) > 1 or any(r["preemptive"] or r["barge_ins"] for r in turns):
        console.print(turns_table(turns, sla_tokens))
    lag = s["client_loop_lag_ms"]["p99"]
    if lag is not None and lag > CLIENT_LAG_WARN_MS:
        console.print(f"[yellow]The client's event loop lagged {lag:.1f} ms (p99): its latencies include that. "
                      "Lower the load per client process, or run several clients.[/yellow]")


def write_json(path: str | Path, config: dict[str, Any], runs: list[dict[str, Any]],
               sweep: dict[str, Any] | None) -> None:
    """{config, runs: [{rate, summary, requests: [record...]}], sweep: {target, best_rate, best} | null}."""
    def enc(run: dict[str, Any]) -> dict[str, Any]:
        return {**run, "requests": [r.to_json() for r in run["requests"]]}
    doc = {"config": config, "runs": [enc(r) for r in runs], "sweep": sweep}
    Path(path).write_text(json.dumps(doc, indent=1), encoding="utf-8")


def plot(path: str | Path, runs: list[dict[str, Any]], sla_tokens: int, sla_ms: float) -> None:
    """Latency CDFs (TTFT, time to token N, inter-token, end-to-end) of the last run; with several runs (a
    sweep), also p50/p99 time to token N and SLA attainment against the rate. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len(runs) > 1
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    recs: list[RequestRecord] = [r for r in runs[-1]["requests"] if r.outcome in ("ok", "cancelled")]
    series: dict[str, list[float | None]] = {
        "TTFT": [r.ttft_ms for r in recs], f"time to token {sla_tokens}": [r.ttfn_ms for r in recs],
        "inter-token": [x for r in recs for x in r.itl_ms],
        "end-to-end": [r.e2e_ms for r in recs if r.outcome == "ok"]}
    for name, vals in series.items():
        xs = sorted(v for v in vals if v is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.axvline(sla_ms, color="red", linestyle="--", label=f"SLA {sla_ms:g} ms")
    ax.set_xscale("log")
    ax.set(xlabel="ms", ylabel="fraction of requests", title=f"Latency CDF (rate {runs[-1].get('rate')})")
    ax.legend(loc="lower right", fontsize=8)
    if sweep:
        ax = axes[0][1]
        pts = sorted(runs, key=lambda r: r["rate"])
        rates = [r["rate"] for r in pts]
        for q in ("p50", "p99"):
            ax.plot(rates, [r["summary"]["ttfn_ms"][q] for r in pts], marker="o", label=f"time to token "
                    f"{sla_tokens} {q}")
        ax.axhline(sla_ms, color="red", linestyle="--", label=f"SLA {sla_ms:g} ms")
        ax.set(xlabel="arrival rate (sessions/s)", ylabel="ms", title="Latency against rate")
        ax.set_ylim(bottom=0)
        ax2 = ax.twinx()
        ax2.plot(rates, [100 * (r["summary"]["sla_attainment_all"] or 0) for r in pts], color="gray",
                 marker="x", label="% of all requests within SLA (right)")
        ax2.set_ylabel("% of all requests within SLA")
        ax2.set_ylim(0, 105)
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
