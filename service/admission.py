"""Admission control: admit a request only if its Nth token will land before its deadline AND every request already
admitted still meets its own; otherwise refuse at once (429), before any prompt token is spent.

The prediction is the planner's (service/engine/planner.py): its forecast plays the engine's own policy forward —
seats, the token budget of a step, prompts chunked into steps beside the decode rows, long prompts launched on their
own — with the latency model's cost of each step from its rows and the K/V positions they attend over. Admission
keeps no simulator of its own: it asks "when would each admitted request, and this one, reach its SLA token if it
joined?", and refuses when the newcomer would be late, or when a request that would be on time without it would not
be with it (one late whatever happens holds nobody back).

A request that would wait for a seat is forecast by when admitted requests end: a prediction resting on predictions of
full batches. Until this server has served a full batch for as many steps as a request takes to its SLA token (the
latency model and the bias have then seen how this host serves full batches, beyond the calibration's bare steps: a
2-core CPU serving four streams ran 1.3x the calibrated steps), such a request is forecast with steps
SEAT_WAIT_STRETCH x the calibration's: a fresh strict-SLA server had admitted a second
wave of a burst, forecast just within its SLA, that then reached its SLA token 25% late. Requests that find a seat are
judged as ever, and once full batches have been served, so is everyone.

The margin that stretches predictions widens when SLA tokens come late (a busy host) and comes back to the configured
one as tokens come on time and as time passes; one late token widens it by MAX_WIDEN at most. An idle server, which
delays nobody by admitting, always judges with the configured margin.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from service.engine.admission import Rejected
from service.engine.commit import Event, Finished, StepDone, Token
from service.engine.kv_slots import KVSlots
from service.engine.planner import Planner
from service.engine.request import Request, State
from service.latency_model import LatencyModel

log = logging.getLogger("parley.admission")

PROBE_EVERY_S = 1.0  # an idle server admits one request it predicts to miss at most this often...
PROBE_WITHIN = 2.0  # ...if it predicts it within this many SLAs: the prediction may be what is wrong
PROBE_WITHIN_UNCHECKED = 4.0  # ...this many, while no served step has checked the calibration (one timed on a busy
# 2-core host ran 3.7x the real steps)
SEAT_WAIT_STRETCH = 1.5  # how much slower than calibrated a full batch may run before one was served: a 2-core CPU
# streaming four replies over HTTP ran 1.3-1.4x its fresh calibration (at 1.2x, 2-4 of 8 admitted came 1-9% late)
MAX_MARGIN = 1.0  # predictions are never stretched by more than 2x
MAX_WIDEN = 0.1  # one late SLA token widens the margin by at most this much (one 10x-late outlier had widened it to
# 0.95 on the H100, and a nearly idle server refused every 64-token turn for seconds)
MARGIN_DECAY = 0.05  # per SLA token on time: the widened margin's share given back (one late first request on
# the H100, slowed by one-off costs, widened it so far that 0.02 kept an idle server refusing for a minute)
MARGIN_HALF_LIFE_S = 1.0  # and the widening halves every second, tokens or not: a server that refuses sees few
BIAS_EWMA = 0.1  # weight of one observed SLA token in the learned actual/predicted ratio
BIAS_RANGE = (0.75, 2.0)
BIAS_STEP = (0.8, 1.25)  # one SLA token's ratio counts at most this far from 1: a stall (a 100 ms pause under load
# on the H100) must not teach the bias; the margin answers misses


class AdmissionController:
    def __init__(self, latency: LatencyModel, sla_s: float, sla_tokens: int, max_batch: int,
                 strict: bool = False, margin: float = 0.10, clock: Callable[[], float] = time.monotonic) -> None:
        self.latency = latency
        self.sla_s, self.sla_tokens = sla_s, sla_tokens
        self.max_batch = max_batch  # requests seated together
        # the policy admission forecasts with: the engine's own planner once bound (Engine binds it)
        self.planner = Planner(KVSlots(max_batch), max_batch, latency.max_rows, max_context=1 << 30)
        self._clock = clock
        self.base_margin = margin  # predictions are stretched by this much: a miss costs more than a refusal
        self.margin = margin  # ...and more while SLA tokens come later than predicted
        self._predicted: dict[str, float] = {}  # request id → unstretched prediction of arrival → SLA token (s)
        # How long SLA tokens really take over what the latency model predicts, learned from every one: the model
        # times the backend's steps, not all that lies between them and a client (it was 0.92 on the H100).
        self.bias = 1.0
        self._outlier_before = False  # the last SLA token was an outlier
        self.full_steps = 0  # steps served with every seat taken (as many as take a request to its SLA token: seat
        # waits are forecast from what they taught, not stretched by SEAT_WAIT_STRETCH)
        self._last_probe = -math.inf
        self.strict = strict
        self._lock = threading.Lock()
        self._active: dict[str, Request] = {}
        self.best_effort = not strict and not self.idle_server_meets_sla()
        if self.best_effort:
            log.warning("even an idle server cannot deliver %d tokens within %.0f ms here (predicted %.0f ms): "
                        "serving best-effort; --strict-sla refuses instead",
                        sla_tokens, sla_s * 1e3, self.idle_prediction_s() * 1e3)

    @property
    def margin(self) -> float:
        """The configured margin, plus what late tokens added, halving every MARGIN_HALF_LIFE_S."""
        age = max(0.0, self._clock() - self._widened_at)
        return self.base_margin + self._widening * 0.5 ** (age / MARGIN_HALF_LIFE_S)

    @margin.setter
    def margin(self, value: float) -> None:
        self._widening, self._widened_at = max(0.0, value - self.base_margin), self._clock()

    def idle_prediction_s(self, prompt_tokens: int = 32) -> float:
        """A prompt riding in one step on an idle server, then a token a step."""
        lat = self.latency
        return lat.step(min(prompt_tokens, lat.max_rows)) + (self.sla_tokens - 1) * lat.step(1)

    def idle_server_meets_sla(self) -> bool:
        """Whether an idle server keeps the SLA, as predicted (the margin is for the queueing and jitter of a busy
        one). A bias below 1 (the model runs pessimistic) may show that it does after all."""
        return self.idle_prediction_s() * min(1.0, self.bias) <= self.sla_s

    def _reconsider_best_effort(self) -> None:
        """A server that started best-effort (its calibration predicted a miss even when idle) enforces the SLA
        as soon as the latency model, learning the real cadence, predicts that an idle server keeps it. Never the
        other way: steps seen under load run slower than idle ones, and a server near its SLA flapped into
        best-effort on the H100 and admitted requests that then missed; late tokens widen the margin instead."""
        if self.strict or not self.best_effort or not self.idle_server_meets_sla():
            return
        log.warning("the latency model now predicts %.0f ms to token %d on an idle server: enforcing the SLA",
                    self.idle_prediction_s() * 1e3, self.sla_tokens)
        self.best_effort = False

    # -- the Engine's admission hooks (service.engine.admission.Admission) ----------------------------------
    def bind(self, planner: Planner) -> None:
        self.planner = planner

    def check(self, req: Request) -> None:
        req.deadline = req.arrival + self.sla_s
        now = time.perf_counter()
        with self._lock:
            self._reconsider_best_effort()
            active = [r for r in self._active.values() if r.state is not State.FINISHED]
            if not self.best_effort:
                # An idle server judges with the configured margin: the widened one is for the queueing and jitter
                # of a busy server, and one late request (the first 1,000-token prompt of a run, on the H100) had
                # widened it so far that a single stream of such prompts was refused outright.
                stretch = self._stretch() if active else self.bias * (1 + self.base_margin)
                t_nth = self._decide(req, active, now, stretch)
                self._predicted[req.id] = (now - req.arrival) + (t_nth - now) / stretch
            self._active[req.id] = req

    def _decide(self, req: Request, active: list[Request], now: float, stretch: float) -> float:
        """The newcomer's predicted SLA-token time, or Rejected: it would be late, or it would make late an admitted
        request that would be on time without it."""
        lat = self.latency

        def step_s(rows: int, kv_positions: int) -> float:
            return lat.step(rows, kv_positions) * stretch

        def prefill_s(tokens: int, cached: int) -> float:
            return lat.prefill(tokens, cached) * stretch

        if len(active) >= self.max_batch and self.full_steps < self.sla_tokens:
            stretch *= SEAT_WAIT_STRETCH  # a seat wait on full batches not yet served
        horizon = self._probe_within() * self.sla_s
        joined = self.planner.forecast(active + [req], step_s, prefill_s, now, horizon)
        t_nth = joined[id(req)]
        if req.deadline is not None and t_nth > req.deadline:
            if not active:  # an idle server refusing: say why (at most every PROBE_EVERY_S: a probe or not)
                log.info("idle server: %s predicted %.1f ms to its SLA token (%.1f ms since arrival, forecast x "
                         "%.3f: bias %.3f, margin %.3f)", req.id, (t_nth - req.arrival) * 1e3,
                         (now - req.arrival) * 1e3, stretch, self.bias, self.margin)
            if active or not self._probe(req, t_nth, now):
                raise Rejected("overloaded" if active else "sla_unmeetable",
                               f"the server cannot deliver {req.sla_token_index} tokens within "
                               f"{self.sla_s * 1e3:.0f} ms now" +
                               (f" (predicted {(t_nth - now) * 1e3:.0f} ms)" if t_nth < math.inf else ""),
                               self.retry_after_s(active, now))
        if active:
            alone = self.planner.forecast(active, step_s, prefill_s, now, horizon)
            for r in active:
                if r.deadline is not None and alone[id(r)] <= r.deadline < joined[id(r)]:
                    raise Rejected("overloaded", "admitting this request would make an admitted one miss its SLA",
                                   self.retry_after_s(active, now))
        return t_nth

    def _probe(self, req: Request, t_nth: float, now: float) -> bool:
        """Admit a request predicted to miss, on an idle server (it can delay nobody), now and then: otherwise a
        latency model that is too pessimistic (a stalled calibration sample, slow steps seen in a load spike) would
        refuse everything for ever, never observing the steps that would correct it. A latency model that no served
        step has checked yet is the calibration alone, and is given more room: a start-up on a busy host had timed
        one-row steps at 267 ms that took 72 ms a second later, and its strict server refused every request, idle or
        not, for good."""
        if now - self._last_probe < PROBE_EVERY_S or t_nth - req.arrival > self._probe_within() * self.sla_s:
            return False
        self._last_probe = now
        log.info("admitting %s as a probe: predicted %.0f ms for its SLA token on an idle server (SLA %.0f ms)",
                 req.id, (t_nth - req.arrival) * 1e3, self.sla_s * 1e3)
        return True

    def _probe_within(self) -> float:
        """How many SLAs away an idle server's prediction may be for a probe."""
        return PROBE_WITHIN_UNCHECKED if self.latency.observed_steps == 0 else PROBE_WITHIN

    def _stretch(self) -> float:
        """Predictions are scaled by the learned bias, then stretched by the safety margin."""
        return self.bias * (1 + self.margin)

    def release(self, req: Request) -> None:
        with self._lock:
            self._active.pop(req.id, None)
            self._predicted.pop(req.id, None)

    def observe_nth(self, req: Request, at: float) -> None:
        """The SLA token came out. Where it came later than predicted by more than the margin allows (a busy host:
        the scheduler's own jitter, other processes), widen the margin at once by half the shortfall (MAX_WIDEN at
        most); each token on time narrows it back a little, towards the configured margin. The bias learns from
        every token but a lone outlier (later than BIAS_STEP allows, after one that was not)."""
        with self._lock:
            predicted = self._predicted.pop(req.id, None)
            if predicted is None or predicted <= 0:
                return
            ratio = (at - req.arrival) / predicted
            outlier = ratio > BIAS_STEP[1]
            if not outlier or self._outlier_before:
                lo, hi = BIAS_RANGE
                learned = min(BIAS_STEP[1], max(BIAS_STEP[0], ratio))
                self.bias = min(hi, max(lo, (1 - BIAS_EWMA) * self.bias + BIAS_EWMA * learned))
            self._outlier_before = outlier
            needed, margin = ratio / self.bias - 1, self.margin
            if needed > margin:
                self.margin = min(MAX_MARGIN, margin + min(MAX_WIDEN, 0.5 * (needed - margin)))
            else:
                self.margin = margin - MARGIN_DECAY * (margin - self.base_margin)

    def consume(self, event: Event) -> None:
        """What a step committed: its time teaches the latency model (a step's, or the prefill launched before it),
        an SLA token the margin and the bias, an end frees the request's place."""
        if isinstance(event, StepDone):
            self.full_steps += event.sampled >= self.max_batch
            if event.seconds <= 0:
                return
            if event.launched:  # the step's time is mostly the launches'
                rest = max(0.0, event.seconds - self.latency.step(event.rows, event.kv_positions))
                for tokens, cached in event.launched:
                    self.latency.observe_prefill(tokens, cached, rest / len(event.launched))
            else:
                self.latency.observe_step(event.rows, event.seconds, event.kv_positions)
        elif isinstance(event, Token | Finished):
            if event.token is not None and event.n == event.req.sla_token_index:
                self.observe_nth(event.req, event.at)
            if isinstance(event, Finished):
                self.release(event.req)

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
        slack = [r.deadline - (now + _left_to_nth(r) * step) for r in active
                 if r.deadline is not None and _left_to_nth(r) > 0]
        return min(slack, default=self.sla_s)


def _remaining(r: Request) -> int:
    return max(0, r.params.max_tokens - len(r.output_ids))


def _left_to_nth(r: Request) -> int:
    return max(0, r.sla_token_index - len(r.output_ids))
