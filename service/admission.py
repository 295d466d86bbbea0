"""Admission control: admit a request only if its Nth token will land before its deadline AND every request already
admitted still meets its own; otherwise refuse at once (429), before any prefill is spent.

The prediction follows what the engine does: it prefills every admitted request that has a slot before the next
decode step, then one step serves every running request. For a newcomer, with b = requests decoding once it joins:

    t_N = now + wait for a slot + Σ prefills ahead of it and its own + (N − 1) × step(b)

and each admitted request i that has not reached its own Nth token is pushed back by the newcomer's prefill and
by the slower steps of a bigger batch: t_i = now + prefills + k_i × step(b), where k_i tokens remain to its Nth.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from service.engine.engine import Engine, Rejected
from service.engine.request import Request, State
from service.latency_model import LatencyModel

log = logging.getLogger("parley.admission")


class AdmissionController:
    def __init__(self, latency: LatencyModel, sla_s: float, sla_tokens: int, num_slots: int,
                 strict: bool = False, margin: float = 0.10) -> None:
        self.latency = latency
        self.sla_s, self.sla_tokens = sla_s, sla_tokens
        self.num_slots = num_slots
        self.margin = margin  # predictions are stretched by this much: a miss costs more than a refusal
        self.strict = strict
        self._lock = threading.Lock()
        self._active: dict[str, Request] = {}
        self.best_effort = not strict and not self.idle_server_meets_sla()
        if self.best_effort:
            log.warning("even an idle server cannot deliver %d tokens within %.0f ms here (predicted %.0f ms): "
                        "serving best-effort; --strict-sla refuses instead",
                        sla_tokens, sla_s * 1e3, self.idle_prediction_s() * 1e3)

    def idle_prediction_s(self, prompt_tokens: int = 32) -> float:
        return self.latency.prefill(prompt_tokens) + (self.sla_tokens - 1) * self.latency.step(1)

    def idle_server_meets_sla(self) -> bool:
        return self.idle_prediction_s() * (1 + self.margin) <= self.sla_s

    # -- the Engine's admission hooks ---------------------------------------------------------------------
    def check(self, req: Request, engine: Engine) -> None:
        req.deadline = req.arrival + self.sla_s
        now = time.perf_counter()
        with self._lock:
            active = [r for r in self._active.values() if r.state is not State.FINISHED]
            if not self.best_effort:
                self._decide(req, active, now)
            self._active[req.id] = req
        engine.metrics.sla_headroom.set(self.headroom(now))

    def _decide(self, req: Request, active: list[Request], now: float) -> None:
        lat, stretch = self.latency, 1 + self.margin
        waiting = [r for r in active if r.state is State.WAITING]
        running = [r for r in active if r.state is State.RUNNING]
        batch = min(len(active) + 1, self.num_slots)
        step = lat.step(batch)
        prefills = sum(lat.prefill(_to_prefill(r)) for r in waiting) + lat.prefill(_to_prefill(req))
        slot_wait = 0.0
        if len(active) >= self.num_slots:  # it waits for the first running request to finish
            slot_wait = min((_remaining(r) * lat.step(len(running)) for r in running), default=0.0)
        own_tokens = min(self.sla_tokens, req.params.max_tokens)
        t_own = now + (slot_wait + prefills + (own_tokens - 1) * step) * stretch
        if t_own > req.deadline:
            raise Rejected("sla_unmeetable" if not active else "overloaded",
                           f"the server cannot deliver {own_tokens} tokens within {self.sla_s * 1e3:.0f} ms now "
                           f"(predicted {(t_own - now) * 1e3:.0f} ms)", self.retry_after_s(active, now))
        for r in active:
            left = _left_to_nth(r, self.sla_tokens)
            if left == 0 or r.deadline is None:
                continue
            # A running request waits for every prefill ahead of its next step; a waiting one, at worst, too.
            if now + (prefills + left * step) * stretch > r.deadline:
                raise Rejected("overloaded", "admitting this request would make a running one miss its SLA",
                               self.retry_after_s(active, now))

    def release(self, req: Request) -> None:
        with self._lock:
            self._active.pop(req.id, None)

    def observe_step(self, batch: int, seconds: float) -> None:
        self.latency.observe_step(batch, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.latency.observe_prefill(tokens, seconds)

    # -- what operators and clients read ------------------------------------------------------------------
    def retry_after_s(self, active: list[Request], now: float) -> float:
        """When capacity will likely be back: the soonest any admitted request ends."""
        step = self.latency.step(max(1, len(active)))
        soonest = min((_remaining(r) * step for r in active), default=0.0)
        return max(soonest, step)

    def headroom(self, now: float) -> float:
        """Smallest predicted slack before an admitted request's deadline; the whole SLA when idle."""
        with self._lock:
            active = [r for r in self._active.values() if r.state is not State.FINISHED]
        step = self.latency.step(max(1, len(active)))
        slack = [r.deadline - (now + _left_to_nth(r, self.sla_tokens) * step) for r in active
                 if r.deadline is not None and _left_to_nth(r, self.sla_tokens) > 0]
        return min(slack, default=self.sla_s)


def _to_prefill(r: Request) -> int:
    return max(1, len(r.prompt_ids) - r.cached_tokens)


def _remaining(r: Request) -> int:
    return max(0, r.params.max_tokens - len(r.output_ids))


def _left_to_nth(r: Request, sla_tokens: int) -> int:
    return max(0, min(sla_tokens, r.params.max_tokens) - len(r.output_ids))


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))
