"""LoopClock: the engine loop measured, per iteration. Two figures (issue 37: the GPU never waits for the host):

- the host's time: an iteration's wall time less what it spent blocked on the device (on a GPU the read of a step's
  tokens; on the CPU the step's own compute, which runs on the engine thread): plan, launch, commit, publish, gauges;
- on CUDA, the GPU's idle time between two consecutive steps: CUDA events recorded on the step's stream right before
  its first work is queued (after the host has prepared it: the megakernel decoder calls step_start between its host
  preparation and its input copy) and after its last, and the gap between one step's end and the next one's start, as
  the GPU timed them. A start recorded before the host's preparation completes at once on a GPU that waits, and the
  host's lateness then read as the step's GPU time (s46: "slow GPU steps" of 1.2-1.6 ms where the kernel takes 0.75).
  A gap is read only once both events have completed (`query()`, never a synchronisation), an iteration or two later.

- on CUDA, each step's own time on the GPU, between the same two events: a step the GPU itself ran slowly (beside
  whatever else it was given) shows there, and not in the host's time or the idle gaps.

"Consecutive": the next step was launched while the last one was still in flight, the engine running a step ahead. A
step launched after the engine had read everything (it had nothing to plan ahead, or waited for work) starts a new run:
that gap is the server being idle, not the host being late. Without CUDA only the host's time is measured; the idle
histogram is never created, so /metrics shows no series rather than zeros that were never measured.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
from prometheus_client import Histogram

from service.engine.host_path import HostPath, IdleGaps, LaunchPath
from service.engine.slow_steps import SlowGpuSteps

MAX_PENDING = 64  # steps not yet readable (the GPU is never this far behind; a bound, not a queue that grows)


class Event(Protocol):
    """What LoopClock asks of a torch.cuda.Event."""

    def record(self, stream: torch.cuda.Stream | None = None) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...


class LoopClock:
    def __init__(self, device: torch.device, host: Histogram, gpu_idle: Histogram | None = None,
                 new_event: Callable[[], Event] | None = None, step_gpu: Histogram | None = None,
                 idle_gaps: IdleGaps | None = None, path: HostPath | None = None) -> None:
        """`gpu_idle`: where the gaps go; None, or a device that is not CUDA, measures the host's time only.
        `step_gpu`: where each step's time on the GPU goes (with gpu_idle). `new_event`: a maker of timing events,
        for tests without a GPU (default: CUDA events with timing). `idle_gaps`: the long gaps counted by the host's
        phase that made them (host_path.py; default: logged only); `path`: the host's path between steps (tests: one on
        a clock of their own)."""
        self.host = host
        self.gpu = gpu_idle is not None and (device.type == "cuda" or new_event is not None)
        self.gpu_idle = gpu_idle
        self.step_gpu = step_gpu
        self._new_event: Callable[[], Event] = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._stream = torch.cuda.current_stream(device) if self.gpu and device.type == "cuda" else None
        self._free: list[Event] = []
        self._start: Event | None = None  # the step being launched
        # launched, not read yet: (start, end, consecutive, the host's path to its start)
        self._steps: deque[tuple[Event, Event, bool, LaunchPath | None, str]] = deque()
        self._path = path or HostPath()
        self._start_path: LaunchPath | None = None
        self.idle_gaps = idle_gaps or IdleGaps()
        self._last_end: Event | None = None  # the last step read's end: where a consecutive next one's gap starts
        self._broken = False  # a launch failed since the last step: the next one starts a new run
        self._slow_gpu = SlowGpuSteps()

    # -- the GPU's idle time and each step's ------------------------------------------------------------------------
    def step_start(self) -> None:
        """Right before a step's first work is queued on the GPU (a prefix copy, a prefill, else its inputs' copy),
        after the host's preparation: host time spent while the GPU has nothing queued then reads as idle, not as
        the step's own time. Only the first call of a step counts."""
        if self.gpu and self._start is None:
            self._start = self._record()
            self._start_path = self._path.launched()

    def mark(self, phase: str) -> None:
        """A phase of the engine thread's work ended now (host_path.py): on a GPU, part of the path to the next step."""
        if self.gpu:
            self._path.mark(phase)

    def step_end(self, consecutive: bool, kind: str = "decode") -> None:
        """After a step's last launch; `consecutive`: launched while the step before it was still in flight; `kind`:
        what its slowness is judged against (SlowGpuSteps: `decode` rows alone, or `prompt`)."""
        if not self.gpu or self._start is None:
            return
        start, self._start = self._start, None
        self._steps.append((start, self._record(), consecutive and not self._broken, self._start_path, kind))
        self._broken = False
        if len(self._steps) > MAX_PENDING:  # never read (no GPU is this far behind): dropped, not kept growing
            old_start, old_end, _, _, _ = self._steps.popleft()
            self._release(old_start, *(() if self._last_end is None else (self._last_end,)))
            self._last_end = old_end

    def step_failed(self) -> None:
        """The launch raised: its start pairs with nothing, and the next step starts a new run."""
        if self._start is not None:
            self._release(self._start)
            self._start = None
        self._broken = True

    def _record(self) -> Event:
        event = self._free.pop() if self._free else self._new_event()
        event.record(self._stream)
        return event

    def _release(self, *events: Event) -> None:
        self._free.extend(events)

    def _read_steps(self) -> None:
        """In launch order (one stream runs the steps in order, so the first not reached ends the pass): the gap
        before each step launched while the last one ran, once the GPU has started it; each step's time on the GPU,
        once it has finished."""
        while self._steps:
            start, end, consecutive, path, kind = self._steps[0]
            if not start.query():
                return
            if consecutive and self._last_end is not None and self.gpu_idle is not None:
                # on one stream the next step's start completes after the last one's end: a negative reading is the
                # timer's resolution (~0.5 us), not time
                gap = max(0.0, self._last_end.elapsed_time(start)) / 1e3
                self.gpu_idle.observe(gap)
                self.idle_gaps.observe(gap, path)
            if self._last_end is not None:
                self._release(self._last_end)
                self._last_end = None
            if not end.query():
                self._steps[0] = (start, end, False, path, kind)  # its gap is read: only its own time is left
                return
            self._steps.popleft()
            seconds = max(0.0, start.elapsed_time(end)) / 1e3
            if self.step_gpu is not None:
                self.step_gpu.observe(seconds)
            self._slow_gpu.observe(seconds, kind)
            self._release(start)
            self._last_end = end

    # -- the host's time -------------------------------------------------------------------------------------------
    def iteration(self, wall_s: float, device_s: float) -> None:
        """An iteration that ran or read a step: `wall_s` in all, `device_s` of it blocked on the device."""
        self.host.observe(max(0.0, wall_s - device_s))
        if self._steps:
            self._read_steps()
