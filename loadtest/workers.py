"""Several client processes for one load. One Python event loop handles some 10-20k token chunks a second
before its own lag shows up in the latencies it measures; with `--workers N` each of N processes runs a share
(rate/N, concurrency/N, sessions/N: N Poisson streams of rate R/N make one of rate R) and the records merge on one
clock (perf_counter is the system's monotonic clock, the same in every process)."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from loadtest.clients import ClientPool, Target
from loadtest.record import RequestRecord
from loadtest.runner import Load, run_phase, watch_loop_lag
from loadtest.workload import Session

MakeSessions = Callable[[], tuple[Iterator[Session], int]]


def share(total: int, n: int, w: int) -> int:
    """Worker w's part of `total` split as evenly as whole numbers go."""
    return total // n + (1 if w < total % n else 0)


def split(load: Load, n: int, w: int) -> Load:
    """Worker w's share; its own arrival stream (the same gaps in every worker would make bursts of n)."""
    return replace(load, rate=load.rate / n if load.rate else None, stream=w,
                   concurrency=share(load.concurrency, n, w) if load.concurrency else None,
                   num_sessions=share(load.num_sessions, n, w) if load.num_sessions is not None else None)


async def _work(target: Target, make_sessions: MakeSessions, load: Load, warmup: int, w: int, n: int,
                sync: Any, start: Any, out: Any) -> tuple[list[RequestRecord], list[float]]:
    # Every nth session of those one process would send: of the warm-up ones, then of the measured ones. A load with
    # no warm-up of its own (a sweep's later points) still sends one a process: a fresh process's first request pays
    # its imports and connection (100-150 ms on the H100 host), and would land on the point's first arrivals.
    warmup = warmup or n
    warm = itertools.islice(make_sessions()[0], w, warmup, n)
    end = warmup + load.num_sessions if load.num_sessions is not None else None
    sessions = itertools.islice(make_sessions()[0], warmup + w, end, n)
    mine = split(load, n, w)
    async with ClientPool(target) as pool:
        if share(warmup, n, w):
            await run_phase(pool, target, warm, mine)
        if sync.wait() == 0:  # all warmed up: one of them sets the common start, a little ahead
            start.value = time.perf_counter() + 0.02
        sync.wait()
        lag: list[float] = []
        watcher = asyncio.create_task(watch_loop_lag(lag))
        records = await run_phase(pool, target, sessions, mine,
                                  lambda r: out.put(("record", r.outcome, r.kind)), t0=start.value)
        watcher.cancel()
    return records, lag


def _worker(target: Target, make_sessions: MakeSessions, load: Load, warmup: int, w: int, n: int,
            sync: Any, start: Any, out: Any) -> None:
    try:
        out.put(("done", *asyncio.run(_work(target, make_sessions, load, warmup, w, n, sync, start, out))))
    except BaseException:
        sync.abort()
        out.put(("failed", traceback.format_exc(), None))


async def run_workers(n: int, target: Target, make_sessions: MakeSessions, load: Load, warmup: int = 0,
                      on_outcome: Callable[[str, str], None] = lambda outcome, kind: None,
                      ) -> tuple[list[RequestRecord], list[float]]:
    """Run the load in n processes; return all records (start_s/end_s on one clock) and every loop-lag sample.
    `on_outcome(outcome, kind)` as each request ends."""
    ctx = mp.get_context("spawn")
    sync, start, out = ctx.Barrier(n), ctx.Value("d", 0.0), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(target, make_sessions, load, warmup, w, n, sync, start, out),
                         daemon=True) for w in range(n)]
    for p in procs:
        p.start()
    records: list[RequestRecord] = []
    lag: list[float] = []
    done, loop = 0, asyncio.get_running_loop()
    try:
        while done < n:
            try:
                kind, a, b = await loop.run_in_executor(None, out.get, True, 1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a loadtest worker died") from None
                continue
            if kind == "record":
                on_outcome(a, b)
            elif kind == "failed":
                raise RuntimeError(f"a loadtest worker failed:\n{a}")
            else:
                records += a
                lag += b
                done += 1
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return records, lag
