"""Engine: one thread that executes step plans. Each iteration it asks the planner (planner.py) for the next step —
decode rows of running requests, chunks of new prompts riding beside them, prefix copies, separate launches of long
prompts — runs it on the decoder, and commits the step before it (commit.py): tokens and ends become events, which it
streams as deltas to each request's sink and hands to metrics and admission. On a GPU it runs a step ahead: the next
step is launched before the last one's tokens are read back, fed the tokens chosen on the device, so that the host's
work per token hides behind the kernel. Its interface (submit, cancel, sessions, truncate, drain) is all the API layer
sees, in this process or, with `--engine-process`, through service/engine_process.py (which sends a step's deltas
in one message from `on_published`, before metrics and admission hear the step's events).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from service.backends.decoder import Decoder, Fed
from service.engine import sampler
from service.engine.admission import Admission, AdmitAll, Rejected
from service.engine.collector import Collector
from service.engine.commit import Event, Finished, StepDone, Token, commit
from service.engine.handoff import HANDOFF_BUDGET_S, Handoff, Then
from service.engine.host_path import READ, IdleGaps
from service.engine.kv_slots import KVSlots, Session
from service.engine.launch_first import LaunchedFirst, fits_one_step, nowhere
from service.engine.loop_clock import LoopClock
from service.engine.masks import StepMasks
from service.engine.output import TextOutput
from service.engine.planner import LAUNCH_MIN_TOKENS, Planner
from service.engine.prefix_cache import block_hashes
from service.engine.request import Delta, Request, SamplingParams, State
from service.engine.sampler import StepTokens
from service.engine.slow_steps import SlowIterations, SlowSteps, thread_clock
from service.engine.step_plan import StepPlan
from service.engine.token_ring import TokenRing
from service.metrics import Metrics
from service.model.tokenizer import Tokenizer

log = logging.getLogger("parley.engine")

FEED_BUFFERS = 4  # pinned buffers the fed rows' indices go through, in turn
VERDICT_WEIGHT = 0.05  # Engine.prepare_s, verdict_s, delays_s: each submit's weight in the running means of its parts
DEFAULT_MAX_ROWS = 16  # rows a step carries (decode rows and prompt tokens): the token budget (README: why 16)


@dataclass
class EngineStats:
    running: int  # seated: prefilling or decoding
    waiting: int
    free_slots: int  # KV slots no running request holds (empty, or caching an idle conversation)
    total_slots: int
    cached_slots: int = 0  # KV slots caching an idle conversation


@dataclass
class Launched:
    """A step on its way: its plan, its tokens (chosen on the device, not read yet), when it was launched, and the
    handed-over work within its cadence that its launch's iteration ran (where that iteration completed no step)."""

    plan: StepPlan
    tokens: StepTokens
    t0: float
    handed_s: float = 0.0
    handed: tuple[tuple[str, float], ...] = ()


class Engine:
    def __init__(self, decoder: Decoder, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...] = (),
                 metrics: Metrics | None = None, admission: Admission | None = None, sla_ms: float = 100.0,
                 sla_tokens: int = 64, max_waiting: int = 256, wedge_timeout_s: float = 30.0,
                 max_batch: int | None = None, max_rows: int | None = None,
                 launch_min_tokens: int = LAUNCH_MIN_TOKENS, prefill_rows: int | None = None,
                 handoff_budget_s: float = HANDOFF_BUDGET_S) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.metrics = metrics or Metrics(sla_tokens)
        self.sla_s, self.sla_tokens = sla_ms / 1e3, sla_tokens
        self.max_waiting = max_waiting
        self.wedge_timeout_s = wedge_timeout_s
        # requests seated together (decoding or prefilling), and KV slots: cached conversations, at least as many
        self.max_batch = min(max_batch or decoder.max_slots, decoder.max_slots)
        self.max_rows = max_rows or getattr(decoder, "max_rows", None) or DEFAULT_MAX_ROWS
        self.planner = Planner(KVSlots(decoder.max_slots), self.max_batch, self.max_rows, decoder.max_context,
                               launch_min_tokens, prefill_rows)
        self.admission: Admission = admission or AdmitAll(sla_ms / 1e3)
        self.admission.bind(self.planner)
        # called on the engine thread after every iteration: the engine process sends the iteration's deltas then
        self.on_iteration: Callable[[], None] | None = None
        # ...and as soon as a batch of events has been streamed to the sinks, before their bookkeeping (_publish)
        self.on_published: Callable[[], None] | None = None
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self.handoff = Handoff()  # work for this thread while the GPU runs a step (run_soon)
        self.handoff_budget_s = handoff_budget_s  # how much of it starts beside one step (the first task always does)
        # Python's garbage collections, run beside launched steps (set where a serving process paces them: runtime.py)
        self.collector: Collector | None = None
        # what a submit's parts take, running means: each one's expected cost where it is handed over
        self.prepare_s = 0.0  # prepare(): the request built, its prefix looked up
        self.verdict_s = 0.0  # admit(): admission's verdict (its first part)
        self.delays_s = 0.0  # ...its second, where it has one (the `delays` rule's second forecast)
        self._live: set[Request] = set()  # admitted, not ended: each gets its final delta, whatever fails
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the counts the API reads
        self._stopping = False
        self.accepting = True
        self._thread: threading.Thread | None = None
        self._busy_since: float | None = None
        self.overlap = decoder.device.type == "cuda"  # run a step ahead
        self._inflight: Launched | None = None
        self._launched_first: list[LaunchedFirst] = []  # seated before their verdicts, judged after the launch
        self._before_plan = False  # the engine thread runs handed-over work before planning, nothing in flight
        self._feed_host = torch.zeros(FEED_BUFFERS, 3 * self.planner.prefill_rows, dtype=torch.int64,
                                      pin_memory=self.overlap and torch.cuda.is_available())
        self._feed_rows = self._feed_host.numpy()  # the same memory, filled from lists by numpy (3x faster than torch)
        self._feed_at = 0
        self._masks = StepMasks()  # where constrained rows' grammar masks go to the device
        self._token_ring = TokenRing(self.max_batch) if self.overlap else None  # the tokens' trips to the host
        self._last_completed = 0.0
        self._resumed = time.perf_counter()  # when the engine last woke from waiting for work (or was made)
        self._slow_steps = SlowSteps()
        self._slow_iterations = SlowIterations()
        self._launch_phases: dict[str, float] = {}
        self._read_wait = 0.0  # this iteration's time blocked reading a step's tokens (the host waiting on the device)
        self._clock = LoopClock(decoder.device, self.metrics.engine_host,
                                self.metrics.track_gpu_idle() if decoder.device.type == "cuda" else None,
                                step_gpu=self.metrics.step_gpu,
                                idle_gaps=IdleGaps(self.metrics.idle_gaps, self.metrics.idle_gap_seconds))
        # where the decoder can say when its step's GPU work starts (after its host-side preparation), the clock's
        # step starts there; else right before decode() is called
        self._decoder_starts_clock = hasattr(decoder, "before_launch")
        self._decoder_feeds = getattr(decoder, "feeds", False)  # takes a Fed (service/backends/decoder.py)
        if self._decoder_starts_clock:
            decoder.before_launch = self._clock.step_start  # type: ignore[attr-defined]
        self._slow_prefills = 0  # the decoder's count, as last exported
        self._query_block_steps = 0  # the same
        self.stats = EngineStats(0, 0, decoder.max_slots, decoder.max_slots)
        self.metrics.kv_slots_total.set(decoder.max_slots)
        self.metrics.sla_seconds.set(self.sla_s)
        self.metrics.sla_headroom.set(self.sla_s)
        self.metrics.kv_slots_free.set(decoder.max_slots)
        self.metrics.kv_slots_cached.set(0)

    # -- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="parley-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop admitting; wait until every admitted request has finished. True if it did in time."""
        self.accepting = False
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            s = self.stats
            if s.running == 0 and s.waiting == 0 and self._inbox.empty():
                return True
            time.sleep(0.01)
        return False

    def healthy(self) -> bool:
        """False once the engine thread died or a step has hung for longer than wedge_timeout_s."""
        if self._thread is None or not self._thread.is_alive():
            return False
        busy = self._busy_since
        return busy is None or time.monotonic() - busy < self.wedge_timeout_s

    # -- the API's side (any thread) ----------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Delta], None],
               session: Session | None = None, arrival: float | None = None,
               received: float | None = None, delivery_s: float = 0.0) -> Request:
        """Validate, admit (or raise Rejected) and enqueue: prepare() then admit(). ValueError for input the model
        cannot take. `received`: when the engine's process read the request (else now); `delivery_s`: how long tokens
        take from here to the front end lately (admission leaves room for it)."""
        req = self.prepare(prompt_ids, params, sink, session, arrival, delivery_s)
        return self.admit(req, received)

    def prepare(self, prompt_ids: list[int], params: SamplingParams, sink: Callable[[Delta], None],
                session: Session | None = None, arrival: float | None = None, delivery_s: float = 0.0,
                detokenize: bool = True) -> Request:
        """A submit's first half: the request validated (ValueError, or Rejected while draining), built, and its
        prompt's cached prefix looked up, for admit() to decide on. `detokenize`: False where the sink's side turns
        the token ids into text itself (an engine process's front end, for a request without stop strings): its
        deltas then carry token ids and no text."""
        if not self.accepting:
            raise Rejected("draining", "the server is shutting down", retry_after_s=5.0, status=503)
        started = time.perf_counter()
        ctx = self.decoder.max_context
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > ctx:
            raise ValueError(f"this model's context is {ctx} tokens; the prompt has {len(prompt_ids)} and "
                             f"max_tokens asks for {params.max_tokens} more")
        vocab = self.decoder.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # in C: a generator over the prompt took ~50 ns a token
            raise ValueError(f"token ids must lie in [0, {vocab})")
        req = Request(prompt_ids=list(prompt_ids), params=params, sink=sink, session=session,
                      output=TextOutput(self.tokenizer.detokenizer(), params.stop) if detokenize else None,
                      sla_tokens=self.sla_tokens)
        if arrival is not None:
            req.arrival = arrival
        req.delivery_s = delivery_s
        req.prompt_blocks = block_hashes(req.prompt_ids)
        req.cached_tokens = self.planner.slots.expected_cached(req.prompt_ids, req.prompt_blocks, session)
        req.choice = sampler.choice_of(req, self.decoder.draws_tokens)
        req.lifted_choice = sampler.unconstrained_choice(params, self.decoder.draws_tokens)
        self.prepare_s += VERDICT_WEIGHT * (time.perf_counter() - started - self.prepare_s)
        return req

    def admit(self, req: Request, received: float | None = None) -> Request:
        """A submit's second half: admission's verdict on a prepared request (Rejected, or it is enqueued and
        returned). It takes about `verdict_s` + `delays_s` (admission's forecasts, mostly)."""
        for _ in self.admit_in_parts(req, received):
            pass
        return req

    def admit_in_parts(self, req: Request, received: float | None = None) -> Iterator[None]:
        """admit() in parts, each run by next(), where admission's verdict has them (service/admission.py: its
        `delays` rule's second forecast apart from the first); the first takes about `verdict_s`, a second about
        `delays_s`. The end enqueues the request, Rejected refuses it."""
        received = time.perf_counter() if received is None else received
        with self._lock:
            full = self.stats.waiting >= self.max_waiting
        if full:
            raise self._refused(Rejected("queue_full", "too many requests are waiting", retry_after_s=1.0))
        yield from self._judged(req, received)
        self._enqueue(req)

    def launch_first(self, req: Request, received: float, on_verdict: Callable[[Rejected | None], None]) -> bool:
        """On an idle GPU engine (this thread, nothing seated, waiting or in flight), a prepared request whose prompt
        fits one step and has no grammar: seated now, its verdict run right after its step is launched, as if run now
        (engine/launch_first.py); `on_verdict` hears it there (None: admitted). False, and nothing done, elsewhere."""
        if not (self.overlap and self._before_plan and threading.current_thread() is self._thread
                and not self._launched_first and self.planner.idle() and self._inbox.empty()
                and req.constraint is None and fits_one_step(req, self.planner.prefill_rows)):
            return False
        self._launched_first.append(LaunchedFirst(req, self.admission.moment(req), received, on_verdict))
        self._enqueue(req, counted=False)
        return True

    def _judged(self, req: Request, received: float, moment: object = None) -> Iterator[None]:
        """Admission's verdict on `req` in its parts (Rejected refuses), its time and what it left of the SLA budget
        into the metrics. `moment`: what it judges from (launch_first), else now."""
        # Not under self._lock: a verdict forecasts for up to a millisecond, and the engine thread takes that lock
        # every iteration (admission has its own, which the engine thread never waits on for a verdict).
        took: list[float] = []  # each part's own time (not the wait between them)
        try:
            parts = self.admission.verdict(req) if moment is None else self.admission.verdict(req, moment)
            while True:
                started = time.perf_counter()
                try:
                    next(parts)
                except StopIteration:
                    break
                finally:  # each part's mean learns as soon as it has run
                    took.append(time.perf_counter() - started)
                    if len(took) == 1:
                        self.verdict_s += VERDICT_WEIGHT * (took[0] - self.verdict_s)
                    else:
                        self.delays_s += VERDICT_WEIGHT * (took[-1] - self.delays_s)
                yield
        except Rejected as r:
            self._refused(r)
            raise
        finally:  # admitted or refused: how much of its SLA budget was gone by then, and where it went
            decided = time.perf_counter()
            self.metrics.verdict_after.observe(decided - req.arrival)
            self.metrics.received_after.observe(max(0.0, received - req.arrival))
            self.metrics.forecast_time.observe(sum(took))
        self.metrics.sla_headroom.set(self.admission.headroom(time.perf_counter()))

    def _enqueue(self, req: Request, counted: bool = True) -> None:
        """Into the engine's inbox (the planner takes it at its next iteration); `counted`: its prompt tokens into
        the metrics now (else once admitted: launch_first)."""
        with self._lock:
            self._live.add(req)
            self.stats.waiting += 1
            self.metrics.waiting.set(self.stats.waiting)
        if counted:
            self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        self._inbox.put(req)
        self._wake.set()

    def _judge_launched_first(self, handed: list[tuple[str, float]]) -> float:
        """The verdicts of the requests seated before them (launch_first), right after their step's launch: each
        admitted, or withdrawn and refused; their seconds (the step's handed-over work, in `handed` as a verdict)."""
        started = time.perf_counter()
        judging, self._launched_first = self._launched_first, []
        for lf in judging:
            refusal: Rejected | None = None
            try:
                for _ in self._judged(lf.req, lf.received, lf.moment):
                    pass  # a second part (the `delays` rule) needs others admitted: none beside an idle engine
                self.metrics.prompt_tokens.inc(len(lf.req.prompt_ids))
            except Rejected as r:
                refusal = r
            except Exception as e:  # a bug: the request is withdrawn and its front end still gets an answer
                log.exception("judging %s after its launch failed", lf.req.id)
                refusal = Rejected("engine_error", f"the engine could not take the request: {e}", 1.0, status=503)
            if refusal is not None:
                self._withdraw(lf.req)
            try:
                lf.on_verdict(refusal)
            except Exception:
                log.exception("answering the verdict on %s failed", lf.req.id)
        took = time.perf_counter() - started
        handed.append(("verdict", took))
        return took

    def _withdraw(self, req: Request) -> None:
        """A request seated before its verdict and refused: nothing more of it goes out (its sink is nowhere, its events
        reach neither metrics nor admission), and it is dropped before the next step, its slot freed."""
        req.withdrawn = True
        req.sink = nowhere
        req.cancelled = True

    def run_soon(self, task: Callable[[], Then | None], cost_s: float = 0.0, kind: str = "task") -> None:
        """Run `task` on the engine thread as soon as it can: at once where it is idle, else right after it has
        launched its next step, while the GPU runs it, where it fits (`cost_s`: what it is expected to take; a task may
        hand the rest of its work on as a Then: service/engine/handoff.py; another thread runs it instead where the
        engine thread has not started it within the handoff's patience; `kind` names it in the admission log)."""
        self.handoff.put(task, cost_s, kind)
        self._wake.set()

    def _refused(self, r: Rejected) -> Rejected:
        """A refusal counted; the caller raises it. (Raised here, it would sit in a local of a frame its own traceback
        holds: a reference cycle, ~50 objects a refusal left to the garbage collector.)"""
        self.metrics.requests.labels(outcome="rejected", reason=r.reason).inc()
        return r

    def cancel(self, req: Request) -> None:
        """Free the request's slot before the next step (barge-in, a dropped stream)."""
        if req.state is not State.FINISHED:
            req.cancelled = True
            self._wake.set()

    def new_session(self) -> Session:
        return Session()

    def close_session(self, session: Session) -> None:
        """The conversation is over: its slot is unpinned, its K/V stay cached like any request's."""
        self.planner.slots.close(session)

    def truncate(self, session: Session, keep_tokens: int) -> None:
        """Between turns (after a barge-in): the session's cached K/V keep only their first `keep_tokens` tokens,
        before any later submit for it. A no-op where its slot was evicted or holds fewer."""
        self.planner.slots.truncate(session, keep_tokens)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[Delta]:
        """Blocking convenience for scripts and tests: the deltas of one request."""
        q: queue.SimpleQueue[Delta] = queue.SimpleQueue()
        self.submit(prompt_ids, params, q.put)
        while True:
            d = q.get()
            yield d
            if d.finish_reason is not None:
                return

    # -- the engine thread --------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                self._iteration()
            except Exception:  # a bug here must not kill the thread: fail what is in flight and go on
                log.exception("engine iteration failed")
                self._fail_all()
            if self.on_iteration is not None:
                try:
                    self.on_iteration()
                except Exception:
                    log.exception("sending an iteration's output failed")
            self._clock.mark("send out")

    def _iteration(self) -> None:
        started = time.perf_counter()
        thread = thread_clock()
        self._read_wait = 0.0
        # nothing on the GPU: handed-over work (verdicts) first, so that its requests plan now; it is within the
        # cadence of the step this iteration launches, and the host's time (no step ran beside it)
        handed_before: list[tuple[str, float]] = []
        # (a request seated before its verdict stops them: the tasks after it are judged beside its step, after it)
        before = 0.0
        if self._inflight is None:
            self._before_plan = True
            before = self.handoff.run_all(ran=handed_before, stop=self._has_launched_first)
            self._before_plan = False
        self._take_inbox()
        now = time.perf_counter()
        self._publish([Finished(r, "cancelled", now) for r in self.planner.take_cancelled()])
        self._clock.mark("inbox")
        inflight = self._inflight
        plan = self.planner.plan(None if inflight is None else inflight.plan, now)
        self._clock.mark("plan")
        if not plan:  # nothing to run now: read what is in flight, or wait for work
            self._inflight = None
            if inflight is not None:
                handed: list[tuple[str, float]] = []
                # while the GPU finishes the step in flight
                overlapped = self.handoff.run_all(self.handoff_budget_s, handed)
                overlapped += self._collect_beside(overlapped, handed)
                self._clock.mark("handed over")
                self._complete(inflight, overlapped, handed)
                self.planner.steps_ahead = 0
                self._clock.mark("commit")
                self._clock.iteration(time.perf_counter() - started - overlapped, self._read_wait)
            else:
                self._update_gauges()
                if self.collector is not None:
                    self.collector.when_idle()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                self._resumed = time.perf_counter()
                self._clock.mark("idle")
            return
        t_plan = time.perf_counter()
        launched = self._launch(plan, inflight)
        # what a request admitted beside this step cannot join: the step before, still in flight, and this one (on
        # the CPU a step has run by the time its launch returns)
        self.planner.steps_ahead = (inflight is not None) + (launched is not None and self.overlap)
        # while the GPU runs the step; as much as fits in it, so that the GPU does not wait for the next
        handed = []
        overlapped = self._judge_launched_first(handed) if self._launched_first else 0.0
        if launched is not None:
            overlapped += self.handoff.run_all(self.handoff_budget_s, handed)
            overlapped += self._collect_beside(overlapped, handed)
        self._clock.mark("handed over")
        t_launch = time.perf_counter()
        self._inflight = None
        if inflight is not None:
            self._complete(inflight, overlapped, handed)
        if launched is not None:
            if self.overlap:
                self._inflight = launched
                if inflight is None:  # this iteration's handed-over work (before and beside it) is within its cadence
                    launched.handed_s, launched.handed = before + overlapped, (*handed_before, *handed)
            else:
                self._complete(launched, before + overlapped, handed_before + handed)
        self.planner.steps_ahead = int(self._inflight is not None)
        self._clock.mark("commit")
        t_complete = time.perf_counter()
        self._update_gauges()
        self._clock.mark("gauges")
        end = time.perf_counter()
        self._slow_iterations.observe({"plan": t_plan - now, **self._launch_phases, "handed over": overlapped,
                                       "complete": t_complete - t_launch, "gauges": end - t_complete}, thread,
                                      lambda: f"{plan.rows} rows ({plan.prompt_rows} prompt) over {plan.kv_positions} "
                                              "positions",
                                      # the decoder's own parts of its call, where it says them (the megakernel's wait
                                      # for its last input copy, its copies and launch after the step's start): a
                                      # decode of milliseconds on the H100 named no part
                                      {"decode": getattr(self.decoder, "decode_phases", {})})
        # the host's time leaves out what ran while the GPU ran the step just launched: no step waited for it
        self._clock.iteration(end - started - overlapped, self._read_wait + self._step_compute())

    def _has_launched_first(self) -> bool:
        return bool(self._launched_first)

    def _collect_beside(self, overlapped: float, handed: list[tuple[str, float]]) -> float:
        """A due garbage collection beside the step on the GPU, in what the handed-over work left of its slack; its
        seconds (0 where none ran), and its kind and seconds in `handed` (the step's handed-over work)."""
        swept = None if self.collector is None else self.collector.beside_step(self.handoff_budget_s - overlapped)
        if swept is None:
            return 0.0
        handed.append(swept)
        return swept[1]

    def _step_compute(self) -> float:
        """The launch's time that was the step's own compute: none on a GPU (launches return at once); on the CPU the
        decoder's calls and the choice of tokens, which run on this thread (a grammar mask's wait is the host's)."""
        if self.overlap:
            return 0.0
        p = self._launch_phases
        return p.get("copies+prefills", 0.0) + p.get("decode", 0.0) + p.get("choose", 0.0) - p.get("mask wait", 0.0)

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item.state is not State.FINISHED:  # else failed already, by _fail_all
                self.planner.add(item)

    def _fail_all(self) -> None:
        """After an iteration failed: every admitted request that has not ended (waiting, running, or in flight)
        ends now with an error, so that no client waits for ever."""
        self._inflight = None
        with self._lock:
            live = list(self._live)
        now = time.perf_counter()
        for req in live:
            try:
                self._publish([Finished(req, "error", now, error="internal engine error")])
            except Exception:
                log.exception("failing %s failed", req.id)
            if req in self._live:  # publishing failed: the client still gets its final delta
                with self._lock:
                    self._live.discard(req)
                try:
                    req.sink(Delta("", [], finish_reason="error", error="internal engine error", usage=req.usage()))
                except Exception:
                    log.exception("the final delta of %s could not be sent", req.id)
        self.planner.waiting.clear()
        self.planner.prefilling.clear()
        self.planner.running.clear()
        self.planner.steps_ahead = 0

    def _launch(self, plan: StepPlan, inflight: Launched | None) -> Launched | None:
        """Run a plan on the decoder, without waiting for it: prefix copies, separate prefill launches, the step, and
        the choice of its tokens on the device. A failure fails the plan's requests alone."""
        t0 = time.perf_counter()
        self._busy_since = time.monotonic()
        self._launch_phases = {}
        try:
            if plan.copies or plan.launches:
                self._clock.step_start()  # the step's GPU work starts with them
            for c in plan.copies:
                self.decoder.copy_prefix(c.src, c.dst, c.tokens)
            for lc in plan.launches:
                self.decoder.prefill(_slot(lc.req), lc.req.prompt_ids[lc.start:lc.end], lc.start)
            t1 = time.perf_counter()
            self._clock.mark("prefills")
            rows = self._row_tokens(plan, inflight)
            t2 = time.perf_counter()
            self._clock.mark("feed")
            # constrained rows' masks (computed off this thread): into the step where the decoder masks there
            constrained = {i: r.constraint for i, r in enumerate(plan.sampled) if r.constraint is not None}
            collected = self._masks.collect(constrained) if constrained else None
            masked_in_step = collected is not None and self.decoder.draws_tokens
            if not self._decoder_starts_clock:
                self._clock.step_start()
            out = self.decoder.decode(plan.slots, rows, plan.positions, sampler.draws(plan.sampled, masked_in_step),
                                      sampled_rows=len(plan.sampled),
                                      masks=collected.masks if masked_in_step and collected else None)
            t3 = time.perf_counter()
            self._clock.mark("launch")
            tokens = sampler.choose(out, plan.sampled, collected, self._masks, masked_in_step, self._token_ring)
            prompt = bool(plan.copies or plan.launches or plan.chunks)
            self._clock.step_end(consecutive=inflight is not None, kind="prompt" if prompt else "decode")
            self._launch_phases = {"copies+prefills": t1 - t0, "feed": t2 - t1, "decode": t3 - t2,
                                   "choose": time.perf_counter() - t3}
            self._clock.mark("choose")
            if tokens.mask_waits:  # grammar masks not ready in time: the engine thread waited (part of choose)
                self._launch_phases["mask wait"] = tokens.mask_wait_s
                self.metrics.grammar_mask_waits.inc(tokens.mask_waits)
        except Exception as e:
            self._clock.step_failed()
            log.exception("step failed")
            self._publish([Finished(r, "error", time.perf_counter(), error=f"step failed: {e}")
                           for r in _requests_of(plan) if r.state is not State.FINISHED])
            return None
        finally:
            self._busy_since = None
        return Launched(plan, tokens, t0)

    def _row_tokens(self, plan: StepPlan, inflight: Launched | None) -> list[int] | torch.Tensor | Fed:
        """Each row's token: from the host, or (fed rows) the token the step in flight chose, still on the device:
        for a decoder that feeds, the rows and their sources (a Fed); for another, a device tensor of the tokens."""
        if not plan.feed:
            return plan.tokens
        assert inflight is not None, "a fed row needs the step before it"
        chosen = inflight.tokens.chosen
        if self._decoder_feeds:  # the decoder gathers them within its own input copy: no torch call here
            return Fed(plan.tokens, list(plan.feed), list(plan.feed.values()), chosen)
        n, k = plan.rows, len(plan.feed)
        if k == n <= len(chosen) and all(row == src for row, src in plan.feed.items()):
            # every row takes the token its own row chose (the same requests decoding step after step): those tokens
            # in order, as they are (a decoder only reads its token tensor), where the general case below takes five
            # torch calls
            return chosen[:n]
        # one copy of [tokens | fed rows | their sources] from a pinned buffer (allocating pinned memory each step
        # can stall the host); a buffer is refilled only FEED_BUFFERS steps later, long after its copy has run. As few
        # torch calls as can be: each releases the GIL, and taking it back from a thread running Python (the API's)
        # waits up to a switch interval: 11 calls here had taken up to 6.2 ms on the H100 (3.5 ms p99 on the CPU
        # beside a busy Python thread, 2.0 with these 5)
        self._feed_at = (self._feed_at + 1) % FEED_BUFFERS
        host = self._feed_host[self._feed_at, :n + 2 * k]
        self._feed_rows[self._feed_at, :n + 2 * k] = [*plan.tokens, *plan.feed, *plan.feed.values()]
        dev = host.to(chosen.device, non_blocking=True)
        tokens = dev[:n] if dev.dtype == chosen.dtype else dev[:n].to(chosen.dtype)
        return tokens.index_copy(0, dev[n:n + k], chosen.index_select(0, dev[n + k:]))

    def _complete(self, launched: Launched, handed_over: float = 0.0,
                  handed: list[tuple[str, float]] | None = None) -> None:
        """Read a launched step's tokens back and commit it; `handed_over`: the seconds of handed-over work this
        iteration ran before it (within the step's cadence), `handed` each task's (kind, seconds)."""
        self._busy_since = time.monotonic()
        t0 = time.perf_counter()
        try:
            launched.tokens.read()
        except Exception as e:
            log.exception("reading a step's tokens failed")
            now = time.perf_counter()
            self._publish([Finished(r, "error", now, error=f"step failed: {e}")
                           for r in _requests_of(launched.plan) if r.state is not State.FINISHED])
            return
        finally:
            self._busy_since = None
            self._read_wait += time.perf_counter() - t0
            self._clock.mark(READ)
        now = time.perf_counter()
        # The step as a client sees it: from the last step's end while the engine ran step after step (the host's
        # work and stalls between steps included: the cadence tokens come at, which admission must learn), from its
        # launch where the engine had waited for work since, or where the step carried prefill launches: their time
        # is learned as the prefill's, uncapped, and a host stall before them (the API thread templating a long
        # conversation) must not be learned as a slow prefill.
        cadence = self._last_completed >= self._resumed and not launched.plan.launches
        seconds = now - (self._last_completed if cadence else launched.t0)
        self._last_completed = now
        self._publish(commit(launched.plan, launched.tokens.token, self.eos, self.decoder.max_context, now,
                             seconds, launched.handed_s + handed_over, (*launched.handed, *(handed or ()))))

    def _publish(self, events: list[Event]) -> None:
        """Stream each event's delta to its request and end the requests that ended; then, the deltas on their way
        (`on_published`: the engine process sends them), give the ended requests' slots back and hand the events to
        metrics and admission. None of that bookkeeping (the slot's cached prefix, the latency model, the guard, the
        headroom's forecast after an end) is on the tokens' way: on the H100 a stream's last token came 0.13 ms later
        than the others, behind its end's (bench/NOTES.md, s87 and s88). A request whose sink raises fails alone."""
        heard: list[Event] = []
        ended: list[Request] = []
        ended_at = None
        for ev in events:
            if isinstance(ev, Token):  # most events: nothing else checked first (a withdrawn request has none: it is
                # finished before the step it was launched in commits)
                try:
                    ev.req.sink(Delta(ev.text, [ev.token]))
                except Exception as e:
                    log.exception("streaming a token failed for %s", ev.req.id)
                    ev = Finished(ev.req, "error", ev.at, error=f"output failed: {e}")
            elif not isinstance(ev, StepDone) and ev.req.withdrawn:  # refused after its launch: it ends unheard
                if isinstance(ev, Finished) and self._send_end(ev):
                    self.planner.finish(ev.req)
                continue
            if isinstance(ev, Finished):
                if self._send_end(ev):
                    ended.append(ev.req)
                ended_at = ev.at
            heard.append(ev)
        if self.on_published is not None and heard:
            try:
                self.on_published()
            except Exception:
                log.exception("sending a step's output failed")
        for req in ended:
            self.planner.finish(req)
        for ev in heard:
            if isinstance(ev, StepDone):
                self._slow_steps.observe(ev.rows, ev.seconds)
            self.metrics.consume(ev)
            self.admission.consume(ev)
        if ended_at is not None:
            # the headroom changes as requests come and go (submit sets it too): not every step, whose admission
            # lock an admission check holds for a forecast
            self.metrics.sla_headroom.set(self.admission.headroom(ended_at))
        slow = self.decoder.slow_prefills
        if slow > self._slow_prefills:
            self.metrics.prefill_slow_path.inc(slow - self._slow_prefills)
            self._slow_prefills = slow
        blocked = self.decoder.query_block_steps
        if blocked > self._query_block_steps:
            self.metrics.query_block_steps.inc(blocked - self._query_block_steps)
            self._query_block_steps = blocked

    def _send_end(self, ev: Finished) -> bool:
        """A request's last delta (its last token and text, usage, timings) streamed; False where it had ended already
        (an error while its final delta went out). The caller gives its slot back (planner.finish) after the send:
        nothing in the delta depends on it, and a session's next turn waits for it on this thread."""
        req = ev.req
        if req not in self._live:
            return False
        text = ev.text
        if ev.reason in ("stop", "length") and req.output is not None:
            try:
                text += req.output.finish()
            except Exception:
                log.exception("flushing the output of %s failed", req.id)
        with self._lock:
            self._live.discard(req)
        try:
            req.sink(Delta(text, [] if ev.token is None else [ev.token], finish_reason=ev.reason, error=ev.error,
                           usage=req.usage(), timings=req.timings(ev.at)))
        except Exception:
            log.exception("the final delta of %s could not be sent", req.id)
        return True

    def _update_gauges(self) -> None:
        p, s, m = self.planner, self.stats, self.metrics
        free, cached = p.slots.counts()
        with self._lock:  # a gauge is set only where its figure changed: most iterations change none
            running, waiting = len(p.prefilling) + len(p.running), len(p.waiting) + self._inbox.qsize()
            if running != s.running:
                s.running = running
                m.running.set(running)
            if waiting != s.waiting:  # submit() sets both too, under this lock
                s.waiting = waiting
                m.waiting.set(waiting)
            if free != s.free_slots:
                s.free_slots = free
                m.kv_slots_free.set(free)
            if cached != s.cached_slots:
                s.cached_slots = cached
                m.kv_slots_cached.set(cached)


def _requests_of(plan: StepPlan) -> list[Request]:
    """Every request with a row in the plan (or a launch), once each."""
    seen: dict[int, Request] = {}
    for r in [*plan.sampled, *(c.req for c in plan.chunks), *(lc.req for lc in plan.launches)]:
        seen.setdefault(id(r), r)
    return list(seen.values())


def _slot(req: Request) -> int:
    if req.slot is None:
        raise RuntimeError(f"{req.id} runs without a KV slot")
    return req.slot
