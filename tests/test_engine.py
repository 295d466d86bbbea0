"""The engine on the CPU: continuous batching, sampling parameters, stop sequences, cancellation, sessions, faults."""

import dataclasses
import gc
import logging
import queue
import threading
import time
import types
from dataclasses import dataclass

import pytest
import torch

from service.backends.decoder import DecodeOutput, Fed
from service.backends.faults import FaultInjectingDecoder
from service.backends.reference import ReferenceDecoder
from service.engine import sampler
from service.engine.admission import AdmitAll, Rejected
from service.engine.commit import StepDone
from service.engine.constraint import bitmask
from service.engine.engine import Engine
from service.engine.output import TextOutput
from service.engine.request import Delta, Request, SamplingParams
from service.engine.sampler import SamplingError
from service.engine.slow_steps import SlowGpuSteps, SlowIterations, SlowSteps, thread_clock
from service.model.loader import load_model
from service.model.synthetic import byte_tokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("synthetic:tiny")


def make_engine(model, slots=4, ctx=256, **fault):
    dec = ReferenceDecoder(model.config, model.weights, max_slots=slots, max_context=ctx)
    if fault:
        dec = FaultInjectingDecoder(dec, **fault)
    eng = Engine(dec, model.tokenizer, eos_token_ids=(), sla_tokens=8)
    eng.start()
    return eng


def collect(q: "queue.SimpleQueue[Delta]", timeout=30.0) -> list[Delta]:
    out = []
    while True:
        d = q.get(timeout=timeout)
        out.append(d)
        if d.finish_reason is not None:
            return out


def wait_until(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return False


def test_batched_requests_get_the_tokens_they_get_alone(tiny):
    eng = make_engine(tiny)
    try:
        prompts = [[5, 6, 7], [100, 3], [42] * 9, [1, 2, 3, 4, 5, 6]]
        alone = [[t for d in eng.generate(p, GREEDY) for t in d.token_ids] for p in prompts]
        qs = []
        for p in prompts:  # all at once: they join the batch as they come
            q = queue.SimpleQueue()
            eng.submit(p, GREEDY, q.put)
            qs.append(q)
        together = [[t for d in collect(q) for t in d.token_ids] for q in qs]
        assert together == alone
        assert all(len(t) == 12 for t in alone)
        assert len({tuple(t) for t in alone}) > 1  # different prompts, different continuations
    finally:
        eng.stop()


def test_more_requests_than_slots_all_complete(tiny):
    eng = make_engine(tiny, slots=2)
    try:
        qs = []
        for i in range(7):
            q = queue.SimpleQueue()
            eng.submit([i + 1, i + 2], GREEDY, q.put)
            qs.append(q)
        for q in qs:
            deltas = collect(q)
            assert deltas[-1].finish_reason == "length"
            assert deltas[-1].usage.completion_tokens == 12
        assert wait_until(lambda: eng.stats.free_slots == 2 and eng.stats.running == 0)
    finally:
        eng.stop()


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny):
    eng = make_engine(tiny)
    try:
        p = SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
        a = [t for d in eng.generate([9, 8, 7], p) for t in d.token_ids]
        b = [t for d in eng.generate([9, 8, 7], p) for t in d.token_ids]
        g = [t for d in eng.generate([9, 8, 7], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
             for t in d.token_ids]
        assert a == b
        assert a != g
    finally:
        eng.stop()


def test_top_k_one_is_greedy(tiny):
    eng = make_engine(tiny)
    try:
        k1 = SamplingParams(max_tokens=10, temperature=1.0, top_k=1, ignore_eos=True)
        g = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        assert [d.token_ids for d in eng.generate([3, 4], k1)] == [d.token_ids for d in eng.generate([3, 4], g)]
    finally:
        eng.stop()


def test_eos_stops_unless_ignored(tiny):
    eng0 = make_engine(tiny)
    try:
        first = [t for d in eng0.generate([11, 12], GREEDY) for t in d.token_ids]
    finally:
        eng0.stop()
    eos = first[3]
    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(eos,))
    eng.start()
    try:
        params = SamplingParams(max_tokens=12, temperature=0)
        deltas = list(eng.generate([11, 12], params))
        assert deltas[-1].finish_reason == "stop"
        assert deltas[-1].usage.completion_tokens == first.index(eos) + 1
        ignored = list(eng.generate([11, 12], GREEDY))
        assert ignored[-1].finish_reason == "length" and ignored[-1].usage.completion_tokens == 12
    finally:
        eng.stop()


def test_stop_sequence_is_never_shown():
    tok = byte_tokenizer(300)
    out = TextOutput(tok.detokenizer(), stop=("END",))
    text = ""
    for ch in "hello wEN world; and theEND more":
        text += out.add(tok.encode(ch)[0])
        if out.stopped:
            break
    assert text == "hello wEN world; and the"
    assert out.stopped


def test_cancel_frees_the_slot_within_a_step(tiny):
    eng = make_engine(tiny, slots=2, step_delay_s=0.02)
    try:
        q = queue.SimpleQueue()
        req = eng.submit([1, 2, 3], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True), q.put)
        q.get(timeout=30)  # the first token is out: it is running
        assert eng.stats.free_slots == 1 or wait_until(lambda: eng.stats.free_slots == 1)
        t0 = time.monotonic()
        eng.cancel(req)
        deltas = collect(q)
        assert deltas[-1].finish_reason == "cancelled"
        assert time.monotonic() - t0 < 0.5  # one 20 ms step, with slack for a busy machine
        assert wait_until(lambda: eng.stats.free_slots == 2 and eng.stats.running == 0)
        assert deltas[-1].usage.completion_tokens < 200
    finally:
        eng.stop()


def test_session_reuses_its_cache_and_gives_the_same_tokens(tiny):
    eng = make_engine(tiny)
    try:
        sess = eng.new_session()
        turn1 = [7, 8, 9, 10]
        q = queue.SimpleQueue()
        eng.submit(turn1, GREEDY, q.put, session=sess)
        d1 = collect(q)
        reply = [t for d in d1 for t in d.token_ids]
        turn2 = turn1 + reply + [20, 21, 22]
        q = queue.SimpleQueue()
        eng.submit(turn2, GREEDY, q.put, session=sess)
        d2 = collect(q)
        # Every token fed so far is cached: prompt + reply but its last token (never fed back).
        assert d2[-1].usage.cached_tokens == len(turn1) + len(reply) - 1
        fresh = [t for d in eng.generate(turn2, GREEDY) for t in d.token_ids]
        assert [t for d in d2 for t in d.token_ids] == fresh
        eng.close_session(sess)
        assert wait_until(lambda: eng.stats.free_slots == 4)
    finally:
        eng.stop()


def test_idle_session_slot_is_taken_back_when_needed(tiny):
    eng = make_engine(tiny, slots=1)
    try:
        sess = eng.new_session()
        q = queue.SimpleQueue()
        eng.submit([1, 2, 3], GREEDY, q.put, session=sess)
        collect(q)
        # The only slot is held by the idle session; a stranger still gets served.
        out = list(eng.generate([4, 5, 6], GREEDY))
        assert out[-1].finish_reason == "length"
        q = queue.SimpleQueue()
        eng.submit([1, 2, 3, 9], GREEDY, q.put, session=sess)
        assert collect(q)[-1].usage.cached_tokens == 0  # its cache was evicted
    finally:
        eng.stop()


def test_a_failing_step_fails_only_its_requests_and_the_engine_goes_on(tiny):
    eng = make_engine(tiny, fail_step=3)
    try:
        q = queue.SimpleQueue()
        eng.submit([1, 2], GREEDY, q.put)
        deltas = collect(q)
        assert deltas[-1].finish_reason == "error"
        assert "injected fault" in deltas[-1].error
        after = list(eng.generate([1, 2], GREEDY))
        assert after[-1].finish_reason == "length"
        assert eng.healthy()
        assert wait_until(lambda: eng.stats.free_slots == 4)
    finally:
        eng.stop()


def test_bad_input_is_refused_before_it_reaches_the_engine(tiny):
    eng = make_engine(tiny, ctx=64)
    try:
        with pytest.raises(ValueError, match="empty"):
            eng.submit([], GREEDY, lambda d: None)
        with pytest.raises(ValueError, match="context is 64"):
            eng.submit([1] * 60, GREEDY, lambda d: None)
        with pytest.raises(ValueError, match="token ids"):
            eng.submit([1, 512], GREEDY, lambda d: None)
        assert eng.stats.waiting == 0
    finally:
        eng.stop()


def test_drain_finishes_in_flight_work_and_refuses_new(tiny):
    from service.engine.engine import Rejected

    eng = make_engine(tiny, step_delay_s=0.005)
    try:
        q = queue.SimpleQueue()
        eng.submit([1, 2], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), q.put)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("ok", eng.drain(timeout_s=30)))
        t.start()
        assert wait_until(lambda: not eng.accepting)
        with pytest.raises(Rejected) as e:
            eng.submit([1, 2], GREEDY, lambda d: None)
        assert e.value.status == 503
        deltas = collect(q)
        t.join(30)
        assert result["ok"] and deltas[-1].usage.completion_tokens == 40
    finally:
        eng.stop()


@pytest.fixture(params=[False, True], ids=["in-step", "run-ahead"])
def overlap(request):
    return request.param


def make_overlap_engine(model, overlap, eos=(), slots=4, ctx=256, start=True):
    dec = ReferenceDecoder(model.config, model.weights, max_slots=slots, max_context=ctx)
    eng = Engine(dec, model.tokenizer, eos_token_ids=eos, sla_tokens=8)
    eng.overlap = overlap  # a GPU engine runs a step ahead; the CPU can run the same logic, for this test
    if start:
        eng.start()
    return eng


def test_running_a_step_ahead_changes_no_token(tiny, overlap):
    base = make_overlap_engine(tiny, False)
    try:
        alone = [[t for d in base.generate(p, GREEDY) for t in d.token_ids] for p in ([5, 6], [9, 9, 9], [77])]
    finally:
        base.stop()
    first = alone[0]
    eos = first[5]  # a request that stops mid-way while the next step already runs
    eng = make_overlap_engine(tiny, overlap, eos=(eos,))
    try:
        qs = []
        for p in ([5, 6], [9, 9, 9], [77]):
            q = queue.SimpleQueue()
            eng.submit(p, SamplingParams(max_tokens=12, temperature=0), q.put)
            qs.append(q)
        got = [[t for d in collect(q) for t in d.token_ids] for q in qs]
        for g, a in zip(got, alone):
            cut = a.index(eos) + 1 if eos in a else len(a)
            assert g == a[:cut]
        sess = eng.new_session()
        q = queue.SimpleQueue()
        eng.submit([5, 6, 7], GREEDY, q.put, session=sess)
        reply = [t for d in collect(q) for t in d.token_ids]
        q = queue.SimpleQueue()
        eng.submit([5, 6, 7] + reply + [1], GREEDY, q.put, session=sess)
        d2 = collect(q)
        assert d2[-1].usage.cached_tokens == 3 + len(reply) - 1  # no token computed ahead counts as cached
        assert wait_until(lambda: eng.stats.running == 0 and eng._inflight is None)
    finally:
        eng.stop()


def request(tiny, params, prompt=(1,)):
    """A request as the engine makes it for a decoder that draws nothing inside its step."""
    req = Request(list(prompt), params, lambda d: None, TextOutput(tiny.tokenizer.detokenizer()))
    req.choice = sampler.choice_of(req, draws_tokens=False)
    return req


def step_tokens(logits, reqs):
    """A step's tokens as the sampler chooses them, every row read."""
    tokens = sampler.choose(DecodeOutput(logits, logits.argmax(-1)), reqs)
    tokens.read()
    return [tokens.token(i) for i in range(len(reqs))]


def test_sampling_on_the_device_follows_the_same_truncation(tiny):
    """Chosen on the device, a step draws only tokens that a request alone could draw (top-k, top-p),
    greedy rows stay greedy, and an engine running ahead with unseeded sampling streams the tokens it chose."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3),
              SamplingParams(temperature=0.8, top_p=0.5)]
    reqs = [request(tiny, p) for p in params]
    seen = [set(), set(), set()]
    for _ in range(300):
        for i, t in enumerate(step_tokens(logits, reqs)):
            seen[i].add(t)
    assert seen[0] == {int(logits[0].argmax())}
    assert seen[1] <= set(torch.topk(logits[1], 3).indices.tolist()) and len(seen[1]) > 1
    probs = (logits[2] / 0.8).softmax(-1)
    order = probs.argsort(descending=True)
    keep = int(((probs[order].cumsum(0) - probs[order]) < 0.5).sum())
    assert seen[2] <= set(order[:keep].tolist())

    eng = make_overlap_engine(tiny, True)
    try:
        out = list(eng.generate([4, 5], SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)))
        assert out[-1].usage.completion_tokens == 20 and sum(len(d.token_ids) for d in out) == 20
    finally:
        eng.stop()


def test_untruncated_sampling_on_the_device_draws_by_the_softmax(tiny):
    """With no top-k/top-p (the fast path), the draw frequencies follow softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    req = request(tiny, SamplingParams(temperature=0.7))
    out = torch.tensor(step_tokens(logits, [req] * 4000))
    freq = torch.bincount(out, minlength=4).float() / 4000
    torch.testing.assert_close(freq, (logits[0] / 0.7).softmax(-1), atol=0.03, rtol=0)


class DrawingDecoder:
    """The reference decoder, drawing tokens inside its step as Decoder.draws_tokens promises: Gumbel-max over
    logits / T with noise keyed by (seed, position) only. Counts the rows it drew, so the test sees the engine
    hand sampled requests to the decoder."""

    draws_tokens = True
    slow_prefills = query_block_steps = 0

    def __init__(self, inner: ReferenceDecoder) -> None:
        self.inner, self.drawn = inner, 0
        self.config, self.max_slots, self.max_context = inner.config, inner.max_slots, inner.max_context
        self.device, self.name = inner.device, "drawing"

    def prefill(self, slot, token_ids, start_pos=0):
        return self.inner.prefill(slot, token_ids, start_pos)

    def draw(self, logits, draws, positions):
        out = []
        for row, d, pos in zip(logits, draws, positions):
            g = torch.Generator().manual_seed((d.seed * 1_000_003 + pos) % 2**63)
            u = torch.rand(row.shape[-1], generator=g).clamp_min(1e-12)
            out.append(int((row / d.temperature - torch.log(-torch.log(u))).argmax()))
            self.drawn += 1
        return torch.tensor(out)

    def decode(self, slots, token_ids, positions, draws=None, sampled_rows=None, masks=None):
        out = self.inner.decode(slots, token_ids, positions, sampled_rows=sampled_rows, masks=masks)
        if draws is None:
            return out
        sampled = out.argmax.clone()
        for i, (d, pos) in enumerate(zip(draws, positions)):
            if d.temperature > 0:
                sampled[i] = self.draw(out.logits[i:i + 1], [d], [pos])[0]
        return DecodeOutput(out.logits, out.argmax, sampled)


def test_sampled_requests_draw_inside_the_decode_step(tiny, overlap):
    """With a decoder that draws inside its step, the engine hands it every untruncated sampled request (greedy
    rows keep the argmax, top-p rows are still sampled by the engine): a seeded request draws the same tokens
    alone and in a mixed batch, with or without running ahead; unseeded requests differ."""
    def engine():
        dec = DrawingDecoder(ReferenceDecoder(tiny.config, tiny.weights, max_slots=4, max_context=256))
        eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=8)
        eng.overlap = overlap
        eng.start()
        return eng, dec

    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=77, ignore_eos=True)
    eng, dec = engine()
    try:
        alone = [t for d in eng.generate([3, 1, 4], seeded) for t in d.token_ids]
        greedy_alone = [t for d in eng.generate([2, 7], GREEDY) for t in d.token_ids]
        # all 16 drawn by the decoder, the first from the prompt's last row; running ahead, no row is planned past
        # max_tokens
        assert dec.drawn == 16
        qs = [queue.SimpleQueue() for _ in range(3)]
        eng.submit([2, 7], GREEDY, qs[0].put)
        eng.submit([3, 1, 4], seeded, qs[1].put)
        eng.submit([5, 5], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.5, ignore_eos=True), qs[2].put)
        got = [[t for d in collect(q) for t in d.token_ids] for q in qs]
        assert got[1] == alone
        assert got[0] == greedy_alone
        assert len(got[2]) == 16
        free = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
        a = [t for d in eng.generate([3, 1, 4], free) for t in d.token_ids]
        b = [t for d in eng.generate([3, 1, 4], free) for t in d.token_ids]
        assert len(a) == len(b) == 16 and a != b
    finally:
        eng.stop()


def test_a_failed_sampling_raises_for_its_request_alone(tiny):
    """A row whose sampling fails (NaN logits, sampled with its own seeded generator) raises SamplingError carrying its
    request, after the step was read; the rows beside it get their tokens. The engine fails that request alone
    (tests/test_reliability_faults.py)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    logits[1] = float("nan")
    reqs = [request(tiny, SamplingParams(temperature=0.0)),
            request(tiny, SamplingParams(temperature=1.0, seed=3)),
            request(tiny, SamplingParams(temperature=1.0, top_p=0.9, seed=4))]
    tokens = sampler.choose(DecodeOutput(logits, logits.argmax(-1)), reqs)
    tokens.read()
    assert tokens.token(0) == int(logits[0].argmax())
    with pytest.raises(SamplingError) as e:
        tokens.token(1)
    assert e.value.request is reqs[1]
    assert 0 <= tokens.token(2) < 50


class OnlyTokens:
    """A constraint (what a grammar plugs in) that allows a few tokens; it can be made to break on its Nth mask."""

    def __init__(self, tokens, break_at=0, vocab=512):
        self.bits, self.break_at = bitmask(tokens, vocab), break_at
        self.masked, self.accepted = 0, []

    def ready(self):
        return True

    def allowed(self):
        self.masked += 1
        if self.masked == self.break_at:
            raise RuntimeError("the grammar broke")
        return self.bits

    def accept(self, token):
        self.accepted.append(token)

    opening = False

    def lifted(self):
        return False


def submit_all(eng, jobs):
    """Submit (prompt, params, constraint) jobs to an engine not started yet (each constraint in its params, as the API
    hands a grammar in); start the engine and collect every request's deltas."""
    qs = []
    for prompt, params, constraint in jobs:
        q = queue.SimpleQueue()
        eng.submit(prompt, dataclasses.replace(params, constraint=constraint), q.put)
        qs.append(q)
    eng.start()
    return [collect(q) for q in qs]


def test_a_constraint_masks_every_choice(tiny, overlap):
    """A constrained request chooses every token, the first one included, among what its constraint allows, and
    tells the constraint each one; beside it, running ahead or not, the other requests get the tokens they get
    alone."""
    base = make_overlap_engine(tiny, False)
    try:
        alone = [t for d in base.generate([9, 9, 9], GREEDY) for t in d.token_ids]
    finally:
        base.stop()
    eng = make_overlap_engine(tiny, overlap, start=False)
    only = OnlyTokens({7, 42, 300})
    sampled = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    try:
        got = submit_all(eng, [([5, 6], sampled, only), ([9, 9, 9], GREEDY, None)])
    finally:
        eng.stop()
    constrained = [t for d in got[0] for t in d.token_ids]
    assert len(constrained) == 12 and set(constrained) <= {7, 42, 300}
    assert only.accepted == constrained
    assert [t for d in got[1] for t in d.token_ids] == alone


def test_a_sampling_failure_in_a_step_fails_only_its_request(tiny, overlap):
    eng = make_overlap_engine(tiny, overlap, start=False)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)
    try:
        broken, greedy, fine = submit_all(eng, [([5, 6], sampled, OnlyTokens(range(100), break_at=3)),
                                                ([9, 9, 9], GREEDY, None), ([1, 2], sampled, None)])
        assert broken[-1].finish_reason == "error" and "sampling failed: the grammar broke" in broken[-1].error
        assert broken[-1].usage.completion_tokens == 2
        assert greedy[-1].finish_reason == fine[-1].finish_reason == "length"
        assert greedy[-1].usage.completion_tokens == fine[-1].usage.completion_tokens == 12
        assert eng.healthy() and wait_until(lambda: eng.stats.free_slots == 4 and eng.stats.running == 0)
    finally:
        eng.stop()


def test_slow_steps_are_logged_at_most_once_a_minute(caplog):
    """On a CPU every step is slow: the first is logged, then at most one line a minute, saying how many slow
    steps there were since the last line; fast steps are not counted."""
    now = [1000.0]
    slow = SlowSteps(clock=lambda: now[0])

    def steps(n, seconds):
        for _ in range(n):
            slow.observe(3, seconds)
            now[0] += seconds

    with caplog.at_level(logging.WARNING, logger="parley.engine"):
        steps(100, 0.2)  # 20 s of slow steps
        steps(50, 0.01)
        assert [r.getMessage() for r in caplog.records] == [
            "a decode step of 3 took 200 ms (1 steps over 50 ms since the last report)"]
        now[0] = 1059.9
        steps(1, 0.2)  # still within the minute of the first line
        steps(1, 0.2)  # past it: one more line, counting the 100 unreported before it
        steps(10, 0.2)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 2 and "(101 steps over 50 ms since the last report)" in lines[1]


def test_a_slow_engine_iteration_is_logged_with_where_its_time_went(caplog):
    now = [0.0]
    slow = SlowIterations(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="parley.engine"):
        slow.observe({"plan": 0.0002, "decode": 0.001})  # 1.2 ms: not slow
        slow.observe({"plan": 0.0002, "decode": 0.0068})
        slow.observe({"plan": 0.0002, "decode": 0.0118})  # within the throttle: counted, not logged
        slow.observe({"plan": 0.0002, "decode": 0.0058})  # shorter than that one
        now[0] += 3.0
        slow.observe({"plan": 0.006, "decode": 0.001})  # due: the line describes the longest since the last
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["an engine iteration took 7.0 ms (plan 0.2, decode 6.8; 1 iterations over 5 ms since the last "
                     "report)", "an engine iteration took 12.0 ms (plan 0.2, decode 11.8; 3 iterations over 5 ms "
                     "since the last report, this the longest)"]


def test_a_slow_iteration_names_the_step_it_launched_and_asks_only_when_slow(caplog):
    """What the iteration launched (its rows, prompt rows and positions) beside its phases: a voice turn's prompt step
    over 2,000 cached positions and a lone decode row's stall read alike without it. The words are built only for a
    slow iteration: the engine thread's time per step is what the GPU waits for."""
    now = [0.0]
    asked = []

    def step():
        asked.append(1)
        return "1 rows (0 prompt) over 2078 positions"

    slow = SlowIterations(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="parley.engine"):
        slow.observe({"plan": 0.0002, "decode": 0.001}, step=step)  # not slow: not asked
        assert not asked
        slow.observe({"decode": 0.0064}, step=step)
    assert caplog.records[0].getMessage().startswith(
        "an engine iteration took 6.4 ms launching 1 rows (0 prompt) over 2078 positions (decode 6.4;")


class PartedDecoder(ReferenceDecoder):
    """A decoder that says its call's parts, as the megakernel's does (its wait for its last input copy, its launch);
    this one's wait is 7 ms of sleep."""

    def __init__(self, model):
        super().__init__(model.config, model.weights, max_slots=4, max_context=256)
        self.decode_phases = {}

    def decode(self, slots, token_ids, positions, draws=None, sampled_rows=None, masks=None):
        time.sleep(0.007)
        out = super().decode(slots, token_ids, positions, draws, sampled_rows, masks)
        self.decode_phases = {"input wait": 0.007, "launch": 0.0}
        return out


def test_a_slow_iteration_splits_decode_into_the_decoders_own_parts(tiny, caplog):
    """A decode of milliseconds on the H100 named no part: the decoder's own parts stand beside the rest of decode,
    and the phases still add up to the iteration."""
    dec = PartedDecoder(tiny)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=8)
    eng.start()
    try:
        with caplog.at_level(logging.WARNING, logger="parley.engine"):
            q: queue.SimpleQueue[Delta] = queue.SimpleQueue()
            eng.submit(tiny.tokenizer.encode("hello there"), GREEDY, q.put)
            collect(q)
    finally:
        eng.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("an engine iteration took")]
    assert lines, "a 7 ms decode makes a slow iteration"
    phases = dict(p.rsplit(" ", 1) for p in lines[0].split(" (", 1)[1].split(";")[0].split(", "))
    assert float(phases["decode: input wait"]) == 7.0 and "decode: launch" in phases
    total = float(lines[0].split(" ms")[0].rsplit(" ", 1)[1])
    assert abs(sum(map(float, phases.values())) - total) < 0.3  # the wait counted once, not in decode too


def test_a_slow_iteration_says_whether_the_thread_ran_or_waited(caplog):
    """The engine thread's own clock beside a slow iteration's phases: 8 ms of Python ran on a CPU; 8 ms asleep (a
    lock, the GIL, a device wait) did not, and blocked."""
    now = [0.0]
    slow = SlowIterations(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="parley.engine"):
        since = thread_clock()
        end = time.thread_time() + 0.008  # 8 ms on a CPU, however long the host takes to give them (CPU steal)
        while time.thread_time() < end:
            pass
        slow.observe({"feed": 0.008}, since)
        now[0] += 3.0
        since = thread_clock()
        time.sleep(0.008)
        slow.observe({"feed": 0.008}, since)
    busy, asleep = [r.getMessage() for r in caplog.records]
    ran = [float(m.split("the thread ran ")[1].split(" ms")[0]) for m in (busy, asleep)]
    assert ran[0] >= 4.0 and ran[1] < 2.0, (busy, asleep)
    assert "blocked 0 times" not in asleep  # the sleep is a wait the thread's clock counts


def test_a_step_the_gpu_ran_slowly_is_logged_against_its_recent_median(caplog):
    """Steps of ~1 ms on the GPU, then a run of them 40% slower (a request alone reached its SLA token 40% late on
    an idle H100 so): the 1.4 ms steps pass, 2 ms ones are logged with how far off they were, throttled."""
    now = [0.0]
    slow = SlowGpuSteps(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="parley.engine"):
        for _ in range(100):
            slow.observe(0.001)
        slow.observe(0.0014)  # under 1.5x the median
        slow.observe(0.002)
        slow.observe(0.0021)  # within the throttle: counted
        now[0] += 3.0
        slow.observe(0.0022)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["the GPU ran a decode step in 2.00 ms, 2.0x the recent median of its kind, 1.00 ms (1 such steps "
                     "since the last report)", "the GPU ran a decode step in 2.20 ms, 2.2x the recent median of its "
                     "kind, 1.00 ms (2 such steps since the last report)"]
    fresh = SlowGpuSteps()
    with caplog.at_level(logging.WARNING, logger="parley.engine"):
        fresh.observe(0.5)  # a first step (a compile, a capture) has no median to be judged against
    assert len(caplog.records) == 2


def test_prompt_steps_are_judged_against_prompt_steps(caplog):
    """A voice sweep's prompt steps over ~2,000 cached positions take 3-7x a decode step: against decode steps they
    were logged once a turn. Each kind against its own median: the prompt steps pass, a decode step's stall among them
    is still logged, and a prompt step twice its kind's median too."""
    now = [0.0]
    slow = SlowGpuSteps(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="parley.engine"):
        for i in range(200):
            slow.observe(0.001)
            if i % 5 == 0:
                slow.observe(0.005, "prompt")
        assert not caplog.records
        slow.observe(0.0045)  # a decode step stalled among them
        now[0] += 3.0
        slow.observe(0.011, "prompt")
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["the GPU ran a decode step",
                                                                          "the GPU ran a prompt step"]


def test_timings_say_which_token_they_time(tiny):
    """The last delta's timings: time to token N, with N the engine's SLA token (8 here), for a request that
    reached it."""
    eng = make_engine(tiny)
    try:
        t = list(eng.generate([4, 5, 6], GREEDY))[-1].timings
        assert t.n == 8 and 0 < t.ttft_ms <= t.ttfn_ms <= t.e2e_ms
    finally:
        eng.stop()


# -- lagging: a request sampled on the host beside a batch that runs ahead ------------------------------------------
class RecordingDecoder(ReferenceDecoder):
    """The reference decoder, recording each step: its rows' slots and positions, its sampled rows, and whether its
    tokens came (some of them) from the device (chosen by the step before, launched before that one was read)."""

    def __init__(self, model, slots=4, ctx=256):
        super().__init__(model.config, model.weights, max_slots=slots, max_context=ctx)
        self.steps = []

    def decode(self, slots, token_ids, positions, draws=None, sampled_rows=None, masks=None):
        self.steps.append(Recorded(list(slots), list(positions), isinstance(token_ids, torch.Tensor),
                                   len(slots) if sampled_rows is None else sampled_rows))
        return super().decode(slots, token_ids, positions, draws, sampled_rows, masks)


@dataclass
class Recorded:
    slots: list
    positions: list
    from_device: bool
    sampled: int

    def positions_of(self, slot):
        return sorted(p for s, p in zip(self.slots, self.positions) if s == slot)


def recorded_engine(model, overlap, slots=4, max_batch=None, max_rows=None, prefill_rows=None):
    dec = RecordingDecoder(model, slots)
    eng = Engine(dec, model.tokenizer, eos_token_ids=(), sla_tokens=8, max_batch=max_batch, max_rows=max_rows,
                 prefill_rows=prefill_rows)
    eng.overlap = overlap
    return eng, dec


def run_jobs(model, overlap, jobs, **engine):
    """Each job's tokens (submit_all on a fresh recording engine, then stopped), and the decoder's record."""
    eng, dec = recorded_engine(model, overlap, **engine)
    try:
        return [[t for d in deltas for t in d.token_ids] for deltas in submit_all(eng, jobs)], dec
    finally:
        eng.stop()


def constrained_job(prompt=(5, 6), max_tokens=6):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=11, ignore_eos=True)
    return list(prompt), params, OnlyTokens({7, 42, 300, 301})


def test_a_constrained_request_lags_and_its_neighbour_keeps_running_ahead(tiny):
    """Beside a greedy request, a constrained one (its grammar needs each token on the host before the next choice)
    lags: the batch keeps running ahead (every step but the first fed, in part, from the device), the constrained
    request has a row every other step, each at the position after its last (nothing computed twice), and it gets
    exactly the tokens it gets alone, run step by step; the neighbour gets its tokens in as many steps as alone."""
    (alone,), _ = run_jobs(tiny, False, [constrained_job()])
    (greedy_alone,), solo = run_jobs(tiny, True, [([9, 9, 9], GREEDY, None)])
    got, dec = run_jobs(tiny, True, [constrained_job(), ([9, 9, 9], GREEDY, None)])
    assert got == [alone, greedy_alone]
    first = dec.steps[0]
    constrained_slot, greedy_slot = first.slots[0], first.slots[1]  # the sampled rows come first, in arrival order
    assert first.positions_of(constrained_slot) == [0, 1] and first.positions_of(greedy_slot) == [0, 1, 2]
    assert [s.from_device for s in dec.steps[1:]] == [True] * (len(dec.steps) - 1)
    rows = [s.positions_of(constrained_slot) for s in dec.steps if greedy_slot in s.slots]
    assert rows[1:10] == [[], [2], [], [3], [], [4], [], [5], []]  # every other step, each position once
    assert len([s for s in dec.steps if greedy_slot in s.slots]) == len(solo.steps)  # its cadence, unchanged


def test_a_batch_of_constrained_requests_runs_step_by_step(tiny):
    """Every row needing the host: nothing to run ahead of, so no row lags: every step is fed from the host, one
    token a step each (both prompts in the first), the same tokens as alone."""
    alone = [run_jobs(tiny, False, [constrained_job(p)])[0][0] for p in ((5, 6), (8, 1, 2))]
    got, dec = run_jobs(tiny, True, [constrained_job((5, 6)), constrained_job((8, 1, 2))])
    assert got == alone
    assert not any(s.from_device for s in dec.steps) and len(dec.steps) == 6
    assert [s.sampled for s in dec.steps] == [2] * 6


def test_a_seeded_request_is_sampled_on_the_device_and_neither_lags_nor_slows_the_batch(tiny):
    """A seeded top-k request (the reference decoder cannot draw it inside its step) is sampled from its own logits
    with its own generator on the device, so the batch runs ahead with it in: the same tokens as alone, one a step."""
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=99, ignore_eos=True)
    (alone,), _ = run_jobs(tiny, False, [([3, 1, 4], seeded, None)])
    got, dec = run_jobs(tiny, True, [([3, 1, 4], seeded, None), ([9, 9, 9], GREEDY, None)])
    assert got[0] == alone
    seeded_slot = dec.steps[0].slots[0]
    mine = [s for s in dec.steps if seeded_slot in s.slots]
    assert len(mine) == 10 and sum(not s.from_device for s in mine) == 1


@pytest.mark.parametrize("prefill_rows", [None, 64])
def test_a_prompt_rides_in_the_step_beside_running_decodes_chunked_by_the_token_budget(tiny, prefill_rows):
    """Mixed steps: a long prompt arriving while another request decodes is cut into chunks of the token budget and
    rides in the running request's steps (no step without its decode row), and both get the tokens they get alone;
    the wider budget of a step with no decode row (prefill_rows) changes none of that."""
    prompt = list(range(1, 40))
    running = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)  # still decoding when the prompt comes
    (alone_long,), _ = run_jobs(tiny, False, [(prompt, GREEDY, None)])
    (alone_short,), _ = run_jobs(tiny, False, [([9, 9, 9], running, None)])
    eng, dec = recorded_engine(tiny, overlap=True, max_rows=16, prefill_rows=prefill_rows)
    try:
        q1, q2 = queue.SimpleQueue(), queue.SimpleQueue()
        eng.submit([9, 9, 9], running, q1.put)
        eng.start()
        assert wait_until(lambda: len(dec.steps) >= 2)
        eng.submit(prompt, GREEDY, q2.put)
        short, long = [t for d in collect(q1) for t in d.token_ids], [t for d in collect(q2) for t in d.token_ids]
    finally:
        eng.stop()
    assert short == alone_short and long == alone_long
    short_slot = dec.steps[0].slots[0]
    long_slot = next(s for step in dec.steps for s in step.slots if s != short_slot)
    with_prompt = [s for s in dec.steps if len(s.positions_of(long_slot)) > 1]
    assert len(with_prompt) >= 3 and all(len(s.slots) <= 16 for s in dec.steps)
    assert sum(len(s.positions_of(long_slot)) for s in with_prompt) >= len(prompt) - 1
    assert all(short_slot in s.slots for s in with_prompt[:3])  # the running request decodes in each of them


def test_a_prompt_alone_is_prefilled_in_one_step_of_prefill_rows_with_the_tokens_of_chunks(tiny):
    """With nobody decoding, a 40-token prompt runs in one step of 40 rows (prefill_rows 64) where --max-rows 16
    chunks it over three, and its greedy tokens are the same; the next steps are its decode rows, one a step."""
    prompt = list(range(1, 41))
    (chunked,), by_chunks = run_jobs(tiny, True, [(prompt, GREEDY, None)], max_rows=16)
    (whole,), at_once = run_jobs(tiny, True, [(prompt, GREEDY, None)], max_rows=16, prefill_rows=64)
    assert whole == chunked
    assert [len(s.slots) for s in by_chunks.steps[:4]] == [16, 16, 8, 1]
    assert [len(s.slots) for s in at_once.steps[:2]] == [40, 1] and at_once.steps[0].sampled == 1
    assert len(at_once.steps) == len(by_chunks.steps) - 2


class BlockCountingDecoder(RecordingDecoder):
    """Counts the steps whose every row shares its slot with another row of the step, as the megakernel counts the
    steps it runs in its query blocks' launch (a prompt's rows alone in a step; its threshold at zero)."""

    def __init__(self, model, slots=4, ctx=256):
        super().__init__(model, slots, ctx)
        self.query_block_steps = 0

    def decode(self, slots, token_ids, positions, draws=None, sampled_rows=None, masks=None):
        self.query_block_steps += all(list(slots).count(s) > 1 for s in slots)
        return super().decode(slots, token_ids, positions, draws, sampled_rows, masks)


def test_the_decoders_query_block_steps_reach_metrics(tiny):
    """parley_query_block_steps_total follows the decoder's count: a 40-token prompt alone is one step of 40 rows of
    one slot (a block step), its decode rows are not; a second request's prompt beside it adds its own."""
    dec = BlockCountingDecoder(tiny)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=8, max_rows=16, prefill_rows=64)
    try:
        submit_all(eng, [(list(range(1, 41)), GREEDY, None)])  # (starts the engine)
        assert wait_until(lambda: eng.metrics.registry.get_sample_value("parley_query_block_steps_total") == 1)
        q = queue.SimpleQueue()
        eng.submit(list(range(2, 30)), GREEDY, q.put)
        collect(q)
        assert wait_until(lambda: eng.metrics.registry.get_sample_value("parley_query_block_steps_total") == 2)
        assert dec.query_block_steps == 2 and len(dec.steps) > 2
    finally:
        eng.stop()


class FeedingDecoder(RecordingDecoder):
    """A decoder that feeds (as the megakernel does): the engine hands it the fed rows and their sources (a Fed), not
    a device tensor of tokens; the reference gathers them itself. Records each Fed."""

    feeds = True

    def __init__(self, model, slots=4, ctx=256):
        super().__init__(model, slots, ctx)
        self.fed: list[Fed] = []

    def decode(self, slots, token_ids, positions, draws=None, sampled_rows=None, masks=None):
        if isinstance(token_ids, Fed):
            self.fed.append(token_ids)
        return super().decode(slots, token_ids, positions, draws, sampled_rows, masks)


def test_a_decoder_that_feeds_gets_the_rows_and_their_sources_and_the_same_tokens_come(tiny):
    """Running a step ahead, the engine hands a decoder that feeds each step's fed rows and the rows of the step
    before that they take (in order while the same requests decode; in an order of their own, beside prompt rows
    from the host, as requests end and join), and every request gets the tokens it gets from an engine that builds
    the tokens itself."""
    jobs = [([9, 9, 9], dataclasses.replace(GREEDY, max_tokens=n), None) for n in (5, 12, 20)]
    jobs.append((list(range(1, 30)), GREEDY, None))
    expected, _ = run_jobs(tiny, True, jobs, max_rows=16)
    dec = FeedingDecoder(tiny)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=8, max_rows=16)
    eng.overlap = True
    try:
        got = [[t for d in deltas for t in d.token_ids] for deltas in submit_all(eng, jobs)]
    finally:
        eng.stop()
    assert got == expected
    assert any(f.in_order() for f in dec.fed) and any(not f.in_order() for f in dec.fed)
    assert all(len(f.rows) == len(f.sources) and max(f.sources) < len(f.chosen) for f in dec.fed)


# -- decode rows and KV slots ----------------------------------------------------------------------------------------
def test_the_decode_batch_never_exceeds_max_batch_however_many_slots(tiny):
    eng, dec = recorded_engine(tiny, overlap=False, slots=4, max_batch=2)
    prompts = [[5, 6, 7], [100, 3], [42] * 9, [1, 2, 3, 4, 5, 6]]
    jobs = [(p, GREEDY, None) for p in prompts]
    try:
        together = [[t for d in deltas for t in d.token_ids] for deltas in submit_all(eng, jobs)]
        assert eng.stats.total_slots == 4 and eng.max_batch == 2
        assert wait_until(lambda: eng.stats.running == 0 and eng.stats.free_slots == 4)
        assert eng.stats.cached_slots == 4  # each conversation's K/V stays cached
    finally:
        eng.stop()
    assert max(s.sampled for s in dec.steps) == 2 and max(len(set(s.slots)) for s in dec.steps) == 2
    base = make_engine(tiny)
    try:
        assert together == [[t for d in base.generate(p, GREEDY) for t in d.token_ids] for p in prompts]
    finally:
        base.stop()


def test_truncate_keeps_only_the_tokens_heard(tiny):
    """After a barge-in, Engine.truncate cuts the session's cached tokens: the next turn reuses no more than that, and
    gets the tokens a cold engine gives."""
    eng = make_engine(tiny)
    try:
        sess = eng.new_session()
        turn1 = list(range(10, 30))
        q = queue.SimpleQueue()
        eng.submit(turn1, GREEDY, q.put, session=sess)
        reply = [t for d in collect(q) for t in d.token_ids]
        eng.truncate(sess, len(turn1) + 3)  # heard three tokens of the reply
        turn2 = turn1 + reply[:3] + [7, 7]
        q = queue.SimpleQueue()
        eng.submit(turn2, GREEDY, q.put, session=sess)
        d2 = collect(q)
        assert d2[-1].usage.cached_tokens == len(turn1) + 3
        eng.truncate(sess, 1000)  # holds fewer: a no-op
        eng.close_session(sess)
        eng.truncate(sess, 5)  # its slot is no longer its own: a no-op
    finally:
        eng.stop()
    cold = make_engine(tiny)
    try:
        assert [t for d in d2 for t in d.token_ids] == [t for d in cold.generate(turn2, GREEDY) for t in d.token_ids]
    finally:
        cold.stop()


# -- robustness ------------------------------------------------------------------------------------------------------
class BreaksOnce(AdmitAll):
    """Admission that raises the first time a step is handed to it (as a double missing a method would)."""

    def __init__(self):
        super().__init__(1.0)
        self.broken = False

    def consume(self, event):
        if not self.broken:
            self.broken = True
            raise AttributeError("consume")


def test_a_request_whose_iteration_fails_still_gets_its_final_delta(tiny):
    """An engine iteration that raises while a request's first step is being committed (its prompt ran, its token is
    not out) fails that request too: the client gets a final delta, nothing hangs, the engine goes on."""
    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    eng = Engine(dec, tiny.tokenizer, admission=BreaksOnce())
    eng.start()
    try:
        q = queue.SimpleQueue()
        eng.submit([1, 2, 3], GREEDY, q.put)
        deltas = collect(q, timeout=10)
        assert deltas[-1].finish_reason == "error" and deltas[-1].error == "internal engine error"
        assert list(eng.generate([1, 2, 3], GREEDY))[-1].finish_reason == "length"
        assert eng.healthy() and wait_until(lambda: eng.stats.free_slots == 2 and eng.stats.running == 0)
    finally:
        eng.stop()


def void_row_decoder(tiny, backend):
    if backend == "reference":
        return ReferenceDecoder(tiny.config, tiny.weights, max_slots=2, max_context=128)
    from kernels.megakernel import KernelConfig
    from service.backends.megakernel import MegakernelDecoder
    from service.model.synthetic import load_synthetic

    config, weights, _ = load_synthetic("smollm2-135m", device="cuda", dtype=torch.bfloat16, seed=0)
    return MegakernelDecoder(config, weights, max_slots=2, max_context=128,
                             kernel_config=KernelConfig(batch_invariant=True))


@pytest.mark.parametrize("backend", ["reference", pytest.param("megakernel", marks=pytest.mark.gpu)])
def test_a_void_rows_position_is_rewritten_by_the_next_real_row(tiny, backend):
    """What a lagging row relies on: a step that feeds a dummy token at a position, then one that feeds the real token
    there, leaves the same K/V and logits as a step that fed the real token alone (the decoder writes a row's K/V at
    its position before its attention reads it)."""
    dec = void_row_decoder(tiny, backend)
    prompt = list(range(1, 21))
    for slot in (0, 1):
        dec.prefill(slot, prompt)
    p = len(prompt)
    dec.decode([0], [7], [p])  # slot 0's void row: a dummy token at p
    out = dec.decode([0, 1], [11, 11], [p, p])  # the real token at p, in both slots
    cache = dec.cache if backend == "reference" else dec.reference.cache
    torch.testing.assert_close(out.logits[0], out.logits[1])
    torch.testing.assert_close(cache.k[:, 0, :, :p + 1], cache.k[:, 1, :, :p + 1])
    torch.testing.assert_close(cache.v[:, 0, :, :p + 1], cache.v[:, 1, :, :p + 1])


class RecordsSteps(AdmitAll):
    """Admission that keeps every StepDone a step commits."""

    def __init__(self):
        super().__init__(1.0)
        self.steps: list[StepDone] = []

    def consume(self, event):
        if isinstance(event, StepDone):
            self.steps.append(event)


def test_a_step_is_timed_with_the_host_work_before_it_but_a_prefill_launch_is_not(tiny):
    """A decode step's time is the cadence tokens come at: the host's work since the last step included (what admission
    must learn, capped at LEARN_CEILING). A step that launches a prefill is timed from its launch: that time teaches
    the prefill's prediction, which has no ceiling, and a stall before it would teach slow prefills for good."""
    stall_s = 0.15
    admission = RecordsSteps()
    dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=4, max_context=256)
    eng = Engine(dec, tiny.tokenizer, eos_token_ids=(), sla_tokens=8, admission=admission, launch_min_tokens=8)
    eng.overlap = False
    eng.start()
    try:
        stalls = {"left": 4}

        def slow_sink(delta):  # the engine thread stalls after each of this request's first tokens (a slow host)
            if stalls["left"] > 0 and delta.token_ids:
                stalls["left"] -= 1
                time.sleep(stall_s)

        eng.submit([5, 6, 7], dataclasses.replace(GREEDY, max_tokens=30), slow_sink)
        assert wait_until(lambda: stalls["left"] == 2)
        q: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        eng.submit(list(range(1, 60)), GREEDY, q.put)  # 58 new tokens: a separate prefill launch
        collect(q)
        assert wait_until(lambda: eng.stats.waiting == 0 and eng.stats.running == 0)
    finally:
        eng.stop()
    launching = [s for s in admission.steps if s.launched]
    decoding = [s for s in admission.steps if not s.launched]
    assert launching and all(s.seconds < stall_s for s in launching), [(s.launched, s.seconds) for s in launching]
    assert sum(s.seconds >= stall_s for s in decoding) >= 2, [s.seconds for s in decoding]  # the stalls, as cadence


def test_a_refused_request_leaves_no_reference_cycle_behind():
    """A refusal's exception, its traceback and the frames it passed through (where a verdict runs beside a step, the
    engine iteration's too, with its plan and its launched step's tensors) are freed as soon as the refusal is answered,
    not left in a cycle for the garbage collector: under realtime voice on the H200 those cycles made most of what each
    collection freed, and collections of 1-3 ms held steps up to 2x their prediction (bench/NOTES.md)."""
    from service.config import ServeConfig
    from service.runtime import build_engine

    eng = build_engine(ServeConfig(model="synthetic:tiny", backend="reference", device="cpu", max_batch=2,
                                   max_context=128, calibration_budget_s=1, sla_ms=1, strict_sla=True)).engine
    reasons: list[str] = []
    gc.collect()
    gc.disable()
    try:
        for i in range(5):
            try:
                # 64 tokens: ~64 steps to the SLA token, so far past a 1 ms SLA that an idle server never admits one
                # as a probe (4 tokens on a CPU whose tiny steps take 0.5 ms made 2.4 ms, within a probe's reach)
                eng.submit([1, 2, 3 + i], SamplingParams(max_tokens=64), lambda d: None)
            except Rejected as r:
                reasons.append(r.reason)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [o for o in gc.garbage if isinstance(o, (Rejected, types.FrameType, types.TracebackType, Request))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert reasons == ["sla_unmeetable"] * 5
    assert cyclic == []


def test_a_steps_deltas_are_sent_before_metrics_and_admission_hear_it(tiny, overlap):
    """The engine process sends a step's deltas from `on_published`: every token, the last one with its end included,
    leaves before the step's bookkeeping (the ended request's slot given back, the latency model, the guard, the
    headroom's forecast after an end), which on the H100 held a stream's last token back by 0.1-0.2 ms."""
    eng = make_overlap_engine(tiny, overlap, start=False)
    order: list[str] = []
    streamed: list[Delta] = []
    sent: list[list[Delta]] = []

    def sink(d: Delta) -> None:
        streamed.append(d)
        order.append("end streamed" if d.finish_reason else "token streamed")

    def published() -> None:
        sent.append(streamed[:])
        streamed.clear()
        order.append("sent")

    consume = eng.admission.consume

    def heard(ev) -> None:
        order.append(f"heard {type(ev).__name__}")
        consume(ev)

    finish = eng.planner.finish

    def released(req) -> None:
        order.append("slot back")
        finish(req)

    eng.on_published = published
    eng.admission.consume = heard  # type: ignore[method-assign]
    eng.planner.finish = released  # type: ignore[method-assign]
    eng.start()
    try:
        q: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        eng.submit([5, 6, 7], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                   lambda d: (sink(d), q.put(d)))
        deltas = collect(q)
        assert wait_until(lambda: "heard Finished" in order)
    finally:
        eng.stop()
    assert [d.token_ids for batch in sent for d in batch] == [d.token_ids for d in deltas]  # each sent, in order
    assert sum(len(d.token_ids) for d in deltas) == 5 and deltas[-1].finish_reason == "length"
    # each step: its deltas streamed, then sent, and only then its events heard (a token's, the end's, the step's)
    for i, what in enumerate(order):
        if what.startswith("heard"):
            last_streamed = max(j for j in range(i) if order[j].endswith("streamed"))
            assert "sent" in order[last_streamed:i], order
    # the end: sent before its slot goes back (the slot's cached prefix kept) and before it is heard
    end = order.index("end streamed")
    assert order[end + 1:end + 3] == ["sent", "slot back"] and "heard Finished" in order[end + 3:], order
    assert eng.planner.slots.num_free == eng.planner.slots.num_slots  # the slot is free again
