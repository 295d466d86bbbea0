"""commit: a step's plan and the tokens it produced → what happened, as events. The one place a step's results are
applied to its requests and the one place the stop rule lives. The engine streams the events' deltas; metrics and
admission consume the events (service/metrics.py, service/admission.py), never called from anywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from service.engine.request import Request, State
from service.engine.step_plan import StepPlan


@dataclass(frozen=True)
class StepDone:
    """A step ran: its rows, the seconds it took in the engine's cadence (0: not measured), when it was committed;
    `handed_over`: the seconds of handed-over work (verdicts, service/engine/handoff.py) the engine thread ran within
    that cadence, while the GPU ran the next step; `handed`: each of those tasks' (kind, seconds)."""

    rows: int
    sampled: int
    prompt_rows: int
    kv_positions: int
    launched: tuple[tuple[int, int], ...]  # (new tokens, cached) of each separate prefill launch before it
    seconds: float
    at: float
    handed_over: float = 0.0
    handed: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Started:
    """A request's prompt started: `cached` of its prompt tokens came from the prefix cache."""

    req: Request
    cached: int
    at: float


class Token(NamedTuple):
    """Request `req` got its n-th token (1-based), streaming `text`; `gap`: seconds since its token before. (A tuple,
    not a frozen dataclass: one is made for every token a step commits, and a frozen dataclass took 0.7 us of it.)"""

    req: Request
    token: int
    n: int
    text: str
    at: float
    gap: float | None = None


@dataclass(frozen=True)
class Finished:
    """Request `req` ended: stop | length (with its last token, the n-th, and text) | cancelled | error."""

    req: Request
    reason: str
    at: float
    text: str = ""
    token: int | None = None
    n: int = 0
    gap: float | None = None
    error: str | None = None


Event = StepDone | Started | Token | Finished


def commit(plan: StepPlan, token_of: Callable[[int], int], eos: frozenset[int], max_context: int, now: float,
           seconds: float = 0.0, handed_over: float = 0.0, handed: tuple[tuple[str, float], ...] = ()
           ) -> list[Event]:
    """Apply a step: each sampled row's token to its request (token_of(row), which raises for a row whose choice
    failed: that request alone ends in error), and the stop rule: EOS (unless ignored), a stop string, max_tokens, or
    a context with no position left. Rows of requests that ended while the step was in flight are dropped."""
    events: list[Event] = [StepDone(plan.rows, len(plan.sampled), plan.prompt_rows, plan.kv_positions,
                                    tuple((lc.end - lc.start, lc.start) for lc in plan.launches), seconds, now,
                                    handed_over, handed)]
    events += [Started(r, r.cached_tokens, now) for r in plan.started]
    for launch in plan.launches:
        if launch.req.state is not State.FINISHED:
            launch.req.kv_len = launch.end
    for chunk in plan.chunks:
        if chunk.req.state is not State.FINISHED:
            chunk.req.kv_len = chunk.end - chunk.last  # the last row's K/V counts once its token is out
    for row, req in enumerate(plan.sampled):
        if req.state is State.FINISHED:  # cancelled, or ended while this step ran ahead
            continue
        try:
            token = token_of(row)
        except Exception as e:  # SamplingError: this request's choice failed
            events.append(Finished(req, "error", now, error=f"sampling failed: {e}"))
            req.state = State.FINISHED
            continue
        events.append(_apply(req, token, eos, max_context, now))
        if isinstance(events[-1], Finished):
            req.state = State.FINISHED
    return events


def _apply(req: Request, token: int, eos: frozenset[int], max_context: int, now: float) -> Token | Finished:
    req.output_ids.append(token)
    req.kv_len = len(req.prompt_ids) + len(req.output_ids) - 1  # every token but the newest has been fed
    n = len(req.output_ids)
    gap = None if req.last_token_at is None else now - req.last_token_at
    if req.first_token_at is None:
        req.first_token_at = req.prefill_end = now
    if n == req.sla_token_index:
        req.nth_token_at = now
    req.last_token_at = now
    if token in eos and not req.params.ignore_eos:
        return Finished(req, "stop", now, "", token, n, gap)
    output = req.output
    text = "" if output is None else output.add(token)  # None: the front end detokenizes (api/engine_client.py)
    if output is not None and output.stopped:
        return Finished(req, "stop", now, text, token, n, gap)
    if n >= req.params.max_tokens or req.kv_len + 1 >= max_context:
        return Finished(req, "length", now, text, token, n, gap)
    return Token(req, token, n, text, now, gap)
