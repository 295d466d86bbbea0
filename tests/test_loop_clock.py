"""The engine loop measured (service/engine/loop_clock.py): the host's time per iteration, and the GPU's idle time
between consecutive steps from events read only once complete; on /metrics, and with no idle series without a GPU."""

from __future__ import annotations

import queue
import statistics
import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from service.backends.reference import ReferenceDecoder
from service.engine.admission import AdmitAll
from service.engine.engine import Engine
from service.engine.host_path import LAUNCH_PREP, READ, HostPath, IdleGaps
from service.engine.loop_clock import LoopClock
from service.engine.request import SamplingParams
from service.engine.slow_steps import ThreadClock
from service.metrics import LOOP_BUCKETS, Metrics
from service.model.loader import load_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("synthetic:tiny")


def histogram(name: str) -> Histogram:
    return Histogram(name, name, buckets=LOOP_BUCKETS, registry=CollectorRegistry())


def observed(h: Histogram) -> tuple[float, float]:
    """(count, sum) of an unlabelled histogram."""
    samples = {s.name: s.value for s in h.collect()[0].samples}
    return samples[h._name + "_count"], samples[h._name + "_sum"]


class FakeGPU:
    """A stream's clock: each event recorded takes the next time the test scheduled, and has completed once the GPU's
    `now` has passed it. The clock never waits: a query of an event not reached yet says no."""

    def __init__(self) -> None:
        self.now = 0.0
        self.times: list[float] = []
        self.made = 0

    def event(self) -> FakeEvent:
        self.made += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu: FakeGPU) -> None:
        self.gpu, self.at = gpu, None

    def record(self, stream=None) -> None:
        self.at = self.gpu.times.pop(0)

    def query(self) -> bool:
        return self.at <= self.gpu.now

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.query() and end_event.query(), "read before both events completed: a synchronisation"
        return (end_event.at - self.at) * 1e3


def fake_clock() -> tuple[LoopClock, FakeGPU, Histogram, Histogram]:
    gpu, host, idle = FakeGPU(), histogram("host"), histogram("idle")
    clock = LoopClock(torch.device("cpu"), host, idle, new_event=gpu.event, step_gpu=histogram("step"))
    return clock, gpu, host, idle


def step(clock: LoopClock, gpu: FakeGPU, start: float, end: float, consecutive: bool) -> None:
    gpu.times += [start, end]
    clock.step_start()
    clock.step_end(consecutive)


def test_idle_is_the_gap_between_consecutive_steps_read_once_complete():
    clock, gpu, host, idle = fake_clock()
    step(clock, gpu, 0.000, 0.001, consecutive=False)  # the first of a run: no gap
    step(clock, gpu, 0.001030, 0.002, consecutive=True)  # 30 us after the first ended
    clock.iteration(0.0002, 0.0)
    assert observed(idle) == (0, 0), "read before the GPU reached the next step's start"
    gpu.now = 0.0015  # the second step has started: its gap is known
    clock.iteration(0.0002, 0.0)
    count, total = observed(idle)
    assert count == 1 and total == pytest.approx(30e-6)
    step(clock, gpu, 0.002, 0.003, consecutive=True)  # queued behind the last one: no idle at all
    step(clock, gpu, 0.010, 0.011, consecutive=False)  # after the engine had read everything: the server idle
    step(clock, gpu, 0.0112, 0.012, consecutive=True)  # 200 us late
    gpu.now = 1.0
    clock.iteration(0.0002, 0.0)
    count, total = observed(idle)
    assert count == 3 and total == pytest.approx(30e-6 + 0 + 200e-6)
    assert count == 3 and observed(host)[0] == 3
    # two events for each step not read yet (three here) and the last one's end: reused once read, not made anew
    assert gpu.made <= 8, f"events are reused once read, not made anew every step ({gpu.made} made)"
    assert clock.step_gpu is not None
    count, total = observed(clock.step_gpu)
    assert count == 5 and total == pytest.approx(0.001 + 0.00097 + 0.001 + 0.001 + 0.0008)


def test_a_step_the_gpu_ran_slowly_is_timed_once_it_has_finished():
    clock, gpu, _, idle = fake_clock()
    assert clock.step_gpu is not None
    step(clock, gpu, 0.000, 0.001, consecutive=False)
    step(clock, gpu, 0.001, 0.021, consecutive=True)  # 20 ms on the GPU: no idle gap, no host time
    gpu.now = 0.005
    clock.iteration(0.0002, 0.0)
    assert observed(clock.step_gpu) == (1, pytest.approx(0.001))  # the second has started, not finished
    assert observed(idle) == (1, pytest.approx(0.0))
    gpu.now = 0.03
    clock.iteration(0.0002, 0.0)
    assert observed(clock.step_gpu) == (2, pytest.approx(0.021))
    assert observed(idle) == (1, pytest.approx(0.0))  # its gap was read once, when it started


def test_a_failed_launch_pairs_with_nothing():
    clock, gpu, _, idle = fake_clock()
    step(clock, gpu, 0.0, 0.001, consecutive=False)
    gpu.times += [0.002]
    clock.step_start()
    clock.step_failed()  # the step raised before it ended
    step(clock, gpu, 0.005, 0.006, consecutive=True)  # its predecessor is gone: a new run
    gpu.now = 1.0
    clock.iteration(0.0, 0.0)
    assert observed(idle) == (0, 0)


def test_a_step_starts_at_its_first_start_and_a_second_changes_nothing():
    """The engine starts a step before its prefix copies, and the decoder again before its input copy: the first
    queued work is the step's start (a second event would be recorded, and the copies' time read as idle)."""
    clock, gpu, _, idle = fake_clock()
    step(clock, gpu, 0.000, 0.001, consecutive=False)
    gpu.times += [0.0012, 0.003]  # the host was 200 us late to queue the second step's first work
    clock.step_start()  # its prefix copy
    clock.step_start()  # the decoder's input copy: no event recorded
    clock.step_end(consecutive=True)
    gpu.now = 1.0
    clock.iteration(0.0, 0.0)
    assert observed(idle) == (1, pytest.approx(200e-6))
    assert clock.step_gpu is not None
    assert observed(clock.step_gpu) == (2, pytest.approx(0.001 + 0.0018))


def test_host_time_is_the_iteration_less_the_device_and_never_negative():
    clock, _, host, _ = fake_clock()
    clock.iteration(0.003, 0.0025)
    clock.iteration(0.001, 0.0012)  # timers read in a different order: no negative time
    count, total = observed(host)
    assert count == 2 and total == pytest.approx(0.0005)


def test_without_cuda_only_the_host_is_measured():
    host = histogram("host")
    clock = LoopClock(torch.device("cpu"), host, histogram("idle"))  # a CPU device: no events, whatever is passed
    assert not clock.gpu
    clock.step_start()
    clock.step_end(consecutive=True)
    clock.iteration(0.001, 0.0)
    assert observed(host)[0] == 1


def metric_families(metrics: Metrics) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def test_engine_exports_host_time_per_iteration_and_no_gpu_idle_on_the_cpu(tiny):
    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4)
    eng.start()
    try:
        t0 = time.perf_counter()
        deltas = list(eng.generate(list(range(1, 33)), GREEDY))
        wall = time.perf_counter() - t0
    finally:
        eng.stop()
    assert deltas[-1].finish_reason == "length"
    fams = metric_families(eng.metrics)
    assert "parley_gpu_idle_seconds" not in fams, "an idle time no GPU measured must be absent, not zeros"
    samples = {s.name: s.value for s in fams["parley_engine_host_seconds"].samples}
    # one iteration per step at least (the prompt's, then a decode step per token after the first)
    assert samples["parley_engine_host_seconds_count"] >= GREEDY.max_tokens
    # the host's share excludes the steps' compute: less than the request's wall time
    assert 0 < samples["parley_engine_host_seconds_sum"] < wall


class StampingDecoder(ReferenceDecoder):
    """The reference decoder, noting when each step is called (perf_counter)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.called: queue.SimpleQueue[float] = queue.SimpleQueue()

    def decode(self, *args, **kwargs):
        self.called.put(time.perf_counter())
        return super().decode(*args, **kwargs)


class HookedDecoder(ReferenceDecoder):
    """The reference decoder with the megakernel's `before_launch` hook, called between its preparation and its
    compute, as the megakernel calls it before its input copy."""

    before_launch = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hooked = 0

    def decode(self, *args, **kwargs):
        if self.before_launch is not None:
            self.before_launch()
            self.hooked += 1
        return super().decode(*args, **kwargs)


def test_the_engine_starts_its_step_clock_where_the_decoder_queues_its_first_work(tiny):
    dec = HookedDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4)
    assert dec.before_launch is not None, "the engine hands its clock's step start to a decoder that can call it"
    eng.start()
    try:
        deltas = list(eng.generate(list(range(1, 33)), GREEDY))
    finally:
        eng.stop()
    assert deltas[-1].finish_reason == "length"
    assert dec.hooked >= GREEDY.max_tokens  # every step (the prompt's, then one a token) called it


def test_an_idle_engine_starts_a_submitted_request_at_once(tiny):
    """Issue 37: on an idle server the engine thread is woken by submit, not found by a poll. Each request is sent
    after the engine has gone back to waiting for work; from submit to its first step's call, the median of 21 must
    be under 4 ms (0.2 ms on two cores; an engine that polled every 10 ms took 5.5, one that waited for its 0.5 s
    timeout would take 250)."""
    dec = StampingDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4)
    eng.start()
    waits = []
    try:
        for i in range(21):
            done = threading.Event()
            # the engine back to waiting for work; pauses of unequal length, so that no poll's period can line up
            time.sleep(0.02 + 0.0037 * (i % 7))
            t0 = time.perf_counter()
            eng.submit([1, 2, 3, 4], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                       lambda d, done=done: d.finish_reason is not None and done.set())
            waits.append(dec.called.get(timeout=30) - t0)
            assert done.wait(30)
    finally:
        eng.stop()
    assert statistics.median(waits) < 0.004, f"submit to the first step: {sorted(waits)}"


@pytest.mark.gpu
def test_gpu_idle_between_consecutive_steps_is_measured_on_cuda(tiny):
    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128, device="cuda")
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4)
    eng.start()
    try:
        deltas = list(eng.generate(list(range(1, 33)), SamplingParams(max_tokens=32, temperature=0.0,
                                                                      ignore_eos=True)))
    finally:
        eng.stop()
    assert deltas[-1].finish_reason == "length"
    samples = {s.name: s.value for s in metric_families(eng.metrics)["parley_gpu_idle_seconds"].samples}
    # 32 steps, each but the first launched while the one before ran; the last gaps may not have been read yet
    assert samples["parley_gpu_idle_seconds_count"] >= 16
    assert samples["parley_gpu_idle_seconds_sum"] >= 0


class RefuseSecond(AdmitAll):
    """Admits the first request, refuses every later one (as an overloaded server would)."""

    def __init__(self) -> None:
        self.seen = 0

    def bind(self, planner) -> None: ...

    def check(self, req) -> None:
        from service.engine.admission import Rejected

        self.seen += 1
        req.deadline = req.arrival + 0.1
        if self.seen > 1:
            raise Rejected("overloaded", "full")

    def consume(self, event) -> None: ...

    def headroom(self, now: float) -> float:
        return 0.1


def test_the_budget_gone_before_the_verdict_is_measured_admitted_or_refused(tiny):
    """parley_admission_verdict_seconds: from a request's arrival (its SLA clock, which x-request-start may start
    before it reached the server) to admission's verdict. On the H100 a fresh 2,000-token prompt reached its verdict
    5-9 ms after arriving and was refused at a forecast of 101-103 ms: the front end's share of the budget."""
    from service.engine.admission import Rejected

    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4, admission=RefuseSecond())
    sink = queue.SimpleQueue()
    eng.submit(list(range(1, 9)), GREEDY, sink.put, arrival=time.perf_counter() - 0.040)  # sent 40 ms ago
    with pytest.raises(Rejected):
        eng.submit(list(range(1, 9)), GREEDY, sink.put, arrival=time.perf_counter() - 0.004)
    samples = {(s.name, s.labels.get("le")): s.value
               for s in metric_families(eng.metrics)["parley_admission_verdict_seconds"].samples}
    assert samples[("parley_admission_verdict_seconds_count", None)] == 2  # the refused one too
    assert samples[("parley_admission_verdict_seconds_bucket", "0.003")] == 0  # neither before 3 ms
    assert samples[("parley_admission_verdict_seconds_bucket", "0.02")] == 1  # the refused one, 4 ms in
    assert 0.044 <= samples[("parley_admission_verdict_seconds_sum", None)] < 0.5


class SlowVerdict(RefuseSecond):
    """Admits the first request after a forecast of 5 ms."""

    def check(self, req) -> None:
        time.sleep(0.005)
        super().check(req)


def test_the_budget_before_the_verdict_is_split_where_it_went(tiny):
    """parley_engine_received_seconds (arrival to the engine's receipt: client, front end, the hop to the engine
    process) and parley_admission_forecast_seconds (the verdict's own time): on the H100 an idle server's verdict came
    2.7 ms after arrival, and what of it was the front end and what the forecast was not measured."""
    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=4, admission=SlowVerdict())
    now = time.perf_counter()
    eng.submit(list(range(1, 9)), GREEDY, queue.SimpleQueue().put, arrival=now - 0.040, received=now - 0.030)
    fams = metric_families(eng.metrics)

    def total(name: str) -> float:
        return next(s.value for s in fams[name].samples if s.name == name + "_sum")

    assert total("parley_engine_received_seconds") == pytest.approx(0.010, abs=1e-6)  # read 10 ms after it was sent
    assert 0.005 <= total("parley_admission_forecast_seconds") < 0.030  # the verdict's own time
    assert total("parley_admission_verdict_seconds") >= 0.045  # all of it, the wait for the engine included
    eng.stop()


def test_a_delta_read_late_by_the_event_loop_is_timed_from_its_publication() -> None:
    """QueuedDeltas (the front end's queue of a request's deltas): a delta of tokens is timed from when the engine
    published it to when the reply reads it, however long the event loop was busy in between; deltas made in the
    front end (a cancel's) and deltas without tokens are not."""
    import asyncio

    from service.api.streaming import QueuedDeltas
    from service.engine.request import Delta

    waits: list[float] = []

    async def read() -> list[Delta]:
        q = QueuedDeltas(waits.append)
        published = time.perf_counter()
        q._queue.put_nowait((Delta("a", [1]), published))
        time.sleep(0.03)  # the event loop busy elsewhere (this coroutine holds it) before the reply reads
        q._queue.put_nowait((Delta("", []), time.perf_counter()))
        q._queue.put_nowait((Delta("b", [2], finish_reason="cancelled"), None))
        return [d async for d in q]

    got = asyncio.run(read())
    assert [d.text for d in got] == ["a", "", "b"]
    assert len(waits) == 1 and 0.03 <= waits[0] < 1.0, waits


class Ticks:
    """A host clock the test moves by hand, and the engine thread's own clock beside it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cpu_s = 0.0

    def __call__(self) -> float:
        return self.now

    def thread(self) -> ThreadClock:
        return ThreadClock(self.cpu_s, 0, 0)


def test_a_gap_is_the_end_of_the_host_s_path_to_the_step():
    """The GPU finished the last step `gap` before this one's start: the host spent that time in the path's last
    phases, whatever came before (a verdict handed over while the GPU was busy)."""
    ticks = Ticks()
    path = HostPath(clock=ticks, thread=ticks.thread)
    for phase, seconds in (("choose", 50e-6), ("handed over", 400e-6), (READ, 300e-6), ("commit", 150e-6),
                           ("plan", 60e-6), ("feed", 90e-6), ("feed", 10e-6)):
        ticks.now += seconds
        path.mark(phase)
    ticks.now += 40e-6
    ticks.cpu_s = 0.0008
    to_launch = path.launched()
    assert [p for p, _ in to_launch.phases] == ["choose", "handed over", READ, "commit", "plan", "feed",
                                                LAUNCH_PREP]
    assert to_launch.ran_s == pytest.approx(0.0008)
    assert to_launch.within(250e-6) == pytest.approx({LAUNCH_PREP: 40e-6, "feed": 100e-6, "plan": 60e-6,
                                                      "commit": 50e-6})
    assert to_launch.cause(250e-6) == "feed"
    assert to_launch.cause(1000e-6) == "handed over"  # the GPU waited since before the read: the verdict was late
    ticks.now += 30e-6
    assert path.launched().phases == [(LAUNCH_PREP, pytest.approx(30e-6))]  # a new path from the last start


def test_a_long_gap_is_counted_by_the_phase_it_overlapped_most():
    registry = CollectorRegistry()
    gaps = Counter("gaps", "gaps", ["after"], registry=registry)
    gap_seconds = Counter("gap_seconds", "gap seconds", ["after"], registry=registry)
    gpu, ticks = FakeGPU(), Ticks()
    clock = LoopClock(torch.device("cpu"), histogram("host"), histogram("idle"), new_event=gpu.event,
                      idle_gaps=IdleGaps(gaps, gap_seconds), path=HostPath(clock=ticks, thread=ticks.thread))

    def launch(start: float, end: float, *phases: tuple[str, float]) -> None:
        for phase, seconds in phases:
            ticks.now += seconds
            clock.mark(phase)
        step(clock, gpu, start, end, consecutive=True)

    launch(0.000, 0.001)
    launch(0.00105, 0.002, ("commit", 200e-6), ("plan", 50e-6))  # 50 us: not counted
    launch(0.0023, 0.003, ("handed over", 700e-6), (READ, 5e-6), ("commit", 200e-6))  # 300 us
    launch(0.0035, 0.004, ("handed over", 700e-6), (READ, 400e-6), ("send out", 450e-6), ("feed", 50e-6))
    gpu.now = 1.0
    clock.iteration(0.0, 0.0)
    assert registry.get_sample_value("gaps_total", {"after": "commit"}) == 1  # 200 of its 300 us
    assert registry.get_sample_value("gaps_total", {"after": "send out"}) == 1  # 450 of its 500 us
    assert registry.get_sample_value("gaps_total", {"after": "handed over"}) is None
    assert registry.get_sample_value("gap_seconds_total", {"after": "handed over"}) == pytest.approx(95e-6)
    assert registry.get_sample_value("gap_seconds_total", {"after": "feed"}) == pytest.approx(50e-6)
    assert registry.get_sample_value("gap_seconds_total", {"after": "send out"}) == pytest.approx(450e-6)
