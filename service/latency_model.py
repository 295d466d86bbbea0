"""LatencyModel: how long a decode step takes at each batch size, and a prefill at each prompt length.

Measured at start-up on the running backend (a calibration sweep), then corrected online from the steps the
engine really takes (an exponentially weighted average per batch size and per prompt-length bucket), so that
admission predicts with what the server does now, not what it did at boot.
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
OUTLIER = 3.0  # one observed step counts as at most this many predicted ones
CALIBRATION_TRIES = 3


class LatencyModel:
    def __init__(self, step_s: dict[int, float], prefill_s: dict[int, float], max_batch: int) -> None:
        self.max_batch = max_batch
        self._step = dict(sorted(step_s.items()))  # batch → seconds per step (a whole engine iteration)
        self._prefill = dict(sorted(prefill_s.items()))  # prompt tokens → seconds
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

    def prefill(self, tokens: int) -> float:
        with self._lock:
            return _interpolate(self._prefill, max(1, tokens))

    # -- online correction --------------------------------------------------------------------------
    def observe_step(self, batch: int, seconds: float) -> None:
        """One step of the engine's cadence. A single stall counts as at most OUTLIER x the prediction: a one-off
        pause (the H100 run saw one step of 100+ ms among 3,500 of 1.2) must not make an idle server look slow for
        the next hundred steps; a real slowdown still moves the average within a few steps."""
        with self._lock:
            self.observed_steps += 1
            prior = _interpolate(self._step, batch)
            seconds = min(seconds, OUTLIER * prior) if prior > 0 else seconds
            self._step[batch] = (1 - EWMA) * prior + EWMA * seconds
            self._step = dict(sorted(self._step.items()))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Scale the nearest measured bucket by how far off this prefill was."""
        with self._lock:
            self.observed_prefills += 1
            keys = list(self._prefill)
            nearest = min(keys, key=lambda k: abs(k - tokens))
            predicted = _interpolate(self._prefill, tokens)
            if predicted > 0:
                ratio = seconds / predicted
                self._prefill[nearest] *= (1 - EWMA) + EWMA * ratio

    def fastest(self, other: LatencyModel) -> LatencyModel:
        """Each point's faster time of the two models' (the points of this one)."""
        with other._lock:
            steps, prefills = dict(other._step), dict(other._prefill)
        with self._lock:
            return LatencyModel({b: min(s, steps.get(b, s)) for b, s in self._step.items()},
                                {n: min(s, prefills.get(n, s)) for n, s in self._prefill.items()}, self.max_batch)

    def disturbed(self) -> bool:
        """A longer prefill measured faster than a shorter one, a bigger batch's step faster than a smaller one's (by
        more than noise), or slower than proportionally: the work is the same each time, so a sample was stalled."""
        with self._lock:
            pre, steps = list(self._prefill.items()), list(self._step.items())
        if any(s2 < s1 for (_, s1), (_, s2) in zip(pre, pre[1:])):
            return True
        return any(s2 < s1 / 1.2 or s2 > s1 * (b2 / b1) * 1.5 for (b1, s1), (b2, s2) in zip(steps, steps[1:]))

    def snapshot(self) -> dict[str, Any]:
        """What operators read at GET /v1/latency_model."""
        with self._lock:
            return {
                "decode_step_ms": {str(b): round(s * 1e3, 4) for b, s in self._step.items()},
                "prefill_ms": {str(n): round(s * 1e3, 4) for n, s in self._prefill.items()},
                "observed_steps": self.observed_steps,
                "observed_prefills": self.observed_prefills,
            }


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


def calibrate(decoder: Decoder, reps: int = 2) -> LatencyModel:
    """Time decode steps at batch sizes 1, 2, 4, … max_slots and prefills at a few lengths, on the real decoder.
    Run before serving: it writes into KV slots that no request holds yet."""
    rng = random.Random(0)
    vocab = decoder.config.vocab_size
    slots = decoder.max_slots
    ctx = decoder.max_context

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefill_s: dict[int, float] = {}
    for n in sorted({16, 128, min(1024, ctx // 2)} & set(range(1, ctx // 2 + 1))):
        decoder.prefill(0, tokens(n))  # untimed: the first prefill of a length may compile or capture a graph
        _sync(decoder)
        times = []
        for _ in range(reps if n <= 128 else 1):  # a long prefill is its own average
            t0 = time.perf_counter()
            decoder.prefill(0, tokens(n))
            _sync(decoder)
            times.append(time.perf_counter() - t0)
        prefill_s[n] = statistics.median(times)

    batches = sorted({1, 2, 4, 8, 16, slots} & set(range(1, slots + 1)))
    pos = min(64, ctx - 2 * reps - 3)
    for s in range(slots):
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
    return LatencyModel(step_s, prefill_s, slots)


def calibrate_robustly(decoder: Decoder) -> LatencyModel:
    """calibrate(), and again (at most CALIBRATION_TRIES in all, keeping each point's fastest time) while its numbers
    contradict themselves. On a busy host one stalled sample can be a hundred times too slow; a latency model that
    predicts everything too slow refuses everything, and then never observes the steps that would correct it."""
    lat = calibrate(decoder)
    for _ in range(CALIBRATION_TRIES - 1):
        if not lat.disturbed():
            break
        log.warning("the latency calibration looks disturbed (a busy host?): %s; measuring again", lat.snapshot())
        lat = lat.fastest(calibrate(decoder))
    return lat


def _sync(decoder: Decoder) -> None:
    if decoder.device.type == "cuda":
        import torch

        torch.cuda.synchronize(decoder.device)
