"""A verdict's host time (issue 36): admission's decision on a newcomer beside N requests in flight, on this CPU.

On a GPU host a verdict runs on the engine thread beside a launched step (service/engine/handoff.py), and what it takes
past the host's slack in the step lands on the step: in the H200's FP8 sweep a newcomer's two parts (0.10 + 0.31 ms)
sat just past a knee of ~0.4 ms, and the steps beside them ran 0.3-0.5 ms over their prediction (bench/NOTES.md, s72).
This measures the verdict alone, with no server: a planner with the GPU servers' shape (16 seats, 16 rows a step, 64
in a prompt-only step) played to a steady state of N requests (32-token prompts, 64 tokens each, arrivals evenly
spaced, so their replies are at every stage and a prompt is sometimes mid-chunk), an admission controller bound to it
with a latency model of the H200's FP8 step and a guard that has seen scores at every level; then the same newcomer
judged again and again on that frozen state (admitted, then released: the state never moves).

Two regimes: `room` (the 100 ms SLA, nobody near their deadline: one forecast a verdict) and `tight` (an SLA that puts
the oldest requests near theirs, so the `delays` rule's second forecast runs too). Besides the whole verdict, its parts
alone on the same state: the states' snapshot and one forecast.

    python -m bench verdict [--in-flight 0 1 4 8 12 15] [--verdicts 2000] [--tag NAME]

Writes bench/results/verdict-<cpu>[-<tag>].{json,md}. Compare builds on one machine, in one run of each.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.device import cpu_name, describe, file_stem
from bench.publish import publish
from service import admission
from service.admission import AdmissionController
from service.admission_guard import IN_FLIGHT_BUCKETS, Level
from service.engine.admission import Rejected
from service.engine.commit import Finished, commit
from service.engine.kv_slots import KVSlots
from service.engine.output import TextOutput
from service.engine.planner import Planner
from service.engine.prefix_cache import block_hashes
from service.engine.request import Request, SamplingParams, State
from service.latency_model import LatencyModel
from service.model.synthetic import byte_tokenizer

PROMPT_TOKENS, MAX_TOKENS, SLA_TOKENS = 32, 64, 64
MAX_BATCH, MAX_ROWS, PREFILL_ROWS, LAUNCH_MIN = 16, 16, 64, 256
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
# The H200's FP8 step by rows (s71-s72: 0.66 ms at one row, 0.85 at 16), a 64-row prompt-only step, the price of a
# K/V position by rows; prefill launches (not taken by 32-token prompts) on the same scale.
STEP_S = {1: 0.00066, 2: 0.00067, 4: 0.00069, 8: 0.00076, 16: 0.00085, 32: 0.00105, 64: 0.00140}
STEP_KV_S = {1: 4e-8, 16: 1e-8}
PREFILL_S = {64: 0.0015, 256: 0.0030, 1024: 0.0090}
SLA_S = {"room": 0.100, "tight": 0.060}
TOKENIZER = byte_tokenizer(300)


def latency_model() -> LatencyModel:
    return LatencyModel(STEP_S, PREFILL_S, MAX_ROWS, buckets=BUCKETS, step_kv_s=STEP_KV_S)


def request(first: int) -> Request:
    req = Request(list(range(first, first + PROMPT_TOKENS)), SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                  lambda d: None, TextOutput(TOKENIZER.detokenizer()), sla_tokens=SLA_TOKENS)
    req.prompt_blocks = block_hashes(req.prompt_ids)
    return req


def seen_scores(adm: AdmissionController, rng: random.Random) -> None:
    """A guard that has seen a busy server: scores at every level, most near 1, a tail to ~1.2."""
    for bucket in range(len(IN_FLIGHT_BUCKETS) + 1):
        for kind in range(3):
            for _ in range(600):
                adm.guard.observe(Level(bucket, kind), 1.0 + abs(rng.gauss(0.0, 0.05)), 1.1)


def steady_state(in_flight: int, sla_s: float, seed: int) -> tuple[AdmissionController, Planner]:
    """`in_flight` requests admitted and in flight, played step by step (a step of the model's time each) with a new
    request every MAX_TOKENS / in_flight steps, long enough for every stage of a reply to be in flight."""
    rng = random.Random(seed)
    lat = latency_model()
    adm = AdmissionController(lat, sla_s, SLA_TOKENS, MAX_BATCH, strict=True, clock=time.perf_counter)
    planner = Planner(KVSlots(4 * MAX_BATCH), MAX_BATCH, MAX_ROWS, max_context=4096, launch_min_tokens=LAUNCH_MIN,
                      prefill_rows=PREFILL_ROWS)
    adm.bind(planner)
    seen_scores(adm, rng)
    if not in_flight:
        return adm, planner
    every = MAX_TOKENS / in_flight
    clock = 0.0  # the model's time: each step as long as the latency model says
    admitted: list[Request] = []
    due, steps = 0.0, 0
    while steps < 3 * MAX_TOKENS or len(live := [r for r in admitted if r.state is not State.FINISHED]) < in_flight:
        if steps >= due:
            req = request(1000 * (len(admitted) + 1))
            req.arrival = clock
            req.deadline = clock + sla_s
            planner.add(req)
            admitted.append(req)
            due += every
        plan = planner.plan()
        if plan:
            clock += lat.step(plan.rows, plan.kv_positions)
            for ev in commit(plan, lambda row: 7, frozenset(), planner.max_context, now=clock):
                if isinstance(ev, Finished):
                    planner.finish(ev.req)
        steps += 1
        if steps > 100 * MAX_TOKENS:
            raise RuntimeError(f"no steady state of {in_flight} in flight")
    for req in live[in_flight:]:  # the youngest past `in_flight` (a prompt chunked beside many takes a few steps more)
        planner.finish(req)
    # the admitted ones to admission, their clocks moved to now: each has been in flight as long as the play says
    offset = time.perf_counter() - clock
    for req in admitted:
        if req.state is State.FINISHED:
            continue
        req.arrival = req.arrival + offset
        try:
            adm.check(req)  # its promise and deadline, as its own verdict made them
        except Rejected:  # judged now, late in its reply (tight): it was admitted when it came, so it is in flight
            req.deadline = req.arrival + sla_s
            adm._active[req.id] = req
    return adm, planner


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


class FrozenClock:
    """`time` as service.admission reads it, stopped at one instant: the state in flight is frozen, so every verdict
    is judged at the moment it was frozen (with the clock running, the requests in flight would look stalled, and
    after a few hundred verdicts late)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def perf_counter(self) -> float:
        return self.at

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def point(in_flight: int, regime: str, verdicts: int, seed: int) -> dict[str, Any]:
    adm, planner = steady_state(in_flight, SLA_S[regime], seed)
    frozen = FrozenClock(time.perf_counter())
    admission.time = frozen  # type: ignore[assignment]
    try:
        return judged(adm, planner, frozen.at, regime, verdicts)
    finally:
        admission.time = time  # type: ignore[assignment]


def judged(adm: AdmissionController, planner: Planner, now: float, regime: str, verdicts: int) -> dict[str, Any]:
    """The verdicts on the frozen state, timed (on the real clock), and their parts."""
    newcomer = request(1)
    active = adm._in_flight()
    outcome = {"admitted": 0, "refused": 0, "second_forecasts": 0}
    forecast = planner.forecast

    def counting(*args: Any, **kw: Any) -> dict[int, float]:
        outcome["second_forecasts"] += len(args[0]) == len(active)  # the newcomer left out: the delays rule's
        return forecast(*args, **kw)

    def verdict() -> None:
        newcomer.arrival = now
        newcomer.state, newcomer.deadline = State.WAITING, None
        try:
            adm.check(newcomer)
            outcome["admitted"] += 1
        except Rejected:
            outcome["refused"] += 1
        adm.release(newcomer)

    for _ in range(50):  # warm: the guard's stretches and the latency model's per-row costs are cached after one
        verdict()
    gc.collect()
    gc.disable()  # a collection's pause is the host's, not the verdict's (the engine collects beside steps)
    try:
        whole = sorted(timed(verdict, verdicts))
        planner.forecast = counting  # type: ignore[method-assign]
        for k in outcome:
            outcome[k] = 0
        verdict()
        planner.forecast = forecast  # type: ignore[method-assign]
        states = planner.snapshot([*active, newcomer])
        step_s, prefill_s, steps_s = adm._costs(1.1)
        snapshot = sorted(timed(lambda: planner.snapshot([*active, newcomer]), verdicts))
        one = sorted(timed(lambda: planner.forecast([*active, newcomer], step_s, prefill_s, now, 0.2, steps_s,
                                                    states=states), verdicts))
    finally:
        gc.enable()

    def us(xs: list[float], q: float) -> float:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6, 1)

    return {"in_flight": len(active), "regime": regime, "verdicts": verdicts,
            "verdict_us_p50": us(whole, 0.5), "verdict_us_p90": us(whole, 0.9), "verdict_us_p99": us(whole, 0.99),
            "verdict_us_mean": round(statistics.fmean(whole) * 1e6, 1),
            "snapshot_us_p50": us(snapshot, 0.5), "forecast_us_p50": us(one, 0.5),
            "admitted": bool(outcome["admitted"]), "second_forecast": bool(outcome["second_forecasts"])}


COLUMNS = (("regime", "regime"), ("in_flight", "in flight"), ("admitted", "admitted"),
           ("second_forecast", "second forecast"), ("verdict_us_p50", "verdict µs p50"),
           ("verdict_us_p90", "p90"), ("verdict_us_p99", "p99"), ("snapshot_us_p50", "snapshot µs p50"),
           ("forecast_us_p50", "one forecast µs p50"))


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# A verdict's host time on {result['cpu']}", "",
             f"Python {result['python']}, Parley {result['parley']}. A newcomer (32-token prompt, 64 tokens) judged "
             f"{result['verdicts']} times on a frozen steady state of requests in flight (16 seats, 16 rows a step, "
             "the H200's FP8 step as the latency model, a guard that has seen scores at every level): the whole "
             "verdict (`AdmissionController.check`), and its states' snapshot and one forecast alone. `room`: the "
             "100 ms SLA; `tight`: 60 ms, where requests near their deadline make the `delays` rule forecast again "
             "without the newcomer.", "",
             "| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for p in result["points"]:
        lines.append("| " + " | ".join(str(p[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench verdict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-flight", nargs="+", type=int, default=[0, 1, 4, 8, 12, 15])
    ap.add_argument("--regimes", nargs="+", choices=sorted(SLA_S), default=["room", "tight"])
    ap.add_argument("--verdicts", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=36)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    points = []
    for regime in a.regimes:
        for n in a.in_flight:
            points.append(point(n, regime, a.verdicts, a.seed))
            print(json.dumps(points[-1]), flush=True)
    result = {**describe("cpu"), "cpu": cpu_name(), "verdicts": a.verdicts, "points": points}
    publish(Path(a.out), file_stem("verdict" + (f"-{a.tag}" if a.tag else ""), cpu_name(short=True)), result,
            markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
