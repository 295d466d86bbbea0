"""Handoff: work the engine thread takes on while the GPU runs a step it has launched, in order, and that another
thread takes back when the engine thread has not started it in time.

The engine process's admission verdicts are the reason. A verdict forecasts for a few hundred microseconds to a
millisecond of Python; on the input thread it competed with the engine thread for the GIL, which the engine thread
gives up in every torch call and takes back only once the other thread's switch interval ends. Under load on the
H100 (bf16, 40-80 requests/s) engine iterations took 5-8 ms of which the thread ran 2-3 ms and blocked 34-50 times,
and each such iteration left the GPU idle. On the engine thread, between launching a step and reading the one before
it, a verdict costs the GPU nothing while it fits in the step (~1 ms).

A task may say what it expects to take (`cost_s`), and return the rest of its work as a task of its own (`Then`), which
runs next, ahead of anything put after it. Beside a launched step, run_all starts a task only where it fits what is left
of the budget (the first of a call always runs, so every task makes progress): a verdict is two or three such tasks, the
request built and its prefix looked up, then admission's forecast, then (where the `delays` rule needs it) its second
forecast, and what does not fit beside one step waits for the next. On the H200, a step beside a verdict of 0.76 ms (the
median, admission on) took 1.47x its prediction: the host's slack beside a step is a quarter to half a millisecond, and
all handed-over work past it was the GPU's idle time (bench/NOTES.md).

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
from dataclasses import dataclass

log = logging.getLogger("parley.engine")

PATIENCE_S = 0.02  # a task waits this long for the engine thread before another thread runs it
# handed-over work run beside a launched step (--handoff-budget-ms, service/config.py): a newcomer's first half and
# its verdict beside two steps, not one (bench/NOTES.md, s73: FP8 on the H100, 0.3 against 0.5 ms)
HANDOFF_BUDGET_S = 0.0003


@dataclass(frozen=True)
class Then:
    """What a task returns where its work goes on in another task: `task`, expected to take `cost_s`."""

    task: Callable[[], Then | None]
    cost_s: float = 0.0
    kind: str = "task"  # what it is, for the admission log's steps (the longest handed-over work, by kind)


@dataclass
class _Queued:
    at: float  # when the work was handed over (a Then keeps its task's)
    cost_s: float
    task: Callable[[], Then | None]
    kind: str


class Handoff:
    def __init__(self, patience_s: float = PATIENCE_S, clock: Callable[[], float] = time.perf_counter) -> None:
        self.patience_s = patience_s
        self._clock = clock
        self._tasks: deque[_Queued] = deque()
        self._lock = threading.Lock()  # guards the queue
        self._running = threading.Lock()  # one runner at a time: tasks keep their order

    def put(self, task: Callable[[], Then | None], cost_s: float = 0.0, kind: str = "task") -> None:
        with self._lock:
            self._tasks.append(_Queued(self._clock(), cost_s, task, kind))

    def pending(self) -> bool:
        return bool(self._tasks)

    def run_all(self, budget_s: float = math.inf, ran: list[tuple[str, float]] | None = None,
                stop: Callable[[], bool] | None = None) -> float:
        """The tasks put so far (the engine thread): the first, then each that fits in what `budget_s` leaves (the
        rest wait for the next call, or for run_stale), none once `stop()` says so; the seconds they took (0 where
        another thread is running them). `ran` gets each task's (kind, seconds)."""
        started = self._clock()
        return self._run(lambda q, ran: (not ran or self._clock() - started + q.cost_s < budget_s)
                         and (stop is None or not stop()), ran)

    def run_stale(self) -> float:
        """The tasks that have waited longer than patience_s, oldest first, up to the first that has not (another
        thread than the engine's); the seconds they took."""
        return self._run(lambda q, ran: self._clock() - q.at >= self.patience_s)

    def _run(self, due: Callable[[_Queued, bool], bool], took: list[tuple[str, float]] | None = None) -> float:
        if not self._tasks or not self._running.acquire(blocking=False):
            return 0.0
        started = self._clock()
        ran = False
        try:
            while True:
                with self._lock:
                    if not self._tasks or not due(self._tasks[0], ran):
                        break
                    q = self._tasks.popleft()
                ran = True
                t0 = self._clock()
                try:
                    then = q.task()
                except Exception:  # one failing task must not keep the others from running
                    log.exception("a task handed to the engine thread failed")
                    continue
                finally:
                    if took is not None:
                        took.append((q.kind, self._clock() - t0))
                if then is not None:  # its work goes on next, before whatever was put after it
                    with self._lock:
                        self._tasks.appendleft(_Queued(q.at, then.cost_s, then.task, then.kind))
        finally:
            self._running.release()
        return self._clock() - started
