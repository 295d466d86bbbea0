"""Tool calls read out of replies as models of each family write them (tool_parsers.py), fed as a server streams them:
one detokenized token at a time (SmolLM2's tokenizer), one character at a time, and whole. Text before a call is
content; a call is its name, then arguments whose pieces join into the JSON the model wrote; what no parser
recognises is content."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from service.api.tool_formats import HERMES, LLAMA3_JSON, CallFormat
from service.api.tool_parsers import CallArguments, CallEnd, CallStart, Content, ToolCallParser, ToolEvent
from service.model.synthetic import smollm2_tokenizer

TOOLS = ("get_weather", "get_time", "transfer_call")


@pytest.fixture(scope="module")
def by_token() -> Callable[[str], list[str]]:
    """A text as a server streams it: the text of each token, as the incremental detokenizer gives it."""
    tok = smollm2_tokenizer(49152)

    def split(text: str) -> list[str]:
        detok = tok.detokenizer()
        return [detok.add(i) for i in tok.encode(text, add_special_tokens=False)] + [detok.flush()]

    return split


def by_char(text: str) -> list[str]:
    return list(text)


def whole(text: str) -> list[str]:
    return [text]


@pytest.fixture(params=["token", "char", "whole"])
def split(request: pytest.FixtureRequest, by_token: Callable[[str], list[str]]) -> Callable[[str], list[str]]:
    """Each reply three ways: a token at a time, a character at a time, and all at once."""
    return {"token": by_token, "char": by_char, "whole": whole}[request.param]


def parse(fmt: CallFormat, deltas: list[str], max_calls: int | None = None) -> tuple[str, list[dict], list[ToolEvent]]:
    """Feed the deltas, then finish: (the content, the calls as OpenAI's message.tool_calls lists them, every
    event). Checks on the way that every call streams as OpenAI streams one: its start (index, id, name) before any
    of its arguments, and its arguments' pieces join into what the call ends with."""
    parser = ToolCallParser(fmt, TOOLS, max_calls)
    events: list[ToolEvent] = []
    for d in deltas:
        events += parser.feed(d)
    events += parser.finish()
    started: dict[int, str] = {}
    pieces: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(started) and e.id.startswith("call_")
            started[e.index] = e.name
        elif isinstance(e, CallArguments | CallEnd):
            assert e.index in started, "arguments before the call's name"
            if isinstance(e, CallArguments):
                pieces[e.index] = pieces.get(e.index, "") + e.text
    calls = [{"name": c.name, "arguments": c.arguments, "complete": c.complete} for c in parser.calls]
    assert [c["arguments"] for c in calls] == [pieces.get(i, "") for i in range(len(calls))]
    return "".join(e.text for e in events if isinstance(e, Content)), calls, events


def call(name: str, arguments: dict, complete: bool = True) -> dict:
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False), "complete": complete}


# Replies as each family writes them (Qwen2.5 / Hermes / SmolLM2: <tool_call> blocks; Llama-3.x: bare JSON).
HERMES_REPLIES = [
    ("text, then a call",
     'Let me check the weather for you.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>',
     "Let me check the weather for you.", [call("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("parallel calls",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Zürich \\"CH\\" {north}"}}\n</tool_call>',
     "", [call("get_weather", {"city": "Paris"}), call("get_weather", {"city": 'Zürich "CH" {north}'})]),
    ("no parameters: {} all the same",
     '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [call("get_time", {})]),
    ("empty arguments", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "",
     [call("get_time", {})]),
    ("arguments before the name",
     '<tool_call>\n{"arguments": {"number": "+15551234"}, "name": "transfer_call"}\n</tool_call>', "",
     [call("transfer_call", {"number": "+15551234"})]),
    ("arguments as a JSON string",
     '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>', "",
     [call("get_weather", {"city": "Oslo"})]),
    ("nested arguments",
     '<tool_call>\n{"name": "transfer_call", "arguments": {"to": {"dept": "sales", "ids": [1, 2]}, "warm": true}}'
     '\n</tool_call>', "", [call("transfer_call", {"to": {"dept": "sales", "ids": [1, 2]}, "warm": True})]),
    ("a function nobody offered is text",
     '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>', []),
    ("no JSON after the marker is text", "Use the <tool_call> tag, then JSON.",
     "Use the <tool_call> tag, then JSON.", []),
    ("plain text with angle brackets", "If x < 3 and y <tool, then stop.\n\nBye.",
     "If x < 3 and y <tool, then stop.\n\nBye.", []),
    ("cut short inside the arguments (max_tokens)",
     'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "Sure.",
     [{"name": "get_weather", "arguments": '{"city": "Par', "complete": False}]),
    ("cut short in the closing marker", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_c', "",
     [call("get_time", {})]),
]

LLAMA3_REPLIES = [
    ("a call", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [call("get_weather", {"city": "Paris"})]),
    ("python_tag", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}', "",
     [call("get_weather", {"city": "Rome", "unit": "c"})]),
    ("two calls, as vLLM's llama3_json reads them",
     '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}', "",
     [call("get_weather", {"city": "Paris"}), call("get_time", {})]),
    ("JSON that is no call is text", '{"answer": 42, "unit": "km"}', '{"answer": 42, "unit": "km"}', []),
    ("JSON after text is text", 'The call would be {"name": "get_weather", "parameters": {}}.',
     'The call would be {"name": "get_weather", "parameters": {}}.', []),
    ("plain text", "It is sunny in Paris today.", "It is sunny in Paris today.", []),
]


@pytest.mark.parametrize("name,reply,content,calls", HERMES_REPLIES, ids=[r[0] for r in HERMES_REPLIES])
def test_hermes_replies(split: Callable[[str], list[str]], name: str, reply: str, content: str, calls: list) -> None:
    got_content, got_calls, _ = parse(HERMES, split(reply))
    assert (got_content, got_calls) == (content, calls)


@pytest.mark.parametrize("name,reply,content,calls", LLAMA3_REPLIES, ids=[r[0] for r in LLAMA3_REPLIES])
def test_llama3_json_replies(split: Callable[[str], list[str]], name: str, reply: str, content: str,
                             calls: list) -> None:
    got_content, got_calls, _ = parse(LLAMA3_JSON, split(reply))
    assert (got_content, got_calls) == (content, calls)


def test_a_call_streams_its_name_first_then_its_arguments_in_pieces(by_token: Callable[[str], list[str]]) -> None:
    reply = HERMES_REPLIES[0][1]
    _, _, events = parse(HERMES, by_token(reply))
    kinds = [type(e).__name__ for e in events]
    first_call = kinds.index("CallStart")
    assert set(kinds[:first_call]) == {"Content"}  # the text before the call streams before it
    assert kinds[-1] == "CallEnd" and kinds.count("CallArguments") > 3  # many pieces, as the tokens come
    assert events[first_call].name == "get_weather"


def test_at_most_max_calls(by_token: Callable[[str], list[str]]) -> None:
    """parallel_tool_calls false: one call; the next one is read and left out (it is no content either)."""
    content, calls, _ = parse(HERMES, by_token(HERMES_REPLIES[1][1]), max_calls=1)
    assert content == "" and calls == [call("get_weather", {"city": "Paris"})]


def test_text_is_unchanged_without_calls(by_token: Callable[[str], list[str]]) -> None:
    """Under tool_choice auto a reply with no call reads exactly as without tools: whitespace included."""
    reply = "  Hello!\n\nIt is 21 degrees, {sunny}.\n  "
    for fmt in (HERMES, LLAMA3_JSON):
        assert parse(fmt, by_token(reply))[0] == reply
