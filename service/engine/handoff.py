"""Handoff: work the engine thread takes on while the GPU runs a step it has launched, in order, and that another
thread takes back when the engine thread has not started it in time.

The engine process's admission verdicts are the reason. A verdict forecasts for a few hundred microseconds to a
millisecond of Python; on the input thread it competed with the engine thread for the GIL, which the engine thread
gives up in every torch call and takes back only once the other thread's switch interval ends. Under load on the
H100 (bf16, 40-80 requests/s) engine iterations took 5-8 ms of which the thread ran 2-3 ms and blocked 34-50 times,
and each such iteration left the GPU idle. On the engine thread, between launching a step and reading the one before
it, a verdict costs the GPU nothing while it fits in the step (~1 ms).

A task not started within `patience_s` (a long prefill launch in flight, an engine thread that died or hung) is run by
whichever thread calls run_stale, so a verdict never waits on a stuck engine. Tasks run one at a time, in the order
they were put: a session's close never overtakes the submit before it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("parley.engine")

PATIENCE_S = 0.02  # a task waits this long for the engine thread before another thread runs it


class Handoff:
    def __init__(self, patience_s: float = PATIENCE_S, clock: Callable[[], float] = time.perf_counter) -> None:
        self.patience_s = patience_s
        self._clock = clock
        self._tasks: deque[tuple[float, Callable[[], None]]] = deque()
        self._lock = threading.Lock()  # guards the queue
        self._running = threading.Lock()  # one runner at a time: tasks keep their order

    def put(self, task: Callable[[], None]) -> None:
        with self._lock:
            self._tasks.append((self._clock(), task))

    def pending(self) -> bool:
        return bool(self._tasks)

    def run_all(self, budget_s: float = math.inf) -> float:
        """The tasks put so far (the engine thread), until they have taken `budget_s` (the rest wait for the next
        call, or for run_stale); the seconds they took (0 where another thread is running them)."""
        started = self._clock()
        return self._run(lambda at: self._clock() - started < budget_s)

    def run_stale(self) -> float:
        """The tasks that have waited longer than patience_s, oldest first, up to the first that has not (another
        thread than the engine's); the seconds they took."""
        return self._run(lambda at: self._clock() - at >= self.patience_s)

    def _run(self, due: Callable[[float], bool]) -> float:
        if not self._tasks or not self._running.acquire(blocking=False):
            return 0.0
        started = self._clock()
        try:
            while True:
                with self._lock:
                    if not self._tasks or not due(self._tasks[0][0]):
                        break
                    _, task = self._tasks.popleft()
                try:
                    task()
                except Exception:  # one failing task must not keep the others from running
                    log.exception("a task handed to the engine thread failed")
        finally:
            self._running.release()
        return self._clock() - started
