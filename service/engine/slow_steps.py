"""What stalls every stream at once, logged where it happens, throttled, with how many there were since: a decode step
slow enough to see (SlowSteps; on a CPU every step is), an engine iteration whose host work took milliseconds
(SlowIterations: its phases, and whether the thread ran, waited or was preempted), a step the GPU itself ran slowly
against its recent median (SlowGpuSteps)."""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable
from typing import NamedTuple

from service.recent_window import RecentWindow

log = logging.getLogger("parley.engine")

SLOW_STEP_S = 0.05
REPORT_EVERY_S = 60.0


class Throttled:
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


class SlowSteps(Throttled):
    def __init__(self, slow_s: float = SLOW_STEP_S, every_s: float = REPORT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(slow_s, every_s, clock)

    def observe(self, batch: int, seconds: float) -> None:
        if count := self.due(seconds):
            log.warning("a decode step of %d took %.0f ms (%d steps over %.0f ms since the last report)", batch,
                        seconds * 1e3, count, self.slow_s * 1e3)


SLOW_ITERATION_S = 0.005  # an engine iteration this long delays every stream's next token visibly


class ThreadClock(NamedTuple):
    """The engine thread's own clock at an instant: CPU seconds it has run, and how often it has blocked (a lock, the
    GIL, a device wait) and been preempted by the OS."""

    cpu_s: float
    waits: int
    preempted: int


def thread_clock() -> ThreadClock:
    """This thread's clock now: its CPU time (to the nanosecond), and on Linux its context switches (getrusage per
    thread, whose CPU times are only as fine as the scheduler's tick)."""
    if _RUSAGE_THREAD is None:
        return ThreadClock(time.thread_time(), 0, 0)
    ru = resource.getrusage(_RUSAGE_THREAD)
    return ThreadClock(time.thread_time(), ru.ru_nvcsw, ru.ru_nivcsw)


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only


class SlowIterations(Throttled):
    """Where an engine iteration's time went, when one took longer than SLOW_ITERATION_S (each phase in ms: plan, the
    launch's parts, complete, gauges), at most once every `every_s`: what a stall between two tokens is made of. With
    the thread's clock at the iteration's start, also how much of it the thread ran on a CPU, how often it blocked and
    how often the OS preempted it: a phase of a few torch calls that took milliseconds on the H100 (feed 2.7 ms, with
    the step in flight waiting for it) either ran Python all along, waited (the GIL, a lock), or was not scheduled."""

    def __init__(self, slow_s: float = SLOW_ITERATION_S, every_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(slow_s, every_s, clock)
        self._worst: tuple[float, str] | None = None  # the longest slow iteration not reported yet: (s, its text)

    def observe(self, phases: dict[str, float], since: ThreadClock | None = None,
                step: Callable[[], str] | None = None, parts: dict[str, dict[str, float]] | None = None) -> None:
        """The line logged is the longest iteration since the last report, not whichever one made the report due:
        a 23-iteration report on the H200 described a 5.8 ms one while its neighbours had stalled streams 12 ms.
        `step`: the step it launched, in words (its rows, prompt rows, positions); `parts`: a phase's own parts, shown
        as `phase: part` and taken out of it. Both are read only for a slow iteration: every step passes here."""
        total = sum(phases.values())
        if total <= self.slow_s:
            return
        if self._worst is None or total > self._worst[0]:
            ran = ""
            if since is not None:
                now = thread_clock()
                ran = (f"; the thread ran {(now.cpu_s - since.cpu_s) * 1e3:.1f} ms on a CPU, blocked "
                       f"{now.waits - since.waits} times, was preempted {now.preempted - since.preempted} times")
            launched = f" launching {step()}" if step is not None else ""
            shown = _with_parts(phases, parts) if parts else phases
            self._worst = (total, f"{total * 1e3:.1f} ms{launched} "
                                  f"({', '.join(f'{k} {v * 1e3:.1f}' for k, v in shown.items())}{ran}")
        if count := self.due(total):
            _, text = self._worst
            self._worst = None
            log.warning("an engine iteration took %s; %d iterations over %.0f ms since the last report%s)", text,
                        count, self.slow_s * 1e3, ", this the longest" if count > 1 else "")


def _with_parts(phases: dict[str, float], parts: dict[str, dict[str, float]]) -> dict[str, float]:
    """The phases, each with its parts (`parts[phase]`) after it as `phase: part`, and what they leave of it."""
    out = {}
    for name, seconds in phases.items():
        own = parts.get(name, {})
        out[name] = seconds - sum(own.values())
        out.update({f"{name}: {part}": s for part, s in own.items()})
    return out


SLOW_GPU_FACTOR = 1.5  # a step this many times the GPU's recent median took longer on the GPU itself
RECENT_GPU_STEPS = 256


class SlowGpuSteps(Throttled):
    """Steps the GPU itself ran slowly (CUDA events: not the host, not a wait), against the median of its recent
    steps of the same kind: a request alone on an idle H100 reached its 64th token 40% late with every step slower and
    no host stall, so the log says when and how much, to line up with the GPU's clocks. At most once every `every_s`.
    Kinds apart (`decode`: decode rows alone; `prompt`: a step that carries prompt rows, prefix copies or prefill
    launches): against one median, a voice sweep's ~2,000-position prompt steps were logged once a turn (2,207 in
    3 minutes, bench/NOTES.md s96), and a decode step's own stall drowned among them."""

    def __init__(self, factor: float = SLOW_GPU_FACTOR, every_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(0.0, every_s, clock)
        self.factor = factor
        self._recent: dict[str, RecentWindow] = {}

    def observe(self, seconds: float, kind: str = "decode") -> None:
        recent = self._recent.get(kind)
        if recent is None:
            recent = self._recent[kind] = RecentWindow(RECENT_GPU_STEPS)
        median = recent.median() if len(recent) >= 16 else None
        recent.add(seconds)
        if median is None:
            return
        self.slow_s = self.factor * median
        if count := self.due(seconds):
            log.warning("the GPU ran a %s step in %.2f ms, %.1fx the recent median of its kind, %.2f ms (%d such "
                        "steps since the last report)", kind, seconds * 1e3, seconds / median, median * 1e3, count)
