"""Today's admission guard (service/admission_guard.py) replayed over a server's admission log (`--admission-log`): the
scores its admitted requests left, fed in the order they came, and at each verdict the stretch this guard gives beside
the one the server gave; the refusals as late whose forecast the replayed stretch meets. A change to the guard is
judged on a GPU run's own log from a machine without one:
    python -m bench.guard_replay RAW/admission-LABEL.jsonl [--target 0.995] [--window-s 10]
Only the newcomer's own rule (`late`) is replayed. What admitting it would have done next (the verdicts after it, the
`delays` rule, its own score) the log cannot say: a flipped refusal is a turn the new guard would have let in, not one
shown to be on time. The log does not record --sla-target: pass the server's (0.995 by default).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.admission_trace import read
from service.admission_guard import IN_FLIGHT_BUCKETS, PROMPT_KINDS, AdmissionGuard, Level

LEVELS = {tuple(sorted(lv.labels.items())): lv
          for lv in (Level(i, k) for i in range(len(IN_FLIGHT_BUCKETS) + 1) for k in range(len(PROMPT_KINDS)))}


def level_of(labels: dict[str, str]) -> Level:
    return LEVELS[tuple(sorted(labels.items()))]


@dataclass
class Window:
    """One stretch of the log: its verdicts beside others (alone, the guard asks its own level only), their stretches
    as logged and as replayed, and the refusals as late."""

    start_s: float
    verdicts: int = 0
    differ: int = 0  # verdicts whose replayed stretch is not the logged one (0 replaying the server's own guard)
    logged: list[float] = field(default_factory=list)
    replayed: list[float] = field(default_factory=list)
    late: int = 0
    met: int = 0  # refused as late; the replayed stretch meets their deadline


def replay(lines: list[dict[str, Any]], target: float = 0.995, window_s: float = 10.0) -> list[Window]:
    """The log's verdicts judged again by a fresh AdmissionGuard(target) fed the log's scores as they came."""
    guard = AdmissionGuard(target)
    windows: list[Window] = []
    t0 = next((x["t"] for x in lines if "t" in x), 0.0)
    for x in lines:
        if x.get("kind") == "sla_token" and x.get("score") is not None:
            guard.observe(level_of(x["level"]), x["score"], x["stretch"])
        elif x.get("kind") == "verdict" and x.get("stretch") is not None and x.get("rule") != "probe":
            start = (x["t"] - t0) // window_s * window_s
            if not windows or windows[-1].start_s != start:
                windows.append(Window(start))
            w = windows[-1]
            stretch = guard.stretch(level_of(x["level"]))
            w.verdicts += 1
            w.differ += abs(stretch - x["stretch"]) > 1e-6 * x["stretch"]
            if x["in_flight"] > 1:
                w.logged.append(x["stretch"])
                w.replayed.append(stretch)
            if x["rule"] == "late" and not x["admitted"]:
                w.late += 1
                w.met += x["forecast_ms"] * stretch <= x["left_ms"]
    return windows


def markdown(windows: list[Window]) -> str:
    head = ("| from s | verdicts | stretch differs | logged stretch p50 (beside others) | replayed p50 | refused late "
            "| of them met by the replay |\n|---|---|---|---|---|---|---|")
    rows = [f"| {w.start_s:.0f} | {w.verdicts} | {w.differ} | {_fmt(_median(w.logged))} | "
            f"{_fmt(_median(w.replayed))} | {w.late} | {w.met} |" for w in windows]
    late, met = sum(w.late for w in windows), sum(w.met for w in windows)
    return "\n".join([head, *rows, f"\nIn all: {met} of {late} refusals as late met by the replayed stretch."])


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.guard_replay", description=__doc__.split("\n")[0])
    ap.add_argument("log", type=Path, help="an admission log (admission-LABEL.jsonl)")
    ap.add_argument("--target", type=float, default=0.995, help="the server's --sla-target")
    ap.add_argument("--window-s", type=float, default=10.0, help="seconds of log per row")
    args = ap.parse_args(argv)
    print(markdown(replay(read(args.log), args.target, args.window_s)))


if __name__ == "__main__":
    main()
