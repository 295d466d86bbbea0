"""The CPU the host takes away while a timing test runs, and judging timing only where the host left it alone.

The CPU tests that hold Parley to an SLA (admission, overload) time a real server on a shared two-core VM. When the
hypervisor runs other guests on those cores (steal, in /proc/stat) or the container's quota throttles it (cgroup
cpu.stat), every step takes longer than the server measured at start-up, by more than the share taken: the reference
decoder's two torch threads wait on each other, so 25-30% steal made one-row steps 3-4x slower (a lone request came
2.4-3.9x its forecast, four in a row, on the machine that passed the same test at 2% steal). No admission policy can
foresee a machine that slows down after its verdict, so such a try cannot judge one.

`judge_on_a_steady_host` runs a try up to TRIES times: lateness on a steady host (at most 5% stolen over the try and
15% in any half second of it) fails the test at once; lateness while the host took the CPU away, or in a try that
found the box too slow by its own measure (HostTooSlow), is reported and the try repeated; when every try was
disturbed the test is skipped with the evidence. Correctness (statuses, counts, errors) is asserted inside the try,
whatever the host did.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

STEADY_SHARE = 0.05  # a try whose host took more than this share of the CPU (steal, or throttled time) is not judged
STEADY_PEAK = 0.15  # ...or more than this in any half second of it (a spike slows the requests in flight at the time)
SAMPLE_S = 0.5
TRIES = 3
WAIT_FOR_STEADY_S = 30.0  # before a try, wait at most this long for one steady second


class HostTooSlow(Exception):
    """Raised by a try that measured the box's pace itself (an idle request's time, say) and found it too slow to
    judge the timing it is about: counted as a disturbed try."""


class HostDisturbed(UserWarning):
    """A try whose timing was missed while the host took the CPU away: tried again (shown in pytest's summary)."""


def _cpu_ticks() -> tuple[int, int]:
    """All CPUs' stolen ticks and total ticks so far (/proc/stat; zeros where there is none)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    fields += [0] * (8 - len(fields))  # user nice system idle iowait irq softirq steal
    return fields[7], sum(fields)


def _throttled_s() -> float:
    """Seconds the container's CPU quota has held it back so far (cgroup v2 cpu.stat; 0 where there is none)."""
    try:
        for line in Path("/sys/fs/cgroup/cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_usec":
                return int(value) / 1e6
    except (OSError, ValueError):
        pass
    return 0.0


@dataclass
class HostWindow:
    """What the host did to the CPUs over a stretch of wall time."""

    stolen: float = 0.0  # share of all CPUs' time the hypervisor gave to other guests
    stolen_peak: float = 0.0  # the largest share in any SAMPLE_S of it
    throttled: float = 0.0  # share of the wall time the cgroup's quota held the container back
    seconds: float = 0.0

    @property
    def steady(self) -> bool:
        return self.stolen <= STEADY_SHARE and self.stolen_peak <= STEADY_PEAK and self.throttled <= STEADY_SHARE

    def __str__(self) -> str:
        return (f"{self.seconds:.1f} s, {self.stolen:.1%} of the CPUs stolen (at most {self.stolen_peak:.0%} in a "
                f"half second), {self.throttled:.1%} throttled")


@contextmanager
def host_window() -> Iterator[HostWindow]:
    """A HostWindow filled in when the block ends; a thread samples the steal every SAMPLE_S meanwhile."""
    window, done = HostWindow(), threading.Event()
    steal0, total0 = _cpu_ticks()
    throttled0, t0 = _throttled_s(), time.monotonic()

    def sample() -> None:
        last = (steal0, total0)
        while not done.wait(SAMPLE_S):
            now = _cpu_ticks()
            if now[1] > last[1]:
                window.stolen_peak = max(window.stolen_peak, (now[0] - last[0]) / (now[1] - last[1]))
            last = now

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield window
    finally:
        done.set()
        sampler.join()
        steal1, total1 = _cpu_ticks()
        window.seconds = time.monotonic() - t0
        window.stolen = (steal1 - steal0) / max(1, total1 - total0)
        window.stolen_peak = max(window.stolen_peak, window.stolen)
        window.throttled = (_throttled_s() - throttled0) / max(1e-6, window.seconds)


def wait_for_steady_host(max_wait_s: float = WAIT_FOR_STEADY_S) -> HostWindow:
    """Sample the host a second at a time until one second is steady, or max_wait_s has passed; the last sample."""
    deadline = time.monotonic() + max_wait_s
    while True:
        with host_window() as window:
            time.sleep(1.0)
        if window.steady or time.monotonic() >= deadline:
            return window


def judge_on_a_steady_host(attempt: Callable[[], list[str]], tries: int = TRIES) -> None:
    """Run `attempt` (it asserts correctness itself and returns its timing problems, none when on time) until it
    is on time or lateness shows on a steady host (the test fails); skip when every try's host took the CPU away or
    the try found the box too slow itself (HostTooSlow)."""
    disturbed: list[str] = []
    for i in range(tries):
        wait_for_steady_host()
        with host_window() as host:
            try:
                problems = attempt()
            except HostTooSlow as e:
                problems, too_slow = [str(e)], True
            else:
                too_slow = False
        if not problems:
            return
        if host.steady and not too_slow:
            pytest.fail("\n".join(problems) + f"\non a steady host ({host})"
                        + "".join(f"\nearlier, disturbed: {d}" for d in disturbed), pytrace=False)
        disturbed.append(f"try {i + 1} ({host}): {problems[0].splitlines()[0][:300]}")
        warnings.warn(f"timing not judged, the host took the CPU away: {disturbed[-1]}", HostDisturbed, stacklevel=2)
    pytest.skip("the host took the CPU away in every try, so timing could not be judged:\n" + "\n".join(disturbed))
