"""HostPath: the engine thread's path from one step's launch to the next, phase by phase, so that a gap the GPU waited
through before a step can be put down to the host's work that filled it (issue 37: the GPU never waits for the host;
the sweeps' idle p99 of 0.4-0.8 ms came with no iteration long enough for the slow-iteration log).

The engine marks each phase's end (`mark`); LoopClock closes the path at a step's start (`launched`) and keeps it with
the step. When that step's gap is read (CUDA events, an iteration or two later), the gap is the last `gap` seconds of
the path before the launch: the GPU had finished the step before and waited while the host did those phases. IdleGaps
splits each gap over GAP_S among the phases it overlapped, counts it by the one it overlapped most, and logs the
longest every few seconds with the whole path and how much of it the thread ran on a CPU (a path the thread spent
blocked, on the GIL or the OS, reads differently from one that ran slow Python).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from service.engine.slow_steps import ThreadClock, Throttled, thread_clock

log = logging.getLogger("parley.engine")

GAP_S = 100e-6  # a gap this long is ~10% of a step: counted by its cause
READ = "read"  # reading the last step's tokens: a wait on the GPU, or (the step done) the call's own cost
LAUNCH_PREP = "launch prep"  # from the last mark to the step's start: the decoder's own preparation


@dataclass
class LaunchPath:
    """The phases from one step's start to the next one's, in order (seconds each), and the engine thread's own
    clock over them: CPU seconds it ran, how often it blocked and how often the OS preempted it."""

    phases: list[tuple[str, float]] = field(default_factory=list)
    ran_s: float = 0.0
    blocked: int = 0
    preempted: int = 0

    def within(self, gap_s: float) -> dict[str, float]:
        """Each phase's seconds within the last `gap_s` before the launch, the latest first."""
        out: dict[str, float] = {}
        left = gap_s
        for phase, seconds in reversed(self.phases):
            if left <= 0:
                break
            part = min(seconds, left)
            out[phase] = out.get(phase, 0.0) + part
            left -= part
        return out

    def cause(self, gap_s: float) -> str:
        """The phase the gap overlapped most."""
        return _most(self.within(gap_s))


def _most(within: dict[str, float]) -> str:
    return max(within, key=within.__getitem__, default="unknown")


class HostPath:
    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 thread: Callable[[], ThreadClock] = thread_clock) -> None:
        self._clock, self._thread = clock, thread
        self._at = clock()
        self._thread_at = thread()
        self._phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """`phase` ended now: the time since the last mark is its."""
        now = self._clock()
        seconds, self._at = now - self._at, now
        if self._phases and self._phases[-1][0] == phase:
            self._phases[-1] = (phase, self._phases[-1][1] + seconds)
        else:
            self._phases.append((phase, seconds))

    def launched(self) -> LaunchPath:
        """A step starts now: the path to it (its last phase LAUNCH_PREP); the next path starts here."""
        self.mark(LAUNCH_PREP)
        now = self._thread()
        since, self._thread_at = self._thread_at, now
        path = LaunchPath(self._phases, now.cpu_s - since.cpu_s, now.waits - since.waits,
                          now.preempted - since.preempted)
        self._phases = []
        return path


class IdleGaps(Throttled):
    """Gaps over GAP_S before a step: counted by the phase they overlapped most, their seconds split among the phases
    they overlapped; the longest since the last report logged with its path, at most once every `every_s`."""

    def __init__(self, gaps: Counter | None = None, gap_seconds: Counter | None = None, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(GAP_S, every_s, clock)
        self.gaps, self.gap_seconds = gaps, gap_seconds
        self._worst: tuple[float, LaunchPath] | None = None

    def observe(self, gap_s: float, path: LaunchPath | None) -> None:
        if gap_s <= GAP_S or path is None:
            return
        if self.gaps is not None and self.gap_seconds is not None:
            within = path.within(gap_s)
            self.gaps.labels(after=_most(within)).inc()
            for phase, seconds in within.items():
                self.gap_seconds.labels(after=phase).inc(seconds)
        if self._worst is None or gap_s > self._worst[0]:
            self._worst = (gap_s, path)
        if count := self.due(gap_s):
            worst_s, worst = self._worst
            self._worst = None
            wall = sum(s for _, s in worst.phases)
            log.info("the GPU waited %.2f ms for a step (%s); the host's path to it since the last step's start: %s "
                     "(ms; the thread ran %.2f of its %.2f ms on a CPU, blocked %d times, was preempted %d times; %d "
                     "gaps over %.0f us since the last report)", worst_s * 1e3, worst.cause(worst_s),
                     ", ".join(f"{p} {s * 1e3:.2f}" for p, s in worst.phases), worst.ran_s * 1e3, wall * 1e3,
                     worst.blocked, worst.preempted, count, GAP_S * 1e6)
