"""Bad input on every endpoint gets a clear 4xx in OpenAI's shape, never a 5xx, and the server stays healthy.

Table-driven, against a `parley serve` of its own on the tiny synthetic model (256 tokens of context, vocabulary 512).
tests/test_api_openai.py's BAD table already covers the basic errors of the two completion endpoints (bad JSON,
missing prompt, n=2, temperature=5, an unknown model, ...); this file extends it: every endpoint and method, bytes
that are not UTF-8, lone surrogates, NaN and huge numbers, chunked oversize bodies, streaming requests that fail
before they start, odd-but-valid values that must be served (200, never 500), and the realtime WebSocket's bad
events (an `error` event each; the socket stays open and serves a response afterwards).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.server_support import (
    Server,
    assert_openai_error,
    health_status,
    recv_event,
    served,
    sse_events,
    tiny_server,
    wait_idle,
)

pytestmark = pytest.mark.slow

CTX = 256
SLOTS = 2
VOCAB = 512
TIMEOUT_S = 60.0
JSON_CT = {"content-type": "application/json"}
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def input_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # A lax SLA: admission is not the point here, and a 429 from a busy host would hide what the input gets.
    yield from served(tiny_server(tmp_path_factory.mktemp("input") / "parley.log", "--max-batch", str(SLOTS),
                                  "--max-context", str(CTX), "--sla-ms", "600000"))


def raw(body: bytes, **headers: str) -> dict[str, Any]:
    return {"content": body, "headers": {**JSON_CT, **headers}}


def chunked(n_bytes: int) -> dict[str, Any]:
    """A body sent with Transfer-Encoding: chunked (no Content-Length): the limit must hold while it streams in."""

    def gen() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(n_bytes // 65536):
            yield b"a" * 65536
        yield b'"}'

    return {"content": gen(), "headers": JSON_CT}


C, CHAT = "/v1/completions", "/v1/chat/completions"

# name, method, path, request kwargs, status, code, param ("<any>": not checked)
HTTP_BAD: list[tuple[str, str, str, dict[str, Any], int, str | None, str | None]] = [
    # -- the body as bytes
    ("not utf-8", "POST", C, raw(b'{"prompt": "\xff\xfe"}'), 400, "invalid_encoding", None),
    ("not utf-8 chat", "POST", CHAT, raw(b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}'), 400,
     "invalid_encoding", None),
    ("nested too deep", "POST", C, raw(b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400,
     "invalid_json", None),
    ("truncated json chat", "POST", CHAT, raw(b'{"messages": [{"role": '), 400, "invalid_json", None),
    ("empty body", "POST", C, raw(b""), 400, "invalid_body", None),
    ("json number", "POST", C, raw(b"42"), 400, "invalid_body", None),
    ("json null chat", "POST", CHAT, raw(b"null"), 400, "invalid_body", None),
    ("text/plain", "POST", C, {"content": b"prompt=hi", "headers": {"content-type": "text/plain"}}, 400,
     "invalid_body", None),
    ("oversize chunked", "POST", C, chunked(2 << 20), 413, "request_too_large", None),
    ("oversize chat", "POST", CHAT, {"json": {"messages": [{"role": "user", "content": "a" * (2 << 20)}]}}, 413,
     "request_too_large", None),
    # -- lone surrogates: valid JSON (\ud800), not text
    ("surrogate prompt", "POST", C, raw(b'{"prompt": "a\\ud800b"}'), 400, "invalid_encoding", "prompt"),
    ("surrogate chat", "POST", CHAT, raw(b'{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400,
     "invalid_encoding", "messages.0.content"),
    # -- numbers
    ("max_tokens -5", "POST", C, {"json": {"prompt": "x", "max_tokens": -5}}, 400, "invalid_value", "max_tokens"),
    ("max_tokens 0", "POST", C, {"json": {"prompt": "x", "max_tokens": 0}}, 400, "invalid_value", "max_tokens"),
    ("max_tokens 1.5", "POST", C, {"json": {"prompt": "x", "max_tokens": 1.5}}, 400, "invalid_value", "max_tokens"),
    ("max_tokens 1e400", "POST", C, raw(b'{"prompt": "x", "max_tokens": 1e400}'), 400, "invalid_value",
     "max_tokens"),
    ("max_tokens 10**30", "POST", C, {"json": {"prompt": "x", "max_tokens": 10**30}}, 400,
     "context_length_exceeded", "max_tokens"),
    ("max_completion_tokens -1", "POST", CHAT, {"json": {"messages": MSG, "max_completion_tokens": -1}}, 400,
     "invalid_value", "max_completion_tokens"),
    ("chat max_tokens huge", "POST", CHAT, {"json": {"messages": MSG, "max_tokens": 10**9}}, 400,
     "context_length_exceeded", "max_tokens"),
    ("temperature NaN", "POST", C, raw(b'{"prompt": "x", "temperature": NaN}'), 400, "invalid_value",
     "temperature"),
    ("temperature -0.1", "POST", CHAT, {"json": {"messages": MSG, "temperature": -0.1}}, 400, "invalid_value",
     "temperature"),
    ("temperature Infinity", "POST", CHAT, raw(b'{"messages": [{"role": "user", "content": "x"}], '
                                               b'"temperature": Infinity}'), 400, "invalid_value", "temperature"),
    ("top_p 1.5", "POST", C, {"json": {"prompt": "x", "top_p": 1.5}}, 400, "invalid_value", "top_p"),
    ("top_p NaN", "POST", CHAT, raw(b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}'), 400,
     "invalid_value", "top_p"),
    ("top_k -2", "POST", C, {"json": {"prompt": "x", "top_k": -2}}, 400, "invalid_value", "top_k"),
    ("seed 2**64", "POST", C, {"json": {"prompt": "x", "seed": 2**64}}, 400, "invalid_value", "seed"),
    ("presence_penalty 2", "POST", CHAT, {"json": {"messages": MSG, "presence_penalty": 2}}, 400, "invalid_value",
     "presence_penalty"),
    # -- types and missing fields
    ("prompt null", "POST", C, {"json": {"prompt": None}}, 400, "invalid_value", "prompt"),
    ("prompt floats", "POST", C, {"json": {"prompt": [1.0, 2.0]}}, 400, "invalid_value", "prompt"),
    ("prompt bools", "POST", C, {"json": {"prompt": [True, False]}}, 400, "invalid_value", "prompt"),
    ("stream 'maybe'", "POST", C, {"json": {"prompt": "x", "stream": "maybe"}}, 400, "invalid_value", "stream"),
    ("stop not strings", "POST", C, {"json": {"prompt": "x", "stop": [1, 2]}}, 400, "invalid_value", "stop.0"),
    ("stream_options list", "POST", CHAT, {"json": {"messages": MSG, "stream_options": [1]}}, 400, "invalid_value",
     "stream_options"),
    ("messages missing", "POST", CHAT, {"json": {"max_tokens": 2}}, 400, "missing_required_parameter", "messages"),
    ("messages object", "POST", CHAT, {"json": {"messages": {"role": "user", "content": "x"}}}, 400,
     "invalid_value", "messages"),
    ("message without role", "POST", CHAT, {"json": {"messages": [{"content": "x"}]}}, 400,
     "missing_required_parameter", "messages.0.role"),
    ("message content number", "POST", CHAT, {"json": {"messages": [{"role": "user", "content": 5}]}}, 400,
     "invalid_value", "messages.0.content"),
    ("user message without content", "POST", CHAT, {"json": {"messages": [{"role": "user"}]}}, 400,
     "invalid_value", "messages.0"),
    ("tools", "POST", CHAT, {"json": {"messages": MSG, "tools": [{"type": "function"}]}}, 400,
     "missing_required_parameter", "tools.0.function"),
    # -- prompts the model cannot take
    ("empty token list", "POST", C, {"json": {"prompt": []}}, 400, "empty_prompt", "prompt"),
    ("empty prompt in a list", "POST", C, {"json": {"prompt": [""]}}, 400, "empty_prompt", "prompt"),
    ("negative token id", "POST", C, {"json": {"prompt": [1, -1]}}, 400, "invalid_token_id", "prompt"),
    ("token id = vocab", "POST", C, {"json": {"prompt": [[1, VOCAB]]}}, 400, "invalid_token_id", "prompt"),
    ("token ids past context", "POST", C, {"json": {"prompt": [1] * (CTX + 1)}}, 400, "context_length_exceeded",
     "prompt"),
    ("chat past context", "POST", CHAT, {"json": {"messages": [{"role": "user", "content": "x" * (CTX * 2)}]}},
     400, "context_length_exceeded", "messages"),
    ("batched prompts", "POST", C, {"json": {"prompt": ["a", "b"]}}, 400, "invalid_value", "prompt"),
    # -- streaming requests fail before the stream starts: plain JSON errors, not SSE
    ("stream: unknown model", "POST", C, {"json": {"prompt": "x", "model": "nope", "stream": True}}, 404,
     "model_not_found", "model"),
    ("stream: chat past context", "POST", CHAT, {"json": {"messages": MSG, "max_tokens": CTX * 4, "stream": True}},
     400, "context_length_exceeded", "max_tokens"),
    ("stream: bad token", "POST", C, {"json": {"prompt": [VOCAB + 7], "stream": True}}, 400, "invalid_token_id",
     "prompt"),
    # -- the other endpoints, unknown routes, wrong methods
    ("models: unknown id", "GET", "/v1/models/gpt-9", {}, 404, "model_not_found", "model"),
    ("models: POST", "POST", "/v1/models", {"json": {}}, 405, "method_not_allowed", None),
    ("models: DELETE one", "DELETE", "/v1/models/synthetic:tiny", {}, 405, "method_not_allowed", None),
    ("health: POST", "POST", "/health", {"json": {}}, 405, "method_not_allowed", None),
    ("health: PUT", "PUT", "/health", {"content": b"\xff"}, 405, "method_not_allowed", None),
    ("metrics: POST", "POST", "/metrics", {"content": b"x"}, 405, "method_not_allowed", None),
    ("metrics: DELETE", "DELETE", "/metrics", {}, 405, "method_not_allowed", None),
    ("completions: GET", "GET", C, {}, 405, "method_not_allowed", None),
    ("chat: PUT", "PUT", CHAT, {"json": {"messages": MSG}}, 405, "method_not_allowed", None),
    ("realtime: plain GET", "GET", "/v1/realtime", {}, 426, "websocket_required", None),
    ("realtime: POST", "POST", "/v1/realtime", {"json": {}}, 405, "method_not_allowed", None),
    ("unknown route", "GET", "/v2/completions", {}, 404, "not_found", None),
    ("unknown route, odd bytes", "GET", "/v1/%ff%00..%2f", {}, 404, "not_found", None),
    ("unknown route POST", "POST", "/v1/responses", {"json": {"input": "x"}}, 404, "not_found", None),
    ("root", "GET", "/", {}, 404, "not_found", None),
]


@pytest.mark.parametrize("name,method,path,kwargs,status,code,param", HTTP_BAD, ids=[b[0] for b in HTTP_BAD])
def test_bad_http_input(input_server: Server, name: str, method: str, path: str, kwargs: dict[str, Any], status: int,
                        code: str | None, param: str | None) -> None:
    r = httpx.request(method, input_server.base + path, timeout=TIMEOUT_S, **kwargs)
    assert r.status_code == status, f"{name}: {r.status_code} {r.text[:500]}"
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = assert_openai_error(r.json(), code, param)
    assert err["type"] == "invalid_request_error"


# Odd but valid: served (200), never a 500. top_p=1e-300 rounds to 0 in float32 and used to drop every token.
HTTP_ODD_BUT_VALID: list[tuple[str, str, dict[str, Any]]] = [
    ("top_p 1e-300", C, {"prompt": "hi", "max_tokens": 3, "top_p": 1e-300, "temperature": 1.0}),
    ("temperature 1e-5, top_p 1e-300", C, {"prompt": "hi", "max_tokens": 3, "temperature": 1e-5, "top_p": 1e-300}),
    ("temperature 1e-6 (greedy)", CHAT, {"messages": MSG, "max_tokens": 3, "temperature": 1e-6}),
    ("top_k 10**20", C, {"prompt": "hi", "max_tokens": 3, "top_k": 10**20, "temperature": 2}),
    ("seed extremes", C, {"prompt": "hi", "max_tokens": 2, "seed": -(2**63), "temperature": 1}),
    ("seed 2**64-1", CHAT, {"messages": MSG, "max_tokens": 2, "seed": 2**64 - 1, "temperature": 1}),
    ("NUL and emoji", C, {"prompt": "a\u0000b \U0001f600", "max_tokens": 2}),
    ("assistant-only, no content", CHAT, {"messages": [{"role": "assistant"}], "max_tokens": 2}),
    ("empty user content", CHAT, {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}),
    ("token ids at the edges", C, {"prompt": [0, VOCAB - 1], "max_tokens": 2}),
    ("prompt fills the context", C, {"prompt": [1] * (CTX - 1), "max_tokens": 1}),
    ("empty stop, many fields", CHAT, {"messages": MSG, "max_tokens": 2, "stop": [""], "logit_bias": {},
                                       "response_format": {"type": "text"}, "whatever": {"x": [1]}}),
]


@pytest.mark.parametrize("name,path,body", HTTP_ODD_BUT_VALID, ids=[b[0] for b in HTTP_ODD_BUT_VALID])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_odd_but_valid_input_is_served(input_server: Server, name: str, path: str, body: dict[str, Any], stream: bool
                                       ) -> None:
    r = httpx.post(input_server.base + path, json={**body, "stream": stream}, timeout=TIMEOUT_S)
    assert r.status_code == 200, f"{name}: {r.status_code} {r.text[:500]}"
    if stream:
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert not any('"error"' in e for e in events), events
    else:
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_healthy_and_idle_after_the_http_tables(input_server: Server) -> None:
    assert health_status(input_server.base) == 200
    wait_idle(input_server.base)
    r = httpx.post(f"{input_server.base}/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                   timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


# -- the realtime WebSocket ---------------------------------------------------------------------------------------
def ev(type: str, **fields: Any) -> str:
    return json.dumps({"type": type, **fields})


# name, frame (text or bytes), code, param ("<any>": not checked)
WS_BAD: list[tuple[str, str | bytes, str, str | None]] = [
    ("binary, not utf-8", b"\xff\xfe\x00", "binary_not_supported", "<any>"),
    ("binary json", ev("response.create", response={"input": "hi"}).encode(), "binary_not_supported", "<any>"),
    ("json array", "[1, 2]", "invalid_event", "type"),
    ("json string", '"response.create"', "invalid_event", "type"),
    ("json null", "null", "invalid_event", "type"),
    ("type a number", json.dumps({"type": 7}), "invalid_event", "type"),
    ("empty frame", "", "invalid_json", "<any>"),
    ("truncated", '{"type": "response.create", "response": {"input": ', "invalid_json", "<any>"),
    ("unknown event", ev("input_audio_buffer.append", audio="AAAA"), "unknown_event_type", "type"),
    ("lone surrogate", '{"type": "response.create", "response": {"input": "\\ud800"}}', "invalid_encoding", "<any>"),
    ("surrogate instructions", '{"type": "session.update", "session": {"instructions": "\\udc00"}}',
     "invalid_encoding", "<any>"),
    ("oversized event", ev("response.create", response={"input": "a" * (1 << 20)}), "request_too_large", "<any>"),
    ("session not an object", ev("session.update", session="fast"), "invalid_value", "session"),
    ("session max_tokens -1", ev("session.update", session={"max_tokens": -1}), "invalid_value",
     "session.max_tokens"),
    ("session temperature 'hot'", ev("session.update", session={"temperature": "hot"}), "invalid_value",
     "session.temperature"),
    ("session top_p 0", ev("session.update", session={"top_p": 0}), "invalid_value", "session.top_p"),
    ("session top_k -3", ev("session.update", session={"top_k": -3}), "invalid_value", "session.top_k"),
    ("session seed 2**64", ev("session.update", session={"seed": 2**64}), "invalid_value", "session.seed"),
    ("session 5 stops", ev("session.update", session={"stop": list("abcde")}), "invalid_value", "session.stop"),
    ("session unknown model", ev("session.update", session={"model": "gpt-9"}), "model_not_found",
     "session.model"),
    ("response not an object", ev("response.create", response=[1]), "invalid_value", "response"),
    ("response unknown model", ev("response.create", response={"input": "hi", "model": "gpt-9"}), "model_not_found",
     "response.model"),
    # null is no input (a reply to the conversation), and a fresh socket's conversation is empty
    ("input null", ev("response.create", response={"input": None}), "empty_input", "response.input"),
    ("input bad role", ev("response.create", response={"input": [{"role": "wizard", "content": "x"}]}),
     "invalid_value", "response.input.0.role"),
    ("input image part", ev("response.create", response={"input": [{"role": "user", "content": [
        {"type": "input_audio", "audio": "AAAA"}]}]}), "invalid_value", "response.input.0.content"),
    ("input past context", ev("response.create", response={"input": "x" * (CTX * 2)}), "context_length_exceeded",
     "response.input"),
    ("max_tokens past context", ev("response.create", response={"input": "hi", "max_tokens": 10**12}),
     "context_length_exceeded", "max_tokens"),
    ("max_tokens 0", ev("response.create", response={"input": "hi", "max_tokens": 0}), "invalid_value",
     "response.max_tokens"),
    ("temperature NaN", '{"type": "response.create", "response": {"input": "hi", "temperature": NaN}}',
     "invalid_value", "response.temperature"),
    ("id too long", ev("response.create", response={"input": "hi", "id": "r" * 129}), "invalid_value",
     "response.id"),
    ("id empty", ev("response.create", response={"input": "hi", "id": ""}), "invalid_value", "response.id"),
    ("cancel id a number", ev("response.cancel", response_id=5), "invalid_value", "response_id"),
    ("cancel nothing", ev("response.cancel"), "response_cancel_not_active", "response_id"),
]


async def _one_response(ws: ClientConnection, max_tokens: int = 3) -> dict[str, Any]:
    await ws.send(ev("response.create", response={"input": "hello", "max_tokens": max_tokens, "ignore_eos": True}))
    while True:
        e = await recv_event(ws, TIMEOUT_S)
        assert e["type"] != "error", e
        if e["type"] == "response.done":
            return e["response"]


def test_bad_realtime_events_keep_the_socket_open(input_server: Server) -> None:
    async def go() -> list[str]:
        failures: list[str] = []
        async with connect(input_server.ws, max_size=None) as ws:
            assert (await recv_event(ws, TIMEOUT_S))["type"] == "session.created"
            for name, frame, code, param in WS_BAD:
                await ws.send(frame)
                e = await recv_event(ws, TIMEOUT_S)
                try:
                    assert e["type"] == "error", e
                    err = e["error"]
                    assert {"type", "code", "message", "param"} <= set(err), err
                    assert err["code"] == code and err["message"], err
                    assert err["type"] == "invalid_request_error", err
                    if param != "<any>":
                        assert err["param"] == param, err
                except AssertionError as ex:
                    failures.append(f"{name}: {ex}")
            # the socket still works: a session update and a response
            await ws.send(ev("session.update", session={"temperature": 0, "max_tokens": 3}))
            assert (await recv_event(ws, TIMEOUT_S))["type"] == "session.updated"
            done = await _one_response(ws)
            assert done["status"] == "incomplete" and done["usage"]["completion_tokens"] == 3  # max_tokens ended it
        return failures

    failures = asyncio.run(go())
    assert not failures, "\n".join(failures)
    assert health_status(input_server.base) == 200


def test_realtime_unknown_model_in_the_url_and_a_frame_past_the_limit(input_server: Server) -> None:
    async def go() -> int | None:
        async with connect(input_server.ws + "?model=gpt-9") as ws:
            assert (await recv_event(ws, TIMEOUT_S))["type"] == "session.created"
            e = await recv_event(ws, TIMEOUT_S)
            assert e["type"] == "error" and e["error"]["code"] == "model_not_found", e
            assert e["error"]["param"] == "model"
            done = await _one_response(ws)  # the session serves the one model it has
            assert done["status"] == "incomplete"  # max_tokens ended it (ignore_eos)
        # a frame past what the WebSocket layer takes at all (4 MiB): closed with 1009, the server unharmed
        async with connect(input_server.ws, max_size=None) as ws:
            await recv_event(ws, TIMEOUT_S)
            await ws.send("x" * (5 << 20))
            try:
                await asyncio.wait_for(ws.recv(), TIMEOUT_S)
            except ConnectionClosed as closed:
                return closed.rcvd.code if closed.rcvd else None
            return None

    assert asyncio.run(go()) == 1009
    assert health_status(input_server.base) == 200
    wait_idle(input_server.base)
