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


def conversation_figures(records: Sequence[RequestRecord], sla_tokens: int = 64) -> dict[str, Any]:
    """The figures of a group of conversation requests (one turn index, or a whole run): those of the replies
    (turns and barge-ins), then those of the preemptive starts. TTFT over every admitted reply; the time to token N
    over the replies not barged in; prompt and cached tokens as the server's usage says (an HTTP stream the client
    closed early never gets its usage chunk)."""
    replies = [r for r in records if r.kind != "preemptive"]
    early = [r for r in records if r.kind == "preemptive"]
    admitted = [r for r in replies if r.outcome != "rejected"]
    streamed = [r for r in replies if r.outcome in ("ok", "cancelled")]
    usage = [r for r in replies if r.prompt_tokens is not None and r.cached_tokens is not None]
    prompt = [r.prompt_tokens for r in replies if r.prompt_tokens is not None]
    ttft = describe([r.ttft_ms for r in streamed if r.ttft_ms is not None])
    ttfn = describe([r.ttfn_ms for r in streamed if r.kind == "turn" and r.ttfn_ms is not None])
    cancel = describe([r.cancel_ms for r in records if r.cancel_ms is not None])
    early_ttft = describe([r.ttft_ms for r in early if r.outcome in ("ok", "cancelled") and r.ttft_ms is not None])
    return {
        "requests": len(replies),
        "barge_ins": sum(r.kind == "barge-in" for r in replies),
        "rejected": len(replies) - len(admitted),
        "errors": sum(r.outcome == "error" for r in replies),
        "prompt_tokens": _ratio(sum(prompt), len(prompt)),
        "cached_tokens": _ratio(sum(r.cached_tokens or 0 for r in usage), len(usage)),
        "cached_share": _ratio(sum(r.cached_tokens or 0 for r in usage), sum(r.prompt_tokens or 0 for r in usage)),
        "ttft_ms_p50": ttft["p50"], "ttft_ms_p99": ttft["p99"],
        f"ttf{sla_tokens}_ms_p50": ttfn["p50"], f"ttf{sla_tokens}_ms_p99": ttfn["p99"],
        "admitted_share": _ratio(len(admitted), len(replies)),
        "sla_attainment_admitted": _ratio(sum(r.sla_met for r in admitted), len(admitted)),
        "preemptive": len(early),
        "preemptive_admitted_share": _ratio(sum(r.outcome != "rejected" for r in early), len(early)),
        "preemptive_ttft_ms_p50": early_ttft["p50"],
        "cancel_ms_p50": cancel["p50"], "cancel_ms_p99": cancel["p99"],
    }


def by_turn(records: Sequence[RequestRecord], sla_tokens: int = 64) -> list[dict[str, Any]]:
    """conversation_figures per turn index, `turn` counted from 1."""
    turns = sorted({r.turn for r in records})
    return [{"turn": k + 1, **conversation_figures([r for r in records if r.turn == k], sla_tokens)} for k in turns]
