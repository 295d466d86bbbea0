"""Servers of their own, on the tiny synthetic model (it loads in a second): the SIGTERM drain (in-flight streams
finish, new requests get 503, the process exits 0) and the 429 shape of a refusal (Retry-After,
x-should-retry: false; the OpenAI SDK does not retry it; the WebSocket's error event carries retry_after_ms)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from tests.server_support import (
    health_status,
    poll,
    recv_event,
    scrape_metrics,
    sse_data,
    sse_events,
    stop_server,
    tiny_server,
)

pytestmark = pytest.mark.slow

SMALL = ("--max-batch", "2", "--max-context", "512")


def test_sigterm_drains_in_flight_streams_then_exits_0(tmp_path) -> None:
    server = tiny_server(tmp_path / "drain.log", *SMALL, "--step-delay-ms", "40")
    try:
        body = {"prompt": "hello", "max_tokens": 50, "ignore_eos": True, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        events: list[str] = []
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if (data := sse_data(line)) is not None:
                    events.append(data)
                    break
            server.proc.send_signal(signal.SIGTERM)
            # draining (our stream is still running, so the port is open): /health and new requests get 503
            poll(lambda: health_status(server.base, timeout_s=10), lambda status: status == 503, 10,
                 "/health 503 after SIGTERM", every_s=0.02)
            refused = httpx.post(f"{server.base}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "draining"
            assert int(refused.headers["retry-after"]) >= 1
            events += sse_events(lines)
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage["completion_tokens"] == 50  # every token, none cut by the shutdown
        finishes = [c["choices"][0]["finish_reason"] for c in map(json.loads, events[:-2]) if c["choices"]]
        assert finishes[-1] == "length"
        assert server.proc.wait(timeout=60) == 0
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit after the drain:\n{server.log_tail()}")
    finally:
        stop_server(server)
    log = server.log.read_text()
    assert "Parley listening on http://127.0.0.1" in log and "draining" in log and "drained" in log
    # the dependencies that take a request's way into the front end faster (pyproject.toml) are what uvicorn runs
    assert "event loop uvloop, HTTP parser HttpToolsProtocol" in log


def test_refusal_is_a_429_that_clients_do_not_retry(tmp_path) -> None:
    # --strict-sla with slow steps: no request can have its 64th token within 200 ms, so every one is refused
    server = tiny_server(tmp_path / "strict.log", *SMALL, "--strict-sla", "--sla-ms", "200", "--step-delay-ms", "40")
    try:
        r = httpx.post(f"{server.base}/v1/completions", json={"prompt": "hello", "max_tokens": 64}, timeout=60)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "overloaded" and err["code"] and err["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert r.headers["x-should-retry"] == "false"

        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", timeout=60)  # default retries
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="synthetic:tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=64, stream=True)
        assert e.value.status_code == 429

        async def ws_refusal() -> dict:
            async with connect(server.ws) as ws:
                assert (await recv_event(ws))["type"] == "session.created"
                await ws.send(json.dumps({"type": "response.create", "response": {"input": "hi", "max_tokens": 64}}))
                return await recv_event(ws, timeout_s=60)

        event = asyncio.run(ws_refusal())
        assert event["type"] == "error" and event["error"]["type"] == "overloaded"
        assert event["error"]["retry_after_ms"] >= 1
        # /metrics answers while refusing, and counts each refusal once: the SDK tried once (x-should-retry: false)
        assert scrape_metrics(server.base).requests("rejected") == 3
        assert health_status(server.base) == 200
    finally:
        assert stop_server(server) == 0
