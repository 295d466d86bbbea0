"""Overload at five times capacity for a minute: every request is answered (a completion or a 429, nothing else,
nothing hangs), the admitted ones keep the SLA as the client measures it, the 429s come fast with Retry-After and
x-should-retry: false, and /health stays quick throughout.

The tiny synthetic model slowed to a known pace: --step-delay-ms 10 makes a decode step ~10-11 ms, so with
--max-batch 2 and 16 tokens a request, capacity is about 2 / (16 x 10 ms) = 12.5 requests/s; the client drives 5x
that (62.5/s) with Poisson arrivals for 60 s, each request an SSE stream of 16 tokens. The SLA is set to what the
slowed server can keep: the client's budget is the 16th token within 600 ms of sending, about 3x the idle time to it
(~190 ms). The server promises --sla-ms 500 from when the request reaches it: the other 100 ms are the loopback HTTP
hop both ways and the client's own event loop, busy with 60 requests a second on the same two (shared) cores.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from tests.host_steal import HostTooSlow, judge_on_a_steady_host
from tests.server_support import (
    Server,
    health_status,
    scrape_metrics,
    served,
    sse_data,
    tiny_server,
    wait_idle,
)

pytestmark = pytest.mark.slow

MAX_BATCH, STEP_MS, TOKENS = 2, 10.0, 16
SLA_MS = 600.0  # the client's budget for the 16th token
SERVER_SLA_MS = 500.0  # what the server promises from arrival (see above)
CAPACITY_RPS = MAX_BATCH / (TOKENS * STEP_MS / 1e3)  # 12.5
RATE_RPS = 5 * CAPACITY_RPS
DURATION_S = 60.0
REQUEST_TIMEOUT_S = 30.0  # a request not answered by then is a hang
HEALTH_EVERY_S, HEALTH_MAX_MS = 0.25, 250.0
REJECT_P99_MS = 100.0


@pytest.fixture(scope="module")
def overload_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from served(tiny_server(tmp_path_factory.mktemp("overload") / "parley.log", "--max-batch", str(MAX_BATCH),
                                  "--max-context", "256", "--step-delay-ms", str(STEP_MS), "--sla-tokens", str(TOKENS),
                                  "--sla-ms", str(SERVER_SLA_MS)))


@dataclass
class Results:
    completed_ms: list[float] = field(default_factory=list)  # send → the 16th (last) token
    rejected_ms: list[float] = field(default_factory=list)  # send → the whole 429 read
    errors: Counter[str] = field(default_factory=Counter)
    bad_429_headers: int = 0
    sent: int = 0


async def one_request(client: httpx.AsyncClient, i: int, res: Results) -> None:
    body = {"prompt": f"caller {i}: hello", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True}
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 429:
                    await r.aread()
                    res.rejected_ms.append((time.perf_counter() - t0) * 1e3)
                    if not (int(r.headers.get("retry-after", "0")) >= 1 and r.headers.get("x-should-retry") == "false"
                            and r.json()["error"]["type"] == "overloaded"):
                        res.bad_429_headers += 1
                    return
                if r.status_code != 200:
                    res.errors[f"status {r.status_code}"] += 1
                    return
                finish, done, t_last = None, False, None
                async for line in r.aiter_lines():
                    if (data := sse_data(line)) is None:
                        continue
                    if data == "[DONE]":
                        done = True
                    elif '"finish_reason":"length"' in data:
                        finish, t_last = "length", time.perf_counter()
                    elif '"error"' in data:
                        res.errors["stream error"] += 1
                        return
                if not (done and finish == "length" and t_last is not None):
                    res.errors["stream cut short"] += 1
                    return
                res.completed_ms.append((t_last - t0) * 1e3)
    except TimeoutError:
        res.errors["hang"] += 1
    except httpx.HTTPError as e:
        res.errors[type(e).__name__] += 1


async def drive(base: str, seed: int = 8) -> Results:
    rng = random.Random(seed)
    res = Results()
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        at = 0.0
        while at < DURATION_S:  # Poisson arrivals on an absolute schedule: a late wake-up does not lower the rate
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(client, res.sent, res)))
            res.sent += 1
            at += rng.expovariate(RATE_RPS)
        await asyncio.gather(*tasks)
    return res


class HealthPoller(threading.Thread):
    """GET /health every 250 ms from its own thread and connection; every answer and its latency."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.stop, self.samples = base, threading.Event(), list[tuple[int, float]]()

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=10) as c:
            while not self.stop.wait(HEALTH_EVERY_S):
                t0 = time.perf_counter()
                try:
                    status = c.get("/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.samples.append((status, (time.perf_counter() - t0) * 1e3))


def p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def test_five_times_capacity_for_a_minute(overload_server: Server) -> None:
    judge_on_a_steady_host(lambda: overload_for_a_minute(overload_server.base))


def overload_for_a_minute(base: str) -> list[str]:
    """One try: the idle time to the 16th token, then a minute at 5x capacity. Asserts what holds on any host; returns
    the timing it missed (judged on a steady host: tests/host_steal.py)."""
    idle = asyncio.run(_idle_times(base))  # the box's pace: the SLA must fit the slowed server to judge anything
    if statistics.median(idle) >= SLA_MS / 2:
        raise HostTooSlow(f"the idle time to token {TOKENS} is {statistics.median(idle):.0f} ms (median of {idle}), "
                          f"over half the SLA: this box runs the slowed server too slowly to judge it")

    before = scrape_metrics(base)
    poller = HealthPoller(base)
    poller.start()
    t0 = time.monotonic()
    res = asyncio.run(drive(base))
    elapsed = time.monotonic() - t0
    poller.stop.set()
    poller.join(15)
    m = wait_idle(base, timeout_s=60)

    answered = len(res.completed_ms) + len(res.rejected_ms)
    # what this box can serve: the nominal capacity, or less where a request alone takes longer than its 16 steps of
    # 10 ms (two run at a time, each as long as one alone): a CI box whose request alone took 226 ms completed 328 on a
    # steady host, under the nominal bound (375) and over this one (265)
    capacity_rps = min(CAPACITY_RPS, MAX_BATCH / (statistics.median(idle) / 1e3))
    health_ms = [ms for _, ms in poller.samples]
    violations = m["parley_sla_violations_total"] - before["parley_sla_violations_total"]
    report = (f"\noverload: {res.sent} sent in {elapsed:.0f} s ({res.sent / DURATION_S:.1f}/s, capacity "
              f"~{CAPACITY_RPS:.1f}/s, this box ~{capacity_rps:.1f}/s): {len(res.completed_ms)} completed, "
              f"{len(res.rejected_ms)} refused (429), "
              f"errors {dict(res.errors)}\n"
              f"  idle time to token {TOKENS}: median {statistics.median(idle):.0f} ms\n"
              f"  admitted, send→token {TOKENS}: p50 {p(res.completed_ms, .5):.0f} p99 {p(res.completed_ms, .99):.0f} "
              f"max {max(res.completed_ms, default=0):.0f} ms (SLA {SLA_MS:.0f})\n"
              f"  429: p50 {p(res.rejected_ms, .5):.1f} p99 {p(res.rejected_ms, .99):.1f} "
              f"max {max(res.rejected_ms, default=0):.1f} ms\n"
              f"  /health: {len(health_ms)} polls, p99 {p(health_ms, .99):.1f} max {max(health_ms, default=0):.1f} ms"
              f"; server-side SLA violations {violations:.0f}")
    print(report)

    assert res.sent > 0.8 * RATE_RPS * DURATION_S, report  # the client really offered ~5x capacity
    assert not res.errors and answered == res.sent, report  # every request answered; no error, no hang
    assert res.bad_429_headers == 0, report  # every 429: Retry-After >= 1, x-should-retry: false, type overloaded
    assert len(res.rejected_ms) > res.sent / 2, report  # overload was shed...
    assert health_ms and all(s == 200 for s, _ in poller.samples), report
    # the server counts the same: no failures, and every request it saw accounted for
    assert m.requests("failed") - before.requests("failed") == 0
    assert m.requests("rejected") - before.requests("rejected") == len(res.rejected_ms)
    assert m.requests("completed") - before.requests("completed") == len(res.completed_ms)
    assert health_status(base) == 200

    missed = {
        "capacity was used while overload was shed": len(res.completed_ms) > 0.5 * capacity_rps * DURATION_S,
        "admitted requests keep the SLA (client-side p99)": p(res.completed_ms, 0.99) <= SLA_MS,
        "none straggles far behind it (max within 2 SLAs)": max(res.completed_ms, default=0) <= 2 * SLA_MS,
        "refusals are fast (p99)": p(res.rejected_ms, 0.99) < REJECT_P99_MS,
        "/health stays quick": max(health_ms) < HEALTH_MAX_MS,
    }
    return [f"missed: {what}{report}" for what, held in missed.items() if not held]


async def _idle_times(base: str, n: int = 5, tries: int = 30) -> list[float]:
    """n requests one after another on the idle server. A refusal here means the start-up calibration came out too
    pessimistic on a busy host: the server admits a probe now and then to correct it, so try again a little later."""
    res = Results()
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as client:
        for i in range(tries):
            refused = len(res.rejected_ms)
            await one_request(client, i, res)
            if len(res.completed_ms) == n:
                break
            if len(res.rejected_ms) > refused:
                await asyncio.sleep(0.5)
    assert not res.errors and len(res.completed_ms) == n, res
    return res.completed_ms
