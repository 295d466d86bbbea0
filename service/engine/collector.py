"""Collector: Python's garbage collections run by the engine thread beside a step it has launched, instead of wherever
an allocation happens to cross the collector's threshold.

A collection holds the GIL. Left to CPython, one starts inside whatever allocates the 700th young container: an
admission verdict handed to the engine thread, the commit of a step, the plan of the next. On the H200 under realtime
voice at 4 and 8 sessions/s, 32 of the 51 steps held up by a long handed-over task (1-3.5 ms, each step 2x its
prediction) had a collection of 1-2.8 ms within them. Most of what those collections freed were refusals' reference
cycles (fixed in engine.py: 58 collections of 1 ms or more a run fell to 2-4); what is left runs here: the engine
thread collects right after a launch, once the handed-over work has had the step's slack, while the GPU runs a whole
step (bench/NOTES.md "Refusals without reference cycles; collections beside the step"). CPython's own trigger stays,
raised to BACKSTOP young containers, for a thread that allocates while the engine thread is not pacing (a long prefill
launch, a stuck step). Full collections (generation 2) run when the engine goes idle, or beside a step once FULL_EVERY
collections of generation 1 have passed without one.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

PACE = 700  # young containers that make a collection due (CPython's default threshold)
BACKSTOP = 20 * PACE  # CPython's own trigger while the collector paces: only where the engine thread does not
GEN1_EVERY = 10  # collections of generation 0 per one of generation 1 (CPython's default)
FULL_EVERY = 100  # collections of generation 1 beside steps before a full one is run there anyway (idle runs it first)


class Collector:
    """Paces the process's garbage collections from the engine thread: `beside_step(slack_s)` after a launch,
    `when_idle()` before the engine waits for work. install() raises CPython's own threshold, uninstall() restores
    it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._saved: tuple[int, int, int] | None = None

    def install(self) -> Collector:
        if self._saved is None:
            self._saved = gc.get_threshold()
            gc.set_threshold(BACKSTOP, GEN1_EVERY, GEN1_EVERY)
        return self

    def uninstall(self) -> None:
        if self._saved is not None:
            gc.set_threshold(*self._saved)
            self._saved = None

    def due(self) -> int | None:
        """The generation a collection now would take, or None where none is due."""
        young, gen0s, gen1s = gc.get_count()
        if young < PACE or not gc.isenabled():
            return None
        if gen0s + 1 < GEN1_EVERY:
            return 0
        return 2 if gen1s + 1 >= FULL_EVERY else 1

    def beside_step(self, slack_s: float) -> tuple[str, float] | None:
        """The due collection, unless the handed-over work has used up the step's slack (`slack_s` <= 0) and the young
        containers are under twice the pace (then it waits for the next step, about); its (kind, seconds) for the
        step's handed-over work, or None. (Waiting for a step with room for a collection's expected time made each
        one scan twice the containers, and take twice as long, on the H200.)"""
        gen = self.due()
        if gen is None or (slack_s <= 0 and gc.get_count()[0] < 2 * PACE):
            return None
        return self._collect(gen)

    def when_idle(self) -> tuple[str, float] | None:
        """Before the engine waits for work: a full collection where a collection of generation 1 has run since the
        last full one, else the collection that is due, if any."""
        if gc.isenabled() and gc.get_count()[2] > 0:
            return self._collect(2)
        gen = self.due()
        return None if gen is None else self._collect(gen)

    def _collect(self, gen: int) -> tuple[str, float]:
        t0 = self._clock()
        gc.collect(gen)
        return f"gc{gen}", self._clock() - t0
