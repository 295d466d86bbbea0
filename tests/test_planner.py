"""The planner's step plans and forecasts, and commit's stop rule, on plain requests (no decoder)."""

import math
from dataclasses import fields

import pytest

from service.engine.commit import Finished, Started, StepDone, Token, commit
from service.engine.kv_slots import KVSlots
from service.engine.output import TextOutput
from service.engine.planner import ForecastState, Planner
from service.engine.prefix_cache import block_hashes
from service.engine.request import Choice, Request, SamplingParams, State
from service.latency_model import LatencyModel
from service.model.synthetic import byte_tokenizer

TOKENIZER = byte_tokenizer(300)


def request(prompt_len, max_tokens=64, choice=Choice.STEP, first=1):
    req = Request(list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                  lambda d: None, TextOutput(TOKENIZER.detokenizer()))
    req.prompt_blocks, req.choice = block_hashes(req.prompt_ids), choice
    return req


def planner(max_batch=4, max_rows=16, slots=4, launch_min=256, prefill_rows=None):
    return Planner(KVSlots(slots), max_batch, max_rows, max_context=4096, launch_min_tokens=launch_min,
                   prefill_rows=prefill_rows)


def run(p, plan, token=7):
    """Commit a plan as if every sampled row chose `token`; end what ended."""
    events = commit(plan, lambda row: token, frozenset(), p.max_context, now=0.0)
    for ev in events:
        if isinstance(ev, Finished):
            p.finish(ev.req)
    return events


def test_a_step_carries_decode_rows_first_then_prompt_chunks_within_the_token_budget():
    p = planner(max_rows=16)
    running = request(5, first=100)
    p.add(running)
    run(p, p.plan())  # its prompt rides alone, and samples its first token
    assert running.state is State.RUNNING and running.output_ids == [7]
    long = request(40)
    p.add(long)
    chunks = []
    while long.prefilled < 40 or not long.output_ids:
        plan = p.plan()
        assert plan.rows <= 16 and plan.sampled[0] is running  # the running request decodes in every step
        assert plan.positions[0] == 5 + len(running.output_ids) - 1 and plan.tokens[0] == 7
        chunks += [(c.start, c.end) for c in plan.chunks]
        own = sorted(pos for slot, pos in zip(plan.slots, plan.positions) if slot == long.slot)
        assert own == list(range(plan.chunks[0].start, plan.chunks[0].end))  # each prompt position once
        run(p, plan)
    assert chunks == [(0, 15), (15, 30), (30, 40)]  # 15 prompt rows beside the decode row, then the rest
    assert long.kv_len == 40 and long.output_ids == [7]


def test_the_last_prompt_row_samples_and_comes_with_the_sampled_rows():
    p = planner(max_rows=16)
    a, b = request(3, first=10), request(4, first=20)
    p.add(a)
    p.add(b)
    plan = p.plan()
    assert plan.sampled == [a, b] and plan.rows == 7
    # sampled rows: each prompt's last token at its last position; then the other prompt rows
    assert plan.positions[:2] == [2, 3] and plan.tokens[:2] == [12, 23]
    assert sorted(zip(plan.slots[2:], plan.positions[2:])) == sorted([(a.slot, 0), (a.slot, 1), (b.slot, 0),
                                                                      (b.slot, 1), (b.slot, 2)])


def test_seats_cap_the_sampled_rows_and_the_rest_wait():
    p = planner(max_batch=2, max_rows=64, slots=4)
    reqs = [request(3, first=10 * i + 1) for i in range(3)]
    for r in reqs:
        p.add(r)
    plan = p.plan()
    assert plan.sampled == reqs[:2] and list(p.waiting) == [reqs[2]]
    run(p, plan)
    assert len(p.plan().sampled) == 2 and reqs[2].state is State.WAITING


def test_a_long_prompt_is_launched_on_its_own_and_its_last_token_rides():
    p = planner(max_rows=16, launch_min=32)
    busy = request(4, first=200)
    p.add(busy)
    run(p, p.plan())
    long = request(100)
    p.add(long)
    plan = p.plan()
    assert [(lc.start, lc.end) for lc in plan.launches] == [(0, 99)]
    assert plan.sampled == [busy, long] and plan.positions[1] == 99 and plan.rows == 2
    run(p, plan)
    assert long.kv_len == 100 and long.output_ids == [7]


def test_on_an_idle_server_a_prompt_of_more_than_three_steps_is_launched_a_shorter_one_rides():
    p = planner(max_rows=16)
    short, long = request(40), request(60, first=100)
    p.add(short)
    plan = p.plan()
    assert not plan.launches and plan.rows == 16 and plan.chunks[0].end == 16
    q = planner(max_rows=16)
    q.add(long)
    plan = q.plan()
    assert [(lc.start, lc.end) for lc in plan.launches] == [(0, 59)] and plan.rows == 1


def test_a_step_with_no_decode_row_carries_prefill_rows_and_one_beside_decode_rows_max_rows():
    """With nobody decoding, a prompt fills a step of up to prefill_rows (64) rows: one of 40 or 64 tokens in a single
    step whose last row samples; one of 65 is launched. A prompt arriving beside a decoding request is chunked by
    max_rows (16) as before, and once nobody decodes any more, its rest rides in one prompt-only step."""
    p = planner(max_rows=16, prefill_rows=64)
    short = request(40)
    p.add(short)
    plan = p.plan()
    assert not plan.launches and plan.rows == 40 and plan.sampled == [short]
    assert [(c.start, c.end) for c in plan.chunks] == [(0, 40)]
    run(p, plan)
    assert short.kv_len == 40 and short.output_ids == [7]
    for n, launched in ((64, False), (65, True)):
        q = planner(max_rows=16, prefill_rows=64)
        req = request(n, first=300)
        q.add(req)
        plan = q.plan()
        assert bool(plan.launches) is launched and plan.rows == (1 if launched else n), n
    # beside a decoding request: chunks of the token budget, then the rest in one step once it has ended
    b = planner(max_rows=16, prefill_rows=64)
    busy = request(4, max_tokens=3, first=200)
    b.add(busy)
    run(b, b.plan())
    late = request(60, first=500)
    b.add(late)
    rows = []
    while not late.output_ids:
        plan = b.plan()
        rows.append((len(plan.sampled), plan.rows))
        run(b, plan)
    assert rows == [(1, 16), (1, 16), (1, 30)] and busy.state is State.FINISHED  # 15 + 15, then 30 at once
    assert late.kv_len == 60


def test_forecast_plays_the_prompt_only_budget_as_plan_does():
    """An idle server's forecast of a 40-token prompt: one step of 40 rows, then a token a step (with prefill_rows
    16: three chunk steps); beside a decoding request, chunks of max_rows as before."""
    def step_s(rows, kv):
        return 0.001 + 1e-5 * rows

    def prefill_s(tokens, cached):
        return 0.050

    for prefill_rows, first_steps in ((64, [40]), (None, [16, 16, 8])):
        p = planner(max_rows=16, prefill_rows=prefill_rows)
        req = request(40, max_tokens=64)
        t = p.forecast([req], step_s, prefill_s, now=0.0, horizon_s=1.0)[id(req)]
        want = sum(step_s(r, 0) for r in first_steps) + 63 * step_s(1, 0)
        assert t == pytest.approx(want), prefill_rows
    p = planner(max_rows=16, prefill_rows=64)
    running = request(8, max_tokens=200)
    p.add(running)
    run(p, p.plan())
    newcomer = request(40, first=300)
    t = p.forecast([running, newcomer], step_s, prefill_s, now=0.0, horizon_s=1.0)[id(newcomer)]
    # 15 + 15 + 10 prompt rows beside the decode row, then 63 steps of the two
    assert t == pytest.approx(2 * step_s(16, 0) + step_s(11, 0) + 63 * step_s(2, 0))


def test_a_request_that_needs_its_token_on_the_host_sits_out_the_step_after_its_own():
    p = planner()
    host, dev = request(3, choice=Choice.HOST, first=1), request(3, first=50)
    p.add(host)
    p.add(dev)
    first = p.plan()
    second = p.plan(inflight=first)  # planned before `first` is read
    assert second.sampled == [dev] and second.feed == {0: 1}  # fed the token `first` chose for it, on the device
    run(p, first)
    third = p.plan(inflight=second)
    assert third.sampled == [host, dev] and third.feed == {1: 0} and third.tokens[0] == 7


class SlowMask:
    """A grammar whose next mask is (not yet) computed."""

    def __init__(self) -> None:
        self.is_ready = False

    def ready(self) -> bool:
        return self.is_ready


def test_a_grammar_still_computing_its_mask_sits_out_unless_nobody_else_decodes():
    p = planner()
    host, dev = request(3, choice=Choice.HOST, first=1), request(3, first=50)
    mask = SlowMask()
    host.constraint = mask
    p.add(host)
    p.add(dev)
    run(p, p.plan())  # both prompts ride and choose their first tokens
    assert p.plan().sampled == [dev]  # the mask for host's next token is not ready: dev's step does not wait for it
    mask.is_ready = True
    assert p.plan().sampled == [host, dev]
    p.finish(dev)
    mask.is_ready = False
    assert p.plan().sampled == [host]  # alone: its step waits for its mask


def test_no_row_is_planned_past_max_tokens_or_the_context():
    p = planner()
    req = request(3, max_tokens=2)
    p.add(req)
    first = p.plan()
    second = p.plan(inflight=first)
    assert second.sampled == [req]
    run(p, first)
    assert not p.plan(inflight=second)  # its second (last) token is in flight: nothing more to plan
    near_end = Planner(KVSlots(2), 2, 16, max_context=5)
    req = request(3, max_tokens=10)
    near_end.add(req)
    run(near_end, near_end.plan())
    assert near_end.plan().positions == [3]
    run(near_end, near_end.plan())  # token 2: the context (5) keeps no position for the row that would feed it
    assert req.state is State.FINISHED and not near_end.plan()


def test_commit_applies_tokens_and_the_stop_rule():
    p = planner()
    req = request(3, max_tokens=3)
    p.add(req)
    events = run(p, p.plan())
    assert [type(e) for e in events] == [StepDone, Started, Token]
    assert events[2].n == 1 and req.kv_len == 3
    run(p, p.plan())
    events = run(p, p.plan())
    assert isinstance(events[-1], Finished) and events[-1].reason == "length" and events[-1].n == 3
    assert req.state is State.FINISHED and req.slot is None
    assert req.output_ids == [7, 7, 7] and req.kv_len == 5


def test_an_eos_token_ends_the_request_and_a_finished_requests_row_is_dropped():
    p = planner()
    req = request(3, max_tokens=10)
    req.params = SamplingParams(max_tokens=10)  # honours EOS
    p.add(req)
    first = p.plan()
    second = p.plan(inflight=first)
    events = commit(first, lambda row: 99, frozenset({99}), 4096, now=1.0)
    assert events[-1] == Finished(req, "stop", 1.0, "", 99, 1, None)
    p.finish(req)
    assert [type(e) for e in commit(second, lambda row: 5, frozenset(), 4096, 2.0)] == [StepDone]


def test_a_prompt_sharing_a_prefix_being_written_waits_for_it_and_copies_it():
    """Two callers with one system prompt at once: the second is seated once the first's prompt has been planned
    (its slot then holds it), and copies it instead of prefilling it again."""
    p = planner(max_rows=64)
    system = list(range(1, 41))
    first, second = request(0), request(0)
    first.prompt_ids, second.prompt_ids = system + [100, 101], system + [200]
    first.prompt_blocks, second.prompt_blocks = block_hashes(first.prompt_ids), block_hashes(second.prompt_ids)
    p.add(first)
    p.add(second)
    plan = p.plan()
    assert plan.started == [first] and list(p.waiting) == [second]
    plan = p.plan(inflight=plan)
    assert plan.started == [second] and second.cached_tokens == 40  # the whole system prompt, copied
    assert [(c.src, c.dst, c.tokens) for c in plan.copies] == [(first.slot, second.slot, 40)]


def test_forecast_a_riding_prompt_delays_nobody_a_launched_one_does():
    p = planner(max_rows=64, launch_min=256)
    running = request(8)
    p.add(running)
    run(p, p.plan())

    def step_s(rows, kv):
        return 0.001

    def prefill_s(tokens, cached):
        return 0.020

    alone = p.forecast([running], step_s, prefill_s, now=0.0, horizon_s=1.0)
    riding = request(50, first=300)
    launched = request(400, first=300)
    with_riding = p.forecast([running, riding], step_s, prefill_s, now=0.0, horizon_s=1.0)
    with_launch = p.forecast([running, launched], step_s, prefill_s, now=0.0, horizon_s=1.0)
    assert alone[id(running)] == pytest.approx(0.063)  # 63 more tokens, one a step
    assert with_riding[id(running)] == pytest.approx(alone[id(running)])
    assert with_riding[id(riding)] == pytest.approx(0.064)  # its prompt in one step, then 63 tokens
    assert with_launch[id(running)] == pytest.approx(0.083)  # stalled by the 20 ms launch
    assert with_launch[id(launched)] == pytest.approx(0.084)
    far = request(8, first=600)
    assert p.forecast([far], step_s, prefill_s, now=0.0, horizon_s=0.01)[id(far)] == math.inf  # past the horizon


@pytest.mark.parametrize("with_runs", [False, True])
def test_a_request_not_yet_seated_joins_after_the_steps_the_engine_has_launched(with_runs):
    """A request that waits for its seat is forecast in the step after those the engine has launched already
    (`steps_ahead`; or `join_after`), each of them the running request's alone; the running request's own forecast
    does not move. With nobody seated the launched steps hold nobody back (they end what is in them)."""
    def step_s(rows, kv):
        return 0.001 * rows

    def prefill_s(tokens, cached):
        return 0.020

    def steps_s(rows, kv, grow, n):
        return n * step_s(rows, kv)

    runs = steps_s if with_runs else None
    p = planner(max_rows=16)
    running = request(8, max_tokens=200)
    p.add(running)
    run(p, p.plan())  # its first token: 63 to its SLA token
    newcomer = request(8, first=300)
    at_once = p.forecast([running, newcomer], step_s, prefill_s, 0.0, 1.0, runs)
    p.steps_ahead = 2
    after = p.forecast([running, newcomer], step_s, prefill_s, 0.0, 1.0, runs)
    assert at_once[id(newcomer)] == pytest.approx(0.009 + 63 * 0.002)  # 1 + 8 rows, then a token a step beside it
    assert after[id(newcomer)] == pytest.approx(at_once[id(newcomer)] + 2 * 0.001)  # two steps of the running one
    assert after[id(running)] == pytest.approx(at_once[id(running)] - 2 * 0.001)  # the newcomer's rows come later
    assert p.forecast([running, newcomer], step_s, prefill_s, 0.0, 1.0, runs, join_after=0) == at_once
    alone = request(8, first=600)
    assert p.forecast([alone], step_s, prefill_s, 0.0, 1.0, runs)[id(alone)] == pytest.approx(0.008 + 63 * 0.001)


@pytest.mark.parametrize("closed_form", [False, True])
def test_forecast_plays_repeated_steps_at_once_with_the_times_of_one_at_a_time(monkeypatch, closed_form):
    """forecast() runs the steps that repeat in one go (Planner._repeat): every seated request decoding and none to
    seat, alone or beside one prompt that rides a full chunk a step; its times must be those of planning each step in
    turn (exactly; to rounding where a run of steps is timed in one call, steps_s) whatever the mix: running and
    waiting requests, prompts that ride, chunk or launch, replies shorter than the SLA token, requests that lag, a
    full batch with requests waiting for a seat, up to 15 decoding beside a prompt that rides a row a step, a horizon
    that cuts the play short."""
    import random

    rng = random.Random(35)
    # the latency model's shape: a base per row count, and a cost per position beyond 64 a row
    lat = LatencyModel({1: 0.001, 4: 0.00104, 16: 0.0012}, {16: 0.002}, max_rows=16, step_kv_s=1e-8)

    def step_s(rows, kv):
        return lat.step(rows, kv)

    def steps_s(rows, kv, grow, n):
        return lat.steps(rows, kv, grow, n)

    def prefill_s(tokens, cached):
        return 0.002 + 1e-5 * tokens + 1e-8 * cached

    def one_step(decoding, rows, kv, grow, most, t, end, step_s, out, steps_s=None):
        t += step_s(rows, kv)
        for s in decoding:
            s.token(t, out)
        return t, 1

    repeated = {"steady": 0, "chunked": 0, "drained": 0}  # _repeat's calls that took more than one step, by kind;
    fast_repeat, fast_drain = Planner._repeat, Planner._drain  # forecasts ended by _drain

    def draining(*args):
        times = fast_drain(*args)
        repeated["drained"] += times is not None
        return times

    def counting(decoding, rows, kv, grow, most, *rest):
        t, taken = fast_repeat(decoding, rows, kv, grow, most, *rest)
        if taken > 1:
            repeated["steady" if most == math.inf else "chunked"] += 1
        return t, taken

    checked = 0
    for case in range(120):
        wide = case % 2  # the server's shape: 16 seats, 16 rows a step
        p = planner(max_batch=16 if wide else rng.randint(1, 4), max_rows=16, slots=20 if wide else 4,
                    launch_min=rng.choice([64, 256]), prefill_rows=rng.choice([None, 64]))
        running = [request(rng.randint(1, 40), max_tokens=rng.randint(2, 90), first=100 * i + 1)
                   for i in range(rng.randint(8, 15) if wide else 3)]
        for r in running:
            p.add(r)
            if wide:
                for _ in range(rng.randint(0, 3)):
                    run(p, p.plan())
        for _ in range(rng.randint(1, 6)):
            run(p, p.plan())
        live = [r for r in running if r.state is State.RUNNING]
        newcomers = [request(rng.choice([5, 30, 120, 400]), max_tokens=rng.choice([10, 64, 80]),
                             choice=rng.choice([Choice.STEP, Choice.STEP, Choice.HOST]), first=10000 + 100 * i)
                     for i in range(rng.randint(1, 3))]
        horizon = rng.choice([0.03, 0.2, 2.0])
        with monkeypatch.context() as m:
            m.setattr(Planner, "_repeat", staticmethod(counting))
            m.setattr(Planner, "_drain", staticmethod(draining))
            fast = p.forecast(live + newcomers, step_s, prefill_s, now=1.0, horizon_s=horizon,
                              steps_s=steps_s if closed_form else None)
        with monkeypatch.context() as m:
            m.setattr(Planner, "_repeat", staticmethod(one_step))
            slow = p.forecast(live + newcomers, step_s, prefill_s, now=1.0, horizon_s=horizon)
        if closed_form:
            assert fast.keys() == slow.keys(), case
            assert all(fast[k] == pytest.approx(slow[k], rel=1e-12) for k in fast), case
        else:
            assert fast == slow, case
        checked += sum(math.isfinite(v) for v in fast.values())
    assert checked > 200  # most requests reach their SLA token within the horizons
    assert repeated["steady"] > 50 and repeated["chunked"] > 20, repeated
    assert (repeated["drained"] > 40) == closed_form, repeated  # _drain needs steps_s


def test_a_forecast_state_copy_carries_every_field():
    """forecast() starts from copies of a verdict's snapshot (ForecastState.copy, written out for speed): every field
    of the copy is the original's, whatever fields the state has, and playing the copy leaves the original as it was."""
    values = {"req": object(), "seated": True, "lags": True, "done": True}
    state = ForecastState(**{f.name: values.get(f.name, 7 + i) for i, f in enumerate(fields(ForecastState))})
    before = {f.name: getattr(state, f.name) for f in fields(ForecastState)}
    copied = state.copy()
    assert copied == state and copied is not state
    copied.token(1.0, {})
    assert copied != state and {f.name: getattr(state, f.name) for f in fields(ForecastState)} == before
