"""The failover drill of `python -m bench router`: Poisson load through the router (parley-loadtest's own load loop,
run in this process so that its clock is the drill's), the last replica SIGKILLed mid-way and restarted later on the
same port, the router's and the replicas' /metrics sampled a few times a second. What it reports:

- how long the router kept sending to the dead replica: from the kill to the router marking it down (health or
  circuit breaker), to its last attempt on it, and to the last request that failed at the client;
- that nothing hung: every request ended (served, refused or failed) within the loadtest's timeout;
- that the survivor kept its promise: SLA attainment of the requests admitted while it served alone;
- that traffic came back: the restarted replica served requests again, and how long after it was healthy.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.fleet import Fleet, metric_samples, metric_total
from bench.server import api_key
from loadtest.clients import ClientPool, Target, first_model
from loadtest.record import RequestRecord
from loadtest.report import write_json
from loadtest.runner import Load, run_phase
from loadtest.stats import summarize
from loadtest.workload import Session, synthetic_sessions

SAMPLE_EVERY_S = 0.25
HANG_SLACK_S = 2.0  # past the request timeout, a request that has not ended counts as hung


@dataclass(frozen=True)
class Drill:
    rate: float  # requests/s through the router
    kill_at_s: float  # into the load
    restart_after_s: float  # after the kill
    back_requests: int  # the restarted replica's completed requests that end the drill...
    tail_s: float  # ...after at least this long past its health
    back_timeout_s: float  # or this long after the restart, whatever comes first
    timeout_s: float  # a request's, as the loadtest's --timeout
    sla_tokens: int = 64
    sla_ms: float = 100.0
    input_len: int = 32
    output_len: int = 64


async def _get(client: httpx.AsyncClient, url: str) -> list[tuple[str, dict[str, str], float]] | None:
    try:
        r = await client.get(url, timeout=2.0)
        return metric_samples(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def _sample(fleet: Fleet, victim_url: str, t0: float, samples: list[dict[str, Any]]) -> None:
    """A few times a second: the router's view of the victim (health, circuit, requests and attempts it sent it)
    and each replica's completed requests (None while it is down)."""
    async with httpx.AsyncClient() as client:
        while True:
            t = time.perf_counter() - t0
            router = await _get(client, fleet.router.metrics_url)
            replicas = [await _get(client, f"{r.base}/metrics") for r in fleet.replicas]
            row: dict[str, Any] = {"t": round(t, 3), "completed": [
                None if m is None else metric_total(m, "parley_requests_total", outcome="completed")
                for m in replicas]}
            if router is not None:
                row |= {
                    "health": metric_total(router, "vllm_router_worker_health", worker=victim_url),
                    "cb_state": metric_total(router, "vllm_router_cb_state", worker=victim_url),
                    "sent": metric_total(router, "vllm_router_processed_requests_total", worker=victim_url),
                    "cb_outcomes": metric_total(router, "vllm_router_cb_outcomes_total", worker=victim_url),
                    "cb_failures": metric_total(router, "vllm_router_cb_outcomes_total", worker=victim_url,
                                                outcome="failure"),
                }
            samples.append(row)
            await asyncio.sleep(max(0.0, SAMPLE_EVERY_S - (time.perf_counter() - t0 - t)))


def _until(stop: asyncio.Event, sessions: Iterator[Session]) -> Iterator[Session]:
    for session in sessions:
        if stop.is_set():
            return
        yield session


async def _drill(fleet: Fleet, drill: Drill, say: Any) -> dict[str, Any]:
    victim = fleet.replicas[-1]
    target = Target(url=fleet.router.base, endpoint="completions", api_key=api_key(), timeout_s=drill.timeout_s)
    load = Load(rate=drill.rate, num_sessions=None, sla_tokens=drill.sla_tokens, sla_ms=drill.sla_ms, seed=3)
    stop = asyncio.Event()
    samples: list[dict[str, Any]] = []
    marks: dict[str, float] = {}
    async with ClientPool(target) as pool:
        client = pool.take()
        target.model = await first_model(client, target)
        pool.give(client)
        t0 = time.perf_counter()
        now = lambda: time.perf_counter() - t0  # noqa: E731
        sessions = _until(stop, synthetic_sessions(drill.input_len, drill.output_len, seed=3))
        loading = asyncio.create_task(run_phase(pool, target, sessions, load, t0=t0))
        sampling = asyncio.create_task(_sample(fleet, victim.base, t0, samples))
        try:
            await asyncio.sleep(drill.kill_at_s)
            marks["kill"] = now()
            await asyncio.to_thread(victim.kill)
            say(f"failover: replica {victim.index} killed at {marks['kill']:.1f} s into the load")
            await asyncio.sleep(drill.restart_after_s)
            marks["restart"] = now()
            victim.launch()
            say(f"failover: replica {victim.index} restarted at {marks['restart']:.1f} s")
            try:
                await asyncio.to_thread(victim.wait_healthy, drill.back_timeout_s)
                marks["healthy"] = now()
                say(f"failover: replica {victim.index} healthy at {marks['healthy']:.1f} s")
                end = marks["restart"] + drill.back_timeout_s
                while now() < end:
                    back = [s["completed"][-1] for s in samples if s["t"] >= marks["healthy"]
                            and s["completed"][-1] is not None]
                    if back and back[-1] >= drill.back_requests and now() >= marks["healthy"] + drill.tail_s:
                        break
                    await asyncio.sleep(SAMPLE_EVERY_S)
            except Exception as e:  # noqa: BLE001  (the report says it did not come back)
                say(f"failover: the restarted replica did not come back: {e}")
            marks["stop"] = now()
            stop.set()
            say(f"failover: arrivals stopped at {marks['stop']:.1f} s; waiting for the requests in flight")
            # every request ends within its timeout (asyncio.timeout in the load loop): waiting longer is a hang
            records = await asyncio.wait_for(loading, drill.timeout_s + 30)
            marks["end"] = now()
        finally:
            stop.set()
            sampling.cancel()
            if not loading.done():
                loading.cancel()
    return {"records": records, "samples": samples, "marks": marks, "model": target.model,
            "victim": victim.index, "victim_url": victim.base}


def _first(samples: list[dict[str, Any]], after: float, cond: Any) -> float | None:
    return next((s["t"] for s in samples if s["t"] >= after and "health" in s and cond(s)), None)


def _last_change(samples: list[dict[str, Any]], after: float, before: float, key: str) -> float | None:
    """The time of the last sample in (after, before) whose `key` differs from the sample before it."""
    rows = [s for s in samples if key in s]
    times = [b["t"] for a, b in zip(rows, rows[1:]) if after < b["t"] < before and b[key] != a[key]]
    return times[-1] if times else None


def figures(run: dict[str, Any], drill: Drill) -> dict[str, Any]:
    recs: list[RequestRecord] = run["records"]
    samples, marks = run["samples"], run["marks"]
    kill, restart = marks["kill"], marks["restart"]
    healthy = marks.get("healthy")
    back_at = None
    if healthy is not None:  # the restarted replica's first completed request, as its /metrics says
        back_at = next((s["t"] for s in samples if s["t"] >= healthy and s["completed"][-1]), None)
    alone_until = back_at if back_at is not None else marks["stop"]
    failed = [r for r in recs if r.outcome == "error"]
    timeout_ms = drill.timeout_s * 1000.0
    hung = [r for r in recs if (r.e2e_ms or 0.0) >= timeout_ms - 1.0 or "Timeout" in (r.error or "")]
    alone = [r for r in recs if kill <= r.start_s < alone_until]
    before = [r for r in recs if r.start_s < kill]
    last_out = None
    for s in samples:
        if s["t"] >= kill and s["t"] < restart and "health" in s and (s["health"] == 0 or s["cb_state"] != 0):
            last_out = s["t"]
            break
    victim_served_after = max((s["completed"][-1] or 0 for s in samples if s["t"] >= restart), default=0)
    survivor = [s["completed"][0] for s in samples if s["completed"][0] is not None]

    def rel(t: float | None, origin: float | None) -> float | None:
        return None if t is None or origin is None else round(t - origin, 2)

    def figs(rs: list[RequestRecord]) -> dict[str, Any]:
        s = summarize(rs)
        return {"requests": s["requests"], "ok": s["ok"], "rejected": s["rejected"], "errors": s["errors"],
                "sla_attainment": s["sla_attainment"], "sla_attainment_all": s["sla_attainment_all"],
                "ttf64_ms_p99": s["ttfn_ms"]["p99"]}

    return {
        "rate": drill.rate, "victim": run["victim"], "timeout_s": drill.timeout_s,
        "marks_s": {k: round(v, 2) for k, v in marks.items()},
        "requests": len(recs),
        "failed": len(failed),
        "failed_in_flight_at_kill": sum(1 for r in failed if r.start_s < kill <= r.end_s),
        "failed_sent_after_kill": sum(1 for r in failed if r.start_s >= kill),
        "errors": sorted({(r.error or "")[:120] for r in failed})[:10],
        "hung": len(hung),
        "longest_request_s": round(max((r.e2e_ms or 0.0) for r in recs) / 1000.0, 2) if recs else None,
        "router_marked_down_s": rel(last_out, kill),
        "last_sent_to_victim_s": rel(_last_change(samples, kill, restart, "sent"), kill),
        "last_attempt_on_victim_s": rel(_last_change(samples, kill, restart, "cb_outcomes"), kill),
        "last_client_failure_s": rel(max((r.end_s for r in failed if r.start_s < restart), default=None), kill),
        "restart_healthy_s": rel(healthy, restart),
        "router_back_s": rel(_first(samples, healthy, lambda s: s["health"] == 1) if healthy is not None else None,
                             healthy),
        "traffic_back_s": rel(back_at, healthy),
        "victim_completed_after_restart": victim_served_after,
        "survivor_completed": (survivor[-1] - survivor[0]) if survivor else None,
        "before_kill": figs(before),
        "survivor_alone": figs(alone),
        "all": figs(recs),
    }


def run(fleet: Fleet, drill: Drill, raw: Path, say: Any) -> dict[str, Any]:
    """The drill through `fleet`'s router; its figures (and, in `raw`, every request and every sample)."""
    result = asyncio.run(_drill(fleet, drill, say))
    config = {"url": fleet.router.base, "endpoint": "completions", "model": result["model"], "rate": drill.rate,
              "sla_tokens": drill.sla_tokens, "sla_ms": drill.sla_ms, "timeout": drill.timeout_s,
              "input_len": drill.input_len, "output_len": drill.output_len}
    write_json(raw / "failover.json", config, [{"rate": drill.rate, "summary": summarize(result["records"]),
                                                "requests": result["records"]}], None)
    (raw / "failover-samples.json").write_text(json.dumps({"marks": result["marks"], "samples": result["samples"]},
                                                          indent=1) + "\n")
    return figures(result, drill)
