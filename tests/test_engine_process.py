"""The two processes of `parley serve` (service/engine_process.py, service/api/engine_client.py): either one killed
mid-stream leaves clean errors, no hang and no orphan; /metrics is the engine's registry, every series once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.server_support import (
    ROOT,
    Server,
    group_pids,
    health_status,
    poll,
    recv_event,
    sse_data,
    stop_server,
    tiny_server,
)

pytestmark = pytest.mark.slow

SMALL = ("--max-batch", "2", "--max-context", "512", "--step-delay-ms", "20")  # a stream lasts seconds


def engine_pid(server: Server) -> int:
    """The engine process: the one child of `parley serve` that runs service.engine_process."""
    for pid in group_pids(server.proc.pid):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"service.engine_process" in cmdline:
            return pid
    raise AssertionError(f"no engine process in the group of {server.proc.pid}:\n{server.log_tail()}")


def gone(pids: set[int]) -> bool:
    return not any(os.path.exists(f"/proc/{p}") and "zombie" not in _state(p) for p in pids)


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/status").read().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (OSError, IndexError):
        return "zombie"


def test_metrics_has_every_series_once(shared_server: Server) -> None:
    """One /metrics for the server, from the engine process: each family described once, each series (name and
    labels) exactly once, the engine's own series (steps, KV slots, GC pauses) among them."""
    httpx.post(f"{shared_server.base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    text = httpx.get(f"{shared_server.base}/metrics", timeout=30).text
    helps = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# HELP "))
    assert helps and max(helps.values()) == 1, [k for k, v in helps.items() if v > 1]
    series = Counter(line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#"))
    assert max(series.values()) == 1, [k for k, v in series.items() if v > 1]
    for family in ("parley_requests_total", "parley_engine_host_seconds", "parley_decode_step_seconds",
                   "parley_kv_slots_free", "parley_gc_pause_seconds", "parley_time_to_first_token_seconds",
                   "parley_info"):
        assert family in helps, family


def test_a_killed_engine_ends_every_stream_in_an_error_and_the_server_exits(tmp_path) -> None:
    """SIGKILL to the engine process mid-stream: the SSE stream ends with an error event and [DONE], the realtime
    response with response.done `failed`, at once; /health says 503 and why; then the front end exits 1 and no
    process of the server is left."""
    server = tiny_server(tmp_path / "engine_killed.log", *SMALL)
    try:
        pids = set(group_pids(server.proc.pid))
        engine = engine_pid(server)
        events: list[str] = []
        done: dict = {}

        async def realtime() -> None:
            async with connect(server.ws) as ws:
                assert (await recv_event(ws))["type"] == "session.created"
                await ws.send(json.dumps({"type": "response.create",
                                          "response": {"input": "hi", "max_tokens": 400, "ignore_eos": True}}))
                while (event := await recv_event(ws, timeout_s=30))["type"] != "response.done":
                    pass
                done.update(event)

        socket = threading.Thread(target=lambda: asyncio.run(realtime()))
        socket.start()
        body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if (data := sse_data(line)) is not None:
                    events.append(data)
                    if len(events) == 3:
                        os.kill(engine, signal.SIGKILL)
                        killed = time.monotonic()
        assert time.monotonic() - killed < 5, "the stream did not end at once"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "server_error" and "engine process is gone" in error["message"], error
        health = httpx.get(f"{server.base}/health", timeout=10)
        assert health.status_code == 503 and "engine process gone" in health.json()["status"], health.text
        socket.join(timeout=30)
        assert done["response"]["status"] == "failed", done
        assert server.proc.wait(timeout=30) == 1
        poll(lambda: gone(pids), bool, 10, "every process of the server gone")
    finally:
        if server.proc.poll() is None:
            stop_server(server)


def test_a_killed_front_end_takes_the_engine_with_it(tmp_path) -> None:
    """SIGKILL to the front end mid-stream (nothing drains): the client's stream breaks rather than hangs, and the
    engine process notices its parent gone and exits: no orphan holds the GPU."""
    server = tiny_server(tmp_path / "front_end_killed.log", *SMALL)
    pids = set(group_pids(server.proc.pid))
    engine = engine_pid(server)
    body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with pytest.raises(httpx.HTTPError):  # noqa: PT012 - the break comes mid-read
        with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n == 4:
                    server.proc.kill()
    server.proc.wait(timeout=10)
    poll(lambda: gone({engine}), bool, 10, "the engine process gone")
    poll(lambda: gone(pids), bool, 10, "every process of the server gone")
    assert health_status_or_none(server.base) is None


def health_status_or_none(base: str) -> int | None:
    try:
        return health_status(base, timeout_s=2)
    except httpx.HTTPError:
        return None


def test_the_ipc_cost_per_step_is_measured() -> None:
    """`python -m bench ipc` (the README's figure): a step's output crosses to another process and back; the engine
    thread's share per step is microseconds, not the milliseconds of a step."""
    run = subprocess.run([sys.executable, "-m", "bench", "ipc", "--steps", "200", "--batches", "1", "64"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()[1:]]
    assert [int(r[0]) for r in rows] == [1, 64]
    for r in rows:
        engine_p50_us, one_way_p50_us = float(r[2]), float(r[5])
        assert 0 < engine_p50_us < 500 and 0 < one_way_p50_us < 5000, run.stdout


def test_several_front_ends_share_the_port_and_the_engine(tmp_path) -> None:
    """--api-workers 2: two front-end processes on one port beside one engine; requests over many connections are all
    answered, /metrics still has every series once, and SIGTERM drains and stops all three processes (exit 0)."""
    server = tiny_server(tmp_path / "workers.log", "--max-batch", "4", "--max-context", "512", "--api-workers", "2")
    try:
        pids = set(group_pids(server.proc.pid))
        assert len(pids) == 3, server.log_tail()
        poll(lambda: server.log.read_text(), lambda log: "[api-1]: Application startup complete" in log, 60,
             "the second front end ready")

        async def many() -> list[int]:
            async def one(i: int) -> int:
                async with httpx.AsyncClient(timeout=60) as c:  # a connection each: the kernel spreads them
                    r = await c.post(f"{server.base}/v1/completions",
                                     json={"prompt": f"hi {i}", "max_tokens": 4, "ignore_eos": True})
                    return r.status_code
            return await asyncio.gather(*(one(i) for i in range(16)))

        assert asyncio.run(many()) == [200] * 16
        text = httpx.get(f"{server.base}/metrics", timeout=30).text
        completed = [line for line in text.splitlines()
                     if line.startswith('parley_requests_total{outcome="completed"')]
        assert len(completed) == 1 and float(completed[0].split()[-1]) >= 16, completed
        assert stop_server(server) == 0, server.log_tail()
        poll(lambda: gone(pids), bool, 10, "every process of the server gone")
    finally:
        if server.proc.poll() is None:
            stop_server(server)
