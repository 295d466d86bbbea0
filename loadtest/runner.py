"""Driving the load: sessions arrive open-loop at a rate (gamma/Poisson gaps), optionally capped at N in flight;
with no rate, N in flight is a closed loop. Turns of a session run one after another, each after the last reply."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from loadtest.clients import ClientPool, RealtimeSession, Target, http_turn
from loadtest.record import RequestRecord, finish
from loadtest.workload import Message, Session, arrival_gaps, should_cancel


@dataclass
class Load:
    rate: float | None = None  # sessions per second; None = as fast as the concurrency cap lets them in
    burstiness: float = 1.0
    concurrency: int | None = None  # sessions in flight at most
    num_sessions: int | None = 100  # None: until `duration_s`
    duration_s: float | None = None  # arrivals stop after this many seconds
    cancel_after: int | None = None  # barge in after this many tokens...
    cancel_share: float = 0.0  # ...on this share of turns
    preemptive_after: int = 4  # a preemptive start is cancelled after this many tokens
    think_s: float = 0.0  # between a reply's end and the next turn: the caller listens, then speaks
    # What a session does when a reply is refused (429): "hang-up" ends it; "fall-back" goes on as a voice agent with
    # a fallback LLM does: that turn answered elsewhere (FALLBACK_REPLY joins the conversation), the next one asked
    # here again
    after_refusal: Literal["hang-up", "fall-back"] = "hang-up"
    sla_tokens: int = 64
    sla_ms: float = 100.0
    seed: int = 0
    stream: int = 0  # which arrival stream (a worker process's index): each has its own gaps


OnRecord = Callable[[RequestRecord], None]
FALLBACK_REPLY = "Sorry, could you say that again?"  # what the agent's fallback said for a refused turn


async def run_session(pool: ClientPool, target: Target, session: Session, load: Load, t0: float,
                      on_record: OnRecord) -> list[RequestRecord]:
    """All turns of one session: each turn's preemptive starts (cancelled after a few tokens; whatever becomes of
    them, the turn goes on), then its reply. It stops at the first failed reply, and at the first rejected one (as a
    caller would hang up) unless `load.after_refusal` falls back. Over HTTP every request carries the whole
    conversation, as heard (a barged-in reply cut where the client stopped reading); over the realtime WebSocket only
    the turn's new messages."""
    records: list[RequestRecord] = []
    conversation: list[Message] = [{"role": "system", "content": session.system}] if session.system else []
    rt = RealtimeSession(target, session.system) if target.endpoint == "realtime" else None
    client = pool.take() if rt is None else None

    async def request(k: int, kind: str, messages: list[Message], max_tokens: int,
                      cancel_after: int | None) -> RequestRecord:
        rec = RequestRecord(session=session.index, turn=k, endpoint=target.endpoint, kind=kind,
                            start_s=time.perf_counter() - t0)
        try:
            async with asyncio.timeout(target.timeout_s):
                if client is not None:
                    await http_turn(client, target, conversation + messages, max_tokens, rec, cancel_after)
                elif rt is not None and (rt.ws is not None or await rt.open(rec)):
                    rec.start_s = time.perf_counter() - t0  # TTFT counts from response.create, not connect
                    await rt.turn(messages, max_tokens, rec, cancel_after, out_of_band=kind == "preemptive")
        except Exception as e:  # a timeout or a malformed reply fails this request, not the run
            rec.outcome, rec.error = "error", f"{type(e).__name__}: {e}"
            rec.end_s = time.perf_counter() - t0
        records.append(finish(rec, load.sla_tokens, load.sla_ms))
        on_record(rec)
        return rec

    try:
        for k, turn in enumerate(session.turns):
            if k and load.think_s:
                await asyncio.sleep(load.think_s)
            for partial in turn.preemptive:
                await request(k, "preemptive", partial, turn.max_tokens, load.preemptive_after)
                if rt is not None and rt.ws is None:
                    return records  # the socket was refused: the caller is gone
            barge_in = load.cancel_after is not None and load.cancel_after < turn.max_tokens \
                and should_cancel(load.seed, session.index, k, load.cancel_share)
            rec = await request(k, "barge-in" if barge_in else "turn", turn.messages, turn.max_tokens,
                                load.cancel_after if barge_in else None)
            if rec.outcome == "rejected" and load.after_refusal == "fall-back" and (rt is None or rt.ws is not None):
                fallback: list[Message] = [*turn.messages, {"role": "assistant", "content": FALLBACK_REPLY}]
                if rt is not None and not await rt.add(fallback, rec):
                    break
                conversation += fallback
                continue
            if rec.outcome not in ("ok", "cancelled"):
                break
            conversation += [*turn.messages, {"role": "assistant", "content": rec.text}]
    finally:
        if client is not None:
            pool.give(client)
        if rt is not None:
            await rt.close()
    return records


async def run_phase(pool: ClientPool, target: Target, sessions: Iterable[Session], load: Load,
                    on_record: OnRecord = lambda r: None, t0: float | None = None) -> list[RequestRecord]:
    """Launch sessions as they arrive; wait for all; return every turn's record (start_s/end_s since t0, a
    perf_counter() time: now, or the common start of several worker processes)."""
    t0 = time.perf_counter() if t0 is None else t0
    gaps = arrival_gaps(load.rate, load.burstiness, load.seed + 7919 * load.stream)
    sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    tasks: list[asyncio.Task[list[RequestRecord]]] = []
    due = 0.0

    async def one(session: Session) -> list[RequestRecord]:
        try:
            return await run_session(pool, target, session, load, t0, on_record)
        finally:
            if sem is not None:
                sem.release()

    for session in sessions:
        due += next(gaps)
        if load.duration_s is not None and due >= load.duration_s:
            break
        await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
        if sem is not None:
            await sem.acquire()
        if load.duration_s is not None and time.perf_counter() - t0 >= load.duration_s:
            if sem is not None:
                sem.release()
            break
        tasks.append(asyncio.create_task(one(session)))
    results = await asyncio.gather(*tasks)
    return [r for rs in results for r in rs]


def take(sessions: Iterator[Session], n: int | None) -> Iterable[Session]:
    return sessions if n is None else itertools.islice(sessions, n)


async def watch_loop_lag(samples: list[float], period_s: float = 0.01) -> None:
    """How late this event loop wakes a sleeper (ms). A client whose loop lags adds that lag to every latency
    it measures: then the figures are the client's, not the server's."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        samples.append(max(0.0, (time.perf_counter() - t - period_s) * 1000.0))


async def run_load(pool: ClientPool, target: Target, sessions: Iterator[Session], load: Load,
                   warmup: int = 0, on_record: OnRecord = lambda r: None,
                   loop_lag_ms: list[float] | None = None) -> list[RequestRecord]:
    """Warm-up sessions first (same load, not measured, waited for), then the measured phase, during which
    the client's own event-loop lag is sampled into `loop_lag_ms`."""
    if warmup:
        await run_phase(pool, target, itertools.islice(sessions, warmup), load)
    watcher = asyncio.create_task(watch_loop_lag(loop_lag_ms if loop_lag_ms is not None else []))
    try:
        return await run_phase(pool, target, take(sessions, load.num_sessions), load, on_record)
    finally:
        watcher.cancel()
