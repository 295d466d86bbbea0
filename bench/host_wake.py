"""The host's wake-ups on an idle server's way to its first step, after idle gaps (CPU; run it on the GPU host).

    python -m bench host-wake [--gaps-ms 0 1 2 5 20 100] [--requests 200] [--modes block spin-input spin-both]

An idle server's first token pays every thread and process hop between the front end and the engine thread, each a
wake-up of a sleeping thread, and the front end's Python on a core that idled. Under load they are awake: on the
H100 an idle server's arrival-to-engine read 0.82 ms past the client's send, 0.52 under 110 req/s (bench/NOTES.md).
This probe plays the engine process's path (service/engine/ipc.py's ZeroMQ PUSH/PULL over a Unix socket to an input
thread that polls it, an Event that wakes the engine thread, the reply written back on the front end's own stream
socket as service/engine/frame_socket.py does) between two processes,
with the host idle for `gap` before each request, and times each hop (perf_counter is CLOCK_MONOTONIC: one clock
across processes on Linux):

- `work`: the front end's Python for a request (JSON, a loop of dict work: ~0.2 ms warm), on the core that idled;
- `to input`: the send to the engine process's input thread (two ZeroMQ I/O threads and the input thread's poll);
- `to engine`: the input thread's Event to the engine thread;
- `back`: the engine thread's reply, a frame on the front end's socket, to the front end's blocking read.

Modes, of the engine process's two threads while idle: `block` (as served: the input thread's poll with a 10 ms
timeout, the engine thread's Event), `spin-input` (the input thread polls without waiting), `spin-both` (and the
engine thread checks its flag without sleeping). Writes bench/results/host-wake-<host>[-TAG].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import threading
import time
from pathlib import Path

import zmq

from bench.device import file_stem
from bench.publish import RESULTS, publish
from service.engine import ipc
from service.engine.frame_socket import HEADER, FrameSender, unix_address

POLL_MS = 10  # the engine process's input thread (engine_process.STALE_POLL_MS)


def _engine(root: str, mode: str) -> None:
    """The engine process's path: an input thread on the PULL socket, an engine thread woken by an Event."""
    addr = ipc.Addresses(root)
    ctx = zmq.Context()
    inbox, out = ipc.pull(ctx, addr.engine), FrameSender.connect(addr.front_end_frames(0))
    wake, stop = threading.Event(), threading.Event()
    box: list[tuple[float, float]] = []
    lock = threading.Lock()

    def input_thread() -> None:
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        spin = mode in ("spin-input", "spin-both")
        while not stop.is_set():
            if poller.poll(0 if spin else POLL_MS):
                sent = json.loads(inbox.recv())
                if sent is None:
                    stop.set()
                with lock:
                    box.append((sent or 0.0, time.perf_counter()))
                wake.set()

    threading.Thread(target=input_thread, daemon=True).start()
    while not stop.is_set():
        if mode == "spin-both":
            while not wake.is_set():
                pass
        else:
            wake.wait(0.5)
        woke = time.perf_counter()
        wake.clear()
        with lock:
            got, box[:] = list(box), []
        for sent, received in got:
            out.send(json.dumps([sent, received, woke]).encode())
    time.sleep(0.05)
    out.close()
    ctx.destroy(linger=0)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise RuntimeError("the engine process closed its socket")
        data += chunk
    return bytes(data)


def _recv_frame(conn: socket.socket) -> bytes:
    (n,) = HEADER.unpack(_recv_exactly(conn, HEADER.size))
    return _recv_exactly(conn, n)


def _work() -> int:
    """A front end's kind of Python for one request: a JSON body parsed, a dict of messages built (~0.2 ms warm)."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 40}] * 4, "stream": True})
    n = 0
    for _ in range(12):
        d = json.loads(body)
        n += sum(len(m["content"]) for m in d["messages"])
        n += len({f"k{i}": i for i in range(64)})
    return n


def measure(mode: str, gaps_ms: list[float], requests: int) -> dict[str, dict[str, float]]:
    root = ipc.Addresses.fresh().root
    addr = ipc.Addresses(root)
    ctx = zmq.Context()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(unix_address(addr.front_end_frames(0)))  # bound before the engine connects, as a front end's Hello
    listener.listen(1)
    listener.settimeout(30)
    to_engine = ipc.push(ctx, addr.engine)
    proc = mp.get_context("spawn").Process(target=_engine, args=(root, mode), daemon=True)
    proc.start()
    back, _ = listener.accept()
    back.settimeout(30)
    # the first reply says the engine process is up
    to_engine.send(json.dumps(time.perf_counter()).encode())
    _recv_frame(back)
    out: dict[str, dict[str, float]] = {}
    for gap in gaps_ms:
        rows: list[tuple[float, float, float, float, float]] = []
        for _ in range(requests):
            time.sleep(gap / 1e3)
            t0 = time.perf_counter()
            _work()
            t1 = time.perf_counter()
            to_engine.send(json.dumps(t1).encode())
            frame = _recv_frame(back)
            t_back = time.perf_counter()
            sent, received, woke = json.loads(frame)
            rows.append((t1 - t0, received - sent, woke - received, t_back - woke, t_back - t0))
        cols = list(zip(*rows, strict=True))
        names = ("work", "to input", "to engine", "back", "round trip")
        out[f"{gap:g}"] = {f"{n} p50 us": round(statistics.median(c) * 1e6, 1) for n, c in zip(names, cols,
                                                                                            strict=True)}
        out[f"{gap:g}"] |= {f"{n} p90 us": round(statistics.quantiles(c, n=10)[-1] * 1e6, 1)
                            for n, c in zip(names, cols, strict=True)}
    to_engine.send(json.dumps(None).encode())
    proc.join(5)
    back.close()
    listener.close()
    ctx.destroy(linger=0)
    return out


def to_markdown(result: dict) -> str:
    lines = [f"# The host's wake-ups on an idle server's path, on {result['host']}", "",
             f"{result['cpus']} CPUs, {result['platform']}, Python {result['python']}, pyzmq {result['pyzmq']}. "
             f"{result['requests']} requests a gap; µs, p50 (p90).", ""]
    for mode, by_gap in result["modes"].items():
        lines += [f"## {mode}", "", "| gap ms | work | to input | to engine | back | round trip |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for gap, r in by_gap.items():
            cells = [f"{r[f'{n} p50 us']:.0f} ({r[f'{n} p90 us']:.0f})"
                     for n in ("work", "to input", "to engine", "back", "round trip")]
            lines.append(f"| {gap} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gaps-ms", type=float, nargs="+", default=[0, 1, 2, 5, 20, 100])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--modes", nargs="+", default=["block", "spin-input", "spin-both"],
                    choices=["block", "spin-input", "spin-both"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    result = {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
              "python": platform.python_version(), "pyzmq": zmq.__version__, "requests": args.requests,
              "modes": {m: measure(m, args.gaps_ms, args.requests) for m in args.modes}}
    stem = file_stem("host-wake", result["host"]) + (f"-{args.tag}" if args.tag else "")
    md = to_markdown(result)
    publish(Path(args.out), stem, result, md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
