"""The two ways to talk to a server: OpenAI-style HTTP with SSE streaming (/v1/completions,
/v1/chat/completions) and Parley's realtime WebSocket (/v1/realtime). Each turn fills one RequestRecord."""

from __future__ import annotations

import json
import ssl
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from loadtest.record import RequestRecord
from loadtest.sse import event_lines
from loadtest.workload import Message, prompt_text

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "realtime": "/v1/realtime"}


@dataclass
class Target:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    endpoint: str = "completions"  # completions | chat | realtime
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 300.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = True  # exact output lengths (vLLM, SGLang and Parley accept it; OpenAI's API does not)
    # Every HTTP request of a conversation carries `x-session-id: <session_prefix>-<session>` (None: no header):
    # what a router's session-sticky policy keys on (vllm-router's sticky_least_loaded, consistent_hash)
    session_prefix: str | None = None

    def url_of(self, path: str) -> str:
        """The URL of one of the server's paths (`url` may end in a slash)."""
        return self.url.rstrip("/") + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def eos(target: Target) -> dict[str, bool]:
    return {"ignore_eos": True} if target.ignore_eos else {}


class ClientPool:
    """HTTP clients of one connection each (aiohttp sessions), lent to one session at a time. aiohttp, not httpx (the
    openai SDK's transport): a measuring client's own cost lands in every time it reports. Against an idle Parley on
    the H100, one 32-token stream's first token p50 5.5 ms with httpx, 4.5 with aiohttp (its send 1.28 -> 0.62 ms),
    and the client's event-loop lag p99 at 80-160 req/s 1.9-3.2 -> 1.0-1.1 ms (loadtest/README.md); httpx's shared
    pool had also added ~150 ms to the first token at 50 streams in flight."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.ssl = ssl.create_default_context()  # built once: building one per client costs milliseconds
        self.free: list[aiohttp.ClientSession] = []
        self.made: list[aiohttp.ClientSession] = []

    def take(self) -> aiohttp.ClientSession:
        if self.free:
            return self.free.pop()
        t = self.target.timeout_s
        client = aiohttp.ClientSession(headers=self.target.headers,
                                       connector=aiohttp.TCPConnector(limit=1, ssl=self.ssl),
                                       timeout=aiohttp.ClientTimeout(total=None, sock_connect=t, sock_read=t))
        self.made.append(client)
        return client

    def give(self, client: aiohttp.ClientSession) -> None:
        self.free.append(client)

    async def __aenter__(self) -> ClientPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self.made:
            await client.close()


async def first_model(client: aiohttp.ClientSession, target: Target) -> str:
    """The first model the server lists (GET /v1/models); aiohttp.ClientResponseError where it answers an error."""
    async with client.get(target.url_of("/v1/models")) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def server_text(client: aiohttp.ClientSession, target: Target, path: str) -> str | None:
    """The text the server answers at `path` (GET; its /metrics, say); None where it answers an error or none."""
    try:
        async with client.get(target.url_of(path)) as resp:
            return await resp.text() if resp.status < 400 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text one SSE chunk carries ('' for a role-only, usage-only or empty chunk)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "text" in c:
        return c["text"] or ""
    delta = c.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


def retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def is_rate_limit(err: dict[str, Any]) -> bool:
    """An error event that sheds load (the WebSocket's 429)."""
    words = f"{err.get('type', '')} {err.get('code', '')}".lower()
    return err.get("retry_after_ms") is not None or "rate_limit" in words or "overload" in words or "429" in words


async def http_turn(client: aiohttp.ClientSession, target: Target, conversation: list[Message], max_tokens: int,
                    rec: RequestRecord, cancel_after: int | None = None) -> RequestRecord:
    """One streamed request. `cancel_after`: close the stream after that many tokens (barge-in)."""
    body: dict[str, Any] = {"model": target.model, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, **eos(target), **target.extra_body}
    if target.endpoint == "chat":
        body["messages"] = conversation
    else:
        body["prompt"] = prompt_text(conversation)
    t0 = time.perf_counter()
    try:
        headers = {} if target.session_prefix is None else {"x-session-id": f"{target.session_prefix}-{rec.session}"}
        # when it was sent, as proxies write it: a server behind a router (which may retry it) judges it from now
        headers["x-request-start"] = f"t={time.time():.6f}"
        async with client.post(target.url_of(PATHS[target.endpoint]), json=body, headers=headers) as resp:
            rec.status = resp.status
            if resp.status == 429:
                rec.outcome, rec.retry_after_s = "rejected", retry_after(resp.headers.get("retry-after"))
                await resp.read()
            elif resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.read()).decode(errors='replace')[:300]}"
            else:
                await _read_sse(resp, rec, t0, cancel_after)
    except aiohttp.ClientError as e:
        rec.outcome, rec.error = "error", f"{type(e).__name__}: {e}"
    rec.end_s = rec.start_s + time.perf_counter() - t0
    return rec


async def _read_sse(resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float, cancel_after: int | None) -> None:
    parts: list[str] = []
    usage_tokens: int | None = None
    async for line in event_lines(resp.content.iter_any()):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            continue  # read on to the body's end, so that the connection goes back to the pool
        chunk = json.loads(data)
        if "error" in chunk:
            rec.error = json.dumps(chunk["error"])[:300]
            return
        text = chunk_text(chunk)
        if text:
            rec.token_times_s.append(time.perf_counter() - t0)
            parts.append(text)
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            usage_tokens = usage.get("completion_tokens")
        if cancel_after is not None and len(rec.token_times_s) >= cancel_after:
            rec.outcome = "cancelled"
            resp.close()  # the connection closed: the server sees the client go and frees the slot
            break
    rec.text = "".join(parts)
    rec.output_tokens = usage_tokens if usage_tokens is not None else len(rec.token_times_s)
    if rec.outcome != "cancelled":
        rec.outcome = "ok"


def ws_url(url: str) -> str:
    return Target(url).url_of(PATHS["realtime"]).replace("https://", "wss://", 1).replace("http://", "ws://", 1)


class RealtimeSession:
    """One WebSocket, one conversation: each turn is a response.create whose input is the turn's new
    messages (the server keeps the conversation, so a turn prefills only what is new). The system prompt is the
    session's `instructions`. After a barge-in the client tells the server how much of the reply was heard
    (conversation.item.truncate), so that the conversation keeps only that, as a voice client does."""

    def __init__(self, target: Target, instructions: str | None = None) -> None:
        self.target = target
        self.instructions = instructions
        self.ws: ClientConnection | None = None

    async def open(self, rec: RequestRecord) -> bool:
        """Connect, wait for session.created and set the instructions. False (and `rec` says why, and the socket
        is closed again) when refused or failed."""
        t0 = time.perf_counter()
        opened = False
        try:
            self.ws = await connect(ws_url(self.target.url), additional_headers=self.target.headers,
                                    max_size=None, open_timeout=self.target.timeout_s)
            event = json.loads(await self.ws.recv())
            if event.get("type") != "error" and self.instructions is not None:
                await self.ws.send(json.dumps({"type": "session.update",
                                               "session": {"instructions": self.instructions}}))
                event = await self._next_event("session.updated")
            if event.get("type") == "error":
                self._error(rec, event.get("error") or {})
            else:
                opened = True
        except InvalidStatus as e:
            rec.status = e.response.status_code
            if rec.status == 429:
                rec.outcome = "rejected"
                rec.retry_after_s = retry_after(e.response.headers.get("retry-after"))
            else:
                rec.error = f"WebSocket refused: HTTP {rec.status}"
        except Exception as e:  # any failure to connect is this turn's error, not the run's
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            rec.end_s = rec.start_s + time.perf_counter() - t0
        if not opened:
            await self.close()
        return opened

    async def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            await ws.close()

    @staticmethod
    def _error(rec: RequestRecord, err: dict[str, Any]) -> None:
        if is_rate_limit(err):
            rec.outcome, rec.status = "rejected", 429
            ms = err.get("retry_after_ms")
            rec.retry_after_s = ms / 1000.0 if ms is not None else None
        else:
            rec.outcome, rec.error = "error", json.dumps(err)[:300]

    async def _next_event(self, kind: str) -> dict[str, Any]:
        """The next event of type `kind`, or the next error that is not a late cancel's."""
        assert self.ws is not None
        async for raw in self.ws:
            event = json.loads(raw)
            if event.get("type") == kind or (event.get("type") == "error" and not _late_cancel(event)):
                return event
        raise ConnectionError("the server closed the WebSocket")

    async def add(self, messages: list[Message], rec: RequestRecord) -> bool:
        """conversation.item.create for each message (a refused turn as the agent's fallback answered it); False,
        with the server's error in `rec.error`, where one was not added."""
        assert self.ws is not None
        for m in messages:
            await self.ws.send(json.dumps({"type": "conversation.item.create",
                                           "item": {"type": "message", "role": m["role"], "content": m["content"]}}))
            event = await self._next_event("conversation.item.created")
            if event.get("type") == "error":
                rec.error = "conversation.item.create: " + json.dumps(event.get("error"))[:300]
                return False
        return True

    async def truncate(self, item_id: str, text_end: int, rec: RequestRecord) -> None:
        """conversation.item.truncate: the reply `item_id` was heard up to `text_end` characters."""
        assert self.ws is not None
        await self.ws.send(json.dumps({"type": "conversation.item.truncate", "item_id": item_id,
                                       "content_index": 0, "text_end": text_end}))
        event = await self._next_event("conversation.item.truncated")
        if event.get("type") == "error":
            rec.outcome, rec.error = "error", "truncate: " + json.dumps(event.get("error"))[:300]

    async def turn(self, messages: list[Message], max_tokens: int, rec: RequestRecord,
                   cancel_after: int | None = None, out_of_band: bool = False) -> RequestRecord:
        """One response. `cancel_after`: barge in (response.cancel) after that many deltas; the conversation then
        keeps what had arrived by then. `out_of_band`: a preemptive start, which must not join the conversation
        (OpenAI's `conversation: "none"`)."""
        assert self.ws is not None
        rid = f"resp_{uuid.uuid4().hex[:16]}"
        response = {"id": rid, "input": messages, "max_tokens": max_tokens, **eos(self.target),
                    **self.target.extra_body}
        if out_of_band:
            response["conversation"] = "none"
        t0 = time.perf_counter()
        cancel_t: float | None = None
        usage_tokens: int | None = None
        parts: list[str] = []
        heard: str | None = None  # the text that had arrived when the client barged in
        item_id = rid
        try:
            await self.ws.send(json.dumps({"type": "response.create", "response": response}))
            rec.status = 101
            async for raw in self.ws:
                event = json.loads(raw)
                kind = event.get("type")
                if kind == "response.created":
                    rid = (event.get("response") or {}).get("id", rid)
                elif kind == "response.output_text.delta" and event.get("delta"):
                    rec.token_times_s.append(time.perf_counter() - t0)
                    parts.append(event["delta"])
                    if cancel_after is not None and cancel_t is None and len(rec.token_times_s) >= cancel_after:
                        cancel_t, heard = time.perf_counter(), "".join(parts)
                        await self.ws.send(json.dumps({"type": "response.cancel", "response_id": rid}))
                elif kind == "response.done":
                    resp = event.get("response") or {}
                    usage = resp.get("usage") or {}
                    rec.prompt_tokens = usage.get("input_tokens", usage.get("prompt_tokens"))
                    rec.cached_tokens = usage.get("cached_tokens",
                                                  (usage.get("input_token_details") or {}).get("cached_tokens"))
                    usage_tokens = usage.get("output_tokens", usage.get("completion_tokens"))
                    item_id = next((o["id"] for o in resp.get("output") or [] if o.get("id")), rid)
                    rec.server_timings = resp.get("timings")
                    status = resp.get("status", "completed")
                    if cancel_t is not None:
                        rec.cancel_ms = (time.perf_counter() - cancel_t) * 1000.0
                    if status in ("completed", "incomplete"):  # incomplete: cut by max_tokens, as asked
                        rec.outcome = "ok"
                    elif status == "cancelled":
                        rec.outcome = "cancelled"
                    else:
                        self._error(rec, resp.get("status_details") or resp.get("error") or {"status": status})
                    break
                elif kind == "error":
                    if _late_cancel(event):
                        continue  # a cancel that came after its response ended (a race, not this turn's fault)
                    self._error(rec, event.get("error") or {})
                    break
            else:
                rec.error = "the server closed the WebSocket mid-response"
            rec.end_s = rec.start_s + time.perf_counter() - t0
            if heard is not None and not out_of_band and rec.outcome in ("ok", "cancelled"):
                await self.truncate(item_id, len(heard), rec)
        except Exception as e:  # a dropped socket is this turn's error, not the run's
            rec.outcome, rec.error = "error", f"{type(e).__name__}: {e}"
            rec.end_s = rec.start_s + time.perf_counter() - t0
        rec.text = heard if heard is not None else "".join(parts)
        rec.output_tokens = usage_tokens if usage_tokens is not None else len(rec.token_times_s)
        return rec


def _late_cancel(event: dict[str, Any]) -> bool:
    """The server's answer to a response.cancel that reached it after the response had ended."""
    err = event.get("error") or {}
    return err.get("event_type") == "response.cancel" or err.get("code") == "response_cancel_not_active"
