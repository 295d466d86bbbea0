"""Three Parley replicas (the tiny synthetic model, CPU) behind the real vllm-router from PyPI, run with the flags
docker-compose.yml gives it (deploy/render_compose.py), and what a deployment needs of the pair. The replicas ask for
an API key, which every call sends to the router, as a client of a deployment does:

- the router passes the caller's key on, to the replica that serves the call and to the render calls it makes to
  choose one (the voice sessions' prefix routing rests on those); a call without a key or with a wrong one gets the
  replica's 401 back as it was, is not retried, and takes no replica out of rotation;

- voice sessions of 6 chat turns over HTTP stay on the replica that holds their K/V: after turn 1, at least 90% of
  each session's prompt tokens come from the cache, by the replicas' own /metrics counters;
- fresh prompts spread: no replica takes more than half of 30;
- a replica at its SLA limit (every request wants the prefix it holds) does not turn the overflow back to the
  client: the router sends it to the others; only when no replica can take a request does the client get the 429,
  with the replica's `x-should-retry: false`;
- a replica killed under load costs only the requests it was running: the router takes it out and every later
  request succeeds.

The replicas decode at most 4 requests together, 20 ms a step (--step-delay-ms), under an SLA loose enough that a
busy CPU never turns a session's turn away. The router turns to the least-loaded replica once one runs 2 more
requests than another (half of --max-batch, as compose sets it). The 429 test adds a replica that can keep its SLA
for one request at a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.deploy_support import Router, router_executable, start_router, worker_health
from tests.server_support import (
    Scrape,
    Server,
    assert_openai_error,
    poll,
    scrape_metrics,
    stop_process,
    stop_server,
    tiny_server,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(router_executable() is None, reason="vllm-router not installed (pip install vllm-router)"),
]

MAX_BATCH, KV_SLOTS = 4, 8
KEY = "sk-router-" + secrets.token_urlsafe(16)
AUTH = {"Authorization": f"Bearer {KEY}"}
REPLICA = ("--max-batch", str(MAX_BATCH), "--kv-slots", str(KV_SLOTS), "--max-context", "4096", "--sla-tokens", "8",
           "--sla-ms", "60000", "--step-delay-ms", "20", "--api-key", KEY)
# One request at a time within its SLA: 8 tokens at 40 ms a step take ~330 ms; a second, waiting for the row, ~660.
ONE_AT_A_TIME = ("--max-batch", "1", "--kv-slots", "2", "--max-context", "1024", "--sla-tokens", "8",
                 "--sla-ms", "500", "--step-delay-ms", "40", "--api-key", KEY)
BALANCE_ABS_THRESHOLD = MAX_BATCH // 2  # as compose sets it from PARLEY_MAX_BATCH
TOKENS = 8
SESSIONS, TURNS = 6, 6
REQUEST_TIMEOUT_S = 60.0

# A voice agent's instructions: long next to a spoken turn, as they are in practice (the tiny model's tokenizer is
# byte-level here: ~1,500 tokens). Each session is a different agent, so that sessions have no prefix in common.
AGENTS = ("Ava", "Ben", "Cleo", "Dev", "Eli", "Fay")
INSTRUCTIONS = (
    "the voice assistant of the Riverside dental clinic. You speak with patients on the phone, so keep every answer "
    "short, warm and spoken: one or two sentences, no lists, no markdown, no emoji, and never read out links. You "
    "can book, move and cancel appointments; answer questions about opening hours (Monday to Friday from eight to "
    "six, Saturday from nine to one), prices, payment plans and insurance; and explain how to prepare for a visit. "
    "Before you change an appointment, confirm the patient's full name and date of birth, and read the new date "
    "and time back to them. If a patient describes severe pain, swelling of the face, bleeding that does not stop "
    "or a knocked-out tooth, tell them to come in today and offer the first free emergency slot. Never give a "
    "diagnosis or name a medicine; say that the dentist will look at it. If the caller asks for a person, offer to "
    "transfer them to the front desk. Prices: a check-up with cleaning is ninety-five dollars, a filling starts at "
    "one hundred and forty, a crown at nine hundred; most insurance plans cover check-ups in full. New patients "
    "fill in a health form before their first visit and should arrive ten minutes early. Parking is free behind "
    "the building; the entrance is on Mill Street. The clinic's dentists are Doctor Ortiz, Doctor Lee and Doctor "
    "Novak; Doctor Novak sees children. Appointments last thirty minutes, a cleaning an hour. Cancellations less "
    "than a day ahead cost twenty-five dollars unless the patient is ill. Speak in the caller's language if they "
    "switch; the clinic serves English and Spanish speakers. Stay on the clinic's business and politely decline "
    "anything else. End each call by asking if there is anything more you can help with.")
USER_TURNS = ("Hi, I'd like to move my appointment.", "It's Sam Rivera, born May 3rd 1990.",
              "Thursday morning if possible.", "Nine thirty works, thank you.", "Do you take Delta Dental?",
              "Great, that's all. Bye!")


@dataclass
class Fleet:
    replicas: list[Server]
    router: Router
    prefix_routing: bool  # the replicas render prompts to token ids, so that the router can match prefixes

    def needs_prefix_routing(self) -> None:
        if not self.prefix_routing:
            pytest.skip("the replicas have no /v1/chat/completions/render: vllm-router cannot route by prefix "
                        "(deploy/README.md, \"The router\")")

    def scrapes(self, alive: list[int] | None = None) -> dict[int, Scrape]:
        return {i: scrape_metrics(self.replicas[i].base) for i in (alive or range(len(self.replicas)))}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("router")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # load the three at once: each takes seconds
        futures = [pool.submit(tiny_server, tmp / f"replica-{i}.log", *REPLICA) for i in range(3)]
        replicas = [f.result() for f in futures]
    router = None
    try:
        router = start_router([r.base for r in replicas], tmp / "router.log", BALANCE_ABS_THRESHOLD)
        yield Fleet(replicas, router, _renders(replicas[0]))
    finally:
        if router is not None:
            stop_process(router.proc, timeout_s=10)
        for r in replicas:
            if r.proc.poll() is None:  # replica 0 is killed by the last test
                assert stop_server(r) == 0, r.log_tail()


def _deltas(before: dict[int, Scrape], after: dict[int, Scrape], name: str) -> dict[int, float]:
    return {i: after[i].total(name) - before[i].total(name) for i in after}


def _completed(before: dict[int, Scrape], after: dict[int, Scrape]) -> dict[int, float]:
    return {i: after[i].requests("completed") - before[i].requests("completed") for i in after}


def _renders(replica: Server) -> bool:
    """Whether the replica answers vLLM's /v1/chat/completions/render (the prompt's token ids): vllm-router's
    cache-aware policy matches prompts by those ids, and routes by load alone without them."""
    r = httpx.post(f"{replica.base}/v1/chat/completions/render", timeout=30, headers=AUTH,
                   json={"messages": [{"role": "user", "content": "hello"}]})
    return r.status_code == 200 and isinstance(r.json().get("token_ids"), list)


def test_voice_sessions_stay_on_the_replica_that_holds_their_prefix(fleet: Fleet) -> None:
    """Six calls at once, each 6 turns; every turn resends the whole conversation, as Pipecat and LiveKit do. Each
    session's share of prompt tokens served from the cache after turn 1 is read from the replicas' own counters:
    the usage each replica reports is what it counts (the sums agree), and a turn that landed elsewhere than its
    conversation would have no cached tokens."""
    fleet.needs_prefix_routing()
    before, routed = fleet.scrapes(), fleet.router.metrics()
    sessions = asyncio.run(_calls(fleet.router.base, AGENTS[:SESSIONS]))
    after = fleet.scrapes()
    # every call's render requests carried its key: the router had the token ids of every prompt
    assert _without_token_ids(fleet.router.metrics()) == _without_token_ids(routed)
    usages = [u for session in sessions for u in session]
    hits = _deltas(before, after, "parley_prefix_cache_hits_total")
    queries = _deltas(before, after, "parley_prefix_cache_queries_total")
    assert sum(hits.values()) == sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert sum(queries.values()) == sum(u["prompt_tokens"] for u in usages)
    for agent, session in zip(AGENTS, sessions):
        assert _cached_after_turn_1(session) >= 0.9, f"{agent}'s call after turn 1: {session}"
    assert sum(1 for q in queries.values() if q) >= 2, f"every call on one replica: {queries}"


async def _call(client: httpx.AsyncClient, agent: str, session_id: str | None = None,
                after: asyncio.Event | None = None, answered: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """One call of TURNS turns to `agent`, each resending the conversation (with `x-session-id` where given): the
    usage of each turn. It starts once `after` is set, and sets `answered` once its first turn is answered."""
    messages = [{"role": "system", "content": f"You are {agent}, {INSTRUCTIONS}"}]
    headers = {"x-session-id": session_id} if session_id else {}
    usages = []
    if after is not None:
        await after.wait()
    for turn in range(TURNS):
        if turn == 1 and answered is not None:
            answered.set()
        messages.append({"role": "user", "content": USER_TURNS[turn]})
        r = await client.post("/v1/chat/completions", headers=headers, json={
            "messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return usages


async def _calls(base: str, agents: Sequence[str], session_ids: Sequence[str | None] | None = None,
                 staggered: bool = False) -> list[list[dict[str, Any]]]:
    """One call per agent, all at once or (`staggered`) each starting once the one before has its first answer, as
    calls arrive one after another."""
    ids = session_ids or [None] * len(agents)
    answered = [asyncio.Event() for _ in agents]
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S, headers=AUTH) as client:
        return await asyncio.gather(*(
            _call(client, agent, sid, answered[i - 1] if staggered and i else None, answered[i])
            for i, (agent, sid) in enumerate(zip(agents, ids))))


def _cached_after_turn_1(session: list[dict[str, Any]]) -> float:
    later = session[1:]
    return sum(u["prompt_tokens_details"]["cached_tokens"] for u in later) / sum(u["prompt_tokens"] for u in later)


def test_one_agents_calls_spread_over_the_replicas_by_their_session_id(fleet: Fleet, tmp_path: Path) -> None:
    """Six calls to ONE agent (one system prompt, as a voice product's callers share it), each arriving once the one
    before has its first answer. The cache-aware policy sends each new call where the prompt is cached, and a turn
    elsewhere only once that replica runs the balance threshold above another, where the call's conversation is
    prefilled again (here: a turn with no cached token); on two H200s, whose replicas refuse what they cannot serve
    on time and so never ran that far ahead, every voice turn went to one replica (deploy/README.md, "One agent, many
    calls"). With `--policy sticky_least_loaded` and the client's `x-session-id` (PARLEY_ROUTER_POLICY in compose), a
    new call goes to the replica with the fewest calls and every turn of a call to its replica: the calls spread over
    all three, and each call's prompt after turn 1 comes from the cache."""
    router = start_router([r.base for r in fleet.replicas], tmp_path / "sticky-router.log", BALANCE_ABS_THRESHOLD,
                          "--policy sticky_least_loaded")
    try:
        before = fleet.scrapes()
        sessions = asyncio.run(_calls(router.base, ["Zoe"] * SESSIONS, [f"call-{i}" for i in range(SESSIONS)],
                                      staggered=True))
        after = fleet.scrapes()
    finally:
        stop_process(router.proc, timeout_s=10)
    queries = _deltas(before, after, "parley_prefix_cache_queries_total")
    assert all(queries.values()), f"a replica got no call: {queries}"
    for i, session in enumerate(sessions):
        assert _cached_after_turn_1(session) >= 0.9, f"call {i}: {session}"


async def _send(base: str, bodies: list[dict[str, Any]], concurrency: int, path: str = "/v1/completions",
                stream: bool = False) -> list[tuple[float, Any, dict[str, str], Any]]:
    """Send every body, `concurrency` at a time: (start, status or the exception's name, headers, JSON or None)."""
    sem = asyncio.Semaphore(concurrency)
    out: list[tuple[float, Any, dict[str, str], Any]] = []
    async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S, headers=AUTH) as client:
        async def one(body: dict[str, Any]) -> None:
            async with sem:
                t0 = time.monotonic()
                try:
                    if stream:
                        async with client.stream("POST", path, json={**body, "stream": True}) as r:
                            text = (await r.aread()).decode()
                        ok = r.status_code == 200 and "data: [DONE]" in text and '"error"' not in text
                        out.append((t0, r.status_code if ok else f"{r.status_code}, cut short", dict(r.headers), None))
                    else:
                        r = await client.post(path, json=body)
                        out.append((t0, r.status_code, dict(r.headers), r.json()))
                except httpx.HTTPError as e:
                    out.append((t0, type(e).__name__, {}, None))
        await asyncio.gather(*(one(b) for b in bodies))
    return out


def _fresh(n: int, tag: str) -> list[dict[str, Any]]:
    """Prompts with nothing in common (each begins differently), 8 tokens each."""
    return [{"prompt": f"{i * 7919 % 1009} {tag} caller {i}: what are your opening hours on day {i}?",
             "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0} for i in range(n)]


def _without_token_ids(router_metrics: Scrape) -> float:
    """Requests the router routed by load alone, its render calls having brought no token ids back."""
    return router_metrics.total("vllm_router_prefix_routing_decisions_total", outcome="missing_tokens")


def test_the_router_passes_the_callers_key_on_and_the_replicas_401_back(fleet: Fleet) -> None:
    """Ten calls through the router without a key or with a wrong one, six with the key. Each refused call is refused
    by every replica the router asks for token ids (vllm-router 0.1.17 asks each) and by the one it sends the call to,
    once: the replicas count (replicas + 1) refusals a call, no retry. The client gets the replica's 401 as it was;
    the keyed calls are answered, with their token ids (their render calls carried the key); no replica leaves the
    rotation."""
    before, routed = fleet.scrapes(), fleet.router.metrics()
    refused: list[httpx.Response] = []
    with httpx.Client(base_url=fleet.router.base, timeout=REQUEST_TIMEOUT_S) as client:
        for i, headers in enumerate([{}] * 5 + [{"Authorization": "Bearer sk-not-the-key"}] * 5):
            refused.append(client.post("/v1/completions", headers=headers, json=_fresh(1, f"keyless-{i}")[0]))
        answered = [client.post("/v1/completions", headers=AUTH, json=body) for body in _fresh(6, "keyed")]
    after, done = fleet.scrapes(), fleet.router.metrics()
    for r in refused:
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (r.status_code, r.text)
        assert_openai_error(r.json(), code="invalid_api_key", param=None)
    assert [r.status_code for r in answered] == [200] * 6, [r.text for r in answered]
    refusals = _deltas(before, after, "parley_api_key_refusals_total")
    assert sum(refusals.values()) == 10 * (len(fleet.replicas) + 1), refusals
    assert _without_token_ids(done) - _without_token_ids(routed) == 10  # the keyed six had their token ids
    assert done.total("vllm_router_request_errors_total", error_type="non_retryable_error") - \
        routed.total("vllm_router_request_errors_total", error_type="non_retryable_error") == 10
    assert set(worker_health(fleet.router).values()) == {1}
    assert set(s.value for s in done.samples if s.name == "vllm_router_cb_state") == {0}  # every breaker closed


def test_fresh_prompts_spread_over_the_replicas(fleet: Fleet) -> None:
    before = fleet.scrapes()
    results = asyncio.run(_send(fleet.router.base, _fresh(30, "spread"), concurrency=3))
    after = fleet.scrapes()
    assert [r[1] for r in results] == [200] * 30
    done = _completed(before, after)
    assert sum(done.values()) == 30 and max(done.values()) <= 15, done


def test_a_full_replica_sends_the_overflow_elsewhere(fleet: Fleet) -> None:
    """Every request wants one replica: they share a long prefix (a popular agent's instructions) that the first one
    leaves in its cache. Eight at a time: that replica fills its batch, and the rest go to the others."""
    fleet.needs_prefix_routing()
    prefix = f"You are Zoe, {INSTRUCTIONS} "
    bodies = [{"prompt": f"{prefix}Caller {i} asks: are you open on day {i}?", "max_tokens": TOKENS,
               "ignore_eos": True, "temperature": 0} for i in range(36)]
    running: dict[int, float] = {i: 0.0 for i in range(3)}
    kv_use: dict[int, float] = {i: 0.0 for i in range(3)}

    async def watched() -> list[tuple[float, Any, dict[str, str], Any]]:
        async def watch() -> None:  # each replica's peaks, as its /metrics says (what a router or picker reads)
            async with httpx.AsyncClient(timeout=10) as c:
                while True:
                    for i, r in enumerate(fleet.replicas):
                        m = Scrape.parse((await c.get(f"{r.base}/metrics")).text)
                        running[i] = max(running[i], m.get("parley_requests_running") or 0)
                        kv_use[i] = max(kv_use[i], m.get("parley_kv_cache_usage_perc") or 0)
                    await asyncio.sleep(0.01)
        watcher = asyncio.create_task(watch())
        try:
            return await _send(fleet.router.base, bodies[1:], concurrency=2 * MAX_BATCH)
        finally:
            watcher.cancel()

    before = fleet.scrapes()
    first = asyncio.run(_send(fleet.router.base, bodies[:1], concurrency=1))  # the prefix lands on one replica
    placed = fleet.scrapes()
    (owner,) = [i for i, d in _completed(before, placed).items() if d]
    results = asyncio.run(watched())
    after = fleet.scrapes()
    assert Counter(r[1] for r in first + results) == {200: 36}
    done = _completed(placed, after)
    assert sum(done.values()) == 35
    # the prefix's replica ran (nearly) full before the rest went elsewhere: the router's load threshold sends
    # requests on at a full batch or one short of it, and /metrics is sampled every ~10 ms on a busy 2-core box
    assert running[owner] >= MAX_BATCH - 1, f"the prefix's replica (#{owner}) never filled its batch: {running}"
    assert kv_use[owner] >= (MAX_BATCH - 1) / KV_SLOTS, kv_use  # its KV use: the share of slots running ones hold
    assert done[owner] < 35 and sum(1 for d in done.values() if d) >= 2, f"nothing overflowed: {done}"


def test_when_no_replica_can_take_it_the_client_gets_the_429_and_do_not_retry(tmp_path) -> None:
    """A router in front of one replica that keeps its SLA for one request at a time: its refusals have nowhere
    else to go. The router retries each a few times within ~20 ms, then passes the replica's 429 on, headers and
    body as they were."""
    replica = tiny_server(tmp_path / "one-at-a-time.log", *ONE_AT_A_TIME)
    router = None
    try:
        router = start_router([replica.base], tmp_path / "router-one.log", BALANCE_ABS_THRESHOLD)
        results = asyncio.run(_send(router.base, _fresh(6, "full"), concurrency=6))
        # The router passes the client's send time on (deploy/README.md, "The client's clock"): a request whose
        # client sent it 400 ms of its 500 ms ago is refused on every try, the same request sent now is served.
        poll(lambda: scrape_metrics(replica.base).get("parley_requests_running"), lambda n: n == 0, 60,
             "the replica idle")
        body = _fresh(1, "clock")[0]
        stale = httpx.post(f"{router.base}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S,
                           headers={**AUTH, "x-request-start": f"t={(time.time() - 0.4) * 1e3:.0f}"})
        fresh = httpx.post(f"{router.base}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S,
                           headers={**AUTH, "x-request-start": f"t={time.time() * 1e3:.0f}"})
    finally:
        if router is not None:
            stop_process(router.proc, timeout_s=10)
        assert stop_server(replica) == 0, replica.log_tail()
    assert (stale.status_code, fresh.status_code) == (429, 200), (stale.text, fresh.text)
    statuses = Counter(r[1] for r in results)
    assert set(statuses) <= {200, 429} and statuses[200] >= 1 and statuses[429] >= 1, statuses
    for _, status, headers, body in results:
        if status == 429:
            assert headers["x-should-retry"] == "false" and int(headers["retry-after"]) >= 1, headers
            assert body["error"]["type"] == "overloaded", body


def test_a_replica_killed_under_load_costs_only_its_in_flight_requests(fleet: Fleet) -> None:
    """Streams at six at a time; replica 0 is killed (SIGKILL) a second in. Only streams it was serving may fail;
    every request sent after the kill succeeds; the router marks it down; later requests all succeed."""
    victim = fleet.replicas[0]
    bodies = [{**b, "max_tokens": 16} for b in _fresh(60, "kill")]

    async def load_and_kill() -> tuple[list[tuple[float, Any, dict[str, str], Any]], float]:
        task = asyncio.create_task(_send(fleet.router.base, bodies, concurrency=6, stream=True))
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        victim.proc.kill()
        return await task, killed_at

    results, killed_at = asyncio.run(load_and_kill())
    victim.proc.wait(timeout=10)
    failed = [r for r in results if r[1] != 200]
    assert len(failed) <= 6, f"{len(failed)} failed, more than were in flight: {Counter(r[1] for r in failed)}"
    assert all(start < killed_at for start, *_ in failed), "a request sent after the kill failed"
    assert len(results) - len(failed) >= 54

    dead = victim.base
    poll(lambda: worker_health(fleet.router).get(dead), lambda h: h == 0, 30, "the router marks the dead replica down")
    later = asyncio.run(_send(fleet.router.base, _fresh(12, "after"), concurrency=4))
    assert [r[1] for r in later] == [200] * 12
