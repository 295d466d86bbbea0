"""The engine's way back to a front end, one step's message at a time: ZeroMQ PUSH/PULL against the frame socket
(CPU; run it on the GPU host too: hosts differ by 2x here).

    python -m bench token-hop [--messages 4000] [--period-us 760 1080] [--rounds 2] [--tag TAG]

A child process plays the engine thread: every `period` (a decode step: 760 µs FP8, 1,080 bf16 on the H100) it sends
one StepOutput of four streams' tokens, stamped when sent. The parent plays a front end on uvloop (as `parley serve`
runs it) and records the hop: read minus stamp (perf_counter is CLOCK_MONOTONIC: one clock across processes). Two
ways, alternated round by round on the same host:

- `zmq`: what the engine used to send on (service/engine/ipc.py: PUSH/PULL over `ipc://`, the front end's reader a
  zmq.asyncio socket): each message passes an I/O thread on either side;
- `frames`: service/engine/frame_socket.py, what it sends on now: the engine thread writes the socket, the event loop
  reads it when it turns readable.

A token's gap to the next is a step plus the difference of two hops, so the hop's spread (p99 - p50) is what the
inter-token tail can shed. Writes bench/results/token-hop-<host>[-TAG].{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from bench.device import file_stem
from bench.publish import RESULTS, publish
from service.engine import ipc
from service.engine.frame_socket import FrameReader, FrameSender
from service.engine.messages import Out, StepOutput

WAYS = ("zmq", "frames")
STREAMS = 4
QUANTILES = (0.5, 0.9, 0.99, 0.999)


def _step_output() -> StepOutput:
    return StepOutput([Out(1000 + i, " word", [1234], None, None, None, None) for i in range(STREAMS)],
                      time.perf_counter())


def _engine(way: str, root: str, messages: int, period_s: float) -> None:
    """The engine thread's sends, one a period, each stamped as it is encoded."""
    addr = ipc.Addresses(root)
    ctx = zmq.Context()
    if way == "zmq":
        push = ipc.push(ctx, addr.front_end(0))
        send: Callable[[bytes], None] = lambda frame: push.send(frame, copy=False)  # noqa: E731
    else:
        sender = FrameSender.connect(addr.front_end_frames(0))
        send = sender.send
    time.sleep(0.3)  # the reader is up
    due = time.perf_counter()
    for _ in range(messages):
        due += period_s
        while (left := due - time.perf_counter()) > 0:
            time.sleep(left)
        send(ipc.ENCODER.encode(_step_output()))
    send(b"")  # the end
    time.sleep(0.2)
    ctx.destroy(linger=0)


async def _front_end(way: str, root: str, messages: int, period_s: float) -> list[float]:
    addr = ipc.Addresses(root)
    hops: list[float] = []
    done = asyncio.get_running_loop().create_future()

    def on_frame(frame: bytes, received: float) -> None:
        if not frame:
            done.set_result(None)
            return
        m = ipc.TO_FRONT_END.decode(frame)
        assert isinstance(m, StepOutput) and m.sent is not None
        hops.append(received - m.sent)

    ctx = zmq.asyncio.Context()
    if way == "zmq":
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.RCVHWM, 0)
        pull.bind(addr.front_end(0))

        async def read() -> None:
            while not done.done():
                frame = await pull.recv()
                on_frame(frame, time.perf_counter())

        reading: Awaitable[None] = asyncio.ensure_future(read())
    else:
        reader = FrameReader(addr.front_end_frames(0), on_frame)
    proc = mp.get_context("spawn").Process(target=_engine, args=(way, root, messages, period_s), daemon=True)
    proc.start()
    await asyncio.wait_for(done, timeout=60 + messages * period_s * 3)
    proc.join(5)
    if way == "zmq":
        await reading
    else:
        reader.close()
    ctx.destroy(linger=0)
    return hops


def measure(way: str, messages: int, period_us: float,
            run: Callable[[Coroutine[Any, Any, list[float]]], list[float]] = asyncio.run) -> dict[str, float]:
    hops = run(_front_end(way, ipc.Addresses.fresh().root, messages, period_us / 1e6))
    us = sorted(h * 1e6 for h in hops[len(hops) // 20:])  # the first 5%: both sides warming up
    row = {f"p{q * 100:g}": round(us[min(len(us) - 1, int(q * len(us)))], 1) for q in QUANTILES}
    return row | {"spread p99-p50": round(row["p99"] - row["p50"], 1), "messages": len(us)}


def to_markdown(result: dict) -> str:
    lines = [f"# The engine's way back to a front end, on {result['host']}", "",
             f"{result['cpus']} CPUs, {result['platform']}, Python {result['python']}, pyzmq {result['pyzmq']}, "
             f"event loop {result['loop']}. One StepOutput of {STREAMS} streams' tokens every period; the hop from "
             "the engine's send to the front end's read, µs. Rounds alternate the ways on one host.", "",
             "| period µs | round | way | p50 | p90 | p99 | p99.9 | spread p99-p50 |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["runs"]:
        lines.append(f"| {r['period_us']:g} | {r['round']} | {r['way']} | {r['p50']} | {r['p90']} | {r['p99']} | "
                     f"{r['p99.9']} | {r['spread p99-p50']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=4000)
    ap.add_argument("--period-us", type=float, nargs="+", default=[760.0, 1080.0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    loop, run = "asyncio", asyncio.run
    try:
        import uvloop

        loop, run = f"uvloop {uvloop.__version__}", uvloop.run
    except ImportError:
        pass
    runs = []
    for period in args.period_us:
        for rnd in range(1, args.rounds + 1):
            for way in args.ways:
                runs.append({"period_us": period, "round": rnd, "way": way} | measure(way, args.messages, period, run))
                print(runs[-1], flush=True)
    result = {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
              "python": platform.python_version(), "pyzmq": zmq.__version__, "loop": loop, "runs": runs}
    stem = file_stem("token-hop", result["host"]) + (f"-{args.tag}" if args.tag else "")
    md = to_markdown(result)
    publish(Path(args.out), stem, result, md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
