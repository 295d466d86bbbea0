"""The risk budget (service/risk_budget.py) and the guard's measured risks: a request's chance of coming late is the
share of its level's scores above the pace its deadline allows; a verdict may judge at the guard's loose stretch only
while the promised risks, the newcomer counted at the cap, average within 1 - target; what reaches /metrics."""

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.admission_guard import AdmissionGuard, Level
from service.metrics import Metrics
from service.risk_budget import RISK_CAP, RiskBudget

BUSY, BESIDE_ONE = Level(4, 1), Level(1, 1)


def test_a_newcomer_is_judged_loosely_only_while_the_promises_average_within_the_target():
    budget = RiskBudget(0.995, size=400)
    assert budget.cap == pytest.approx(RISK_CAP * 0.005)
    assert not budget.room()  # nothing served yet: one request at the cap would be the whole mean
    for i in range(3):  # three served with no risk: 2% over four requests is 0.5%
        budget.promise([f"done-{i}"], [0.0])
        budget.settle(f"done-{i}")
    assert budget.room()
    budget.promise(["flying"], [0.006])  # in flight, at 0.6%: 2.6% over five is over 0.5%
    assert not budget.room()
    budget.promise(["flying"], [0.0])  # its latest verdict found it safe: the promise moves
    assert budget.room()
    assert budget.promised() == 0.0
    budget.promise(["risky"], [0.03])
    assert budget.promised() == pytest.approx(0.03 / 5)
    budget.drop("risky")  # cancelled: its promise is gone, not served
    assert budget.promised() == 0.0
    budget.settle("nobody")  # a request without a promise (refused, or best effort) changes nothing
    assert budget.promised() == 0.0


def test_the_recent_window_forgets_the_oldest_promise():
    budget = RiskBudget(0.99, size=3)
    for i, risk in enumerate([0.5, 0.0, 0.0, 0.0]):
        budget.promise([str(i)], [risk])
        budget.settle(str(i))
    assert budget.promised() == 0.0  # the 50% one has left the window of three
    assert budget.room()


def test_a_request_s_risk_is_the_share_of_its_level_s_scores_above_the_pace_it_can_afford():
    guard = AdmissionGuard(0.995)
    n = 400  # its own window (N is 399 at 0.995)
    for i in range(n):
        guard.observe(BUSY, 1.28 if i % 100 == 0 else 1.0, 1.0)  # one moment in a hundred 28% over
    assert guard.stretch(BUSY) == pytest.approx(1.28)  # the 0.995 quantile: the second largest
    assert guard.loose_stretch(BUSY) == pytest.approx(1.0)  # the 0.98 quantile: past the four slow ones
    assert guard.miss_risks(BUSY, [1.3, 1.16, 0.99]) == [0.0, pytest.approx(4 / n), 1.0]
    # a level with none of its own: its neighbours' scores, as the stretch pools them
    assert guard.miss_risks(Level(5, 1), [1.16]) == [pytest.approx(4 / n)]
    assert AdmissionGuard(0.995).miss_risks(BUSY, [1.1]) == [0.0]  # nothing seen: nothing to say
    # a request alone, short of its own N, by its own recent scores: never the busy levels' (on an H100 a 2,000-token
    # prompt alone was put at 43% by them, and its promise filled the budget for a hundred seconds)
    for score in [1.0] * 30 + [1.1] * 10:
        guard.observe(Level(0, 2), score, 1.05)
    assert guard.miss_risks(Level(0, 2), [1.05, 1.2]) == [pytest.approx(10 / 20), 0.0]
    assert AdmissionGuard(0.995).loose_stretch(BUSY) is None  # too few scores for a quantile: the stretch decides


def test_a_loose_stretch_never_exceeds_the_stretch_and_a_request_alone_short_of_its_own_has_none():
    rng = random.Random(35)
    guard = AdmissionGuard(0.99)
    for _ in range(guard.enough):
        guard.observe(BUSY, rng.lognormvariate(0, 0.1), 1.0)
    for _ in range(10):
        guard.observe(Level(0, 1), 1.0, 1.0)
    assert guard.loose_stretch(BUSY) <= guard.stretch(BUSY)
    assert guard.loose_stretch(BESIDE_ONE) <= guard.stretch(BESIDE_ONE)  # pooled from BUSY's
    assert guard.loose_stretch(Level(0, 1)) is None


def test_the_promised_late_share_on_metrics():
    guard = AdmissionGuard(0.99)
    metrics = Metrics(64)
    metrics.export_guard(guard)
    guard.budget.promise(["a"], [0.02])
    guard.budget.promise(["b"], [0.0])
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert fams["parley_admission_guard_promised_late_share"].samples[0].value == pytest.approx(0.01)
