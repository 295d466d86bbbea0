"""The SLA clock starts when the client sent the request, where it says so (`x-request-start`): read in every form
proxies write it, bounded against a wrong clock (service/api/request_start.py)."""

import pytest

from service.api.request_start import MAX_AGE_S, arrival, sent_at

NOW, WALL = 1000.0, 1_800_000_000.0  # perf_counter and the wall clock at the same instant


@pytest.mark.parametrize("value", ["1800000000.25", "t=1800000000.25", "1800000000250", "t=1800000000250",
                                   "1800000000250000", " t=1800000000250000 "])
def test_seconds_milliseconds_and_microseconds_with_or_without_t(value):
    assert sent_at(value) == pytest.approx(1_800_000_000.25)


@pytest.mark.parametrize("value", ["", "t=", "soon", "-5", "0", "nan", "inf", "t=1e400"])
def test_what_is_not_a_time_is_ignored(value):
    assert sent_at(value) is None
    assert arrival(value, NOW, WALL) == NOW


def test_the_age_it_claims_is_taken_off_the_arrival_within_bounds():
    assert arrival(None, NOW, WALL) == NOW
    assert arrival(f"t={(WALL - 0.04) * 1e3:.0f}", NOW, WALL) == pytest.approx(NOW - 0.04, abs=1e-3)  # 40 ms ago
    assert arrival(str(WALL + 5), NOW, WALL) == NOW  # a clock ahead of ours: no wait, not a negative one
    assert arrival(str(WALL - MAX_AGE_S - 1), NOW, WALL) == NOW  # a minute old: a wrong clock, not a queue
