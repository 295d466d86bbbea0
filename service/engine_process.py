"""The engine process (`parley serve --engine-process`): the runtime (runtime.py: warm-up, calibration, the engine
loop, the planner, admission's forecast and guard, K/V slots and sessions) served to the front end over ipc.py, so
that the front end's Python (HTTP parsing, pydantic, templates, tokenization, SSE framing) never holds the GIL the
engine loop needs. Its threads:

- the engine thread (Engine's loop): after every iteration it sends one StepOutput with that iteration's deltas;
- the input thread (EngineService.serve): takes the front end's messages in order. A Submit is handed to the engine
  thread (Engine.run_soon), which admits or refuses it and sends its Verdict right after launching its next step,
  while the GPU runs it, in parts where they do not fit beside one step (Engine.prepare, then Engine.admit_in_parts:
  the forecast, and the `delays` rule's second forecast where it needs one; on an idle GPU engine a prompt that fits
  one step is seated and launched first, its verdict run beside its step: service/engine/launch_first.py):
  on the input thread the verdicts' Python took the GIL from the engine thread between its torch calls
  (service/engine/handoff.py). A session's truncate and close, and a drain, follow the same
  way, in order. One with a grammar is compiled and admitted on the side pool instead, so that no other verdict
  waits for a compile. What the engine thread has not started within the handoff's patience, this thread runs;
- the side pool: grammar compiles, and /metrics and /v1/latency_model rendered off the engine thread;
- a status thread: a Status every STATUS_EVERY_S, the heartbeat /health and the drain read.

Ready is sent only once build_engine has returned, i.e. after the warm-up ran every step shape (CUDA graphs, Triton
kernels) and the calibration, in this process: the one that serves; to each front end that says Hello (`--api-workers
N`: N of them, each its own socket, every answer routed by the id it names: messages.front_end_of). It dies with the
process that started it (PR_SET_PDEATHSIG) and exits on SIGTERM (sent once the front ends have drained).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import zmq

from service.config import ServeConfig, front_end_count
from service.engine import ipc
from service.engine.admission import Rejected
from service.engine.frame_socket import FrameSender
from service.engine.grammar import GrammarError, grammars
from service.engine.handoff import Then
from service.engine.kv_slots import Session
from service.engine.messages import (
    STATUS_EVERY_S,
    Answer,
    Cancel,
    CloseSession,
    Drain,
    EngineInfo,
    Hello,
    Out,
    Query,
    Ready,
    Status,
    StepOutput,
    Submit,
    Truncate,
    Verdict,
    front_end_of,
)
from service.engine.request import Delta, Request, SamplingParams, State
from service.runtime import Runtime, build_engine, settle_process

log = logging.getLogger("parley.engine")

STALE_POLL_MS = 10  # the input thread looks for handed-over work the engine thread has not started this often
SIDE_WORKERS = 2  # threads for what takes milliseconds (a grammar's compile, rendering /metrics)
SLOW_RENDER_S = 0.02  # a /metrics render this long is logged: it shares the engine thread's GIL


class EngineService:
    """A runtime's engine, served to `front_ends` front ends at `addresses`."""

    def __init__(self, rt: Runtime, addresses: ipc.Addresses, front_ends: int = 1) -> None:
        self.rt = rt
        self.engine = rt.engine
        self.ctx = zmq.Context()
        self.addresses = addresses
        self.inbox = ipc.pull(self.ctx, addresses.engine)
        # each front end's socket, connected when it says Hello (frame_socket.py); None before, or once it is gone
        self.outs: list[FrameSender | None] = [None] * front_ends
        self._send_lock = threading.Lock()  # the engine, input, side and status threads share the sockets
        self._outboxes: list[list[Out]] = [[] for _ in self.outs]  # the iteration's deltas by front end (engine thread)
        self._live: dict[int, Request] = {}  # rid → the admitted request, until it ends
        self._live_lock = threading.Lock()
        self._undecided: set[int] = set()  # submitted, no verdict yet (handed to the engine thread, or compiling)
        self._cancel_early: set[int] = set()  # ...and cancelled meanwhile: cancelled once admitted
        self._side_pool = ThreadPoolExecutor(max_workers=SIDE_WORKERS, thread_name_prefix="parley-side")
        self._sessions: dict[str, Session] = {}
        self._stopping = threading.Event()
        self._status_thread = threading.Thread(target=self._heartbeat, name="parley-status", daemon=True)
        self.engine.on_published = self._flush  # a step's deltas, as soon as they are streamed
        self.engine.on_iteration = self._flush  # and what an iteration streamed otherwise (a failure's last deltas)
        self.info = engine_info(rt)

    # -- sending ------------------------------------------------------------------------------------------------
    def _send(self, message: object, front_end: int | None = None) -> None:
        """To one front end, or (None) to every one."""
        frame = ipc.ENCODER.encode(message)
        with self._send_lock:
            for out in self.outs if front_end is None else (self.outs[front_end],):
                if out is not None:  # a front end that has not said Hello yet misses a heartbeat, nothing else
                    out.send(frame)

    def _to(self, id_: int) -> int:
        """The front end a request or query id came from."""
        return front_end_of(id_, len(self.outs))

    def _sink(self, rid: int, fe: int, d: Delta) -> None:
        """One request's sink (engine thread), bound to its front end `fe` when submitted (not worked out again for
        every token): into this iteration's outbox of that front end, sent by _flush."""
        outbox = self._outboxes[fe]
        if d.finish_reason is None:
            outbox.append(Out(rid, d.text, d.token_ids))
            return
        with self._live_lock:
            self._live.pop(rid, None)
        u, t = d.usage, d.timings
        outbox.append(Out(
            rid, d.text, d.token_ids, d.finish_reason, d.error,
            None if u is None else (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            None if t is None else (t.queue_ms, t.prefill_ms, t.ttft_ms, t.ttfn_ms, t.e2e_ms, t.n)))

    def _flush(self) -> None:
        """The deltas streamed since the last flush (engine thread: a step's, once they are streamed, and after each
        iteration), in one message to each front end that has some."""
        for fe, box in enumerate(self._outboxes):
            if box:
                self._outboxes[fe] = []
                self._send(StepOutput(box, time.perf_counter()), fe)

    # -- the input thread ---------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Take the front ends' messages until stop() (SIGTERM)."""
        self._status_thread.start()
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while not self._stopping.is_set():
            if poller.poll(STALE_POLL_MS):
                message = ipc.TO_ENGINE.decode(self.inbox.recv(copy=False).buffer)
                try:
                    self._handle(message)
                except Exception:  # one bad message must not stop the engine
                    log.exception("handling %s failed", type(message).__name__)
            self.engine.handoff.run_stale()  # what the engine thread has not started in time (a long step, a hang)

    def _handle(self, m: object) -> None:
        if isinstance(m, Hello):
            self._hello(m.front_end)
        elif isinstance(m, Submit):
            session = None
            if m.session is not None:  # here, in the order of the front end's messages (before a later close)
                session = self._sessions.get(m.session)
                if session is None:
                    session = self._sessions[m.session] = self.engine.new_session()
            with self._live_lock:
                self._undecided.add(m.rid)
            received = time.perf_counter()
            if m.params.grammar is None:
                self.engine.run_soon(functools.partial(self._submit, m, session, received), self.engine.prepare_s,
                                     "prepare")
            else:  # compiling takes milliseconds: on the pool, so that other requests' verdicts do not wait
                self._side_pool.submit(self._submit_now, m, session, received)
        elif isinstance(m, Cancel):
            with self._live_lock:
                req = self._live.get(m.rid)
                if req is None and m.rid in self._undecided:
                    self._cancel_early.add(m.rid)
            if req is not None:
                self.engine.cancel(req)
        elif isinstance(m, Truncate):  # after the session's submits handed over before it
            session = self._sessions.get(m.session)
            if session is not None:
                self.engine.run_soon(functools.partial(self.engine.truncate, session, m.keep_tokens), kind="truncate")
        elif isinstance(m, CloseSession):
            session = self._sessions.pop(m.session, None)
            if session is not None:
                self.engine.run_soon(functools.partial(self.engine.close_session, session), kind="close")
        elif isinstance(m, Query):
            self._side_pool.submit(self._reply, m)
        elif isinstance(m, Drain):  # after the submits handed over before it: those are decided, and counted
            self.engine.run_soon(self._stop_accepting, kind="drain")

    def _hello(self, fe: int) -> None:
        """A front end has started: Ready to it; and whatever a predecessor of the same number left running (it died
        mid-stream, and nobody reads its streams now) is cancelled, its slots freed before the next step."""
        if not 0 <= fe < len(self.outs):
            log.error("a front end numbered %d said hello; this engine serves %d", fe, len(self.outs))
            return
        with self._live_lock:
            orphans = [req for rid, req in self._live.items() if self._to(rid) == fe]
            self._cancel_early |= {rid for rid in self._undecided if self._to(rid) == fe}
        for req in orphans:
            self.engine.cancel(req)
        if orphans:
            log.warning("front end %d restarted: cancelled the %d requests its predecessor left running", fe,
                        len(orphans))
        try:
            out = FrameSender.connect(self.addresses.front_end_frames(fe))
        except OSError as e:  # it said Hello and died: a successor says Hello again
            log.error("front end %d said hello, but its socket is gone: %s", fe, e)
            return
        with self._send_lock:
            old, self.outs[fe] = self.outs[fe], out
            if old is not None:
                old.close()
        self._send(Ready(self.info), fe)

    def _stop_accepting(self) -> None:
        self.engine.accepting = False

    def _submit(self, m: Submit, session: Session | None, received: float) -> Then | None:
        """A verdict's first half (the engine thread, or the input thread where it took the task back): the request
        built and its cached prefix looked up; its second half, admission's forecast, is returned as the task that
        follows (Handoff runs it beside this step where it fits, else beside the next). Input the model cannot take
        is answered here."""
        try:
            prepared = self._prepare(m, session)
        except Exception as e:  # a bug: the front end still gets its answer (a 503), never silence
            log.exception("submitting rid %d failed", m.rid)
            prepared = Verdict(m.rid, 503, "engine_error", f"the engine could not take the request: {e}", 1.0)
        if isinstance(prepared, Verdict):
            self._decided(m, prepared, None)
            return None
        if self.engine.launch_first(prepared, received, functools.partial(self._judged_after_launch, m, prepared)):
            return None  # an idle engine: its step launched first, its verdict beside it (engine/launch_first.py)
        return Then(functools.partial(self._verdict, m, prepared, received), self.engine.verdict_s, "verdict")

    def _judged_after_launch(self, m: Submit, req: Request, refusal: Rejected | None) -> None:
        """The verdict on a request whose step was launched first (None: admitted), sent before any of its tokens."""
        if refusal is None:
            self._decided(m, Verdict(m.rid, cached_tokens=req.cached_tokens), req)
        else:
            self._decided(m, Verdict(m.rid, refusal.status, refusal.reason, refusal.message, refusal.retry_after_s),
                          None)

    def _submit_now(self, m: Submit, session: Session | None, received: float) -> None:
        """Every part at once (the side pool: a request with a grammar)."""
        then = self._submit(m, session, received)
        while then is not None:
            then = then.task()

    def _prepare(self, m: Submit, session: Session | None) -> Request | Verdict:
        p = m.params
        try:
            constraint = None if p.grammar is None else \
                grammars(self.engine.tokenizer, self.engine.eos).constraint(p.grammar, p.opening)
        except Exception as e:  # GrammarError, or a tokenizer the grammar engine cannot take: the request's 400
            return Verdict(m.rid, 400, "grammar", str(e) if isinstance(e, GrammarError) else
                           f"constrained decoding is unavailable for this model: {e}")
        params = SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                seed=p.seed, stop=tuple(p.stop), ignore_eos=p.ignore_eos, constraint=constraint)
        try:
            return self.engine.prepare(m.prompt_ids, params, functools.partial(self._sink, m.rid, self._to(m.rid)),
                                       session=session, arrival=m.arrival, delivery_s=m.delivery_s,
                                       detokenize=p.detokenize)
        except Rejected as r:
            return Verdict(m.rid, r.status, r.reason, r.message, r.retry_after_s)
        except ValueError as e:
            return Verdict(m.rid, 400, "invalid", str(e))

    def _verdict(self, m: Submit, req: Request, received: float,
                 parts: Iterator[None] | None = None) -> Then | None:
        """A verdict's second half: admitted or refused, the Verdict sent; or, where admission's `delays` rule
        forecasts again, that forecast returned as the task that follows (a third part, handed over like the
        second)."""
        admitted: Request | None = req
        try:
            parts = self.engine.admit_in_parts(req, received) if parts is None else parts
            next(parts)
            return Then(functools.partial(self._verdict, m, req, received, parts), self.engine.delays_s, "delays")
        except StopIteration:
            verdict = Verdict(m.rid, cached_tokens=req.cached_tokens)
        except Rejected as r:
            verdict, admitted = Verdict(m.rid, r.status, r.reason, r.message, r.retry_after_s), None
        except Exception as e:  # a bug: the front end still gets its answer (a 503), never silence
            log.exception("admitting rid %d failed", m.rid)
            verdict = Verdict(m.rid, 503, "engine_error", f"the engine could not take the request: {e}", 1.0)
            admitted = None
        self._decided(m, verdict, admitted)
        return None

    def _decided(self, m: Submit, verdict: Verdict, req: Request | None) -> None:
        with self._live_lock:
            self._undecided.discard(m.rid)
            early = m.rid in self._cancel_early
            self._cancel_early.discard(m.rid)
            if req is not None and req.state is not State.FINISHED:  # else it ended already (its delta is coming)
                self._live[m.rid] = req
        if req is not None and early:
            self.engine.cancel(req)
        self._send(verdict, self._to(m.rid))

    def _reply(self, m: Query) -> None:
        t0 = time.perf_counter()
        try:
            body = self._answer(m.what)
        except Exception:
            log.exception("answering %r failed", m.what)
            body = b""
        took = time.perf_counter() - t0
        if took > SLOW_RENDER_S:
            log.info("answering %r took %.1f ms", m.what, took * 1e3)
        self._send(Answer(m.qid, body), self._to(m.qid))

    def _answer(self, what: str) -> bytes:
        if what == "metrics":
            return self.engine.metrics.render()
        if what == "latency_model":
            return json.dumps(self.rt.latency_model()).encode()
        return b""

    def _heartbeat(self) -> None:
        while not self._stopping.wait(STATUS_EVERY_S):
            e = self.engine
            s = e.stats
            self._send(Status(s.running, s.waiting, e.accepting, e.healthy()))

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        """After serve(): every thread that sends stopped first, then the sockets closed."""
        self._stopping.set()
        self._side_pool.shutdown(wait=True, cancel_futures=True)
        self.engine.stop()
        if self._status_thread.is_alive():
            self._status_thread.join(timeout=5)
        self.inbox.close(linger=0)
        with self._send_lock:
            for out in self.outs:
                if out is not None:
                    out.close()
        self.ctx.term()


def engine_info(rt: Runtime) -> EngineInfo:
    tok = rt.model.tokenizer
    return EngineInfo(
        model_id=rt.model_id, backend=rt.backend, device=rt.device, pid=os.getpid(), max_context=rt.max_context,
        vocab_size=rt.model.config.vocab_size, sla_tokens=rt.config.sla_tokens, max_batch=rt.config.max_batch,
        eos_token_ids=sorted(rt.engine.eos), tokenizer_json=tok.to_json(), chat_template=tok.chat_template,
        bos_token=tok.bos_token, eos_token=tok.eos_token, extra_tokens=list(tok.extra_tokens))


def warn_of_late_compiles() -> None:
    """From Ready on, a Triton kernel compiled (or loaded from the disk cache) in this process is a shape the warm-up
    missed: the old engine-process branch's 7.6-10.5 s decode iterations on the H100 were such compiles. Each is
    logged with its kernel and specialization, so a sweep's stall has a name. (Where Triton has no such hook: none.)"""
    try:
        from triton import knobs  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return
    before = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs: object) -> object:
        log.warning("a Triton kernel was compiled after start-up (a shape the warm-up missed): %s",
                    str(kwargs.get("repr", "?"))[:300])
        return before(**kwargs) if before is not None else None

    try:
        knobs.runtime.jit_post_compile_hook = hook
    except AttributeError:
        pass


# -- the process ----------------------------------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 15.0  # after SIGTERM: the engine thread's last step, then SIGKILL


def spawn(cfg: ServeConfig, addresses: ipc.Addresses) -> subprocess.Popen[bytes]:
    """Start the engine process (from the main thread: PR_SET_PDEATHSIG follows the thread that started it). Its
    output goes where this process's goes."""
    cmd = [sys.executable, "-m", "service.engine_process", cfg.model_dump_json(), addresses.root, str(os.getpid())]
    return subprocess.Popen(cmd)


def stop(proc: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM, then SIGKILL after `timeout_s`; its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop within %.0f s: killed", timeout_s)
            proc.kill()
            proc.wait()
    return proc.returncode


def die_with_parent(parent: int) -> None:
    """SIGKILL when the process that started this one dies, however it dies (Linux): no engine outlives its server.
    (Set here, in the child, then checked: the parent may have died before it was set.)"""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: `parley serve`'s SIGTERM (or SIGKILL) still ends this
        return
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str]) -> int:
    """`python -m service.engine_process CONFIG_JSON IPC_ROOT PARENT_PID`"""
    config_json, root, parent = argv[0], argv[1], int(argv[2])
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the front end drains first
    cfg = ServeConfig.model_validate_json(config_json)
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    t0 = time.perf_counter()
    rt = settle_process(build_engine(cfg))  # warm-up and every step shape: here, before Ready
    service = EngineService(rt, ipc.Addresses(root), front_end_count(cfg))
    warn_of_late_compiles()
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    log.info("engine process %d ready in %.1f s", os.getpid(), time.perf_counter() - t0)
    try:
        service.serve()
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
