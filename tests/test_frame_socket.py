"""The engine's socket to a front end (service/engine/frame_socket.py): every frame arrives whole and in order, a
front end that stops reading never blocks the engine (what waits is sent once it reads again), one that is gone is
dropped, and an engine that connects again replaces the old connection."""

import asyncio
import os
import time

from service.engine.frame_socket import FrameReader, FrameSender
from service.engine.ipc import Addresses


def address() -> str:
    return Addresses.fresh().front_end_frames(0)


async def read_all(sender: FrameSender, got: list[bytes], n: int, timeout_s: float = 10.0) -> None:
    """The event loop reads until `n` frames came; meanwhile the sender flushes what waits, as the engine's next send
    (a heartbeat's at the latest) does."""
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"timed out with {len(got)} of {n} frames"
        await asyncio.sleep(0.001)
        sender.flush()


async def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_frames_of_every_size_arrive_whole_and_in_order():
    async def go():
        got: list[bytes] = []
        at = address()
        reader = FrameReader(at, lambda frame, received: got.append(frame))
        sender = FrameSender.connect(at)
        frames = [os.urandom(n) for n in (0, 1, 3, 4, 5, 100, 65_535, 65_536, 65_537, 300_000, 7)] * 3
        for f in frames:
            sender.send(f)
            await asyncio.sleep(0)  # the loop reads some as they come, not only all at the end
        await read_all(sender, got, len(frames))
        assert got == frames and sender.waiting == 0
        sender.close()
        reader.close()

    asyncio.run(go())


def test_a_front_end_that_stops_reading_never_blocks_the_engine():
    async def go():
        got: list[bytes] = []
        at = address()
        reader = FrameReader(at, lambda frame, received: got.append(frame))
        sender = FrameSender.connect(at)
        frames = [os.urandom(50_000) + i.to_bytes(4, "little") for i in range(400)]  # 20 MB: past any socket buffer
        t0 = time.perf_counter()
        for f in frames:  # the event loop does not run meanwhile: nobody reads
            sender.send(f)
        assert time.perf_counter() - t0 < 5.0 and sender.waiting > 0  # queued here, not blocked on the kernel
        await read_all(sender, got, len(frames))  # it reads again
        assert got == frames and sender.waiting == 0
        sender.close()
        reader.close()

    asyncio.run(go())


def test_a_front_end_gone_is_dropped_and_an_engine_connecting_again_replaces_the_old_connection():
    async def go():
        got: list[bytes] = []
        at = address()
        reader = FrameReader(at, lambda frame, received: got.append(frame))
        first = FrameSender.connect(at)
        first.send(b"one")
        await wait_for(lambda: got == [b"one"])
        second = FrameSender.connect(at)  # the front end said Hello again: the engine connects anew
        second.send(b"two")
        await wait_for(lambda: got == [b"one", b"two"])
        reader.close()
        for _ in range(3):  # the peer is gone: the sender notices (EPIPE or ECONNRESET) and drops what it has
            second.send(b"x" * 100_000)
            await asyncio.sleep(0.01)
        assert second.closed and second.waiting == 0
        second.send(b"after")  # a send to a dropped front end is a no-op, never an error
        first.close()

    asyncio.run(go())


def test_the_token_hop_benchmark_times_both_ways(tmp_path):
    """`python -m bench token-hop` (what the next GPU call runs beside e2e): both ways deliver every message and give
    hops a step's fraction long, into JSON and Markdown."""
    import json

    from bench.token_hop import main

    assert main(["--messages", "200", "--period-us", "1000", "--rounds", "1", "--tag", "t", "--out",
                 str(tmp_path)]) == 0
    [doc] = [json.loads(p.read_text()) for p in tmp_path.glob("token-hop-*-t.json")]
    assert [r["way"] for r in doc["runs"]] == ["zmq", "frames"]
    for r in doc["runs"]:
        assert r["messages"] == 190 and 0 < r["p50"] <= r["p99"] < 1e6
    assert "| 1000 | 1 | frames |" in next(tmp_path.glob("token-hop-*-t.md")).read_text()


def test_the_host_wake_probe_replies_on_the_front_ends_socket(tmp_path):
    """`python -m bench host-wake` plays the engine process's path with the way back on the front end's own socket:
    every hop is timed, each shorter than the round trip that holds it."""
    import json

    from bench.host_wake import main

    assert main(["--gaps-ms", "0", "--requests", "20", "--modes", "block", "--tag", "t", "--out",
                 str(tmp_path)]) == 0
    [doc] = [json.loads(p.read_text()) for p in tmp_path.glob("host-wake-*-t.json")]
    row = doc["modes"]["block"]["0"]
    for hop in ("work", "to input", "to engine", "back"):
        assert 0 < row[f"{hop} p50 us"] < row["round trip p90 us"]
