"""Admission control: admit a request only if its Nth token will land before its deadline AND every request already
admitted still meets its own; otherwise refuse at once (429), before any prompt token is spent.

The prediction is the planner's (service/engine/planner.py): its forecast plays the engine's own policy forward —
seats, the token budget of a step, prompts chunked into steps beside the decode rows, long prompts launched on their
own — with the latency model's cost of each step from its rows and the K/V positions they attend over. Admission
keeps no simulator of its own: it asks "when would each admitted request, and this one, reach its SLA token if it
joined?", and refuses when the newcomer would be late, or when it would delay a request that is forecast late beside
it but would be on time without it at the usual pace (the guard's median, not its stretch). Only a request late even
at the usual pace holds nobody back: judged by the stretch alone, a request whose forecast had drifted a few percent
past its deadline was given up, and the newcomers admitted beside it made it really late (bf16 on the H200 at 100-160
req/s: 6% of admitted requests late at the server, 0.5% over their stretch).

Every forecast is stretched by the guard (service/admission_guard.py): the target quantile of how much longer than
forecast admitted requests at this load level really took to their SLA token, as this server measured it. So the
share of admitted requests that come late is what the target says, whatever the forecast misses (host stalls,
prompt chunks, a busier host than the calibration's), and no margin is tuned by hand. An idle server that predicts
a miss still admits a probe now and then: a latency model that is too pessimistic must be corrected by serving.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from service.admission_guard import AdmissionGuard, Level
from service.admission_log import AdmissionLog
from service.engine.admission import Rejected
from service.engine.commit import Event, Finished, StepDone, Token
from service.engine.kv_slots import KVSlots
from service.engine.planner import ForecastState, Planner
from service.engine.request import Request, State
from service.latency_model import LatencyModel
from service.model_clock import ModelClock

log = logging.getLogger("parley.admission")

DELIVERY_SHARE = 0.05  # the most of the SLA a request's deadline leaves for its tokens' way to the front end
PROBE_EVERY_S = 1.0  # an idle server admits one request it predicts to miss at most this often...
PROBE_WITHIN = 2.0  # ...if it predicts it within this many SLAs: the prediction may be what is wrong
DELAYS_NOBODY_S = 1e-6  # a newcomer that moves an admitted request's forecast by less delays it not at all (the two
# forecasts add the same step times in runs cut differently: their sums differ in the last bits)
HANDED_LINE_S = 0.001  # a handed-over task this long (past the handoff's whole budget) gets its step a `handed` line
OVER_LOG_EVERY_S = 1.0  # a score over the stretch it was admitted with is logged at most this often
PROBE_WITHIN_UNCHECKED = 4.0  # ...this many, while no served step has checked the calibration (one timed on a busy
# 2-core host ran 3.7x the real steps)


class Promise(NamedTuple):
    """What admission said of a request: admitted at `at`, its SLA token at `predicted` (the forecast unstretched),
    judged at `level` with `stretch`. Each later admission forecasts it again beside its newcomer and judges it at the
    newcomer's level: the promise moves to that forecast, level and stretch, and is scored where it was last judged
    (kept at the level it was admitted at, a request that ended beside four others taught the level of one, and the
    busy levels, short of scores of their own, borrowed lighter ones': 3% of admitted requests came late on the H100 at
    12-20 req/s, 12% in FP8 at 30). Its score is against the model clock (service/model_clock.py): how far the latency
    model was off on the steps that ran over its whole span, not how much load came after it (scored against its first
    forecast, a request admitted alone in a moderate load scored 1.4x and the idle server's stretch rose until it
    refused requests alone: the H100's voice sweep), nor only how far its latest forecast, made near its end under
    load, was off."""

    at: float
    predicted: float
    level: Level
    stretch: float

    def latest_score(self, came: float) -> float:
        """Actual over forecast time from the verdict to the SLA token by the latest forecast (for the log)."""
        span = self.predicted - self.at
        return (came - self.at) / span if span > 0 else math.inf


@dataclass
class _Judging:
    """A verdict between its parts: the moment and states its forecasts start from (the newcomer last), and what the
    first forecast (the newcomer joined) found that the `delays` rule's second judges."""

    req: Request
    active: list[Request]
    now: float
    stretch: float
    level: Level
    horizon_s: float
    states: list[ForecastState]
    ahead: int  # steps the engine had launched: its newcomer is seated after them, in both forecasts
    note: dict[str, object] = field(default_factory=dict)
    joined: dict[int, float] = field(default_factory=dict)  # SLA-token times with the newcomer, by id(request)
    late: list[Request] = field(default_factory=list)  # admitted requests late beside the newcomer
    spent: dict[int, tuple[float, float | None]] = field(default_factory=dict)  # by id(request): (wall, model) time
    # since its first verdict
    typical: float = 1.0  # the guard's usual pace at this level

    def over(self, r: Request, t: float, pace: float) -> float:
        """How far past its deadline `r` comes at `pace` (times the forecast), `t` its stretched forecast."""
        assert r.deadline is not None
        wall, model = self.spent.get(id(r), (0.0, None))
        past = pace * wall if model is None else max(wall, pace * model)
        return self.now - wall + past + (t - self.now) * pace / self.stretch - r.deadline


@dataclass(frozen=True)
class Moment:
    """What a verdict judges from, taken before the verdict runs (AdmissionController.moment): the admitted requests,
    when, their states and the newcomer's (last), the steps the engine had launched, and how many verdicts had admitted
    by then (one admitted since, on another thread, and the moment is stale: the verdict judges from now instead)."""

    active: list[Request]
    now: float
    states: list[ForecastState]
    ahead: int
    decided: int


class AdmissionController:
    def __init__(self, latency: LatencyModel, sla_s: float, sla_tokens: int, max_batch: int,
                 strict: bool = False, target: float = 0.995, clock: Callable[[], float] = time.monotonic,
                 trace: AdmissionLog | None = None, forecasts: bool = True) -> None:
        self.latency = latency
        # --no-admission (False): every request admitted without a forecast; deadlines still set, on time still judged
        self.forecasts = forecasts
        self.trace = trace  # --admission-log: a line per verdict, SLA token and step (service/admission_log.py)
        self.sla_s, self.sla_tokens = sla_s, sla_tokens
        self.max_batch = max_batch  # requests seated together
        # the policy admission forecasts with: the engine's own planner once bound (Engine binds it)
        self.planner = Planner(KVSlots(max_batch), max_batch, latency.max_rows, max_context=1 << 30)
        self.guard = AdmissionGuard(target, clock)
        self.model_clock = ModelClock()  # what a promise is scored against, over its span
        self._last_probe = -math.inf
        self._over_logged_at = -math.inf  # when a score over its stretch was last logged
        self.strict = strict
        # One verdict at a time (each forecasts with what the others admitted); the engine thread never waits for one:
        # it takes only `_lock`, which guards the admitted requests and their promises and is held briefly.
        self._deciding = threading.Lock()
        self._decided = 0  # verdicts admitted so far: what a verdict in parts checks that nobody was admitted between
        self._lock = threading.Lock()
        self._active: dict[str, Request] = {}
        self._promises: dict[str, Promise] = {}
        self.best_effort = not strict and forecasts and not self.idle_server_meets_sla()
        if self.best_effort:
            log.warning("even an idle server cannot deliver %d tokens within %.0f ms here (predicted %.0f ms): "
                        "serving best-effort; --strict-sla refuses instead",
                        sla_tokens, sla_s * 1e3, self.idle_prediction_s() * 1e3)

    def idle_prediction_s(self, prompt_tokens: int = 32) -> float:
        """A prompt riding in one step on an idle server, then a token a step."""
        lat = self.latency
        return lat.step(min(prompt_tokens, lat.max_rows)) + (self.sla_tokens - 1) * lat.step(1)

    def idle_server_meets_sla(self) -> bool:
        """Whether an idle server keeps the SLA, as predicted, and as measured once requests alone have taught the
        guard that the forecast runs pessimistic (a stretch below 1)."""
        alone = Level.of(1, 32, self.planner.budget(decoding=False), self.planner.launch_min_tokens)
        return self.idle_prediction_s() * min(1.0, self.guard.stretch(alone)) <= self.sla_s

    def _reconsider_best_effort(self) -> None:
        """A server that started best-effort (its calibration predicted a miss even when idle) enforces the SLA
        as soon as the latency model, learning the real cadence, predicts that an idle server keeps it. Never the
        other way: a server near its SLA flapped into best-effort on the H100 and admitted requests that then missed;
        the guard's stretch answers a slow host instead."""
        if self.strict or not self.best_effort or not self.idle_server_meets_sla():
            return
        log.warning("the latency model now predicts %.0f ms to token %d on an idle server: enforcing the SLA",
                    self.idle_prediction_s() * 1e3, self.sla_tokens)
        self.best_effort = False

    def level_of(self, active: list[Request], req: Request) -> Level:
        """The load `req` would join: requests in flight with it, and the prompt tokens still to prefill (whether they
        fit one step: alone, a step with no decode row, whose budget is the planner's prefill_rows)."""
        return self._level(self.planner.snapshot([*active, req]))

    def _level(self, states: list[ForecastState]) -> Level:
        """level_of() from the requests' snapshot (the newcomer last), which a verdict takes for its forecasts."""
        return Level.of(len(states), sum(map(_PROMPT_LEFT, states)), self.planner.budget(decoding=len(states) > 1),
                        self.planner.launch_min_tokens)

    # -- the Engine's admission hooks (service.engine.admission.Admission) ----------------------------------
    def bind(self, planner: Planner) -> None:
        self.planner = planner

    def check(self, req: Request) -> None:
        """Admit `req` (its deadline set, its promise made) or raise Rejected: the verdict's parts at once."""
        for _ in self.verdict(req):
            pass

    def moment(self, req: Request) -> Moment:
        """What a verdict on `req` would judge from now, for one run a little later as if now (Engine.launch_first:
        an idle server's prompt step launched before its verdict, which then runs beside the step)."""
        with self._lock:
            active = self._in_flight()
        return Moment(active, time.perf_counter(), self.planner.snapshot([*active, req]), self.planner.steps_ahead,
                      self._decided)

    def verdict(self, req: Request, moment: object = None) -> Iterator[None]:
        """check() in parts, for a caller that runs each apart (the engine process, each beside a GPU step where it
        fits): it yields once, where the `delays` rule needs its second forecast (the newcomer left out) after the
        first (it joined), which then starts from the same moment and states. A verdict decided in between (a
        grammar's, on another thread) changes what the first part saw: the second then judges again, whole.
        `moment`: a Moment taken earlier, which the first part judges from (unless a verdict admitted since)."""
        # room for the hop from the engine to the front end, where the client's clock reads it (api/delivery.py); at
        # most a share of the SLA, so that a front end that stalled once cannot make an idle server refuse
        req.deadline = req.arrival + self.sla_s - min(req.delivery_s, DELIVERY_SHARE * self.sla_s)
        if not self.forecasts:
            self._admit_unjudged(req)
            return
        with self._deciding:
            judging = self._first(req, moment if isinstance(moment, Moment) and moment.decided == self._decided
                                  else None)
            if not judging.late:
                self._admit(judging)
                return
            decided = self._decided
        yield
        with self._deciding:
            if self._decided != decided:  # judged again, whole: its first forecast now, then the `delays` rule
                judging = self._first(req)
                self._second(judging)
            else:
                self._second(judging, time.perf_counter() - judging.now)
            self._admit(judging)

    def _first(self, req: Request, moment: Moment | None = None) -> _Judging:
        """A verdict's first forecast, the newcomer joined, and the rules it decides alone (late, probe); what the
        `delays` rule needs of it. From `moment` where given, else from now."""
        if moment is None:
            moment = self.moment(req)
        active, now, states = moment.active, moment.now, moment.states
        self._reconsider_best_effort()
        level = self._level(states)
        # A best-effort server admits everything, but forecasts all the same: the guard learns from it.
        stretch = 1.0 if self.best_effort else self.guard.stretch(level)
        j = _Judging(req, active, now, stretch, level, self._probe_within() * self.sla_s, states, moment.ahead)
        try:
            self._joined(j)
        except Rejected as refusal:
            self._trace_verdict(j, refusal)
            raise
        return j

    def _second(self, j: _Judging, waited_s: float = 0.0) -> None:
        """The verdict's second part, `waited_s` after its first: the newcomer joins that much later than the first
        forecast had it, so its SLA token moves as much (on the H200 the second part ran 0.3 ms after the first at the
        median, 1.1-1.5 at p90, up to 3.7; one request admitted 2.5 ms after its first part came late), then the
        `delays` rule."""
        try:
            if waited_s > 0:
                self._waited(j, waited_s)
            self._delays(j)
        except Rejected as refusal:
            self._trace_verdict(j, refusal)
            raise

    def _admit(self, j: _Judging) -> None:
        """Admitted: the newcomer's promise made, and every admitted request's moved to its forecast beside it."""
        req, now, stretch = j.req, j.now, j.stretch
        self._trace_verdict(j, None)
        with self._lock:
            for r in [*j.active, req]:  # the forecast (unstretched) of every admitted request beside the newcomer
                t = j.joined.get(id(r), math.inf)
                p = self._promises.get(r.id)
                if t < math.inf and (p is not None or r is req):
                    if p is None:
                        self.model_clock.start(r.id, now)
                    predicted = now + (t - now) / stretch
                    self._promises[r.id] = Promise(p.at if p is not None else now, predicted, j.level, stretch)
            self._active[req.id] = req
        self._decided += 1

    def _admit_unjudged(self, req: Request) -> None:
        """--no-admission: in flight without a forecast or a promise (nothing scored, the guard learns only whether
        it came in time)."""
        with self._lock:
            self._active[req.id] = req
            self._decided += 1
        if self.trace is not None:
            self.trace.record("verdict", t=time.perf_counter(), req=req.id, admitted=True, reason=None, rule="off",
                              prompt_tokens=len(req.prompt_ids), cached_tokens=req.cached_tokens)

    def _trace_step(self, event: StepDone, predicted: float) -> None:
        """A sampled step's line; and every step with a long handed-over task in its cadence gets a `handed` line, so
        that the rare task that holds the GPU up is named (the sample would miss most)."""
        assert self.trace is not None
        due, held = self.trace.step_due(), any(s >= HANDED_LINE_S for _, s in event.handed)
        if not (due or held):  # most steps: nothing built
            return
        tasks = [[kind, s * 1e3] for kind, s in event.handed]
        common = dict(t=event.at, rows=event.rows, prompt_rows=event.prompt_rows, kv_positions=event.kv_positions,
                      launched=len(event.launched), predicted_ms=predicted * 1e3, ms=event.seconds * 1e3,
                      handed_ms=event.handed_over * 1e3)
        if due:
            self.trace.record("step", **common, **({"handed": tasks} if tasks else {}))
        if held:
            self.trace.record("handed", **common, tasks=tasks)

    def _trace_verdict(self, j: _Judging, refused: Rejected | None) -> None:
        if self.trace is None:
            return
        req, note, now = j.req, j.note, j.now
        t_nth = note.get("t_nth", math.inf)
        assert isinstance(t_nth, float)
        left = (req.deadline if req.deadline is not None else math.inf) - now
        self.trace.record("verdict", t=now, req=req.id, admitted=refused is None,
                          reason=None if refused is None else refused.reason, rule=note.get("rule"),
                          in_flight=len(j.active) + 1, prompt_tokens=len(req.prompt_ids),
                          cached_tokens=req.cached_tokens, level=j.level.labels, stretch=j.stretch,
                          since_arrival_ms=(now - req.arrival) * 1e3, left_ms=left * 1e3,
                          forecast_ms=(t_nth - now) / j.stretch * 1e3, stretched_ms=(t_nth - now) * 1e3, ahead=j.ahead,
                          **{k: v for k, v in note.items() if k not in ("t_nth", "rule")})

    def _costs(self, stretch: float) -> tuple[Callable[[int, int], float], Callable[[int, int], float],
                                              Callable[[int, int, int, int], float]]:
        """The latency model's step, prefill and run-of-steps times, stretched: the forecast's costs."""
        costs = self.latency.stretched(stretch)
        return costs.step, costs.prefill, costs.steps

    def _joined(self, j: _Judging) -> None:
        """Every admitted request's and the newcomer's predicted SLA-token time (stretched) with the newcomer joined
        (j.joined, by id()), and the admitted requests it makes late there (j.late: the `delays` rule judges them);
        or Rejected: the newcomer would be late. j.note gets the newcomer's forecast ("t_nth") and the rule that
        decided ("rule": late, probe), for the admission log."""
        req, active, now, stretch, note = j.req, j.active, j.now, j.stretch, j.note
        step_s, prefill_s, steps_s = self._costs(stretch)
        joined = j.joined = self.planner.forecast([*active, req], step_s, prefill_s, now, j.horizon_s, steps_s,
                                                  states=j.states, join_after=j.ahead)
        t_nth = note["t_nth"] = joined[id(req)]
        if self.best_effort:
            return
        if req.deadline is not None and t_nth > req.deadline:
            note["rule"] = "late"
            if not active:  # an idle server refusing: say why (at most every PROBE_EVERY_S: a probe or not)
                log.info("idle server: %s predicted %.1f ms to its SLA token (%.1f ms since arrival, forecast x "
                         "%.3f, the guard's stretch at %s)", req.id, (t_nth - req.arrival) * 1e3,
                         (now - req.arrival) * 1e3, stretch, j.level.labels)
            if not active and self._probe(req, t_nth, now):
                note["rule"] = "probe"
            else:
                raise self._late(j, t_nth)
        # an admitted request late beside the newcomer: does the newcomer delay it, and would it be on time without
        # it at the usual pace? (Else nobody can be made late, and the forecast without the newcomer, as long as the
        # first, is not needed.) The usual pace is the stretched forecast scaled: every cost in it carries the factor.
        # A request is judged over the span its score measures, from its first verdict (observe_nth): the bound the
        # guard states is its SLA token within `pace` x the model clock's time over that span, what its steps so far
        # were predicted to take plus the forecast of what is left. Its past counts at the pace in that clock's time
        # (in the wall's, a request whose steps had run 3% over the model lost 3% of its past x the stretch more: 66
        # of bf16's 76 `delays` refusals on the H200 had a victim on time by the bound), and never as less than the
        # time that really passed; before a step has ended in its span, as the wall's time at the pace.
        j.spent = {id(r): (now - p.at, self.model_clock.span(r.id)) for r in active
                   if (p := self._promises.get(r.id)) is not None}
        j.late = [r for r in active if r.deadline is not None and j.over(r, joined[id(r)], stretch) > 0]
        if j.late:  # the usual pace is the `delays` rule's alone (a pooled median: not worked out for nothing)
            j.typical = self.guard.typical(j.level)

    def _waited(self, j: _Judging, waited_s: float) -> None:
        """The newcomer's forecast moved by the wait between the verdict's parts; Rejected if that makes it late."""
        req = j.req
        j.note["second_after_ms"] = waited_s * 1e3
        t_nth = j.joined[id(req)] + waited_s
        j.joined[id(req)] = j.note["t_nth"] = t_nth
        if not self.best_effort and req.deadline is not None and t_nth > req.deadline:
            j.note["rule"] = "late"
            raise self._late(j, t_nth)

    def _late(self, j: _Judging, t_nth: float) -> Rejected:
        """The refusal of a newcomer forecast to reach its SLA token at t_nth, past its deadline."""
        return Rejected("overloaded" if j.active else "sla_unmeetable",
                        f"the server cannot deliver {j.req.sla_token_index} tokens within {self.sla_s * 1e3:.0f} ms "
                        "now" + (f" (predicted {(t_nth - j.now) * 1e3:.0f} ms)" if t_nth < math.inf else ""),
                        self.retry_after_s(j.active, j.now))

    def _delays(self, j: _Judging) -> None:
        """The `delays` rule: Rejected where the newcomer delays an admitted request late beside it that would be on
        time without it at the usual pace (the second forecast, from the first's moment and states)."""
        if not j.late:
            return
        step_s, prefill_s, steps_s = self._costs(j.stretch)
        alone = self.planner.forecast(j.active, step_s, prefill_s, j.now, j.horizon_s, steps_s, states=j.states[:-1],
                                      join_after=j.ahead)
        for r in j.late:
            if j.joined[id(r)] > alone[id(r)] + DELAYS_NOBODY_S and j.over(r, alone[id(r)], j.typical) <= 0:
                wall, model = j.spent.get(id(r), (0.0, None))
                j.note.update(rule="delays", victim_over_ms=j.over(r, j.joined[id(r)], j.stretch) * 1e3,
                              victim_alone_over_ms=j.over(r, alone[id(r)], j.stretch) * 1e3,
                              victim_since_ms=wall * 1e3, victim_model_ms=_ms(model))
                raise Rejected("overloaded", "admitting this request would make an admitted one miss its SLA",
                               self.retry_after_s(j.active, j.now))

    def _probe(self, req: Request, t_nth: float, now: float) -> bool:
        """Admit a request predicted to miss, on an idle server (it can delay nobody), now and then: otherwise a
        latency model that is too pessimistic (a stalled calibration sample, slow steps seen in a load spike) would
        refuse everything for ever, never observing the steps that would correct it. A latency model that no served
        step has checked yet is the calibration alone, and is given more room: a start-up on a busy host had timed
        one-row steps at 267 ms that took 72 ms a second later, and its strict server refused every request, idle or
        not, for good. What a probe doubts is the forecast, not the time a request spent before it got here: it is
        judged by the budget left."""
        left = (req.deadline if req.deadline is not None else req.arrival + self.sla_s) - now
        if now - self._last_probe < PROBE_EVERY_S or left <= 0 or t_nth - now > self._probe_within() * left:
            return False
        self._last_probe = now
        log.info("admitting %s as a probe: predicted %.0f ms for its SLA token on an idle server (SLA %.0f ms)",
                 req.id, (t_nth - req.arrival) * 1e3, self.sla_s * 1e3)
        return True

    def _probe_within(self) -> float:
        """How many SLAs away an idle server's prediction may be for a probe."""
        return PROBE_WITHIN_UNCHECKED if self.latency.observed_steps == 0 else PROBE_WITHIN

    def _in_flight(self) -> list[Request]:
        """Admitted requests still to be served: not ended, and not cancelled (the engine drops a cancelled one before
        its next step; a barge-in's next turn, sent as soon as response.done came, must not be judged beside it)."""
        return [r for r in self._active.values() if r.state is not State.FINISHED and not r.cancelled]

    def release(self, req: Request) -> None:
        with self._lock:
            self._active.pop(req.id, None)
            self._promises.pop(req.id, None)
        self.model_clock.forget(req.id)

    def observe_nth(self, req: Request, at: float) -> None:
        """The SLA token came out at `at`: the guard learns whether it was late, and, where it is the SLA's own token
        (not the last of a shorter reply: a few steps' forecast errs differently), how far the latency model was off
        over its span (ModelClock; nothing to score where no step was committed since its verdict)."""
        with self._lock:
            promise = self._promises.pop(req.id, None)
        model_s, ran_s = self.model_clock.span(req.id), self.model_clock.ran(req.id)
        self.model_clock.forget(req.id)
        if req.deadline is not None:
            self.guard.judged(at > req.deadline)
        if promise is None or req.sla_token_index != self.sla_tokens:
            return
        score = (at - promise.at) / model_s if model_s else math.inf
        self.guard.observe(promise.level, score, promise.stretch)
        if self.trace is not None:
            self.trace.record("sla_token", t=at, req=req.id, after_verdict_ms=(at - promise.at) * 1e3,
                              model_ms=_ms(model_s), steps_ms=_ms(ran_s),
                              forecast_ms=(promise.predicted - promise.at) * 1e3, score=score,
                              latest_score=promise.latest_score(at), stretch=promise.stretch,
                              level=promise.level.labels, late=req.deadline is not None and at > req.deadline,
                              since_arrival_ms=(at - req.arrival) * 1e3)
        if score > promise.stretch and at - self._over_logged_at >= OVER_LOG_EVERY_S:
            # what the guard erred on, to line up with the engine's and the GPU's logs
            self._over_logged_at = at
            log.info("%s reached its SLA token %.1f ms after its verdict, the steps since predicted %.1f ms: %.2fx, "
                     "over the stretch %.3f at %s (%.1f ms since arrival)", req.id, (at - promise.at) * 1e3,
                     (model_s or 0.0) * 1e3, score, promise.stretch, promise.level.labels,
                     (at - req.arrival) * 1e3)

    def consume(self, event: Event) -> None:
        """What a step committed: its time teaches the latency model (a step's, or the prefill launched before it),
        an SLA token (or an end before it) the guard, an end frees the request's place."""
        if isinstance(event, Token):  # most events, one a token: tested first
            if event.n == event.req.sla_token_index:
                self.observe_nth(event.req, event.at)
        elif isinstance(event, StepDone):
            # the model clock first, with what the model predicted before it learns from this step
            lat = self.latency
            predicted = lat.step(event.rows, event.kv_positions) + \
                sum(lat.prefill(tokens, cached) for tokens, cached in event.launched)
            self.model_clock.tick(predicted, event.at, event.seconds)
            if event.seconds <= 0:
                return
            if self.trace is not None:
                self._trace_step(event, predicted)
            if event.launched:  # the step's time is mostly the launches'
                rest = max(0.0, event.seconds - self.latency.step(event.rows, event.kv_positions))
                for tokens, cached in event.launched:
                    self.latency.observe_prefill(tokens, cached, rest / len(event.launched))
            else:
                self.latency.observe_step(event.rows, event.seconds, event.kv_positions)
        elif isinstance(event, Finished):
            req = event.req
            if event.token is not None and event.n == req.sla_token_index:
                self.observe_nth(req, event.at)
            elif event.reason in ("stop", "length") and req.deadline is not None and event.n < req.sla_token_index:
                self.guard.judged(event.at > req.deadline)  # it ended before its SLA token: judged by its last
            self.release(req)

    # -- what operators and clients read ------------------------------------------------------------------
    def retry_after_s(self, active: list[Request], now: float) -> float:
        """When capacity will likely be back: the soonest any admitted request ends."""
        step = self.latency.step(max(1, len(active)))
        soonest = min((_remaining(r) * step for r in active), default=0.0)
        return max(soonest, step)

    def headroom(self, now: float) -> float:
        """Smallest predicted slack before an admitted request's deadline; the whole SLA when idle."""
        with self._lock:
            active = self._in_flight()
        step = self.latency.step(max(1, len(active)))
        slack = [r.deadline - (now + _left_to_nth(r) * step) for r in active
                 if r.deadline is not None and _left_to_nth(r) > 0]
        return min(slack, default=self.sla_s)

    def snapshot(self) -> dict[str, object]:
        """The guard as GET /v1/latency_model shows it."""
        late, exceeded = self.guard.miss_rate()
        return {"target": self.guard.target, "late_share_last_minute": round(late, 4),
                "over_stretch_share_last_minute": round(exceeded, 4),
                "levels": [{**s.level.labels, "stretch": round(s.stretch, 4), "scores": s.scores}
                           for s in self.guard.levels()]}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


_PROMPT_LEFT = attrgetter("prompt_left")  # a request's prompt tokens still to prefill, in a snapshot (ForecastState)


def _remaining(r: Request) -> int:
    return max(0, r.params.max_tokens - len(r.output_ids))


def _left_to_nth(r: Request) -> int:
    return max(0, r.sla_token_index - len(r.output_ids))
