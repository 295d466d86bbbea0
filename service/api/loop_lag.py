"""The front end's event loop, watched: every LAG_EVERY_S a task asks to wake and observes how late it woke
(parley_front_end_loop_lag_seconds). A late wake-up is time in which no request was read, no verdict answered and no
token written, for every stream at once: on the H200 (bench/NOTES.md, s44) one bf16 sweep point saw 73 token deltas
reach the front end over 100 ms after the engine published them while the engine's own iterations stayed under 2 ms,
and nothing said where the front end's time went. A wake-up later than SLOW_LAG_S is logged (throttled), with the
garbage collections of this process since the last one."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

from prometheus_client import Histogram

log = logging.getLogger("parley")

LAG_EVERY_S = 0.005  # ~200 wake-ups a second: a few hundred microseconds of the front end's CPU a second
SLOW_LAG_S = 0.02
LOG_EVERY_S = 10.0


async def watch_loop_lag(histogram: Histogram, every_s: float = LAG_EVERY_S, slow_s: float = SLOW_LAG_S,
                         clock: Callable[[], float] = time.perf_counter) -> None:
    """Until cancelled: each wake-up's lateness into `histogram`; one later than `slow_s` logged."""
    logged_at, unlogged = -LOG_EVERY_S, 0
    collections = _collections()
    while True:
        asked = clock()
        await asyncio.sleep(every_s)
        lag = max(0.0, clock() - asked - every_s)
        histogram.observe(lag)
        if lag <= slow_s:
            continue
        unlogged += 1
        now = clock()
        if now - logged_at < LOG_EVERY_S:
            continue
        seen = _collections()
        log.warning("the front end's event loop woke %.1f ms late (%d wake-ups over %.0f ms since the last report; "
                    "garbage collections since then by generation: %s)", lag * 1e3, unlogged, slow_s * 1e3,
                    [b - a for a, b in zip(collections, seen)])
        logged_at, unlogged, collections = now, 0, seen


def _collections() -> list[int]:
    return [s["collections"] for s in gc.get_stats()]
