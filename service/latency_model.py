"""LatencyModel: how long a step takes from its rows (decode rows and prompt tokens riding in it) and the K/V positions
they attend over, and a separate prefill launch of so many new tokens on top of so many cached ones.

Measured at start-up on the running backend (service/calibration.py), then corrected online from the steps and
prefills the engine really takes (an exponentially weighted average per point, where one outlier counts as at most
OUTLIER times the prediction), so that admission predicts with what the server does now, not what it did at boot.

A step costs step_s[rows] at a short context, plus step_kv_s[rows] per K/V position its rows attend over (summed over
the rows; a row at position p reads p positions): the weights are streamed once whatever the rows, attention reads grow
with the context. On a GPU a step's rows are padded to a bucket (the measured points), so its cost is the bucket's. The
price of a position depends on the rows: on a GPU one row's attention leaves most of the SMs idle, so a position cost
a one-row step 44 ns and a 16-row one 11 (bf16, context 2,048, the H200); priced at one number measured at max_batch
rows, a voice conversation's 1-4-row steps at 2,000 positions were predicted 3-6% short at the median, and admission's
learned stretch paid for it (bench/NOTES.md, "Attention's price by rows").

A prefill launch's cost is a 2-D table: new tokens × the cached length it attends over (the K/V length, cached + new;
0 for a fresh prompt). On a GPU every prefill replays a graph captured at a (new tokens, K/V length) pair of buckets,
so its cost is that pair's, measured at each pair it can use; on the CPU (eager) the cost grows smoothly, so a few
points are measured and the rest interpolated.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

EWMA = 0.1  # weight of one new observation
OUTLIER = 1.5  # an observation over this many predicted ones is an outlier: alone it teaches nothing (one 10x-late
# step had made an idle server whose prediction sat near the SLA refuse what it could serve); in a row, each counts
# as this many
SHORT_CONTEXT = 64  # the positions step_s is measured at: step_kv_s counts what lies beyond
LEARN_CEILING = 1.2  # a step is never learned slower than this many times its calibrated time: what slows the cadence
# beyond that is the host (the API thread holding the GIL while it templates a 2,000-token conversation, on the H100's
# voice run), not the step; had the model learned it, an idle server predicted 105 ms and refused every request.
# What the host adds beyond that shows in the admission guard's scores (service/admission_guard.py) instead.


class LatencyModel:
    def __init__(self, step_s: dict[int, float], prefill_s: dict[int, float], max_rows: int,
                 continued_s: dict[tuple[int, int], float] | None = None, buckets: list[int] | None = None,
                 step_kv_s: float | dict[int, float] = 0.0) -> None:
        """step_s: rows in a step → seconds at a short context; prefill_s: tokens of a fresh prompt → seconds;
        continued_s: (new tokens, K/V length) of a prefill on top of cached tokens → seconds; buckets: the graph
        buckets prefills pad to (None: eager, interpolate; steps too are then interpolated, not padded);
        step_kv_s: seconds per K/V position a step's rows attend over beyond SHORT_CONTEXT each, by the rows it was
        measured at (a step of other rows: interpolated between them, the nearest past them), or one for all."""
        self.max_rows = max_rows
        self._step = dict(sorted(step_s.items()))  # rows → seconds per step (a whole engine iteration)
        self._bases: dict[int, tuple[float, float]] = {}  # rows → (_base(rows), _kv_s(rows)), until _step changes
        # (a forecast asks hundreds)
        self._calibrated = dict(self._step)  # what start-up measured (LEARN_CEILING)
        table = step_kv_s if isinstance(step_kv_s, dict) else {1: step_kv_s}
        self.step_kv_s = dict(sorted(table.items())) or {1: 0.0}  # rows → seconds a position
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
    def step(self, rows: int, kv_positions: int = 0) -> float:
        """Seconds for a step of `rows` rows attending over `kv_positions` positions in all; more rows are never
        predicted faster."""
        r = max(1, rows)
        return step_time(self._cost(r), r, kv_positions)

    def _cost(self, rows: int) -> tuple[float, float]:
        """A step of `rows` rows: its seconds at a short context and a position's price, kept until _step changes."""
        cost = self._bases.get(rows)  # read without the lock: a stale pair is one read just before the update
        if cost is not None:
            return cost
        with self._lock:
            cost = self._bases.get(rows)
            if cost is None:
                cost = self._bases[rows] = (self._base(rows), self._kv_s(rows))
            return cost

    def steps(self, rows: int, kv_positions: int, grow: int, n: int) -> float:
        """Seconds for n steps of `rows` rows in a row, the first attending over `kv_positions` positions and each
        next one over `grow` more (grow >= 0): the sum of step() over them, in closed form."""
        r = max(1, rows)
        return steps_time(self._cost(r), r, kv_positions, grow, n)

    def stretched(self, stretch: float) -> StretchedCosts:
        """The model's times x `stretch`, for one verdict's forecasts (admission's)."""
        return StretchedCosts(self, stretch)

    def _kv_s(self, rows: int) -> float:
        """Seconds a K/V position costs a step of `rows` rows: its point's (on a GPU the bucket it pads to) measured
        price, between two measured row counts linearly, past them the nearest one's (more rows than measured: the
        widest measured step's price, which more rows only lower)."""
        xs = list(self.step_kv_s)
        return _interpolate(self.step_kv_s, min(max(self._point_of(rows), xs[0]), xs[-1]))

    def _base(self, rows: int) -> float:
        point = self._point_of(rows)
        floor = max((s for k, s in self._step.items() if k <= point), default=0.0)
        if len(self._step) == 1:  # one point: a step streams the same weights whatever its rows
            return floor or next(iter(self._step.values()))
        return max(_interpolate(self._step, point), floor)

    def _point_of(self, rows: int) -> int:
        """The measured point a step of `rows` rows costs as: on a GPU the bucket it pads to."""
        if self.buckets is None:
            return rows
        return next((k for k in self._step if k >= rows), rows)

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
            (rows[max(0, len(rows) - 2)], rows[-1]) if i >= len(rows) else (rows[i - 1], rows[i])
        y_lo, y_hi = _interpolate(self._prefill[lo], n), _interpolate(self._prefill[hi], n)
        y = y_lo if hi == lo else y_lo + (y_hi - y_lo) * (kv - lo) / (hi - lo)
        return max(y, fresh)

    # -- online correction --------------------------------------------------------------------------
    def observe_step(self, rows: int, seconds: float, kv_positions: int = 0) -> None:
        """One step of the engine's cadence. A one-off pause (the H100 run saw one step of 100+ ms among 3,500 of
        1.2) must not make an idle server look slow: a lone outlier teaches nothing, and a real slowdown still moves
        the average within a few dozen steps (a millisecond each). A step whose K/V term is most of its own time
        teaches the short-context time nothing: where the calibration's per-position cost runs high (a 2-core CPU
        serving long realtime sessions), the remainder fell to zero, an idle server was predicted to keep the SLA,
        began enforcing it, and then refused every request whose forecast counted its context."""
        with self._lock:
            self.observed_steps += 1
            point = self._point_of(max(1, rows))
            extra = self._kv_s(rows) * max(0, kv_positions - SHORT_CONTEXT * rows)
            if extra > 0.5 * seconds:
                return
            learned = self._learn((point,), _interpolate(self._step, point), max(0.0, seconds - extra))
            new = point not in self._step
            self._step[point] = min(learned, LEARN_CEILING * _interpolate(self._calibrated, point))
            if new:  # kept in order of rows (_interpolate bisects its keys); a known point keeps its place
                self._step = dict(sorted(self._step.items()))
            self._bases.clear()

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
                                {n: s for (n, kv), s in fastest.items() if not kv}, self.max_rows,
                                {p: s for p, s in fastest.items() if p[1]}, self.buckets,
                                {r: min(s, other._kv_s(r)) for r, s in self.step_kv_s.items()})

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
                "step_ms": {str(b): round(s * 1e3, 4) for b, s in self._step.items()},  # rows → ms
                # rows → µs per 1,000 positions the step's rows attend over
                "step_kv_us_per_1k_positions": {str(r): round(s * 1e9, 4) for r, s in self.step_kv_s.items()},
                "prefill_ms": {str(n): round(s * 1e3, 4) for n, s in self._prefill[0].items()},
                "prefill_on_cache_ms": {f"{n}@{kv}": round(s * 1e3, 4) for kv, row in self._prefill.items() if kv
                                        for n, s in row.items()},  # new tokens @ the K/V length they attend over
                "observed_steps": self.observed_steps,
                "observed_prefills": self.observed_prefills,
            }


def step_time(cost: tuple[float, float], rows: int, kv_positions: int) -> float:
    """A step's seconds from its row count's (seconds at a short context, price of a position beyond it)."""
    base, kv_s = cost
    return base + kv_s * max(0, kv_positions - SHORT_CONTEXT * rows)


def steps_time(cost: tuple[float, float], rows: int, kv_positions: int, grow: int, n: int) -> float:
    """n steps' seconds, each attending over `grow` more positions than the last: step_time's sum in closed form."""
    base, kv_s = cost
    over = kv_positions - SHORT_CONTEXT * rows  # positions beyond the short context, at the first step
    if grow <= 0:
        return n * (base + kv_s * max(0, over))
    first = 0 if over > 0 else min(n, -over // grow + 1)  # the first step attending beyond the short context
    paying = n - first
    return n * base + kv_s * (paying * over + grow * (first + n - 1) * paying / 2)


class StretchedCosts:
    """A latency model's step, run-of-steps and prefill times, each x `stretch`: the costs one verdict's forecasts play
    with, the model's own formulas called directly (a forecast beside 15 requests asks for ~40 runs of steps; through
    a closure over the model each took three calls and a lock)."""

    def __init__(self, model: LatencyModel, stretch: float) -> None:
        self.model, self.stretch = model, stretch
        self._cost = model._cost

    def step(self, rows: int, kv_positions: int) -> float:
        r = max(1, rows)
        return step_time(self._cost(r), r, kv_positions) * self.stretch

    def steps(self, rows: int, kv_positions: int, grow: int, n: int) -> float:
        r = max(1, rows)
        return steps_time(self._cost(r), r, kv_positions, grow, n) * self.stretch

    def prefill(self, tokens: int, cached: int) -> float:
        return self.model.prefill(tokens, cached) * self.stretch


def _bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket that holds n (the largest, past them all)."""
    return next((b for b in buckets if b >= n), buckets[-1])


def _interpolate(table: dict[int, float], x: int) -> float:
    """Piecewise-linear through the measured points; linear extrapolation past the last two."""
    if x in table:  # before listing the keys: a step's own point is the usual question
        return table[x]
    xs = list(table)
    if len(xs) == 1:
        return table[xs[0]] * (x / xs[0] if xs[0] else 1.0)
    i = bisect.bisect_left(xs, x)
    lo, hi = (xs[0], xs[1]) if i == 0 else (xs[-2], xs[-1]) if i >= len(xs) else (xs[i - 1], xs[i])
    y = table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
    return max(y, 0.0)
