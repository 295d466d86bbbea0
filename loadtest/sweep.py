"""The sweep: the highest arrival rate at which at least `target` (99%) of ALL requests get their first N tokens
within the SLA. Rejected requests count as misses, so a server cannot pass by shedding everything."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

Summary = dict[str, Any]
Measure = Callable[[float], Awaitable[Summary]]


def holds(summary: Summary, target: float) -> bool:
    return (summary.get("sla_attainment_all") or 0.0) >= target


async def find_max_rate(measure: Measure, target: float = 0.99, rates: Sequence[float] | None = None,
                        start: float = 1.0, max_rate: float = 1024.0, bisect_steps: int = 3,
                        ) -> tuple[list[tuple[float, Summary]], float | None]:
    """Measure at `rates` if given; else double from `start` until the SLA breaks (or `max_rate`), then bisect
    `bisect_steps` times between the last rate that held and the first that broke. Returns every
    (rate, summary) in the order measured and the highest rate that held (None if none did)."""
    points: list[tuple[float, Summary]] = []

    async def ok(rate: float) -> bool:
        summary = await measure(rate)
        points.append((rate, summary))
        return holds(summary, target)

    if rates:
        for rate in rates:
            await ok(rate)
        good = [r for r, s in points if holds(s, target)]
        return points, max(good) if good else None
    lo, hi, rate = 0.0, None, start
    while rate <= max_rate:
        if not await ok(rate):
            hi = rate
            break
        lo, rate = rate, rate * 2
    if hi is not None:
        for _ in range(bisect_steps):
            mid = (lo + hi) / 2
            if await ok(mid):
                lo = mid
            else:
                hi = mid
    return points, lo if lo > 0 else None
