"""What the admission guard learned, kept across restarts beside the calibration it scored against.

A fresh guard knows nothing of its server: beside other requests it stretches forecasts by a prior (1.5x, weighing as
20 scores) until each load level has ~200 scores of its own. On the H200's voice sweep a fresh server's loaded
levels stretched by 1.24-1.33 in its first seconds of load (a 2x prior then) and refused a third of the turns at 4
sessions/s, where the same server with admission off served 93% of them on time; a minute later the learned stretch
read 1.03-1.09. A restart that read them admitted 88% at 4 sessions/s, its loaded levels at 1.024 from the first
verdict, none late (bench/NOTES.md, s69).
The scores are the latency model's own error (actual over predicted time, service/model_clock.py), so they belong
with the calibration they were scored against: one file beside it, for the same device, model, weights and step
limits (calibration.cache_key), and the same SLA (memory_key). A restart (a deploy, a crash and its supervisor's
restart) starts from them; a server whose calibration is not cached (--calibration-cache off) starts from the prior,
as before. Written at a clean exit (SIGTERM's drain).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from service.admission_guard import AdmissionGuard, Level
from service.calibration import cache_path, read_keyed, write_keyed

log = logging.getLogger("parley.admission")

FORMAT = 1  # in the file's key: a memory of another layout is for something else
WHAT = "admission guard memory"


def memory_key(calibration_key: dict[str, Any], sla_ms: float, sla_tokens: int) -> dict[str, Any]:
    """The calibration's key and the SLA: a score is the time to the SLA token over its forecast, and the loads a
    server reaches are what its SLA admits. A server with admission off in practice (the benchmarks' --sla-ms 100000,
    before --no-admission, which keeps no memory at all) shares the calibration of the one beside it, but not its
    memory: on the H200 it read the admitting server's scores and wrote its own, of a server that never refused, over
    them at its exit."""
    return {**calibration_key, "sla_ms": sla_ms, "sla_tokens": sla_tokens}


def memory_path(directory: Path, key: dict[str, Any]) -> Path:
    """In the calibration cache's directory, named as cache_path names `key` (memory_key), then .guard.json."""
    return cache_path(directory, key).with_suffix(".guard.json")


def load(path: Path, key: dict[str, Any], guard: AdmissionGuard) -> int:
    """Seed `guard` with the scores kept at `path` for `key`; how many (0 where there is no usable file: the prior)."""
    data = read_keyed(path, {**key, "guard_memory": FORMAT}, WHAT)
    if data is None:
        return 0
    try:
        scores = {Level(int(row["in_flight"]), int(row["prompt"])): [float(x) for x in row["scores"]]
                  for row in data["levels"]}
    except (KeyError, TypeError, ValueError) as e:
        log.warning("ignoring the %s %s: malformed (%s)", WHAT, path, e)
        return 0
    taken = guard.seed(scores)
    log.info("admission guard: %d scores of %d load levels from %s", taken, len(scores), path)
    return taken


def save(path: Path, key: dict[str, Any], guard: AdmissionGuard) -> None:
    """Keep the guard's scores at `path` (write_keyed: atomically; a failure costs a warning)."""
    levels = [{"in_flight": lv.in_flight, "prompt": lv.prompt, "scores": xs}
              for lv, xs in sorted(guard.scores().items()) if xs]
    if levels:
        write_keyed(path, {**key, "guard_memory": FORMAT}, {"levels": levels}, WHAT)
