"""What a server's admission log (`--admission-log`, service/admission_log.py) says: how many verdicts refused and by
which rule, what the refused had left of their budget against what their forecast asked, how far the forecasts of
the admitted were off at each load level, and which kinds of step ran over the latency model's prediction. The e2e
report shows it for each server (bench/e2e_report.py); on its own:
    python -m bench.admission_trace RAW/admission-LABEL.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read(path: Path) -> list[dict[str, Any]]:
    """The log's lines; a line cut short by a killed server is skipped."""
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return lines


def quantile(xs: list[float], q: float) -> float | None:
    """The q-quantile by the nearest rank (None for none)."""
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def level_name(level: dict[str, str]) -> str:
    return f"{level['in_flight']} in flight, prompt {level['prompt']}"


def summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    verdicts = [x for x in lines if x.get("kind") == "verdict"]
    tokens = [x for x in lines if x.get("kind") == "sla_token"]
    refused = [v for v in verdicts if not v["admitted"]]
    late_rule = [v for v in refused if v.get("rule") == "late" and v.get("reason") == "overloaded"]
    delays = [v for v in refused if v.get("rule") == "delays"]

    def spread(rows: list[dict[str, Any]], key: str) -> dict[str, float | None]:
        xs = [r[key] for r in rows if r.get(key) is not None]
        return {"p50": quantile(xs, 0.5), "p90": quantile(xs, 0.9), "max": max(xs, default=None)}

    by_level: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in tokens:
        by_level[level_name(t["level"])].append(t)
    first_forecast: dict[str, float] = {}  # req → what its own (first) verdict forecast, for the scores against it
    for v in verdicts:
        if v["admitted"] and v.get("forecast_ms") and v["req"] not in first_forecast:
            first_forecast[v["req"]] = v["forecast_ms"]

    def p99(ts: list[dict[str, Any]], score: Callable[[dict[str, Any]], float | None]) -> float | None:
        return quantile([x for x in map(score, ts) if x is not None], 0.99)

    def first_score(t: dict[str, Any]) -> float | None:
        forecast = first_forecast.get(t["req"])
        return t["after_verdict_ms"] / forecast if forecast else None

    return {
        "verdicts": len(verdicts),
        "admitted": len(verdicts) - len(refused),
        "refused": dict(Counter(f"{v.get('reason')} ({v.get('rule') or '–'})" for v in refused)),
        "refused_levels": dict(Counter(level_name(v["level"]) for v in refused)),
        # refused as late beside others: the budget they had left, what the forecast asked, stretched and not
        "late_refusals": {key: spread(late_rule, key) for key in
                          ("since_arrival_ms", "left_ms", "forecast_ms", "stretched_ms", "stretch", "in_flight")},
        # ...of them, how many the unstretched forecast alone would have admitted
        "late_refusals_by_stretch_alone": sum(1 for v in late_rule if v["forecast_ms"] is not None
                                              and v["forecast_ms"] <= v["left_ms"]),
        "delays_refusals": len(delays),
        # verdicts the `delays` rule forecast twice for; the second forecast ran apart (the engine process: a task of
        # its own, beside the same step or the next), this long after the first began
        "second_forecasts": {"n": sum(1 for v in verdicts if v.get("second_after_ms") is not None),
                             **spread(verdicts, "second_after_ms")},
        "sla_tokens": len(tokens),
        "late": sum(1 for t in tokens if t["late"]),
        "levels": {name: {"n": len(ts), "score_p50": quantile([t["score"] for t in ts if t["score"]], 0.5),
                          "score_p99": p99(ts, lambda t: t["score"]),
                          # the same spans against the latest forecast, and against their own verdict's
                          "latest_score_p99": p99(ts, lambda t: t.get("latest_score")),
                          "first_score_p99": p99(ts, first_score),
                          # a score split: the steps over their forecast, and the time around the steps
                          "steps_over_model_p99": p99(ts, lambda t: _ratio(t.get("steps_ms"), t.get("model_ms"))),
                          "wall_over_steps_p99": p99(ts, lambda t: _ratio(t.get("after_verdict_ms"),
                                                                          t.get("steps_ms"))),
                          "stretch_p50": quantile([t["stretch"] for t in ts], 0.5),
                          "over_stretch": sum(1 for t in ts if (t["score"] or 0) > t["stretch"]),
                          "late": sum(1 for t in ts if t["late"])}
                   for name, ts in sorted(by_level.items())},
        "own_forecasts": own_forecasts(verdicts, tokens),
        "steps": steps_summary(lines),
        "handed": handed_summary(lines),
        "gc": gc_summary(lines),
    }


def own_forecasts(verdicts: list[dict[str, Any]], tokens: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """How far a newcomer's own forecast was off in the latency model's time: for the admitted requests no later
    verdict forecast again (their latest forecast is their verdict's), the model clock's time of the steps that ran to
    their SLA token less that forecast, ms, by the steps the engine had launched at the verdict (`ahead`; by alone /
    beside others in a log from before it). The guard's score cannot see this error (the model clock counts every
    step since the verdict): a newcomer seated later than its forecast said came that much later (bench/NOTES.md,
    s80)."""
    own = {v["req"]: v for v in verdicts if v["admitted"] and v.get("forecast_ms") is not None}
    groups: dict[str, list[float]] = defaultdict(list)
    for t in tokens:
        v = own.get(t["req"])
        if v is None or t.get("model_ms") is None or abs(t["forecast_ms"] - v["forecast_ms"]) > 1e-6:
            continue
        key = f"{v['ahead']} ahead" if "ahead" in v else ("alone" if v.get("in_flight") == 1 else "beside others")
        groups[key].append(t["model_ms"] - t["forecast_ms"])
    return {key: {"n": len(xs), "p10": quantile(xs, 0.1), "p50": quantile(xs, 0.5), "p90": quantile(xs, 0.9),
                  "max": max(xs)} for key, xs in sorted(groups.items())}


POSITION_BANDS = (256, 1024, 2048)  # positions a row attends over, on average: the steps' table splits there


def step_kind(step: dict[str, Any]) -> str:
    """A step line's kind for the table: what rode in it, its rows, the positions its rows attend over on average."""
    what = "launch" if step.get("launched") else "chunk" if step.get("prompt_rows") else "decode"
    rows = step["rows"]
    band = next((f"<{b}" for b in POSITION_BANDS if step["kv_positions"] / max(1, rows) < b),
                f">={POSITION_BANDS[-1]}")
    return f"{what}, {rows} rows, {band} positions"


def steps_summary(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The step lines by kind (step_kind), after every step split by whether handed-over work (verdicts) ran within
    its cadence: how many, and their time over the model's prediction at p50 / p90 / p99 and in all (their time summed
    over their predictions summed)."""
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    handed: dict[str, list[dict[str, Any]]] = defaultdict(list)  # every step, by whether verdicts ran in its cadence
    for x in lines:
        if x.get("kind") == "step" and x.get("predicted_ms"):
            by_kind[step_kind(x)].append(x)
            handed["every step, handed-over work within" if x.get("handed_ms") else "every step, none within"].append(x)
    out = {}
    for kind, steps in [*sorted(handed.items()), *sorted(by_kind.items(), key=lambda kv: -len(kv[1]))]:
        ratios = [x["ms"] / x["predicted_ms"] for x in steps]
        out[kind] = {"n": len(steps), "p50": quantile(ratios, 0.5), "p90": quantile(ratios, 0.9),
                     "p99": quantile(ratios, 0.99),
                     "all": sum(x["ms"] for x in steps) / sum(x["predicted_ms"] for x in steps)}
    return out


def handed_summary(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The handed-over tasks by kind (a verdict's prepare / verdict / delays parts, a session's truncate and close):
    from the sampled step lines, how many ran and how long (p50 / p90 / max ms); from the `handed` lines (every step
    with a task of 1 ms or more), how many such steps had their longest task of that kind, its longest, and those
    steps' time over their prediction at the median."""
    took: dict[str, list[float]] = defaultdict(list)
    for x in lines:
        if x.get("kind") == "step":
            for kind, ms in x.get("handed") or ():
                took[kind].append(ms)
    long: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for x in lines:
        if x.get("kind") == "handed" and x.get("tasks"):
            long[max(x["tasks"], key=lambda t: t[1])[0]].append(x)
    out = {}
    for kind in sorted(set(took) | set(long)):
        ms, steps = took.get(kind, []), long.get(kind, [])
        out[kind] = {"n": len(ms), "p50": quantile(ms, 0.5), "p90": quantile(ms, 0.9), "max": max(ms, default=None),
                     "long_steps": len(steps), "long_max": max((max(t[1] for t in x["tasks"]) for x in steps),
                                                               default=None),
                     "long_over": quantile([x["ms"] / x["predicted_ms"] for x in steps if x.get("predicted_ms")],
                                           0.5)}
    return out


def gc_summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The garbage collections of 1 ms or more (service/runtime.py GcWatch): how many, of which generation 2, their
    p50 and longest; and how many of the steps with a long handed-over task had one end within their cadence (the
    task's time then includes the collection's)."""
    pauses = [x for x in lines if x.get("kind") == "gc"]
    held = [x for x in lines if x.get("kind") == "handed"]
    within = sum(1 for h in held if any(h["t"] - h["ms"] / 1e3 <= g["t"] <= h["t"] for g in pauses))
    ms = [g["ms"] for g in pauses]
    return {"n": len(pauses), "gen2": sum(1 for g in pauses if g.get("generation") == 2),
            "p50": quantile(ms, 0.5), "max": max(ms, default=None), "held_steps": len(held), "held_with_gc": within}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def of_raw(raw: Path) -> dict[str, dict[str, Any]]:
    """Each server's summary, by its label (admission-<label>.jsonl in the raw folder)."""
    return {p.stem.removeprefix("admission-"): summary(read(p)) for p in sorted(raw.glob("admission-*.jsonl"))}


def _f(x: float | int | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown(summaries: dict[str, dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for label, s in summaries.items():
        if not s["verdicts"] and not s.get("steps") and not (s.get("gc") or {}).get("n"):
            continue
        refused = ", ".join(f"{n} {why}" for why, n in s["refused"].items()) or "none"
        lines += ["", f"Admission's log, {label}: {s['verdicts']} verdicts, {s['admitted']} admitted; refused: "
                      f"{refused}. {s['sla_tokens']} SLA tokens reached, {s['late']} late by the server's clock."]
        second = s.get("second_forecasts") or {}
        if second.get("n"):
            lines += ["", f"{second['n']} verdicts forecast twice (the `delays` rule), the second "
                          f"{_f(second['p50'], 2)} / {_f(second['p90'], 2)} / {_f(second['max'], 2)} ms (p50 / p90 / "
                          "max) after the first began."]
        late = s["late_refusals"]
        if late["left_ms"]["p50"] is not None:
            lines += ["", f"Refused as late beside others ({s['late_refusals_by_stretch_alone']} of them within "
                          "their budget by the unstretched forecast): p50 / p90 / max", "",
                      "| since arrival ms | left ms | forecast ms | stretched ms | stretch | in flight |",
                      "|---|---|---|---|---|---|",
                      "| " + " | ".join(" / ".join(_f(late[k][q], 2 if k == "stretch" else 1)
                                                  for q in ("p50", "p90", "max"))
                                         for k in ("since_arrival_ms", "left_ms", "forecast_ms", "stretched_ms",
                                                   "stretch", "in_flight")) + " |"]
        if s["levels"]:
            lines += ["", "Admitted requests' scores (time from the first verdict to the SLA token over what the "
                          "latency model predicted for the steps that ran; p99 also against the latest forecast and "
                          "against their own verdict's; the score split: the steps' measured time over the model's, "
                          "the wall's over the steps') by the level they were last judged at; refusals at the same "
                          "level", "",
                      "| level | SLA tokens | score p50 | score p99 | latest p99 | own verdict's p99 | "
                      "steps / model p99 | wall / steps p99 | stretch p50 | over their stretch | late | refused |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            lines += [f"| {name} | {v['n']} | {_f(v['score_p50'], 3)} | {_f(v['score_p99'], 3)} | "
                      f"{_f(v.get('latest_score_p99'), 3)} | {_f(v.get('first_score_p99'), 3)} | "
                      f"{_f(v.get('steps_over_model_p99'), 3)} | {_f(v.get('wall_over_steps_p99'), 3)} | "
                      f"{_f(v['stretch_p50'], 3)} | {v['over_stretch']} | {v['late']} | "
                      f"{s['refused_levels'].get(name, 0)} |" for name, v in s["levels"].items()]
        own = s.get("own_forecasts") or {}
        if own:
            lines += ["", "Newcomers forecast once (no later verdict forecast them again): the latency model's time of "
                          "the steps that ran to their SLA token less their own forecast, ms, by the steps the engine "
                          "had launched at the verdict", "",
                      "| at the verdict | requests | p10 | p50 | p90 | max |", "|---|---|---|---|---|---|"]
            lines += [f"| {key} | {v['n']} | {_f(v['p10'], 2)} | {_f(v['p50'], 2)} | {_f(v['p90'], 2)} | "
                      f"{_f(v['max'], 2)} |" for key, v in own.items()]
        steps = s.get("steps") or {}
        if steps:
            lines += ["", "Steps by kind (a prompt chunk riding beside decode rows, a separate prefill launch before "
                          "the step, or decode rows alone; positions a row attends over on average), after every step "
                          "split by whether verdicts ran within its cadence: their measured time over the latency "
                          "model's prediction, the 12 most frequent kinds", "",
                      "| step | steps | p50 | p90 | p99 | in all |", "|---|---|---|---|---|---|"]
            lines += [f"| {kind} | {v['n']} | {_f(v['p50'], 3)} | {_f(v['p90'], 3)} | {_f(v['p99'], 3)} | "
                      f"{_f(v['all'], 3)} |" for kind, v in list(steps.items())[:14]]
        handed = s.get("handed") or {}
        if handed:
            lines += ["", "Handed-over tasks by kind: in the sampled steps, how many ran and how long (ms); steps with "
                          "a task of 1 ms or more (every one logged), by their longest task's kind: how many, the "
                          "longest task, their time over the model's prediction at the median", "",
                      "| task | ran | p50 ms | p90 ms | max ms | steps with it ≥ 1 ms | its longest ms | "
                      "those steps over prediction p50 |", "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {kind} | {v['n']} | {_f(v['p50'], 2)} | {_f(v['p90'], 2)} | {_f(v['max'], 2)} | "
                      f"{v['long_steps']} | {_f(v['long_max'], 2)} | {_f(v['long_over'], 2)} |"
                      for kind, v in handed.items()]
        gcs = s.get("gc") or {}
        if gcs.get("n") or gcs.get("held_steps"):
            lines += ["", f"Garbage collections of 1 ms or more: {gcs['n']} ({gcs['gen2']} of generation 2), "
                          f"{_f(gcs['p50'], 2)} ms at the median, {_f(gcs['max'], 2)} the longest; "
                          f"{gcs['held_with_gc']} of the {gcs['held_steps']} steps with a task of 1 ms or more had one "
                          "within their cadence."]
    return lines


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print("\n".join(markdown({Path(arg).stem: summary(read(Path(arg)))})))
