"""The front end's event-loop watch (service/api/loop_lag.py): a loop blocked for a while is seen as one late
wake-up of about that long, counted and logged; an idle loop's wake-ups come about on time."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram

from service.api.loop_lag import watch_loop_lag


def lags(h: Histogram) -> tuple[float, float]:
    """(count, sum) of the histogram's observations."""
    samples = {s.name: s.value for m in h.collect() for s in m.samples}
    return samples["lag_count"], samples["lag_sum"]


async def watched(block_s: float, h: Histogram) -> None:
    task = asyncio.create_task(watch_loop_lag(h, every_s=0.005, slow_s=0.02))
    await asyncio.sleep(0.1)
    if block_s:
        time.sleep(block_s)  # a handler that holds the event loop: no other task runs meanwhile
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_blocked_event_loop_is_one_late_wake_up_of_that_length(caplog: pytest.LogCaptureFixture) -> None:
    h = Histogram("lag", "", buckets=(0.01, 0.05, 0.1, 0.25), registry=CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="parley"):
        asyncio.run(watched(0.15, h))
    count, total = lags(h)
    over_50ms = count - next(s.value for m in h.collect() for s in m.samples
                             if s.name == "lag_bucket" and s.labels["le"] == "0.05")
    assert count >= 10 and over_50ms == 1, (count, over_50ms)
    assert 0.14 <= total < 0.15 + 0.05 * count, total
    assert any("event loop woke" in r.getMessage() and "ms late" in r.getMessage() for r in caplog.records)


def test_an_idle_event_loop_wakes_about_on_time(caplog: pytest.LogCaptureFixture) -> None:
    h = Histogram("lag", "", buckets=(0.01, 0.05, 0.1, 0.25), registry=CollectorRegistry())
    with caplog.at_level(logging.WARNING, logger="parley"):
        asyncio.run(watched(0.0, h))
    count, total = lags(h)
    assert count >= 10 and total / count < 0.01, (count, total)
