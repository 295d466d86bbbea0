"""The engine process: the runtime (runtime.py: the planner, the engine loop, commit, the K/V slots and sessions,
admission's forecast) served to front-end processes over ipc.py. Its threads:

- the engine thread (Engine's loop), which after every iteration sends each front end one StepOutput: the token ids
  and the ends of that iteration, never text;
- the input thread (EngineService.serve), which takes the front ends' messages in order: a Submit is admitted or
  refused there, as the API's thread did in one process (Engine.submit holds the engine's lock a moment), and its
  Verdict sent at once (one with a grammar is compiled and admitted on a small pool instead: milliseconds no other
  request's verdict waits for); cancels, truncates and session ends go straight to the engine;
- a status thread: a Status every STATUS_EVERY_S, the heartbeat /health and a drain read;
- the grammar engine's mask workers (grammar.py), off the engine thread as before.

`parley serve` starts it (`python -m service.engine_process`: spawn()); it dies with the process that started it
(PR_SET_PDEATHSIG) and exits on SIGTERM (what `parley serve` sends once its front ends have drained). Tests may serve
a runtime on threads of their own process instead (serve_in_threads).
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from service.config import ServeConfig
from service.engine import ipc
from service.engine.admission import Rejected
from service.engine.grammar import GrammarError, grammars
from service.engine.kv_slots import Session
from service.engine.messages import (
    STATUS_EVERY_S,
    Answer,
    Cancel,
    CloseSession,
    Drain,
    EngineInfo,
    Finish,
    Query,
    Ready,
    Status,
    StepOutput,
    Submit,
    Truncate,
    Verdict,
)
from service.engine.request import Delta, Request, SamplingParams, State
from service.runtime import Runtime, build_engine, settle_process

log = logging.getLogger("parley.engine")

SIDE_WORKERS = 2  # threads for what takes milliseconds (a grammar's compile, rendering /metrics): not the input's


@dataclass
class _Outbox:
    """One front end's output of the current iteration (engine thread only)."""

    rids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finished: list[Finish] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.rids or self.finished)


class EngineService:
    """A runtime's engine, served to `front_ends` front ends at `addresses`."""

    def __init__(self, rt: Runtime, addresses: ipc.Addresses, front_ends: int) -> None:
        self.rt = rt
        self.engine = rt.engine
        self.engine.detokenize = False  # the front ends detokenize (and read stop strings)
        self.addresses = addresses
        self.ctx = zmq.Context()
        self.inbox = ipc.pull(self.ctx, addresses.engine)
        self.outs = [ipc.push(self.ctx, addresses.front_end(fe)) for fe in range(front_ends)]
        self._send_lock = threading.Lock()  # the engine, input and status threads share the sockets
        self._outboxes = [_Outbox() for _ in range(front_ends)]
        self._live: dict[tuple[int, int], Request] = {}  # (front end, rid) → the admitted request, until it ends
        self._live_lock = threading.Lock()
        self._compiling: set[tuple[int, int]] = set()  # submitted with a grammar, still compiling
        self._cancel_early: dict[tuple[int, int], str] = {}  # ...and cancelled meanwhile: cancelled once admitted
        self._side_pool = ThreadPoolExecutor(max_workers=SIDE_WORKERS, thread_name_prefix="parley-side")
        self._sessions: dict[tuple[int, str], Session] = {}
        self._stopping = threading.Event()
        self._status_thread = threading.Thread(target=self._heartbeat, name="parley-status", daemon=True)
        self.engine.on_iteration = self._flush
        self.info = engine_info(rt)

    # -- sending ------------------------------------------------------------------------------------------------
    def _send(self, fe: int, message: object) -> None:
        frame = ipc.ENCODER.encode(message)
        with self._send_lock:
            self.outs[fe].send(frame, copy=False)

    def _sink(self, fe: int, rid: int, delta: Delta) -> None:
        """The engine's sink of one request (engine thread): into its front end's outbox."""
        box = self._outboxes[fe]
        if delta.finish_reason is None:
            for t in delta.token_ids:
                box.rids.append(rid)
                box.tokens.append(t)
            return
        with self._live_lock:
            self._live.pop((fe, rid), None)
        u, tm = delta.usage, delta.timings
        box.finished.append(Finish(
            rid, delta.finish_reason, delta.token_ids[-1] if delta.token_ids else None, delta.error,
            u.prompt_tokens if u else 0, u.completion_tokens if u else 0, u.cached_tokens if u else 0,
            tm.queue_ms if tm else None, tm.prefill_ms if tm else None, tm.ttft_ms if tm else None,
            tm.ttfn_ms if tm else None, tm.e2e_ms if tm else None, tm.n if tm else self.rt.config.sla_tokens))

    def _flush(self) -> None:
        """After an iteration (engine thread): each front end's output, one message each."""
        for fe, box in enumerate(self._outboxes):
            if box:
                self._outboxes[fe] = _Outbox()
                self._send(fe, StepOutput(box.rids, box.tokens, box.finished))

    # -- the input thread ---------------------------------------------------------------------------------------
    def serve(self) -> None:
        """Take the front ends' messages until stop() (SIGTERM)."""
        for fe in range(len(self.outs)):
            self._send(fe, Ready(self.info))
        self._status_thread.start()
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(100):
                continue
            message = ipc.TO_ENGINE.decode(self.inbox.recv(copy=False).buffer)
            try:
                self._handle(message)
            except Exception:  # one bad message must not stop the engine
                log.exception("handling %s failed", type(message).__name__)
        self._stopping.set()

    def _handle(self, m: object) -> None:
        if isinstance(m, Submit):
            session = None
            if m.session is not None:  # here, in the order of the front end's messages (before a later close)
                session = self._sessions.get((m.fe, m.session))
                if session is None:
                    session = self._sessions[(m.fe, m.session)] = self.engine.new_session()
            if m.params.grammar is None:
                self._submit(m, session)
            else:  # compiling takes milliseconds: on the pool, so that other requests' verdicts do not wait
                with self._live_lock:
                    self._compiling.add((m.fe, m.rid))
                self._side_pool.submit(self._submit, m, session)
        elif isinstance(m, Cancel):
            key = (m.fe, m.rid)
            with self._live_lock:
                req = self._live.get(key)
                if req is None and key in self._compiling:
                    self._cancel_early[key] = m.reason  # cancelled while its grammar compiles
            if req is not None:
                self.engine.cancel(req, m.reason)
        elif isinstance(m, Truncate):
            session = self._sessions.get((m.fe, m.session))
            if session is not None:
                self.engine.truncate(session, m.keep_tokens)
        elif isinstance(m, CloseSession):
            session = self._sessions.pop((m.fe, m.session), None)
            if session is not None:
                self.engine.close_session(session)
        elif isinstance(m, Query):  # rendering /metrics takes milliseconds: off the input thread too
            self._side_pool.submit(self._reply, m)
        elif isinstance(m, Drain):
            self.engine.accepting = False

    def _submit(self, m: Submit, session: Session | None) -> None:
        """Admit or refuse (the input thread; a request with a grammar, the side pool): a Verdict, always."""
        key = (m.fe, m.rid)
        try:
            verdict, req = self._admit(m, session)
        except Exception as e:  # a bug: the front end still gets its answer (a 503), never silence
            log.exception("submitting rid %d failed", m.rid)
            verdict, req = Verdict(m.rid, 503, "engine_error", f"the engine could not take the request: {e}", 1.0), None
        with self._live_lock:
            self._compiling.discard(key)
            early = self._cancel_early.pop(key, None)
            if req is not None and req.state is not State.FINISHED:  # else it ended already (its Finish is coming)
                self._live[key] = req
        if req is not None and early is not None:
            self.engine.cancel(req, early)
        self._send(m.fe, verdict)

    def _admit(self, m: Submit, session: Session | None) -> tuple[Verdict, Request | None]:
        p = m.params
        try:
            constraint = None if p.grammar is None else \
                grammars(self.engine.tokenizer, self.engine.eos).constraint(p.grammar)
        except Exception as e:  # GrammarError, or a tokenizer the grammar engine cannot take: the request's 400
            return Verdict(m.rid, 400, "grammar", str(e) if isinstance(e, GrammarError) else
                           f"constrained decoding is unavailable for this model: {e}"), None
        params = SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                seed=p.seed, ignore_eos=p.ignore_eos, constraint=constraint)
        try:
            req = self.engine.submit(m.prompt_ids, params, functools.partial(self._sink, m.fe, m.rid),
                                     session=session, arrival=m.arrival)
        except Rejected as r:
            return Verdict(m.rid, r.status, r.reason, r.message, r.retry_after_s), None
        except ValueError as e:
            return Verdict(m.rid, 400, "invalid", str(e)), None
        return Verdict(m.rid), req

    def _reply(self, m: Query) -> None:
        try:
            body = self._answer(m.what)
        except Exception:
            log.exception("answering %r failed", m.what)
            body = b""
        self._send(m.fe, Answer(m.qid, body))

    def _answer(self, what: str) -> bytes:
        if what == "metrics":
            return self.engine.metrics.render()
        if what == "latency_model":
            rt, adm = self.rt, self.rt.admission
            return json.dumps({**rt.latency.snapshot(), "sla_ms": adm.sla_s * 1e3, "sla_tokens": adm.sla_tokens,
                               "best_effort": adm.best_effort, "strict": adm.strict,
                               "bias": round(adm.bias, 4), "margin": round(adm.margin, 4),
                               "idle_time_to_sla_token_ms": round(adm.idle_prediction_s() * 1e3, 3),
                               "backend": rt.backend, "device": rt.device}).encode()
        return b""

    def _heartbeat(self) -> None:
        while not self._stopping.wait(STATUS_EVERY_S):
            s, e = self.engine.stats, self.engine
            status = Status(s.running, s.waiting, s.free_slots, s.total_slots, s.cached_slots, e.accepting,
                            e.healthy())
            for fe in range(len(self.outs)):
                self._send(fe, status)

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        """After serve(): every thread that sends stopped first, then the sockets closed."""
        self._stopping.set()
        self._side_pool.shutdown(wait=True, cancel_futures=True)
        self.engine.stop()
        if self._status_thread.is_alive():
            self._status_thread.join(timeout=5)
        for s in (self.inbox, *self.outs):
            s.close(linger=0)
        self.ctx.term()


def engine_info(rt: Runtime) -> EngineInfo:
    tok = rt.model.tokenizer
    return EngineInfo(
        model_id=rt.model_id, backend=rt.backend, device=rt.device, pid=os.getpid(),
        max_context=min(rt.config.max_context, rt.model.config.max_position_embeddings),
        vocab_size=rt.model.config.vocab_size, sla_tokens=rt.config.sla_tokens, max_batch=rt.config.max_batch,
        tokenizer_json=tok.to_json(), chat_template=tok.chat_template, bos_token=tok.bos_token,
        eos_token=tok.eos_token, extra_tokens=list(tok.extra_tokens))


def serve_in_threads(rt: Runtime, addresses: ipc.Addresses, front_ends: int = 1) -> Callable[[], None]:
    """Serve `rt` from threads of this process (tests): the same messages as the engine process's. Returns what
    stops it."""
    service = EngineService(rt, addresses, front_ends)

    def run() -> None:
        try:
            service.serve()
        finally:
            service.close()

    thread = threading.Thread(target=run, name="parley-engine-input", daemon=True)
    thread.start()

    def stop() -> None:
        service.stop()
        thread.join(timeout=30)

    return stop


# -- the process ----------------------------------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 15.0  # after SIGTERM: the engine thread's last step, then SIGKILL


def spawn(cfg: ServeConfig, addresses: ipc.Addresses, front_ends: int) -> subprocess.Popen[bytes]:
    """Start the engine process (from the main thread: PR_SET_PDEATHSIG follows the thread that started it). Its
    output goes where this process's goes."""
    cmd = [sys.executable, "-m", "service.engine_process", cfg.model_dump_json(), addresses.root, str(front_ends),
           str(os.getpid())]
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
    """`python -m service.engine_process CONFIG_JSON IPC_DIR FRONT_ENDS PARENT_PID`"""
    config_json, root, front_ends, parent = argv[0], argv[1], int(argv[2]), int(argv[3])
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the front end drains first
    cfg = ServeConfig.model_validate_json(config_json)
    logging.basicConfig(level=getattr(logging, cfg.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    t0 = time.perf_counter()
    rt = settle_process(build_engine(cfg))
    service = EngineService(rt, ipc.Addresses(root), front_ends)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    log.info("engine process %d ready in %.1f s", os.getpid(), time.perf_counter() - t0)
    try:
        service.serve()
    finally:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
