"""The engine loop as a server's /metrics saw it over one loadtest: the runner scrapes /metrics before and after each
(<loadtest>.metrics-before.txt, <loadtest>.metrics.txt in the raw folder), and the report reads the difference of two
histograms, parley_engine_host_seconds, parley_gpu_idle_seconds, parley_step_gpu_seconds,
parley_admission_verdict_seconds (and its parts, parley_engine_received_seconds and parley_admission_forecast_seconds;
of the first, parley_request_transit_seconds: the client's own send) and parley_token_delivery_seconds, as quantiles
(interpolated within a bucket, as Prometheus' histogram_quantile does), and the GPU's idle gaps over 100 us by the host
phase that made them (parley_gpu_idle_gaps_total and its seconds). The loadtest's warm-up requests are in it.
A sweep's rates one by one: parley-loadtest's own snapshots around each (at_rate)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

HOST = "parley_engine_host_seconds"
GPU_IDLE = "parley_gpu_idle_seconds"
STEP_GPU = "parley_step_gpu_seconds"
SLOW_STEP_S = 0.005  # a step this long on the GPU: a prefill of a thousand tokens and more, or the GPU stalling
VERDICT = "parley_admission_verdict_seconds"
RECEIVED = "parley_engine_received_seconds"
TRANSIT = "parley_request_transit_seconds"  # of RECEIVED: the client's send to the server's first sight (its header)
FORECAST = "parley_admission_forecast_seconds"
DELIVERY = "parley_token_delivery_seconds"
HOP = "parley_token_hop_seconds"  # of DELIVERY: the engine's send to the front end's reader (between processes)
FRONT_LAG = "parley_front_end_loop_lag_seconds"
GENERATED = "parley_generation_tokens"  # a counter: the tokens the engine's steps made
IDLE_GAPS, IDLE_GAP_SECONDS = "parley_gpu_idle_gaps", "parley_gpu_idle_gap_seconds"  # counters, by `after`
BEFORE, AFTER = ".metrics-before.txt", ".metrics.txt"  # after the loadtest's name
POINTS = ".points"  # after the loadtest's name: the folder of its snapshots around each rate (--metrics-snapshots)


def buckets(text: str, name: str) -> dict[float, float] | None:
    """A histogram's cumulative bucket counts (upper bound → count) summed over its labels; None where it is absent."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out or None


def total(text: str, name: str) -> float | None:
    """A counter's value summed over its labels; None where it is absent."""
    values = [s.value for family in text_string_to_metric_families(text) if family.name == name
              for s in family.samples if s.name == name + "_total"]
    return sum(values) if values else None


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """A counter's values by one of its labels."""
    return {s.labels[label]: s.value for family in text_string_to_metric_families(text) if family.name == name
            for s in family.samples if s.name == name + "_total"}


def idle_gaps(before: str | None, after: str) -> dict[str, tuple[int, float]]:
    """The GPU's long idle gaps between two scrapes by the host phase that made them: phase → (gaps, seconds),
    the most seconds first."""
    n, s = by_label(after, IDLE_GAPS, "after"), by_label(after, IDLE_GAP_SECONDS, "after")
    n0 = by_label(before, IDLE_GAPS, "after") if before is not None else {}
    s0 = by_label(before, IDLE_GAP_SECONDS, "after") if before is not None else {}
    out = {k: (int(n[k] - n0.get(k, 0.0)), s.get(k, 0.0) - s0.get(k, 0.0)) for k in n}
    return dict(sorted(((k, v) for k, v in out.items() if v[0] > 0), key=lambda kv: -kv[1][1]))


def quantile(cumulative: dict[float, float], q: float) -> float | None:
    """The q-quantile of a histogram's cumulative counts; None where it counted nothing. Past the last finite bound:
    that bound (the histogram knows no more)."""
    edges = sorted(cumulative)
    total = cumulative[edges[-1]]
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in edges:
        count = cumulative[le]
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def longest(cumulative: dict[float, float]) -> float:
    """The upper bound of the highest bucket that counted anything (past the last finite bound: that bound)."""
    edges = sorted(cumulative)
    finite = [le for le in edges if le != float("inf")]
    below, top = 0.0, 0.0
    for le in edges:
        if cumulative[le] > below:
            top = le if le != float("inf") else max(finite, default=0.0)
        below = cumulative[le]
    return top


def over(before: str | None, after: str, name: str) -> dict[float, float] | None:
    """The histogram's counts between two scrapes (after alone where there is no before)."""
    end = buckets(after, name)
    if end is None:
        return None
    start = buckets(before, name) if before is not None else None
    return {le: n - (start or {}).get(le, 0.0) for le, n in end.items()}


def figures(raw: Path, loadtest: str) -> dict[str, Any]:
    """host_us_p50/p99, gpu_idle_us_p50/p99, step_gpu_us_p50/p99 and slow_gpu_steps (over SLOW_STEP_S),
    verdict_us_p50/p99 (arrival to admission's verdict), of it received_us_p50/p99 (arrival to the engine's receipt;
    of that, transit_us_p50/p99: the client's send to the server's first sight) and forecast_us_p50/p99 (the verdict's
    own time), delivery_us_p50/p99
    (a delta of tokens from the engine's publishing it to the front end's reading it; of it hop_us_p50/p99, the
    engine's send to the front end's reader) and loop_iterations
    over one loadtest; {} where it was not scraped, None
    for a figure the server did not measure (the GPU's idle time on a CPU)."""
    return _between_files(raw / f"{loadtest}{BEFORE}", raw / f"{loadtest}{AFTER}")


def at_rate(raw: Path, loadtest: str, run: dict[str, Any]) -> dict[str, Any]:
    """figures()'s figures over one rate of a loadtest (a run of its JSON), from the snapshots parley-loadtest took
    around it (`--metrics-snapshots`, raw/<loadtest>.points); {} where it took none."""
    names = run.get("metrics") or {}
    folder = raw / f"{loadtest}{POINTS}"
    if not names.get("after"):
        return {}
    return _between_files(folder / names["before"] if names.get("before") else None, folder / names["after"])


def _between_files(before: Path | None, after: Path) -> dict[str, Any]:
    """between() of two scrape files; {} without the later one, from nothing without the earlier one."""
    if not after.exists():
        return {}
    return between(before.read_text() if before is not None and before.exists() else None, after.read_text())


def between(before: str | None, after: str) -> dict[str, Any]:
    """figures()'s figures from two scrapes' texts (bench engine-loop reads the engine's registry itself)."""
    out: dict[str, Any] = {}
    for key, name in (("host", HOST), ("gpu_idle", GPU_IDLE), ("step_gpu", STEP_GPU), ("verdict", VERDICT),
                      ("received", RECEIVED), ("transit", TRANSIT), ("forecast", FORECAST), ("delivery", DELIVERY),
                      ("hop", HOP), ("front_lag", FRONT_LAG)):
        h = over(before, after, name)
        for q in (50, 99):
            v = None if h is None else quantile(h, q / 100)
            out[f"{key}_us_p{q}"] = None if v is None else round(v * 1e6, 1)
        if key == "host":
            out["loop_iterations"] = None if h is None else int(h[float("inf")])
        if key == "front_lag":  # the longest stall, to its bucket's upper bound (past the last: that bound, as >)
            out["front_lag_ms_max"] = None if h is None else round(longest(h) * 1e3, 1)
        if key == "step_gpu":  # how many steps took longer on the GPU than SLOW_STEP_S
            out["slow_gpu_steps"] = None if h is None else int(h[float("inf")] - h.get(SLOW_STEP_S, 0.0))
    # the rows a step decodes, from the same two scrapes as the iterations (a window's edges count on both sides)
    made, made_before = total(after, GENERATED), total(before, GENERATED) if before is not None else 0.0
    out["tokens_per_iteration"] = None if made is None or made_before is None or not out["loop_iterations"] \
        else round((made - made_before) / out["loop_iterations"], 3)
    out["idle_gaps"] = {k: [n, round(sec * 1e3, 2)] for k, (n, sec) in idle_gaps(before, after).items()}
    return out
