"""The loadtest's pure parts on fixed inputs: percentiles, per-request derivation, summaries, cost, the sweep's
search, and the workload (lengths, arrivals, dataset rows, barge-in draws, SSE chunk parsing)."""

import asyncio
import math
import random
import statistics

import pytest

from loadtest.clients import chunk_text, is_rate_limit, ws_url
from loadtest.record import RequestRecord, finish
from loadtest.stats import describe, percentile, summarize, usd_per_million_tokens
from loadtest.sweep import find_max_rate
from loadtest.workload import (
    WORDS,
    arrival_gaps,
    parse_dataset_line,
    prompt_text,
    should_cancel,
    spread_len,
    synthetic_sessions,
)


def test_percentile_linear_interpolation():
    xs = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(xs, 0) == 15.0
    assert percentile(xs, 100) == 50.0
    assert percentile(xs, 50) == 35.0
    assert percentile(xs, 40) == pytest.approx(29.0)  # pos 1.6: 20 + 0.6 × 15
    assert percentile(xs, 90) == pytest.approx(46.0)  # pos 3.6: 40 + 0.6 × 10
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    with pytest.raises(ValueError):
        percentile([], 50)


def test_describe():
    d = describe([1.0, 2.0, 3.0, 4.0])
    assert d == {"n": 4, "mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97)}
    assert describe([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def rec(outcome="ok", times=(), start=0.0, end=1.0, tokens=None, **kw) -> RequestRecord:
    r = RequestRecord(session=0, turn=0, start_s=start, end_s=end, outcome=outcome, token_times_s=list(times),
                      output_tokens=len(times) if tokens is None else tokens, **kw)
    return finish(r, sla_tokens=3, sla_ms=100.0)


def test_finish_derives_latencies_and_sla():
    r = rec(times=[0.010, 0.020, 0.050, 0.060], start=1.0, end=1.070)
    assert r.ttft_ms == pytest.approx(10.0)
    assert r.ttfn_ms == pytest.approx(50.0)  # the 3rd token
    assert r.itl_ms == pytest.approx([10.0, 30.0, 10.0])
    assert r.tpot_ms == pytest.approx(50.0 / 3)
    assert r.e2e_ms == pytest.approx(70.0)
    assert r.sla_met
    assert not rec(times=[0.010, 0.020, 0.101]).sla_met  # 3rd token late
    assert rec(times=[0.010, 0.090]).ttfn_ms == pytest.approx(90.0)  # fewer than N: the last token
    assert rec(times=[0.010, 0.090]).sla_met
    assert rec(outcome="cancelled", times=[0.01]).sla_met  # a barge-in still had its tokens on time
    assert not rec(outcome="rejected").sla_met
    assert not rec(outcome="error", times=[0.01]).sla_met  # failed after admission: a miss
    assert not rec(times=[]).sla_met and rec(times=[]).ttft_ms is None


def test_summarize_exact():
    records = [
        rec(times=[0.01, 0.02, 0.03], start=0.0, end=0.5),  # met
        rec(times=[0.02, 0.04, 0.08], start=0.5, end=1.0),  # met
        rec(times=[0.05, 0.10, 0.15], start=1.0, end=2.0),  # missed: 150 ms
        rec(outcome="cancelled", times=[0.01, 0.02], start=1.0, end=1.1),  # met
        rec(outcome="rejected", start=1.5, end=1.502),
        rec(outcome="error", start=2.0, end=4.0),
    ]
    s = summarize(records, gpu_hourly_usd=3.0, gpus=2)
    assert (s["requests"], s["ok"], s["cancelled"], s["rejected"], s["errors"]) == (6, 3, 1, 1, 1)
    assert s["admitted"] == 5 and s["sla_met"] == 3
    assert s["duration_s"] == pytest.approx(4.0)
    assert s["output_tokens"] == 11 and s["good_output_tokens"] == 8
    assert s["output_throughput"] == pytest.approx(11 / 4)
    assert s["request_throughput"] == pytest.approx(4 / 4)
    assert s["goodput"] == pytest.approx(3 / 4)
    assert s["rejection_rate"] == pytest.approx(1 / 6)
    assert s["sla_attainment"] == pytest.approx(3 / 5)
    assert s["sla_attainment_all"] == pytest.approx(3 / 6)
    assert s["ttft_ms"]["n"] == 4 and s["ttft_ms"]["p50"] == pytest.approx(15.0)
    assert s["ttfn_ms"]["mean"] == pytest.approx((30 + 80 + 150 + 20) / 4)
    assert s["e2e_ms"]["n"] == 3 and s["e2e_ms"]["p50"] == pytest.approx(500.0)
    assert s["reject_ms"]["p50"] == pytest.approx(2.0)
    assert s["itl_ms"]["n"] == 2 + 2 + 2 + 1
    assert s["usd_per_1m_output_tokens"] == pytest.approx(3.0 * 2 / (11 / 4 * 3600) * 1e6)
    assert s["usd_per_1m_good_tokens"] == pytest.approx(3.0 * 2 / (8 / 4 * 3600) * 1e6)
    empty = summarize([])
    assert empty["requests"] == 0 and empty["sla_attainment"] is None and empty["usd_per_1m_output_tokens"] is None


def test_cost_formula():
    # One H100 at $2.50/h producing 1,000 tokens/s makes 3.6M tokens an hour: $0.6944 per 1M.
    assert usd_per_million_tokens(1000.0, 2.5, 1) == pytest.approx(2.5 / 3.6)
    assert usd_per_million_tokens(1000.0, 2.5, 8) == pytest.approx(8 * 2.5 / 3.6)
    assert usd_per_million_tokens(0.0, 2.5, 1) is None


def run(coro):
    return asyncio.run(coro)


def fake_measure(capacity: float, calls: list[float]):
    async def measure(rate: float) -> dict:
        calls.append(rate)
        return {"sla_attainment_all": 1.0 if rate <= capacity else 0.9}
    return measure


def test_sweep_doubles_then_bisects():
    calls: list[float] = []
    points, best = run(find_max_rate(fake_measure(5.3, calls), 0.99, start=1.0, bisect_steps=3))
    assert calls == [1, 2, 4, 8, 6, 5, 5.5]
    assert best == 5.0 and [r for r, _ in points] == calls


def test_sweep_edges():
    calls: list[float] = []
    _, best = run(find_max_rate(fake_measure(0.1, calls), 0.99, start=1.0, bisect_steps=2))
    assert calls == [1, 0.5, 0.25] and best is None  # even the lowest rate breaks the SLA
    calls = []
    _, best = run(find_max_rate(fake_measure(100.0, calls), 0.99, start=1.0, max_rate=16))
    assert calls == [1, 2, 4, 8, 16] and best == 16  # never broke up to the cap
    calls = []
    _, best = run(find_max_rate(fake_measure(5.0, calls), 0.99, rates=[3, 10, 5, 1]))
    assert calls == [3, 10, 5, 1] and best == 5


def test_arrival_gaps_gamma():
    n = 20000
    for rate, shape in ((10.0, 1.0), (10.0, 0.25), (4.0, 4.0)):
        gen = arrival_gaps(rate, shape, seed=1)
        xs = [next(gen) for _ in range(n)]
        assert statistics.fmean(xs) == pytest.approx(1 / rate, rel=0.05)
        # gamma(shape): coefficient of variation 1/sqrt(shape) (Poisson arrivals: exponential gaps, CV 1)
        assert statistics.pstdev(xs) / statistics.fmean(xs) == pytest.approx(1 / math.sqrt(shape), rel=0.07)
    gen = arrival_gaps(None)
    assert [next(gen) for _ in range(3)] == [0.0, 0.0, 0.0]
    a, b = arrival_gaps(5.0, 1.0, seed=7), arrival_gaps(5.0, 1.0, seed=7)
    assert [next(a) for _ in range(5)] == [next(b) for _ in range(5)]  # reproducible


def test_lengths_and_synthetic_sessions():
    rng = random.Random(0)
    assert spread_len(100, 0.0, rng) == 100
    xs = [spread_len(100, 0.5, rng) for _ in range(2000)]
    assert min(xs) >= 50 and max(xs) <= 150 and statistics.fmean(xs) == pytest.approx(100, rel=0.03)
    sessions = synthetic_sessions(16, 8, turns=3, seed=0)
    s0, s1 = next(sessions), next(sessions)
    assert (s0.index, s1.index) == (0, 1) and len(s0.turns) == 3
    for t in s0.turns:
        assert t.max_tokens == 8 and len(t.messages) == 1 and t.messages[0]["role"] == "user"
        words = t.messages[0]["content"].split(" ")
        assert len(words) == 16 and set(words) <= set(WORDS)
    assert s0.turns[0].messages != s1.turns[0].messages


def test_dataset_rows():
    assert parse_dataset_line({"prompt": "hi"}, 8)[0].messages == [{"role": "user", "content": "hi"}]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    [t] = parse_dataset_line({"messages": chat, "max_tokens": 3}, 8)
    assert t.messages == chat and t.max_tokens == 3
    turns = parse_dataset_line({"turns": ["a", "b"], "output_len": 5}, 8)
    assert [t.messages[0]["content"] for t in turns] == ["a", "b"] and turns[1].max_tokens == 5
    with pytest.raises(ValueError):
        parse_dataset_line({"text": "?"}, 8)
    assert prompt_text(chat) == "be brief\nhi"


def test_should_cancel_is_a_fixed_share():
    draws = [should_cancel(0, s, t, 0.3) for s in range(1000) for t in range(2)]
    assert sum(draws) / len(draws) == pytest.approx(0.3, abs=0.04)
    assert draws == [should_cancel(0, s, t, 0.3) for s in range(1000) for t in range(2)]
    assert not any(should_cancel(0, s, 0, 0.0) for s in range(100))
    assert all(should_cancel(0, s, 0, 1.0) for s in range(100))


def test_chunk_parsing():
    assert chunk_text({"choices": [{"index": 0, "text": " a"}]}) == " a"
    assert chunk_text({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"index": 0, "delta": {"content": "b"}}]}) == "b"
    assert chunk_text({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""
    assert is_rate_limit({"type": "rate_limit_error"}) and is_rate_limit({"code": "overloaded"})
    assert is_rate_limit({"message": "x", "retry_after_ms": 10}) and not is_rate_limit({"code": "invalid_request"})
    assert ws_url("http://127.0.0.1:8000/") == "ws://127.0.0.1:8000/v1/realtime"
    assert ws_url("https://h") == "wss://h/v1/realtime"


def test_worker_split():
    from loadtest.runner import Load
    from loadtest.workers import share, split

    assert [share(10, 3, w) for w in range(3)] == [4, 3, 3] and sum(share(7, 7, w) for w in range(7)) == 7
    parts = [split(Load(rate=9.0, concurrency=4, num_sessions=10), 3, w) for w in range(3)]
    assert [p.rate for p in parts] == [3.0] * 3  # three Poisson streams of 3/s make one of 9/s
    assert [p.stream for p in parts] == [0, 1, 2]  # ... if each has its own gaps
    assert [p.concurrency for p in parts] == [2, 1, 1] and [p.num_sessions for p in parts] == [4, 3, 3]
    assert split(Load(rate=None, concurrency=None, num_sessions=None), 2, 1).rate is None
