"""EngineClient: the front end's side of the engine process (`parley serve --engine-process`,
service/engine_process.py), on the event loop. It sends Submits, cancels and session changes; the engine's messages
come on a socket of this front end's own (service/engine/frame_socket.py), read by the event loop when it turns
readable (a StepOutput per engine iteration: one wake-up of the loop per step, whatever the number of streams), and
each RemoteStream gets its deltas. A watchdog notices the engine process gone (its exit, or its
heartbeat silent for HEARTBEAT_TIMEOUT_S): every stream then ends in an error, /health says why, and `on_dead` runs.

RemoteStream reads as streaming.EngineStream does (`async for` deltas, cancel, close), so the handlers do not know
which engine they talk to.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import zmq
from tokenizers import Tokenizer as HFTokenizer

from service.api.streaming import QueuedDeltas
from service.engine import ipc
from service.engine.admission import Rejected
from service.engine.frame_socket import FrameReader
from service.engine.grammar import GrammarError
from service.engine.messages import (
    Answer,
    Cancel,
    CloseSession,
    Drain,
    EngineInfo,
    Hello,
    Out,
    Params,
    Query,
    Ready,
    Status,
    StepOutput,
    Submit,
    Truncate,
    Verdict,
    first_id,
)
from service.engine.output import TextOutput
from service.engine.request import Delta, SamplingParams, Timings, Usage
from service.model.tokenizer import Tokenizer

log = logging.getLogger("parley.api")

HEARTBEAT_TIMEOUT_S = 10.0  # no Status for this long: the engine process is gone (or frozen), whatever its pid says
WATCH_EVERY_S = 0.1  # how often the engine's end is looked for where no pidfd says it (its heartbeat's silence too)
# With a pidfd the engine's exit wakes the front end at once, and only the heartbeat is looked at, this often: a look
# reads /proc (front_ends.engine_gone), and on the H100 host a stream's tokens came ~0.15 ms late every 100 ms in the
# hop to the front end (bench/NOTES.md, s87)
HEARTBEAT_WATCH_S = 1.0
MAX_TOP_K = 2**62  # a top_k past the vocabulary keeps every token, and a message carries 64-bit integers


@dataclass(frozen=True)
class RemoteSession:
    """A realtime session as the front end knows it: an id; its slot and K/V live in the engine process."""

    id: str = field(default_factory=lambda: f"sess-{uuid.uuid4().hex[:16]}")


@dataclass(frozen=True)
class RemoteGrammar:
    """A turn's grammar as it travels: Lark text, compiled in the engine process (a GrammarError comes back as the
    Verdict's 400)."""

    lark: str
    opening: bool = False


def tokenizer_of(info: EngineInfo) -> Tokenizer:
    tok = Tokenizer(HFTokenizer.from_str(info.tokenizer_json), info.chat_template, info.bos_token, info.eos_token)
    tok.extra_tokens = list(info.extra_tokens)
    return tok


def delta_of(o: Out) -> Delta:
    u, t = o.usage, o.timings
    return Delta(o.text, o.token_ids, o.finish_reason, o.error, None if u is None else Usage(*u),
                 None if t is None else Timings(*t))


class RemoteStream(QueuedDeltas):
    """One request submitted to the engine process. `output`: where this front end detokenizes its tokens (a request
    without stop strings: the engine sends token ids alone, and spends none of its thread's time a token on text)."""

    def __init__(self, client: EngineClient, rid: int, prompt_tokens: int, arrival: float,
                 on_close: Callable[[], None] | None, on_delivered: Callable[[float], None] | None = None,
                 output: TextOutput | None = None, ignore_eos: bool = False) -> None:
        super().__init__(on_delivered)
        self.client, self.rid = client, rid
        self._output, self._ignore_eos = output, ignore_eos
        self.verdict: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._prompt_tokens = prompt_tokens
        self._tokens = 0
        self._arrival = arrival
        self._first_at: float | None = None  # when its first token reached this process
        self._ended = False  # its last delta is queued
        self._on_close = on_close

    def put(self, d: Delta, published: float | None = None) -> None:
        """The engine's delta (`published`: when the engine process sent it), or one made here (None)."""
        if self._ended:
            return  # cancelled here already: the engine's own last delta is never read
        if self._output is not None:  # (the deltas made here, a cancel's and a failure's, carry no token)
            d = self._detokenized(d)
        if d.token_ids and self._first_at is None:
            self._first_at = time.perf_counter()
        self._tokens += len(d.token_ids)
        if d.finish_reason is not None:
            self._ended = True
        self._queue.put_nowait((d, published))

    def _detokenized(self, d: Delta) -> Delta:
        """The engine's delta with its text, as the engine would have written it (commit.py, Engine._end): every token
        but an end-of-sequence one that stopped the reply, and what the detokenizer still holds once it ended."""
        assert self._output is not None
        ids = d.token_ids
        if d.finish_reason == "stop" and ids and ids[-1] in self.client.eos and not self._ignore_eos:
            ids = ids[:-1]
        text = "".join(map(self._output.add, ids))
        if d.finish_reason in ("stop", "length"):
            text += self._output.finish()
        return replace(d, text=d.text + text)

    def fail(self, why: str) -> None:
        self.put(Delta("", [], finish_reason="error", error=why, usage=self._usage()))

    def _usage(self) -> Usage:
        cached = self.verdict.result().cached_tokens if self.verdict.done() else 0
        return Usage(self._prompt_tokens, self._tokens, cached)

    def _timings(self) -> Timings:
        """A cancel's timings, as this process saw them (the engine's own last delta is not waited for)."""
        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - self._arrival) * 1e3, 3)

        return Timings(ttft_ms=ms(self._first_at), e2e_ms=ms(time.perf_counter()),
                       n=self.client.info.sla_tokens)

    def cancel(self) -> None:
        """Free the slot before the engine's next step, and end the stream now (its last delta queued at once, as
        EngineStream does: a barge-in's response.done does not wait for the engine). Idempotent."""
        if self._ended:
            return
        self.client.cancel(self.rid)
        self.put(Delta("", [], finish_reason="cancelled", usage=self._usage(), timings=self._timings()))

    def close(self) -> None:
        self.cancel()
        self.client.forget(self.rid)
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


def pidfd(pid: int | None) -> int | None:
    """A file descriptor that becomes readable once process `pid` exits (Linux 5.3+), or None where there is none."""
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:  # gone already, or a kernel without pidfds: the watch looks instead
        return None


class EngineClient:
    def __init__(self, info: EngineInfo, addresses: ipc.Addresses, ctx: zmq.Context,
                 reader: FrameReader, exit_code: Callable[[], int | str | None] | None = None,
                 front_end: int = 0, front_ends: int = 1, out: zmq.Socket | None = None,
                 exit_fd: int | None = None) -> None:
        self.info = info
        self.tokenizer = tokenizer_of(info)
        self.eos = frozenset(info.eos_token_ids)
        self._ctx = ctx
        self._reader = reader  # the engine's messages (frame_socket.py); on_frame is set to _on_frame by connect
        self._out = out if out is not None else ipc.push(ctx, addresses.engine)
        self._send_lock = threading.Lock()  # the drain thread sends too
        self._exit_code = exit_code  # the engine process's exit status, or why it is gone (None while it runs)
        self._exit_fd = exit_fd  # readable once the engine process has exited (a pidfd, owned here), or None
        # this front end's ids (messages.front_end_of names it in each), from a start of its own: a front end
        # restarted after a crash never reuses an id its predecessor's requests may still hold in the engine
        start = first_id(front_end) + front_ends * (time.time_ns() // 1_000_000 if front_ends > 1 else 0)
        self._rids = itertools.count(start, front_ends)
        self._qids = itertools.count(start, front_ends)
        self._streams: dict[int, RemoteStream] = {}
        self._queries: dict[int, asyncio.Future[bytes]] = {}
        self.status: Status | None = None
        self._status_at = time.monotonic()
        self.dead: str | None = None  # why the engine process is gone
        self.on_dead: list[Callable[[str], None]] = []
        # hears, once a message of tokens, how long it took from the engine's send to this reader (the hop between
        # processes: parley_token_hop_seconds)
        self.on_hop: Callable[[float], None] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(cls, addresses: ipc.Addresses, exit_code: Callable[[], int | str | None] | None = None,
                      front_end: int = 0, front_ends: int = 1, engine_pid: int | None = None) -> EngineClient:
        """Bind front end `front_end`'s socket (of `front_ends`), say Hello and wait for the engine's Ready (sent once
        it is loaded, warm and calibrated); a RuntimeError if its process exits first. `engine_pid`: the engine
        process, whose exit a pidfd then tells at once."""
        arrived: asyncio.Queue[tuple[bytes, float]] = asyncio.Queue()
        reader = FrameReader(addresses.front_end_frames(front_end), lambda *frame: arrived.put_nowait(frame))
        ctx = zmq.Context()
        out = ipc.push(ctx, addresses.engine)  # queued until the engine binds (it may still be loading)
        out.send(ipc.ENCODER.encode(Hello(front_end)))  # after the bind: the engine connects to it on this Hello
        while True:
            if exit_code is not None and (code := exit_code()) is not None:
                reader.close()
                out.close(linger=0)
                ctx.term()
                raise RuntimeError(f"the engine process exited with {code} before it was ready")
            try:
                frame, _ = await asyncio.wait_for(arrived.get(), 0.2)
            except TimeoutError:
                continue
            message = ipc.TO_FRONT_END.decode(frame)
            if isinstance(message, Ready):
                break
        client = cls(message.info, addresses, ctx, reader, exit_code, front_end, front_ends, out, pidfd(engine_pid))
        reader.on_frame = client._on_frame
        while not arrived.empty():  # what came right behind Ready
            client._on_frame(*arrived.get_nowait())
        client._tasks = [asyncio.create_task(client._watch())]
        return client

    # -- requests -------------------------------------------------------------------------------------------------
    def _send(self, message: object) -> None:
        frame = ipc.ENCODER.encode(message)
        with self._send_lock:
            self._out.send(frame, copy=False)

    async def submit(self, prompt_ids: list[int], params: SamplingParams, grammar: RemoteGrammar | None = None,
                     session: RemoteSession | None = None, arrival: float | None = None,
                     on_close: Callable[[], None] | None = None,
                     on_delivered: Callable[[float], None] | None = None, delivery_s: float = 0.0) -> RemoteStream:
        """Submit and wait for admission's verdict: the stream, or Rejected (429, 503), ValueError (a prompt the
        engine cannot take), GrammarError (a grammar that does not compile). `delivery_s`: Engine.submit's."""
        if self.dead is not None:
            raise Rejected("engine_gone", f"the engine process is gone: {self.dead}", retry_after_s=5.0, status=503)
        rid = next(self._rids)
        arrival = arrival if arrival is not None else time.perf_counter()
        here = not params.stop  # stop strings: the engine must read the text to stop there, so it detokenizes
        stream = self._streams[rid] = RemoteStream(
            self, rid, len(prompt_ids), arrival, on_close, on_delivered,
            TextOutput(self.tokenizer.detokenizer()) if here else None, params.ignore_eos)
        p = Params(params.max_tokens, params.temperature, params.top_p, min(params.top_k, MAX_TOP_K), params.seed,
                   list(params.stop), params.ignore_eos, None if grammar is None else grammar.lark,
                   grammar is not None and grammar.opening, detokenize=not here)
        self._send(Submit(rid, list(prompt_ids), p, arrival, None if session is None else session.id, delivery_s))
        try:
            verdict = await stream.verdict
        except BaseException:  # cancelled while waiting (the client went away): the engine must not run it
            self._streams.pop(rid, None)
            self.cancel(rid)
            raise
        if verdict.status == 0:
            return stream
        self._streams.pop(rid, None)
        if verdict.reason == "invalid":
            raise ValueError(verdict.message)
        if verdict.reason == "grammar":
            raise GrammarError(verdict.message)
        raise Rejected(verdict.reason, verdict.message, verdict.retry_after_s, verdict.status)

    def cancel(self, rid: int) -> None:
        if self.dead is None:
            self._send(Cancel(rid))

    def forget(self, rid: int) -> None:
        """A closed stream: what the engine still sends for it is dropped."""
        self._streams.pop(rid, None)

    def new_session(self) -> RemoteSession:
        return RemoteSession()

    def close_session(self, session: RemoteSession) -> None:
        if self.dead is None:
            self._send(CloseSession(session.id))

    def truncate(self, session: RemoteSession, keep_tokens: int) -> None:
        if self.dead is None:
            self._send(Truncate(session.id, keep_tokens))

    async def query(self, what: str, timeout_s: float = 10.0) -> bytes:
        """The engine's answer to a Query ("metrics", "latency_model")."""
        if self.dead is not None:
            raise RuntimeError(f"the engine process is gone: {self.dead}")
        qid = next(self._qids)
        future = self._queries[qid] = asyncio.get_running_loop().create_future()
        self._send(Query(qid, what))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._queries.pop(qid, None)

    # -- the engine's state ----------------------------------------------------------------------------------------
    def unavailable(self, look: bool = False) -> tuple[str, str, str] | None:
        """Why no request can be served now, as (error code, error message, /health status); None when ready.
        `look`: check the engine process now (what /health asks), not only what the watchdog saw at its last tick:
        with two front ends, one can end a stream on the engine's death while the other's /health, asked at once,
        still read ok (a fresh-clone CI run)."""
        dead = self.dead or (self._why_gone() if look else None)
        if dead is not None:
            return "engine_gone", f"the engine process is gone ({dead}); this server should be restarted", \
                f"engine process gone: {dead}"
        s = self.status
        if s is not None and not s.accepting:
            return "draining", "the server is shutting down", "draining"
        if s is not None and not s.healthy:  # wedged: an answer now beats a request that would wait forever
            return "engine_unhealthy", "the engine is not responding; this server should be restarted", \
                "engine unhealthy"
        return None

    def drain(self) -> None:
        """Tell the engine to stop admitting (any thread)."""
        if self.dead is None:
            self._send(Drain())

    def drained(self) -> bool:
        """The engine has stopped admitting and nothing of it runs or waits (from its last heartbeat)."""
        s = self.status
        return self.dead is not None or (s is not None and not s.accepting and s.running == 0 and s.waiting == 0)

    # -- the reader and the watchdog --------------------------------------------------------------------------------
    def _on_frame(self, frame: bytes, received: float) -> None:
        """A message from the engine, on the event loop as it is read (the reader hands over all that is there)."""
        try:
            self._dispatch(ipc.TO_FRONT_END.decode(frame), received)
        except Exception:
            log.exception("a message from the engine could not be handled")

    def _dispatch(self, m: object, received: float) -> None:
        if isinstance(m, StepOutput):
            if self.on_hop is not None and m.sent is not None and any(o.token_ids for o in m.outs):
                self.on_hop(received - m.sent)  # (as deliveries count: messages with tokens)
            streams = self._streams
            for o in m.outs:
                stream = streams.get(o.rid)
                if stream is not None:
                    stream.put(delta_of(o), m.sent)
                    if o.finish_reason is not None:
                        streams.pop(o.rid, None)
        elif isinstance(m, Verdict):
            stream = self._streams.get(m.rid)
            if stream is not None and not stream.verdict.done():
                stream.verdict.set_result(m)
        elif isinstance(m, Status):
            self.status, self._status_at = m, time.monotonic()
        elif isinstance(m, Answer):
            future = self._queries.get(m.qid)
            if future is not None and not future.done():
                future.set_result(m.body)

    async def _watch(self) -> None:
        """The engine process's end: at once where a pidfd tells it, else by a look every WATCH_EVERY_S; and its
        heartbeat's silence."""
        loop = asyncio.get_running_loop()
        if self._exit_fd is not None:
            loop.add_reader(self._exit_fd, self._exited, self._exit_fd)
        try:
            while self.dead is None:
                await asyncio.sleep(WATCH_EVERY_S if self._exit_fd is None else HEARTBEAT_WATCH_S)
                why = self._why_gone(look=self._exit_fd is None)
                if why is not None:
                    self._gone(why)
        finally:
            if self._exit_fd is not None:
                loop.remove_reader(self._exit_fd)

    def _exited(self, fd: int) -> None:
        """The pidfd `fd` is readable: the engine process has exited (its status, where this process can read it)."""
        asyncio.get_running_loop().remove_reader(fd)
        self._gone(self._why_gone() or "it exited")

    def _why_gone(self, look: bool = True) -> str | None:
        """Why the engine process is gone, by a look now (`look`: its exit status, or /proc) or by its heartbeat's
        silence; None while it runs. Reads only: any thread may ask."""
        code = self._exit_code() if look and self._exit_code is not None else None
        if isinstance(code, str):
            return code
        if code is not None:
            return f"it exited with {code}" if code >= 0 else f"it was killed by signal {-code}"
        if time.monotonic() - self._status_at > HEARTBEAT_TIMEOUT_S:
            return f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s"
        return None

    def _gone(self, why: str) -> None:
        """The engine process is gone: every stream ends in an error now, every question and verdict fails."""
        if self.dead is not None:
            return
        self.dead = why
        log.error("the engine process is gone: %s", why)
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            if not stream.verdict.done():
                stream.verdict.set_result(Verdict(stream.rid, 503, "engine_gone",
                                                  f"the engine process is gone: {why}", 5.0))
            stream.fail(f"the engine process is gone: {why}")
        for future in self._queries.values():
            if not future.done():
                future.set_exception(RuntimeError(f"the engine process is gone: {why}"))
        for callback in self.on_dead:
            callback(why)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._reader.close()
        self._out.close(linger=0)
        self._ctx.term()
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
