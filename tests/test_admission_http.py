"""Admission over HTTP and the WebSocket, against a real server slowed on purpose: a burst gets on-time streams and
fast 429s in OpenAI's shape that the SDK will not retry; the latency model is readable; the metrics agree."""

import asyncio
import json
import time

import httpx
import pytest
import websockets

from tests.server_fixture import metrics, requests_total, start_server, stop_server, wait_idle

SLOTS, STEP_MS, SLA_MS, SLA_TOKENS, MAX_TOKENS = 4, 20, 1500, 16, 64


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("adm") / "parley.log", "--model", "synthetic:tiny",
                          "--max-batch", str(SLOTS), "--max-context", "512", "--step-delay-ms", str(STEP_MS),
                          "--sla-ms", str(SLA_MS), "--sla-tokens", str(SLA_TOKENS))
    yield server
    stop_server(server)


def test_latency_model_is_readable_and_saw_the_delay(slowed):
    body = httpx.get(f"{slowed.base}/v1/latency_model", timeout=10).json()
    assert set(body["decode_step_ms"]) >= {"1", "2", "4"}
    assert body["decode_step_ms"]["1"] >= STEP_MS
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
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    stamps.append(time.perf_counter() - t0)
        return {"status": 200, "stamps": stamps}


def test_burst_splits_into_on_time_streams_and_fast_429s(slowed):
    before = metrics(slowed.base)

    async def burst():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, slowed.base, i) for i in range(24)))

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
    after = wait_idle(slowed.base, slots=SLOTS)
    assert requests_total(after, "rejected") - requests_total(before, "rejected") == len(shed)
    assert after["parley_sla_violations_total"] == before.get("parley_sla_violations_total", 0)


def test_openai_sdk_does_not_retry_a_shed_request(slowed):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{slowed.base}/v1", api_key="x", max_retries=3)
    hold = [httpx.stream("POST", f"{slowed.base}/v1/completions", timeout=60,
                         json={"model": "synthetic:tiny", "prompt": "hold", "max_tokens": 200, "stream": True,
                               "ignore_eos": True}) for _ in range(SLOTS + 2)]
    opened = [h.__enter__() for h in hold]
    try:
        before = requests_total(metrics(slowed.base), "rejected")
        t0 = time.perf_counter()
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="synthetic:tiny", prompt="hi", max_tokens=MAX_TOKENS)
        assert time.perf_counter() - t0 < 0.5  # not three retries with back-off
        assert requests_total(metrics(slowed.base), "rejected") - before == 1
    finally:
        for h, r in zip(hold, opened):
            r.close()
            h.__exit__(None, None, None)
    wait_idle(slowed.base, slots=SLOTS)


def test_realtime_refusal_is_an_error_event_with_retry_after(slowed):
    hold = [httpx.stream("POST", f"{slowed.base}/v1/completions", timeout=60,
                         json={"model": "synthetic:tiny", "prompt": "hold", "max_tokens": 200, "stream": True,
                               "ignore_eos": True}) for _ in range(SLOTS + 2)]
    opened = [h.__enter__() for h in hold]

    async def turn():
        async with websockets.connect(slowed.ws) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "response.create", "response": {"input": "hi", "max_tokens": 32}}))
            return json.loads(await asyncio.wait_for(ws.recv(), 10))

    try:
        event = asyncio.run(turn())
    finally:
        for h, r in zip(hold, opened):
            r.close()
            h.__exit__(None, None, None)
    assert event["type"] == "error"
    assert event["error"]["type"] == "overloaded" and event["error"]["retry_after_ms"] > 0
    wait_idle(slowed.base, slots=SLOTS)
