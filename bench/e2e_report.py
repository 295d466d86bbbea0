"""Fold the runs of bench/e2e_gpu.sh into bench/results/e2e-<device>.{json,md,png}.

    python bench/e2e_report.py RAW_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def device_info() -> dict[str, str]:
    import torch
    import triton

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__}


def record(backend: str, model: str, kind: str, doc: dict[str, Any]) -> dict[str, Any]:
    runs = doc["runs"]
    best = doc["sweep"]["best"] if doc.get("sweep") else runs[0]["summary"]
    s = best or runs[-1]["summary"]
    rec = {
        "backend": backend, "model": model, "kind": kind,
        "prompt_tokens": round(s["mean_prompt_tokens"] or 0),
        "requests": s["requests"],
        "ttf64_ms_p50": s["ttfn_ms"]["p50"], "ttf64_ms_p99": s["ttfn_ms"]["p99"],
        "ttft_ms_p50": s["ttft_ms"]["p50"], "ttft_ms_p99": s["ttft_ms"]["p99"],
        "itl_ms_p50": s["itl_ms"]["p50"], "itl_ms_p99": s["itl_ms"]["p99"],
        "sla_attainment": s["sla_attainment"], "rejection_rate": s["rejection_rate"],
        "output_tokens_per_s": s["output_throughput"], "usd_per_1m_tokens": s["usd_per_1m_output_tokens"],
        "reject_ms_p99": s["reject_ms"]["p99"],
    }
    if doc.get("sweep"):
        rec["goodput_rps"] = doc["sweep"]["best_rate"]
        rec["sweep"] = [{"rate": r["rate"], "sla_attainment": r["summary"]["sla_attainment"],
                         "sla_attainment_all": r["summary"]["sla_attainment_all"],
                         "rejection_rate": r["summary"]["rejection_rate"],
                         "ttf64_ms_p50": r["summary"]["ttfn_ms"]["p50"], "ttf64_ms_p99": r["summary"]["ttfn_ms"]["p99"]}
                        for r in sorted(runs, key=lambda r: r["rate"] or 0)]
        admitted = [p["sla_attainment"] for p in rec["sweep"] if p["sla_attainment"] is not None]
        rec["min_sla_attainment_over_sweep"] = min(admitted) if admitted else None
    return rec


def fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def main(raw: str) -> None:
    raw_dir = Path(raw)
    info_file = raw_dir / "device.json"  # written on the GPU host; the report may be made elsewhere
    info = json.loads(info_file.read_text()) if info_file.exists() else device_info()
    records = []
    for path in sorted(raw_dir.glob("*-*.json")):
        if "latency-model" in path.name or "pyspy" in path.name:
            continue
        backend, kind = path.stem.split("-", 1)
        doc = json.loads(path.read_text())
        records.append(record(backend, doc["config"]["model"], kind, doc))
    out = {**info, "records": records}
    stem = f"e2e-{info['device'].replace(' ', '-')}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1))
    lines = [
        f"# End to end: client-measured latency of `parley serve` on {info['device']}",
        "",
        f"torch {info['torch']}, Triton {info['triton']}. Model: synthetic weights with the real shapes "
        "(decode cost does not depend on weight values). SLA: 64 tokens within 100 ms. Measured by parley-loadtest "
        "on the same host over loopback; `single` = one stream at a time, `sweep` = Poisson arrivals at the highest "
        "rate where ≥ 99% of all requests met the SLA (goodput).",
        "",
        "| backend | run | prompt tok | TTF64 p50 ms | TTF64 p99 ms | TTFT p50 ms | ITL p50 ms | SLA att. (admitted) "
        "| rejected | goodput req/s | out tok/s | USD / 1M tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['backend']} | {r['kind']} | {r['prompt_tokens']} | {fmt(r['ttf64_ms_p50'])} | "
            f"{fmt(r['ttf64_ms_p99'])} | {fmt(r['ttft_ms_p50'])} | {fmt(r['itl_ms_p50'], 2)} | "
            f"{fmt(r['sla_attainment'], 3)} | {fmt(r['rejection_rate'], 3)} | {fmt(r.get('goodput_rps'))} | "
            f"{fmt(r['output_tokens_per_s'], 0)} | {fmt(r['usd_per_1m_tokens'], 3)} |")
    sweeps = [r for r in records if r.get("sweep")]
    for r in sweeps:
        lines += ["", f"Sweep, {r['backend']} {r['kind']}: rate → SLA attainment of admitted (of all), rejection "
                      "rate, TTF64 p99",
                  "", "| rate /s | attainment admitted | attainment all | rejected | TTF64 p99 ms |",
                  "|---|---|---|---|---|"]
        lines += [f"| {fmt(p['rate'])} | {fmt(p['sla_attainment'], 3)} | {fmt(p['sla_attainment_all'], 3)} | "
                  f"{fmt(p['rejection_rate'], 3)} | {fmt(p['ttf64_ms_p99'])} |" for p in r["sweep"]]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    plot(sweeps, RESULTS / f"{stem}.png")
    print("\n".join(lines))


def plot(sweeps: list[dict[str, Any]], path: Path) -> None:
    if not sweeps:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in sweeps:
        rates = [p["rate"] for p in r["sweep"]]
        ax.plot(rates, [p["ttf64_ms_p99"] for p in r["sweep"]], marker="o", label=f"{r['backend']} TTF64 p99")
        ax.plot(rates, [p["ttf64_ms_p50"] for p in r["sweep"]], marker=".", linestyle=":",
                label=f"{r['backend']} TTF64 p50")
    ax.axhline(100, color="red", linestyle="--", label="SLA 100 ms")
    ax.set(xscale="log", xlabel="arrival rate (requests/s)", ylabel="ms (admitted requests)",
           title="Time to the 64th token against load")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/e2e-raw")
