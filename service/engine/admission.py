"""What the engine asks of admission control (service/admission.py implements it): a verdict on each new request, and
the events each step commits, to learn from. AdmitAll admits everything (tests, warm-up)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from service.engine.request import Request

if TYPE_CHECKING:
    from service.engine.commit import Event
    from service.engine.planner import Planner


class Rejected(Exception):
    """Not admitted: answer at once, without spending a prefill."""

    def __init__(self, reason: str, message: str, retry_after_s: float = 1.0, status: int = 429) -> None:
        super().__init__(message)
        self.reason, self.message, self.retry_after_s, self.status = reason, message, retry_after_s, status


class Admission(Protocol):
    def bind(self, planner: Planner) -> None:
        """The engine's planner: admission asks it what would happen if a request joined."""
        ...

    def check(self, req: Request) -> None:
        """Admit `req`, setting its deadline, or raise Rejected. Its cached_tokens are those the prefix cache holds
        for it now; its choice says whether it lags (a grammar)."""
        ...

    def moment(self, req: Request) -> object:
        """What a verdict on `req` judges from, taken now (the requests admitted, their states and `req`'s, the steps
        launched), for a verdict run later as if now: the engine launches an idle server's prompt step first and
        judges it beside the step (Engine.launch_first)."""
        ...

    def verdict(self, req: Request, moment: object = None) -> Iterator[None]:
        """check() in parts, each run by next() (a part may wait between them: the engine process runs each beside a
        GPU step where it fits); the end admits, Rejected refuses. `moment`: one taken by moment(), judged from."""
        ...

    def consume(self, event: Event) -> None:
        """What a step committed (service/engine/commit.py): steps to learn from, SLA tokens, ends."""
        ...

    def headroom(self, now: float) -> float:
        """The smallest predicted slack to its deadline among admitted requests, in seconds."""
        ...


class AdmitAll:
    """Admit everything, each with the SLA deadline; learn nothing."""

    def __init__(self, sla_s: float) -> None:
        self.sla_s = sla_s

    def bind(self, planner: Planner) -> None: ...

    def check(self, req: Request) -> None:
        req.deadline = req.arrival + self.sla_s

    def moment(self, req: Request) -> object:
        return None

    def verdict(self, req: Request, moment: object = None) -> Iterator[None]:
        """One part: check()."""
        self.check(req)
        yield from ()

    def consume(self, event: Event) -> None: ...

    def headroom(self, now: float) -> float:
        return self.sla_s
