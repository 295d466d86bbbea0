"""Engine: one scheduler thread that prefills new requests, runs one decode step for every running request, samples,
streams text deltas and frees slots. Its interface (submit, cancel, sessions, drain) is all the API layer sees.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from service.backends.decoder import Decoder
from service.engine.admission import Admission, AdmitAll, Rejected
from service.engine.kv_slots import Session
from service.engine.output import TextOutput
from service.engine.request import Delta, Request, SamplingParams, State, outcome_of
from service.engine.sampler import Sampler, SamplingError, StepTokens
from service.engine.scheduler import Scheduler
from service.engine.slow_steps import SlowSteps
from service.metrics import Metrics
from service.model.tokenizer import Tokenizer

log = logging.getLogger("parley.engine")


@dataclass
class _Step:
    """A launched decode step whose tokens have not been read back yet."""

    batch: list[Request]
    tokens: StepTokens
    t0: float


@dataclass
class EngineStats:
    running: int
    waiting: int
    free_slots: int
    total_slots: int


class Engine:
    def __init__(self, decoder: Decoder, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...] = (),
                 metrics: Metrics | None = None, admission: Admission | None = None, sla_ms: float = 100.0,
                 sla_tokens: int = 64, max_waiting: int = 256, wedge_timeout_s: float = 30.0) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.metrics = metrics or Metrics(sla_tokens)
        self.admission: Admission = admission or AdmitAll(sla_ms / 1e3)
        self.sampler = Sampler(decoder)
        self.sla_s, self.sla_tokens = sla_ms / 1e3, sla_tokens
        self.max_waiting = max_waiting
        self.wedge_timeout_s = wedge_timeout_s
        self.scheduler = Scheduler(decoder.max_slots)
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the counts the API reads
        self._stopping = False
        self.accepting = True
        self._thread: threading.Thread | None = None
        self._busy_since: float | None = None
        # What admission learns a step costs is the engine's cadence: from one decode step's start to the next one's,
        # less the prefills run in between (admission models those on their own). That includes what the decode
        # step alone does not: the loop's own work, and waiting for the GIL while the API thread is busy.
        self._prev_step: tuple[float, int] | None = None  # (start, batch) of the last step, while decoding goes on
        self._prefill_s_since = 0.0
        self.overlap = decoder.device.type == "cuda"  # run a step ahead (see _decode_step)
        self._inflight: _Step | None = None
        self._last_completed = 0.0
        self._slow_steps = SlowSteps()
        self._slow_prefills = 0  # the decoder's count, as last exported
        self.stats = EngineStats(0, 0, decoder.max_slots, decoder.max_slots)
        self.metrics.kv_slots_total.set(decoder.max_slots)
        self.metrics.sla_seconds.set(self.sla_s)
        self.metrics.sla_headroom.set(self.sla_s)
        self.metrics.kv_slots_free.set(decoder.max_slots)

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
               session: Session | None = None, arrival: float | None = None) -> Request:
        """Validate, admit (or raise Rejected) and enqueue. ValueError for input the model cannot take."""
        if not self.accepting:
            raise Rejected("draining", "the server is shutting down", retry_after_s=5.0, status=503)
        ctx = self.decoder.max_context
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > ctx:
            raise ValueError(f"this model's context is {ctx} tokens; the prompt has {len(prompt_ids)} and "
                             f"max_tokens asks for {params.max_tokens} more")
        vocab = self.decoder.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"token ids must lie in [0, {vocab})")
        req = Request(prompt_ids=list(prompt_ids), params=params, sink=sink, session=session,
                      output=TextOutput(self.tokenizer.detokenizer(), params.stop), sla_tokens=self.sla_tokens)
        if arrival is not None:
            req.arrival = arrival
        with self._lock:
            if self.stats.waiting >= self.max_waiting:
                self._reject(req, Rejected("queue_full", "too many requests are waiting", retry_after_s=1.0))
            try:
                self.admission.check(req)
            except Rejected as r:
                self._reject(req, r)
            self.metrics.sla_headroom.set(self.admission.headroom(time.perf_counter()))
            self.stats.waiting += 1
            self.metrics.waiting.set(self.stats.waiting)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self._inbox.put(req)
        self._wake.set()
        return req

    def _reject(self, req: Request, r: Rejected) -> None:
        self.metrics.requests.labels(outcome="rejected", reason=r.reason).inc()
        raise r

    def cancel(self, req: Request) -> None:
        """Free the request's slot before the next step (barge-in, a dropped stream)."""
        if req.state is not State.FINISHED:
            req.cancelled = True
            self._wake.set()

    def new_session(self) -> Session:
        return Session()

    def close_session(self, session: Session) -> None:
        self._inbox.put(session)  # type: ignore[arg-type]  # handled on the engine thread
        self._wake.set()

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
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(req, "error", error="internal engine error")
                self.scheduler.waiting.clear()

    def _iteration(self) -> None:
        sched = self.scheduler
        self._take_inbox()
        for req in sched.take_cancelled():
            self._finish(req, "cancelled")
        while (req := sched.next_to_prefill()) is not None:
            self._prefill(req)
        self._update_gauges()
        if sched.running or self._inflight is not None:
            self._decode_step()
        else:
            self._prev_step = None  # idle: the next step starts a new cadence
            self._wake.wait(timeout=0.5)
            self._wake.clear()

    def _take_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Session):
                self.scheduler.slots.close_session(item)
            else:
                self.scheduler.add(item)

    def _prefill(self, req: Request) -> None:
        req.prefill_start = time.perf_counter()
        self.metrics.queue_time.observe(req.prefill_start - req.arrival)
        start = req.cached_tokens
        self._busy_since = time.monotonic()
        try:
            logits = self.decoder.prefill(req.slot, req.prompt_ids[start:], start)
            token = self.sampler.first(logits, req)  # reading it back waits for the prefill to run
        except Exception as e:  # a fault fails this request only; the engine goes on
            log.exception("prefill failed for %s", req.id)
            self._finish(req, "error", error=f"prefill failed: {e}")
            return
        finally:
            self._busy_since = None
            self._prefill_s_since += time.perf_counter() - req.prefill_start
        req.prefill_end = time.perf_counter()
        n = len(req.prompt_ids) - start
        self.metrics.prefill_time.observe(req.prefill_end - req.prefill_start)
        self.metrics.prefilled_tokens.inc(n)
        self.admission.observe_prefill(n, req.prefill_end - req.prefill_start)
        slow = self.decoder.slow_prefills
        if slow > self._slow_prefills:
            self.metrics.prefill_slow_path.inc(slow - self._slow_prefills)
            self._slow_prefills = slow
        req.kv_len = len(req.prompt_ids)
        self.scheduler.start(req)
        self._emit_or_fail(req, token)

    def _decode_step(self) -> None:
        """One token for every running request. On a GPU, while the batch stays the same, the next step is launched
        before this one's tokens are read back: they are chosen on the device (greedy, or sampled there) and fed
        straight into it, so the host's work per token (streaming, detokenizing, bookkeeping) hides behind the
        kernel. A request with a seed is sampled on the host, one step at a time."""
        batch = list(self.scheduler.running)
        pending, self._inflight = self._inflight, None
        if pending is not None:
            if pending.batch == batch and pending.tokens.ahead and self._can_run_ahead(batch):
                self._inflight = self._launch(batch, pending.tokens.chosen, [r.kv_len + 1 for r in batch])
                self._complete(pending)
                return
            self._complete(pending)
            batch = list(self.scheduler.running)
            if not batch:
                return
        launched = self._launch(batch, [r.output_ids[-1] for r in batch], [r.kv_len for r in batch])
        if launched is None:
            return
        if launched.tokens.ahead:
            self._inflight = launched
        else:
            self._complete(launched)

    def _can_run_ahead(self, batch: list[Request]) -> bool:
        """Whether the next tokens can be chosen on the device and one more position fits every sequence."""
        ctx = self.decoder.max_context
        return self.overlap and self.sampler.on_device(batch) and all(r.kv_len + 2 < ctx for r in batch)

    def _launch(self, batch: list[Request], tokens: list[int] | torch.Tensor, positions: list[int]) -> _Step | None:
        t0 = time.perf_counter()
        if self._prev_step is not None:
            prev_start, prev_batch = self._prev_step
            self.admission.observe_step(prev_batch, max(0.0, t0 - prev_start - self._prefill_s_since))
        self._prev_step, self._prefill_s_since = (t0, len(batch)), 0.0
        self._busy_since = time.monotonic()
        try:
            slots = [r.slot for r in batch]
            draws = self.sampler.draws(batch)
            if draws is None:
                out = self.decoder.decode(slots, tokens, positions)
            else:
                out = self.decoder.decode(slots, tokens, positions, draws)
            # running ahead: the tokens are chosen on the device now; _complete waits for them
            next_tokens = self.sampler.step(out, batch, ahead=self._can_run_ahead(batch))
        except Exception as e:  # fail the requests of this step, keep serving the rest
            self._fail_step(batch, e)
            return None
        finally:
            self._busy_since = None
        return _Step(batch, next_tokens, t0)

    def _complete(self, step: _Step) -> None:
        """Read a launched step's tokens back and stream them."""
        self._busy_since = time.monotonic()
        try:
            step.tokens.read()
        except Exception as e:
            self._fail_step(step.batch, e)
            return
        finally:
            self._busy_since = None
        for i, req in enumerate(step.batch):
            if req.state is State.FINISHED:  # cancelled, or ended while this step ran ahead: its token is void
                continue
            try:
                token = step.tokens.token(i)
            except SamplingError as e:  # this request's sampling failed: fail it alone
                log.error("sampling failed for %s: %s", req.id, e)
                self._finish(req, "error", error=f"sampling failed: {e}")
                continue
            req.kv_len += 1
            self._emit_or_fail(req, token)
        # Per token as a client sees it: kernel, sampling, detokenizing, streaming. (Admission observes the
        # cadence at each launch.)
        now = time.perf_counter()
        dt = now - max(step.t0, self._last_completed)
        self._last_completed = now
        self.metrics.decode_step.labels(batch_size=str(len(step.batch))).observe(dt)
        self._slow_steps.observe(len(step.batch), dt)

    def _fail_step(self, batch: list[Request], e: Exception) -> None:
        log.exception("decode step failed")
        for req in batch:
            if req.state is not State.FINISHED:
                self._finish(req, "error", error=f"decode step failed: {e}")
        self._prev_step = None

    def _emit_or_fail(self, req: Request, token: int) -> None:
        """_emit, and if detokenizing or streaming this one request raises, fail it alone."""
        try:
            self._emit(req, token)
        except Exception as e:
            log.exception("emitting a token failed for %s", req.id)
            if req.state is not State.FINISHED:
                self._finish(req, "error", error=f"output failed: {e}")

    def _emit(self, req: Request, token: int) -> None:
        now = time.perf_counter()
        m = self.metrics
        req.output_ids.append(token)
        n = len(req.output_ids)
        m.generation_tokens.inc()
        if req.first_token_at is None:
            req.first_token_at = now
            m.time_to_first_token.observe(now - req.arrival)
        else:
            m.inter_token_latency.observe(now - req.last_token_at)
        req.last_token_at = now
        if n == req.sla_token_index:
            req.nth_token_at = now
            m.time_to_nth_token.observe(now - req.arrival)
            self._check_sla(req, now)
            self.admission.observe_nth(req, now)

        reason = None
        if token in self.eos and not req.params.ignore_eos:
            text, reason = "", "stop"
        else:
            text = req.output.add(token)
            if req.output.stopped:
                reason = "stop"
            elif n >= req.params.max_tokens or req.kv_len + 1 >= self.decoder.max_context:
                reason = "length"
        if reason is None:
            req.sink(Delta(text, [token]))
            return
        if req.nth_token_at is None:  # ended before the SLA token: the SLA was about its last one
            self._check_sla(req, now)
        self._finish(req, reason, text=text, token=token)

    def _check_sla(self, req: Request, now: float) -> None:
        if req.deadline is not None:
            self.metrics.sla_checked.inc()
            if now > req.deadline:
                self.metrics.sla_violations.inc()

    def _finish(self, req: Request, reason: str, text: str = "", token: int | None = None,
                error: str | None = None) -> None:
        if req.state is not State.FINISHED:
            self.scheduler.finish(req)
        if reason in ("stop", "length"):
            text += req.output.finish()
        now = time.perf_counter()
        outcome = outcome_of(reason)
        self.metrics.requests.labels(outcome=outcome, reason="" if outcome != "failed" else "engine_error").inc()
        self.metrics.e2e_latency.observe(now - req.arrival)
        self.admission.release(req)
        self.metrics.sla_headroom.set(self.admission.headroom(now))
        req.sink(Delta(text, [] if token is None else [token], finish_reason=reason, error=error,
                       usage=req.usage(), timings=req.timings(now)))

    def _update_gauges(self) -> None:
        sched, s = self.scheduler, self.stats
        with self._lock:
            s.running = len(sched.running)
            s.waiting = len(sched.waiting) + self._inbox.qsize()
            s.free_slots = sched.slots.num_free
        self.metrics.running.set(s.running)
        self.metrics.waiting.set(s.waiting)
        self.metrics.kv_slots_free.set(s.free_slots)
