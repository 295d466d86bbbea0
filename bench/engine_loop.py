"""The engine loop alone (issue 37: the GPU never waits for the host): one in-process engine built as `parley serve`
builds it (warm-up, calibration), no HTTP, N greedy requests decoding together for a few seconds at each N. From the
engine's own /metrics series (bench/loop_metrics.py) over each window: the host's time per iteration, the GPU's idle
time between consecutive steps and each step's time on the GPU; from the requests' sinks, the gaps between a stream's
tokens as the engine published them (the target: p99 within 1.1x the step's GPU time).

    python -m bench engine-loop [--model synthetic:llama-3.2-1b] [--weights bf16] [--rows 1 4 16] [--seconds 1.5]
    python -m bench engine-loop --first-tokens 200 [--gap-ms 2]

`--first-tokens N` measures instead an idle engine's first token (issue 37's TTFT without HTTP and the process hop):
N 32-token prompts one at a time, each `--gap-ms` after the last one ended, in an engine built as `parley serve`
builds it on a GPU (16 seats, 16 rows, admission on): the submit (its verdict) and the first token from the call,
beside the prompt's step replayed alone (its bucket's CUDA graph, hot and after the same gap).

Writes bench/results/engine-loop-<device>[-<tag>].{json,md}. On a CPU it runs too (small shapes, the reference
backend), with no GPU figures."""

from __future__ import annotations

import argparse
import json
import queue
import time
from pathlib import Path
from typing import Any

from bench.device import describe, file_stem
from bench.loop_metrics import between
from service.config import ServeConfig
from service.engine.request import Delta, Request, SamplingParams
from service.runtime import Runtime, build_engine

PROMPT_TOKENS = 32


def window(rt: Runtime, rows: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    """`rows` requests decoding together: the loop's figures over `seconds` once every one has its first token."""
    engine = rt.engine
    stamps: list[list[float]] = [[] for _ in range(rows)]
    ended: queue.SimpleQueue[int] = queue.SimpleQueue()

    def sink(i: int, d: Delta) -> None:
        if d.token_ids:
            stamps[i].append(time.perf_counter())
        if d.finish_reason is not None:
            ended.put(i)

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.decoder.config.vocab_size
    reqs: list[Request] = [engine.submit([(7 * i + p) % (vocab - 1) + 1 for p in range(PROMPT_TOKENS)], params,
                                         lambda d, i=i: sink(i, d)) for i in range(rows)]
    deadline = time.perf_counter() + 60
    while any(not s for s in stamps) and time.perf_counter() < deadline:
        time.sleep(0.01)
    before, t0 = engine.metrics.render().decode(), time.perf_counter()
    time.sleep(seconds)
    after, t1 = engine.metrics.render().decode(), time.perf_counter()
    for r in reqs:
        engine.cancel(r)
    for _ in reqs:
        ended.get(timeout=30)
    gaps = sorted(b - a for s in stamps for a, b in zip(s, s[1:]) if t0 <= a and b <= t1)
    out: dict[str, Any] = {"rows": rows, "tokens_per_s": round(len(gaps) / (t1 - t0), 1)}
    loop = between(before, after)
    out |= {k: loop[k] for k in ("loop_iterations", "tokens_per_iteration", "host_us_p50", "host_us_p99",
                                 "gpu_idle_us_p50", "gpu_idle_us_p99", "step_gpu_us_p50", "step_gpu_us_p99")}
    for q in (50, 99):
        out[f"token_gap_us_p{q}"] = round(gaps[min(len(gaps) - 1, int(q / 100 * len(gaps)))] * 1e6, 1) if gaps \
            else None
    out["token_gap_us_max"] = round(gaps[-1] * 1e6, 1) if gaps else None
    step = out["step_gpu_us_p50"]
    out["gap_p99_over_step"] = round(out["token_gap_us_p99"] / step, 3) if step and out["token_gap_us_p99"] else None
    return out


def first_tokens(rt: Runtime, n: int, gap_s: float) -> dict[str, Any]:
    """n 32-token prompts to an idle engine, one at a time, each gap_s after the last one's end: the submit's time
    (the verdict: prepare and the forecast) and its first token's, from the call; and the prompt's step alone."""
    engine = rt.engine
    vocab = engine.decoder.config.vocab_size
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    submit_s, first_s = [], []
    for i in range(n):
        got: queue.SimpleQueue[tuple[float, Delta]] = queue.SimpleQueue()
        time.sleep(gap_s)
        prompt = [(11 * i + 3 * p) % (vocab - 1) + 1 for p in range(PROMPT_TOKENS)]
        t0 = time.perf_counter()
        engine.submit(prompt, params, lambda d, got=got: got.put((time.perf_counter(), d)))
        t1 = time.perf_counter()
        first = None
        while True:
            at, d = got.get(timeout=30)
            if first is None and d.token_ids:
                first = at
            if d.finish_reason is not None:
                break
        submit_s.append(t1 - t0)
        first_s.append((first or at) - t0)
    out: dict[str, Any] = {"requests": n, "gap_ms": gap_s * 1e3}
    for name, xs in (("submit", submit_s), ("first_token", first_s)):
        xs = sorted(xs)
        out |= {f"{name}_us_p50": round(xs[len(xs) // 2] * 1e6, 1),
                f"{name}_us_p90": round(xs[int(0.9 * len(xs))] * 1e6, 1)}
    out |= prompt_step(rt, gap_s)
    return out


def prompt_step(rt: Runtime, gap_s: float, bucket: int = PROMPT_TOKENS, replays: int = 50) -> dict[str, Any]:
    """The prompt's step alone, as the engine runs it (one row sampled: the bucket's one-LM-row launch where it has
    one): its graph replayed back to back (hot), and once after `gap_s` of idling (as the engine's first step of a
    request runs), timed by CUDA events (µs)."""
    import torch

    decoder = rt.engine.decoder
    run = getattr(decoder, "run_step", None)
    if run is None or not torch.cuda.is_available():
        return {}
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    run(bucket, False, True)
    torch.cuda.synchronize()
    events[0].record()
    for _ in range(replays):
        run(bucket, False, True)
    events[1].record()
    torch.cuda.synchronize()
    hot = events[0].elapsed_time(events[1]) / replays
    cold = []
    for _ in range(20):
        time.sleep(gap_s)
        events[0].record()
        run(bucket, False, True)
        events[1].record()
        torch.cuda.synchronize()
        cold.append(events[0].elapsed_time(events[1]))
    return {"prompt_step_hot_us": round(hot * 1e3, 1), "prompt_step_after_gap_us": round(sorted(cold)[10] * 1e3, 1)}


COLUMNS = (("rows", "rows"), ("loop_iterations", "iterations"), ("tokens_per_iteration", "tokens/iteration"),
           ("host_us_p50", "host µs p50"), ("host_us_p99", "host µs p99"), ("gpu_idle_us_p50", "GPU idle µs p50"),
           ("gpu_idle_us_p99", "GPU idle µs p99"),
           ("step_gpu_us_p50", "step on the GPU µs p50"), ("token_gap_us_p50", "token gap µs p50"),
           ("token_gap_us_p99", "token gap µs p99"), ("token_gap_us_max", "token gap µs max"),
           ("gap_p99_over_step", "gap p99 / step"), ("tokens_per_s", "tokens/s"))


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# The engine loop on {result['device']}", "",
             f"torch {result['torch']}, Triton {result['triton']}, Parley {result['parley']}. "
             f"{result['model']} ({result['weights']}, {result['backend']}), one in-process "
             f"engine, no HTTP; {PROMPT_TOKENS}-token prompts decoding greedily, {result['seconds']} s a window. The "
             "host's time per iteration leaves out what it spent blocked on the device; the GPU's idle time is between "
             "consecutive steps (CUDA events); a token gap is between two of a stream's tokens as the engine published "
             "them.", "",
             "| " + " | ".join(title for _, title in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for w in result["windows"]:
        lines.append("| " + " | ".join("–" if w.get(k) is None else str(w[k]) for k, _ in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench engine-loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: synthetic:llama-3.2-1b on a GPU, synthetic:tiny else")
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=1.5, help="a window: ~1,500 steps of the H100's")
    ap.add_argument("--max-tokens", type=int, default=1900, help="more than a window's steps: nobody ends early")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--first-tokens", type=int, default=0, help="instead: an idle engine's first token, N times")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="--first-tokens: idle before each request")
    a = ap.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    model = a.model or ("synthetic:llama-3.2-1b" if gpu else "synthetic:tiny")
    if a.first_tokens:  # as `parley serve` runs on a GPU: 16 seats and rows, admission on
        rt = build_engine(ServeConfig(model=model, backend=a.backend, weights=a.weights, max_batch=16, max_rows=16))
        try:
            result = first_tokens(rt, a.first_tokens, a.gap_ms / 1e3)
        finally:
            rt.engine.stop()
        print(json.dumps({**describe(), "model": model, "weights": a.weights, **result}, indent=1))
        return 0
    cfg = ServeConfig(model=model, backend=a.backend, weights=a.weights, max_batch=max(a.rows), max_rows=max(a.rows),
                      sla_ms=1e6)  # admission must not refuse: this measures the loop, not the verdict
    rt = build_engine(cfg)
    try:
        windows = []
        for rows in a.rows:
            windows.append(window(rt, rows, a.seconds, a.max_tokens))
            print(json.dumps(windows[-1]), flush=True)
    finally:
        rt.engine.stop()
    about = describe()
    result = {**about, "model": model, "weights": a.weights, "backend": rt.backend, "seconds": a.seconds,
              "windows": windows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = file_stem("engine-loop" + (f"-{a.tag}" if a.tag else ""), str(about["device"]))
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
