"""Tool calls read out of replies as models of each family write them (tool_parsers.py), fed as a server streams them:
one detokenized token at a time (SmolLM2's tokenizer), one character at a time, and whole. Text before a call is
content; a call is its name, then arguments whose pieces join into the JSON the model wrote; what the parser does
not recognise as a call is content to it. What is spoken (reply.py: chat content, realtime output_text) never holds
tool-protocol markup: a call of an offered tool is a call, any other markup is withheld — Hermes's blocks, a bare
Llama call under tool_choice "none", Llama's <|python_tag|> (which the detokenizer shows for that)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from tokenizers import AddedToken

from service.api.reply import ReplyReader
from service.api.tool_formats import HERMES, LLAMA3_JSON, CallFormat
from service.api.tool_parsers import CallArguments, CallEnd, CallStart, Content, ToolCallParser, ToolEvent
from service.model.synthetic import byte_tokenizer, smollm2_tokenizer
from service.model.tokenizer import Tokenizer

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
    ("cut short before the arguments: none made up",
     '<tool_call>\n{"name": "get_weather", "argum', "", [{"name": "get_weather", "arguments": "", "complete": False}]),
    ("cut short after the arguments' key", '<tool_call>\n{"name": "get_weather", "arguments": ', "",
     [{"name": "get_weather", "arguments": "", "complete": False}]),
    ("the same call twice is a stutter: one call",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [call("get_weather", {"city": "Paris"})]),
    ("a stutter cut short (max_tokens) is no call either",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"ci', "", [call("get_weather", {"city": "Paris"})]),
    ("a stutter between two calls",
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {}}\n</tool_call>', "",
     [call("get_weather", {"city": "Paris"}), call("get_time", {})]),
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


# -- what is spoken -------------------------------------------------------------------------------------------------
def speak(fmt: CallFormat | None, tools: tuple[str, ...], deltas: list[str]) -> tuple[str, list[str]]:
    """A reply through the reader a spoken turn uses: (what is spoken, the names of the calls). `fmt` None: the model
    was told of no tools; `tools` (): tool_choice "none"."""
    reader = ReplyReader(None if fmt is None else ToolCallParser(fmt, tools))
    events = [e for d in deltas for e in reader.feed(d)] + reader.finish()
    return "".join(e.text for e in events if isinstance(e, Content)), [c.name for c in reader.calls]


NONE: tuple[str, ...] = ()
SPOKEN = [
    ("a tool's result echoed back (SmolLM2 after a round trip)", HERMES, TOOLS,
     'It is 21 degrees.\n<tool_response>\n{"temperature_c": 21}\n</tool_response>\nAnything else?',
     "It is 21 degrees.\nAnything else?", []),
    ("a call of a function nobody offered", HERMES, TOOLS,
     'One moment.\n<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>', "One moment.\n", []),
    ("a marker with no JSON after it, to the end", HERMES, TOOLS, "Use the <tool_call> tag.", "Use the ", []),
    ("a closing tag on its own", HERMES, TOOLS, "Done.</tool_call> Bye.", "Done. Bye.", []),
    ("tool_choice none: a call is withheld", HERMES, NONE,
     'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "Sure.\n", []),
    ("an offered call is a call", HERMES, TOOLS, 'Sure <tool_call>\n{"name": "get_time"}\n</tool_call>', "Sure",
     ["get_time"]),
    ("a call inside an echoed result is still a call", HERMES, TOOLS,
     '<tool_response>ok</tool_response>\n<tool_call>\n{"name": "get_time"}\n</tool_call>', "", ["get_time"]),
    ("an echoed result cut short (max_tokens)", HERMES, TOOLS, 'OK.\n<tool_response>\n{"temperature_c": 2',
     "OK.\n", []),
    ("a mark cut short by max_tokens (after a repeated call) is no word", HERMES, TOOLS,
     '<tool_call>\n{"name": "get_time"}\n</tool_call>\n<tool_call>\n{"name": "get_time"}\n</tool_call>\n<tool_',
     "", ["get_time"]),
    ("a reply cut in a mark", HERMES, TOOLS, "Sure. <tool_resp", "Sure. ", []),
    ("a lone < at the end is text", HERMES, TOOLS, "x is 3 <", "x is 3 <", []),
    ("no tools at all: markup is withheld all the same", None, NONE,
     "Hello <tool_response>x</tool_response> there, <tools>[]</tools>friend.", "Hello there, friend.", []),
    ("tool_choice none: a bare Llama call is withheld", LLAMA3_JSON, NONE,
     '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", []),
    ("a bare call of a function nobody offered", LLAMA3_JSON, TOOLS, '{"name": "launch", "parameters": {}}', "", []),
    ("JSON that is no call is spoken", LLAMA3_JSON, NONE, '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36}',
     []),
    ("python_tag: a call", LLAMA3_JSON, TOOLS, 'Checking.<|python_tag|>{"name": "get_time", "parameters": {}}',
     "Checking.", ["get_time"]),
    ("python_tag: code for the interpreter, to the end", LLAMA3_JSON, TOOLS,
     "Let me compute.<|python_tag|>print(6 * 7)", "Let me compute.", []),
    ("python_tag with no tools", None, NONE, 'Sure.<|python_tag|>{"name": "get_time", "parameters": {}}', "Sure.",
     []),
]


@pytest.mark.parametrize("name,fmt,tools,reply,spoken,calls", SPOKEN, ids=[r[0] for r in SPOKEN])
def test_markup_is_never_spoken(split: Callable[[str], list[str]], name: str, fmt: CallFormat | None,
                                tools: tuple[str, ...], reply: str, spoken: str, calls: list[str]) -> None:
    assert speak(fmt, tools, split(reply)) == (spoken, calls)


def test_speech_without_markup_is_unchanged(by_token: Callable[[str], list[str]]) -> None:
    reply = "  Hello!\n\nIt is 21 degrees, {sunny} <b>today</b> <tool.\n  "
    for fmt, tools in ((None, NONE), (HERMES, TOOLS), (HERMES, NONE), (LLAMA3_JSON, TOOLS)):
        assert speak(fmt, tools, by_token(reply)) == (reply, [])


@pytest.fixture(scope="module")
def llama_like() -> Tokenizer:
    """A byte-level tokenizer with Llama-3.x's special tokens: <|python_tag|> and the end of a turn."""
    base = byte_tokenizer(256 + 2)
    base.hf.add_special_tokens([AddedToken(t, special=True) for t in ("<|python_tag|>", "<|eot_id|>")])
    return Tokenizer(base.hf, chat_template=None, bos_token=None, eos_token="<|eot_id|>")


def test_the_detokenizer_shows_python_tag_so_that_the_call_is_read(llama_like: Tokenizer) -> None:
    """Llama-3.x opens a call with <|python_tag|>, a special token: skipped like the others, the call after it would
    be bare JSON after text — spoken. Shown, it opens the call."""
    ids = llama_like.encode('Sure.<|python_tag|>{"name": "get_time", "parameters": {}}<|eot_id|>')
    detok = llama_like.detokenizer()
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    text = 'Sure.<|python_tag|>{"name": "get_time", "parameters": {}}'
    assert "".join(deltas) == llama_like.decode(ids) == text  # the tag shown, <|eot_id|> not
    assert speak(LLAMA3_JSON, TOOLS, deltas) == ("Sure.", ["get_time"])
