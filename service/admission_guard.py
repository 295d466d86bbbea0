"""AdmissionGuard: how far admission stretches the planner's forecast, measured rather than tuned, so that "admitted"
carries a stated probability of being on time.

Split conformal prediction, run online. Every admitted request leaves one score: the time from its verdict to its
SLA token over the time the forecast (unstretched) said it would take. The guard keeps the recent scores of each
load level, and a level's stretch is the ceil((n + 1) x target)-th smallest of its n scores. If the next request's
score is exchangeable with those (same level, no drift since), it exceeds that stretch with probability at most
1 - target; admitting only requests whose stretched forecast meets their deadline then keeps at least `target` of
them on time. Whatever the forecast does not see (host stalls, steps carrying prompt chunks, a busier host than the
calibration's) is in the scores, at the level where it happens; no margin is picked by hand.

A level is (requests in flight once the newcomer joins, in powers of two; what the prompt tokens still to prefill
need: one step, chunks over several, or a launch of their own): a server with sixteen streams and prompts riding in
every step misses its forecast differently from one serving a single stream.

How many scores are enough: N = the fewest for which the quantile is not the largest score (199 at 0.99), so that one
stall (a first request's one-off cost, a compile) never decides alone; it would otherwise keep a whole level refusing
for hundreds of requests, and a refusing level learns nothing. A level with fewer pools the nearest levels' (one
in-flight bucket or one prompt kind away, then two, ...) until it has N, and its stretch is then never below its own
second-largest score: the levels a busy server reaches rarely are the ones that miss, and lighter levels' scores alone
said 1.14 where FP8 requests admitted at 30 req/s on the H100 reached their SLA token at p99 116 ms. Where all of them
together have fewer, the stretch is a prior and the pool's second-largest score averaged, the prior weighing as
PRIOR_SCORES scores: a fresh server starts from the prior and relaxes as it sees its own requests (on a GPU, the single
streams a benchmark sends first have it admitting beside others within a few dozen requests). Not before the pool has
PRIOR_SCORES: a handful of scores says nothing of a 1-in-100 tail, and until then the stretch is the prior, or their
second-largest where that is higher. Averaged in from the first few, one burst on the 2-core CPU (four scores near
1.02) took the next burst's stretch to 1.42; that burst admitted three, whose 3-row steps the calibration had put at
a 4-row step's time and which ran 1.46x their forecast: all three late (bench/NOTES.md, s99). Never above the pool's
conformal quantile once there is one (its largest score, from half of N: 199 scores at 0.995): that bound holds without
the prior, which held a fresh H100's voice sweep at 1.03-1.05 for 20 s with 199-398 scores at hand, none over 1.02,
until the 399th dropped the stretch to 1.01 at once (bench/NOTES.md, s79); where the largest is a stall, the prior's
average is the lower and stays.

A request alone, its level short of N scores, is judged by its own level's last PRIOR_SCORES scores only (their
second-largest, averaged with the prior). No other level's: its forecast has the engine to itself, and misses
differently from a forecast beside others (shared steps, prompt chunks in them) and from one alone with a prompt of
another kind; an FP8 server that pooled them took a 1,000-token prompt's stall (1.77x) and one score beside others as
what requests alone see, and refused 32-token prompts alone (forecast x 1.7) that it served in 58 ms. And none but its
recent ones: an idle server's first requests meet one-off costs (a profiler attaching left two of 3.9 and 14.2 on the
H100), and with the second-largest of all its scores each probe served on time weighed those more, so an idle server
refused every request alone until its level had N scores, one probe a second. A recent window forgets them after
PRIOR_SCORES requests, and still sees a pattern: two late requests in any twenty keep the stretch up.

The prior is the one figure here not measured on this server, and it must hold where nothing has been seen: PRIOR_ALONE
for a request alone (the calibration times steps back to back, as the engine runs them; the H100 came in 0.92 of such
forecasts), PRIOR_LOADED beside others (the calibration times bare steps: a 2-core CPU streaming four replies over
HTTP ran a fresh server's first burst at 1.45-2.2x its forecast with two torch threads, 1.03-1.11x with the one its
engine now keeps to (--cpu-threads); on the H200, fresh servers' loaded levels scored at most 1.03 in their first
seconds of voice load and 1.06 over the minute, admitted FP8 requests at 60-80 req/s 1.28 at p99). It was 2.0: a
fresh server stretched its first loaded verdicts by 1.28 at the median and refused 49 of their first 5 s's 108 as
late; with 1.5, 1.12-1.15 and 6-14 of 120-158, none of the admitted late (bench/NOTES.md, s69).
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from service.recent_window import RecentWindow

PRIOR_ALONE = 1.05
PRIOR_LOADED = 1.5
PRIOR_SCORES = 20  # how many scores the prior weighs as, until a level's pool has enough
MISS_WINDOW_S = 60.0  # the late share /metrics shows: over this many seconds
WINDOW_PER_N = 5  # a level keeps its last WINDOW_PER_N x N scores (995 at 0.99: the quantile is the 10th largest)

IN_FLIGHT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # upper bounds; more than the last is one bucket too
PROMPT_KINDS = ("step", "chunked", "launch")  # the prompt tokens to prefill fit one step / need several / a launch


@dataclass(frozen=True, order=True)
class Level:
    """A load level: an in-flight bucket (an index into IN_FLIGHT_BUCKETS; its length for more) and a prompt kind (an
    index into PROMPT_KINDS)."""

    in_flight: int
    prompt: int

    @classmethod
    def of(cls, in_flight: int, prompt_tokens: int, max_rows: int, launch_min_tokens: int) -> Level:
        """The level of a verdict: `in_flight` requests admitted and not ended, the newcomer included;
        `prompt_tokens` prompt tokens among them still to prefill."""
        bucket = next((i for i, b in enumerate(IN_FLIGHT_BUCKETS) if in_flight <= b), len(IN_FLIGHT_BUCKETS))
        kind = 0 if prompt_tokens <= max_rows else 1 if prompt_tokens < launch_min_tokens else 2
        return cls(bucket, kind)

    @property
    def alone(self) -> bool:
        return self.in_flight == 0

    @property
    def labels(self) -> dict[str, str]:
        """Its Prometheus labels, e.g. in_flight="3-4", prompt="chunked"."""
        if self.in_flight >= len(IN_FLIGHT_BUCKETS):
            span = f"{IN_FLIGHT_BUCKETS[-1] + 1}+"
        else:
            hi = IN_FLIGHT_BUCKETS[self.in_flight]
            lo = IN_FLIGHT_BUCKETS[self.in_flight - 1] + 1 if self.in_flight else 1
            span = str(hi) if lo == hi else f"{lo}-{hi}"
        return {"in_flight": span, "prompt": PROMPT_KINDS[self.prompt]}

    def distance(self, other: Level) -> int:
        return abs(self.in_flight - other.in_flight) + abs(self.prompt - other.prompt)


@dataclass(frozen=True)
class LevelState:
    """What /metrics shows of a level: its stretch now, how many scores of its own are behind it, and their median."""

    level: Level
    stretch: float
    scores: int
    median: float | None = None  # of its own scores: how far off its forecasts run on the whole, beside the tail


def enough_scores(target: float) -> int:
    """The fewest scores whose conformal quantile at `target` is not the largest: ceil((n + 1) target) <= n - 1."""
    return math.ceil((1 + target) / (1 - target) - 1e-9)


def conformal_quantile(ordered: Sequence[float], target: float) -> float:
    """The ceil((n + 1) target)-th smallest of these scores, sorted (inf where there are too few for one)."""
    k = math.ceil((len(ordered) + 1) * target - 1e-9)
    return ordered[k - 1] if 0 < k <= len(ordered) else math.inf


def largest(ranked: Sequence[Sequence[float]], j: int) -> list[float]:
    """The `j` largest scores of several sorted windows together, largest first: only each window's top `j` can be
    among them (pooling busy levels' windows of ~2,000 scores and sorting the lot took 0.1-0.2 ms a verdict)."""
    return sorted(itertools.chain.from_iterable(r[-j:] for r in ranked), reverse=True)[:j]


def pooled_quantile(ranked: Sequence[Sequence[float]], n: int, target: float) -> float:
    """conformal_quantile of the `n` scores of these sorted windows together: the k-th smallest is the (n - k + 1)-th
    largest, near the top at a high target."""
    k = math.ceil((n + 1) * target - 1e-9)
    return largest(ranked, n - k + 1)[-1] if 0 < k <= n else math.inf


class AdmissionGuard:
    def __init__(self, target: float = 0.99, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.5 <= target < 1:
            raise ValueError(f"the on-time target must lie in [0.5, 1), not {target}")
        self.target = target
        self.enough = enough_scores(target)
        self._scores: dict[Level, RecentWindow] = {}
        self._stretches: dict[Level, float] = {}  # each level's stretch since the scores last changed
        self._judged: deque[tuple[float, bool]] = deque()  # (when, late) of each admitted request's SLA
        self._exceeded: deque[tuple[float, bool]] = deque()  # (when, score over the stretch it was admitted with)
        self._clock = clock
        self._lock = threading.Lock()

    # -- what admission asks -------------------------------------------------------------------------------
    def stretch(self, level: Level) -> float:
        """The factor forecasts at this level are stretched by."""
        with self._lock:
            return self._stretch(level)

    def _stretch(self, level: Level) -> float:
        """The level's stretch, computed once per change of the scores: a verdict asks for it twice (its stretch, then
        the usual pace's cap), and /metrics for every level."""
        cached = self._stretches.get(level)
        if cached is None:
            cached = self._stretches[level] = self._computed_stretch(level)
        return cached

    def _computed_stretch(self, level: Level) -> float:
        own = self._scores.get(level)
        if own is not None and len(own) >= self.enough:
            return conformal_quantile(own.ranked, self.target)
        if level.alone:
            return self._alone_stretch(own)
        pool: list[list[float]] = []  # the pooled windows' ranked scores, never merged: only their tops are read
        n = 0
        for ring in self._rings(level):  # this level's scores, then the nearest levels' until there are enough
            pool += [self._scores[lv].ranked for lv in ring]
            n += sum(len(self._scores[lv]) for lv in ring)
            if n >= self.enough:  # never below what this level saw itself, bar its largest score
                own_seen = own.ranked[-2] if own is not None and len(own) > 1 else 0.0
                return max(pooled_quantile(pool, n, self.target), own_seen)
        prior = PRIOR_ALONE if level.alone else PRIOR_LOADED
        if n < PRIOR_SCORES:  # too few to say anything of a tail: the prior holds, or what they saw if more
            return max(prior, largest(pool, 2)[1]) if n > 1 else prior
        seen = largest(pool, 2)[1]  # the largest score never decides alone
        blended = (n * seen + PRIOR_SCORES * prior) / (n + PRIOR_SCORES)
        # A pool already large enough for a conformal quantile (its largest score: from 199 scores at 0.995) bounds
        # the stretch by itself; the prior stands in only above it, where one stall is that largest score.
        return min(blended, pooled_quantile(pool, n, self.target))

    @staticmethod
    def _alone_stretch(own: RecentWindow | None) -> float:
        """A request alone, its level short of enough scores: the second-largest of the level's last PRIOR_SCORES
        scores, averaged with the prior (weighing as many). No other level's scores, and none but its recent ones (see
        the module's docstring)."""
        if own is None:
            return PRIOR_ALONE
        recent = sorted(list(own.order)[-PRIOR_SCORES:])
        seen = recent[-2] if len(recent) > 1 else PRIOR_ALONE  # the largest score never decides alone
        return (len(recent) * seen + PRIOR_SCORES * PRIOR_ALONE) / (len(recent) + PRIOR_SCORES)

    def typical(self, level: Level) -> float:
        """How far forecasts at this level run off on the whole: the median of its own scores, of the nearest levels'
        while it has fewer than PRIOR_SCORES, 1 where there are none; never above its stretch."""
        with self._lock:
            own = self._scores.get(level)
            if own is not None and len(own) >= PRIOR_SCORES:  # the loaded case: its window keeps them ranked
                usual = own.median()
            else:
                pool: list[float] = []
                for ring in self._rings(level):
                    for lv in ring:
                        pool.extend(self._scores[lv].ranked)  # sorted runs: the median's sort merges them
                    if len(pool) >= PRIOR_SCORES:
                        break
                usual = statistics.median(pool) if len(pool) >= PRIOR_SCORES else 1.0
            return min(usual, self._stretch(level))

    def _rings(self, level: Level) -> Iterator[list[Level]]:
        """The levels that have scores and may stand in for `level` (beside others), by their distance from it,
        nearest first."""
        by_distance: dict[int, list[Level]] = {}
        for lv in self._scores:
            by_distance.setdefault(level.distance(lv), []).append(lv)
        for d in sorted(by_distance):
            yield by_distance[d]

    # -- what admitted requests teach ----------------------------------------------------------------------
    def observe(self, level: Level, score: float, stretch: float) -> None:
        """An admitted request judged at `level` with `stretch` reached its SLA token after `score` times its
        forecast."""
        if not math.isfinite(score) or score <= 0:
            return
        with self._lock:
            self._scores.setdefault(level, RecentWindow(WINDOW_PER_N * self.enough)).add(score)
            self._stretches.clear()
            self._exceeded.append((self._clock(), score > stretch))
            self._trim()

    def scores(self) -> dict[Level, list[float]]:
        """Each level's recent scores, oldest first (what guard_memory.py keeps across restarts)."""
        with self._lock:
            return {lv: list(window.order) for lv, window in self._scores.items()}

    def seed(self, scores: dict[Level, list[float]]) -> int:
        """Start from scores a previous run of this server learned (oldest first): each level's window as if it had
        seen them; how many were read. Scores seen since stay the newest."""
        taken = 0
        with self._lock:
            for lv, xs in scores.items():
                window = RecentWindow(WINDOW_PER_N * self.enough)
                for x in xs:
                    if math.isfinite(x) and x > 0:
                        window.add(x)
                        taken += 1
                for x in self._scores[lv].order if lv in self._scores else ():
                    window.add(x)
                self._scores[lv] = window
            self._stretches.clear()
        return taken

    def judged(self, late: bool) -> None:
        """An admitted request's SLA was judged: its SLA token came (or it ended before it), late or in time."""
        with self._lock:
            self._judged.append((self._clock(), late))
            self._trim()

    def _trim(self) -> None:
        old = self._clock() - MISS_WINDOW_S
        for recent in (self._judged, self._exceeded):
            while recent and recent[0][0] < old:
                recent.popleft()

    # -- what operators read -------------------------------------------------------------------------------
    def miss_rate(self) -> tuple[float, float]:
        """Over the last MISS_WINDOW_S: the share of admitted requests judged late, and the share of scores over the
        stretch their request was admitted with (what the target bounds); 0 where there were none."""
        with self._lock:
            self._trim()
            return _share(self._judged), _share(self._exceeded)

    def levels(self) -> list[LevelState]:
        """Every level with scores, and the two a fresh server judges most requests at (alone, and beside one)."""
        with self._lock:
            shown = set(self._scores) | {Level(0, 1), Level(1, 1)}
            return [LevelState(lv, self._stretch(lv), len(self._scores.get(lv, ())),
                               self._scores[lv].median() if lv in self._scores else None) for lv in sorted(shown)]


def _share(recent: deque[tuple[float, bool]]) -> float:
    return sum(flag for _, flag in recent) / len(recent) if recent else 0.0
