"""Soak: hours of mixed, misbehaving traffic against one Parley server, then a verdict.

    python -m bench soak --spawn "--model synthetic:tiny --max-batch 8"     # starts its own server (30 min)
    python -m bench soak --url http://127.0.0.1:8000 --pid 12345 --minutes 60
    python -m bench soak --spawn "--model synthetic:tiny" --minutes 0.6     # the CI variant (tests/)

Workers loop until the time is up, each request drawn at random: /v1/completions or /v1/chat/completions (JSON or
SSE) or a realtime WebSocket session of one to three turns; most run to the end, some hang up early (after k SSE
chunks, mid-request, or by dropping the socket), some cancel (response.cancel), a few send bad input on purpose.
With an API key (--api-key, $OPENAI_API_KEY; a spawned server requires it) every request carries it, in the
Authorization header or, on half of the WebSockets, as a browser sends it (the `openai-insecure-api-key.<key>`
subprotocol), and some of the bad ones come with no key or a wrong one. A poller reads /health every second and
/metrics every five, without a key: both stay open.

At the end, every one of these must hold, or the exit status is 1:
- every request was answered: a completion, a 429 (refused: Retry-After and x-should-retry: false), or the 4xx a
  bad request asked for (a 401 `invalid_api_key` for a missing or wrong key, a WebSocket's at its handshake); no
  5xx, no stream ending in an error, no request unanswered within --request-timeout-s;
- /health answered 200 every time;
- once the traffic stops, nothing runs or waits and every KV slot is free;
- the server's RSS (VmRSS, /proc/<pid>/status; with --spawn or --pid) grew by less than --max-rss-growth-mb from
  the end of the warm-up (the first --warmup-s seconds) to the end;
- a spawned server exits 0 on SIGTERM, with no traceback in its log.

It uses httpx, websockets and prometheus_client only (no torch, no imports of service/), so it runs from any client
box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bench.server import ServerFailed, add_api_key_argument, api_key, auth_headers, use_api_key
from bench.server import start as start_server
from bench.server import stop as stop_server
from loadtest.sse import event_lines

BAD_BODIES = [  # (path, body, the status it must get)
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 400),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
]


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    health_polls: int = 0
    health_bad: int = 0
    health_max_ms: float = 0.0
    metrics_polls: int = 0

    def fail(self, what: str) -> None:
        self.outcomes["FAILED"] += 1
        if len(self.failures) < 50:
            self.failures.append(what)


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a /metrics text, as prometheus_client reads it (ValueError if it is not Prometheus text)."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric(samples: list[Sample], name: str, **labels: str) -> float | None:
    """The sum of the samples `name` whose labels include `labels`; None when there is none."""
    values = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    return sum(values) if values else None


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# -- one request of each kind -------------------------------------------------------------------------------------
def check_429(r: httpx.Response, t: Tally, where: str) -> None:
    if int(r.headers.get("retry-after", "0")) < 1 or r.headers.get("x-should-retry") != "false":
        t.fail(f"{where}: a 429 without Retry-After/x-should-retry: {dict(r.headers)}")
    else:
        t.outcomes["refused (429)"] += 1


async def backoff(rng: random.Random) -> None:
    """After a refusal, a caller waits a moment (a voice agent would say "one moment"), not Retry-After's second."""
    await asyncio.sleep(rng.uniform(0.05, 0.25))


async def http_request(client: httpx.AsyncClient, rng: random.Random, t: Tally) -> None:
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    body: dict = {"max_tokens": rng.randint(1, 64), "temperature": rng.choice([0, 0.7, 1.0]),
                  "ignore_eos": rng.random() < 0.5, "stream": stream}
    text = rng.choice(["Hello there.", "Tell me a story about a fox.", "Count: 1 2 3", "x" * rng.randint(1, 300)])
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    where = f"POST {path} stream={stream}"
    behaviour = rng.choices(["to_the_end", "hang_up"], weights=[80, 20])[0]
    if not stream:
        if behaviour == "hang_up":  # give up mid-request: the server must cancel it
            try:
                await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.001, 0.05))
            except TimeoutError:
                t.outcomes["hung up (json)"] += 1
                return
        r = await client.post(path, json=body)
        if r.status_code == 200:
            u = r.json()["usage"]
            ok = 1 <= u["completion_tokens"] <= body["max_tokens"]
            t.outcomes["completed"] += 1 if ok else 0
            if not ok:
                t.fail(f"{where}: usage {u}")
        elif r.status_code == 429:
            check_429(r, t, where)
            await backoff(rng)
        else:
            t.fail(f"{where}: {r.status_code} {r.text[:200]}")
        return
    k = rng.randint(1, 8) if behaviour == "hang_up" else 10**9
    async with client.stream("POST", path, json=body) as r:
        if r.status_code == 429:
            await r.aread()
            check_429(r, t, where)
            await backoff(rng)
            return
        if r.status_code != 200:
            t.fail(f"{where}: {r.status_code} {(await r.aread())[:200]!r}")
            return
        seen, last = 0, ""
        async for line in event_lines(r.aiter_bytes()):
            if not line.startswith("data: "):
                continue
            seen, last = seen + 1, line[6:]
            if '"error"' in last and last.startswith('{"error"'):
                t.fail(f"{where}: the stream ended in an error: {last[:200]}")
                return
            if seen >= k:
                t.outcomes["hung up (sse)"] += 1
                return  # leaving the block closes the connection mid-stream
        if last != "[DONE]":
            t.fail(f"{where}: the stream ended without [DONE] (last {last[:100]!r})")
        else:
            t.outcomes["completed"] += 1


async def realtime_session(ws_url: str, rng: random.Random, t: Tally, timeout_s: float) -> None:
    key = api_key()
    if key and rng.random() < 0.5:  # as a browser sends it: it cannot set headers
        credentials: dict = {"subprotocols": ["realtime", f"openai-insecure-api-key.{key}"]}
    else:
        credentials = {"additional_headers": auth_headers()}
    async with connect(ws_url, open_timeout=timeout_s, close_timeout=5, **credentials) as ws:

        late_cancels = 0  # cancels sent as a response was ending: each may get its own error, or none

        async def recv() -> dict:
            nonlocal late_cancels
            while True:
                e = json.loads(await asyncio.wait_for(ws.recv(), timeout_s))
                if late_cancels and e["type"] == "error" and e["error"]["code"] == "response_cancel_not_active":
                    late_cancels -= 1
                    t.outcomes["late cancel refused (ws)"] += 1
                    continue
                return e

        if (await recv())["type"] != "session.created":
            t.fail("realtime: no session.created")
            return
        await ws.send(json.dumps({"type": "session.update", "session": {
            "instructions": "Answer briefly.", "temperature": rng.choice([0, 0.8]),
            "chunking": rng.choice(["none", "sentence"])}}))
        if (await recv())["type"] != "session.updated":
            t.fail("realtime: no session.updated")
            return
        for turn in range(rng.randint(1, 3)):
            behaviour = rng.choices(["to_the_end", "cancel", "drop", "bad_event"], weights=[70, 15, 10, 5])[0]
            if behaviour == "bad_event":
                await ws.send(rng.choice(["{not json", json.dumps({"type": "nope"}),
                                          json.dumps({"type": "response.create", "response": {"input": 42}})]))
                e = await recv()
                if e["type"] != "error" or e["error"]["type"] != "invalid_request_error":
                    t.fail(f"realtime: a bad event got {e}")
                else:
                    t.outcomes["bad input refused (ws)"] += 1
                continue
            await ws.send(json.dumps({"type": "response.create", "response": {
                "input": [{"role": "user", "content": f"Turn {turn}: say something."}],
                "max_tokens": rng.randint(4, 64), "ignore_eos": rng.random() < 0.5}}))
            deltas, cancelled = 0, False
            while True:
                e = await recv()
                if e["type"] == "error":
                    if e["error"]["type"] == "overloaded" and e["error"].get("retry_after_ms", 0) >= 1:
                        t.outcomes["refused (ws)"] += 1
                        await backoff(rng)
                    else:
                        t.fail(f"realtime: error {e['error']}")
                    break
                if e["type"] == "response.output_text.delta":
                    deltas += 1
                    if behaviour == "drop" and deltas >= rng.randint(1, 4):
                        t.outcomes["dropped (ws)"] += 1
                        return  # leaving the block closes the socket mid-response
                    if behaviour == "cancel" and deltas == 1:
                        await ws.send(json.dumps({"type": "response.cancel"}))
                        cancelled = True
                if e["type"] == "response.done":
                    status = e["response"]["status"]
                    if status == "failed":
                        t.fail(f"realtime: response failed {e['response'].get('status_details')}")
                    else:
                        t.outcomes[f"realtime {status}"] += 1
                    if cancelled and status in ("completed", "incomplete"):  # the cancel came too late; an error
                        # may follow
                        late_cancels += 1
                    break


async def bad_request(client: httpx.AsyncClient, ws_url: str, rng: random.Random, t: Tally) -> None:
    if api_key() and rng.random() < 0.5:
        await bad_key(client, ws_url, rng, t)
        return
    path, body, status = rng.choice(BAD_BODIES)
    r = await client.post(path, json=body)
    err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != status or not {"message", "type", "param", "code"} <= set(err):
        t.fail(f"bad input {body}: {r.status_code} {r.text[:200]}")
    else:
        t.outcomes["bad input refused (http)"] += 1


async def bad_key(client: httpx.AsyncClient, ws_url: str, rng: random.Random, t: Tally) -> None:
    """No key, or a wrong one: over HTTP a 401 `invalid_api_key` in OpenAI's shape, a WebSocket refused with a 401 at
    its handshake."""
    wrong = rng.choice([{}, {"Authorization": "Bearer not-the-key"}])
    if rng.random() < 0.5:
        request = client.build_request("POST", "/v1/chat/completions", headers=wrong,
                                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        if not wrong:
            del request.headers["Authorization"]  # the client's own
        r = await client.send(request)
        code = r.json().get("error", {}).get("code") if r.headers.get("content-type") == "application/json" else None
        if r.status_code != 401 or code != "invalid_api_key":
            t.fail(f"{'a wrong' if wrong else 'no'} key: {r.status_code} {r.text[:200]}")
        else:
            t.outcomes["refused for its key (http)"] += 1
        return
    try:
        async with connect(ws_url, additional_headers=wrong, close_timeout=5):
            t.fail(f"realtime with {'a wrong' if wrong else 'no'} key: accepted")
    except InvalidStatus as e:
        if e.response.status_code != 401:
            t.fail(f"realtime with {'a wrong' if wrong else 'no'} key: HTTP {e.response.status_code}")
        else:
            t.outcomes["refused for its key (ws)"] += 1


# -- the run --------------------------------------------------------------------------------------------------------
async def worker(base: str, deadline: float, rng: random.Random, t: Tally, timeout_s: float) -> None:
    ws_url = base.replace("http", "ws", 1) + "/v1/realtime"
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=4)
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s, limits=limits, headers=auth_headers()) as client:
        while time.monotonic() < deadline:
            kind = rng.choices(["http", "realtime", "bad"], weights=[70, 25, 5])[0]
            try:
                async with asyncio.timeout(timeout_s):
                    if kind == "http":
                        await http_request(client, rng, t)
                    elif kind == "realtime":
                        await realtime_session(ws_url, rng, t, timeout_s)
                    else:
                        await bad_request(client, ws_url, rng, t)
            except TimeoutError:
                t.fail(f"{kind}: no answer within {timeout_s:.0f} s")
            except (httpx.HTTPError, ConnectionClosed, OSError) as e:
                t.fail(f"{kind}: {type(e).__name__}: {e}")


async def poller(base: str, deadline: float, t: Tally) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:  # no key: /health and /metrics stay open
        n = 0
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            try:
                ok = (await client.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            t.health_polls += 1
            t.health_max_ms = max(t.health_max_ms, (time.perf_counter() - t0) * 1e3)
            if not ok:
                t.health_bad += 1
            if n % 5 == 0:
                try:
                    parse_metrics((await client.get("/metrics")).text)
                    t.metrics_polls += 1
                except (httpx.HTTPError, ValueError) as e:
                    t.fail(f"GET /metrics failed: {type(e).__name__}: {e}")
            n += 1
            await asyncio.sleep(1.0)


async def wait_idle(base: str, timeout_s: float) -> list[Sample]:
    """Poll /metrics until nothing runs or waits and every KV slot is free; the last samples (idle or not)."""
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        end = time.monotonic() + timeout_s
        while True:
            m = parse_metrics((await client.get("/metrics")).text)
            if (metric(m, "parley_requests_running") == 0 and metric(m, "parley_requests_waiting") == 0
                    and metric(m, "parley_kv_slots_free") == metric(m, "parley_kv_slots_total")):
                return m
            if time.monotonic() > end:
                return m
            await asyncio.sleep(0.2)


async def soak(base: str, pid: int | None, args: argparse.Namespace) -> tuple[Tally, list[str]]:
    t = Tally()
    problems: list[str] = []
    start = time.monotonic()
    deadline = start + args.minutes * 60
    rng = random.Random(args.seed)
    tasks = [asyncio.create_task(worker(base, deadline, random.Random(rng.random()), t, args.request_timeout_s))
             for _ in range(args.concurrency)]
    tasks.append(asyncio.create_task(poller(base, deadline, t)))
    warmup_s = min(args.warmup_s, args.minutes * 60 / 3)
    await asyncio.sleep(warmup_s)
    rss_warm = rss_mb(pid)
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - start
    m = await wait_idle(base, 60)
    rss_end = rss_mb(pid)

    running, waiting = metric(m, "parley_requests_running"), metric(m, "parley_requests_waiting")
    free, total = metric(m, "parley_kv_slots_free"), metric(m, "parley_kv_slots_total")
    if running != 0 or waiting != 0 or free != total:
        problems.append(f"not idle after the traffic: running {running}, waiting {waiting}, slots free {free}/{total}")
    failed = metric(m, "parley_requests_total", outcome="failed") or 0
    if failed:
        problems.append(f"the server counts {failed:.0f} failed requests")
    if t.health_bad:
        problems.append(f"/health was not 200 in {t.health_bad} of {t.health_polls} polls")
    if t.failures:
        problems.append(f"{t.outcomes['FAILED']} requests went wrong, e.g.:\n    " + "\n    ".join(t.failures[:10]))
    growth = None
    if rss_warm is not None and rss_end is not None:
        growth = rss_end - rss_warm
        if growth >= args.max_rss_growth_mb:
            problems.append(f"RSS grew {growth:.1f} MB after warm-up (limit {args.max_rss_growth_mb:g})")
    total_requests = sum(v for k, v in t.outcomes.items() if k != "FAILED") + t.outcomes["FAILED"]
    print(f"soak: {elapsed:.0f} s, {args.concurrency} workers, {total_requests} requests "
          f"({total_requests / max(elapsed, 1e-9):.1f}/s)")
    for k, v in sorted(t.outcomes.items()):
        print(f"  {k:28s} {v}")
    print(f"  /health: {t.health_polls} polls, {t.health_bad} not 200, slowest {t.health_max_ms:.0f} ms; "
          f"/metrics: {t.metrics_polls} polls")
    print(f"  after: running {running}, waiting {waiting}, KV slots free {free}/{total}")
    if growth is not None:
        print(f"  RSS: {rss_warm:.1f} MB after {warmup_s:.0f} s of warm-up -> {rss_end:.1f} MB ({growth:+.1f})")
    else:
        print("  RSS: not measured (give --pid, or --spawn)")
    return t, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--spawn", metavar="ARGS", help='start `parley serve ARGS` on a free port, e.g. '
                                                        '"--model synthetic:tiny --max-batch 8"')
    p.add_argument("--pid", type=int, help="with --url: the server's process id, to watch its RSS")
    p.add_argument("--minutes", type=float, default=30.0, help="how long to run (default 30)")
    p.add_argument("--concurrency", type=int, default=12, help="concurrent clients (default 12)")
    p.add_argument("--warmup-s", type=float, default=60.0,
                   help="RSS is measured from the end of this (at most a third of the run; default 60)")
    p.add_argument("--max-rss-growth-mb", type=float, default=40.0, help="allowed RSS growth (default 40)")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="unanswered after this = failure")
    p.add_argument("--start-timeout-s", type=float, default=300.0, help="with --spawn: time to become healthy")
    p.add_argument("--seed", type=int, default=0)
    add_api_key_argument(p)
    args = p.parse_args(argv)
    use_api_key(args.api_key)

    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    if args.spawn is not None:
        log = Path(tempfile.mkdtemp(prefix="parley-soak-")) / "server.log"
        try:
            started = start_server(shlex.split(args.spawn), log, args.start_timeout_s)
        except ServerFailed as e:
            raise SystemExit(f"soak: {e}") from None
        proc, base = started.proc, started.base
        pid: int | None = proc.pid
        print(f"soak: spawned parley serve {args.spawn} at {base} (pid {pid}, log {log})")
    else:
        base, pid = args.url.rstrip("/"), args.pid
    try:
        _, problems = asyncio.run(soak(base, pid, args))
    finally:
        if proc is not None:
            stop_server(proc)
    if proc is not None and log is not None:
        if proc.returncode != 0:
            problems.append(f"the server exited {proc.returncode} on SIGTERM")
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            problems.append(f"a traceback in the server's log ({log}):\n" + text[text.index("Traceback"):][:2000])
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("OK: every request answered, no 5xx, nothing left running, every slot free, RSS bounded")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
