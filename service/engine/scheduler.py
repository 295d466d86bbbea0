"""Scheduler: continuous batching over the decoder's KV slots.

Requests join between steps (waiting → running once a slot is free and they are prefilled) and leave between
steps (finished or cancelled → their slot is free for the next step). Only the engine thread touches it.
"""

from __future__ import annotations

from collections import deque

from service.engine.kv_slots import Session, SlotManager
from service.engine.request import Request, State


class Scheduler:
    def __init__(self, num_slots: int) -> None:
        self.slots = SlotManager(num_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def take_cancelled(self) -> list[Request]:
        """Cancelled requests, out of both queues; a running one's slot is free from now on."""
        gone = [r for r in self.waiting if r.cancelled] + [r for r in self.running if r.cancelled]
        if gone:
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
            self.running = [r for r in self.running if not r.cancelled]
            for r in gone:
                self.release(r)
        return gone

    def next_to_prefill(self) -> Request | None:
        """The oldest waiting request whose session is not mid-turn, given a slot; None if none can start."""
        for req in self.waiting:
            session: Session | None = req.session  # type: ignore[assignment]
            if session is not None and session.busy:
                continue
            slot = self.slots.acquire(session)
            if slot is None:
                return None
            self.waiting.remove(req)
            req.slot, req.state = slot, State.RUNNING
            if session is not None:
                session.busy = True
                req.cached_tokens = _reusable_prefix(session.cached_ids, req.prompt_ids)
            return req
        return None

    def start(self, req: Request) -> None:
        self.running.append(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.release(req)

    def release(self, req: Request) -> None:
        req.state = State.FINISHED
        session: Session | None = req.session  # type: ignore[assignment]
        if session is not None:
            session.busy = False
        if req.slot is not None:
            cached = (req.prompt_ids + req.output_ids)[: req.kv_len]
            self.slots.release(req.slot, session, cached)
            req.slot = None


def _reusable_prefix(cached: list[int], prompt: list[int]) -> int:
    """How many leading prompt tokens already sit in the cache; at least one is always prefilled anew,
    since its logits give the first output token."""
    n = 0
    for a, b in zip(cached, prompt):
        if a != b:
            break
        n += 1
    return min(n, len(prompt) - 1)
