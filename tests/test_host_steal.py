"""tests/host_steal.py decides which timing tries count: lateness on a steady host fails, lateness while the host
took the CPU away (or in a try that found the box too slow itself) is tried again, and a test whose every try was
disturbed is skipped with the evidence."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests import host_steal


class FakeHost:
    """/proc/stat's steal and total ticks: every read adds 1000 ticks, `share` of them stolen."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.share, self.steal, self.total = 0.0, 0, 0
        monkeypatch.setattr(host_steal, "_cpu_ticks", self.ticks)
        monkeypatch.setattr(host_steal, "wait_for_steady_host", lambda: host_steal.HostWindow())

    def ticks(self) -> tuple[int, int]:
        self.steal, self.total = self.steal + round(1000 * self.share), self.total + 1000
        return self.steal, self.total


def tries(host: FakeHost, outcomes: list[tuple[float, list[str]]]) -> tuple[list[int], Callable[[], list[str]]]:
    """An attempt whose i-th try runs with outcomes[i]'s share stolen and returns its problems."""
    calls: list[int] = []

    def attempt() -> list[str]:
        host.share, problems = outcomes[len(calls)]
        calls.append(1)
        return problems

    return calls, attempt


def test_on_time_at_the_first_try_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, attempt = tries(FakeHost(monkeypatch), [(0.3, [])])
    host_steal.judge_on_a_steady_host(attempt)
    assert len(calls) == 1


def test_late_on_a_steady_host_fails_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, attempt = tries(FakeHost(monkeypatch), [(0.01, ["req-1 late by 2 s"]), (0.0, [])])
    with pytest.raises(pytest.fail.Exception, match=r"req-1 late by 2 s\non a steady host \(.*1\.0% of the CPUs"):
        host_steal.judge_on_a_steady_host(attempt)
    assert len(calls) == 1


def test_late_while_stolen_is_tried_again_and_judged_on_a_steady_host(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, attempt = tries(FakeHost(monkeypatch), [(0.25, ["late while stolen"]), (0.0, ["late again"])])
    failed = r"late again(.|\n)*earlier, disturbed: try 1 .*25\.0% of the CPUs"
    with pytest.warns(host_steal.HostDisturbed, match="late while stolen"), \
            pytest.raises(pytest.fail.Exception, match=failed):
        host_steal.judge_on_a_steady_host(attempt)
    assert len(calls) == 2


def test_every_try_disturbed_skips_with_the_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    calls, attempt = tries(FakeHost(monkeypatch), [(0.2, ["late 1"]), (0.3, ["late 2"]), (0.1, ["late 3"])])
    skipped = r"every try(.|\n)*try 3 .*10\.0% of the CPUs stolen.*late 3"
    with pytest.warns(host_steal.HostDisturbed), pytest.raises(pytest.skip.Exception, match=skipped):
        host_steal.judge_on_a_steady_host(attempt)
    assert len(calls) == 3


def test_a_spike_in_a_try_disturbs_it_though_the_average_is_low(monkeypatch: pytest.MonkeyPatch) -> None:
    host = FakeHost(monkeypatch)
    calls: list[int] = []

    def attempt() -> list[str]:
        calls.append(1)
        if len(calls) == 1:  # half a second at 60% steal, then 100 quiet reads: 0.6% over the try
            host.share = 0.6
            time.sleep(2 * host_steal.SAMPLE_S)
            host.share = 0.0
            for _ in range(100):
                host.ticks()
        return [f"late in try {len(calls)}"]

    with pytest.warns(host_steal.HostDisturbed, match=r"try 1 .*at most 60% in a half second"), \
            pytest.raises(pytest.fail.Exception, match="late in try 2"):
        host_steal.judge_on_a_steady_host(attempt)


def test_a_try_that_finds_the_box_too_slow_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def attempt() -> list[str]:
        calls.append(1)
        if len(calls) < 3:
            raise host_steal.HostTooSlow("an idle request took 2x its usual time")
        return []

    FakeHost(monkeypatch)
    with pytest.warns(host_steal.HostDisturbed, match="2x its usual time"):
        host_steal.judge_on_a_steady_host(attempt)
    assert len(calls) == 3


def test_a_window_reads_this_machine() -> None:
    with host_steal.host_window() as window:
        sum(range(200_000))
    assert 0 <= window.stolen <= window.stolen_peak <= 1 and window.throttled >= 0 and window.seconds > 0
