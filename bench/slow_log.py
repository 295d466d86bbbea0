"""The engine's slow iterations as its server's log tells them (service/engine/slow_steps.py SlowIterations): how many
iterations went over 5 ms while the server served, and of the lines logged (the longest iteration of each two seconds,
its phases in ms), which part was the largest. A voice run's "stalled" decode rows were, read this way, one part:
`decode: input wait`, the host waiting behind a prefill launch on the GPU (bench/NOTES.md, s97), where a reading by eye
of a few hundred lines had called them unexplained.

The lines before the server said it was listening (start-up's compiles and captures, seconds each) are left out."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

LINE = re.compile(r"an engine iteration took (?P<ms>[\d.]+) ms(?: launching (?P<step>\d+ rows \(\d+ prompt\) over \d+ "
                  r"positions))? \((?P<phases>[^;]*)"
                  r"(?:; the thread ran [\d.]+ ms on a CPU, blocked (?P<blocked>\d+) times[^;]*)?; "
                  r"(?P<over>\d+) iterations over")
READY = "listening on"  # the server's line once it serves (service/api/server.py)


def phases(text: str) -> dict[str, float]:
    """`plan 0.0, decode: input wait 4.3, …` → {"plan": 0.0, "decode: input wait": 4.3, …}."""
    out = {}
    for part in text.split(", "):
        name, _, ms = part.rpartition(" ")
        out[name] = float(ms)
    return out


def read(log: str) -> list[dict[str, Any]]:
    """Each slow-iteration line logged after the server was ready: its ms, the step it launched (None in logs from
    before the step was named), its phases, how often the thread blocked (None where not said) and how many iterations
    over 5 ms it stands for."""
    ready = log.find(READY)
    out = []
    for m in LINE.finditer(log[ready:] if ready >= 0 else ""):
        out.append({"ms": float(m["ms"]), "step": m["step"], "phases": phases(m["phases"]),
                    "blocked": None if m["blocked"] is None else int(m["blocked"]), "over": int(m["over"])})
    return out


def summary(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """The iterations over 5 ms in all, and the lines by their largest part: how many, their ms at the median and that
    part's, and the longest line's step."""
    by: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        largest = max(line["phases"], key=line["phases"].get)
        by.setdefault(largest, []).append(line)
    parts = [{"part": part, "lines": len(group), "ms_p50": statistics.median(g["ms"] for g in group),
              "part_ms_p50": statistics.median(g["phases"][part] for g in group),
              "longest_step": max(group, key=lambda g: g["ms"])["step"]}
             for part, group in sorted(by.items(), key=lambda kv: -len(kv[1]))]
    return {"lines": len(lines), "iterations_over_5ms": sum(line["over"] for line in lines), "by_part": parts}


def of_servers(raw: Path, labels: list[str]) -> dict[str, dict[str, Any]]:
    """summary() of each RAW/server-<label>.log there is (none for a server measured at --url)."""
    paths = {label: raw / f"server-{label}.log" for label in labels}
    return {label: summary(read(p.read_text(errors="replace"))) for label, p in paths.items() if p.exists()}


def section(by_server: dict[str, dict[str, Any]]) -> list[str]:
    """The reports' section: per server, its iterations over 5 ms and its logged lines by their largest part."""
    if not by_server:
        return []
    lines = ["", "## The engine's slow iterations (its log)", "",
             "Per server: the iterations over 5 ms while it served, and the lines its engine logged (the longest "
             "iteration of each two seconds) by their largest part. `decode: input wait` is the host waiting for the "
             "GPU to reach the last step's input copy (on the voice runs, a prefill launch ahead of it): the GPU was "
             "busy, not stalled."]
    for label, s in by_server.items():
        lines += ["", f"`{label}`: {s['iterations_over_5ms']} iterations over 5 ms, {s['lines']} lines logged.", ""]
        if not s["by_part"]:
            continue
        lines += ["| largest part | lines | iteration ms p50 | that part ms p50 | the longest one launched |",
                  "|---|---:|---:|---:|---|"]
        lines += [f"| {p['part']} | {p['lines']} | {p['ms_p50']:.1f} | {p['part_ms_p50']:.1f} | "
                  f"{p['longest_step'] or '–'} |" for p in s["by_part"]]
    return lines
