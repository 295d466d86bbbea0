"""The prefix cache and the KV slots' placement policy, on token lists alone: which slot a prompt goes to, how much of
it comes from the cache, what is copied, what is evicted, sessions' pins, and the cost of a lookup."""

import random
import statistics
import time

from service.engine.kv_slots import COPY_MIN_TOKENS, KVSlots, Placement, Session
from service.engine.prefix_cache import BLOCK_TOKENS, PrefixCache, block_hashes


def tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0  # every reading later than the last: least recently used is well defined
        return self.now


def slots(n=4):
    return KVSlots(n, clock=Clock())


def run(kv, prompt, session=None, output=()):
    """A request through the slots as the engine runs it: placed, prefilled, ended with `output` fed back (all but
    its last token); its placement."""
    p = kv.place(prompt, block_hashes(prompt), session)
    assert p is not None
    kv.filled(p.slot, prompt, block_hashes(prompt))
    kv.release(p.slot, prompt + list(output)[:-1], session)
    return p


def test_the_longest_shared_prefix_is_found_to_the_token():
    cache = PrefixCache(3)
    a, b = tokens(100, 1), tokens(100, 2)
    cache.set(0, a, 0)
    cache.set(1, a[:37] + b[37:], 0)  # diverges from a inside the third block
    cache.set(2, b, 0)
    prompt = a[:70] + [7] * 10
    assert cache.matches(prompt, block_hashes(prompt)) == {0: 70}  # the deepest shared block is a's alone
    assert cache.common_prefix(1, prompt, block_hashes(prompt)) == 37
    assert cache.common_prefix(2, prompt, block_hashes(prompt)) == 0
    short = a[:BLOCK_TOKENS - 1]
    assert cache.matches(short, block_hashes(short)) == {}  # less than a block: nothing to find by hash
    cache.truncate(0, 20)
    assert cache.tokens(0) == a[:20] and cache.matches(prompt, block_hashes(prompt)) == {1: 37}
    assert cache.common_prefix(0, prompt, block_hashes(prompt)) == 20
    cache.copy(1, 0, 30)
    assert cache.tokens(0) == a[:30] and cache.common_prefix(0, prompt, block_hashes(prompt)) == 30


def test_a_hash_collision_never_serves_another_conversations_kv():
    """A slot indexed under a prompt's block hashes that holds other tokens (what a crafted collision would do) is
    never taken to hold that prompt: the chosen match is confirmed token by token."""
    kv = slots(2)
    prompt, other = tokens(64, 1), tokens(64, 2)
    kv.cache.set(0, other, 0, blocks=block_hashes(prompt))  # indexed as if it held `prompt`
    assert kv.cache.matches(prompt, block_hashes(prompt)) == {0: 64}  # the hashes alone say so...
    assert kv.expected_cached(prompt, block_hashes(prompt), None) == 0  # ...the tokens do not
    p = kv.place(prompt, block_hashes(prompt), None)
    assert p.cached == 0 and p.source is None


def test_an_idle_slot_that_the_prompt_extends_is_taken_over():
    kv = slots()
    first = tokens(40, 1)
    p1 = run(kv, first, output=tokens(8, 2))
    held = kv.cache.tokens(p1.slot)
    assert len(held) == 40 + 7  # the prompt and the reply but its last token (never fed)
    p2 = kv.place(held + [5, 6], block_hashes(held + [5, 6]), None)
    assert p2 == Placement(p1.slot, len(held))
    assert kv.num_free == 3


def test_a_branch_is_copied_so_that_the_original_survives():
    """A prompt that diverges from an idle slot's tokens (an edited history, another branch) reuses the shared prefix
    through a copy into a free slot; the original keeps all it held."""
    kv = slots()
    base = tokens(60, 1)
    p1 = run(kv, base, output=tokens(5, 2))
    held = list(kv.cache.tokens(p1.slot))
    branch = base[:50] + tokens(20, 3)
    p2 = kv.place(branch, block_hashes(branch), None)
    assert p2.source == p1.slot and p2.cached == 50 and p2.slot != p1.slot
    assert kv.cache.tokens(p1.slot) == held and kv.cache.tokens(p2.slot) == base[:50]


def test_a_prefix_held_by_a_running_request_is_copied():
    kv = slots()
    system = tokens(48, 1)
    busy = kv.place(system + [1, 2, 3], block_hashes(system + [1, 2, 3]), None)
    kv.filled(busy.slot, system + [1, 2, 3], [])
    second = system + [9, 9]
    p = kv.place(second, block_hashes(second), None)
    assert p.source == busy.slot and p.cached == 48 and p.slot != busy.slot


def test_a_short_shared_prefix_is_prefilled_not_copied():
    kv = slots()
    a = tokens(40, 1)
    run(kv, a, output=[1, 2])
    prompt = a[:COPY_MIN_TOKENS - 1] + tokens(30, 2)
    p = kv.place(prompt, block_hashes(prompt), None)
    assert p.cached == 0 and p.source is None


def test_at_least_one_prompt_token_is_prefilled():
    kv = slots()
    prompt = tokens(40, 1)
    p1 = run(kv, prompt, output=[7])  # the slot holds exactly the prompt
    p2 = kv.place(prompt, block_hashes(prompt), None)
    assert p2 == Placement(p1.slot, 39)


def test_eviction_takes_empty_slots_then_the_least_recently_used_unpinned_then_pinned():
    kv = slots(3)
    session = Session()
    pinned = run(kv, tokens(20, 1), session=session, output=[1, 2])
    old = run(kv, tokens(20, 2), output=[1, 2])
    new = run(kv, tokens(20, 3), output=[1, 2])
    assert {pinned.slot, old.slot, new.slot} == {0, 1, 2} and kv.num_cached == 3
    fresh = run(kv, tokens(20, 4), output=[1, 2])
    assert fresh.slot == old.slot and session.slot == pinned.slot  # the oldest unpinned idle slot
    run(kv, tokens(20, 5), output=[1, 2])  # new's slot, now the oldest unpinned
    assert session.slot == pinned.slot
    for slot in (0, 1, 2):  # every slot busy but the pinned one
        if slot != pinned.slot:
            kv.place(kv.cache.tokens(slot) + [3], block_hashes(kv.cache.tokens(slot) + [3]), None)
    last = kv.place(tokens(20, 6), block_hashes(tokens(20, 6)), None)
    assert last.slot == pinned.slot and session.slot is None  # evicted at last: the session starts cold
    assert kv.place(tokens(20, 7), block_hashes(tokens(20, 7)), None) is None  # all busy
    assert kv.expected_cached(tokens(20, 7), block_hashes(tokens(20, 7)), None) == 0


def test_counts_follow_every_change_of_the_slots():
    kv = slots(3)
    assert kv.counts() == (3, 0)
    session = Session()
    p = kv.place(tokens(20, 1), block_hashes(tokens(20, 1)), session)
    assert kv.counts() == (2, 0) == (kv.num_free, kv.num_cached)
    kv.release(p.slot, tokens(20, 1), session)
    assert kv.counts() == (3, 1)
    kv.truncate(session, 0)
    assert kv.counts() == (3, 0) == (kv.num_free, kv.num_cached)


def test_a_session_keeps_its_slot_truncates_it_and_leaves_it_cached_when_closed():
    kv = slots()
    session = Session()
    turn1 = tokens(30, 1)
    p1 = run(kv, turn1, session=session, output=tokens(10, 2))
    held = list(kv.cache.tokens(p1.slot))
    assert session.slot == p1.slot and not session.busy
    # its next turn goes to its own slot, even one that diverges (a preemptive start the kept turn replaces)
    turn2 = held[:35] + tokens(10, 3)
    p2 = kv.place(turn2, block_hashes(turn2), session)
    assert p2 == Placement(p1.slot, 35) and session.busy
    kv.filled(p2.slot, turn2, block_hashes(turn2))
    kv.release(p2.slot, turn2 + [4], session)
    # a barge-in: the caller heard less
    kv.truncate(session, 32)
    assert kv.cache.tokens(p1.slot) == turn2[:32]
    kv.truncate(session, 100)  # holds fewer: nothing changes
    assert kv.cache.tokens(p1.slot) == turn2[:32]
    kv.close(session)
    assert session.slot is None and kv.num_cached == 1
    # a stranger whose prompt extends the closed conversation takes its slot over
    stranger = turn2[:32] + [1, 2]
    assert kv.place(stranger, block_hashes(stranger), None) == Placement(p1.slot, 32)


def test_a_truncation_while_the_cancelled_turn_still_holds_the_slot_applies_when_it_ends():
    """A barge-in's response.done goes out as soon as it is cancelled, before the engine has released the turn's slot:
    a truncation then waits for the release, and the tokens the engine fed after the cancel go with it."""
    kv = slots()
    session = Session()
    turn = tokens(30, 1)
    p = kv.place(turn, block_hashes(turn), session)
    kv.filled(p.slot, turn, block_hashes(turn))
    kv.truncate(session, 34)  # the caller heard 4 of the reply's tokens; the turn still runs
    kv.truncate(session, 36)  # a later one keeping more keeps no more than the first
    assert session.busy and kv.cache.tokens(p.slot) == turn
    kv.release(p.slot, turn + tokens(9, 2), session)
    assert kv.cache.tokens(p.slot) == (turn + tokens(9, 2))[:34] and session.keep_tokens is None and not session.busy


def test_a_pinned_slot_is_copied_from_not_taken_over_by_others():
    kv = slots()
    session = Session()
    p1 = run(kv, tokens(40, 1), session=session, output=tokens(4, 2))
    held = kv.cache.tokens(p1.slot)
    other = held + [1, 2, 3]  # extends the session's conversation: an HTTP client resending it
    p2 = kv.place(other, block_hashes(other), None)
    assert p2.source == p1.slot and p2.slot != p1.slot and p2.cached == len(held)
    assert session.slot == p1.slot


def test_a_lookup_costs_well_under_a_millisecond():
    """64 cached conversations of 4,000 tokens sharing a 1,500-token system prompt; a 4,000-token prompt that shares
    the system prompt with all of them (the most candidates to compare) or extends one of them."""
    system = tokens(1500, 0)
    kv = KVSlots(64)
    for s in range(64):
        conversation = system + tokens(2500, s + 1)
        kv.place(conversation, block_hashes(conversation), None)
        kv.filled(s, conversation, block_hashes(conversation))
        kv.release(s, conversation, None)
    shares_system = system + tokens(2500, 1000)
    extends_one = kv.cache.tokens(17)[:3990] + tokens(10, 1001)

    def lookup(prompt):
        t0 = time.perf_counter()
        cached = kv.expected_cached(prompt, block_hashes(prompt), None)
        return time.perf_counter() - t0, cached

    for prompt, cached in ((shares_system, 1500), (extends_one, 3990)):
        times = []
        for _ in range(30):
            seconds, got = lookup(prompt)
            assert got == cached
            times.append(seconds)
        print(f"\nlookup of {len(prompt)} tokens over 64 slots: median {statistics.median(times) * 1e6:.0f} µs")
        assert statistics.median(times) < 1e-3


def test_what_a_prompt_expects_cached_is_what_its_placement_finds():
    """Admission judges a request by expected_cached (which looks up the prefix without choosing a slot); place() then
    chooses one. In every state a busy server's slots go through (shared system prompts, sessions, busy, idle, pinned,
    all but one busy, all busy), the two agree on the cached tokens whenever place() finds a slot."""
    rng = random.Random(37)
    systems = [tokens(n, 500 + n) for n in (0, 16, 40, 70)]  # shorter and longer than COPY_MIN_TOKENS
    checked = {"copies": 0, "takes over": 0, "fresh": 0, "the last idle slot, less than a copy's worth": 0}
    for case in range(400):
        kv = KVSlots(rng.randint(1, 4), clock=Clock())
        sessions = [Session() for _ in range(2)]
        held = []
        for _ in range(rng.randint(0, 12)):
            prompt = rng.choice(systems) + tokens(rng.randint(1, 40), rng.randrange(10**6))
            if rng.random() < 0.2:  # one block exactly, which others extend: its last token is prefilled, so it
                prompt = systems[1]  # shares one token less than a block (less than a copy's worth)
            session = rng.choice([None, None, *sessions])
            if session is not None and session.busy:
                session = None
            want = kv.expected_cached(prompt, block_hashes(prompt), session)
            p = kv.place(prompt, block_hashes(prompt), session)
            if p is None:
                assert want == 0 or all(kv._state[s].busy for s in range(len(kv._state))), case
                continue
            assert p.cached == want, case
            checked["copies" if p.source is not None else "takes over" if p.cached else "fresh"] += 1
            others_busy = all(st.busy for s, st in enumerate(kv._state) if s != p.slot)
            checked["the last idle slot, less than a copy's worth"] += others_busy and 0 < p.cached < COPY_MIN_TOKENS
            kv.filled(p.slot, prompt, block_hashes(prompt))
            held.append((p.slot, prompt, session))
            if rng.random() < 0.6:  # some end (their slots idle, keeping their K/V), some stay busy
                slot, fed, s = held.pop(rng.randrange(len(held)))
                kv.release(slot, fed + tokens(rng.randint(0, 8), case), s)
    assert min(checked.values()) > 10, checked
