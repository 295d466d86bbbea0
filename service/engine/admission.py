"""What the engine asks of admission control (service/admission.py implements it): a verdict on each new request,
and what the engine observes as it runs, to learn from. AdmitAll admits everything (tests, warm-up)."""

from __future__ import annotations

from typing import Protocol

from service.engine.request import Request


class Rejected(Exception):
    """Not admitted: answer at once, without spending a prefill."""

    def __init__(self, reason: str, message: str, retry_after_s: float = 1.0, status: int = 429) -> None:
        super().__init__(message)
        self.reason, self.message, self.retry_after_s, self.status = reason, message, retry_after_s, status


class Admission(Protocol):
    def check(self, req: Request) -> None:
        """Admit `req`, setting its deadline, or raise Rejected. Its cached_tokens are those the prefix cache holds
        for it now; `lags`: it would get a token every other step beside requests chosen on the device."""
        ...

    def release(self, req: Request) -> None:
        """`req` has ended (any way)."""
        ...

    def headroom(self, now: float) -> float:
        """The smallest predicted slack to its deadline among admitted requests, in seconds."""
        ...

    def observe_step(self, batch: int, seconds: float) -> None: ...

    def observe_prefill(self, tokens: int, cached: int, seconds: float) -> None:
        """A prefill of `tokens` new tokens on top of `cached` ones took `seconds`."""
        ...

    def observe_nth(self, req: Request, at: float) -> None:
        """`req`'s SLA token came out at `at` (time.perf_counter)."""
        ...


class AdmitAll:
    """Admit everything, each with the SLA deadline; learn nothing."""

    def __init__(self, sla_s: float) -> None:
        self.sla_s = sla_s

    def check(self, req: Request) -> None:
        req.deadline = req.arrival + self.sla_s

    def release(self, req: Request) -> None: ...

    def headroom(self, now: float) -> float:
        return self.sla_s

    def observe_step(self, batch: int, seconds: float) -> None: ...

    def observe_prefill(self, tokens: int, cached: int, seconds: float) -> None: ...

    def observe_nth(self, req: Request, at: float) -> None: ...
