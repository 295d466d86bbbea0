"""ModelClock: the forecast's own time. It advances by what the latency model predicted for each step the engine
committed, so over any span its reading is how long the steps that really ran should have taken.

Beside it, the same spans in the steps' measured time (`ran`, StepDone.seconds: a step's cadence, from the previous
step's end, the host's work between steps included): a score over 1 is then split, for the log, into the steps' cadence
over the latency model's (ran / span) and the time outside any step's cadence (actual / ran: an idle engine's waits,
the SLA token's way out).

Admission scores an admitted request over its span, from its first verdict to its SLA token: actual time over this
clock's time. The load admitted after the verdict is on both sides (its steps are the steps that ran), so the score is
the latency model's error alone, over the whole span. Scored against the request's latest forecast instead, the error
of every step before that forecast was lost: under load a newcomer's verdict forecasts the admitted requests again
every few milliseconds, the latest forecast of a request was made near its end, and the guard's stretch read 1.02-1.04
at 9-16 requests in flight while requests took 1.3-1.5x their own verdict's forecast at p99 (FP8 on the H200 at 160
req/s, bench/NOTES.md "Admission's log").
"""

from __future__ import annotations

import math
import threading


class ModelClock:
    def __init__(self) -> None:
        self.reading = 0.0  # predicted seconds of every step committed so far
        self.measured = 0.0  # ...and what they took (a step not measured: as predicted)
        self._waiting: dict[str, float] = {}  # span → when it began, until a step ends after that
        self._origin: dict[str, tuple[float, float]] = {}  # span → the readings (predicted, measured) it counts from
        self._lock = threading.Lock()  # verdicts start spans; the engine's thread ticks

    def start(self, key: str, at: float) -> None:
        """A span begins at `at` (a request's first verdict); its origin is set by the first step to end after it."""
        with self._lock:
            self._waiting[key] = at

    def tick(self, predicted: float, at: float, seconds: float = 0.0) -> None:
        """A step committed at `at` after `seconds` (0: unmeasured), predicted to take `predicted` seconds. A span that
        began before the step started has all of it, and the wait before it as it ran (an idle engine's first step
        after a verdict, a long prompt's launch among them, is the forecast's to get right); one that began while it
        ran counts the part after its start as it ran: the forecast at a verdict starts from the step in flight."""
        with self._lock:
            before, measured_before = self.reading, self.measured
            self.reading += predicted
            self.measured += seconds if seconds > 0 else predicted
            start = at - seconds if seconds > 0 else -math.inf  # unmeasured: taken as in flight at the verdict
            begun = [(key, t0) for key, t0 in self._waiting.items() if t0 <= at]
            for key, t0 in begun:
                self._origin[key] = (before - (start - t0), measured_before - (start - t0)) if t0 <= start else \
                    (self.reading - (at - t0), self.measured - (at - t0))
                del self._waiting[key]

    def span(self, key: str) -> float | None:
        """The clock's seconds since the span began, to the last step committed; None before a step ended in it."""
        with self._lock:
            origin = self._origin.get(key)
            return None if origin is None else self.reading - origin[0]

    def ran(self, key: str) -> float | None:
        """The same span in the steps' measured seconds (the wait before an idle engine's first step, and a step in
        flight at its start, as they ran); None before a step ended in it."""
        with self._lock:
            origin = self._origin.get(key)
            return None if origin is None else self.measured - origin[1]

    def forget(self, key: str) -> None:
        with self._lock:
            self._waiting.pop(key, None)
            self._origin.pop(key, None)
