"""/v1/realtime against a real `parley serve`: the event protocol, barge-in (response.cancel), multi-turn KV reuse
in one engine session, sentence chunking, a dropped socket, and errors that keep the socket open."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.server_support import Server, recv_event, scrape_metrics, wait_idle

pytestmark = pytest.mark.slow


async def send(ws: ClientConnection, event: dict[str, Any]) -> None:
    await ws.send(json.dumps(event))


async def until_done(ws: ClientConnection) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Events up to response.done: (the events before it, response.done's `response`)."""
    events = []
    while True:
        e = await recv_event(ws)
        if e["type"] == "response.done":
            return events, e["response"]
        assert e["type"] != "error", e
        events.append(e)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_session_and_one_turn(shared_server: Server) -> None:
    async def go() -> None:
        async with connect(shared_server.ws) as ws:
            created = await recv_event(ws)
            assert created["type"] == "session.created"
            assert created["session"]["id"] and created["session"]["model"] == "smollm2-135m-instruct"
            await send(ws, {"type": "session.update", "session": {"instructions": "Answer briefly.",
                                                                  "temperature": 0, "max_tokens": 12}})
            updated = await recv_event(ws)
            assert updated["type"] == "session.updated"
            assert updated["session"]["instructions"] == "Answer briefly." and updated["session"]["max_tokens"] == 12
            await send(ws, {"type": "response.create", "response": {
                "id": "r1", "input": [{"role": "user", "content": "What is two plus two?"}]}})
            events, done = await until_done(ws)
            assert events[0] == {"type": "response.created", "response": {"id": "r1", "status": "in_progress"}}
            deltas = [e for e in events[1:]]
            assert deltas and all(e["type"] == "response.output_text.delta" and e["response_id"] == "r1"
                                  for e in deltas)
            assert done["id"] == "r1" and done["status"] in ("completed", "incomplete")
            assert "".join(e["delta"] for e in deltas) == done["output_text"]
            u = done["usage"]
            assert 0 < u["completion_tokens"] <= 12 and u["prompt_tokens"] > 0 and u["cached_tokens"] == 0
            t = done["timings"]
            assert set(t) >= {"ttft_ms", "ttf64_ms", "e2e_ms"} and 0 < t["ttft_ms"] <= t["e2e_ms"]

            # a raw text prompt (no chat template)
            await send(ws, {"type": "response.create", "response": {"input": "Once upon a time", "max_tokens": 3,
                                                                    "ignore_eos": True}})
            _, done = await until_done(ws)
            # cut by max_tokens: incomplete, and why, as OpenAI's Realtime API says it
            assert done["status"] == "incomplete" and done["usage"]["completion_tokens"] == 3
            assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
            assert done["output"][0]["status"] == "incomplete" and done["finish_reason"] == "length"
            # a reply that ends on its own (a stop string here) is completed, with no status_details
            await send(ws, {"type": "response.create", "response": {"input": "Once upon a time", "max_tokens": 8,
                                                                    "stop": ["e"], "ignore_eos": True}})
            _, done = await until_done(ws)
            assert done["finish_reason"] == "stop" and done["status"] == "completed" and "status_details" not in done

    run(go())


def test_openai_s_names_for_the_token_limit_are_heard(shared_server: Server) -> None:
    """The openai SDK and voice frameworks send the Realtime API's max_output_tokens (max_response_output_tokens before
    GA, "inf" for none): the reply is cut there, as with max_tokens."""
    async def go() -> None:
        async with connect(shared_server.ws) as ws:
            await recv_event(ws)  # session.created
            await send(ws, {"type": "response.create", "response": {"input": "Once upon a time",
                                                                    "max_output_tokens": 4, "ignore_eos": True}})
            _, done = await until_done(ws)
            assert done["status"] == "incomplete" and done["usage"]["completion_tokens"] == 4
            await send(ws, {"type": "session.update", "session": {"max_response_output_tokens": 5}})
            assert (await recv_event(ws))["session"]["max_tokens"] == 5
            await send(ws, {"type": "response.create", "response": {"input": "Once upon a time", "ignore_eos": True}})
            _, done = await until_done(ws)
            assert done["usage"]["completion_tokens"] == 5
            await send(ws, {"type": "session.update", "session": {"max_output_tokens": "inf"}})
            assert (await recv_event(ws))["session"]["max_tokens"] is None

    run(go())


def test_cancel_is_quick_and_frees_the_slot(shared_server: Server) -> None:
    async def go() -> tuple[float, dict[str, Any]]:
        async with connect(shared_server.ws) as ws:
            await recv_event(ws)
            await send(ws, {"type": "response.create", "response": {
                "id": "long", "input": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 600,
                "ignore_eos": True}})
            assert (await recv_event(ws))["type"] == "response.created"
            while (await recv_event(ws))["type"] != "response.output_text.delta":
                pass
            t0 = time.monotonic()
            await send(ws, {"type": "response.cancel", "response_id": "long"})
            _, done = await until_done(ws)
            return time.monotonic() - t0, done

    wait_idle(shared_server.base)
    before = scrape_metrics(shared_server.base).requests("cancelled")
    elapsed, done = run(go())
    assert done["status"] == "cancelled" and done["id"] == "long"
    assert done["usage"]["completion_tokens"] < 600
    assert elapsed < 5.0  # one decode step on a busy CPU, with plenty of slack
    after = wait_idle(shared_server.base, timeout_s=15)
    assert after.requests("cancelled") == before + 1


def test_a_barge_ins_response_done_never_waits_for_a_step(tmp_path) -> None:
    """Steps of 300 ms (--step-delay-ms): a response.cancel sent as a delta arrives (the engine has just begun the next
    step) is answered with response.done at once, not when the step ends; the slot is free after that step, and the
    next turn runs in it."""
    from tests.server_support import stop_server, tiny_server

    async def go(base_ws: str) -> list[float]:
        waits = []
        async with connect(base_ws) as ws:
            await recv_event(ws)
            for i in range(3):
                await send(ws, {"type": "response.create", "response": {
                    "id": f"r{i}", "input": f"story {i}", "max_tokens": 50, "ignore_eos": True}})
                while (await recv_event(ws))["type"] != "response.output_text.delta":
                    pass
                t0 = time.monotonic()
                await send(ws, {"type": "response.cancel"})
                _, done = await until_done(ws)
                waits.append(time.monotonic() - t0)
                assert done["status"] == "cancelled" and done["id"] == f"r{i}"
        return waits

    server = tiny_server(tmp_path / "parley.log", "--step-delay-ms", "300", "--sla-ms", "60000", "--max-batch", "1")
    try:
        waits = run(go(server.ws))
        assert max(waits) < 0.15, f"cancel -> done (s): {waits}"
        assert wait_idle(server.base).requests("cancelled") == 3
    finally:
        assert stop_server(server) == 0, server.log_tail()


def test_multi_turn_reuses_the_kv_cache(shared_server: Server) -> None:
    async def go() -> list[dict[str, Any]]:
        async with connect(shared_server.ws) as ws:
            await recv_event(ws)
            await send(ws, {"type": "session.update", "session": {
                "instructions": "You are a helpful voice assistant. Keep answers short.", "temperature": 0}})
            await recv_event(ws)
            done = []
            for text in ("Hi! My name is Ada. What is the capital of France?", "And what is the capital of Italy?"):
                await send(ws, {"type": "response.create", "response": {
                    "input": [{"role": "user", "content": text}], "max_tokens": 16}})
                _, d = await until_done(ws)
                assert d["status"] in ("completed", "incomplete")
                done.append(d)
            return done

    first, second = run(go())
    u1, u2 = first["usage"], second["usage"]
    assert u1["cached_tokens"] == 0
    # the second prompt is the first + its reply + the new message: all but the new part comes from the cache
    assert u2["prompt_tokens"] > u1["prompt_tokens"] + u1["completion_tokens"] - 2
    assert u2["cached_tokens"] >= u1["prompt_tokens"] - 2
    assert u2["prompt_tokens"] - u2["cached_tokens"] < 40


def test_sentence_chunking(shared_server: Server) -> None:
    async def go() -> tuple[list[str], dict[str, Any]]:
        async with connect(shared_server.ws) as ws:
            await recv_event(ws)
            await send(ws, {"type": "session.update", "session": {"chunking": "sentence", "temperature": 0}})
            await recv_event(ws)
            await send(ws, {"type": "response.create", "response": {
                "input": [{"role": "user", "content": "Describe a sunny day in three sentences."}],
                "max_tokens": 60}})
            events, done = await until_done(ws)
            return [e["delta"] for e in events if e["type"] == "response.output_text.delta"], done

    deltas, done = run(go())
    assert "".join(deltas) == done["output_text"] and deltas
    for d in deltas[:-1]:
        assert d[-1] in ".!?;:,\n", f"a chunk that ends mid-clause: {d!r}"


def test_dropped_socket_cancels_and_frees_the_slot(shared_server: Server) -> None:
    async def go() -> None:
        async with connect(shared_server.ws) as ws:
            await recv_event(ws)
            await send(ws, {"type": "response.create", "response": {"input": "Count to a thousand:",
                                                                    "max_tokens": 800, "ignore_eos": True}})
            while (await recv_event(ws))["type"] != "response.output_text.delta":
                pass
        # leaving the block closes the socket mid-response

    wait_idle(shared_server.base)
    before = scrape_metrics(shared_server.base).requests("cancelled")
    run(go())
    after = wait_idle(shared_server.base, timeout_s=15)
    assert after.requests("cancelled") == before + 1


def test_items_then_a_bare_response_create_as_openai_clients_send_them(shared_server: Server) -> None:
    """OpenAI's Realtime clients add the user's transcript (or a tool's output) as an item, then ask for a response
    with no input: each item is answered with conversation.item.created, the response replies to the conversation,
    the next turn reuses its K/V, and an item added while a response runs joins after that reply (so the turn after
    it extends the cached prompt and reply)."""
    async def go() -> list[dict[str, Any]]:
        async with connect(shared_server.ws) as ws:
            await recv_event(ws)
            await send(ws, {"type": "session.update", "session": {"temperature": 0, "max_tokens": 8}})
            await recv_event(ws)
            text = "Hi! My name is Ada. What is the capital of France?"
            await send(ws, {"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
            created = await recv_event(ws)
            assert created["type"] == "conversation.item.created" and created["previous_item_id"] is None
            first_item = created["item"]
            assert first_item["id"].startswith("item_") and first_item["role"] == "user"
            assert first_item["content"] == [{"type": "input_text", "text": text}]
            await send(ws, {"type": "response.create"})
            events, first = await until_done(ws)
            assert events[0]["type"] == "response.created" and first["usage"]["completion_tokens"] > 0

            await send(ws, {"type": "response.create", "response": {
                "input": [{"role": "user", "content": "And of Italy?"}], "max_tokens": 24, "ignore_eos": True}})
            assert (await recv_event(ws))["type"] == "response.created"
            await send(ws, {"type": "conversation.item.create", "item": {
                "id": "item_q3", "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "And of Spain?"}]}})
            events, second = await until_done(ws)
            (created,) = [e for e in events if e["type"] == "conversation.item.created"]
            assert created["item"]["id"] == "item_q3" and created["previous_item_id"] == first_item["id"]
            await send(ws, {"type": "response.create"})
            _, third = await until_done(ws)

            await send(ws, {"type": "conversation.item.create", "item": {
                "type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 14}'}})
            created = await recv_event(ws)
            assert created["item"]["type"] == "function_call_output" and created["item"]["call_id"] == "call_1"
            assert created["item"]["output"] == '{"temp_c": 14}' and created["previous_item_id"] == "item_q3"
            return [first, second, third]

    first, second, third = run(go())
    u1, u2, u3 = first["usage"], second["usage"], third["usage"]
    assert u2["cached_tokens"] >= u1["prompt_tokens"] - 2  # the first item and its reply were the conversation
    # the item came during the second reply and joined after it: the third prompt extends the second's and most of
    # its reply (a reply cut mid-word may tokenize otherwise at its end); ahead of the second turn's message, the
    # cache would end before that message
    assert u3["cached_tokens"] >= u2["prompt_tokens"] + u2["completion_tokens"] // 2
    assert u3["prompt_tokens"] - u3["cached_tokens"] < 40


def test_errors_keep_the_socket_open(shared_server: Server) -> None:
    async def go() -> None:
        async with connect(shared_server.ws) as ws:
            await recv_event(ws)

            async def expect_error(raw: str | bytes, code: str, param: str | None = None) -> dict[str, Any]:
                await ws.send(raw)
                e = await recv_event(ws)
                assert e["type"] == "error", e
                assert e["error"]["code"] == code, e
                assert e["error"]["type"] == "invalid_request_error" and e["error"]["message"]
                if param is not None:
                    assert e["error"]["param"] == param, e
                return e

            await expect_error("{not json", "invalid_json")
            await expect_error(b"\x00\x01", "binary_not_supported")
            await expect_error(json.dumps({"no": "type"}), "invalid_event", "type")
            await expect_error(json.dumps({"type": "conversation.item.create"}), "missing_required_parameter", "item")
            await expect_error(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "AAAA"}]}}),
                "invalid_value")
            await expect_error(json.dumps({"type": "conversation.item.create", "item": {
                "type": "function_call_output", "output": "{}"}}), "invalid_value", "item")
            # nothing to reply to on a fresh socket, with or without a `response` object
            await expect_error(json.dumps({"type": "response.create"}), "empty_input", "response.input")
            await expect_error(json.dumps({"type": "response.create", "response": {}}), "empty_input",
                               "response.input")
            await expect_error(json.dumps({"type": "response.create", "response": {"input": 42}}),
                               "invalid_value", "response.input")
            await expect_error(json.dumps({"type": "response.create", "response": {
                "input": "x", "temperature": 9}}), "invalid_value", "response.temperature")
            await expect_error(json.dumps({"type": "response.create", "response": {"input": ""}}), "empty_prompt")
            await expect_error(json.dumps({"type": "session.update", "session": {"chunking": "words"}}),
                               "invalid_value", "session.chunking")
            await expect_error(json.dumps({"type": "response.cancel", "response_id": "nope"}),
                               "response_cancel_not_active")

            # one response at a time
            await send(ws, {"type": "response.create", "response": {"id": "a", "input": "Once upon a time",
                                                                    "max_tokens": 200, "ignore_eos": True}})
            assert (await recv_event(ws))["type"] == "response.created"
            await ws.send(json.dumps({"type": "response.create", "response": {"input": "again"}}))
            while True:
                e = await recv_event(ws)
                if e["type"] == "error":
                    assert e["error"]["code"] == "conversation_already_has_active_response"
                    break
                assert e["type"] == "response.output_text.delta"
            await send(ws, {"type": "response.cancel"})  # no id: the active one
            _, done = await until_done(ws)
            assert done["id"] == "a" and done["status"] == "cancelled"

            # the socket still works
            await send(ws, {"type": "response.create", "response": {"input": "Hello", "max_tokens": 2,
                                                                    "ignore_eos": True}})
            _, done = await until_done(ws)
            assert done["status"] == "incomplete" and done["usage"]["completion_tokens"] == 2

    run(go())
