"""KV slots: which of the decoder's slots a request runs in, and what each slot keeps cached between requests.

Every slot holds the K/V of some tokens (prefix_cache.PrefixCache says which). A request holds its slot from its
prefill to its end; then the slot keeps the K/V of the request's prompt and reply (every token that was fed) and goes
idle, so that a later request whose prompt begins with those tokens prefills only what follows: an HTTP client
resending the whole conversation, a realtime turn, a second caller with the same system prompt. A realtime Session
pins the slot of its last turn: its next turn goes there, and a pinned slot is evicted only after every unpinned
idle one; after a barge-in its cached tokens are cut to what the caller heard (truncate), and once it is closed its
slot is unpinned and stays cached like any other. The same mechanism serves every path; the pin is all a session
adds.

Where a request goes (KVSlots.place):
- a session's request: its pinned slot, keeping the prefix they share (or the longer one of another slot, copied in);
- an idle unpinned slot whose every cached token begins the prompt: taken over, nothing is lost;
- where the longest shared prefix sits in a slot that must survive (busy with a running request, pinned by another
  session, or holding tokens past the divergence: another branch of a conversation, an edited history), that prefix
  is copied into another slot: a free one, else the least recently used idle one. Below COPY_MIN_TOKENS a copy is
  not worth it: those tokens are prefilled instead;
- otherwise a free slot, else the least recently used idle one (unpinned ones first) is evicted.
At least one prompt token is always prefilled: its logits give the first output token.

The engine thread places, fills and releases; admission (any thread) asks what a prompt would reuse. One lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.engine.prefix_cache import BLOCK_TOKENS, PrefixCache

COPY_MIN_TOKENS = BLOCK_TOKENS  # a shorter shared prefix is prefilled, not copied

_ids = itertools.count()


@dataclass(eq=False)
class Session:
    """A multi-turn conversation (a realtime WebSocket): its turns run one at a time, in the slot it pins."""

    id: str = field(default_factory=lambda: f"sess-{next(_ids)}")
    slot: int | None = None  # the slot it pins (its last turn's), until evicted
    busy: bool = False  # a turn is running
    closed: bool = False
    keep_tokens: int | None = None  # a truncation asked while its last turn still held the slot: applied on release


@dataclass(frozen=True)
class Placement:
    """Where a request runs: `slot`, whose first `cached` tokens are the prompt's once `source` (if any) has been
    copied into it."""

    slot: int | None  # None (only in a plan): every slot is busy now
    cached: int
    source: int | None = None  # copy the K/V of the first `cached` tokens from this slot first


@dataclass
class _SlotState:
    busy: bool = False  # held by a running request
    pin: Session | None = None
    last_used: float = 0.0


class KVSlots:
    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.num_slots = num_slots
        self.cache = PrefixCache(num_slots)
        self._state = [_SlotState() for _ in range(num_slots)]
        self._clock = clock
        self._lock = threading.Lock()
        # counts() as of the last change: the engine exports them every iteration, and scanning every slot there cost
        # ~25 µs an iteration with 64 slots, while slots change only as requests start, fill and end
        self._changes = 0
        self._counted: tuple[int, int, int] | None = None  # (changes, free, cached)

    @property
    def num_free(self) -> int:
        """Slots no running request holds: a new request can have any of them now (a cached one is evicted)."""
        return sum(not st.busy for st in self._state)

    @property
    def num_cached(self) -> int:
        """Idle slots holding cached K/V."""
        return sum(not st.busy and bool(self.cache.tokens(s)) for s, st in enumerate(self._state))

    def counts(self) -> tuple[int, int]:
        """(num_free, num_cached), counted again only after a change through this class."""
        with self._lock:
            counted = self._counted
            if counted is None or counted[0] != self._changes:
                counted = self._counted = (self._changes, self.num_free, self.num_cached)
            return counted[1], counted[2]

    # -- placing a request --------------------------------------------------------------------------------
    def expected_cached(self, prompt: list[int], blocks: list[int], session: Session | None) -> int:
        """The prompt tokens a request would find cached if it were placed now (what admission predicts with)."""
        with self._lock:
            return self._plan(prompt, blocks, session, choose=False).cached

    def place(self, prompt: list[int], blocks: list[int], session: Session | None) -> Placement | None:
        """A slot for a request with this prompt (`blocks`: its block_hashes), now held by it; None when every slot is
        busy. The caller copies `source`'s K/V into it, if any, before prefilling."""
        with self._lock:
            p = self._plan(prompt, blocks, session)
            if p.slot is None:
                return None
            self._changes += 1
            now = self._clock()
            st = self._state[p.slot]
            if st.pin is not None and st.pin is not session:  # evicted from its session
                st.pin.slot = None
            if p.source is not None:
                self.cache.copy(p.source, p.slot, p.cached)
                self._state[p.source].last_used = now  # a prefix that others copy stays
            else:
                self.cache.truncate(p.slot, p.cached)
            st.busy, st.pin, st.last_used = True, session, now
            if session is not None:
                session.slot, session.busy = p.slot, True
            return p

    def filled(self, slot: int, prompt: list[int], blocks: list[int]) -> None:
        """The request in `slot` has been prefilled: the slot holds its whole prompt."""
        with self._lock:
            self._changes += 1
            self.cache.set(slot, prompt, len(self.cache.tokens(slot)), blocks)

    def release(self, slot: int, tokens: list[int], session: Session | None) -> None:
        """The request in `slot` ended; the slot keeps the K/V of `tokens` (those it fed) for later requests."""
        with self._lock:
            self._changes += 1
            held = self.cache.tokens(slot)
            self.cache.set(slot, tokens, len(held) if tokens[: len(held)] == held else 0)
            st = self._state[slot]
            st.busy, st.last_used = False, self._clock()
            if session is not None:
                if session.keep_tokens is not None:
                    self.cache.truncate(slot, session.keep_tokens)
                    session.keep_tokens = None
                session.busy = False
                if session.closed:
                    st.pin, session.slot = None, None

    # -- sessions -----------------------------------------------------------------------------------------
    def truncate(self, session: Session, keep_tokens: int) -> None:
        """The session's cached tokens keep only their first `keep_tokens` (a no-op where its slot was evicted or
        holds fewer). Between turns: the API truncates after a response has ended, which a cancelled one does before
        the engine has released its slot (its response.done goes out at once): then when it does."""
        with self._lock:
            self._changes += 1
            if session.slot is None:
                return
            if self._state[session.slot].busy:
                held = session.keep_tokens
                session.keep_tokens = keep_tokens if held is None else min(held, keep_tokens)
            else:
                self.cache.truncate(session.slot, keep_tokens)

    def close(self, session: Session) -> None:
        """The conversation is over: its slot is no longer pinned, and stays cached like any other."""
        with self._lock:
            self._changes += 1
            session.closed = True
            if session.slot is not None and not self._state[session.slot].busy:
                self._state[session.slot].pin, session.slot = None, None

    # -- the policy ---------------------------------------------------------------------------------------
    def _plan(self, prompt: list[int], blocks: list[int], session: Session | None, choose: bool = True) -> Placement:
        """Where the request would run. `choose`: False where only `cached` is asked (expected_cached): which slot a
        fresh prompt's would be changes nothing of it, and choosing one among 64 took ~30 us of each request's first
        half on a CPU (on a GPU host, beside a step)."""
        own = session.slot if session is not None else None
        held = self.cache.matches(prompt, blocks)  # slot → the prompt's leading tokens it holds, by their hashes
        if own is not None:
            held[own] = self.cache.common_prefix(own, prompt, blocks)
        while True:  # the slot chosen is confirmed token by token: a hash collision never serves another's K/V
            shared = {s: min(n, len(prompt) - 1) for s, n in held.items()}  # the last prompt token is prefilled
            best = max(shared, default=None, key=lambda s: (shared[s], s == own, self._takes_over(s, held[s]),
                                                            not self._state[s].busy, self._state[s].last_used))
            if best is None or self.cache.holds(best, prompt, held[best]):
                break
            held[best] = self.cache.common_prefix(best, prompt, blocks)
        n = 0 if best is None else shared[best]
        if own is not None:
            if best != own and n >= shared[own] + COPY_MIN_TOKENS:
                return Placement(own, n, source=best)
            return Placement(own, shared[own])
        if best is not None and self._takes_over(best, held[best]):
            return Placement(best, n)
        copied = n if n >= COPY_MIN_TOKENS else 0
        if not choose:  # with a spare slot it copies what it shares (if enough to), without one it takes `best`'s
            spare = any(not st.busy for s, st in enumerate(self._state) if s != best)
            return Placement(None, n if not spare and best is not None and not self._state[best].busy else copied)
        dst = self._victim(avoid=best)
        if dst is None:  # every other slot is busy
            if best is not None and not self._state[best].busy:
                return Placement(best, n)  # the only slot left: it loses what follows the shared prefix
            return Placement(None, copied)  # none now; once one frees, it will copy the prefix in
        return Placement(dst, copied, source=best if copied else None)

    def _takes_over(self, slot: int, held: int) -> bool:
        """Whether a request can run in this slot as it is: idle, unpinned, and all it holds begins the prompt."""
        st = self._state[slot]
        return not st.busy and st.pin is None and held == len(self.cache.tokens(slot))

    def _victim(self, avoid: int | None) -> int | None:
        """A slot to give a request: an empty one, else the least recently used idle one, unpinned ones first."""
        idle = [s for s, st in enumerate(self._state) if not st.busy and s != avoid]
        return min(idle, default=None, key=lambda s: (bool(self.cache.tokens(s)), self._state[s].pin is not None,
                                                      self._state[s].last_used))
