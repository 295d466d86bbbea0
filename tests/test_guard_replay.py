"""bench/guard_replay.py: today's admission guard over an admission log. A log the same guard wrote replays to the same
stretches; a refusal as late counts as met only where the replayed stretch brings its forecast within its budget."""

from bench.guard_replay import level_of, markdown, replay
from service.admission_guard import AdmissionGuard, Level

ALONE, BESIDE_ONE = Level(0, 1), Level(1, 1)


def _log(stretch_of, verdicts: list[tuple[float, float]]) -> list[dict]:
    """199 scores of requests alone (1.0 to 1.02), then verdicts beside one other (forecast ms, left ms), refused as
    late, each with the stretch `stretch_of(guard)` says: the guard that wrote this log."""
    guard = AdmissionGuard(0.995)
    lines, t = [], 100.0
    for i in range(199):
        score = 1.0 + 0.02 * i / 199
        guard.observe(ALONE, score, 1.05)
        lines.append({"kind": "sla_token", "t": t, "score": score, "stretch": 1.05, "level": ALONE.labels})
        t += 0.05
    for forecast_ms, left_ms in verdicts:
        stretch = stretch_of(guard)
        lines.append({"kind": "verdict", "t": t, "admitted": False, "rule": "late", "in_flight": 2,
                      "level": BESIDE_ONE.labels, "stretch": stretch, "forecast_ms": forecast_ms, "left_ms": left_ms,
                      "stretched_ms": forecast_ms * stretch})
        t += 0.05
    return lines


def test_a_log_the_same_guard_wrote_replays_to_its_own_stretches():
    lines = _log(lambda g: g.stretch(BESIDE_ONE), [(95.0, 90.0), (96.0, 94.0)])
    windows = replay(lines, target=0.995)
    assert sum(w.differ for w in windows) == 0
    assert sum(w.verdicts for w in windows) == 2 and sum(w.met for w in windows) == 0  # over budget either way


def test_refusals_a_lower_stretch_would_have_let_in_are_counted():
    """Logged at 1.06 (an older guard's prior average); today's guard says the pool's largest, 1.02: a forecast of 90
    ms with 93 left is met (90 x 1.02 = 91.8), one with 91 left is not."""
    lines = _log(lambda g: 1.06, [(90.0, 93.0), (90.0, 91.0)])
    windows = replay(lines, target=0.995)
    assert sum(w.differ for w in windows) == 2
    assert sum(w.late for w in windows) == 2 and sum(w.met for w in windows) == 1
    assert windows[-1].replayed == [windows[-1].replayed[0]] * 2 and windows[-1].replayed[0] < 1.02
    assert "1 of 2 refusals as late met" in markdown(windows)


def test_levels_are_read_back_from_their_labels():
    for lv in (ALONE, BESIDE_ONE, Level(3, 2), Level(7, 0)):
        assert level_of(lv.labels) == lv
