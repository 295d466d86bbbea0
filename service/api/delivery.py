"""DeliveryWatch: how long the engine's tokens take to reach the front end's event loop, so that admission leaves room
for the hop.

Admission judges a request by when its SLA token is committed on the engine; the client reads it after the hop to the
front end (the engine process's socket, or the engine thread's call_soon_threadsafe) and the event loop's turn. In the
H200's voice sweep (s45) the chat turns the client saw late were, bar one, on time at the engine, by 0.1-5 ms: the hop.
So each submit carries the hop's recent 99th percentile, and admission takes it off the request's deadline
(AdmissionController.check, which bounds it).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

WINDOW = 512  # the last deliveries weighed
FRESH_S = 10.0  # older ones are forgotten: a past front-end stall must not shorten every deadline for long
RECOMPUTE_S = 0.5  # the percentile is sorted again at most this often (deliveries come thousands a second)
QUANTILE = 0.99


class DeliveryWatch:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._recent: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (when, seconds)
        self._allowance = 0.0
        self._computed_at = -math.inf

    def observe(self, seconds: float) -> None:
        """A delta of tokens was read `seconds` after the engine published it (the event loop's thread)."""
        self._recent.append((self._clock(), seconds))

    def allowance(self) -> float:
        """The 99th percentile of the fresh deliveries, in seconds (0 where there are none)."""
        now = self._clock()
        if now - self._computed_at >= RECOMPUTE_S:
            fresh = sorted(s for t, s in self._recent if now - t <= FRESH_S)
            self._allowance = fresh[math.ceil(QUANTILE * len(fresh)) - 1] if fresh else 0.0
            self._computed_at = now
        return self._allowance
