"""What the engine process's transport costs per step (service/engine/ipc.py): a StepOutput of B requests' tokens
(and a few ends) encoded and sent by the engine thread, then received and decoded by a front end in another
process. Prints, per batch size, the engine thread's cost per step (build + encode + send: what its loop pays), the
front end's (receive + decode) and the one-way latency (half a round trip through an echo process).

    python -m bench ipc                 # batch sizes 1, 16, 64; 2000 steps each
    python -m bench ipc --steps 200 --batches 1 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import zmq

from service.engine import ipc
from service.engine.messages import Finish, StepOutput


def echo(root: str, ready: mp.synchronize.Event) -> None:
    """The front end's side: receive, decode, send back a byte (the round trip's other half)."""
    addresses = ipc.Addresses(root)
    ctx = zmq.Context()
    inbox = ipc.pull(ctx, addresses.front_end(0))
    back = ipc.push(ctx, addresses.engine)
    ready.set()
    spent = 0.0
    while True:
        frame = inbox.recv(copy=False)
        t0 = time.perf_counter()
        message = ipc.TO_FRONT_END.decode(frame.buffer)
        spent += time.perf_counter() - t0
        if isinstance(message, StepOutput) and not message.rids and not message.finished:
            back.send(str(spent).encode())  # the end: the decode time in all
            return
        back.send(b"")


def step_output(batch: int, step: int) -> StepOutput:
    """One iteration's output: a token for each of `batch` requests; every 64th step, one of them ends."""
    rids = list(range(step * batch, step * batch + batch))
    finished = [Finish(rids[0], "length", 7, None, 32, 64, 0, 0.1, 0.5, 5.0, 70.0, 80.0, 64)] if step % 64 == 0 else []
    return StepOutput(rids, [1000 + i for i in range(batch)], finished)


def measure(batch: int, steps: int) -> dict[str, float]:
    addresses = ipc.Addresses.fresh()
    ctx = zmq.Context()
    inbox = ipc.pull(ctx, addresses.engine)
    out = ipc.push(ctx, addresses.front_end(0))
    ready = mp.get_context("spawn").Event()
    peer = mp.get_context("spawn").Process(target=echo, args=(addresses.root, ready), daemon=True)
    peer.start()
    ready.wait(60)
    send_us, trip_us = [], []
    frame_bytes = 0
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            frame = ipc.ENCODER.encode(step_output(batch, step))
            out.send(frame, copy=False)
            t1 = time.perf_counter()
            inbox.recv()
            t2 = time.perf_counter()
            send_us.append((t1 - t0) * 1e6)
            trip_us.append((t2 - t0) * 1e6)
            frame_bytes = len(frame)
        out.send(ipc.ENCODER.encode(StepOutput([], [], [])))
        decode_s = float(inbox.recv().decode())
    finally:
        peer.join(10)
        inbox.close(linger=0)
        out.close(linger=0)
        ctx.term()
        addresses.remove()
    return {"batch": batch, "bytes": frame_bytes, "engine_p50_us": statistics.median(send_us),
            "engine_p99_us": p99(send_us), "front_end_decode_us": decode_s / steps * 1e6,
            "one_way_p50_us": statistics.median(trip_us) / 2, "one_way_p99_us": p99(trip_us) / 2}


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench ipc", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    args = p.parse_args(argv)
    print(f"{'batch':>5} {'bytes':>6} {'engine p50 us':>14} {'engine p99 us':>14} {'front end decode us':>20} "
          f"{'one-way p50 us':>15} {'one-way p99 us':>15}")
    for batch in args.batches:
        r = measure(batch, args.steps)
        print(f"{r['batch']:>5} {r['bytes']:>6} {r['engine_p50_us']:>14.1f} {r['engine_p99_us']:>14.1f} "
              f"{r['front_end_decode_us']:>20.1f} {r['one_way_p50_us']:>15.1f} {r['one_way_p99_us']:>15.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
