"""One request as the client saw it: what was measured, and the latencies and SLA verdict derived from it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

OUTCOMES = ("ok", "rejected", "error", "cancelled")
# What the client meant a request to be: a turn's reply, a turn's reply it barged in on, or a reply started early on
# a partial transcript and cancelled (LiveKit's preemptive_generation, Pipecat's eager end-of-turn).
KINDS = ("turn", "barge-in", "preemptive")


@dataclass
class RequestRecord:
    session: int
    turn: int
    endpoint: str = ""  # completions | chat | realtime
    kind: str = "turn"  # one of KINDS
    start_s: float = 0.0  # when it was sent, seconds since the run began
    end_s: float = 0.0  # when it ended (last byte, rejection, error, or the stream closed on a cancel)
    outcome: str = "error"  # one of OUTCOMES
    status: int | None = None  # HTTP status (101 for a WebSocket turn)
    error: str | None = None
    retry_after_s: float | None = None  # from a 429's Retry-After header or an error event's retry_after_ms
    prompt_tokens: int | None = None  # from the server's usage, where it sends one
    cached_tokens: int | None = None  # of those, how many came from the server's KV cache (usage, where sent)
    output_tokens: int = 0  # usage.completion_tokens where sent, else the count of token-carrying chunks
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token chunk, since sent
    cancel_ms: float | None = None  # realtime: response.cancel sent → response.done received
    server_timings: dict[str, Any] | None = None  # realtime: the server's own `timings` in response.done
    text: str = ""  # the reply as heard: on a barge-in, what arrived before the client cancelled
    # Derived by finish():
    ttft_ms: float | None = None
    ttfn_ms: float | None = None  # time to the Nth token (to the last one when fewer arrived)
    tpot_ms: float | None = None  # (last token - first token) / (tokens - 1)
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    sla_met: bool = False

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        return d


def finish(r: RequestRecord, sla_tokens: int, sla_ms: float) -> RequestRecord:
    """Fill the derived fields from the token arrival times. The SLA is met by an admitted request (ok, or
    cancelled by the client) whose first min(N, tokens) tokens arrived within sla_ms; never by a rejected one or
    one that failed."""
    t = [x * 1000.0 for x in r.token_times_s]
    r.e2e_ms = (r.end_s - r.start_s) * 1000.0
    r.ttft_ms = t[0] if t else None
    r.ttfn_ms = t[min(sla_tokens, len(t)) - 1] if t else None
    r.itl_ms = [b - a for a, b in zip(t, t[1:])]
    r.tpot_ms = (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None
    r.sla_met = r.outcome in ("ok", "cancelled") and r.ttfn_ms is not None and r.ttfn_ms <= sla_ms
    return r
