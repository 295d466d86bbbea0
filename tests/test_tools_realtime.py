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
            [call] = [o for o in done["output"] if o["type"] == "function_call"]
            assert call == {**item, "status": "completed", "arguments": end["arguments"]}
            first_prompt = done["usage"]["prompt_tokens"]

            # the tool's result; the session still offers the tool, this turn lets the model answer in words
            await send(ws, {"type": "response.create", "response": {"id": "r2", "tool_choice": "none", "input": [
                {"role": "tool", "tool_call_id": call["call_id"], "content": '{"temperature_c": 21}'}]}})
            events, done = await until_done(ws)
            assert done["status"] == "completed"
            # what is spoken holds no tool markup (SmolLM2 greedily echoes the <tool_response> block: withheld)
            spoken = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert spoken == done["output_text"] and "<tool" not in spoken and "</tool" not in spoken
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
            assert done["status"] == "completed" and done["usage"]["cached_tokens"] > 0

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
