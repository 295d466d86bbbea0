"""`python -m bench step-host` at a few steps: every request decodes in each timed step, the engine process's message
carries each one's token (and no text: its front end detokenizes), and the report has each count of requests."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from service.engine.messages import StepOutput


def test_each_step_carries_every_requests_token_and_no_text(tmp_path: Path) -> None:
    from bench import step_host
    from service.engine.commit import commit

    engine, outbox = step_host.engine_with(5, seed=1)
    plan = engine.planner.plan()
    assert len(plan.sampled) == 5 and not plan.chunks
    engine._publish(commit(plan, step_host.token_source(2), engine.eos, step_host.CONTEXT, 0.0, 0.001))
    box = list(outbox.box)
    outbox.flush()
    assert [len(o.token_ids) for o in box] == [1] * 5 and all(o.text == "" for o in box)
    assert sorted(o.rid for o in box) == list(range(5))
    assert outbox.bytes == len(msgspec.msgpack.encode(StepOutput(box, 0.0)))


def test_the_report_has_each_count_of_requests(tmp_path: Path) -> None:
    from bench import step_host

    assert step_host.main(["--decoding", "1", "4", "--steps", "20", "--out", str(tmp_path), "--tag", "t"]) == 0
    [report] = tmp_path.glob("step-host-t-*.json")
    points = json.loads(report.read_text())["points"]
    assert [p["decoding"] for p in points] == [1, 4]
    for p in points:
        assert 0 < p["plan_us"] and 0 < p["step_us"] and p["message_bytes"] > 0
    # four tokens make a longer message than one (their times are the bench's to show: a timed comparison of 20 steps
    # read 34.5 against 35.3 µs on a busy CI host)
    assert points[1]["message_bytes"] > points[0]["message_bytes"]
    assert "| 4 |" in report.with_suffix(".md").read_text()
