"""KV slots: who holds which of the decoder's B cache slots.

A request holds a slot from prefill to its end. A session (a multi-turn WebSocket conversation) keeps its slot
between turns, so that the next turn prefills only what it adds; an idle session's slot is taken back (least
recently used first) when a request finds no free one, and that session then prefills from scratch.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

_ids = itertools.count()


@dataclass(eq=False)
class Session:
    id: str = field(default_factory=lambda: f"sess-{next(_ids)}")
    slot: int | None = None
    cached_ids: list[int] = field(default_factory=list)  # the tokens whose K/V sit in `slot`, in order
    busy: bool = False  # a turn is running
    closed: bool = False
    last_used: float = field(default_factory=time.monotonic)


class SlotManager:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._idle_sessions: dict[int, Session] = {}  # slot → idle session holding it

    @property
    def num_free(self) -> int:
        """Slots a new request can have now (idle sessions' slots can be taken back)."""
        return len(self._free) + len(self._idle_sessions)

    def acquire(self, session: Session | None) -> int | None:
        """A slot for a request; its session's own slot if it still has one. None if all are busy."""
        if session is not None and session.slot is not None:
            self._idle_sessions.pop(session.slot, None)
            return session.slot
        if self._free:
            slot = self._free.pop()
        elif self._idle_sessions:
            victim = min(self._idle_sessions.values(), key=lambda s: s.last_used)
            slot = victim.slot
            del self._idle_sessions[slot]
            victim.slot, victim.cached_ids = None, []
        else:
            return None
        if session is not None:
            session.slot, session.cached_ids = slot, []
        return slot

    def release(self, slot: int, session: Session | None, cached_ids: list[int]) -> None:
        """A request ended. Its session keeps the slot (and what it caches) unless the session is closed."""
        if session is not None and not session.closed:
            session.cached_ids = cached_ids
            session.last_used = time.monotonic()
            self._idle_sessions[slot] = session
            return
        if session is not None:
            session.slot, session.cached_ids = None, []
        self._free.append(slot)

    def close_session(self, session: Session) -> None:
        session.closed = True
        if session.slot is not None and self._idle_sessions.pop(session.slot, None) is session:
            self._free.append(session.slot)
            session.slot, session.cached_ids = None, []
