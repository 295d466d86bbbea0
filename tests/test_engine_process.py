"""`parley serve --engine-process`: the engine in a process of its own (service/engine_process.py) behind the HTTP
front end (service/api/engine_client.py). Streaming, a dropped stream's cancel, realtime barge-in and K/V reuse,
constrained decoding compiled in the engine process, one /metrics with every series once, the drain on SIGTERM; and
either process killed mid-stream: clean errors, /health 503 and why, no hang, no orphan."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

from service.api.engine_client import EngineClient, RemoteGrammar, RemoteStream, pidfd
from service.config import ServeConfig
from service.engine import ipc
from service.engine.admission import Rejected
from service.engine.grammar import GrammarError
from service.engine.request import Delta, SamplingParams
from service.engine_process import EngineService
from service.runtime import build_engine
from tests.server_support import (
    Server,
    engine_pid,
    group_pids,
    poll,
    recv_event,
    scrape_metrics,
    sse_data,
    stop_server,
    stream_killing,
    tiny_server,
    wait_idle,
)

pytestmark = pytest.mark.slow

# steps of 20 ms: a 400-token stream lasts seconds, long enough to cancel or kill it midway
SLOW = ("--engine-process", "--max-batch", "2", "--max-context", "1024", "--step-delay-ms", "20", "--sla-ms", "60000")
LONG = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def proc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = tiny_server(tmp_path_factory.mktemp("engine_process") / "parley.log", *SLOW)
    try:
        assert len(group_pids(server.proc.pid)) == 2, server.log_tail()
        yield server
    finally:
        if server.proc.poll() is None:
            stop_server(server)


def gone(pids: set[int]) -> bool:
    return not any(Path(f"/proc/{p}").exists() and _state(p) != "Z" for p in pids)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


async def send(ws: ClientConnection, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


async def until_done(ws: ClientConnection, errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """response.done's `response`; an error event before it fails the test, or is kept in `errors`."""
    while (e := await recv_event(ws, timeout_s=60))["type"] != "response.done":
        assert e["type"] != "error" or errors is not None, e
        if e["type"] == "error" and errors is not None:
            errors.append(e["error"])
    return e["response"]


@contextlib.contextmanager
def engine_service() -> Iterator[ipc.Addresses]:
    """The tiny model's EngineService on threads of this process (no server), its addresses for an EngineClient."""
    rt = build_engine(ServeConfig(model="synthetic:tiny", device="cpu", max_batch=2, max_context=128,
                                  calibration_budget_s=1, sla_ms=60000))
    addresses = ipc.Addresses.fresh()
    service = EngineService(rt, addresses)
    serving = threading.Thread(target=service.serve, daemon=True)
    serving.start()
    try:
        yield addresses
    finally:
        service.stop()
        serving.join(timeout=10)
        service.close()


def test_the_client_and_the_service_in_one_process() -> None:
    """EngineService on threads, EngineClient on this event loop (no server): a delta's usage and timings cross; a
    grammar the engine process cannot compile is a GrammarError, a prompt it cannot take a ValueError (the turn's
    400s); a cancel ends the stream at once with the usage so far; after Drain, a submit is refused 503."""

    async def go(addresses: ipc.Addresses) -> None:
        client = await EngineClient.connect(addresses)
        try:
            assert client.info.max_context == 128 and client.tokenizer.encode("hi")
            stream = await client.submit([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
            deltas = [d async for d in stream]
            last = deltas[-1]
            assert last.finish_reason == "length" and last.usage is not None and last.timings is not None
            assert last.usage.completion_tokens == 5 == sum(len(d.token_ids) for d in deltas)
            assert last.timings.ttft_ms is not None and last.timings.e2e_ms >= last.timings.ttft_ms
            with pytest.raises(GrammarError):
                await client.submit([1, 2], SamplingParams(max_tokens=2), RemoteGrammar("start: ("))
            with pytest.raises(ValueError, match="token ids"):
                await client.submit([1, 10**6], SamplingParams(max_tokens=2))
            long = await client.submit([1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
            seen = 0
            async for d in long:
                seen += len(d.token_ids)
                if seen >= 2 and d.finish_reason is None:
                    long.cancel()
                if d.finish_reason is not None:
                    assert d.finish_reason == "cancelled" and d.usage is not None and d.usage.completion_tokens < 100
            long.close()
            client.drain()
            await asyncio.sleep(0.2)  # a heartbeat after the Drain
            assert client.unavailable() is not None and client.unavailable()[0] == "draining"
            with pytest.raises(Rejected) as refused:
                await client.submit([1, 2], SamplingParams(max_tokens=2))
            assert refused.value.status == 503
        finally:
            await client.close()

    with engine_service() as addresses:
        asyncio.run(go(addresses))


def test_text_detokenized_by_the_front_end_is_the_engines() -> None:
    """A request without stop strings crosses as token ids and this front end writes its text; one with stop strings
    is detokenized in the engine process (it must read the text to stop). Greedy, both ways, the same prompts: the
    same tokens and the same text, whatever byte sequences the tiny model's byte-level tokens make (characters split
    across tokens, bytes that never make one: held, then flushed at the end); and a stop string still stops."""

    async def go(addresses: ipc.Addresses) -> None:
        client = await EngineClient.connect(addresses)
        try:
            for prompt in ([1, 2, 3], [200, 201, 202, 203], [65, 66, 67, 68, 69, 70]):
                runs = {}
                for stop in ((), ("never said",)):
                    stream = await client.submit(prompt, SamplingParams(max_tokens=24, temperature=0.0,
                                                                        ignore_eos=True, stop=stop))
                    deltas = [d async for d in stream]
                    runs[stop] = ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas),
                                  deltas[-1].finish_reason)
                (ids, here, why), (engine_ids, there, engine_why) = runs[()], runs[("never said",)]
                assert ids == engine_ids and len(ids) == 24 and why == engine_why == "length", prompt
                assert here == there and here, (prompt, here, there)
            text = runs[()][1]
            word = text[-4:-1]  # a stop string the reply writes: the engine stops where it first does
            stream = await client.submit([65, 66, 67, 68, 69, 70], SamplingParams(max_tokens=24, temperature=0.0,
                                                                                  ignore_eos=True, stop=(word,)))
            deltas = [d async for d in stream]
            assert deltas[-1].finish_reason == "stop" and "".join(d.text for d in deltas) == text[:text.index(word)]
        finally:
            await client.close()

    with engine_service() as addresses:
        asyncio.run(go(addresses))


def test_a_front_end_writes_the_text_as_the_engine_would() -> None:
    """RemoteStream's own detokenizer on the engine's deltas of token ids: a character split across two tokens comes
    whole with the second; an end-of-sequence token that stopped the reply is not shown (one let through with
    ignore_eos is a token like any); what the detokenizer holds at the end is flushed on stop and length, not on a
    cancel; deltas made here (a cancel) pass as they are."""
    from service.engine.output import TextOutput
    from service.model.synthetic import byte_tokenizer

    tok = byte_tokenizer(300)
    eos = tok.hf.token_to_id("A")  # an end-of-sequence id that would show as text (a special one shows as nothing)
    e_acute = [tok.hf.token_to_id(piece) for piece in tok.hf.encode("é").tokens]
    assert len(e_acute) == 2 and eos is not None and tok.detokenizer().add(eos) == "A"  # two bytes, two tokens

    class Client:
        def __init__(self) -> None:
            self.eos = frozenset({eos})

    async def stream(ignore_eos: bool = False) -> RemoteStream:
        return RemoteStream(Client(), 1, 3, 0.0, None, None, TextOutput(tok.detokenizer()), ignore_eos)  # type: ignore[arg-type]

    async def go() -> None:
        s = await stream()
        s.put(Delta("", [e_acute[0]]))
        s.put(Delta("", [e_acute[1]]))
        s.put(Delta("", [eos], finish_reason="stop"))
        got = [s._queue.get_nowait()[0] for _ in range(3)]
        assert [d.text for d in got] == ["", "é", ""] and got[-1].token_ids == [eos]
        held = await stream()
        held.put(Delta("", [e_acute[0]], finish_reason="length"))  # half a character at the end: flushed, as U+FFFD
        assert held._queue.get_nowait()[0].text == "\ufffd"
        cut = await stream()
        cut.put(Delta("", [e_acute[0]]))
        cut.cancel = lambda: None  # type: ignore[method-assign]
        cut.put(Delta("", [], finish_reason="cancelled"))
        assert [cut._queue.get_nowait()[0].text for _ in range(2)] == ["", ""]  # nothing flushed on a cancel
        through = await stream(ignore_eos=True)
        through.put(Delta("", [eos], finish_reason="length"))
        assert through._queue.get_nowait()[0].text == "A"

    asyncio.run(go())


def test_streams_tools_and_one_metrics(proc_server: Server) -> None:
    """A streamed completion comes token by token to [DONE]; a forced tool call is constrained by a grammar compiled
    in the engine process; /metrics has the engine's series and the front end's, each once."""
    base = proc_server.base
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                      json={"prompt": "hi", "max_tokens": 6, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [d for line in r.iter_lines() if (d := sse_data(line)) is not None]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "weather?"}], "tools": [tool], "tool_choice": "required",
        "max_tokens": 60, "temperature": 0})
    assert r.status_code == 200, r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "lookup" and "city" in json.loads(call["arguments"]), call
    text = httpx.get(f"{base}/metrics", timeout=30).text
    helps = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# HELP "))
    assert helps and max(helps.values()) == 1, [k for k, v in helps.items() if v > 1]
    series = Counter(line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#"))
    assert max(series.values()) == 1, [k for k, v in series.items() if v > 1]
    for family in ("parley_requests_total", "parley_engine_host_seconds", "parley_decode_step_seconds",
                   "parley_kv_slots_free", "parley_admission_guard_target", "parley_api_key_refusals_total",
                   "parley_info", "parley_token_delivery_seconds", "parley_token_hop_seconds",
                   "parley_front_end_loop_lag_seconds"):
        assert family in helps, family
    # the tokens' hop from the engine process to the front end, timed per delta: the streamed 6 and the tool call's
    delivered = scrape_metrics(base)
    assert delivered["parley_token_delivery_seconds_count"] >= 2
    assert delivered["parley_token_delivery_seconds_sum"] / delivered["parley_token_delivery_seconds_count"] < 0.1
    # ... and of it the hop between the processes, once a message: at most one a delta, never longer than the delivery
    hops = delivered["parley_token_hop_seconds_count"]
    assert 1 <= hops <= delivered["parley_token_delivery_seconds_count"]
    assert 0 < delivered["parley_token_hop_seconds_sum"] <= delivered["parley_token_delivery_seconds_sum"]
    assert httpx.get(f"{base}/v1/latency_model", timeout=30).json()["sla_ms"] == 60000


def test_a_dropped_stream_frees_its_slot(proc_server: Server) -> None:
    """A client that hangs up mid-stream: the engine process cancels the request before it would have ended."""
    before = wait_idle(proc_server.base)
    t0 = time.monotonic()
    events = 0
    with httpx.stream("POST", f"{proc_server.base}/v1/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            events += sse_data(line) is not None
            if events > 3:
                break
    assert events > 3, "the stream ended before the client hung up"
    after = wait_idle(proc_server.base, timeout_s=15)
    outcomes = {o: after.requests(o) - before.requests(o) for o in ("completed", "cancelled", "rejected", "failed")}
    assert outcomes["cancelled"] == 1, (outcomes, proc_server.log_tail())
    assert time.monotonic() - t0 < 6  # 400 steps of 20 ms would have taken 8 s or more


def test_realtime_barge_in_and_kv_reuse(proc_server: Server) -> None:
    """A response.cancel mid-reply gets response.done `cancelled` at once; the session's next turn finds the
    conversation's K/V cached in the engine process (the session crosses the boundary by its id)."""

    async def go() -> tuple[float, dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with connect(proc_server.ws) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            await send(ws, {"type": "response.create", "response": {
                "id": "long", "input": [{"role": "user", "content": "tell me a story"}], "max_tokens": 400,
                "ignore_eos": True, "temperature": 0}})
            while (await recv_event(ws))["type"] != "response.output_text.delta":
                pass
            t0 = time.monotonic()
            await send(ws, {"type": "response.cancel"})
            cancelled = await until_done(ws)
            waited = time.monotonic() - t0
            turns = []
            for text in ("My name is Ada.", "What is my name?"):
                await send(ws, {"type": "response.create", "response": {
                    "input": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}})
                turns.append(await until_done(ws))
            return waited, cancelled, turns[0], turns[1]

    waited, cancelled, first, second = asyncio.run(go())
    assert cancelled["status"] == "cancelled" and cancelled["id"] == "long"
    assert waited < 1.0, waited
    assert first["status"] in ("completed", "incomplete") and second["status"] in ("completed", "incomplete")
    u1, u2 = first["usage"], second["usage"]
    assert u2["cached_tokens"] >= u1["prompt_tokens"] - 2, (u1, u2)
    assert scrape_metrics(proc_server.base).requests("cancelled") >= 1


def test_the_sla_clock_crosses_with_the_request(proc_server: Server) -> None:
    """x-request-start is read in the front end and judged by admission in the engine process: a request sent 59.5 s
    ago against a 60 s SLA has 0.5 s left, less than 64 steps of 20 ms: refused at once; the same request fresh is
    admitted."""
    body = {"prompt": "late", "max_tokens": 64, "ignore_eos": True}
    stale = httpx.post(f"{proc_server.base}/v1/completions", json=body, timeout=30,
                       headers={"x-request-start": f"t={(time.time() - 59.5) * 1e3:.0f}"})
    assert stale.status_code == 429 and stale.json()["error"]["type"] == "overloaded", stale.text
    fresh = httpx.post(f"{proc_server.base}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
    assert fresh.status_code == 200, fresh.text


def test_api_keys_are_checked_in_the_front_end(tmp_path: Path) -> None:
    """--api-key with --engine-process: a call without the key is refused 401 by the front end (counted on the one
    /metrics beside the engine's series), with it served; SIGTERM then stops both processes (exit 0)."""
    server = tiny_server(tmp_path / "keys.log", *SLOW, "--api-key", "sk-test-proc")
    pids = set(group_pids(server.proc.pid))
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{server.base}/v1/completions", json=body, timeout=30).status_code == 401
        ok = httpx.post(f"{server.base}/v1/completions", json=body, timeout=30,
                        headers={"Authorization": "Bearer sk-test-proc"})
        assert ok.status_code == 200, ok.text
        m = scrape_metrics(server.base)
        assert m.total("parley_api_key_refusals_total", reason="missing", transport="http") == 1
        assert m.requests("completed") == 1 and m.requests("rejected") == 0
        assert stop_server(server) == 0, server.log_tail()
        poll(lambda: gone(pids), bool, 20, "every process of the server gone")
    finally:
        if server.proc.poll() is None:
            stop_server(server)


def test_a_killed_engine_ends_every_stream_in_an_error(tmp_path: Path) -> None:
    """SIGKILL to the engine process mid-stream: the SSE stream ends with an error event and [DONE] and the realtime
    response with response.done `failed`, at once; /health says 503 and why; the front end then exits 1 and no
    process of the server is left."""
    server = tiny_server(tmp_path / "engine_killed.log", *SLOW)
    try:
        pids = set(group_pids(server.proc.pid))
        engine = engine_pid(server)
        done: dict[str, Any] = {}
        errors: list[dict[str, Any]] = []
        started = threading.Event()

        async def realtime() -> None:
            async with connect(server.ws) as ws:
                assert (await recv_event(ws))["type"] == "session.created"
                await send(ws, {"type": "response.create",
                                "response": {"input": "hi", "max_tokens": 400, "ignore_eos": True}})
                started.set()
                done.update(await until_done(ws, errors))

        socket = threading.Thread(target=lambda: asyncio.run(realtime()))
        socket.start()
        assert started.wait(30)
        events, ended_after = stream_killing(server, LONG, engine)
        assert ended_after < 5, "the stream did not end at once"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "engine process is gone" in error["message"], error
        health = httpx.get(f"{server.base}/health", timeout=10)  # within ENGINE_GONE_GRACE_S of the death
        assert health.status_code == 503 and "engine process gone" in health.json()["status"], health.text
        socket.join(timeout=30)
        assert done.get("status") == "failed", done
        assert errors and "engine process is gone" in errors[0]["message"], errors
        assert server.proc.wait(timeout=30) == 1
        poll(lambda: gone(pids), bool, 10, "every process of the server gone")
    finally:
        if server.proc.poll() is None:
            stop_server(server)


def test_health_looks_at_the_engine_process_when_asked() -> None:
    """/health checks the engine process when it is asked, not only at the front end's watchdog's next tick: with two
    front ends, one ended a stream on the engine's death while the other's /health, asked right after, read ok (a CI
    run). A request's own check keeps the watchdog's view (no look at /proc on its path)."""
    exit_status: list[int | None] = [None]

    async def go(addresses: ipc.Addresses) -> None:
        client = await EngineClient.connect(addresses, exit_code=lambda: exit_status[0])
        try:
            assert client.unavailable(look=True) is None
            exit_status[0] = -9  # gone, and the watchdog has not looked yet
            why = client.unavailable(look=True)
            assert why is not None and why[0] == "engine_gone" and "signal 9" in why[2]
            assert client.unavailable() is None and client.dead is None  # what the watchdog saw last
            await asyncio.sleep(0.3)  # its ticks are 0.1 s apart
            assert client.dead == "it was killed by signal 9" and client.unavailable() is not None
        finally:
            await client.close()

    with engine_service() as addresses:
        asyncio.run(go(addresses))


def test_the_engine_process_s_exit_is_heard_at_once_and_never_polled_for() -> None:
    """With the engine's pid the front end hears its exit through a pidfd, at once, and never reads its status on a
    timer (a look reads /proc every 0.1 s: on the H100 host a stream's tokens came ~0.15 ms late that often)."""
    probe = pidfd(os.getpid())
    if probe is None:
        pytest.skip("no pidfds here (an old kernel, or a sandbox that refuses pidfd_open): the watch looks instead")
    os.close(probe)
    looks: list[float] = []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    def exit_code() -> int | None:
        looks.append(time.monotonic())
        return child.poll()

    async def go(addresses: ipc.Addresses) -> None:
        client = await EngineClient.connect(addresses, exit_code=exit_code, engine_pid=child.pid)
        try:
            looks.clear()
            await asyncio.sleep(0.5)
            assert looks == [] and client.dead is None  # alive: nothing looked at on the watch's ticks
            killed = time.monotonic()
            child.kill()
            while client.dead is None and time.monotonic() - killed < 0.9:  # before the heartbeat's 1 s tick
                await asyncio.sleep(0.01)
            assert client.dead == "it was killed by signal 9"
            assert client.unavailable() is not None
        finally:
            await client.close()
            child.kill()

    with engine_service() as addresses:
        asyncio.run(go(addresses))


def test_the_engine_gone_says_why_on_health(tmp_path: Path) -> None:
    """Between the engine's death and the front end's exit, /health is 503 with the reason, and a request gets a 503
    in OpenAI's shape, not a hang."""
    server = tiny_server(tmp_path / "engine_gone.log", *SLOW)
    try:
        os.kill(engine_pid(server), signal.SIGKILL)
        h = poll(lambda: httpx.get(f"{server.base}/health", timeout=5), lambda h: h.status_code == 503, 1.5,
                 "/health 503", every_s=0.05)
        assert "engine process gone" in h.json()["status"] and "signal 9" in h.json()["status"], h.text
        r = httpx.post(f"{server.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_gone", r.text
        assert server.proc.wait(timeout=30) == 1
    finally:
        if server.proc.poll() is None:
            stop_server(server)


def test_a_killed_front_end_takes_the_engine_with_it(tmp_path: Path) -> None:
    """SIGKILL to the front end mid-stream (nothing drains): the client's stream breaks rather than hangs, and the
    engine process dies with its parent (PR_SET_PDEATHSIG): no orphan holds the GPU."""
    server = tiny_server(tmp_path / "front_end_killed.log", *SLOW)
    engine = engine_pid(server)
    try:
        with pytest.raises(httpx.HTTPError):  # noqa: PT012 - the break comes mid-read
            with httpx.stream("POST", f"{server.base}/v1/completions", json=LONG, timeout=30) as r:
                assert r.status_code == 200
                for n, _ in enumerate(r.iter_lines()):
                    if n == 4:
                        server.proc.kill()
        server.proc.wait(timeout=10)
        poll(lambda: gone({engine}), bool, 10, "the engine process gone")
    finally:
        if server.proc.poll() is None:
            stop_server(server)
        if not gone({engine}):
            os.kill(engine, signal.SIGKILL)
