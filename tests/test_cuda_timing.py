"""bench/cuda_timing.time_in_turns, on the CPU with a stand-in timer: graphs timed in turns, in a rotating order, so
drift over the run falls on every graph alike (the GPU's own timing is exercised by `python -m bench decode`)."""

from __future__ import annotations

from bench.cuda_timing import time_in_turns


def test_drift_falls_on_every_graph_alike() -> None:
    # a machine that slows by 1 ms with every block of replays: timed one after another, the second of two identical
    # graphs would read 4 ms slower; in turns both read the same
    blocks: list[str] = []

    def drifting(fn, n: int) -> list[float]:  # noqa: ANN001
        blocks.append(fn.__name__)
        return [10.0 + len(blocks)] * n

    def a() -> None: ...

    def b() -> None: ...

    out = time_in_turns({"a": a, "b": b}, reps=40, rounds=4, timer=drifting)
    assert out["a"]["step_ms"] == out["b"]["step_ms"]
    assert blocks == ["a", "b", "b", "a", "a", "b", "b", "a"]  # the order rotates: neither always goes first
    assert out["a"]["round_medians_ms"] == [11.0, 14.0, 15.0, 18.0]
    assert out["b"]["step_ms_min"] == 12.0


def test_every_graph_is_warmed_and_replayed_its_share() -> None:
    calls = {"x": 0, "y": 0, "z": 0}

    def replay(name: str):  # noqa: ANN202
        def fn() -> None:
            calls[name] += 1
        return fn

    def timer(fn, n: int) -> list[float]:  # noqa: ANN001
        for _ in range(n):
            fn()
        return [1.0] * n

    out = time_in_turns({n: replay(n) for n in calls}, reps=100, rounds=5, timer=timer)
    assert calls == {"x": 120, "y": 120, "z": 120}  # 20 warm-up replays, then 5 rounds of 20
    assert {n: r["step_ms"] for n, r in out.items()} == {"x": 1.0, "y": 1.0, "z": 1.0}
    assert all(len(r["round_medians_ms"]) == 5 for r in out.values())
