"""SlowSteps: a decode step slow enough that every stream stalls visibly is what a client notices, so the log says
so; at most once a minute, with how many there were since (on a CPU every step is slow)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger("parley.engine")

SLOW_STEP_S = 0.05
REPORT_EVERY_S = 60.0


class _Throttled:
    """Counts occurrences over `slow_s`; due() says when one may be logged (at most once every `every_s`)."""

    def __init__(self, slow_s: float, every_s: float, clock: Callable[[], float]) -> None:
        self.slow_s, self.every_s, self._clock = slow_s, every_s, clock
        self._unreported = 0
        self._reported_at = -math.inf

    def due(self, seconds: float) -> int:
        """0, or how many slow ones there were since the last report (this one included): report them now."""
        if seconds <= self.slow_s:
            return 0
        self._unreported += 1
        now = self._clock()
        if now - self._reported_at < self.every_s:
            return 0
        count, self._unreported, self._reported_at = self._unreported, 0, now
        return count


class SlowSteps(_Throttled):
    def __init__(self, slow_s: float = SLOW_STEP_S, every_s: float = REPORT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(slow_s, every_s, clock)

    def observe(self, batch: int, seconds: float) -> None:
        if count := self.due(seconds):
            log.warning("a decode step of %d took %.0f ms (%d steps over %.0f ms since the last report)", batch,
                        seconds * 1e3, count, self.slow_s * 1e3)


SLOW_ITERATION_S = 0.005  # an engine iteration this long delays every stream's next token visibly


class SlowIterations(_Throttled):
    """Where an engine iteration's time went, when one took longer than SLOW_ITERATION_S (each phase in ms: plan, the
    launch's parts, complete, gauges), at most once every `every_s`: what a stall between two tokens is made of."""

    def __init__(self, slow_s: float = SLOW_ITERATION_S, every_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(slow_s, every_s, clock)

    def observe(self, phases: dict[str, float]) -> None:
        total = sum(phases.values())
        if count := self.due(total):
            log.warning("an engine iteration took %.1f ms (%s; %d iterations over %.0f ms since the last report)",
                        total * 1e3, ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items()), count,
                        self.slow_s * 1e3)
