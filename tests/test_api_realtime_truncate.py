"""conversation.item.truncate on /v1/realtime: after a barge-in the caller heard only part of a reply, and the
conversation (and the session's cached K/V) keep only that. response.done names the reply as an assistant item.
The accounting of characters to tokens on fixed deltas, then the event against a real `parley serve`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

from service.api.errors import APIError
from service.api.truncation import ReplyItem, Truncate
from service.engine.request import Delta
from tests.server_support import Server, recv_event
from tests.test_api_realtime import run, send, until_done

INSTRUCTIONS = "You are a friendly voice assistant. Answer in full sentences."
FIRST = "Tell me about the history of the bicycle."
SECOND = "Thanks! And who invented the car?"


# -- the accounting ---------------------------------------------------------------------------------------------
def reply_of(*deltas: Delta, prompt_tokens: int = 100) -> ReplyItem:
    reply = ReplyItem("resp_1", prompt_tokens)
    for d in deltas:
        reply.add(d)
    reply.text = "".join(d.text for d in deltas)
    return reply


def test_keep_tokens_counts_the_tokens_whose_text_was_heard() -> None:
    # "Hel" | (a token held back: half of a character) | "lo wo" (that token and the next) | "rld"
    reply = reply_of(Delta("Hel", [1]), Delta("", [2]), Delta("lo wo", [3]), Delta("rld", [4]))
    assert reply.text == "Hello world"
    assert [reply.keep_tokens(n) for n in (0, 2, 3, 7, 8, 10, 11)] == [100, 100, 101, 101, 103, 103, 104]


def test_truncate_cuts_the_text_and_what_later_truncations_can_keep() -> None:
    reply = reply_of(Delta("One.", [1]), Delta(" Two.", [2]), Delta(" Three.", [3]))
    reply.truncate(9)
    assert reply.text == "One. Two."
    assert reply.keep_tokens(9) == 102 and reply.keep_tokens(4) == 101
    out = json.loads(reply.output("cancelled").model_dump_json())  # as response.done writes it
    assert out == {"id": reply.id, "object": "realtime.item", "type": "message", "role": "assistant",
                   "status": "incomplete", "content": [{"type": "output_text", "text": "One. Two."}]}
    assert reply.id.startswith("item_") and reply.output("completed").status == "completed"


@pytest.mark.parametrize("event, param, code", [
    ({"content_index": 0, "text_end": 3}, "item_id", "missing_required_parameter"),
    ({"item_id": 7, "text_end": 3}, "item_id", "invalid_value"),
    ({"item_id": "i", "content_index": 1, "text_end": 3}, "content_index", "invalid_value"),
    ({"item_id": "i", "content_index": True, "text_end": 3}, "content_index", "invalid_value"),
    ({"item_id": "i", "content_index": 0, "audio_end_ms": 1500}, "text_end", "missing_required_parameter"),
    ({"item_id": "i", "text_end": "3"}, "text_end", "invalid_value"),
    ({"item_id": "i", "text_end": -1}, "text_end", "invalid_value"),
    ({"item_id": "i", "text_end": 2.5}, "text_end", "invalid_value"),
])
def test_bad_truncate_events(event: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(APIError) as e:
        Truncate.parse({"type": "conversation.item.truncate", **event})
    assert (e.value.param, e.value.code, e.value.status) == (param, code, 400)


def test_a_good_truncate_event() -> None:
    assert Truncate.parse({"type": "conversation.item.truncate", "item_id": "item_1", "content_index": 0,
                           "text_end": 0}) == Truncate("item_1", 0)
    assert Truncate.parse({"item_id": "resp_1", "text_end": 12}) == Truncate("resp_1", 12)  # content_index: 0


# -- against the server -----------------------------------------------------------------------------------------
async def session(ws: ClientConnection) -> None:
    assert (await recv_event(ws))["type"] == "session.created"
    await send(ws, {"type": "session.update", "session": {"instructions": INSTRUCTIONS, "temperature": 0}})
    assert (await recv_event(ws))["type"] == "session.updated"


async def barge_in(ws: ClientConnection, rid: str, after_deltas: int) -> tuple[list[str], dict[str, Any]]:
    """A reply cancelled after `after_deltas` deltas: (its deltas, response.done's response)."""
    await send(ws, {"type": "response.create", "response": {
        "id": rid, "input": [{"role": "user", "content": FIRST}], "max_tokens": 200, "ignore_eos": True}})
    deltas: list[str] = []
    while True:
        e = await recv_event(ws)
        if e["type"] == "response.output_text.delta":
            deltas.append(e["delta"])
            if len(deltas) == after_deltas:
                await send(ws, {"type": "response.cancel", "response_id": rid})
        elif e["type"] == "response.done":
            return deltas, e["response"]
        else:
            assert e["type"] == "response.created", e


async def truncate(ws: ClientConnection, item_id: str, text_end: int) -> dict[str, Any]:
    await send(ws, {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                    "text_end": text_end})
    return await recv_event(ws)


async def reply(ws: ClientConnection, messages: list[dict[str, str]]) -> dict[str, Any]:
    await send(ws, {"type": "response.create", "response": {"input": messages, "max_tokens": 12, "ignore_eos": True}})
    _, done = await until_done(ws)
    assert done["status"] == "incomplete", done  # max_tokens cut it (ignore_eos)
    return done


@pytest.mark.slow
def test_response_done_names_the_reply_as_an_assistant_item(shared_server: Server) -> None:
    async def go() -> dict[str, Any]:
        async with connect(shared_server.ws) as ws:
            await session(ws)
            return await reply(ws, [{"role": "user", "content": FIRST}])

    done = run(go())
    [item] = done["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "incomplete"
    assert item["id"].startswith("item_") and item["content"] == [{"type": "output_text", "text": done["output_text"]}]


@pytest.mark.slow
def test_the_next_turn_sees_only_what_was_heard(shared_server: Server) -> None:
    """After a barge-in and a truncate to what was heard, the next turn is the one a client that sent that history
    itself gets: the same prompt, the same greedy reply; its cache holds no more than what was heard."""
    async def go() -> tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with connect(shared_server.ws) as ws:
            await session(ws)
            deltas, first = await barge_in(ws, "r1", after_deltas=8)
            heard = "".join(deltas[:4])  # the speech stopped while the client was still receiving
            assert first["status"] == "cancelled" and first["output_text"] == "".join(deltas)
            truncated = await truncate(ws, first["output"][0]["id"], len(heard))
            second = await reply(ws, [{"role": "user", "content": SECOND}])
        async with connect(shared_server.ws) as ws:  # a cold socket given the heard history explicitly
            await session(ws)
            cold = await reply(ws, [{"role": "user", "content": FIRST}, {"role": "assistant", "content": heard},
                                    {"role": "user", "content": SECOND}])
        return heard, first, truncated, second, cold

    heard, first, truncated, second, cold = run(go())
    assert truncated == {"type": "conversation.item.truncated", "item_id": first["output"][0]["id"],
                         "content_index": 0, "text_end": len(heard)}
    assert second["usage"]["prompt_tokens"] == cold["usage"]["prompt_tokens"]
    assert second["output_text"] == cold["output_text"]
    # (the cold socket may reuse the closed first socket's K/V: the prefix cache serves every socket alike)
    assert cold["usage"]["cached_tokens"] < cold["usage"]["prompt_tokens"]
    # the first turn's prompt came from the cache, and nothing past the heard tokens (one per delta here)
    assert first["usage"]["prompt_tokens"] <= second["usage"]["cached_tokens"] <= first["usage"]["prompt_tokens"] + 4


@pytest.mark.slow
def test_truncate_by_response_id_and_again_shorter(shared_server: Server) -> None:
    async def go() -> list[dict[str, Any]]:
        async with connect(shared_server.ws) as ws:
            await session(ws)
            await send(ws, {"type": "response.create", "response": {
                "id": "r1", "input": [{"role": "user", "content": FIRST}], "max_tokens": 12, "ignore_eos": True}})
            _, done = await until_done(ws)
            text = done["output_text"]
            return [await truncate(ws, "r1", len(text) // 2), await truncate(ws, done["output"][0]["id"], 1),
                    await truncate(ws, "r1", len(text) // 2)]

    by_response, shorter, longer_again = run(go())
    assert by_response["type"] == "conversation.item.truncated" and by_response["item_id"].startswith("item_")
    assert shorter["type"] == "conversation.item.truncated" and shorter["text_end"] == 1
    assert longer_again["type"] == "error" and longer_again["error"]["code"] == "text_end_out_of_range"


@pytest.mark.slow
def test_truncate_errors_keep_the_socket_open(shared_server: Server) -> None:
    async def go() -> None:
        async with connect(shared_server.ws) as ws:
            await session(ws)

            async def expect_error(event: dict[str, Any], code: str, param: str | None) -> None:
                await ws.send(json.dumps({"type": "conversation.item.truncate", **event}))
                e = await recv_event(ws)
                while e["type"] == "response.output_text.delta":  # a response running meanwhile
                    e = await recv_event(ws)
                assert e["type"] == "error", e
                err = e["error"]
                assert (err["code"], err["param"], err["type"]) == (code, param, "invalid_request_error"), err
                assert err["event_type"] == "conversation.item.truncate" and err["message"]

            await expect_error({"item_id": "item_nope", "content_index": 0, "text_end": 0}, "item_not_found",
                               "item_id")
            await expect_error({"item_id": "r1", "content_index": 0, "audio_end_ms": 800},
                               "missing_required_parameter", "text_end")
            done = await reply(ws, [{"role": "user", "content": FIRST}])
            item = done["output"][0]["id"]
            await expect_error({"item_id": item, "content_index": 0, "text_end": len(done["output_text"]) + 1},
                               "text_end_out_of_range", "text_end")
            await expect_error({"item_id": item, "content_index": 2, "text_end": 0}, "invalid_value",
                               "content_index")
            # while a response runs
            await send(ws, {"type": "response.create", "response": {
                "id": "long", "input": [{"role": "user", "content": SECOND}], "max_tokens": 200, "ignore_eos": True}})
            assert (await recv_event(ws))["type"] == "response.created"
            await expect_error({"item_id": item, "content_index": 0, "text_end": 0}, "response_in_progress", None)
            await send(ws, {"type": "response.cancel"})
            _, done = await until_done(ws)
            assert done["status"] == "cancelled"
            # the socket goes on
            assert (await truncate(ws, item, 0))["type"] == "conversation.item.truncated"
            await reply(ws, [{"role": "user", "content": "Bye!"}])

    run(go())
