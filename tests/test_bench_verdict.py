"""`python -m bench verdict` at a few verdicts: the steady state it judges on holds as many requests in flight as asked,
at every stage of their replies, and the report says what each verdict decided and how long it took."""

from __future__ import annotations

import json
from pathlib import Path

from service.engine.request import State


def test_the_steady_state_has_the_requests_in_flight_asked_for_at_every_stage() -> None:
    from bench import verdict

    adm, planner = verdict.steady_state(12, verdict.SLA_S["room"], seed=1)
    live = [r for r in adm._in_flight() if r.state is not State.FINISHED]
    queued = {r.id for r in (*planner.waiting, *planner.prefilling, *planner.running)}
    assert len(live) == 12 and {r.id for r in live} == queued
    made = sorted(len(r.output_ids) for r in live)
    assert made[0] < 8 and made[-1] > 48, made  # new replies and ones near their 64th token
    assert all(r.deadline is not None and r.deadline > r.arrival for r in live)


def test_the_report_has_each_point_with_its_decision_and_parts(tmp_path: Path) -> None:
    from bench import verdict

    assert verdict.main(["--in-flight", "0", "15", "--verdicts", "30", "--out", str(tmp_path), "--tag", "t"]) == 0
    [report] = tmp_path.glob("verdict-t-*.json")
    doc = json.loads(report.read_text())
    points = {(p["regime"], p["in_flight"]): p for p in doc["points"]}
    assert set(points) == {(r, n) for r in ("room", "tight") for n in (0, 15)}
    idle = points["room", 0]
    assert idle["admitted"] and not idle["second_forecast"]  # an idle server admits, forecasting once
    assert not points["tight", 15]["admitted"]  # 60 ms beside 15 requests: the newcomer would be late
    for p in points.values():
        assert 0 < p["verdict_us_p50"] <= p["verdict_us_p90"] <= p["verdict_us_p99"]
        assert 0 < p["snapshot_us_p50"] and 0 < p["forecast_us_p50"]
    # beside 15 a forecast plays many more steps than alone: the time grows with the load it judges
    assert points["room", 15]["forecast_us_p50"] > 3 * idle["forecast_us_p50"]
    assert "| tight | 15 |" in report.with_suffix(".md").read_text()
