"""A scripted OpenAI-style server whose token timings are known, for the loadtest tests.

Each request's last user message may hold directives `key=value`: ttft=<ms> (default 5), itl=<ms> (default 0.5),
status=<429|500> (answer that instead), refuse_turn=<i> (answer 429 to a session's turn i, 0-based: over HTTP the
request whose conversation holds i + 1 user messages, on the WebSocket the i-th in-band response.create), usage=<n>
(report n completion tokens whatever was streamed); a `script`
field of the body (realtime: of `response`) holds more, which win. Token i (0-based) is sent at ttft + i × itl ms
after the request arrived; every chunk carries one token " t". A prompt's tokens are its words: over HTTP,
`cached_tokens` is the prefix it shares with the previous request's prompt; on the WebSocket, the session's
instructions and conversation so far (replies as truncated by conversation.item.truncate; a `conversation: "none"`
response adds nothing to it).
Run as a script it binds 127.0.0.1 on a free port and prints the port on its first line.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

STATS: dict[str, Any] = {}
# Prometheus text at /metrics, as Parley's: one observation of the engine loop's histogram per completed HTTP stream
# (its ttft), so that a loadtest's snapshots around each rate can be checked against the streams it ran
REGISTRY = CollectorRegistry()
SERVED = Histogram("parley_engine_host_seconds", "scripted: one observation per completed stream (its ttft)",
                   buckets=(0.001, 0.01, 0.1), registry=REGISTRY)


def reset() -> None:
    STATS.update(requests=0, completed=0, disconnects=0, ws_sessions=0, ws_cancels=0, message_counts=[],
                 ws_inputs=[], bodies=[], cached=[], last_prompt=[], ws_events=[], session_ids=[])


reset()


def directives(text: str, script: str | None = None) -> dict[str, float]:
    out = {"ttft": 5.0, "itl": 0.5}
    for word in f"{text} {script or ''}".split():
        k, _, v = word.partition("=")
        if v:
            out[k] = float(v)
    return out


def shared_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def last_user(messages: list[dict[str, str]]) -> str:
    return next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")


async def ticks(d: dict[str, float], n: int):
    """Yield i at ttft + i × itl ms after now (absolute schedule: no drift), never before."""
    t0 = time.perf_counter()
    for i in range(n):
        await sleep_until(t0 + (d["ttft"] + i * d["itl"]) / 1000.0)
        yield i


async def sleep_until(deadline: float) -> None:
    """Until time.perf_counter() reaches `deadline`: uvloop's timers (libuv's, in whole milliseconds from a clock read
    once a loop turn) may fire a fraction of a millisecond early, and the tests check no token comes before its time."""
    while (left := deadline - time.perf_counter()) > 0:
        await asyncio.sleep(left)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": "scripted-model", "object": "model"}]})


async def stats(request: Request) -> JSONResponse:
    if request.method == "POST":
        reset()
    return JSONResponse(STATS)


async def complete(request: Request) -> Any:
    body = await request.json()
    STATS["requests"] += 1
    STATS["bodies"].append(body)
    STATS["session_ids"].append(request.headers.get("x-session-id"))
    chat = "messages" in body
    text = last_user(body["messages"]) if chat else body["prompt"]
    if chat:
        STATS["message_counts"].append(len(body["messages"]))
    d = directives(text, body.get("script"))
    turn = sum(m["role"] == "user" for m in body["messages"]) - 1 if chat else 0
    if d.get("status") == 429 or d.get("refuse_turn") == turn:
        return JSONResponse({"error": {"message": "overloaded", "type": "rate_limit_error"}}, status_code=429,
                            headers={"Retry-After": "0.5", "x-should-retry": "false"})
    if "status" in d:
        return JSONResponse({"error": {"message": "scripted failure"}}, status_code=int(d["status"]))
    n = int(body["max_tokens"])
    words = [w for m in body["messages"] for w in m["content"].split()] if chat else text.split()
    cached = shared_prefix(STATS["last_prompt"], words)
    STATS["last_prompt"] = words
    STATS["cached"].append(cached)
    usage = {"prompt_tokens": len(words), "completion_tokens": int(d.get("usage", n)),
             "total_tokens": len(words) + int(d.get("usage", n)), "prompt_tokens_details": {"cached_tokens": cached}}

    async def stream():
        done = False
        try:
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            async for _ in ticks(d, n):
                yield sse({"choices": [{"index": 0, "delta": {"content": " t"}}]} if chat else
                          {"choices": [{"index": 0, "text": " t"}]})
            SERVED.observe(d["ttft"] / 1000.0)  # before the stream's end reaches the client
            yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]} if chat else
                      {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if body.get("stream_options", {}).get("include_usage"):
                yield sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
            done = True
            STATS["completed"] += 1
        finally:
            if not done:
                STATS["disconnects"] += 1

    return StreamingResponse(stream(), media_type="text/event-stream")


async def metrics(request: Request) -> Response:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def realtime(ws: WebSocket) -> None:
    await ws.accept()
    STATS["ws_sessions"] += 1
    await ws.send_json({"type": "session.created", "session": {"id": "sess_1"}})
    running: dict[str, asyncio.Task] = {}
    instructions: list[str] = []
    conversation: list[str] = []  # contents, in order
    replies: dict[str, int] = {}  # assistant item id → its place in the conversation
    turns = 0  # in-band response.create events so far

    async def respond(rid: str, d: dict[str, float], n: int, inputs: list[str], in_band: bool) -> None:
        sent = 0
        context = len(" ".join(instructions + conversation).split())
        try:
            await ws.send_json({"type": "response.created", "response": {"id": rid}})
            async for _ in ticks(d, n):
                await ws.send_json({"type": "response.output_text.delta", "response_id": rid, "delta": " t"})
                sent += 1
            status = "completed"
        except asyncio.CancelledError:
            status = "cancelled"
        item_id = f"item_{rid}"
        if in_band:
            conversation.extend(inputs)
            replies[item_id] = len(conversation)
            conversation.append(" t" * sent)
        usage = {"input_tokens": context + len(" ".join(inputs).split()), "output_tokens": int(d.get("usage", sent)),
                 "cached_tokens": context}
        output = [{"id": item_id, "type": "message", "role": "assistant",
                   "content": [{"type": "output_text", "text": " t" * sent}]}]
        await ws.send_json({"type": "response.done", "response": {"id": rid, "status": status, "usage": usage,
                                                                   "output": output}})
        running.pop(rid, None)

    try:
        while True:
            event = await ws.receive_json()
            STATS["ws_events"].append(event)
            if event["type"] == "session.update":
                instructions[:] = [event["session"]["instructions"]]
                await ws.send_json({"type": "session.updated", "session": event["session"]})
            elif event["type"] == "response.create":
                r = event["response"]
                messages = r["input"] if isinstance(r["input"], list) else [{"role": "user", "content": r["input"]}]
                STATS["ws_inputs"].append(messages)
                d = directives(last_user(messages), r.get("script"))
                in_band = r.get("conversation") != "none"
                turns += in_band
                if d.get("status") == 429 or (in_band and d.get("refuse_turn") == turns - 1):
                    await ws.send_json({"type": "error", "error": {"type": "rate_limit_error", "code":
                                        "rate_limit_exceeded", "message": "overloaded", "retry_after_ms": 500}})
                    continue
                rid = r.get("id") or f"resp_{len(STATS['ws_inputs'])}"
                running[rid] = asyncio.create_task(respond(rid, d, int(r["max_tokens"]), [m["content"] for m in
                                                   messages], in_band))
            elif event["type"] == "conversation.item.create":
                item = event["item"]
                conversation.append(item["content"])
                await ws.send_json({"type": "conversation.item.created", "item": {"id": f"item_{len(conversation)}",
                                                                                  **item}})
            elif event["type"] == "response.cancel":
                STATS["ws_cancels"] += 1
                task = running.get(event["response_id"])
                if task is not None:
                    task.cancel()
                else:  # as Parley answers a cancel that came after its response ended
                    await ws.send_json({"type": "error", "error": {
                        "type": "invalid_request_error", "code": "response_cancel_not_active",
                        "message": "no response in progress", "event_type": "response.cancel"}})
            elif event["type"] == "conversation.item.truncate":
                where = replies.get(event["item_id"])
                if where is None:
                    await ws.send_json({"type": "error", "error": {
                        "type": "invalid_request_error", "code": "item_not_found", "message": "no such item"}})
                    continue
                conversation[where] = conversation[where][:event["text_end"]]
                await ws.send_json({"type": "conversation.item.truncated", "item_id": event["item_id"],
                                    "content_index": 0, "text_end": event["text_end"]})
    except WebSocketDisconnect:
        for task in running.values():
            task.cancel()


app = Starlette(routes=[
    Route("/v1/models", models), Route("/stats", stats, methods=["GET", "POST"]), Route("/metrics", metrics),
    Route("/v1/completions", complete, methods=["POST"]), Route("/v1/chat/completions", complete, methods=["POST"]),
    WebSocketRoute("/v1/realtime", realtime),
])


if __name__ == "__main__":
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # proto TCP: asyncio sets
    # TCP_NODELAY only on such sockets; without it Nagle + delayed ACK hold small WebSocket frames for 40 ms
    sock.bind(("127.0.0.1", 0))
    print(sock.getsockname()[1], flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off")).run(sockets=[sock])
    sys.exit(0)
