"""Consistency of a parley-loadtest JSON report: every figure recomputed from its per-request records."""

import pytest

from loadtest.stats import percentile


def check_consistent(doc: dict) -> None:
    cfg = doc["config"]
    n_sla, sla_ms = cfg["sla_tokens"], cfg["sla_ms"]
    for run in doc["runs"]:
        s, recs = run["summary"], run["requests"]
        assert s["requests"] == len(recs)
        for key, outcome in (("ok", "ok"), ("rejected", "rejected"), ("errors", "error"), ("cancelled", "cancelled")):
            assert s[key] == sum(r["outcome"] == outcome for r in recs)
        for r in recs:
            t = r["token_times_s"]
            if t:
                assert r["ttft_ms"] == pytest.approx(t[0] * 1000)
                assert r["ttfn_ms"] == pytest.approx(t[min(n_sla, len(t)) - 1] * 1000)
                assert t == sorted(t) and r["start_s"] + t[-1] <= r["end_s"] + 1e-6
            assert r["sla_met"] == (r["outcome"] in ("ok", "cancelled") and bool(t) and r["ttfn_ms"] <= sla_ms)
        met = sum(r["sla_met"] for r in recs)
        admitted = len(recs) - s["rejected"]
        assert s["sla_met"] == met and s["admitted"] == admitted
        if admitted:
            assert s["sla_attainment"] == pytest.approx(met / admitted)
        assert s["sla_attainment_all"] == pytest.approx(met / len(recs))
        duration = max(r["end_s"] for r in recs) - min(r["start_s"] for r in recs)
        assert s["duration_s"] == pytest.approx(duration)
        assert s["output_tokens"] == sum(r["output_tokens"] for r in recs)
        assert s["output_throughput"] == pytest.approx(s["output_tokens"] / duration)
        assert s["goodput"] == pytest.approx(met / duration)
        assert s["usd_per_1m_output_tokens"] == pytest.approx(
            cfg["gpu_hourly_usd"] * cfg["gpus"] / (s["output_throughput"] * 3600) * 1e6)
        ttft = [r["ttft_ms"] for r in recs if r["outcome"] in ("ok", "cancelled") and r["ttft_ms"] is not None]
        for q in (50, 90, 99):
            assert s["ttft_ms"][f"p{q}"] == pytest.approx(percentile(ttft, q))
        assert s["ttft_ms"]["mean"] == pytest.approx(sum(ttft) / len(ttft))
