"""HostPath: the engine thread's path from one step's launch to the next, phase by phase, so that a gap the GPU waited
through before a step can be put down to the part of the host's work that made it (issue 37: the GPU never waits for
the host; the sweeps' idle p99 of 0.4-0.8 ms came with no iteration long enough for the slow-iteration log).

The engine marks each phase's end (`mark`); LoopClock closes the path at a step's start and keeps it with the step,
and when that step's gap is read (CUDA events, an iteration or two later) IdleGaps counts a gap over GAP_S by its
cause: the longest phase the GPU could not hide. Where the host waited on the GPU along the path (reading the last
step's tokens), what it did before the wait ran while the GPU was busy and cannot have made the gap: it is kept apart,
as `before the wait`, and is never the cause.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

from service.engine.slow_steps import Throttled

log = logging.getLogger("parley.engine")

GAP_S = 100e-6  # a gap this long is ~10% of a step: counted by its cause
WAITED_S = 20e-6  # a read that blocked this long waited on the GPU: the phases before it were hidden
READ_WAIT, HIDDEN = "read wait", "before the wait"
LAUNCH_PREP = "launch prep"  # from the last mark to the step's start: the decoder's own preparation


class HostPath:
    """The phases since the last step's start (seconds each), in the order they first came."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._at = clock()
        self._phases: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """`phase` ended now: the time since the last mark is its (added to it where it came before)."""
        now = self._clock()
        seconds, self._at = now - self._at, now
        if phase == READ_WAIT and seconds > WAITED_S:  # the GPU was busy until now: what came before was hidden
            self._phases = {HIDDEN: sum(self._phases.values())}
        self._phases[phase] = self._phases.get(phase, 0.0) + seconds

    def launched(self) -> dict[str, float]:
        """A step starts now: the path to it (its last part is LAUNCH_PREP); the next path starts here."""
        self.mark(LAUNCH_PREP)
        path, self._phases = self._phases, {}
        return path


def cause(path: dict[str, float]) -> str:
    """The longest phase the GPU could not hide: neither a wait on it nor what ran before that wait."""
    return max((p for p in path if p not in (READ_WAIT, HIDDEN)), key=path.__getitem__, default="unknown")


class IdleGaps(Throttled):
    """Gaps over GAP_S before a step, counted by cause (and their seconds), and the longest since the last report
    logged with its whole path, at most once every `every_s`."""

    def __init__(self, gaps: Counter | None = None, gap_seconds: Counter | None = None, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(GAP_S, every_s, clock)
        self.gaps, self.gap_seconds = gaps, gap_seconds
        self._worst: tuple[float, dict[str, float]] | None = None

    def observe(self, gap_s: float, path: dict[str, float] | None) -> None:
        if gap_s <= GAP_S or path is None:
            return
        why = cause(path)
        if self.gaps is not None and self.gap_seconds is not None:
            self.gaps.labels(after=why).inc()
            self.gap_seconds.labels(after=why).inc(gap_s)
        if self._worst is None or gap_s > self._worst[0]:
            self._worst = (gap_s, path)
        if count := self.due(gap_s):
            worst_s, worst = self._worst
            self._worst = None
            log.info("the GPU waited %.2f ms for a step (%s); the host's path to it: %s (ms; %d gaps over %.0f us "
                     "since the last report)", worst_s * 1e3, cause(worst),
                     ", ".join(f"{k} {v * 1e3:.2f}" for k, v in worst.items()), count, GAP_S * 1e6)
