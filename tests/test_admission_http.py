"""Admission over HTTP and the WebSocket, against a real server slowed on purpose: a burst gets on-time streams and
fast 429s in OpenAI's shape that the SDK will not retry; the latency model is readable; the metrics agree."""

import asyncio
import json
import math
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import httpx
import pytest
import websockets

from tests.host_steal import judge_on_a_steady_host
from tests.server_support import recv_event, scrape_metrics, served, sse_data, tiny_server, wait_idle

SLOTS, STEP_MS, SLA_MS, SLA_TOKENS, MAX_TOKENS = 4, 20, 1500, 16, 64


@pytest.fixture(scope="module")
def slowed_server(tmp_path_factory):
    """The tiny model with every decode step slowed by STEP_MS, and an SLA it can keep for a few at a time."""
    yield from served(tiny_server(tmp_path_factory.mktemp("adm") / "parley.log", "--max-batch", str(SLOTS),
                                  "--max-context", "512", "--step-delay-ms", str(STEP_MS), "--sla-ms", str(SLA_MS),
                                  "--sla-tokens", str(SLA_TOKENS)))


@contextmanager
def every_slot_held(base: str) -> Iterator[None]:
    """For the block: SLOTS + 2 long streams open, so every slot is busy and two wait."""
    with ExitStack() as streams:
        for _ in range(SLOTS + 2):
            streams.enter_context(httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
                "model": "synthetic:tiny", "prompt": "hold", "max_tokens": 200, "stream": True, "ignore_eos": True}))
        yield


def test_latency_model_is_readable_and_saw_the_delay(slowed_server):
    body = httpx.get(f"{slowed_server.base}/v1/latency_model", timeout=10).json()
    assert set(body["step_ms"]) >= {"1", "2", "4"}
    assert body["step_ms"]["1"] >= STEP_MS
    assert body["prefill_ms"] and body["sla_ms"] == SLA_MS and body["sla_tokens"] == SLA_TOKENS
    assert body["best_effort"] is False


async def stream_one(client, base, i):
    t0 = time.perf_counter()
    body = {"model": "synthetic:tiny", "prompt": f"request {i}", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "seconds": time.perf_counter() - t0, "headers": r.headers,
                    "body": r.json()}
        stamps = []
        async for line in r.aiter_lines():
            if (data := sse_data(line)) not in (None, "[DONE]"):
                chunk = json.loads(data)
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter() - t0)
        return {"status": 200, "stamps": stamps}


def test_burst_splits_into_on_time_streams_and_fast_429s(slowed_server):
    before = scrape_metrics(slowed_server.base)

    async def burst():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, slowed_server.base, i) for i in range(24)))

    results = asyncio.run(burst())
    ok = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 429]
    assert len(ok) + len(shed) == 24
    assert ok and shed
    assert len(ok) <= SLOTS + 1
    for r in ok:
        assert len(r["stamps"]) >= MAX_TOKENS - 1  # one chunk a token (the last may ride with finish_reason)
        assert r["stamps"][SLA_TOKENS - 1] * 1e3 <= SLA_MS
    for r in shed:
        assert r["headers"]["x-should-retry"] == "false"
        assert int(r["headers"]["retry-after"]) >= 1
        err = r["body"]["error"]
        assert err["type"] == "overloaded" and err["code"] == "overloaded" and err["message"]
        assert r["seconds"] < 0.5  # no prefill spent (generous: the client shares two busy cores)
    after = wait_idle(slowed_server.base)
    assert after.requests("rejected") - before.requests("rejected") == len(shed)
    assert after["parley_sla_violations_total"] == before["parley_sla_violations_total"]


def test_the_sla_clock_starts_when_the_client_sent_the_request(slowed_server):
    """Behind a router, a request may reach the server after retries or a queue: with `x-request-start` (when the
    client sent it), it is judged by the budget it has left. 1.4 s of its 1.5 s gone: refused at once, where the same
    request fresh is admitted and on time by the client's clock. Each one's transit (sent to first seen) is on
    /metrics."""
    base = slowed_server.base
    before = wait_idle(base)
    body = {"model": "synthetic:tiny", "prompt": "late", "max_tokens": SLA_TOKENS, "temperature": 0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    stale = httpx.post(f"{base}/v1/completions", json=body, timeout=30,
                       headers={"x-request-start": f"t={(time.time() - 1.4) * 1e3:.0f}"})
    assert stale.status_code == 429 and time.perf_counter() - t0 < 0.5, stale.text
    sent = time.time() - 0.1
    fresh = httpx.post(f"{base}/v1/completions", json=body, timeout=30,
                       headers={"x-request-start": f"{sent:.3f}"})
    assert fresh.status_code == 200, fresh.text
    assert time.time() - sent <= SLA_MS / 1e3  # its last token (the SLA's) within the SLA of when it was sent
    after = wait_idle(base)
    transit = "parley_request_transit_seconds"
    assert after[transit + "_count"] - before[transit + "_count"] == 2
    assert 1.5 <= after[transit + "_sum"] - before[transit + "_sum"] < 2.5  # 1.4 s and 0.1 s, and their sends


def test_openai_sdk_does_not_retry_a_shed_request(slowed_server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{slowed_server.base}/v1", api_key="x", max_retries=3)
    with every_slot_held(slowed_server.base):
        before = scrape_metrics(slowed_server.base).requests("rejected")
        t0 = time.perf_counter()
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="synthetic:tiny", prompt="hi", max_tokens=MAX_TOKENS)
        assert time.perf_counter() - t0 < 0.5  # not three retries with back-off
        assert scrape_metrics(slowed_server.base).requests("rejected") - before == 1
    wait_idle(slowed_server.base)


def test_realtime_refusal_is_an_error_event_with_retry_after(slowed_server):
    async def turn():
        async with websockets.connect(slowed_server.ws) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            await ws.send(json.dumps({"type": "response.create", "response": {"input": "hi", "max_tokens": 32}}))
            return await recv_event(ws, timeout_s=10)

    with every_slot_held(slowed_server.base):
        event = asyncio.run(turn())
    assert event["type"] == "error"
    assert event["error"]["type"] == "overloaded" and event["error"]["retry_after_ms"] > 0
    wait_idle(slowed_server.base)


# The embedded model on the CPU with a strict SLA, as a new user tried it (issues 31 and 36): `parley serve
# --sla-ms 8000 --strict-sla --max-batch 4` and a burst of 24 streamed 64-token completions. Before the admission
# guard, 4 were admitted and two or three of them reached their 64th token after 8.6-8.7 s, run after run: the
# calibration times bare steps, and a 2-core CPU streaming four replies over HTTP runs them 1.45-1.6x slower. A fresh
# server has seen nothing: its guard's prior must hold; every later burst is judged with what the earlier ones taught.
STRICT_SLA_MS, STRICT_TOKENS, STRICT_SLOTS, BURST, BURSTS = 8000, 64, 4, 24, 3
# A slower CPU gets a longer SLA, as its user would give it: one an idle server keeps with room. On the CI runner the
# calibration forecast 6.1-7.0 s to a lone request's 64th token, and a burst's one admitted request came at 7.75-8.6 s:
# 8 s is an SLA no admission keeps there every time, and failing it tests the runner, not admission.
IDLE_ROOM = 1.5


def strict_flags(cache: Path, sla_ms: int, strict: bool = True) -> tuple[str, ...]:
    # each server fresh: its guard from the prior, not from what the last one learned (--no-guard-memory)
    return ("--sla-ms", str(sla_ms), *(("--strict-sla",) if strict else ()), "--max-batch", str(STRICT_SLOTS),
            "--calibration-cache", str(cache), "--no-guard-memory")


@dataclass(frozen=True)
class CpuCalibration:
    """The strict servers' calibration, timed once and read from its cache by each of them (as a restart reads it),
    and what one request alone took on the server that timed it."""

    cache: Path
    step_ms: dict[str, float]
    idle_ms: float  # the idle server's forecast to its SLA token
    alone_ms: float  # a request alone, warm, to its SLA token by the client's clock

    def flags(self, sla_ms: int) -> tuple[str, ...]:
        return strict_flags(self.cache, sla_ms)

    @property
    def strict_sla_ms(self) -> int:
        """STRICT_SLA_MS, or IDLE_ROOM x what a request alone takes (forecast or served) where this CPU is too slow
        for it."""
        return max(STRICT_SLA_MS, math.ceil(IDLE_ROOM * max(self.idle_ms, self.alone_ms)))


@pytest.fixture(scope="module")
def cpu_calibration(tmp_path_factory) -> CpuCalibration:
    """Calibrates on a server whose SLA admits anything, and times a request alone there (the second; the first
    warms the path)."""
    from tests.server_support import start_server, stop_server

    tmp = tmp_path_factory.mktemp("strict")
    server = start_server(tmp / "calibrate.log", *strict_flags(tmp / "calibration", 600_000, strict=False))
    try:
        body = httpx.get(f"{server.base}/v1/latency_model", timeout=30).json()

        async def alone():
            async with httpx.AsyncClient(timeout=120) as client:
                return await stream_embedded(client, server.base, 0)

        timed = [asyncio.run(alone()) for _ in range(2)][-1]
        assert timed["status"] == 200, server.log_tail()
    finally:
        assert stop_server(server) == 0, server.log_tail()
    return CpuCalibration(tmp / "calibration", body["step_ms"], body["idle_time_to_sla_token_ms"],
                          timed["sla_token_s"] * 1e3)


@pytest.fixture
def strict_cpu_server(tmp_path, cpu_calibration):
    from tests.server_support import start_server

    yield from served(start_server(tmp_path / "parley.log", *cpu_calibration.flags(cpu_calibration.strict_sla_ms),
                                   "--admission-log", str(tmp_path / ADMISSION_LOG)))


ADMISSION_LOG = "admission.jsonl"


def sla_tokens_seen(log: Path) -> str:
    """The admission log's SLA-token lines so far, one per admitted request (its level, the stretch it was admitted
    with, its score): what a late burst's failure shows, so that the guard's learning can be read from CI."""
    if not log.exists():
        return ""
    keys = ("req", "level", "stretch", "score", "after_verdict_ms", "model_ms", "steps_ms", "late")
    lines = [json.loads(line) for line in log.read_text().splitlines() if '"sla_token"' in line]
    return "\n".join(json.dumps({k: x.get(k) for k in keys}) for x in lines)


async def stream_embedded(client, base, i):
    """A streamed completion of STRICT_TOKENS tokens: its status, and when its SLA token came (s from sending)."""
    t0 = time.perf_counter()
    body = {"prompt": f"Tell me a story about the number {i}.", "max_tokens": STRICT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "seconds": time.perf_counter() - t0}
        last = None  # its last token is its SLA token: it comes with the last chunk at the latest
        async for line in r.aiter_lines():
            if sse_data(line) not in (None, "[DONE]"):
                last = time.perf_counter() - t0
        return {"status": 200, "sla_token_s": last}


@pytest.mark.slow
@pytest.mark.parametrize("repeat", range(3))
def test_a_strict_sla_cpu_server_delivers_every_admitted_request_on_time(strict_cpu_server, cpu_calibration, repeat,
                                                                         tmp_path):
    """Three bursts on a fresh strict-SLA server: whatever it admits reaches its SLA token in time, every time; then
    one request on the idle server is admitted (and on time): admission never refuses what an idle server can serve.
    Three fresh servers: each starts from the guard's prior. A burst or the lone request is judged on a steady host
    (tests/host_steal.py): one the hypervisor slowed down is tried again."""
    base, sla_ms = strict_cpu_server.base, cpu_calibration.strict_sla_ms

    async def burst(n):
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(stream_embedded(client, base, i) for i in range(n)))

    def one_burst(b: int) -> list[str]:
        results = asyncio.run(burst(BURST))
        ok = [r for r in results if r["status"] == 200]
        assert {r["status"] for r in results} <= {200, 429}
        assert ok, f"burst {b}: nothing admitted\n{strict_cpu_server.log_tail()}"
        late = [round(r["sla_token_s"], 2) for r in ok if r["sla_token_s"] * 1e3 > sla_ms]
        wait_idle(base)
        time.sleep(1.1)  # past the idle server's probe interval (admission.PROBE_EVERY_S)
        return [f"burst {b}, SLA {sla_ms} ms: {len(ok)} admitted, these late (s): {late}\n"
                f"{strict_cpu_server.log_tail()}\n{sla_tokens_seen(tmp_path / ADMISSION_LOG)}"] if late else []

    def alone() -> list[str]:
        [r] = asyncio.run(burst(1))
        time.sleep(1.1)
        on_time = r["status"] == 200 and r["sla_token_s"] * 1e3 <= sla_ms
        return [] if on_time else [f"alone on the idle server, SLA {sla_ms} ms: {r}\n{strict_cpu_server.log_tail()}"]

    for b in range(BURSTS):
        judge_on_a_steady_host(partial(one_burst, b))
    judge_on_a_steady_host(alone)


@pytest.mark.slow
def test_an_sla_that_a_wave_fits_only_by_the_calibration_admits_no_one_late(tmp_path, cpu_calibration):
    """The same burst where the SLA is 1.25x what the calibration says four streams take to their 64th token, on
    whatever CPU runs it: the old margin (5%) admitted all four, which came 1.45-1.6x their forecast, late. A fresh
    server's guard judges requests beside others with its prior (1.5x) until it has seen enough: whatever it admits is
    on time, burst after burst. (The calibration is measured once and shared through its cache, so the SLA matches
    it.) Each burst is judged on a steady host (tests/host_steal.py)."""
    from tests.server_support import start_server, stop_server

    sla_ms = round(1.25 * STRICT_TOKENS * cpu_calibration.step_ms[str(STRICT_SLOTS)])
    server = start_server(tmp_path / "parley.log", *cpu_calibration.flags(sla_ms))
    try:
        async def burst(n):
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
                return await asyncio.gather(*(stream_embedded(client, server.base, i) for i in range(n)))

        def one_burst(b: int) -> list[str]:
            ok = [r for r in asyncio.run(burst(BURST)) if r["status"] == 200]
            late = [round(r["sla_token_s"], 2) for r in ok if r["sla_token_s"] * 1e3 > sla_ms]
            assert ok, f"burst {b}, SLA {sla_ms} ms: nothing admitted\n{server.log_tail()}"
            wait_idle(server.base)
            time.sleep(1.1)
            return [f"burst {b}, SLA {sla_ms} ms: {len(ok)} admitted, late (s): {late}\n{server.log_tail()}"] \
                if late else []

        for b in range(BURSTS):
            judge_on_a_steady_host(partial(one_burst, b))
    finally:
        assert stop_server(server) == 0, server.log_tail()
