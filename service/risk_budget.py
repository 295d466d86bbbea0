"""RiskBudget: the chance of coming late that admission has promised, request by request, so that a verdict may
admit a request whose forecast is inside its deadline but not by the guard's whole stretch while, on average,
admitted requests still come on time as often as the target says.

The guard's stretch (service/admission_guard.py) judges every request as if it were the marginal one: each admitted
request is on time with probability at least the target. Most are not marginal. In `bench voice` on the H200
(s75: realtime at 4 and 8 sessions/s) one moment in which three requests of one level ran 1.2-1.28x their forecast
set that level's stretch for the minute after: the requests it refused then were forecast inside their deadline by
1.16x, a margin the level's scores exceeded for ~1% of requests; admission let in 62% and 45% of the turns that the
server with admission off served 96% and 71% of on time, with 5 of 1,405 admitted requests late (0.36%).

So every admitted request carries its risk: the share of its level's scores above the factor its forecast could
stretch by and still meet its deadline (the guard's miss_risk), as judged at its latest verdict. The budget keeps
the risks of the requests in flight and of the last `size` that reached their SLA token. A verdict may judge at the
guard's loose stretch (its quantile at 1 - cap: a request promised at most `cap` risk) only while the mean of those
risks, the newcomer counted at the cap, stays within 1 - target; otherwise it judges at the stretch, as before. The
mean is what a client can expect of the on-time share, and /metrics shows it; the risks are the guard's measured
scores, not a margin chosen by hand.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

RISK_CAP = 4.0  # a single request may be promised at most this many times the target's late share (2% at 0.995)


class RiskBudget:
    def __init__(self, target: float, size: int) -> None:
        self.allowed = 1.0 - target  # the mean risk the promises may carry
        self.cap = min(0.5, RISK_CAP * self.allowed)  # the most one request may carry when judged loosely
        self._in_flight: dict[str, float] = {}
        self._in_flight_sum = 0.0
        self._done: deque[float] = deque(maxlen=size)
        self._done_sum = 0.0
        self._lock = threading.Lock()

    def room(self) -> bool:
        """Whether a newcomer may be judged loosely: the mean risk with it counted at the cap stays within bounds."""
        with self._lock:
            n = len(self._in_flight) + len(self._done) + 1
            return self._in_flight_sum + self._done_sum + self.cap <= self.allowed * n

    def promise(self, req_ids: Sequence[str], risks: Sequence[float]) -> None:
        """Requests' risks as their latest verdict put them (a newcomer's, and the admitted requests' moved beside
        it)."""
        with self._lock:
            flying = self._in_flight
            for req_id, risk in zip(req_ids, risks, strict=True):
                risk = min(1.0, max(0.0, risk))
                self._in_flight_sum += risk - flying.get(req_id, 0.0)
                flying[req_id] = risk

    def settle(self, req_id: str) -> None:
        """The request reached its SLA token: its risk joins the recent ones'."""
        with self._lock:
            risk = self._pop(req_id)
            if risk is None:
                return
            if len(self._done) == self._done.maxlen:
                self._done_sum -= self._done[0]
            self._done.append(risk)
            self._done_sum = max(0.0, self._done_sum + risk)

    def drop(self, req_id: str) -> None:
        """The request ended without an SLA token to judge (cancelled, or a shorter reply): no promise is left."""
        with self._lock:
            self._pop(req_id)

    def _pop(self, req_id: str) -> float | None:
        risk = self._in_flight.pop(req_id, None)
        if risk is not None:
            self._in_flight_sum = max(0.0, self._in_flight_sum - risk) if self._in_flight else 0.0
        return risk

    def promised(self) -> float:
        """The mean risk of the requests in flight and the recent ones: the late share the promises add up to."""
        with self._lock:
            n = len(self._in_flight) + len(self._done)
            return (self._in_flight_sum + self._done_sum) / n if n else 0.0
