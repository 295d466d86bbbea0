"""Tools on /v1/realtime against a live `parley serve`: a call arrives as response.output_item.added,
response.function_call_arguments.delta/.done and a function_call item of response.done; the client answers with a
`role: "tool"` message and the conversation goes on from the cache (prefix reuse across the round trip); a call cut
by a barge-in leaves a history the next turn takes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.server_support import Server, recv_event
from tests.test_api_realtime import run, send, until_done

pytestmark = pytest.mark.slow

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# the Realtime API's shape: the function's fields beside "type"
GET_WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather",
               "parameters": PARAMETERS}
SESSION = {"instructions": "You are a voice assistant. Use the tools.", "temperature": 0, "max_tokens": 48,
           "tools": [GET_WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


async def opened(ws: ClientConnection) -> None:
    assert (await recv_event(ws))["type"] == "session.created"
    await send(ws, {"type": "session.update", "session": SESSION})
    updated = await recv_event(ws)
    assert updated["type"] == "session.updated" and updated["session"]["tool_choice"] == "required"


def test_a_tool_round_trip(shared_server: Server) -> None:
    async def go() -> None:
        async with connect(shared_server.ws) as ws:
            await opened(ws)
            await send(ws, {"type": "response.create", "response": {"id": "r1", "input": ASK}})
            events, done = await until_done(ws)
            added = [e for e in events if e["type"] == "response.output_item.added"]
            deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
            [end] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
            [item] = [a["item"] for a in added]
            assert item["type"] == "function_call" and item["name"] == "get_weather"
            assert len(deltas) > 1 and all(
                (d["response_id"], d["item_id"], d["call_id"], d["name"]) == ("r1", item["id"], item["call_id"],
                                                                              "get_weather") for d in deltas)
            assert (end["item_id"], end["call_id"], end["name"]) == (item["id"], item["call_id"], "get_weather")
            assert end["arguments"] == "".join(d["delta"] for d in deltas)
            jsonschema.validate(json.loads(end["arguments"]), PARAMETERS)
            assert done["status"] == "completed"
            # the call alone, as OpenAI sends it: no empty message item beside it
            [call] = done["output"]
            assert call == {**item, "status": "completed", "arguments": end["arguments"]}
            assert {e["output_index"] for e in events if "output_index" in e} == {0}
            first_prompt = done["usage"]["prompt_tokens"]

            # the tool's result; the session still offers the tool, this turn lets the model answer in words
            await send(ws, {"type": "response.create", "response": {"id": "r2", "tool_choice": "none", "input": [
                {"role": "tool", "tool_call_id": call["call_id"], "content": '{"temperature_c": 21}'}]}})
            events, done = await until_done(ws)
            assert done["status"] in ("completed", "incomplete")
            # words, with no tool markup (SmolLM2 used to echo the <tool_response> block, which left nothing to say)
            spoken = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert spoken.strip() and spoken == done["output_text"] and "<tool" not in spoken
            assert [o["type"] for o in done["output"]] == ["message"]
            assert not [e for e in events if e["type"].startswith("response.function_call")]
            # this turn's prompt extends the last one (its prompt + the call): prefilled from the cache
            assert done["usage"]["cached_tokens"] >= first_prompt
            assert done["usage"]["prompt_tokens"] > done["usage"]["cached_tokens"]

    run(go())


def test_a_call_cut_by_a_barge_in_leaves_a_history_the_next_turn_takes(shared_server: Server) -> None:
    async def go() -> None:
        async with connect(shared_server.ws) as ws:
            await opened(ws)
            await send(ws, {"type": "response.create", "response": {"id": "r1", "input": ASK}})
            while (e := await recv_event(ws))["type"] != "response.function_call_arguments.delta":
                assert e["type"] != "response.done", e
            await send(ws, {"type": "response.cancel", "response_id": "r1"})
            events, done = await until_done(ws)
            assert done["status"] == "cancelled"
            assert not [e for e in events if e["type"] == "response.function_call_arguments.done"]
            [call] = [o for o in done["output"] if o["type"] == "function_call"]
            assert call["status"] == "incomplete"
            await send(ws, {"type": "response.create", "response": {"id": "r2", "tool_choice": "auto", "input": [
                {"role": "user", "content": "Never mind. Say hello."}]}})
            _, done = await until_done(ws)
            assert done["status"] in ("completed", "incomplete") and done["usage"]["cached_tokens"] > 0

    run(go())


def test_a_turn_naming_an_unknown_tool_is_an_error_event(shared_server: Server) -> None:
    async def go() -> None:
        async with connect(shared_server.ws) as ws:
            await opened(ws)
            choice: dict[str, Any] = {"type": "function", "name": "book_table"}
            await send(ws, {"type": "response.create", "response": {"tool_choice": choice, "input": ASK}})
            e = await recv_event(ws)
            assert e["type"] == "error" and e["error"]["param"] == "response.tool_choice"
            await send(ws, {"type": "session.update", "session": {"tools": [{"type": "function", "name": "x y"}]}})
            e = await recv_event(ws)
            assert e["type"] == "error" and e["error"]["param"] == "session.tools.0.function.name"

    run(go())


def test_a_call_cut_by_max_tokens_has_what_the_model_wrote(shared_server: Server) -> None:
    """max_tokens cuts the call: the function_call item is incomplete and its arguments are the text the model wrote
    (never arguments it did not write, such as "{}"); the response is incomplete, and says why."""
    async def go() -> tuple[dict[str, Any], str]:
        async with connect(shared_server.ws) as ws:
            await opened(ws)
            await send(ws, {"type": "response.create", "response": {"input": ASK, "max_tokens": 14}})
            _, done = await until_done(ws)
            await send(ws, {"type": "response.create", "response": {"input": ASK, "max_tokens": 64}})
            _, whole = await until_done(ws)
            return done, whole["output"][0]["arguments"]

    done, arguments = run(go())
    assert done["status"] == "incomplete"
    assert done["status_details"] == {"type": "incomplete", "reason": "max_output_tokens"}
    [call] = done["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete" and call["name"] == "get_weather"
    assert call["arguments"] != "{}" and arguments.startswith(call["arguments"]), (call, arguments)


def test_a_response_to_nothing_is_an_error(shared_server: Server) -> None:
    """response.create with an empty input on a fresh session has nothing to reply to: an error event, no
    generation, and the socket goes on."""
    async def go() -> list[dict[str, Any]]:
        async with connect(shared_server.ws) as ws:
            assert (await recv_event(ws))["type"] == "session.created"
            await send(ws, {"type": "response.create", "response": {"input": []}})
            error = await recv_event(ws)
            await send(ws, {"type": "response.create", "response": {"input": ASK, "max_tokens": 2}})
            events, done = await until_done(ws)
            return [error, events[0], done]

    error, created, done = run(go())
    assert error["type"] == "error" and error["error"]["code"] == "empty_input"
    assert error["error"]["param"] == "response.input"
    assert created["type"] == "response.created" and done["usage"]["completion_tokens"] == 2


def test_a_repeated_call_is_one_call_and_ends_the_reply(shared_server: Server) -> None:
    """Parallel calls allowed, greedy SmolLM2 writes the same call again and again: one function_call item, the
    reply cut there (completed, not run to max_tokens)."""
    async def go() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        async with connect(shared_server.ws) as ws:
            await opened(ws)
            await send(ws, {"type": "response.create", "response": {"input": ASK, "parallel_tool_calls": True,
                                                                    "max_tokens": 200}})
            return await until_done(ws)

    events, done = run(go())
    assert done["status"] == "completed" and done["usage"]["completion_tokens"] < 200
    [call] = done["output"]
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert len([e for e in events if e["type"] == "response.output_item.added"]) == 1
