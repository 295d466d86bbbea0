"""Launch first, judge beside the step: on an idle GPU engine a newcomer whose prompt fits one step is seated and its
prompt step launched before admission's verdict, which then runs while the GPU runs the step.

On an idle server the verdict stood between a request's arrival at the engine and its prompt step: on the H100 host the
engine thread, waking from idle into cold caches, took ~0.06 ms to build the request and ~0.08 ms for the verdict
(bench/NOTES.md, s86), where the same calls in a warm loop take 12 and 18-27 µs; the idle first token read 3.03-3.07 ms
against issue 37's 3. Beside the step the verdict costs the first token nothing.

It is judged as if before the launch: admission's Moment (the requests admitted, their states and the newcomer's, the
steps launched) is taken when the request is seated, so its forecast, its promise and the guard's score are the ones
the verdict would have made then. A refusal withdraws the request: its step's work is dropped, its slot freed before
the next step, and nothing of it reaches its front end or the metrics but the refusal. Only where the verdict all but
certainly admits: an idle engine (nothing seated, waiting or in flight), a prompt that fits one step, no grammar (its
compile runs on the side pool); a wasted step of an idle GPU is the price of a refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.engine.admission import Rejected
from service.engine.request import Delta, Request


@dataclass(frozen=True)
class LaunchedFirst:
    """A request seated before its verdict: what the verdict judges from, when the engine's process received it, and
    who hears the verdict (None: admitted; else the refusal)."""

    req: Request
    moment: object
    received: float
    on_verdict: Callable[[Rejected | None], None]


def fits_one_step(req: Request, prefill_rows: int) -> bool:
    """The prompt's new tokens (less its expected cached prefix) ride in one step with no decode row beside them."""
    return len(req.prompt_ids) - req.cached_tokens <= prefill_rows


def nowhere(delta: Delta) -> None:
    """A withdrawn request's sink: its front end has its refusal."""
