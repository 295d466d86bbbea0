"""Timing device work from the host: CUDA events around a call, a CUDA graph of a call and the median of its
replays. Shared by the decode bench and its library peer (bench/decode.py, bench/library_peer.py)."""

from __future__ import annotations

import statistics

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
