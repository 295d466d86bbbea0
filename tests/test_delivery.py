"""The hop from the engine to the front end: measured by the front end (DeliveryWatch), carried with every submit, and
taken off the request's deadline by admission, within a bound."""

import asyncio
import time
from types import SimpleNamespace

import pytest

from service.admission import DELIVERY_SHARE, AdmissionController
from service.api.delivery import FRESH_S, RECOMPUTE_S, DeliveryWatch
from service.api.state import ServerState
from service.engine import ipc
from service.engine.messages import Params, Submit
from service.engine.request import SamplingParams
from service.latency_model import LatencyModel
from tests.test_admission import newcomer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_allowance_is_the_recent_99th_percentile_and_forgets_old_deliveries():
    clock = Clock()
    watch = DeliveryWatch(clock)
    assert watch.allowance() == 0.0  # nothing seen: no room taken
    for i in range(1, 201):  # 0.1 ms ... 20 ms
        watch.observe(i * 1e-4)
    clock.t += RECOMPUTE_S
    assert watch.allowance() == pytest.approx(198e-4)  # the 198th of 200
    clock.t += FRESH_S + 1  # a stall long past: forgotten
    watch.observe(3e-4)
    assert watch.allowance() == pytest.approx(3e-4)


def test_a_deadline_leaves_room_for_the_delivery_within_a_share_of_the_sla():
    lat = LatencyModel({1: 0.001}, {16: 0.002}, max_rows=16)
    adm = AdmissionController(lat, 0.5, 64, 4)
    req = newcomer()
    req.delivery_s = 0.002
    adm.check(req)
    assert req.deadline == pytest.approx(req.arrival + 0.498)
    stalled = newcomer()
    stalled.delivery_s = 0.3  # a front end that stalled: bounded, an idle server still admits
    adm.check(stalled)
    assert stalled.deadline == pytest.approx(stalled.arrival + 0.5 * (1 - DELIVERY_SHARE))


def test_the_front_end_sends_its_allowance_with_each_submit():
    """Both ways to the engine: in this process (Engine.submit) and to the engine process (the Submit message)."""
    seen: dict[str, float] = {}

    def submit(prompt_ids, params, sink, session=None, arrival=None, received=None, delivery_s=0.0):
        seen["thread"] = delivery_s
        return SimpleNamespace()

    class Client:
        async def submit(self, *args, delivery_s=0.0, **kwargs):
            seen["process"] = delivery_s

    local = ServerState(runtime=SimpleNamespace(engine=SimpleNamespace(submit=submit)))
    remote = ServerState(client=Client())
    for st in (local, remote):
        for i in range(100):
            st._delivered(0.004 if i == 99 else 0.001)
    params = SamplingParams(max_tokens=4)
    asyncio.run(local.open_stream([1, 2], params, time.perf_counter()))
    asyncio.run(remote.open_stream([1, 2], params, time.perf_counter()))
    assert seen == {"thread": pytest.approx(0.001), "process": pytest.approx(0.001)}  # the 99th of 100 deliveries
    message = Submit(1, [1, 2], Params(4, 1.0, 1.0, 0, None, [], False, None, False), 5.0, None, 0.0021)
    assert ipc.TO_ENGINE.decode(ipc.ENCODER.encode(message)).delivery_s == pytest.approx(0.0021)
