"""`python -m bench engine-loop` on the CPU at tiny sizes: it builds an engine as `parley serve` does, runs each row
count's streams together, and reports the host's time per iteration and the gaps between a stream's tokens from
the engine's own series; the GPU's figures are absent on a CPU, not zero."""

from __future__ import annotations

import json
from pathlib import Path

from tests.host_steal import judge_on_a_steady_host


def test_engine_loop_reports_each_row_count(tmp_path: Path) -> None:
    judge_on_a_steady_host(lambda: engine_loop_windows(tmp_path))


def engine_loop_windows(tmp_path: Path) -> list[str]:
    """One run of both windows: the report's shape is asserted; the three streams' speed-up, half a second of timing
    each, is returned to be judged on a steady host (tests/host_steal.py)."""
    from bench import engine_loop

    for old in tmp_path.glob("engine-loop-t-*"):
        old.unlink()
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
    # three streams decode together: about three times the tokens a second of one (not three times the steps)
    faster = three["tokens_per_s"] / one["tokens_per_s"]
    return [] if faster > 1.5 else [f"three streams made {faster:.2f}x one stream's tokens a second, not > 1.5x"]
