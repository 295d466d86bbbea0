"""Launch first, judge beside the step (service/engine/launch_first.py): on an idle GPU engine a prompt that fits one
step is launched before admission's verdict, which is then judged as if made before the launch; a refusal withdraws
the request, unheard. The CPU runs the GPU's run-ahead logic (Engine.overlap) for these tests."""

from __future__ import annotations

import queue
import time

import pytest

from service.admission import AdmissionController
from service.backends.reference import ReferenceDecoder
from service.engine.admission import AdmitAll, Rejected
from service.engine.engine import Engine
from service.engine.kv_slots import KVSlots
from service.engine.planner import Planner
from service.engine.request import Delta, Request, SamplingParams
from service.latency_model import LatencyModel
from service.metrics import Metrics
from service.model.loader import load_model
from tests.test_engine import collect

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("synthetic:tiny")


class Recorded(AdmitAll):
    """AdmitAll that notes each verdict in the engine's log, and refuses the prompts it is told to."""

    def __init__(self, log: list[str], refuse: tuple[int, ...] = ()) -> None:
        super().__init__(1.0)
        self.log, self.refuse = log, refuse

    def verdict(self, req: Request, moment: object = None):
        self.log.append(f"verdict {req.prompt_ids[0]}")
        if req.prompt_ids[0] in self.refuse:
            raise Rejected("overloaded", "refused for the test")
        yield from super().verdict(req, moment)


def engine(tiny, admission, overlap: bool = True) -> tuple[Engine, list[str]]:
    """A started engine on the tiny model whose decoder notes each step's launch in the log admission writes to."""
    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, metrics=Metrics(4), admission=admission, sla_tokens=4)
    eng.overlap = overlap
    log = admission.log
    decode = dec.decode

    def noted(slots, tokens, positions, *args, **kwargs):
        log.append(f"launch {len(positions)} rows")
        return decode(slots, tokens, positions, *args, **kwargs)

    dec.decode = noted  # type: ignore[method-assign]
    eng.start()
    return eng, log


def submit_first(eng: Engine, prompt: list[int], params: SamplingParams = GREEDY):
    """As the engine process submits on the engine thread: prepared, then launched first where the engine may; the
    deltas' queue and a queue that gets the verdict (None: admitted) and whether it was launched first."""
    deltas: queue.SimpleQueue[Delta] = queue.SimpleQueue()
    verdicts: queue.SimpleQueue[tuple[bool, Rejected | None]] = queue.SimpleQueue()

    def task() -> None:
        req = eng.prepare(prompt, params, deltas.put)
        if not eng.launch_first(req, time.perf_counter(), lambda refusal: verdicts.put((True, refusal))):
            try:
                eng.admit(req)
                verdicts.put((False, None))
            except Rejected as r:
                verdicts.put((False, r))

    eng.run_soon(task)
    return deltas, verdicts


def tokens(deltas: queue.SimpleQueue[Delta]) -> list[int]:
    return [t for d in collect(deltas) for t in d.token_ids]


def metric(eng: Engine, name: str, **labels: str) -> float:
    return sum(s.value for f in eng.metrics.registry.collect() for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_an_idle_engine_launches_a_prompt_before_its_verdict_and_serves_it_the_same_tokens(tiny):
    base, _ = engine(tiny, Recorded([]), overlap=False)
    try:
        expected = [t for d in base.generate([5, 6, 7], GREEDY) for t in d.token_ids]
    finally:
        base.stop()
    eng, log = engine(tiny, Recorded([]))
    try:
        deltas, verdicts = submit_first(eng, [5, 6, 7])
        assert verdicts.get(timeout=30) == (True, None)
        assert tokens(deltas) == expected
        # its prompt's step (three rows) went to the decoder before admission judged it
        assert log[:2] == ["launch 3 rows", "verdict 5"]
        assert metric(eng, "parley_prompt_tokens_total") == 3
        # the engine busy with it: the next newcomer is judged first, then seated (not launched first)
        deltas, verdicts = submit_first(eng, [9, 9], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        assert verdicts.get(timeout=30) == (True, None)
        later, later_verdicts = submit_first(eng, [8])
        assert later_verdicts.get(timeout=30) == (False, None)
        assert len(tokens(later)) == 6 and len(tokens(deltas)) == 40
    finally:
        eng.stop()


def test_without_run_ahead_or_with_a_long_prompt_the_verdict_comes_first(tiny):
    eng, log = engine(tiny, Recorded([]), overlap=False)  # the CPU's engine: its launch runs the whole step
    try:
        deltas, verdicts = submit_first(eng, [5, 6, 7])
        assert verdicts.get(timeout=30) == (False, None)
        assert len(tokens(deltas)) == 6 and log[0] == "verdict 5"
    finally:
        eng.stop()
    eng, log = engine(tiny, Recorded([]))
    try:
        long_prompt = [3] * (eng.planner.prefill_rows + 1)  # more than one step's rows
        deltas, verdicts = submit_first(eng, long_prompt)
        assert verdicts.get(timeout=30) == (False, None)
        assert len(tokens(deltas)) == 6 and log[0] == "verdict 3"
    finally:
        eng.stop()


def test_a_refusal_after_the_launch_withdraws_the_request_unheard(tiny):
    eng, log = engine(tiny, Recorded([], refuse=(4,)))
    try:
        deltas, verdicts = submit_first(eng, [4, 5, 6])
        launched_first, refusal = verdicts.get(timeout=30)
        assert launched_first and refusal is not None and refusal.reason == "overloaded"
        assert log[:2] == ["launch 3 rows", "verdict 4"]  # its step did run
        # the next request is served: the withdrawn one's seat and slot were freed before its step
        after, after_verdicts = submit_first(eng, [7, 7])
        assert after_verdicts.get(timeout=30)[1] is None  # admitted (launched first or not: the engine may be ending
        # the withdrawn request's step when it comes)
        assert len(tokens(after)) == 6
        assert deltas.empty()  # nothing of the refused request reached its sink: not a token, not an end
        assert eng.planner.idle()
        deadline = time.monotonic() + 10
        while eng.stats.running and time.monotonic() < deadline:  # the gauges follow at the iteration's end
            time.sleep(0.01)
        assert eng.stats.running == 0 and eng.stats.waiting == 0
        assert eng.planner.slots.counts()[0] == 2  # both slots free (one caching the withdrawn prompt's K/V)
        assert metric(eng, "parley_requests_total", outcome="rejected") == 1
        assert metric(eng, "parley_requests_total", outcome="cancelled") == 0
        assert metric(eng, "parley_requests_total", outcome="completed") == 1
        assert metric(eng, "parley_prompt_tokens_total") == 2  # the admitted one's only
    finally:
        eng.stop()


def test_a_verdict_from_a_moment_judges_as_it_would_have_then():
    lat = LatencyModel({1: 0.001, 16: 0.002}, {16: 0.002, 128: 0.004}, max_rows=16)

    def controller() -> tuple[AdmissionController, Planner]:
        adm = AdmissionController(lat, 0.1, 64, 4)
        planner = Planner(KVSlots(4), 4, 16, 512)
        adm.bind(planner)
        return adm, planner

    def request() -> Request:
        return Request(prompt_ids=list(range(1, 13)), params=SamplingParams(max_tokens=64), sink=lambda d: None,
                       output=None)

    then, _ = controller()
    judged_then = request()
    then.check(judged_then)
    adm, planner = controller()
    req = request()
    moment = adm.moment(req)
    planner.add(req)  # seated and its prompt planned into a launched step, as launch_first does before the verdict
    planner.plan()
    planner.steps_ahead = 1
    time.sleep(0.005)
    for _ in adm.verdict(req, moment):
        pass
    p_then, p_now = then._promises[judged_then.id], adm._promises[req.id]
    assert p_now.at == moment.now  # promised from the moment, not from when the verdict ran
    assert p_now.predicted - p_now.at == pytest.approx(p_then.predicted - p_then.at, rel=1e-9)
    # judged from now instead, the seated request's forecast no longer counts its prompt's step
    fresh, fresh_planner = controller()
    late = request()
    fresh_planner.add(late)
    fresh_planner.plan()
    fresh_planner.steps_ahead = 1
    fresh.check(late)
    p_fresh = fresh._promises[late.id]
    assert p_fresh.predicted - p_fresh.at != pytest.approx(p_then.predicted - p_then.at, rel=1e-6)


def test_a_moment_is_stale_once_another_verdict_admitted():
    lat = LatencyModel({1: 0.001, 16: 0.002}, {16: 0.002, 128: 0.004}, max_rows=16)
    adm = AdmissionController(lat, 0.5, 64, 4)  # room for both beside each other at the guard's prior
    adm.bind(Planner(KVSlots(4), 4, 16, 512))

    def request() -> Request:
        return Request(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=64), sink=lambda d: None, output=None)

    first, other = request(), request()
    moment = adm.moment(first)
    adm.check(other)  # admitted in between (a grammar's verdict, on the side pool)
    for _ in adm.verdict(first, moment):
        pass
    # judged beside the one admitted since: its promise starts after the moment
    assert adm._promises[first.id].at > moment.now
    assert set(adm._active) == {first.id, other.id}


def test_the_engine_process_answers_a_launched_first_verdict_before_any_token() -> None:
    """Through the engine process's sockets (EngineService on threads, an EngineClient here): an idle engine's request
    launched first gets its tokens after its verdict; one refused after its launch gets a 429 and nothing else, and
    the engine is idle again with nothing of it left."""
    import asyncio
    import threading

    from service.api.engine_client import EngineClient
    from service.config import ServeConfig
    from service.engine import ipc
    from service.engine_process import EngineService
    from service.runtime import build_engine

    rt = build_engine(ServeConfig(model="synthetic:tiny", device="cpu", max_batch=2, max_context=128,
                                  calibration_budget_s=1, sla_ms=60000))
    eng = rt.engine
    eng.overlap = True  # as on a GPU
    first: list[bool] = []
    launch_first = eng.launch_first

    def noted(req, received, on_verdict):
        if req.prompt_ids[0] == 4:  # refused after its launch
            on_verdict = _refusing(eng, req, on_verdict)
        first.append(launch_first(req, received, on_verdict))
        return first[-1]

    eng.launch_first = noted  # type: ignore[method-assign]
    addresses = ipc.Addresses.fresh()
    service = EngineService(rt, addresses)
    serving = threading.Thread(target=service.serve, daemon=True)
    serving.start()

    async def go() -> None:
        client = await EngineClient.connect(addresses)
        try:
            stream = await client.submit([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
            deltas = [d async for d in stream]
            assert sum(len(d.token_ids) for d in deltas) == 5 and deltas[-1].finish_reason == "length"
            with pytest.raises(Rejected) as refused:
                await client.submit([4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
            assert refused.value.status == 429 and refused.value.reason == "overloaded"
            stream = await client.submit([7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
            assert sum(len(d.token_ids) for d in [d async for d in stream]) == 3
        finally:
            await client.close()

    try:
        asyncio.run(go())
        assert first[:2] == [True, True]  # (the third may come while the refused one's step is still ending)
        assert metric(eng, "parley_requests_total", outcome="rejected") == 1
        assert metric(eng, "parley_requests_total", outcome="cancelled") == 0
        assert eng.planner.idle() and not eng._live
    finally:
        service.stop()
        serving.join(timeout=10)
        service.close()


def _refusing(eng: Engine, req: Request, on_verdict):
    """The request's verdict refused, as admission refuses one: its own forecast said it would be late."""
    judged = eng.admission.verdict

    def refuse(r: Request, moment: object = None):
        if r is req:
            raise Rejected("overloaded", "refused for the test")
        return judged(r, moment)

    eng.admission.verdict = refuse  # type: ignore[method-assign]

    def answered(refusal: Rejected | None) -> None:
        eng.admission.verdict = judged  # type: ignore[method-assign]
        on_verdict(refusal)

    return answered
