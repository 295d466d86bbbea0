"""Scheduler: continuous batching over the decoder's KV slots.

Requests join between steps (waiting → running once a decode row and a KV slot are free and they are prefilled) and
leave between steps (finished or cancelled → their slot goes idle, its K/V cached for later requests). At most
`max_batch` requests run (decode) together; the KV slots (kv_slots.KVSlots) may be more: cached conversations.
Only the engine thread touches it.
"""

from __future__ import annotations

from collections import deque

from service.engine.kv_slots import KVSlots, Placement, Session
from service.engine.request import Request, State


class Scheduler:
    def __init__(self, slots: KVSlots, max_batch: int) -> None:
        self.slots = slots
        self.max_batch = max_batch
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

    def next_to_prefill(self) -> tuple[Request, Placement] | None:
        """The oldest waiting request whose session is not mid-turn, placed in a slot (the prompt tokens found there
        are its cached_tokens); None if none can start now."""
        if len(self.running) >= self.max_batch:
            return None
        for req in self.waiting:
            session: Session | None = req.session  # type: ignore[assignment]
            if session is not None and session.busy:
                continue
            placement = self.slots.place(req.prompt_ids, req.prompt_blocks, session)
            if placement is None:
                return None
            self.waiting.remove(req)
            req.slot, req.state, req.cached_tokens = placement.slot, State.RUNNING, placement.cached
            return req, placement
        return None

    def start(self, req: Request) -> None:
        """`req` has been prefilled: it decodes from the next step, and its slot holds its prompt."""
        assert req.slot is not None
        self.slots.filled(req.slot, req.prompt_ids, req.prompt_blocks)
        self.running.append(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.release(req)

    def release(self, req: Request) -> None:
        req.state = State.FINISHED
        if req.slot is not None:  # the tokens fed: the last one generated never is
            fed = (req.prompt_ids + req.output_ids)[: req.kv_len]
            self.slots.release(req.slot, fed, req.session)  # type: ignore[arg-type]
            req.slot = None
