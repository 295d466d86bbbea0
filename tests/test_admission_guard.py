"""The admission guard (service/admission_guard.py): the stretch is the conformal quantile of what admitted requests
really took over their forecast, per load level; a fresh server starts from a prior and relaxes as it learns; one stall
never decides; the late share and the guard's own error rate over the last minute; its gauges on /metrics."""

import random

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.admission_guard import (
    MISS_WINDOW_S,
    PRIOR_ALONE,
    PRIOR_LOADED,
    PRIOR_SCORES,
    WINDOW_PER_N,
    AdmissionGuard,
    Level,
    conformal_quantile,
    enough_scores,
)
from service.metrics import Metrics

ALONE, BESIDE_ONE, BUSY = Level(0, 1), Level(1, 1), Level(4, 1)


def test_the_stretch_covers_the_target_share_of_new_requests():
    """Scores drawn from one distribution (a forecast right on average, sometimes 30% late): the stretch learned from
    a window of them is exceeded by about 1% of the next 20,000, not more (the conformal guarantee, in expectation)."""
    rng = random.Random(36)

    def score():
        return rng.lognormvariate(0, 0.08) * (1.3 if rng.random() < 0.03 else 1.0)

    over = []
    for _ in range(20):  # twenty windows, each judged on fresh draws
        guard = AdmissionGuard(0.99)
        for _ in range(guard.enough * WINDOW_PER_N):
            guard.observe(BUSY, score(), 1.0)
        stretch = guard.stretch(BUSY)
        over += [score() > stretch for _ in range(1000)]
    assert 0.003 < sum(over) / len(over) <= 0.015


def test_the_quantile_is_the_finite_sample_one():
    assert enough_scores(0.99) == 199 and enough_scores(0.9) == 19
    assert conformal_quantile(list(range(1, 200)), 0.99) == 198  # ceil(200 x 0.99) = 198th of 199: not the largest
    assert conformal_quantile(list(range(1, 100)), 0.99) == 99  # 99 scores: their largest
    assert conformal_quantile([1.0], 0.99) == float("inf")


def test_a_fresh_server_starts_from_the_prior_and_relaxes_as_it_learns():
    guard = AdmissionGuard(0.99)
    assert guard.stretch(ALONE) == PRIOR_ALONE and guard.stretch(BUSY) == PRIOR_LOADED
    for _ in range(PRIOR_SCORES):
        guard.observe(ALONE, 0.9, 1.05)
    half = guard.stretch(BUSY)  # no scores of its own: it pools the nearest levels', as many as the prior weighs
    assert half == pytest.approx((0.9 + PRIOR_LOADED) / 2)
    for _ in range(guard.enough):
        guard.observe(ALONE, 0.9, 1.05)
    assert guard.stretch(BUSY) == pytest.approx(0.9)  # enough nearby: what was measured, not the prior
    for _ in range(guard.enough):
        guard.observe(BUSY, 1.2, 0.9)
    assert guard.stretch(BUSY) == pytest.approx(1.2)  # its own, once it has enough
    assert guard.stretch(ALONE) == pytest.approx(0.9)  # and another level keeps its own


def test_a_pool_with_a_conformal_quantile_is_not_held_up_by_the_prior():
    """From 199 scores at 0.995 (half of N) the pool's largest is a conformal quantile of its own: a fresh H100's voice
    sweep held 199-398 scores none over 1.02 while the prior's average kept its loaded levels at 1.03-1.05 for 20 s. A
    stall as that largest leaves the prior's average, the lower, in charge."""
    guard = AdmissionGuard(0.995)
    half = enough_scores(0.995) // 2  # 199: ceil(200 x 0.995) = 199, the largest
    scores = [1.0 + 0.02 * i / half for i in range(half)]  # 1.0 to 1.02

    def prior_average(seen: list[float]) -> float:
        return (len(seen) * sorted(seen)[-2] + PRIOR_SCORES * PRIOR_LOADED) / (len(seen) + PRIOR_SCORES)

    for x in scores[:-1]:
        guard.observe(ALONE, x, 1.05)
    before = guard.stretch(BESIDE_ONE)
    assert before == pytest.approx(prior_average(scores[:-1])) and before > 1.06  # 198 scores: the prior's average
    guard.observe(ALONE, scores[-1], 1.05)
    assert guard.stretch(BESIDE_ONE) == pytest.approx(max(scores))  # 199: the pool's largest, 1.02
    guard.observe(ALONE, 40.0, 1.05)  # a compile's stall is the largest now
    assert guard.stretch(BESIDE_ONE) == pytest.approx(prior_average([*scores, 40.0]))


def test_a_fresh_servers_first_bursts_are_judged_by_the_prior_until_it_has_seen_enough():
    """A burst of four on the 2-core CPU leaves four scores near 1.02: averaged with the prior, they took the next
    burst's stretch to 1.42, and that burst (three rows a step, which the calibration had not timed) ran 1.46x its
    forecast. Fewer than PRIOR_SCORES scores say nothing of a 1-in-100 tail: the prior holds until there are that
    many (or what they saw, where it is higher), then relaxes."""
    guard = AdmissionGuard(0.99)
    stretches = []
    for _ in range(PRIOR_SCORES // 4):
        stretches.append(guard.stretch(BUSY))
        for _ in range(4):
            guard.observe(BUSY, 1.02, stretches[-1])
    assert stretches == [PRIOR_LOADED] * (PRIOR_SCORES // 4)
    assert guard.stretch(BUSY) == pytest.approx((1.02 + PRIOR_LOADED) / 2)  # PRIOR_SCORES seen: they weigh as it
    worse = AdmissionGuard(0.99)
    for x in (1.9, 1.8, 1.1):  # a few scores over the prior: the second-largest of them, not the prior
        worse.observe(BUSY, x, PRIOR_LOADED)
    assert worse.stretch(BUSY) == pytest.approx(1.8)


def test_one_stall_never_decides_but_a_pattern_does():
    guard = AdmissionGuard(0.99)
    guard.observe(BESIDE_ONE, 40.0, 1.5)  # a compile: a first request 40x late
    assert guard.stretch(BESIDE_ONE) == PRIOR_LOADED
    for _ in range(PRIOR_SCORES):
        guard.observe(BESIDE_ONE, 1.0, 1.5)
    assert guard.stretch(BESIDE_ONE) < PRIOR_LOADED
    for _ in range(guard.enough):
        guard.observe(BESIDE_ONE, 1.0, 1.0)
    assert guard.stretch(BESIDE_ONE) == pytest.approx(1.0)  # 40 is the largest of 210: not the quantile
    for _ in range(10):
        guard.observe(BESIDE_ONE, 1.6, 1.0)  # 5% of them 1.6x late: that is the 0.99 quantile now
    assert guard.stretch(BESIDE_ONE) == pytest.approx(1.6)


def test_a_rare_busy_level_is_never_stretched_less_than_it_saw_itself():
    """A level a busy server reaches now and then pools lighter levels' scores until it has enough of its own; the
    pool's quantile never hides what it saw itself (bar its single largest score): on the H100 the lighter levels
    alone said 1.14 while FP8 requests admitted at 30 req/s came 16% late."""
    guard = AdmissionGuard(0.99)
    for _ in range(guard.enough):
        guard.observe(BESIDE_ONE, 1.0, 1.0)
    guard.observe(BUSY, 1.5, 1.0)  # one score alone never decides
    assert guard.stretch(BUSY) == pytest.approx(1.0)
    for score in (1.3, 1.2, 1.1):
        guard.observe(BUSY, score, 1.0)
    assert guard.stretch(BUSY) == pytest.approx(1.3)  # its own second largest, above the pool's quantile
    assert guard.stretch(BESIDE_ONE) == pytest.approx(1.0)  # the lighter level keeps its own


def test_requests_alone_are_judged_by_requests_alone():
    """What an FP8 server on the H100 had seen when it refused 32-token prompts alone that it served in 58 ms: 154
    such requests alone, on time within 8%; a 1,000-token prompt alone that met a 53 ms stall (1.77x); a few dozen
    beside others, two of them 1.8x. Requests alone are stretched by what requests alone with prompts like theirs
    saw, and the prior; beside others, the stall and the busy scores still count."""
    guard = AdmissionGuard(0.995)
    rng = random.Random(37)
    own = [rng.uniform(0.95, 1.08) for _ in range(154)]
    for score in own:
        guard.observe(ALONE, score, 1.05)
    launch_alone = Level(0, 2)
    for score in [1.77] + [1.0] * 22:
        guard.observe(launch_alone, score, 1.05)
    for score in [1.8, 1.8] + [1.1] * 22:
        guard.observe(BESIDE_ONE, score, 1.3)
    alone = guard.stretch(ALONE)
    assert alone < 1.08  # 58 ms x 1.08 is on time: served, not refused
    recent = sorted(own[-PRIOR_SCORES:])
    assert alone == pytest.approx((recent[-2] + PRIOR_ALONE) / 2)  # its recent second-largest and the prior
    assert guard.stretch(launch_alone) < 1.2  # its one stall is its largest score: it never decides alone
    assert guard.stretch(BESIDE_ONE) > 1.6  # beside others, the stall and the late scores count


def test_an_idle_server_forgets_its_first_requests_stalls():
    """The H100's idle server with a profiler attaching: its first two requests alone came 14.2x and 3.9x their
    forecast, and every 32-token prompt after them was refused (stretch 1.27; forecast 85 ms, served in ~76), one probe
    a second admitted. With the second-largest of all its scores each probe served on time weighed the 3.9 more, until
    the level had 399 scores; now the stalls are forgotten after PRIOR_SCORES probes. Two late ones among the last
    twenty keep the stretch up."""
    guard = AdmissionGuard(0.995)
    guard.observe(ALONE, 14.21, 1.05)
    guard.observe(ALONE, 3.9, 1.05)
    stretches = [guard.stretch(ALONE)]
    for _ in range(PRIOR_SCORES):
        guard.observe(ALONE, 0.88, stretches[-1])
        stretches.append(guard.stretch(ALONE))
    assert min(stretches[1:PRIOR_SCORES - 1]) > 1.2  # while the stalls are recent: refusing is still right
    assert stretches[-1] == pytest.approx((0.88 + PRIOR_ALONE) / 2)  # forgotten: 85 ms x 0.97 is on time
    for _ in range(100):  # and they stay forgotten as the level fills
        guard.observe(ALONE, 0.88, stretches[-1])
    assert guard.stretch(ALONE) == pytest.approx((0.88 + PRIOR_ALONE) / 2)
    for late in (1.5, 1.4):  # a pattern again: two late among the last twenty
        guard.observe(ALONE, late, stretches[-1])
    assert guard.stretch(ALONE) == pytest.approx((20 * 1.4 + PRIOR_SCORES * PRIOR_ALONE) / (20 + PRIOR_SCORES))


def test_a_level_keeps_only_its_recent_scores():
    guard = AdmissionGuard(0.99)
    for _ in range(guard.enough * WINDOW_PER_N):
        guard.observe(BUSY, 2.0, 1.0)
    for _ in range(guard.enough * WINDOW_PER_N):
        guard.observe(BUSY, 1.1, 1.0)
    assert guard.stretch(BUSY) == pytest.approx(1.1)


def test_the_late_share_and_the_guards_error_over_the_last_minute():
    now = [0.0]
    guard = AdmissionGuard(0.99, clock=lambda: now[0])
    assert guard.miss_rate() == (0.0, 0.0)
    for late in (False, False, False, True):
        guard.judged(late)
    guard.observe(BUSY, 1.3, 1.2)  # over the stretch it was admitted with
    guard.observe(BUSY, 1.1, 1.2)
    assert guard.miss_rate() == (0.25, 0.5)
    now[0] += MISS_WINDOW_S + 1
    guard.judged(False)
    assert guard.miss_rate() == (0.0, 0.0)


def test_levels_bucket_requests_in_flight_and_prompt_work():
    assert Level.of(1, 32, 16, 256) == Level(0, 1) and Level.of(1, 16, 16, 256) == Level(0, 0)
    assert Level.of(3, 300, 16, 256) == Level(2, 2) and Level.of(100, 0, 16, 256) == Level(7, 0)
    assert Level(2, 1).labels == {"in_flight": "3-4", "prompt": "chunked"}
    assert Level(0, 0).labels == {"in_flight": "1", "prompt": "step"}
    assert Level(7, 2).labels == {"in_flight": "65+", "prompt": "launch"}


def test_the_guard_on_metrics():
    now = [0.0]
    guard = AdmissionGuard(0.95, clock=lambda: now[0])
    metrics = Metrics(64)
    metrics.export_guard(guard)
    for i in range(guard.enough):
        guard.observe(BUSY, 1.25 if i % 10 == 0 else 0.9, 1.5)  # forecasts 10% pessimistic, one in ten 25% late
    guard.judged(True)
    guard.judged(False)
    fams = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    quantile = {(s.labels["in_flight"], s.labels["prompt"]): s.value
                for s in fams["parley_admission_guard_quantile"].samples}
    assert quantile[("9-16", "chunked")] == pytest.approx(1.25)
    assert quantile[("1", "chunked")] == PRIOR_ALONE  # a request alone borrows no busy level's scores
    median = {s.labels["in_flight"]: s.value for s in fams["parley_admission_guard_median"].samples}
    assert median == {"9-16": pytest.approx(0.9)}  # the bias on the whole; levels without scores have none
    scores = {s.labels["in_flight"]: s.value for s in fams["parley_admission_guard_scores"].samples}
    assert scores["9-16"] == guard.enough and scores["1"] == 0
    assert fams["parley_admission_guard_target"].samples[0].value == 0.95
    assert fams["parley_admission_guard_miss_rate"].samples[0].value == 0.5
    assert fams["parley_admission_guard_exceeded_rate"].samples[0].value == 0.0


def test_a_restarted_guard_starts_from_what_the_last_run_learned(tmp_path):
    """The guard's memory (service/guard_memory.py): a server that learned its levels leaves their scores beside its
    calibration at exit; the next run of the same server starts from them (its stretch as before the restart, not the
    prior); a memory for another server, a torn file or none leaves the prior; scores seen before the memory was read
    stay the newest."""
    from service import guard_memory

    rng = random.Random(7)
    key = {"device": "test", "model": "synthetic:tiny", "weights": "bf16", "max_rows": 16}
    learned = AdmissionGuard(0.99)
    for _ in range(learned.enough * 2):
        learned.observe(BUSY, rng.uniform(0.95, 1.1), 1.0)
        learned.observe(BESIDE_ONE, rng.uniform(0.98, 1.03), 1.0)
    path = guard_memory.memory_path(tmp_path, key)
    guard_memory.save(path, key, learned)
    assert path.name.endswith(".guard.json") and path.parent == tmp_path

    restarted = AdmissionGuard(0.99)
    assert restarted.stretch(BUSY) == PRIOR_LOADED
    assert guard_memory.load(path, key, restarted) == 4 * learned.enough
    assert restarted.stretch(BUSY) == learned.stretch(BUSY) < 1.1
    assert restarted.stretch(BESIDE_ONE) == learned.stretch(BESIDE_ONE) < 1.03
    assert restarted.scores() == learned.scores()

    other = AdmissionGuard(0.99)
    assert guard_memory.load(path, {**key, "max_rows": 64}, other) == 0  # another server's memory
    assert guard_memory.load(tmp_path / "none.guard.json", key, other) == 0
    path.write_text('{"format": 1, "key"')
    assert guard_memory.load(path, key, other) == 0
    assert other.stretch(BUSY) == PRIOR_LOADED

    seen = AdmissionGuard(0.99)  # a score seen before the memory was read stays the newest of its level
    seen.observe(BUSY, 1.5, 1.0)
    assert seen.seed({BUSY: [1.0] * WINDOW_PER_N * seen.enough}) == WINDOW_PER_N * seen.enough
    assert seen.scores()[BUSY][-1] == 1.5 and len(seen.scores()[BUSY]) == WINDOW_PER_N * seen.enough


def _pooled_stretch_by_sorting(guard: AdmissionGuard, level: Level) -> float:
    """The pooled stretch as the module's docstring states it, the windows merged and sorted whole (what
    _computed_stretch did before it read only their tops)."""
    scores = guard.scores()
    rings: dict[int, list[Level]] = {}
    for lv in scores:
        rings.setdefault(level.distance(lv), []).append(lv)
    pool: list[float] = []
    for d in sorted(rings):
        pool += [x for lv in rings[d] for x in scores[lv]]
        if len(pool) >= guard.enough:
            own = sorted(scores.get(level, []))
            return max(conformal_quantile(sorted(pool), guard.target), own[-2] if len(own) > 1 else 0.0)
    if len(pool) < PRIOR_SCORES:
        return max(PRIOR_LOADED, sorted(pool)[-2]) if len(pool) > 1 else PRIOR_LOADED
    seen = sorted(pool)[-2]
    blended = (len(pool) * seen + PRIOR_SCORES * PRIOR_LOADED) / (len(pool) + PRIOR_SCORES)
    return min(blended, conformal_quantile(sorted(pool), guard.target))  # the pool's own bound, once it has one


@pytest.mark.parametrize("target", [0.9, 0.99, 0.995])
def test_a_busy_level_pooled_from_its_neighbours_reads_what_sorting_them_all_reads(target):
    """A level short of scores of its own borrows its neighbours' (windows of ~2,000 on a busy server): its stretch,
    read from the windows' tops alone and kept until the next score, is the conformal quantile of the whole pool,
    whatever the windows' sizes, before and after a new score moves it."""
    rng = random.Random(7)
    for _ in range(30):
        guard = AdmissionGuard(target)
        for lv in {Level(rng.randrange(1, 6), rng.randrange(3)) for _ in range(rng.randrange(1, 7))}:
            for _ in range(rng.choice([1, 2, 5, guard.enough // 3, guard.enough, WINDOW_PER_N * guard.enough])):
                guard.observe(lv, rng.lognormvariate(0, 0.1) * (1.5 if rng.random() < 0.02 else 1.0), 1.0)
        busy = Level(rng.randrange(1, 7), rng.randrange(3))
        for _ in range(2):
            own = len(guard.scores().get(busy, []))
            expected = conformal_quantile(sorted(guard.scores()[busy]), target) if own >= guard.enough \
                else _pooled_stretch_by_sorting(guard, busy)
            assert guard.stretch(busy) == expected
            assert guard.stretch(busy) == expected  # read again: the same, from the cache
            guard.observe(Level(rng.randrange(1, 6), rng.randrange(3)), 3.0, 1.0)  # a stall next door moves the pool
