"""LatencyModel: how long a decode step takes at each batch size, and a prefill of so many new tokens on top of so
many cached ones.

Measured at start-up on the running backend (a calibration sweep), then corrected online from the steps and prefills
the engine really takes (an exponentially weighted average per point, where one outlier counts as at most OUTLIER
times the prediction), so that admission predicts with what the server does now, not what it did at boot.

A prefill's cost is a 2-D table: new tokens × the cached length it attends over (the K/V length, cached + new; 0
for a fresh prompt, which attends only among its own tokens). On a GPU every prefill replays a graph captured at a
(new tokens, K/V length) pair of buckets, so its cost is that pair's, measured at each pair it can use; on the CPU
(eager) the cost grows smoothly, so a few points are measured and the rest interpolated.
"""

from __future__ import annotations

import bisect
import logging
import random
import statistics
import threading
import time
from typing import Any

from service.backends.decoder import Decoder

log = logging.getLogger("parley")

EWMA = 0.1  # weight of one new observation
OUTLIER = 1.5  # an observation over this many predicted ones is an outlier: alone it teaches nothing (one 10x-late
# step had made an idle server whose prediction sat near the SLA refuse what it could serve); in a row, each counts
# as this many
CALIBRATION_TRIES = 3


class LatencyModel:
    def __init__(self, step_s: dict[int, float], prefill_s: dict[int, float], max_batch: int,
                 continued_s: dict[tuple[int, int], float] | None = None, buckets: list[int] | None = None) -> None:
        """step_s: batch → seconds a step; prefill_s: tokens of a fresh prompt → seconds; continued_s: (new tokens,
        K/V length) of a prefill on top of cached tokens → seconds; buckets: the graph buckets prefills pad to
        (None: eager, interpolate)."""
        self.max_batch = max_batch
        self._step = dict(sorted(step_s.items()))  # batch → seconds per step (a whole engine iteration)
        # K/V length (0: a fresh prompt) → new tokens → seconds
        self._prefill: dict[int, dict[int, float]] = {0: dict(sorted(prefill_s.items()))}
        for (n, kv), seconds in sorted((continued_s or {}).items(), key=lambda item: (item[0][1], item[0][0])):
            self._prefill.setdefault(kv, {})[n] = seconds
        self.buckets = buckets
        self._outliers: set[tuple[int, ...]] = set()  # points whose last observation was an outlier
        self._lock = threading.Lock()
        self.observed_steps = 0
        self.observed_prefills = 0

    # -- predictions ----------------------------------------------------------------------------------
    def step(self, batch: int) -> float:
        """Seconds per decode step with `batch` running requests; a bigger batch is never predicted faster."""
        b = max(1, min(batch, self.max_batch))
        with self._lock:
            floor = max((s for k, s in self._step.items() if k <= b), default=0.0)
            return max(_interpolate(self._step, b), floor)

    def prefill(self, tokens: int, cached: int = 0) -> float:
        """Seconds to prefill `tokens` new tokens on top of `cached` ones."""
        with self._lock:
            kv, n = self._point(max(1, tokens), cached)
            return self._predict(n, kv)

    def _point(self, tokens: int, cached: int) -> tuple[int, int]:
        """The table's (K/V length, new tokens) for a prefill: on a GPU, the graph buckets it replays."""
        kv = cached + tokens if cached else 0
        if self.buckets is None:
            return kv, tokens
        return (_bucket(kv, self.buckets) if kv else 0), _bucket(tokens, self.buckets)

    def _predict(self, n: int, kv: int) -> float:
        fresh = _interpolate(self._prefill[0], n)
        rows = sorted(k for k in self._prefill if k)
        if not kv or not rows:
            return fresh
        if kv in self._prefill and n in self._prefill[kv]:
            return self._prefill[kv][n]
        # between (or past) the two nearest measured K/V lengths, linearly; never cheaper than a fresh prompt's
        i = bisect.bisect_left(rows, kv)
        lo, hi = (rows[0], rows[min(1, len(rows) - 1)]) if i == 0 else \
            (rows[-2], rows[-1]) if i >= len(rows) else (rows[i - 1], rows[i])
        y_lo, y_hi = _interpolate(self._prefill[lo], n), _interpolate(self._prefill[hi], n)
        y = y_lo if hi == lo else y_lo + (y_hi - y_lo) * (kv - lo) / (hi - lo)
        return max(y, fresh)

    # -- online correction --------------------------------------------------------------------------
    def observe_step(self, batch: int, seconds: float) -> None:
        """One step of the engine's cadence. A one-off pause (the H100 run saw one step of 100+ ms among 3,500 of
        1.2) must not make an idle server look slow: a lone outlier teaches nothing, and a real slowdown still moves
        the average within a few dozen steps (a millisecond each)."""
        with self._lock:
            self.observed_steps += 1
            self._step[batch] = self._learn((batch,), _interpolate(self._step, batch), seconds)
            self._step = dict(sorted(self._step.items()))

    def observe_prefill(self, tokens: int, cached: int, seconds: float) -> None:
        """Scale the nearest measured point (on a GPU, the pair of graph buckets it ran) by how far off this
        prefill was."""
        with self._lock:
            self.observed_prefills += 1
            kv, n = self._point(max(1, tokens), cached)
            predicted = self._predict(n, kv)
            if predicted <= 0:
                return
            rows = [k for k in self._prefill if k] if kv else [0]
            at = min(rows or [0], key=lambda k: abs(k - kv))
            row = self._prefill[at]
            nearest = min(row, key=lambda k: abs(k - n))
            row[nearest] *= self._learn((at, nearest), predicted, seconds) / predicted

    def _learn(self, point: tuple[int, ...], predicted: float, seconds: float) -> float:
        """The prediction at `point` once `seconds` has been observed there: an exponentially weighted average, in
        which an outlier (over OUTLIER x the prediction) counts only after another one in a row, as OUTLIER x."""
        if predicted <= 0:
            return seconds
        outlier = seconds > OUTLIER * predicted
        if outlier and point not in self._outliers:
            self._outliers.add(point)
            return predicted
        if not outlier:
            self._outliers.discard(point)
        return (1 - EWMA) * predicted + EWMA * min(seconds, OUTLIER * predicted)

    def fastest(self, other: LatencyModel) -> LatencyModel:
        """Each point's faster time of the two models' (the points of this one)."""
        with other._lock:
            steps, prefills = dict(other._step), other._points()
        with self._lock:
            mine = self._points()
            fastest = {p: min(s, prefills.get(p, s)) for p, s in mine.items()}
            return LatencyModel({b: min(s, steps.get(b, s)) for b, s in self._step.items()},
                                {n: s for (n, kv), s in fastest.items() if not kv}, self.max_batch,
                                {p: s for p, s in fastest.items() if p[1]}, self.buckets)

    def _points(self) -> dict[tuple[int, int], float]:
        """Every prefill point as (new tokens, K/V length) → seconds."""
        return {(n, kv): s for kv, row in self._prefill.items() for n, s in row.items()}

    def disturbed(self) -> bool:
        """A longer prefill measured faster than a shorter one over the same K/V length, or a bigger batch's step
        faster than a smaller one's (by more than noise), or slower than proportionally: the work is the same each
        time, so a sample was stalled."""
        with self._lock:
            rows, steps = [list(row.values()) for row in self._prefill.values()], list(self._step.items())
        if any(s2 < s1 / 1.2 for row in rows for s1, s2 in zip(row, row[1:])):
            return True
        return any(s2 < s1 / 1.2 or s2 > s1 * (b2 / b1) * 1.5 for (b1, s1), (b2, s2) in zip(steps, steps[1:]))

    def snapshot(self) -> dict[str, Any]:
        """What operators read at GET /v1/latency_model."""
        with self._lock:
            return {
                "decode_step_ms": {str(b): round(s * 1e3, 4) for b, s in self._step.items()},
                "prefill_ms": {str(n): round(s * 1e3, 4) for n, s in self._prefill[0].items()},
                "prefill_on_cache_ms": {f"{n}@{kv}": round(s * 1e3, 4) for kv, row in self._prefill.items() if kv
                                        for n, s in row.items()},  # new tokens @ the K/V length they attend over
                "observed_steps": self.observed_steps,
                "observed_prefills": self.observed_prefills,
            }


def _bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds n (the largest, past them all)."""
    return next((b for b in buckets if b >= n), buckets[-1])


def _interpolate(table: dict[int, float], x: int) -> float:
    """Piecewise-linear through the measured points; linear extrapolation past the last two."""
    xs = list(table)
    if x in table:
        return table[x]
    if len(xs) == 1:
        return table[xs[0]] * (x / xs[0] if xs[0] else 1.0)
    i = bisect.bisect_left(xs, x)
    lo, hi = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1]) if i >= len(xs) else (xs[i - 1], xs[i])
    y = table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
    return max(y, 0.0)


def calibrate(decoder: Decoder, max_batch: int | None = None, reps: int = 2) -> LatencyModel:
    """Time decode steps at batch sizes 1, 2, 4, … max_batch (the decoder's slots by default), and prefills of fresh
    prompts and on top of cached tokens: on a GPU at every pair of graph buckets a prefill can replay, on the CPU
    at a few points. Run before serving: it writes into KV slots that no request holds yet."""
    rng = random.Random(0)
    vocab = decoder.config.vocab_size
    max_batch = min(max_batch or decoder.max_slots, decoder.max_slots)
    ctx = decoder.max_context
    buckets = decoder.prefill_graph_buckets()

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def prefill_seconds(n: int, cached: int) -> float:
        """n new tokens on top of `cached` ones, in slot 0."""
        if cached:
            decoder.prefill(0, tokens(cached))
        decoder.prefill(0, tokens(n), cached)  # untimed: the first prefill of a shape may compile or allocate
        _sync(decoder)
        times = []
        for _ in range(reps if n <= 128 else 1):  # a long prefill is its own average
            t0 = time.perf_counter()
            decoder.prefill(0, tokens(n), cached)
            _sync(decoder)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    fresh, continued = _prefill_points(ctx, buckets)
    prefill_s = {n: prefill_seconds(n, 0) for n in fresh}
    continued_s = {key: prefill_seconds(n, kv - n) for key, (n, kv) in continued.items()}

    batches = sorted({1, 2, 4, 8, 16, max_batch} & set(range(1, max_batch + 1)))
    pos = min(64, ctx - 2 * reps - 3)
    for s in range(max_batch):
        decoder.prefill(s, tokens(pos))
    step_s: dict[int, float] = {}
    for b in batches:
        if decoder.device.type == "cuda":
            # The engine runs a step ahead there, feeding each step the last one's tokens on the device: its
            # cadence is the steps back to back (timed one by one, each paid a launch and a sync: 1.38 ms for a
            # 1.22 ms step on the H100, enough to predict an idle server past its SLA).
            out = decoder.decode(list(range(b)), tokens(b), [pos] * b)
            _sync(decoder)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for r in range(2 * reps + 1):
                    out = decoder.decode(list(range(b)), out.argmax, [pos + 1 + r] * b)
                out.argmax.tolist()
                times.append((time.perf_counter() - t0) / (2 * reps + 1))
            step_s[b] = min(times)
            continue
        times = []
        for r in range(2 * reps + 1):
            t0 = time.perf_counter()
            out = decoder.decode(list(range(b)), tokens(b), [pos + r] * b)
            out.argmax.tolist()  # the engine reads the tokens back every step, so must we
            times.append(time.perf_counter() - t0)
        step_s[b] = statistics.median(times[1:])
    return LatencyModel(step_s, prefill_s, max_batch, continued_s, buckets)


def _prefill_points(ctx: int, buckets: list[int] | None) -> tuple[list[int], dict[tuple[int, int], tuple[int, int]]]:
    """Where to measure prefills: fresh prompt lengths, and (new tokens, K/V length) table keys of prefills on top of
    cached tokens, each with the (new tokens, K/V length) to run for it. With graph buckets, every pair a prefill
    can replay (new ≤ K/V), each run with a shape that replays that pair's graph (one that ends on the context's
    last position would run eagerly); without, a few points (the CPU: start-up stays short)."""
    if buckets is None:
        fresh = sorted({16, 128, min(1024, ctx // 2)} & set(range(1, ctx // 2 + 1)))
        return fresh, {(n, kv): (n, kv) for kv in sorted({ctx // 4, ctx // 2}) for n in (16, 128) if 0 < n < kv}
    continued = {}
    for kv_bucket in buckets:
        kv = min(kv_bucket, ctx - 1)
        for n_bucket in (b for b in buckets if b <= kv_bucket):
            continued[n_bucket, kv_bucket] = (min(n_bucket, kv - 1), kv)
    return list(buckets), continued


def calibrate_robustly(decoder: Decoder, max_batch: int | None = None) -> LatencyModel:
    """calibrate(), and again (at most CALIBRATION_TRIES in all, keeping each point's fastest time) while its numbers
    contradict themselves. On a busy host one stalled sample can be a hundred times too slow; a latency model that
    predicts everything too slow refuses everything, and then never observes the steps that would correct it."""
    lat = calibrate(decoder, max_batch)
    for _ in range(CALIBRATION_TRIES - 1):
        if not lat.disturbed():
            break
        log.warning("the latency calibration looks disturbed (a busy host?): %s; measuring again", lat.snapshot())
        lat = lat.fastest(calibrate(decoder, max_batch))
    return lat


def _sync(decoder: Decoder) -> None:
    if decoder.device.type == "cuda":
        import torch

        torch.cuda.synchronize(decoder.device)
