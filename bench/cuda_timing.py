"""Timing device work from the host: CUDA events around a call, a CUDA graph of a call and the median of its
replays. Shared by the decode bench and its library peer (bench/decode.py, bench/library_peer.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def events_ms(fn, reps: int) -> list[float]:  # noqa: ANN001
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def graph_of(fn) -> torch.cuda.CUDAGraph:  # noqa: ANN001
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph(g: torch.cuda.CUDAGraph, reps: int) -> dict[str, float]:
    for _ in range(20):
        g.replay()
    per = events_ms(g.replay, reps)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return {"step_ms": statistics.median(per), "step_ms_min": min(per),
            "step_ms_back_to_back": a.elapsed_time(b) / reps}


def time_in_turns(replays: dict[str, Callable[[], None]], reps: int, rounds: int = 5,
                  timer: Callable[[Callable[[], None], int], list[float]] = events_ms) -> dict[str, dict]:
    """Several graphs' replays (name → replay) timed in turns: `rounds` rounds, each timing every graph for
    reps // rounds replays, in an order that rotates by one each round. On the H100 the same kernel timed right after
    another read up to 2% apart (bench/NOTES.md, "The step at the floor, second session"): drift and position, not
    the kernels; in turns every graph meets them alike. Per name: time_graph's step_ms (the median of every replay)
    and step_ms_min, and the rounds' medians (their spread says what a difference between names is worth)."""
    names = list(replays)
    for replay in replays.values():
        for _ in range(20):
            replay()
    per: dict[str, list[float]] = {n: [] for n in names}
    rounds_ms: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            times = timer(replays[name], max(1, reps // rounds))
            per[name] += times
            rounds_ms[name].append(statistics.median(times))
    return {n: {"step_ms": statistics.median(per[n]), "step_ms_min": min(per[n]), "round_medians_ms": rounds_ms[n]}
            for n in names}
