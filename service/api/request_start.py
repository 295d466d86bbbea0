"""When a request started, which is when its SLA clock starts: the moment this server first sees it, or earlier where
the client (or a proxy in front of Parley) says when it was sent, in an `x-request-start` header.

Behind a router a request may reach a replica after time spent elsewhere: vllm-router retries a 429 on a replica
again after a backoff (5 tries took 61 ms with its default backoff), a proxy may queue it. The client's clock started
when it sent the request, so the replica's must too: a request that has already spent most of its budget is judged
by what is left of it. The header is the one many proxies and APM tools use (nginx `X-Request-Start "t=${msec}"`,
Heroku's router, New Relic): a time since the Unix epoch in seconds, milliseconds or microseconds (told apart by their
size, as New Relic does), optionally after `t=`. It needs the sender's clock to agree with the server's (NTP): a time
in the future counts as now; one more than MAX_AGE_S old is taken for a wrong clock, not a wait, and ignored.

The stamp is taken by an ASGI middleware before the body is read: a large body and its parsing count as well.
"""

from __future__ import annotations

import logging
import time

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("parley.api")

HEADER = b"x-request-start"
MAX_AGE_S = 60.0
WARN_EVERY_S = 60.0
_warned_at = -float("inf")


def sent_at(value: str) -> float | None:
    """Seconds since the Unix epoch that a header value names, or None for anything else."""
    text = value.strip()
    if text.startswith("t="):
        text = text[2:]
    try:
        t = float(text)
    except ValueError:
        return None
    if not t > 0 or t != t or t == float("inf"):
        return None
    # told apart by size: seconds are ~1.7e9 now, milliseconds ~1.7e12, microseconds ~1.7e15 (until the year 2286)
    return t / 1e6 if t > 1e14 else t / 1e3 if t > 1e11 else t


def arrival(header: str | None, now: float, wall: float) -> float:
    """The request's start on the perf_counter clock: `now` (perf_counter at first sight, when the wall clock said
    `wall`) less the age the header claims, bounded to [0, MAX_AGE_S]."""
    if header is None:
        return now
    sent = sent_at(header)
    if sent is None:
        return now
    age = wall - sent
    if age > MAX_AGE_S:
        _warn(f"an {HEADER.decode()} header {age:.0f} s old was ignored: the sender's clock is off")
        return now
    return now - max(0.0, age)


def _warn(message: str) -> None:
    global _warned_at
    if time.monotonic() - _warned_at >= WARN_EVERY_S:
        _warned_at = time.monotonic()
        log.warning(message)


class RequestStart:
    """ASGI middleware: each HTTP request's start (perf_counter seconds), in its scope's state as `request_start`; where
    a header moved it earlier, how much earlier as `request_transit`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            now, wall = time.perf_counter(), time.time()
            header = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k == HEADER), None)
            state = scope.setdefault("state", {})
            state["request_start"] = start = arrival(header, now, wall)
            if header is not None:
                state["request_transit"] = now - start
        await self.app(scope, receive, send)


def request_start(conn: HTTPConnection) -> float:
    """When this request's SLA clock started (now, where no middleware stamped it)."""
    return float(conn.scope.get("state", {}).get("request_start", time.perf_counter()))


def request_transit(conn: HTTPConnection) -> float | None:
    """From the send time its x-request-start gave to this server's first sight of it (None: no header): the client's
    own send, a proxy, a router's retries."""
    transit = conn.scope.get("state", {}).get("request_transit")
    return None if transit is None else float(transit)
