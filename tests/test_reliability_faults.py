"""Faults: a decode step that raises fails only the requests in that step, each client gets an error in its own
protocol, and the engine goes on; a sampling error fails only its request; a wedged engine turns /health 503 (and
refuses new work at once) so that an orchestrator restarts it; SIGTERM drains every kind of request in flight.

Servers of their own on the tiny synthetic model. tests/test_api_lifecycle.py already drains one SSE stream on
SIGTERM; the drain test here has a non-streaming chat request and a WebSocket response in flight as well.
"""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import time
from typing import Any

import httpx
import pytest
import torch
from websockets.asyncio.client import connect

from service.backends.decoder import DecodeOutput
from service.backends.reference import ReferenceDecoder
from service.engine.engine import Engine
from service.engine.request import Delta, SamplingParams
from service.model.loader import load_model
from tests.server_support import (
    assert_openai_error,
    health_status,
    poll,
    recv_event,
    sse_events,
    stop_server,
    tiny_server,
    wait_idle,
)

LAX = ("--sla-ms", "600000")  # admission is not the point here: no 429 from a busy host
# the thread engine (the default), and the engine in a process of its own (tests/test_engine_process.py has the rest)
ENGINES = pytest.mark.parametrize("engine", [(), ("--engine-process",)], ids=["thread", "process"])

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}


# -- a failing decode step ----------------------------------------------------------------------------------------
def test_a_failing_step_fails_its_requests_in_each_protocol_and_the_engine_goes_on(tmp_path) -> None:
    # Step 12 of users' requests raises (the warm-up and calibration do not count): 12 x 20 ms after the first
    # request starts decoding, by which time the other two have joined the batch.
    server = tiny_server(tmp_path / "fail.log", *LAX, "--max-batch", "4", "--max-context", "512",
                         "--step-delay-ms", "20", "--fail-step", "12")
    try:
        async def go() -> tuple[list[str], httpx.Response, list[dict[str, Any]]]:
            async with httpx.AsyncClient(base_url=server.base, timeout=TIMEOUT_S) as client:
                async with client.stream("POST", "/v1/completions", json={"prompt": "one", "stream": True, **LONG}
                                         ) as sse:
                    assert sse.status_code == 200
                    lines = sse.aiter_lines()
                    first = await anext(lines)  # decoding has begun: the others join the batch now

                    async def chat() -> httpx.Response:
                        return await client.post("/v1/chat/completions", json={
                            "messages": [{"role": "user", "content": "two"}], **LONG})

                    async def realtime() -> list[dict[str, Any]]:
                        async with connect(server.ws) as ws:
                            await recv_event(ws)
                            await ws.send(json.dumps({"type": "response.create", "response": {"input": "three",
                                                                                               **LONG}}))
                            events = [await recv_event(ws)]
                            while events[-1]["type"] != "response.done":
                                events.append(await recv_event(ws))
                            # the socket goes on: the next response completes
                            await ws.send(json.dumps({"type": "response.create", "response": {
                                "input": "four", "max_tokens": 3, "ignore_eos": True}}))
                            while (e := await recv_event(ws))["type"] != "response.done":
                                pass
                            assert e["response"]["status"] == "incomplete", e  # cut by max_tokens
                            return events

                    chat_task, ws_task = asyncio.create_task(chat()), asyncio.create_task(realtime())
                    rest = [line async for line in lines]
                    return sse_events([first, *rest]), await chat_task, await ws_task

        events, chat, ws_events = asyncio.run(go())

        # SSE: the stream ends with an error event, then [DONE]
        assert events[-1] == "[DONE]", events[-3:]
        assert_openai_error(json.loads(events[-2]), code="engine_error", type="server_error")
        assert "injected fault" in json.loads(events[-2])["error"]["message"]
        # non-streaming: a 500 in OpenAI's shape
        assert chat.status_code == 500, chat.text
        assert_openai_error(chat.json(), code="engine_error", type="server_error")
        # WebSocket: an error event, then response.done with status failed
        done = ws_events[-1]["response"]
        assert done["status"] == "failed" and "injected fault" in done["status_details"]["error"]["message"]
        errors = [e for e in ws_events if e["type"] == "error"]
        assert len(errors) == 1 and errors[0]["error"]["code"] == "engine_error"
        assert errors[0]["error"]["type"] == "server_error"

        # the engine goes on
        r = httpx.post(f"{server.base}/v1/completions", json={"prompt": "after", "max_tokens": 5, "ignore_eos": True},
                       timeout=TIMEOUT_S)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert health_status(server.base) == 200
        m = wait_idle(server.base)
        assert m.requests("failed") == 3
    finally:
        assert stop_server(server) == 0, server.log_tail()


# -- a sampling error ---------------------------------------------------------------------------------------------
POISON = 511  # a prompt that starts with this token gets NaN logits in every decode step


class NaNLogitsDecoder:
    """The reference decoder, but the rows of slots whose prompt started with POISON come back NaN: a numerical
    fault in one sequence, which makes sampling (torch.multinomial) raise for that request only."""

    def __init__(self, inner: ReferenceDecoder) -> None:
        self.inner, self.poisoned = inner, set[int]()
        self.config, self.max_slots, self.max_context = inner.config, inner.max_slots, inner.max_context
        self.device, self.name, self.draws_tokens = inner.device, inner.name, False
        self.slow_prefills = self.query_block_steps = 0

    def prefill(self, slot: int, token_ids: list[int], start_pos: int = 0) -> torch.Tensor:
        (self.poisoned.add if token_ids[0] == POISON else self.poisoned.discard)(slot)
        return self.inner.prefill(slot, token_ids, start_pos)

    def decode(self, slots: list[int], token_ids: list[int], positions: list[int], draws: object = None,
               sampled_rows: int | None = None, masks: dict | None = None) -> DecodeOutput:
        for s, t, p in zip(slots, token_ids, positions):  # a prompt's first token rides in a step
            if p == 0:
                (self.poisoned.add if t == POISON else self.poisoned.discard)(s)
        out = self.inner.decode(slots, token_ids, positions, sampled_rows=sampled_rows, masks=masks)
        logits = out.logits.clone()
        for i in range(len(logits)):
            if slots[i] in self.poisoned:
                logits[i] = float("nan")
        return DecodeOutput(logits, out.argmax)


def test_a_sampling_error_fails_only_its_request() -> None:
    model = load_model("synthetic:tiny")
    eng = Engine(NaNLogitsDecoder(ReferenceDecoder(model.config, model.weights, max_slots=4, max_context=128)),
                 model.tokenizer, eos_token_ids=())
    eng.start()
    try:
        sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
        greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        queues: list[queue.SimpleQueue[Delta]] = [queue.SimpleQueue() for _ in range(3)]
        for q, prompt, params in zip(queues, ([POISON, 1, 2], [3, 4, 5], [6, 7]), (sampled, sampled, greedy)):
            eng.submit(prompt, params, q.put)

        def last(q: queue.SimpleQueue[Delta]) -> Delta:
            while (d := q.get(timeout=TIMEOUT_S)).finish_reason is None:
                pass
            return d

        bad, good, good_greedy = (last(q) for q in queues)
        assert bad.finish_reason == "error" and "sampling failed" in (bad.error or ""), bad
        assert good.finish_reason == "length" and good.usage is not None and good.usage.completion_tokens == 12
        assert good_greedy.finish_reason == "length"
        assert eng.healthy()
        poll(lambda: eng.stats.free_slots, lambda free: free == 4, 10, "every slot free", every_s=0.01)
        assert eng.stats.running == 0
    finally:
        eng.stop()


# -- a wedged engine ----------------------------------------------------------------------------------------------
@ENGINES
def test_a_wedged_engine_turns_health_503(tmp_path, engine: tuple[str, ...]) -> None:
    wedge_s = 2.0
    server = tiny_server(tmp_path / "wedge.log", *LAX, "--max-batch", "2", "--max-context", "256", "--hang-step", "3",
                         "--wedge-timeout-s", str(wedge_s), *engine)
    try:
        with httpx.Client(base_url=server.base, timeout=TIMEOUT_S) as client:
            assert client.get("/health").status_code == 200
            # This request's third decode step never returns; its stream stalls after two tokens.
            stalled = client.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 50,
                                                                     "ignore_eos": True, "stream": True},
                                    timeout=httpx.Timeout(TIMEOUT_S, read=wedge_s + 30))
            r = stalled.__enter__()
            try:
                assert r.status_code == 200
                t0 = time.monotonic()
                # the event loop is free: /health answers at once, 503 once the step has hung for wedge_s
                h = poll(lambda: client.get("/health", timeout=5), lambda h: h.status_code == 503, wedge_s + 15,
                         "/health 503 with a wedged engine")
                assert h.json() == {"status": "engine unhealthy"} and h.headers["retry-after"]
                assert time.monotonic() - t0 >= wedge_s - 0.5  # not before the timeout
                # new work is refused at once, not queued behind the wedge
                t1 = time.monotonic()
                refused = client.post("/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=10)
                assert refused.status_code == 503, refused.text
                assert_openai_error(refused.json(), code="engine_unhealthy", type="service_unavailable")
                assert time.monotonic() - t1 < 5
            finally:
                server.proc.kill()  # what an orchestrator does to a wedged replica
                stalled.__exit__(None, None, None)
    finally:
        stop_server(server)


# -- a graceful shutdown ------------------------------------------------------------------------------------------
@ENGINES
def test_sigterm_drains_every_kind_of_request_in_flight(tmp_path, engine: tuple[str, ...]) -> None:
    server = tiny_server(tmp_path / "drain.log", *LAX, "--max-batch", "4", "--max-context", "256",
                         "--step-delay-ms", "30", *engine)
    n = 40  # ~1.2 s of decoding each: SIGTERM lands mid-generation
    body = {"max_tokens": n, "ignore_eos": True, "temperature": 0}
    try:
        async def go() -> tuple[list[str], httpx.Response, dict[str, Any], int]:
            async with httpx.AsyncClient(base_url=server.base, timeout=TIMEOUT_S) as client:
                async with connect(server.ws) as ws:
                    await recv_event(ws)
                    await ws.send(json.dumps({"type": "response.create", "response": {"input": "ws", **body}}))
                    chat = asyncio.create_task(client.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "chat"}], **body}))
                    async with client.stream("POST", "/v1/completions", json={"prompt": "sse", "stream": True,
                                                                              **body}) as sse:
                        lines = sse.aiter_lines()
                        first = await anext(lines)
                        server.proc.send_signal(signal.SIGTERM)
                        rest = [line async for line in lines]
                    while (e := await recv_event(ws))["type"] != "response.done":
                        pass
                    return sse_events([first, *rest]), await chat, e["response"], 0

        events, chat, ws_done, _ = asyncio.run(go())
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == n
        assert ws_done["status"] == "incomplete" and ws_done["usage"]["completion_tokens"] == n
        assert server.proc.wait(timeout=60) == 0
    finally:
        stop_server(server)
    log = server.log.read_text()
    assert "draining" in log and "drained" in log


def test_metrics_and_health_stay_quick_while_requests_fail(tmp_path) -> None:
    """Every request of a step fails: /metrics counts them, nothing stays running, the server answers on."""
    server = tiny_server(tmp_path / "fail1.log", *LAX, "--max-batch", "2", "--max-context", "256", "--fail-step", "1")
    try:
        r = httpx.post(f"{server.base}/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True},
                       timeout=TIMEOUT_S)
        events = sse_events(r.text)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert_openai_error(json.loads(events[-2]), code="engine_error")
        m = wait_idle(server.base)
        assert m.requests("failed") == 1 and m["parley_kv_slots_free"] == 2
        assert health_status(server.base) == 200
    finally:
        assert stop_server(server) == 0
