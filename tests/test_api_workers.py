"""`parley serve --api-workers N`: N front-end processes on one port, one engine process behind them
(service/api/front_ends.py). Requests reach both and stream correctly; /metrics sums the front ends' own series; a
SIGTERM drains them all; a killed front end is started again and what it left running is cancelled; a killed engine
ends every stream in an error and the server exits 1 with no process left."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from service.cli import parse
from tests.server_support import (
    Server,
    engine_pid,
    group_pids,
    poll,
    scrape_metrics,
    sse_data,
    stop_server,
    stream_killing,
    tiny_server,
    wait_idle,
)

pytestmark = pytest.mark.slow

TWO = ("--api-workers", "2", "--access-log", "--max-batch", "2", "--sla-ms", "60000")
SLOW = (*TWO, "--max-context", "1024", "--step-delay-ms", "20")  # a 400-token stream lasts seconds
LONG = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "hi there", "max_tokens": 8, "temperature": 0}


def front_end_pids(server: Server) -> list[int]:
    """The front ends' pids, by number, as the supervisor logged them."""
    found = poll(lambda: re.search(r"2 front ends on \S+ \(pids (\d+), (\d+)\)", server.log.read_text()), bool, 30,
                 "the supervisor's line naming its front ends")
    assert found is not None
    return [int(found.group(1)), int(found.group(2))]


def served_by(server: Server, path: str) -> list[int]:
    """Which front end logged each request to `path` (uvicorn's access log, at the response's start), in order."""
    return [int(m) for m in re.findall(r"uvicorn\.access\[front end (\d)\]: .*\"POST " + re.escape(path),
                                       server.log.read_text())]


def fresh_post(server: Server, body: dict, **kw: object) -> httpx.Response:
    """On a connection of its own: the kernel hands each new connection to whichever front end accepts it first."""
    with httpx.Client(timeout=60) as client:
        return client.post(f"{server.base}/v1/completions", json=body, **kw)


def test_two_front_ends_serve_one_port_and_one_metrics_sums_them(tmp_path: Path) -> None:
    server = tiny_server(tmp_path / "two.log", *TWO, "--api-key", "sk-two")
    try:
        assert len(group_pids(server.proc.pid)) == 4, server.log_tail()  # the supervisor, the engine, 2 front ends
        key = {"Authorization": "Bearer sk-two"}
        texts = set()
        for n in range(1, 41):  # until both front ends have answered (each connection goes to one of them)
            r = fresh_post(server, SHORT, headers=key)
            assert r.status_code == 200, r.text
            texts.add(r.json()["choices"][0]["text"])
            if n >= 6 and set(served_by(server, "/v1/completions")) == {0, 1}:
                break
        assert set(served_by(server, "/v1/completions")) == {0, 1}, server.log_tail()
        assert len(texts) == 1  # greedy: the same reply whichever front end took it
        for _ in range(10):
            assert fresh_post(server, SHORT).status_code == 401  # no key: refused by whichever front end
        for _ in range(4):  # each scrape lands on either front end: every one reads the same sums
            m = scrape_metrics(server.base)
            assert m.total("parley_api_key_refusals_total", reason="missing", transport="http") == 10
            assert m.total("parley_token_delivery_seconds_count") >= n  # each reply's deltas, from both ends
            assert m.requests("completed") == n
    finally:
        assert stop_server(server) == 0, server.log_tail()
    assert not group_pids(server.proc.pid)


def test_sigterm_drains_every_front_end_and_leaves_no_process(tmp_path: Path) -> None:
    server = tiny_server(tmp_path / "drain.log", *SLOW)
    pids = set(group_pids(server.proc.pid))
    streams = [httpx.Client(timeout=60) for _ in range(2)]
    try:
        responses = [c.send(c.build_request("POST", f"{server.base}/v1/completions", json=LONG), stream=True)
                     for c in streams]
        lines = [r.iter_lines() for r in responses]
        for it in lines:  # both streaming
            assert any(sse_data(line) is not None for line in it)
        os.kill(server.proc.pid, signal.SIGTERM)
        for it in lines:
            events = [d for line in it if (d := sse_data(line)) is not None]
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"  # ran to its end
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
        poll(lambda: [p for p in pids if Path(f"/proc/{p}").exists()], lambda left: not left, 10, "no process left")
    finally:
        for c in streams:
            c.close()
        if server.proc.poll() is None:
            stop_server(server)


def test_a_killed_front_end_is_started_again_and_what_it_left_running_is_cancelled(tmp_path: Path) -> None:
    server = tiny_server(tmp_path / "front_end_killed.log", *SLOW)
    try:
        before = front_end_pids(server)
        with pytest.raises(httpx.HTTPError):  # noqa: PT012 - the break comes mid-read
            with httpx.stream("POST", f"{server.base}/v1/completions", json=LONG, timeout=30) as r:
                assert r.status_code == 200
                for n, _ in enumerate(r.iter_lines()):
                    if n == 4:
                        (which,) = served_by(server, "/v1/completions")
                        os.kill(before[which], signal.SIGKILL)
        poll(server.log_tail, lambda tail: f"front end {which} (pid {before[which]}) exited" in tail, 15,
             "the supervisor restarting the front end")
        poll(server.log_tail, lambda tail: f"front end {which} restarted: cancelled the 1 requests" in tail, 30,
             "the engine cancelling what it left running")
        m = wait_idle(server.base)  # its slot freed long before its 400 tokens would have run
        assert m.requests("cancelled") == 1
        assert server.proc.poll() is None and len(group_pids(server.proc.pid)) == 4
        for _ in range(4):
            assert fresh_post(server, SHORT).status_code == 200  # both front ends serve again
    finally:
        assert stop_server(server) == 0, server.log_tail()


def test_a_killed_engine_ends_every_stream_and_the_server_exits_1(tmp_path: Path) -> None:
    server = tiny_server(tmp_path / "engine_killed.log", *SLOW)
    pids = set(group_pids(server.proc.pid))
    try:
        engine = engine_pid(server)
        events, ended_after = stream_killing(server, LONG, engine)
        assert ended_after < 5, "the stream did not end at once"
        assert events[-1] == "[DONE]" and "engine process is gone" in json.loads(events[-2])["error"]["message"]
        health = httpx.get(f"{server.base}/health", timeout=10)
        assert health.status_code == 503 and "engine process gone" in health.json()["status"], health.text
        assert server.proc.wait(timeout=30) == 1, server.log_tail()
        poll(lambda: [p for p in pids if Path(f"/proc/{p}").exists()], lambda left: not left, 10, "no process left")
    finally:
        if server.proc.poll() is None:
            stop_server(server)


def test_many_front_ends_need_the_engine_in_a_process_of_its_own() -> None:
    assert parse(["serve", "--api-workers", "3"]).api_workers == 3
    with pytest.raises(SystemExit) as e:
        parse(["serve", "--api-workers", "2", "--no-engine-process"])
    assert e.value.code == 2


def test_two_front_ends_on_a_gpu_and_one_on_the_cpu_unless_asked() -> None:
    """Unset, --api-workers is 2 where the engine runs in its own process on a GPU (what the H200's calls measured
    faster tokens and barge-ins with), 1 on the CPU (its few cores are the engine's) or with the engine a thread."""
    from service.config import engine_in_own_process, front_end_count

    assert parse(["serve"]).api_workers is None
    assert front_end_count(parse(["serve", "--device", "cuda"])) == 2
    assert engine_in_own_process(parse(["serve", "--device", "cuda"]))
    assert front_end_count(parse(["serve", "--device", "cuda", "--no-engine-process"])) == 1
    assert front_end_count(parse(["serve", "--device", "cpu"])) == 1
    assert front_end_count(parse(["serve", "--device", "cpu", "--engine-process"])) == 1
    assert front_end_count(parse(["serve", "--device", "cuda", "--api-workers", "3"])) == 3


def test_a_step_with_no_decode_row_is_the_megakernels_widest_on_a_gpu_else_max_rows() -> None:
    """Unset, --prefill-rows is 64 for the megakernel on a GPU (its rows cost less the more a step carries), not
    with --batch-invariant (every step would pad to it), and --max-rows for the reference decoder; given, it is
    kept, and one below --max-rows is refused with exit 2."""
    from service.config import step_prefill_rows

    gpu = parse(["serve", "--device", "cuda"])
    assert step_prefill_rows(gpu, "megakernel", "cuda", 16) == 64
    assert step_prefill_rows(gpu, "reference", "cuda", 16) == 16
    assert step_prefill_rows(parse(["serve", "--device", "cpu"]), "reference", "cpu", 16) == 16
    assert step_prefill_rows(parse(["serve", "--batch-invariant"]), "megakernel", "cuda", 16) == 16
    assert step_prefill_rows(parse(["serve", "--prefill-rows", "32"]), "megakernel", "cuda", 16) == 32
    assert step_prefill_rows(parse(["serve", "--prefill-rows", "32"]), "reference", "cpu", 16) == 32
    with pytest.raises(SystemExit) as e:
        parse(["serve", "--max-rows", "16", "--prefill-rows", "8"])
    assert e.value.code == 2


def test_the_cpu_engine_leaves_a_core_to_the_front_end_unless_asked() -> None:
    """Unset, --cpu-threads is one fewer than the cores (at least one): the front end and the clients keep a core,
    and the engine's torch threads are not stalled at every op's barrier by them."""
    from service.config import engine_cpu_threads

    cpu = parse(["serve", "--device", "cpu"])
    assert [engine_cpu_threads(cpu, cores=cores) for cores in (1, 2, 8)] == [1, 1, 7]
    assert 1 <= engine_cpu_threads(cpu) < max(2, len(os.sched_getaffinity(0)))
    assert engine_cpu_threads(parse(["serve", "--cpu-threads", "3"]), cores=2) == 3
    with pytest.raises(SystemExit) as e:
        parse(["serve", "--cpu-threads", "0"])
    assert e.value.code == 2
