"""Work handed to the engine thread (service/engine/handoff.py): run in order on the engine thread right after it
launches a step, taken back by another thread when the engine thread has not started it in time (the engine
process's input thread does, so that no verdict waits on a hung step), one task at a time."""

from __future__ import annotations

import threading
import time

import pytest

from service.engine.engine import Engine
from service.engine.handoff import Handoff, Then
from service.engine.request import SamplingParams
from service.model.loader import load_model


def test_tasks_run_in_order_and_a_failing_one_stops_none_after_it():
    handoff = Handoff()
    done: list[int] = []
    for i in range(3):
        handoff.put(lambda i=i: done.append(i))
    handoff.put(lambda: 1 / 0)
    handoff.put(lambda: done.append(4))
    assert handoff.run_all() >= 0 and done == [0, 1, 2, 4] and not handoff.pending()


def test_beside_a_step_only_what_fits_its_budget_runs():
    """Verdicts of 0.4 ms each beside a launched step, with half a millisecond to spend: two run now (the second
    starts inside the budget), the third waits for the next iteration rather than keep the GPU waiting."""
    now = [0.0]
    handoff = Handoff(clock=lambda: now[0])
    done: list[int] = []

    def verdict(i: int) -> None:
        now[0] += 0.0004
        done.append(i)

    for i in range(3):
        handoff.put(lambda i=i: verdict(i))
    assert handoff.run_all(budget_s=0.0005) == pytest.approx(0.0008)
    assert done == [0, 1] and handoff.pending()
    handoff.run_all(budget_s=0.0005)
    assert done == [0, 1, 2]


def test_only_tasks_past_their_patience_are_taken_back():
    now = [0.0]
    handoff = Handoff(patience_s=0.02, clock=lambda: now[0])
    done: list[str] = []
    handoff.put(lambda: done.append("old"))
    now[0] = 0.015
    handoff.put(lambda: done.append("new"))
    now[0] = 0.021
    handoff.run_stale()
    assert done == ["old"]  # the second has waited 6 ms: still the engine thread's
    now[0] = 0.04
    handoff.run_stale()
    assert done == ["old", "new"]


def test_one_runner_at_a_time_keeps_the_order():
    """The engine thread is inside a task (a verdict) when the input thread finds the next one stale: it leaves it,
    so a session's close never overtakes the submit before it."""
    handoff = Handoff(patience_s=0.0)
    order: list[str] = []
    inside, release = threading.Event(), threading.Event()

    def submit() -> None:
        inside.set()
        release.wait(5)
        order.append("submit")

    handoff.put(submit)
    handoff.put(lambda: order.append("close"))
    engine = threading.Thread(target=handoff.run_all)
    engine.start()
    assert inside.wait(5)
    handoff.run_stale()  # another thread: the runner is busy, nothing runs out of order
    assert order == []
    release.set()
    engine.join(5)
    assert order == ["submit", "close"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("synthetic:tiny")


def recorded_steps(eng: Engine) -> list:
    """The StepDone events `eng` commits from now on, in order (admission still consumes each)."""
    from service.engine.commit import StepDone

    steps: list[StepDone] = []
    consume = eng.admission.consume
    eng.admission.consume = lambda ev: (steps.append(ev) if isinstance(ev, StepDone) else None, consume(ev))[1]
    return steps


def handed_beside_a_request(eng: Engine, task, cost_s: float = 0.0) -> list:
    """Start `eng`, run a 40-token request, hand `task` (a verdict, expected to take cost_s) over once its first
    step has committed, and stop once the request ends: the StepDone events of its steps."""
    steps = recorded_steps(eng)
    eng.start()
    try:
        got = threading.Event()
        eng.submit([1, 2, 3], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                   lambda d: d.finish_reason and got.set())
        while not steps:
            time.sleep(0.001)
        eng.run_soon(task, cost_s, kind="verdict")
        assert got.wait(20)
    finally:
        eng.stop()
    return steps


def test_the_engine_runs_handed_work_on_its_own_thread_and_plans_its_request_at_once(tiny):
    from service.backends.reference import ReferenceDecoder

    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4)
    eng.start()
    try:
        ran_on: list[str] = []
        got = threading.Event()
        deltas = []

        def submit() -> None:
            ran_on.append(threading.current_thread().name)
            eng.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                       lambda d: (deltas.append(d), d.finish_reason and got.set()))

        time.sleep(0.05)  # the engine idle, waiting for work
        eng.run_soon(submit)
        assert got.wait(10)
        assert ran_on == ["parley-engine"] and deltas[-1].finish_reason == "length"
    finally:
        eng.stop()


def test_an_engine_thread_that_never_runs_it_does_not_keep_a_verdict(tiny):
    from service.backends.reference import ReferenceDecoder

    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4)  # never started: as if hung or dead
    ran = threading.Event()
    eng.run_soon(ran.set)
    eng.handoff.run_stale()
    assert not ran.is_set()  # not yet past its patience
    time.sleep(eng.handoff.patience_s + 0.01)
    eng.handoff.run_stale()
    assert ran.is_set()


def test_a_step_says_how_long_handed_work_ran_within_its_cadence(tiny):
    """The verdicts the engine thread runs beside a step lengthen the cadence admission learns a step's time from: each
    StepDone carries the seconds of handed-over work its iteration ran (the admission log's `handed_ms`), so that a
    step that ran long beside a verdict reads as the host's, not the kernel's."""
    from service.backends.reference import ReferenceDecoder

    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4)
    steps = handed_beside_a_request(eng, lambda: time.sleep(0.004))  # a 4 ms verdict, beside a request's steps
    handed = [s.handed_over for s in steps if s.handed_over > 0]
    assert len(handed) == 1 and handed[0] >= 0.004
    (beside,) = [s for s in steps if s.handed_over > 0]
    assert beside.seconds >= beside.handed_over  # within its cadence
    ((kind, took),) = beside.handed  # and what it was (the admission log names the task that held a step up)
    assert kind == "verdict" and 0.004 <= took <= beside.handed_over


def test_work_handed_on_runs_next_and_waits_for_the_next_step_where_it_does_not_fit():
    """A verdict in two halves beside steps with half a millisecond to spend: the request built (0.3 ms), then the
    forecast (0.4 ms expected): together they would keep the GPU waiting, so the forecast runs first beside the next
    step, before a session's close put after the verdict."""
    now = [0.0]
    handoff = Handoff(clock=lambda: now[0])
    done: list[str] = []

    def forecast() -> None:
        now[0] += 0.0004
        done.append("forecast")

    def build() -> Then:
        now[0] += 0.0003
        done.append("build")
        return Then(forecast, cost_s=0.0004, kind="verdict")

    handoff.put(build, kind="prepare")
    handoff.put(lambda: done.append("close"), kind="close")
    ran: list[tuple[str, float]] = []
    assert handoff.run_all(budget_s=0.0005, ran=ran) == pytest.approx(0.0003)
    assert done == ["build"] and handoff.pending() and ran == [("prepare", pytest.approx(0.0003))]
    ran.clear()
    handoff.run_all(budget_s=0.0005, ran=ran)
    assert done == ["build", "forecast", "close"]
    assert ran == [("verdict", pytest.approx(0.0004)), ("close", 0.0)]  # each task by the kind it was handed as
    handoff.put(build)  # where both fit, both run beside one step
    handoff.run_all(budget_s=0.001)
    assert done[3:] == ["build", "forecast"] and not handoff.pending()


@pytest.mark.parametrize(("budget_ms", "steps_beside"), [(3.0, 2), (20.0, 1)], ids=["apart", "together"])
def test_the_engines_budget_decides_whether_a_verdicts_second_part_runs_beside_the_same_step(tiny, budget_ms,
                                                                                           steps_beside):
    """--handoff-budget-ms: a 2 ms verdict whose second part is expected to take 2 ms more runs whole beside one
    step where the engine's budget holds both parts, and its second part waits for the next step where it does not
    (the host's slack beside a step is what the budget says; past it the GPU would wait). The engine runs a step
    ahead, as on a GPU: one that runs step by step has nothing in flight between steps and runs handed-over work
    whole before its next launch."""
    from tests.test_engine import recorded_engine

    eng, _ = recorded_engine(tiny, overlap=True)
    eng.handoff_budget_s = budget_ms / 1e3

    def second() -> None:
        time.sleep(0.002)

    def first() -> Then:
        time.sleep(0.002)
        return Then(second, 0.002, "delays")

    steps = handed_beside_a_request(eng, first, 0.002)
    beside = [[kind for kind, _ in s.handed] for s in steps if s.handed]
    assert beside == ([["verdict"], ["delays"]] if steps_beside == 2 else [["verdict", "delays"]])


def test_a_task_that_does_not_fit_still_runs_first_and_a_stale_one_runs_whole():
    now = [0.0]
    handoff = Handoff(patience_s=0.02, clock=lambda: now[0])
    done: list[str] = []
    handoff.put(lambda: done.append("long"), cost_s=0.002)  # over any step's budget: it would never run otherwise
    handoff.put(lambda: done.append("short"), cost_s=0.002)
    handoff.run_all(budget_s=0.0005)
    assert done == ["long"]
    handoff.put(lambda: (done.append("build"), Then(lambda: done.append("forecast"), 0.001))[1])
    now[0] = 0.05  # the engine thread is stuck in a step: another thread takes everything back, halves in order
    handoff.run_stale()
    assert done == ["long", "short", "build", "forecast"] and not handoff.pending()


def test_a_verdicts_halves_prepare_then_admit_and_admit_learns_what_a_verdict_costs(tiny):
    """Engine.prepare builds and checks a request without a verdict (bad input fails there, admission never sees it);
    Engine.admit decides; each half's running mean (prepare_s, verdict_s: what it is expected to take where it is
    handed over) learns from them."""
    from service.backends.reference import ReferenceDecoder

    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4)
    with pytest.raises(ValueError):
        eng.prepare([1, 2, tiny.config.vocab_size], SamplingParams(max_tokens=4), lambda d: None)
    assert eng.verdict_s == 0.0 and eng.stats.waiting == 0
    req = eng.prepare([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), lambda d: None)
    assert eng.stats.waiting == 0 and req.prompt_blocks is not None and eng.prepare_s > 0.0
    assert eng.admit(req) is req and eng.stats.waiting == 1 and eng.verdict_s > 0.0


def test_a_verdict_with_a_second_forecast_hands_it_on_as_a_third_part(tiny):
    """Where admission's verdict has two parts (its `delays` rule's second forecast apart from the first),
    Engine.admit_in_parts yields between them and learns each part's own time, not the wait between (verdict_s,
    delays_s); the engine process hands the second part on as a Then expected to take delays_s, and answers the
    front end only once it has run."""
    from types import SimpleNamespace

    from service.backends.reference import ReferenceDecoder
    from service.engine.admission import AdmitAll
    from service.engine_process import EngineService

    class TwoParts(AdmitAll):
        def verdict(self, req):
            time.sleep(0.002)
            yield
            time.sleep(0.003)
            self.check(req)

    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4, admission=TwoParts(1.0))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    req = eng.prepare([1, 2, 3], params, lambda d: None)
    parts = eng.admit_in_parts(req)
    next(parts)
    assert eng.stats.waiting == 0 and eng.verdict_s > 0.0 and eng.delays_s == 0.0
    time.sleep(1.0)  # steps run between the parts: not the verdict's time
    with pytest.raises(StopIteration):
        next(parts)
    assert eng.stats.waiting == 1 and eng.delays_s > 0.0
    forecast = {s.name: s.value for f in eng.metrics.registry.collect() for s in f.samples
                if s.name.startswith("parley_admission_forecast_seconds")}
    assert forecast["parley_admission_forecast_seconds_count"] == 1
    assert 0.005 <= forecast["parley_admission_forecast_seconds_sum"] < 1.0

    proc = EngineService.__new__(EngineService)  # its verdict path alone: no sockets
    proc.engine = eng
    answered: list = []
    proc._decided = lambda m, verdict, admitted: answered.append((verdict, admitted))
    req = eng.prepare([4, 5, 6], params, lambda d: None)
    then = proc._verdict(SimpleNamespace(rid=7), req, time.perf_counter())
    assert isinstance(then, Then) and then.cost_s == eng.delays_s and then.kind == "delays" and answered == []
    assert then.task() is None
    ((verdict, admitted),) = answered
    assert verdict.rid == 7 and verdict.status == 0 and admitted is req and eng.stats.waiting == 2


def test_a_running_ahead_engine_counts_work_handed_before_its_first_step_within_that_step(tiny):
    """An engine that runs a step ahead (a GPU's) and has nothing in flight runs handed-over work first, then launches:
    that work is within the launched step's cadence, and the step's StepDone says so (kind and seconds), as a step
    completed in the same iteration does (the admission log names the task that held a step up)."""
    from tests.test_engine import recorded_engine

    eng, _ = recorded_engine(tiny, overlap=True)
    steps = recorded_steps(eng)
    got = threading.Event()

    def verdict() -> None:  # a 4 ms verdict that admits its request: the engine launches its first step right after
        time.sleep(0.004)
        eng.submit([1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                   lambda d: d.finish_reason and got.set())

    eng.start()
    try:
        time.sleep(0.05)  # idle: nothing in flight
        eng.run_soon(verdict, kind="verdict")
        assert got.wait(10)
    finally:
        eng.stop()
    first = steps[0]
    assert first.handed_over >= 0.004
    assert [kind for kind, _ in first.handed] == ["verdict"] and first.handed[0][1] >= 0.004
    assert all(s.handed_over == 0 for s in steps[1:])
