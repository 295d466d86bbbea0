"""Admission control against a backend slowed on purpose: a burst splits into admitted requests that all meet the
SLA as the client measures it, and fast refusals; the metrics agree."""

import json
import logging
import queue
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.admission import DELIVERY_SHARE, AdmissionController
from service.backends.faults import FaultInjectingDecoder
from service.backends.reference import ReferenceDecoder
from service.calibration import calibrate
from service.engine.admission import Rejected
from service.engine.commit import StepDone
from service.engine.engine import Engine
from service.engine.request import SamplingParams
from service.latency_model import LatencyModel
from service.metrics import Metrics
from service.model.loader import load_model

SLA_S, SLA_TOKENS, SLOTS, STEP_DELAY_S = 1.5, 16, 4, 0.02
MAX_TOKENS = 64  # a request holds its slot ~64 steps: a second wave could not make the deadline


@pytest.fixture(scope="module")
def slowed():
    model = load_model("synthetic:tiny")
    dec = FaultInjectingDecoder(ReferenceDecoder(model.config, model.weights, max_slots=SLOTS, max_context=256),
                                step_delay_s=STEP_DELAY_S)
    latency = calibrate(dec, deadline_s=60)
    admission = AdmissionController(latency, SLA_S, SLA_TOKENS, SLOTS)
    metrics = Metrics(SLA_TOKENS)
    eng = Engine(dec, model.tokenizer, metrics=metrics, admission=admission, sla_ms=SLA_S * 1e3,
                 sla_tokens=SLA_TOKENS)
    eng.start()
    yield eng, latency, admission
    eng.stop()


def step_done(rows, seconds, launched=(), at=None):
    """A step as the engine commits it: `rows` rows at a short context, `launched` prefills before it, committed at
    `at` (now by default)."""
    return StepDone(rows=rows, sampled=rows, prompt_rows=0, kv_positions=0, launched=tuple(launched),
                    seconds=seconds, at=time.perf_counter() if at is None else at)


def run_steps(adm, since, n, rows, seconds):
    """`n` steps of `rows` rows committed one after another from `since`, each taking `seconds` (unmeasured: the
    latency model does not learn from them, and predicts each as before): when the last ended."""
    for i in range(1, n + 1):
        adm.consume(step_done(rows, 0.0, at=since + i * seconds))
    return since + n * seconds


def samples(eng, name):
    fams = {f.name: f for f in text_string_to_metric_families(eng.metrics.render().decode())}
    return fams[name].samples


def value(eng, name, **labels):
    return sum(s.value for s in samples(eng, name) if all(s.labels.get(k) == v for k, v in labels.items())
               and not s.name.endswith("_created"))


def test_calibration_sees_the_injected_delay(slowed):
    _, latency, admission = slowed
    assert latency.step(1) >= STEP_DELAY_S
    assert not admission.best_effort  # an idle server meets 16 tokens in 1.5 s at ~20 ms a step


def test_burst_splits_into_on_time_admissions_and_fast_refusals(slowed):
    eng, _, _ = slowed
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    n = 24
    results = [None] * n
    barrier = threading.Barrier(n)

    def client(i):
        q = queue.SimpleQueue()
        stamps = []
        barrier.wait()
        t0 = time.perf_counter()
        try:
            eng.submit([1 + i, 2, 3], params, lambda d: (stamps.append(time.perf_counter()), q.put(d)), arrival=t0)
        except Rejected as r:
            results[i] = ("rejected", time.perf_counter() - t0, r)
            return
        while (d := q.get(timeout=60)).finish_reason is None:
            pass
        results[i] = ("admitted", stamps[SLA_TOKENS - 1] - t0, d)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    admitted = [r for r in results if r[0] == "admitted"]
    rejected = [r for r in results if r[0] == "rejected"]
    assert len(admitted) + len(rejected) == n
    assert 1 <= len(admitted) <= SLOTS + 1  # the slots, no more: a second wave would be late
    assert rejected, "a 24-request burst on 4 slots must shed load"
    for _, ttf_n, d in admitted:
        assert ttf_n <= SLA_S, f"an admitted request got its {SLA_TOKENS}th token after {ttf_n * 1e3:.0f} ms"
        assert d.finish_reason == "length" and d.usage.completion_tokens == MAX_TOKENS
    for _, seconds, r in rejected:
        assert seconds < 0.05, f"a refusal took {seconds * 1e3:.1f} ms"  # at once (slack for a busy CI box)
        assert r.status == 429 and r.reason == "overloaded" and r.retry_after_s > 0

    assert value(eng, "parley_requests", outcome="rejected", reason="overloaded") == len(rejected)
    assert value(eng, "parley_prefilled_tokens") == 3 * len(admitted)  # no prefill spent on a refusal
    assert value(eng, "parley_requests", outcome="completed") >= len(admitted)
    assert value(eng, "parley_sla_violations") == 0
    assert value(eng, "parley_sla_checked") >= len(admitted)
    assert value(eng, "parley_generation_tokens") >= MAX_TOKENS * len(admitted)


def test_metrics_parse_and_have_the_sla_bucket(slowed):
    eng, _, _ = slowed
    fams = {f.name: f for f in text_string_to_metric_families(eng.metrics.render().decode())}
    for name in ("parley_time_to_first_token_seconds", "parley_time_to_nth_token_seconds",
                 "parley_inter_token_latency_seconds", "parley_e2e_request_latency_seconds",
                 "parley_request_queue_time_seconds", "parley_request_prefill_time_seconds",
                 "parley_decode_step_seconds"):
        assert fams[name].type == "histogram"
    edges = {s.labels["le"] for s in fams["parley_time_to_nth_token_seconds"].samples if "le" in s.labels}
    assert "0.1" in edges
    steps = [s for s in fams["parley_decode_step_seconds"].samples if s.name.endswith("_count")]
    assert steps and all("batch_size" in s.labels for s in steps)
    for gauge in ("parley_requests_running", "parley_requests_waiting", "parley_kv_slots_free",
                  "parley_sla_headroom_seconds"):
        assert fams[gauge].type == "gauge"
    assert value(eng, "parley_kv_slots_free") == SLOTS


def test_online_correction_follows_the_backend():
    lat = LatencyModel({1: 0.010, 4: 0.020}, {16: 0.005, 256: 0.050}, max_rows=64)
    for _ in range(100):
        lat.observe_step(1, 0.011)
    assert lat.step(1) == pytest.approx(0.011, rel=0.01)
    for _ in range(100):  # the host stalling between steps: learned no further than LEARN_CEILING x the calibration
        lat.observe_step(1, 0.030)
    assert lat.step(1) == pytest.approx(0.012)
    for _ in range(100):
        lat.observe_step(1, 0.008)
    assert lat.step(1) == pytest.approx(0.008, rel=0.01)  # faster: learned all the way
    assert lat.step(2) > lat.step(1) - 1e-9  # interpolated between corrected points
    for _ in range(100):
        lat.observe_prefill(256, 0, 0.100)
    assert lat.prefill(256) == pytest.approx(0.100, rel=0.05)


def test_long_context_steps_never_teach_a_short_step_to_cost_nothing():
    """Steps whose K/V term is most of their time leave the short-context time as it was; the same steps at a short
    context still teach it. (On a 2-core CPU serving long realtime sessions a high per-position cost took
    the one-row step to ~0, an idle server then enforced the SLA and refused every request for good.)"""
    lat = LatencyModel({1: 0.040, 4: 0.060}, {16: 0.050, 256: 0.400}, max_rows=64, step_kv_s=0.000040)
    for kv in (2000, 600):  # the K/V term alone predicts 78 ms, then 21.4: the steps take 40
        for _ in range(200):
            lat.observe_step(1, 0.040, kv_positions=kv)
        assert lat.step(1) == pytest.approx(0.040)
    for _ in range(200):  # short contexts: learned as ever
        lat.observe_step(1, 0.030, kv_positions=32)
    assert lat.step(1) == pytest.approx(0.030, rel=0.01)


def test_an_idle_cpu_server_says_it_serves_best_effort_and_strict_refuses(caplog):
    slow = LatencyModel({1: 0.050}, {16: 0.2, 128: 0.5}, max_rows=64)
    lenient = AdmissionController(slow, 0.1, 64, 4)
    assert lenient.best_effort
    assert "best-effort" in caplog.text
    strict = AdmissionController(slow, 0.1, 64, 4, strict=True)
    assert not strict.best_effort
    from service.engine.output import TextOutput
    from service.engine.request import Request
    from service.model.synthetic import byte_tokenizer

    out = TextOutput(byte_tokenizer(300).detokenizer())
    req = Request([1, 2, 3], SamplingParams(max_tokens=64), lambda d: None, out)
    with pytest.raises(Rejected) as e:
        strict.check(req)
    assert e.value.reason == "sla_unmeetable"
    lenient.check(req)  # best-effort admits


def test_the_guard_learns_that_forecasts_run_pessimistic_and_stays_honest():
    """A latency model more pessimistic than the server refuses, even on an idle server, requests that would make it;
    once enough requests alone have come in 0.85 of their forecast, the guard's stretch says so and they are admitted.
    And it stays honest: when they take 1.3x their forecast, they are refused again."""
    lat = LatencyModel({1: 0.0017}, {16: 0.003, 128: 0.0035}, max_rows=64)  # 64 x 1.7 ms: 109 ms, over the SLA
    adm = AdmissionController(lat, 0.1, 64, 4, strict=True)
    adm._last_probe = time.perf_counter()  # no probe just now
    alone = adm.level_of([], newcomer())
    with pytest.raises(Rejected):
        adm.check(newcomer())
    for _ in range(adm.guard.enough):
        adm.guard.observe(alone, 0.85, 1.05)
    assert adm.guard.stretch(alone) == pytest.approx(0.85)
    adm.check(req := newcomer())  # 109 ms x 0.85: admitted now
    adm.release(req)
    for _ in range(adm.guard.enough):
        adm.guard.observe(alone, 1.3, 0.85)
    with pytest.raises(Rejected):
        adm.check(newcomer())


def test_each_admitted_request_is_scored_against_the_steps_that_ran_since_its_verdict():
    """The guard's score of a request is the time from its verdict to its SLA token over what the latency model
    predicted for the steps committed in between (the model clock; the step in flight at the verdict counts as it ran),
    at the load level it was admitted at; a shorter reply (its last token is its SLA token) is judged late or not, but
    not scored: a few steps' forecast errs differently from the SLA's 64."""
    from service.engine.commit import Finished, Token

    lat = LatencyModel({1: 0.001, 2: 0.001}, {16: 0.002, 128: 0.003}, max_rows=64)
    adm = AdmissionController(lat, 0.1, 64, 4)
    req = newcomer()
    level = adm.level_of([], req)
    adm.check(req)
    promise = adm._promises[req.id]
    assert promise.level == level and promise.stretch == pytest.approx(1.05)  # a fresh server: the prior alone
    assert promise.predicted - promise.at == pytest.approx(0.064, rel=0.05)  # 64 steps of 1 ms, unstretched
    came = run_steps(adm, promise.at, 64, 1, 0.00125)  # each step a quarter over the model's 1 ms
    adm.consume(Token(req, 7, 64, "", came))
    assert adm.guard._scores[level].ranked == [pytest.approx(0.080 / 0.06425)]  # the first step as it ran
    assert adm.guard.miss_rate() == (0.0, 1.0)  # on time, but over the 1.05 it was admitted with
    short = newcomer(max_tokens=8)
    adm.check(short)
    run_steps(adm, adm._promises[short.id].at, 8, 1, 0.001)
    adm.consume(Finished(short, "length", short.deadline + 0.01, token=7, n=8))
    assert len(adm.guard._scores[level]) == 1 and adm.guard.miss_rate()[0] == 0.5  # judged late, not scored
    assert list(adm._active) == [req.id] and not adm._promises  # the short one ended: forgotten
    assert not adm.model_clock._origin and not adm.model_clock._waiting  # and so are their spans


def test_the_model_clock_counts_a_span_from_its_start_with_the_step_in_flight_as_it_ran():
    """A span begun while a step ran counts that step's part after the start at the time it took, then each step at
    what the model predicted; a step committed before the span began (a verdict racing the engine's commit) is not in
    it; a forgotten span reads nothing; a span begun before its first step started (an idle engine) has that step as
    predicted."""
    from service.model_clock import ModelClock

    clock = ModelClock()
    clock.start("a", 10.0)
    clock.tick(0.001, 9.9995)
    assert clock.span("a") is None
    clock.tick(0.002, 10.0015)
    assert clock.span("a") == pytest.approx(0.0015)
    clock.tick(0.001, 10.004)  # ran 2.5 ms, predicted 1
    assert clock.span("a") == pytest.approx(0.0025)
    clock.forget("a")
    assert clock.span("a") is None
    clock.start("idle", 20.0)  # a verdict on an idle engine: its first step, a launch, starts 0.3 ms later
    clock.tick(0.005, 20.0103, seconds=0.010)  # predicted 5 ms, took 10
    assert clock.span("idle") == pytest.approx(0.0053)  # all of the launch as predicted, the wait as it ran
    assert clock.ran("idle") == pytest.approx(0.0103)  # in the steps' own time: the launch as it ran


def test_the_model_clock_also_reads_a_span_in_the_steps_measured_time():
    """Beside the forecast's time, the time the same steps took: a span's score (wall over model) splits into the
    steps running over the model (ran / span) and the time between them (wall / ran). A step not measured counts as
    predicted; one in flight at the span's start counts its part after it, as it ran, in both."""
    from service.model_clock import ModelClock

    clock = ModelClock()
    clock.start("b", 30.0)
    clock.tick(0.002, 30.003, seconds=0.003)  # predicted 2 ms, took 3
    clock.tick(0.002, 30.0065, seconds=0.003)  # 0.5 ms of the host's between the two
    assert clock.span("b") == pytest.approx(0.004) and clock.ran("b") == pytest.approx(0.006)
    clock.tick(0.001, 30.008)  # not measured: as predicted
    assert clock.span("b") == pytest.approx(0.005) and clock.ran("b") == pytest.approx(0.007)
    clock.start("c", 40.001)  # begun while a step ran (40.000 to 40.003)
    assert clock.ran("c") is None
    clock.tick(0.002, 40.003, seconds=0.003)
    assert clock.span("c") == pytest.approx(0.002) == clock.ran("c")
    clock.forget("b")
    assert clock.ran("b") is None


def test_a_score_over_its_stretch_is_logged_with_its_level(caplog):
    """What the guard erred on is logged (at most once a second), so that a late request can be lined up with the
    engine's and the GPU's logs: its times from the verdict, what the steps since were predicted, the stretch and the
    level."""
    from service.engine.commit import Token

    lat = LatencyModel({1: 0.001, 2: 0.001}, {16: 0.002, 128: 0.003}, max_rows=64)
    adm = AdmissionController(lat, 0.1, 64, 4)
    on_time, late, later = newcomer(), newcomer(), newcomer()
    with caplog.at_level(logging.INFO, logger="parley.admission"):
        for req, factor in ((on_time, 1.0), (late, 1.4), (later, 1.5)):
            adm.check(req)
            came = run_steps(adm, adm._promises[req.id].at, 64, 1, 0.001 * factor)
            adm.consume(Token(req, 7, 64, "", came))
            adm.release(req)  # it ended: the next one is alone again
    lines = [r.getMessage() for r in caplog.records if "after its verdict" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"{late.id} reached its SLA token 89.6 ms after its verdict, "
                                                   "the steps since predicted 64.4 ms")  # the third: within a second
    assert "1.39x, over the stretch 1.050 at {'in_flight': '1', 'prompt': 'step'}" in lines[0]


def test_the_steps_before_a_late_forecast_still_count_in_the_score():
    """Under load a newcomer's verdict forecasts every admitted request again, so a request's latest forecast is made
    near its end and knows how far it has come: against it, a request whose every step ran 30% over the model scored
    about 1 (the guard's stretch read 1.02-1.04 on the H200 while such requests took 1.3-1.5x). Against the model
    clock it scores the 1.3 its steps ran."""

    from service.engine.commit import Token
    from service.engine.request import State

    lat = LatencyModel({1: 0.001, 2: 0.001}, {16: 0.002, 128: 0.003}, max_rows=64)
    adm = AdmissionController(lat, 0.5, 64, 4)
    running = newcomer()
    adm.check(running)
    begun = time.perf_counter() - 60 * 0.0013  # its verdict, 60 steps of 1.3 ms ago
    adm._promises[running.id] = adm._promises[running.id]._replace(at=begun)
    adm.model_clock.start(running.id, begun)
    running.state, running.prefilled, running.output_ids = State.RUNNING, 32, [0] * 60
    t = run_steps(adm, begun, 60, 1, 0.0013)
    adm.check(newcomer())  # a verdict now: 4 steps left in its forecast
    latest = adm._promises[running.id]
    came = run_steps(adm, t, 4, 2, 0.0013)
    adm.consume(Token(running, 7, 64, "", came))
    assert latest.at == begun and (came - begun) / (latest.predicted - begun) < 1.05  # against the latest: ~1
    assert adm.guard._scores[latest.level].ranked == [pytest.approx(1.3, rel=0.01)]


def test_a_request_is_scored_where_it_was_last_judged_and_not_for_the_load_that_came_after_it():
    """A request admitted alone is forecast again when another joins it (its steps now carry two rows): its promise
    moves to the newcomer's level and stretch, and its steps, now of two rows, are on both sides of its score. So
    reaching its SLA token as the model said of the steps that ran scores 1 at the level of two in flight: not the
    1.1-1.4x it would score against its forecast alone (on the H100 such scores raised an idle server's stretch until it
    refused requests alone), and not at the level of one (where busy levels, short of scores, borrowed them and let
    late requests in)."""
    from service.engine.commit import Token

    lat = LatencyModel({1: 0.001, 2: 0.0013}, {16: 0.002, 128: 0.003}, max_rows=64)
    adm = AdmissionController(lat, 0.5, 64, 4)  # room for a fresh server's prior beside others (1.5x)
    first = newcomer()
    adm.check(first)
    alone = adm._promises[first.id]
    adm.check(second := newcomer())
    joined, theirs = adm._promises[first.id], adm._promises[second.id]
    assert joined.at == alone.at  # its span still runs from its own verdict
    assert joined.level == theirs.level != alone.level and joined.stretch == theirs.stretch != alone.stretch
    assert joined.predicted - joined.at > 1.25 * (alone.predicted - alone.at)  # two rows a step, and its prompt
    came = run_steps(adm, alone.at, 64, 2, 0.0013)  # each step as the model says
    adm.consume(Token(first, 7, 64, "", came))
    assert adm.guard._scores[theirs.level].ranked == [pytest.approx(1.0)]
    assert (came - alone.at) / (alone.predicted - alone.at) > 1.1  # what its first forecast would have scored
    assert alone.level not in adm.guard._scores
def test_a_prompt_alone_that_fits_a_prompt_only_step_is_judged_at_the_one_step_level():
    """Where a step with no decode row carries more rows than one beside them (the planner's prefill_rows), a 40-token
    prompt alone rides in one step and is judged at its level's "step" kind; beside a running request it is chunked
    by max_rows, and judged as "chunked"."""
    from service.engine.kv_slots import KVSlots
    from service.engine.planner import Planner
    from service.engine.request import State

    lat = LatencyModel({1: 0.001, 16: 0.0012, 64: 0.0016}, {16: 0.003, 128: 0.0035}, max_rows=64)
    adm = AdmissionController(lat, 0.1, 64, 4)
    adm.bind(Planner(KVSlots(4), 4, 16, max_context=4096, prefill_rows=64))
    running = newcomer(state=State.RUNNING)
    assert adm.level_of([], newcomer(40)).labels == {"in_flight": "1", "prompt": "step"}
    assert adm.level_of([running], newcomer(40)).labels == {"in_flight": "2", "prompt": "chunked"}
    adm.bind(Planner(KVSlots(4), 4, 16, max_context=4096))
    assert adm.level_of([], newcomer(40)).labels["prompt"] == "chunked"


def test_late_requests_at_a_busy_level_refuse_there_only_and_never_switch_admission_off():
    """On the H100 a stall under load made SLA tokens come 2x late; the old learned bias crossed the SLA and the
    server went best-effort, admitting requests that then missed. Now the lateness is scored at the level where it
    happened: a newcomer beside a running request is refused there, an idle server (whose requests alone came on
    time) still admits, and enforcement never turns off."""
    from service.engine.request import State

    lat = LatencyModel({1: 0.00125, 2: 0.0013}, {16: 0.003, 128: 0.0035}, max_rows=64)  # idle: ~82 ms
    adm = AdmissionController(lat, 0.1, 64, 4)
    adm._last_probe = time.perf_counter()  # no probe now: the stretch alone decides
    running = newcomer(state=State.RUNNING)
    alone, busy = adm.level_of([], newcomer()), adm.level_of([running], newcomer())
    assert alone != busy
    for _ in range(adm.guard.enough):
        adm.guard.observe(alone, 1.0, 1.05)
        adm.guard.observe(busy, 1.4, 1.5)
    adm.check(running)
    with pytest.raises(Rejected, match="cannot deliver"):
        adm.check(newcomer())  # beside it: 82 ms x 1.4
    adm.release(running)
    adm.check(newcomer())  # alone: 82 ms x 1.0
    adm._reconsider_best_effort()
    assert not adm.best_effort  # refusing, not admitting everything


def test_a_disturbed_calibration_is_measured_again_keeping_the_fastest_times():
    """A stalled sample shows as numbers that contradict themselves (a longer prefill faster than a shorter one, a
    bigger batch faster than a smaller one by more than noise, or slower than proportionally); the calibration is
    then measured again and each point keeps its fastest time."""
    sane = LatencyModel({1: 0.010, 2: 0.011, 4: 0.013}, {16: 0.005, 128: 0.02}, max_rows=64)
    assert not sane.disturbed()
    for steps, prefills in [({1: 0.010, 2: 0.011, 4: 0.013}, {16: 0.5, 128: 0.02}),  # a stalled short prefill
                            ({1: 0.010, 2: 0.005, 4: 0.013}, {16: 0.005, 128: 0.02}),  # batch 2 faster than 1
                            ({1: 0.010, 2: 0.011, 4: 0.100}, {16: 0.005, 128: 0.02})]:  # batch 4 stalled
        assert LatencyModel(steps, prefills, max_rows=64).disturbed()
    stalled = LatencyModel({1: 0.010, 2: 0.011, 4: 0.100}, {16: 0.5, 128: 0.02}, max_rows=64)
    merged = stalled.fastest(sane)
    assert merged.snapshot()["step_ms"] == {"1": 10.0, "2": 11.0, "4": 13.0}
    assert merged.snapshot()["prefill_ms"] == {"16": 5.0, "128": 20.0}
    assert not merged.disturbed()


# -- prefill on top of cached tokens, outliers, lagging requests -----------------------------------------------------
def newcomer(prompt_tokens=32, cached=0, max_tokens=64, lags=False, state=None):
    from service.engine.output import TextOutput
    from service.engine.request import Choice, Request, State
    from service.model.synthetic import byte_tokenizer

    req = Request(list(range(prompt_tokens)), SamplingParams(max_tokens=max_tokens), lambda d: None,
                  TextOutput(byte_tokenizer(300).detokenizer()))
    req.cached_tokens, req.state = cached, state or State.WAITING
    if req.state is State.RUNNING:  # its prompt has run: it decodes
        req.prefilled = prompt_tokens
    req.choice = Choice.HOST if lags else Choice.STEP
    return req


def settled(adm, score):
    """`adm` once its guard has seen enough requests, each taking `score` times its forecast: every level's stretch
    is `score` (the levels without scores of their own pool these)."""
    from service.admission_guard import Level

    for _ in range(adm.guard.enough):
        adm.guard.observe(Level(0, 0), score, score)
    return adm


@pytest.fixture
def frozen_clock(monkeypatch) -> float:
    """The admission clock held still: the time a test's verdicts are made at, whatever a slow host takes between
    them (a 2-core CI host once took 25 ms, more than a test's few ms of room)."""
    from types import SimpleNamespace

    import service.admission

    frozen = time.perf_counter()
    monkeypatch.setattr(service.admission, "time", SimpleNamespace(perf_counter=lambda: frozen))
    return frozen


def now_and_then_over(adm):
    """`adm` once its guard has seen forecasts run to time, and a tenth of them 20% over: every level's stretch 1.20,
    its usual pace 1.0."""
    from service.admission_guard import Level

    n = adm.guard.enough
    for i in range(n):
        adm.guard.observe(Level(0, 0), 1.20 if i < n // 10 else 1.0, 1.20)
    return adm


def test_a_run_of_steps_costs_what_its_steps_add_up_to():
    """LatencyModel.steps (the forecast's repeated steps in one call) equals the sum of step() over the run: rows on
    a bucket or between two, runs that start below the short context and cross it, start beyond it, never reach it,
    or do not grow; a bucketed model (the GPU's) and an interpolated one (the CPU's)."""
    import random

    rng = random.Random(7)
    for buckets in (None, [1, 2, 4, 8, 16]):
        lat = LatencyModel({1: 0.0007, 2: 0.00072, 4: 0.00078, 8: 0.00084, 16: 0.00089}, {16: 0.003}, max_rows=16,
                           buckets=buckets, step_kv_s=1.1e-8)
        for _ in range(300):
            rows = rng.randint(0, 16)
            kv = rng.choice([0, rng.randint(0, 64 * max(1, rows)), rng.randint(0, 40_000)])
            grow = rng.choice([0, rows, rng.randint(1, 300)])
            n = rng.randint(1, 200)
            one_by_one = sum(lat.step(rows, kv + k * grow) for k in range(n))
            assert lat.steps(rows, kv, grow, n) == pytest.approx(one_by_one, rel=1e-12), (rows, kv, grow, n)


def test_prefill_is_predicted_from_the_new_and_the_cached_tokens():
    """A 1,000-token prompt on an idle server misses the SLA when fresh, and keeps it when all but 40 of its tokens
    are cached: the prediction follows new tokens and the cached length they attend over (interpolated between
    the measured points, on the CPU)."""
    lat = LatencyModel({1: 0.001}, {16: 0.002, 128: 0.010, 1024: 0.080}, max_rows=64,
                       continued_s={(16, 256): 0.003, (128, 256): 0.012, (16, 1024): 0.006, (128, 1024): 0.020})
    assert lat.prefill(16) < lat.prefill(16, cached=240) < lat.prefill(16, cached=1008) < lat.prefill(1000)
    at_256, at_1024 = 0.003 + (0.012 - 0.003) * 24 / 112, 0.006 + (0.020 - 0.006) * 24 / 112  # 40 new tokens
    assert lat.prefill(40, cached=960) == pytest.approx(at_256 + (at_1024 - at_256) * (1000 - 256) / (1024 - 256))
    assert lat.prefill(40, cached=4000) >= lat.prefill(40)  # past the measured lengths: extrapolated, never cheaper
    adm = AdmissionController(lat, 0.1, 64, 4)
    adm._last_probe = time.perf_counter()  # no probe: the prediction alone decides
    with pytest.raises(Rejected) as e:
        adm.check(newcomer(1000))  # 80 + 63 ms
    assert e.value.reason == "sla_unmeetable"
    adm.check(newcomer(1000, cached=960))  # 9 + 63 ms


def test_on_a_gpu_a_prefill_costs_the_graph_buckets_it_replays():
    """With graph buckets, a prefill is predicted at the pair of buckets its graph pads to (not interpolated below
    them), and what it is observed to cost corrects that pair."""
    buckets = [16, 32, 64, 128, 256, 512, 1024]
    fresh = {b: 0.001 * (1 + b / 128) for b in buckets}
    continued = {(n, kv): 0.001 * (1 + n / 128 + kv / 1024) for kv in buckets for n in buckets if n <= kv}
    lat = LatencyModel({1: 0.001}, fresh, max_rows=64, continued_s=continued, buckets=buckets)
    assert lat.prefill(600) == fresh[1024] and lat.prefill(40, cached=960) == continued[64, 1024]
    lat.observe_prefill(40, 960, 1.2 * continued[64, 1024])
    assert lat.prefill(40, cached=960) == pytest.approx(1.02 * continued[64, 1024])
    assert lat.prefill(40, cached=100) == continued[64, 256]  # another pair: untouched


def test_calibration_measures_prefills_on_cached_tokens_at_shapes_that_replay_their_graphs(slowed):
    from service.calibration import _prefill_points

    _, latency, _ = slowed
    assert latency.snapshot()["prefill_on_cache_ms"]  # the CPU: a few points
    dec = ReferenceDecoder(load_model("synthetic:tiny").config, load_model("synthetic:tiny").weights, max_slots=1,
                           max_context=1000)
    buckets = dec.prefill_buckets()
    fresh, continued = _prefill_points(1000, buckets)
    assert fresh == buckets and len(continued) == len(buckets) * (len(buckets) + 1) // 2
    for (n_bucket, kv_bucket), (n, kv) in continued.items():
        assert dec.bucket(n) == n_bucket and dec.bucket(kv) == kv_bucket
        assert 1 <= n < kv < 1000  # something cached; ends before the last position: the graph, not eager


def test_one_outlier_never_makes_an_idle_server_refuse():
    """A fresh idle server predicted at 99% of its SLA (the prior's stretch included) keeps admitting after a step, a
    prefill and an SLA token each 10x late: a lone outlier teaches neither the latency model nor the guard (the
    largest score never decides alone; a compile or a first request's one-off cost would otherwise keep a level
    refusing for hundreds of requests)."""
    from service.admission_guard import PRIOR_ALONE
    from service.engine.commit import Token

    lat = LatencyModel({1: 0.00148}, {16: 0.003, 128: 0.005}, max_rows=64)
    adm = AdmissionController(lat, 0.1, 64, 4)
    adm._last_probe = time.perf_counter()
    assert adm.idle_prediction_s() * PRIOR_ALONE == pytest.approx(0.0994, abs=0.0005)
    adm.check(first := newcomer())
    adm.consume(step_done(1, 10 * lat.step(1)))
    adm.consume(step_done(1, 10 * lat.prefill(32), launched=[(32, 0)]))
    promise = adm._promises[first.id]
    adm.consume(Token(first, 7, 64, "", promise.at + 10 * (promise.predicted - promise.at)))
    adm.release(first)
    adm.check(newcomer())
    # a second one in a row is no outlier any more: the model learns (by at most OUTLIER a step)
    adm.consume(step_done(1, 10 * lat.step(1)))
    assert lat.step(1) == pytest.approx(0.00148 * 1.05)


def test_a_lagging_request_takes_two_steps_a_token_beside_others():
    """A constrained request gets a token every other step when it shares the batch with requests sampled on the
    device: its 64th token takes twice the steps, and admission says so; alone it runs step by step."""
    from service.engine.request import State

    lat = LatencyModel({1: 0.001, 2: 0.001}, {16: 0.003, 128: 0.004}, max_rows=64)  # 64 ms to token 64
    adm = settled(AdmissionController(lat, 0.1, 64, 4), 1.05)
    adm._last_probe = time.perf_counter()
    alone = newcomer(lags=True)
    adm.check(alone)  # alone: 64 ms
    adm.release(alone)
    adm.check(newcomer(state=State.RUNNING, max_tokens=200))
    with pytest.raises(Rejected):
        adm.check(newcomer(lags=True))  # beside it: 1 + 126 ms
    # a reply to a tool's result is held to its opening only (tools.SPEECH_OPENING), then runs step by step: on time
    opening = newcomer(lags=True)
    opening.constraint = type("Opening", (), {"opening": True})()
    adm.check(opening)


def test_the_engine_predicts_with_what_the_prefix_cache_holds():
    """Engine.submit asks the prefix cache how much of the prompt it holds before admission judges it."""
    from service.engine.admission import AdmitAll

    class Recording(AdmitAll):
        def __init__(self):
            super().__init__(1.0)
            self.seen = []

        def check(self, req):
            self.seen.append(req.cached_tokens)
            super().check(req)

    model = load_model("synthetic:tiny")
    adm = Recording()
    eng = Engine(ReferenceDecoder(model.config, model.weights, max_slots=2, max_context=256), model.tokenizer,
                 admission=adm)
    eng.start()
    try:
        first = list(range(1, 41))
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        reply = [t for d in eng.generate(first, params) for t in d.token_ids]
        last = list(eng.generate(first + reply + [5], params))[-1]
    finally:
        eng.stop()
    assert adm.seen == [0, len(first) + len(reply) - 1] == [0, last.usage.cached_tokens]


def test_a_request_late_whatever_happens_holds_nobody_back():
    """A running request that will miss its SLA token anyway (admitted as a probe) does not make the server refuse a
    newcomer that keeps its own; one still on time is protected as before."""
    from service.engine.request import State

    lat = LatencyModel({1: 0.002, 2: 0.002}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)  # 128 ms to token 64
    adm = settled(AdmissionController(lat, 0.2, 64, 4), 1.05)
    late = newcomer(state=State.RUNNING)
    adm.check(late)
    fits = newcomer()
    late.output_ids = [0] * 10
    late.deadline = time.perf_counter() + 0.01  # its 64th token comes 54 x 2.1 ms on: late whatever happens
    adm.check(fits)  # 64 x 2.1 ms: on time, admitted beside the late one

    adm = settled(AdmissionController(lat, 0.2, 64, 4), 1.05)
    on_time = newcomer(state=State.RUNNING)
    adm.check(on_time)
    riding = newcomer(prompt_tokens=100)
    on_time.deadline = time.perf_counter() + 0.15  # 64 x 2.1 ms alone: on time, with 16 ms to spare
    adm.check(riding)  # its prompt rides in two steps beside the running one's: that delays nobody
    adm.release(riding)
    pushing = newcomer(prompt_tokens=400)
    with pytest.raises(Rejected, match="admitted one miss"):
        adm.check(pushing)  # its 27 ms prefill launch ahead of those steps would make it miss


def test_a_request_late_only_at_the_stretch_holds_back_a_newcomer_that_delays_it(frozen_clock):
    """Forecasts here usually run to time (median score 1.0) and now and then 20% over (the stretch, 1.20). A running
    request whose stretched forecast has drifted past its deadline, but which makes it at the usual pace, is not given
    up: a newcomer whose prefill launch would delay it is refused; one that delays it not at all is admitted. Once it
    is late even at the usual pace, nothing holds the newcomer back."""
    from service.admission_guard import Level
    from service.engine.request import State

    lat = LatencyModel({1: 0.002, 2: 0.002}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)

    def drifted(left_s):
        adm = now_and_then_over(AdmissionController(lat, 0.2, 64, 4))
        running = newcomer(state=State.RUNNING)
        adm.check(running)
        pushing, riding = newcomer(prompt_tokens=400), newcomer()
        running.output_ids = [0] * 10  # 54 tokens to go: 108 ms at the usual pace, 130 ms stretched
        running.deadline = frozen_clock + left_s
        return adm, pushing, riding

    adm, pushing, riding = drifted(0.119)
    level = Level(1, 2)
    assert adm.guard.stretch(level) == pytest.approx(1.20) and adm.guard.typical(level) == pytest.approx(1.0)
    with pytest.raises(Rejected, match="admitted one miss"):
        adm.check(pushing)  # its prefill launch (27 ms) would come first
    adm.check(riding)  # rides beside it: delays it not at all

    adm, pushing, _ = drifted(0.098)  # late at the usual pace too: a lost cause
    adm.check(pushing)


def test_a_verdict_in_parts_judges_as_one_from_its_first_moment(frozen_clock):
    """The engine process runs a verdict's `delays` rule (its second forecast, the newcomer left out) beside the next
    GPU step: admission.verdict yields before it. A step runs between the parts: the second forecast starts from the
    first's moment and states, so it says what check() says then (from the states a step later, one token nearer, it
    would read a newcomer that delays nobody as delaying the running request by that step). A verdict that needs no
    second forecast has one part."""
    from service.engine.request import State

    lat = LatencyModel({1: 0.002, 2: 0.002}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)

    def drifted():
        adm = now_and_then_over(AdmissionController(lat, 0.2, 64, 4))
        running = newcomer(state=State.RUNNING)
        adm.check(running)
        running.output_ids = [0] * 10  # 54 tokens to go: 108 ms at the usual pace, 130 ms stretched
        running.deadline = frozen_clock + 0.119  # late at the stretch, on time at the usual pace
        return adm, running

    adm, running = drifted()
    riding = newcomer()
    parts = adm.verdict(riding)
    next(parts)  # the first forecast: the running request is late beside it, the `delays` rule must look
    running.output_ids.append(0)  # a step ran
    with pytest.raises(StopIteration):
        next(parts)  # admitted, as check() admits it: it delays nobody
    assert riding.id in adm._active

    adm, running = drifted()
    pushing = newcomer(prompt_tokens=400)
    parts = adm.verdict(pushing)
    next(parts)
    running.output_ids.append(0)
    with pytest.raises(Rejected, match="admitted one miss"):
        next(parts)  # its 27 ms prefill launch would make it miss
    assert pushing.id not in adm._active

    adm = now_and_then_over(AdmissionController(lat, 0.2, 64, 4))
    with pytest.raises(StopIteration):
        next(adm.verdict(newcomer()))  # nobody late beside it: one part


def test_a_verdict_in_parts_counts_the_wait_between_them(frozen_clock, monkeypatch):
    """The newcomer joins when its verdict's last part has run, a step or more after its first forecast: its SLA token
    moves by that wait. A newcomer on time with 0.5 ms to spare at the first part is admitted after a 0.2 ms wait and
    refused as late after a 1 ms one (judged from the first moment alone, one such request came late on the H200)."""
    from types import SimpleNamespace

    import service.admission
    from service.engine.request import State

    lat = LatencyModel({1: 0.002, 2: 0.002}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)

    def drifted():
        adm = now_and_then_over(AdmissionController(lat, 0.2, 64, 4))
        running = newcomer(state=State.RUNNING)
        adm.check(running)
        running.output_ids = [0] * 10
        running.deadline = frozen_clock + 0.119  # late at the stretch, on time at the usual pace: two parts
        return adm

    adm = drifted()
    probe = newcomer()
    adm.check(probe)
    promise = adm._promises[probe.id]
    t_nth = frozen_clock + (promise.predicted - frozen_clock) * promise.stretch  # its stretched forecast

    def judged_after(wait_s: float):
        adm = drifted()
        edge = newcomer()
        edge.arrival = t_nth + 0.0005 - adm.sla_s  # its deadline 0.5 ms past its forecast
        parts = adm.verdict(edge)
        next(parts)
        monkeypatch.setattr(service.admission, "time", SimpleNamespace(perf_counter=lambda: frozen_clock + wait_s))
        try:
            next(parts)
        except StopIteration:
            pass
        finally:
            monkeypatch.setattr(service.admission, "time", SimpleNamespace(perf_counter=lambda: frozen_clock))
        return adm, edge

    adm, edge = judged_after(0.0002)
    assert edge.id in adm._active
    with pytest.raises(Rejected, match="cannot deliver 64 tokens"):
        judged_after(0.001)


def test_a_verdict_decided_between_the_parts_of_another_is_seen_by_it(frozen_clock):
    """A grammar's verdict runs whole on another thread, and may come between another verdict's parts: that one's
    second part then judges again, beside it, and its forecast moves every admitted request's promise (the one
    admitted in between too)."""
    from service.engine.request import State

    lat = LatencyModel({1: 0.002, 2: 0.002, 3: 0.002}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)
    adm = now_and_then_over(AdmissionController(lat, 0.2, 64, 4))
    running = newcomer(state=State.RUNNING)
    adm.check(running)
    running.output_ids = [0] * 10
    running.deadline = frozen_clock + 0.119
    first, between = newcomer(), newcomer()
    parts = adm.verdict(first)
    next(parts)
    adm.check(between)  # decided whole meanwhile
    promised = adm._promises[between.id]
    assert promised.level == adm.level_of([running], between)
    with pytest.raises(StopIteration):
        next(parts)
    assert {first.id, between.id} <= set(adm._active)
    assert adm._promises[first.id].level == adm.level_of([running, between], first) != promised.level
    assert adm._promises[between.id].level == adm._promises[first.id].level  # forecast again beside it


def test_a_verdict_judged_again_between_its_parts_still_keeps_the_delays_rule(frozen_clock):
    """A verdict decided whole between another's parts makes that one judge again from its first part; judged again,
    it still asks the `delays` rule: a newcomer whose prefill launch would make an on-time request miss is refused (it
    was admitted unasked before)."""
    from service.engine.request import State

    lat = LatencyModel({1: 0.002, 2: 0.002, 3: 0.002}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)
    adm = now_and_then_over(AdmissionController(lat, 0.2, 64, 4))
    running = newcomer(state=State.RUNNING)
    adm.check(running)
    running.output_ids = [0] * 10  # 54 tokens to go: 108 ms at the usual pace, 130 ms stretched
    running.deadline = frozen_clock + 0.119  # late at the stretch, on time at the usual pace
    pushing, between = newcomer(prompt_tokens=400), newcomer()
    parts = adm.verdict(pushing)
    next(parts)  # the running request is late beside it: the `delays` rule must look
    adm.check(between)  # rides beside it: delays it not at all, admitted whole meanwhile
    with pytest.raises(Rejected, match="admitted one miss"):
        next(parts)  # its 27 ms prefill launch would make the running request miss
    assert pushing.id not in adm._active and between.id in adm._active


def test_a_newcomer_beside_a_busy_gpu_is_forecast_after_the_steps_already_launched(frozen_clock):
    """The engine launches a step before it commits the one in flight, and a verdict runs beside them: its newcomer
    is seated in the step after both at the earliest. Forecast as if seated at once, every newcomer beside a busy GPU
    came ~1.5 steps later than its forecast (the H100's voice sweep), and the guard's score, over the steps that ran
    since the verdict, never saw it. A request on time only if seated at once is refused."""
    from service.engine.request import State

    step = 0.002
    lat = LatencyModel({1: step, 2: step}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)

    def beside_one(ahead):
        adm = AdmissionController(lat, 0.2, 64, 4)
        adm.guard.observe = lambda *a, **k: None  # no score learned
        adm.guard.stretch = lambda level: 1.0  # forecasts taken as they are
        running = newcomer(state=State.RUNNING, max_tokens=400)
        adm.check(running)
        adm.planner.steps_ahead = ahead
        req = newcomer()
        req.arrival = frozen_clock - 0.2 + 0.128 + 0.001  # 129 ms left: 64 steps of 2 ms, and 1 to spare
        return adm, req

    adm, req = beside_one(0)
    adm.check(req)
    assert adm._promises[req.id].predicted - frozen_clock == pytest.approx(64 * step)
    adm, req = beside_one(2)
    with pytest.raises(Rejected, match="cannot deliver"):
        adm.check(req)  # seated two steps on: 132 ms
    adm, req = beside_one(1)
    req.arrival += 0.004
    adm.check(req)
    assert adm._promises[req.id].predicted - frozen_clock == pytest.approx(65 * step)


def test_a_cancelled_request_holds_nobody_back():
    """A barge-in's next turn comes as soon as response.done does, which may be before the engine has dropped the
    cancelled reply: it is judged as if that one were gone (it is, by the engine's next step)."""
    from service.engine.request import State

    lat = LatencyModel({1: 0.00145, 2: 0.00145}, {16: 0.003, 128: 0.0035}, max_rows=64)  # ~95 ms to token 64 alone
    adm = AdmissionController(lat, 0.1, 64, 4)
    adm._last_probe = time.perf_counter()
    barged = newcomer(state=State.RUNNING, max_tokens=200)
    adm.check(barged)
    with pytest.raises(Rejected):
        adm.check(newcomer())  # beside a running reply: the prior's 1.5x
    barged.cancelled = True
    adm.check(newcomer())  # alone, as it will be


def test_a_calibration_with_one_prefill_on_cache_predicts_every_kv_length():
    """A calibration cut short by its time budget (a busy host) may have timed one prefill on cached tokens: a
    conversation past that K/V length had raised IndexError in admission (a 500 for every later voice turn)."""
    lat = LatencyModel({1: 0.001, 16: 0.002}, {64: 0.001, 256: 0.03, 1024: 0.07}, max_rows=16,
                       continued_s={(256, 2048): 0.05})
    short, at, past = lat.prefill(256, 1000), lat.prefill(256, 1792), lat.prefill(256, 3000)
    assert at == pytest.approx(0.05)
    assert lat.prefill(256, 0) <= short <= at and past >= at  # more cached K/V never predicted cheaper


@pytest.mark.parametrize("repeat", range(3))
def test_a_burst_on_a_misjudged_host_admits_no_one_who_will_be_late(repeat):
    """The calibration times bare steps; a host serving them runs slower (a 2-core CPU streaming four replies ran 1.3x
    its calibrated steps). A burst on a fresh server whose latency model says 15 ms a step where steps take 20: the
    first wave (a seat each) keeps its SLA with room to spare, but a second wave, forecast to reach its SLA token at
    2 x 16 x 15 ms = 480 ms, would reach it at 640 ms, past the 550 ms promise. A fresh server's guard has seen
    nothing: its prior must hold (1.5x beside other requests: 720 ms, refused). Repeated: it must hold every time."""
    model = load_model("synthetic:tiny")
    dec = FaultInjectingDecoder(ReferenceDecoder(model.config, model.weights, max_slots=SLOTS, max_context=256),
                                step_delay_s=0.02)
    sla_s, sla_tokens = 0.55, 16
    warm = Engine(dec, model.tokenizer, max_batch=SLOTS)  # torch's first calls are slow: not what this test is about
    warm.start()
    try:
        for _ in warm.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
            pass
    finally:
        warm.stop()
    lat = LatencyModel({1: 0.015, 16: 0.015}, {16: 0.015}, max_rows=16)
    admission = AdmissionController(lat, sla_s, sla_tokens, SLOTS, strict=True)
    eng = Engine(dec, model.tokenizer, admission=admission, sla_ms=sla_s * 1e3, sla_tokens=sla_tokens,
                 max_batch=SLOTS)
    params = SamplingParams(max_tokens=sla_tokens, temperature=0, ignore_eos=True)
    stamps: dict[int, list[float]] = {}
    done = threading.Semaphore(0)
    t0 = time.perf_counter()
    admitted = []
    for i in range(3 * SLOTS):
        def sink(d, i=i):
            stamps.setdefault(i, []).append(time.perf_counter())
            if d.finish_reason is not None:
                done.release()
        try:
            eng.submit([1 + i, 2, 3], params, sink, arrival=t0)
            admitted.append(i)
        except Rejected as r:
            assert r.status == 429
    eng.start()
    try:
        for _ in admitted:
            assert done.acquire(timeout=30)
    finally:
        eng.stop()
    late = {i: round((stamps[i][sla_tokens - 1] - t0) * 1e3) for i in admitted
            if stamps[i][sla_tokens - 1] - t0 > sla_s}
    assert not late, f"admitted and late (ms): {late}"
    assert 1 <= len(admitted) <= SLOTS  # the first wave: admission still admits what it can serve


def test_a_strict_server_probes_a_calibration_no_served_step_has_checked():
    """A calibration timed on a busy moment (3x the real steps: 64 tokens predicted at 2.9x the SLA) must not make a
    strict idle server refuse for good: it admits a probe (one a second), whose steps correct the model. Once served
    steps have checked the model, its predictions are trusted further: the same one is refused."""
    lat = LatencyModel({1: 0.009}, {16: 0.009}, max_rows=16)  # 64 x 9 ms = 0.58 s for an SLA of 0.2 s
    adm = AdmissionController(lat, 0.2, 64, 4, strict=True)
    probe = newcomer()
    adm.check(probe)
    adm.release(probe)
    with pytest.raises(Rejected):  # a second within PROBE_EVERY_S
        adm.check(newcomer())
    checked = LatencyModel({1: 0.009}, {16: 0.009}, max_rows=16)
    checked.observe_step(1, 0.009)
    with pytest.raises(Rejected, match="cannot deliver"):
        AdmissionController(checked, 0.2, 64, 4, strict=True).check(newcomer())


@pytest.mark.parametrize("admission", ["any", "controller"])
def test_a_slow_verdict_never_stalls_the_streams_already_running(admission):
    """A verdict forecasts on the API's thread (a millisecond or more at 16 in flight on the H100, far more on a busy
    CPU); the engine thread must not wait for it between steps. It had: the engine held its own lock for the
    verdict's whole length (which every iteration takes to update its gauges), and the controller its one lock (which
    every SLA token and every end takes)."""
    from service.engine.admission import AdmitAll

    verdict_s = 2.0  # long next to a busy 2-core host's own hiccups (400 ms seen with other jobs sharing the cores)
    slow = threading.Event()

    class SlowVerdicts(AdmitAll):
        def check(self, req):
            if slow.is_set():
                time.sleep(verdict_s)
            super().check(req)

    model = load_model("synthetic:tiny")
    if admission == "any":
        adm = SlowVerdicts(60.0)
    else:
        adm = AdmissionController(LatencyModel({1: 0.001}, {16: 0.001}, max_rows=16), 60.0, 4, 2)
    eng = Engine(ReferenceDecoder(model.config, model.weights, max_slots=2, max_context=256), model.tokenizer,
                 admission=adm, sla_ms=60_000, sla_tokens=4)
    if admission == "controller":
        forecast = adm.planner.forecast

        def slow_forecast(*args, **kwargs):
            if slow.is_set():
                time.sleep(verdict_s)  # with the newcomer (and without it, where an admitted one would be late)
            return forecast(*args, **kwargs)

        adm.planner.forecast = slow_forecast
    eng.start()
    stamps: list[float] = []
    done = threading.Event()
    try:
        eng.submit([1, 2, 3], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                   lambda d: (stamps.append(time.perf_counter()), d.finish_reason and done.set()))
        while len(stamps) < 5:
            time.sleep(0.001)
        # a second stream whose SLA token and end (each passes through admission) come during the slow verdict
        eng.submit([7, 8, 9], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), lambda d: None)
        slow.set()
        t0 = time.perf_counter()
        eng.submit([4, 5, 6], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), lambda d: None)
        assert time.perf_counter() - t0 >= verdict_s
        assert done.wait(60)
    finally:
        eng.stop()
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b >= t0 and a <= t0 + verdict_s]  # gaps it overlaps
    assert len(during) > 2 and max(during) < verdict_s / 2, f"a token waited {max(during) * 1e3:.0f} ms"


def verdict_beside_a_running_request(now: float, spent_s: float, slack_s: float, model_s: float | None = None) -> bool:
    """Whether a newcomer is admitted whose prefill launch delays a running request `spent_s` into its life
    (`model_s` of it by the model clock; None: no step has ended in its span). The running request's deadline is
    `slack_s` after its SLA token beside the newcomer, as the stretched forecast from now puts it (its past aside).
    The guard's stretch is 1.20, its usual pace 1.0; `now` is the frozen admission clock."""

    from service.engine.request import State

    lat = LatencyModel({1: 0.002, 2: 0.002}, {16: 0.02, 128: 0.025, 512: 0.03}, max_rows=64)
    adm = now_and_then_over(AdmissionController(lat, 0.2, 64, 4))
    running = newcomer(state=State.RUNNING)
    adm.check(running)
    running.output_ids = [0] * 10
    running.deadline = now + 10
    adm.check(trial := newcomer(prompt_tokens=400))
    moved = adm._promises[running.id]
    stretched = (moved.predicted - adm._promises[trial.id].at) * moved.stretch  # its SLA token beside the newcomer
    assert moved.stretch == pytest.approx(1.20)
    adm.release(trial)
    first = adm._promises[running.id]
    adm._promises[running.id] = first._replace(at=first.at - spent_s)
    if model_s is not None:  # its span began spent_s ago, and the steps since were predicted model_s
        adm.model_clock.forget(running.id)
        adm.model_clock.start(running.id, now - spent_s)
        adm.model_clock.tick(model_s, at=now, seconds=spent_s)
    running.deadline = now + stretched + slack_s
    try:
        adm.check(newcomer(prompt_tokens=400))
    except Rejected as r:
        assert "admitted one miss" in r.message
        return False
    return True


def test_an_admitted_request_keeps_the_stretch_over_all_it_has_spent_since_its_verdict(frozen_clock):
    """The guard scores a request over the span from its first verdict to its SLA token, so a newcomer's verdict
    judges the admitted requests over that span too: 50 ms into a request's life, a stretch of 1.20 holds 10 ms in
    reserve for it that a check over the time left alone (what admitted newcomers right up to its deadline, and let it
    come late by a few ms at FP8's 160 req/s on the H200) would give away. Only `spent_s` separates the verdicts."""
    assert verdict_beside_a_running_request(frozen_clock, 0.0, 0.005)  # just admitted: 5 ms to spare
    # 50 ms in: 0.2 x 50 ms = 10 ms of its span's stretch is more than the 5 ms
    assert not verdict_beside_a_running_request(frozen_clock, 0.05, 0.005)


def test_an_admitted_request_s_past_counts_as_the_guard_bounds_it_in_the_model_clock_s_time(frozen_clock):
    """The guard's score is the time from a request's verdict to its SLA token over the model clock's time between
    them, so the bound a newcomer's verdict holds an admitted request to is the stretch x (its steps so far as the model
    predicted them + the forecast of the rest). 50 ms into its life, its steps having run 4% over the model (48 ms of
    the clock's), that is 1.2 x 48 = 57.6 ms of its past, 2.4 ms less than the stretch x the wall's 50 ms (the rule of
    before: 66 of bf16's 76 `delays` refusals on the H200 had a victim on time by the bound). Never less than the time
    that really passed: steps that ran at twice the model's time are charged as they ran."""

    def verdict(spent_s, model_s, room_s):
        """Admitted beside a request `spent_s` into its life (`model_s` by the model clock) that ends `room_s` before
        its deadline by the rule's bound?"""
        past = max(spent_s, 1.2 * model_s)
        return verdict_beside_a_running_request(frozen_clock, spent_s, past - spent_s + room_s, model_s)

    assert verdict(0.05, 0.048, 0.0005)  # by the wall's 1.2 x 50 ms, 1.9 ms late
    assert not verdict(0.05, 0.048, -0.0005)  # late by the bound
    assert verdict(0.05, 0.025, 0.0005)  # its steps ran 2x the model: charged the 50 ms that passed, not 1.2 x 25
    assert not verdict(0.05, 0.025, -0.0005)


def test_no_admission_admits_every_request_unjudged_and_still_times_its_sla(monkeypatch, tmp_path):
    """--no-admission (what `bench e2e` measures capacity with): a request that a strict server refuses is admitted
    without any forecast (--sla-ms 100000 had forecast every newcomer behind the whole queue: up to 5 ms a verdict
    beside the GPU's steps), gets its deadline from its arrival all the same, and its SLA token is judged against it
    (the late share on /metrics); the log says why it was admitted."""
    from service.admission_log import AdmissionLog
    from service.engine.commit import Token
    from service.engine.output import TextOutput
    from service.engine.request import Request
    from service.model.synthetic import byte_tokenizer

    slow = LatencyModel({1: 0.050}, {16: 0.2, 128: 0.5}, max_rows=64)  # 64 tokens in 3.2 s: never within 0.1 s
    trace = AdmissionLog(tmp_path / "admission.jsonl")
    off = AdmissionController(slow, 0.1, 64, 4, strict=True, trace=trace, forecasts=False)
    assert not off.best_effort  # nothing forecast, nothing to serve best-effort about

    def no_forecast(*args, **kwargs):
        raise AssertionError("--no-admission forecast")

    monkeypatch.setattr(off.planner, "forecast", no_forecast)
    out = TextOutput(byte_tokenizer(300).detokenizer())
    reqs = [Request([1, 2, 3], SamplingParams(max_tokens=64), lambda d: None, out) for _ in range(6)]
    for r in reqs:  # more than the server's 4 slots: admission off queues them all
        off.check(r)
        assert r.deadline == pytest.approx(r.arrival + 0.1 - min(r.delivery_s, 0.1 * DELIVERY_SHARE))
    assert len(off._in_flight()) == 6
    on_time, late = reqs[0], reqs[1]
    off.consume(Token(req=on_time, token=7, n=on_time.sla_token_index, text="x", at=on_time.deadline - 0.01))
    off.consume(Token(req=late, token=7, n=late.sla_token_index, text="x", at=late.deadline + 0.01))
    assert off.guard.miss_rate()[0] == pytest.approx(0.5)
    trace.close()
    lines = [json.loads(x) for x in (tmp_path / "admission.jsonl").read_text().splitlines()]
    assert [x["req"] for x in lines] == [r.id for r in reqs]  # a verdict line each, and no SLA token's: no score
    assert all(x["kind"] == "verdict" and x["admitted"] and x["rule"] == "off" for x in lines)
