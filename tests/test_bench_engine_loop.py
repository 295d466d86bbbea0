"""`python -m bench engine-loop` on the CPU at tiny sizes: it builds an engine as `parley serve` does, runs each row
count's streams together, and reports the host's time per iteration and the gaps between a stream's tokens from
the engine's own series; the GPU's figures are absent on a CPU, not zero."""

from __future__ import annotations

import json
from pathlib import Path


def test_engine_loop_reports_each_row_count(tmp_path: Path) -> None:
    """Both windows' report, and three streams decoding together: three tokens a loop iteration (one step for the
    three rows), where one stream gets one, both counted by the engine between the same two scrapes. Not their tokens
    a second: on a 2-vCPU VM torch's two intra-op threads made the tiny model's 3-row step 3x its 1-row step (one
    thread: 2.96x the tokens a second), which says how that host schedules OpenMP, not how the engine loop batches
    (bench/NOTES.md); nor the stamps' tokens over the window's nominal seconds, which a busy host's slow scrape
    stretched."""
    from bench import engine_loop

    assert engine_loop.main(["--rows", "1", "3", "--seconds", "0.5", "--out", str(tmp_path), "--tag", "t"]) == 0
    [report] = tmp_path.glob("engine-loop-t-*.json")
    doc = json.loads(report.read_text())
    assert doc["model"] == "synthetic:tiny" and doc["backend"] == "reference"
    one, three = doc["windows"]
    assert (one["rows"], three["rows"]) == (1, 3)
    for w in (one, three):
        assert w["loop_iterations"] > 10 and 0 < w["host_us_p50"] <= w["host_us_p99"]
        assert 0 < w["token_gap_us_p50"] <= w["token_gap_us_p99"] <= w["token_gap_us_max"]
        assert w["gpu_idle_us_p99"] is None and w["step_gpu_us_p50"] is None and w["gap_p99_over_step"] is None
    assert "| 3 |" in report.with_suffix(".md").read_text()
    per_iteration = [w["tokens_per_iteration"] for w in (one, three)]
    assert 0.9 < per_iteration[0] < 1.1 and 2.7 < per_iteration[1] < 3.1, doc["windows"]
