"""Pure statistics over request records: percentiles, throughput, goodput, SLA attainment, cost."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadtest.record import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values: Sequence[float]) -> dict[str, float | int | None]:
    """{n, mean, p50, p90, p99}; None for each figure when there are no values."""
    out: dict[str, float | int | None] = {"n": len(values), "mean": sum(values) / len(values) if values else None}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) if values else None
    return out


def usd_per_million_tokens(tokens_per_s: float, gpu_hourly_usd: float, gpus: int) -> float | None:
    """What 1M output tokens cost at this throughput: (price per GPU-hour × GPUs) / (tokens per hour) × 1e6."""
    if tokens_per_s <= 0:
        return None
    return gpu_hourly_usd * gpus / (tokens_per_s * 3600.0) * 1e6


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def summarize(records: Sequence[RequestRecord], gpu_hourly_usd: float = 2.5, gpus: int = 1,
              loop_lag_ms: Sequence[float] = ()) -> dict[str, Any]:
    """Every figure of a run. The window is from the first request sent to the last one ended.
    admitted = not rejected (a request that failed after admission counts against the SLA).
    loop_lag_ms: the client's event-loop lag samples, reported so that a saturated client shows."""
    n = len(records)
    by = {o: [r for r in records if r.outcome == o] for o in ("ok", "rejected", "error", "cancelled")}
    admitted = n - len(by["rejected"])
    met = [r for r in records if r.sla_met]
    streamed = by["ok"] + by["cancelled"]
    duration = max(r.end_s for r in records) - min(r.start_s for r in records) if records else 0.0
    out_tokens = sum(r.output_tokens for r in records)
    good_tokens = sum(r.output_tokens for r in met)
    tok_s = _ratio(out_tokens, duration) or 0.0
    good_tok_s = _ratio(good_tokens, duration) or 0.0
    prompt = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    return {
        "requests": n,
        "ok": len(by["ok"]),
        "cancelled": len(by["cancelled"]),
        "rejected": len(by["rejected"]),
        "errors": len(by["error"]),
        "admitted": admitted,
        "sla_met": len(met),
        "duration_s": duration,
        "request_throughput": _ratio(len(streamed), duration),
        "output_throughput": tok_s,
        "goodput": _ratio(len(met), duration),
        "rejection_rate": _ratio(len(by["rejected"]), n),
        "sla_attainment": _ratio(len(met), admitted),
        "sla_attainment_all": _ratio(len(met), n),
        "output_tokens": out_tokens,
        "good_output_tokens": good_tokens,
        "mean_prompt_tokens": _ratio(sum(prompt), len(prompt)),
        "mean_output_tokens": _ratio(sum(r.output_tokens for r in streamed), len(streamed)),
        "ttft_ms": describe([r.ttft_ms for r in streamed if r.ttft_ms is not None]),
        "ttfn_ms": describe([r.ttfn_ms for r in streamed if r.ttfn_ms is not None]),
        "itl_ms": describe([x for r in streamed for x in r.itl_ms]),
        "tpot_ms": describe([r.tpot_ms for r in by["ok"] if r.tpot_ms is not None]),
        "e2e_ms": describe([r.e2e_ms for r in by["ok"] if r.e2e_ms is not None]),
        "reject_ms": describe([r.e2e_ms for r in by["rejected"] if r.e2e_ms is not None]),
        "cancel_ms": describe([r.cancel_ms for r in by["cancelled"] if r.cancel_ms is not None]),
        "client_loop_lag_ms": describe(loop_lag_ms),
        "gpu_hourly_usd": gpu_hourly_usd,
        "gpus": gpus,
        "usd_per_1m_output_tokens": usd_per_million_tokens(tok_s, gpu_hourly_usd, gpus),
        "usd_per_1m_good_tokens": usd_per_million_tokens(good_tok_s, gpu_hourly_usd, gpus),
    }
