"""Engine: one scheduler thread that prefills new requests (on top of the K/V cached for their prompt's longest
cached prefix), runs one decode step for every running request, samples, streams text deltas and frees slots. Its
interface (submit, cancel, sessions, truncate, drain) is all the API layer sees.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from service.backends.decoder import Decoder
from service.engine import run_ahead
from service.engine.admission import Admission, AdmitAll, Rejected
from service.engine.kv_slots import KVSlots, Placement, Session
from service.engine.output import TextOutput
from service.engine.prefix_cache import block_hashes
from service.engine.request import Delta, Request, SamplingParams, State, outcome_of
from service.engine.run_ahead import Rows, Step
from service.engine.sampler import Sampler, SamplingError
from service.engine.scheduler import Scheduler
from service.engine.slow_steps import SlowSteps
from service.metrics import Metrics
from service.model.tokenizer import Tokenizer

log = logging.getLogger("parley.engine")


@dataclass
class EngineStats:
    running: int
    waiting: int
    free_slots: int  # KV slots no running request holds (empty, or caching an idle conversation)
    total_slots: int
    cached_slots: int = 0  # KV slots caching an idle conversation


class Engine:
    def __init__(self, decoder: Decoder, tokenizer: Tokenizer, eos_token_ids: tuple[int, ...] = (),
                 metrics: Metrics | None = None, admission: Admission | None = None, sla_ms: float = 100.0,
                 sla_tokens: int = 64, max_waiting: int = 256, wedge_timeout_s: float = 30.0,
                 max_batch: int | None = None) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.metrics = metrics or Metrics(sla_tokens)
        self.admission: Admission = admission or AdmitAll(sla_ms / 1e3)
        self.sampler = Sampler(decoder)
        self.sla_s, self.sla_tokens = sla_ms / 1e3, sla_tokens
        self.max_waiting = max_waiting
        self.wedge_timeout_s = wedge_timeout_s
        # requests decoded together (the decode batch), and KV slots: cached conversations, at least as many
        self.max_batch = min(max_batch or decoder.max_slots, decoder.max_slots)
        self.scheduler = Scheduler(KVSlots(decoder.max_slots), self.max_batch)
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._live: set[Request] = set()  # admitted, not ended: each gets its final delta, whatever fails
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
        self._inflight: Step | None = None
        self._last_completed = 0.0
        self._slow_steps = SlowSteps()
        self._slow_prefills = 0  # the decoder's count, as last exported
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
        req.prompt_blocks = block_hashes(req.prompt_ids)
        req.cached_tokens = self.scheduler.slots.expected_cached(req.prompt_ids, req.prompt_blocks, session)
        req.lags = self.overlap and self.sampler.needs_host(req)
        with self._lock:
            if self.stats.waiting >= self.max_waiting:
                self._reject(req, Rejected("queue_full", "too many requests are waiting", retry_after_s=1.0))
            try:
                self.admission.check(req)
            except Rejected as r:
                self._reject(req, r)
            self.metrics.sla_headroom.set(self.admission.headroom(time.perf_counter()))
            self._live.add(req)
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
        """The conversation is over: its slot is unpinned, its K/V stay cached like any request's."""
        self.scheduler.slots.close(session)

    def truncate(self, session: Session, keep_tokens: int) -> None:
        """Between turns (after a barge-in): the session's cached K/V keep only their first `keep_tokens` tokens,
        before any later submit for it. A no-op where its slot was evicted or holds fewer."""
        self.scheduler.slots.truncate(session, keep_tokens)

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

    def _iteration(self) -> None:
        sched = self.scheduler
        self._take_inbox()
        for req in sched.take_cancelled():
            self._finish(req, "cancelled")
        while (placed := sched.next_to_prefill()) is not None:
            self._prefill(*placed)
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
            if item.state is not State.FINISHED:  # else failed already, by _fail_all
                self.scheduler.add(item)

    def _fail_all(self) -> None:
        """After an iteration failed: every admitted request that has not ended (waiting, running, or the one being
        prefilled when it failed) ends now with an error, so that no client waits for ever."""
        self._inflight, self._prev_step = None, None
        with self._lock:
            live = list(self._live)
        for req in live:
            try:
                self._finish(req, "error", error="internal engine error")
            except Exception:
                log.exception("failing %s failed", req.id)
                with self._lock:
                    self._live.discard(req)
                try:
                    req.sink(Delta("", [], finish_reason="error", error="internal engine error", usage=req.usage()))
                except Exception:
                    log.exception("the final delta of %s could not be sent", req.id)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()

    def _prefill(self, req: Request, placement: Placement) -> None:
        """Prefill what follows the prompt's cached prefix (copied in first from another slot, where it sits in one
        that must keep it) and choose the first token."""
        req.prefill_start = time.perf_counter()
        self.metrics.queue_time.observe(req.prefill_start - req.arrival)
        start = req.cached_tokens
        self.metrics.prefix_cache_queries.inc(len(req.prompt_ids))
        self.metrics.prefix_cache_hits.inc(start)
        self._busy_since = time.monotonic()
        try:
            slot = slot_of(req)
            if placement.source is not None:
                self.decoder.copy_prefix(placement.source, slot, start)
            logits = self.decoder.prefill(slot, req.prompt_ids[start:], start)
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
        self.admission.observe_prefill(n, start, req.prefill_end - req.prefill_start)
        slow = self.decoder.slow_prefills
        if slow > self._slow_prefills:
            self.metrics.prefill_slow_path.inc(slow - self._slow_prefills)
            self._slow_prefills = slow
        req.kv_len = len(req.prompt_ids)
        self.scheduler.start(req)
        self._emit_or_fail(req, token)

    def _decode_step(self) -> None:
        """One token for every running request (a lagging one: every other step). On a GPU, while the batch stays
        the same, the next step is launched before this one's tokens are read back (run_ahead.py): they are chosen
        on the device and fed straight into it, so the host's work per token hides behind the kernel."""
        batch = list(self.scheduler.running)
        pending, self._inflight = self._inflight, None
        if pending is not None:
            if pending.batch == batch and pending.tokens.ahead and self._can_run_ahead(batch):
                self._inflight = self._launch(batch, run_ahead.after(pending, self.sampler.needs_host))
                self._complete(pending)
                return
            self._complete(pending)
            batch = list(self.scheduler.running)
            if not batch:
                return
        launched = self._launch(batch, run_ahead.from_host(batch))
        if launched is None:
            return
        if launched.tokens.ahead:
            self._inflight = launched
        else:
            self._complete(launched)

    def _can_run_ahead(self, batch: list[Request]) -> bool:
        """Whether the next step can be launched before this one is read: a GPU, one position more fits every
        sequence, and not every request waits for the host between its tokens (those alone run step by step)."""
        ctx = self.decoder.max_context
        return (self.overlap and not all(self.sampler.needs_host(r) for r in batch)
                and all(r.kv_len + 2 < ctx for r in batch))

    def _launch(self, batch: list[Request], rows: Rows) -> Step | None:
        t0 = time.perf_counter()
        if self._prev_step is not None:
            prev_start, prev_batch = self._prev_step
            self.admission.observe_step(prev_batch, max(0.0, t0 - prev_start - self._prefill_s_since))
        self._prev_step, self._prefill_s_since = (t0, len(batch)), 0.0
        self._busy_since = time.monotonic()
        try:
            slots = [slot_of(r) for r in batch]
            draws = self.sampler.draws(batch)
            if draws is None:
                out = self.decoder.decode(slots, rows.tokens, rows.positions)
            else:
                out = self.decoder.decode(slots, rows.tokens, rows.positions, draws)
            # running ahead: the tokens are chosen on the device now; _complete waits for them
            tokens = self.sampler.step(out, batch, ahead=self._can_run_ahead(batch), void=rows.void)
        except Exception as e:  # fail the requests of this step, keep serving the rest
            self._fail_step(batch, e)
            return None
        finally:
            self._busy_since = None
        return Step(batch, rows, tokens, t0)

    def _complete(self, step: Step) -> None:
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
            # cancelled, or ended while this step ran ahead; or a lagging request's row between two of its tokens
            if req.state is State.FINISHED or step.rows.void[i]:
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
        elif req.last_token_at is not None:
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
        with self._lock:
            self._live.discard(req)
        req.sink(Delta(text, [] if token is None else [token], finish_reason=reason, error=error,
                       usage=req.usage(), timings=req.timings(now)))

    def _update_gauges(self) -> None:
        sched, s = self.scheduler, self.stats
        with self._lock:
            s.running = len(sched.running)
            s.waiting = len(sched.waiting) + self._inbox.qsize()
            s.free_slots = sched.slots.num_free
            s.cached_slots = sched.slots.num_cached
        self.metrics.running.set(s.running)
        self.metrics.waiting.set(s.waiting)
        self.metrics.kv_slots_free.set(s.free_slots)
        self.metrics.kv_slots_cached.set(s.cached_slots)


def slot_of(req: Request) -> int:
    """The KV slot of a request the scheduler has placed (every running one)."""
    if req.slot is None:
        raise RuntimeError(f"{req.id} runs without a KV slot")
    return req.slot
