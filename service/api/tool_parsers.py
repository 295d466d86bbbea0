"""Reading tool calls out of a reply as it streams, in a model family's format (tool_formats.CallFormat).

Text before a call is content. A call opens at one of the format's markers (`<tool_call>`), or, for a family that
writes calls bare (Llama-3.x), with a JSON object at the start of the reply; it is a JSON object
{"name": ..., "arguments" | "parameters": ...}. It becomes OpenAI's tool call as it comes: the function's name once
it is written, then the arguments in pieces, as the model writes them. What is not a call of an offered tool is
never an error: a bare JSON object shaped like a call (a name and arguments) is withheld, any other is content; a
marker's text (an unknown name, no JSON, an unclosed marker) is content here, and reply.py's MarkupFilter withholds
the markup from what is spoken. The tools offered may be none (tool_choice "none": the model was told of the tools
and may still write a call, which is then withheld). One parser serves streaming and whole answers (feed
everything, then finish).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from service.api.tool_formats import CallFormat

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')  # a call's JSON that names its function first
_ARGUMENTS = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')  # … then gives its arguments
_ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int  # the call is whole: its JSON closed


ToolEvent = Content | CallStart | CallArguments | CallEnd


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""  # JSON text
    complete: bool = False  # its JSON closed (a reply cut short by max_tokens or a barge-in leaves it open)


@dataclass
class _Scan:
    """Where a JSON text stands, character by character: nesting depth, and whether inside a string."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    pos: int = 0  # the next character to look at

    def step(self, c: str) -> None:
        self.pos += 1
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1


@dataclass
class _Call:
    """A call being read: its text from the opening brace on, and how far its name and arguments are known."""

    opening: str  # the marker that opened it ("" for a bare JSON object): content again if this is no call
    raw: str = ""
    body: _Scan = field(default_factory=_Scan)
    started: bool = False  # its opening brace came
    closed: bool = False  # … and its closing one
    broken: bool = False  # something other than a JSON object came
    # pending: its function not named yet; call: an offered tool's, streaming (`call`); other: not an offered
    # tool's (content, once it ends); dropped: a call past max_calls, read and left out
    verdict: str = "pending"
    call: ParsedCall | None = None
    index: int = -1
    args_start: int | None = None  # where the arguments' value starts in raw
    args: _Scan = field(default_factory=_Scan)
    args_end: int | None = None
    sent: int = 0  # characters of the arguments' text streamed
    held: list[ToolEvent] = field(default_factory=list)  # its events, held back until it closes (ToolCallParser._gate)

    def feed(self, text: str) -> int:
        """Take characters up to the call's closing brace; how many were taken."""
        for n, c in enumerate(text):
            if not self.started:
                if c.isspace():
                    self.raw += c
                    continue
                if c != "{":
                    self.broken = True
                    return n
                self.started = True
            self.raw += c
            self.body.step(c)
            if self.body.depth == 0:
                self.closed = True
                return n + 1
        return len(text)

    def arguments_so_far(self) -> tuple[str, bool]:
        """The arguments' JSON text as far as it is known, and whether it is whole."""
        if self.args_start is None:
            return "", False
        while self.args_end is None and self.args.pos < len(self.raw) - self.args_start:
            c = self.raw[self.args_start + self.args.pos]
            if self.args.depth == 0 and not self.args.in_string and c in ",}":
                self.args_end = self.args_start + self.args.pos
                break
            self.args.step(c)
        end = self.args_end if self.args_end is not None else len(self.raw)
        return self.raw[self.args_start:end].strip(), self.args_end is not None


class ToolCallParser:
    """Feed it a reply's text deltas; it answers events: content, and calls of the offered `tools` (at most
    `max_calls`; further calls are read and left out)."""

    def __init__(self, fmt: CallFormat, tools: Collection[str], max_calls: int | None = None) -> None:
        self.fmt, self.tools, self.max_calls = fmt, frozenset(tools), max_calls
        self.calls: list[ParsedCall] = []
        self.repeated = False  # a call was left out as a repeat of an earlier one: the model stutters
        self._pending = ""
        self._call: _Call | None = None
        self._spoke = False  # content other than whitespace came: a bare JSON object is no call any more
        self._after_call = False  # a call just ended: its closing marker and separators are no content
        self._space = ""  # trailing whitespace held back: dropped before a call, content before anything else

    def feed(self, text: str) -> list[ToolEvent]:
        self._pending += text
        return self._run(final=False)

    def finish(self) -> list[ToolEvent]:
        """The end of the reply: what was held back, and a call left open (its arguments as far as they came)."""
        out = self._run(final=True)
        if self._call is not None:
            out += self._gate(self._call, self._close(self._call, complete=False), ended=True)
            self._call = None
        if self._space and not self.calls:
            out.append(Content(self._space))
        self._space = ""
        return out

    # -- the text between calls ---------------------------------------------------------------------------
    def _run(self, final: bool) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        while self._pending:
            if self._call is None:
                if not self._text(out, final):
                    break
            else:
                call = self._call
                taken = call.feed(self._pending)
                self._pending = self._pending[taken:]
                if call.broken or call.closed:
                    self._call = None
                    out += self._gate(call, self._close(call, complete=True), ended=True)
                else:
                    out += self._gate(call, self._stream(call), ended=False)
        return out

    def _gate(self, call: _Call, events: list[ToolEvent], ended: bool) -> list[ToolEvent]:
        """A call after the first is held back until it closes: the same call again (same function, same
        arguments; or the start of them where the reply was cut short) is a model's stutter, and an agent would run
        the tool twice; it is left out."""
        if call.call is None or call.index == 0:
            return events
        call.held += events
        if not ended:
            return []
        events, call.held = call.held, []
        if any(p.name == call.call.name and _repeats(p.arguments, call.call) for p in self.calls[:call.index]):
            self.calls.remove(call.call)
            self.repeated = True
            return []
        return events

    def _text(self, out: list[ToolEvent], final: bool) -> bool:
        """Content up to the next call, which it opens; False when what is left must wait for more text."""
        text = self._pending
        if self._after_call:
            rest = text.lstrip()
            closer, separator = self.fmt.suffix.strip(), self.fmt.separator.strip()
            if closer and rest.startswith(closer):
                rest = rest[len(closer):].lstrip()
            if separator and rest.startswith(separator):
                rest = rest[len(separator):].lstrip()
            if not rest or (closer and closer.startswith(rest)):  # nothing yet, or (part of) the closing marker
                self._pending = "" if final or not rest else text
                return False
            text = rest
        start, opening = self._call_start(text)
        if start is None:
            keep = 0 if final else held_suffix(text, self.fmt.markers)
            self._emit(out, text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            return False
        space = self._emit(out, text[:start], before_call=True)
        self._pending = text[start + len(opening):]
        self._call = _Call(space + opening)
        self._after_call = False
        return True

    def _call_start(self, text: str) -> tuple[int | None, str]:
        """Where the next call opens in `text`, and the marker that opens it ("" for a bare JSON object)."""
        found = [(i, m) for m in self.fmt.markers if (i := text.find(m)) >= 0]
        if self.fmt.leading_json and (not self._spoke or self._after_call) and text.lstrip().startswith("{"):
            found.append((len(text) - len(text.lstrip()), ""))
        return min(found) if found else (None, "")

    def _emit(self, out: list[ToolEvent], text: str, before_call: bool = False) -> str:
        """Content; trailing whitespace waits to see whether a call follows (then it is dropped: returned)."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body:
            out.append(Content(body))
            self._spoke, self._after_call = True, False
        if not before_call:
            return ""
        space, self._space = self._space, ""
        return space

    # -- one call -------------------------------------------------------------------------------------------
    def _stream(self, call: _Call) -> list[ToolEvent]:
        """What is known of a call so far: its name once written (if it is an offered tool), then its arguments."""
        out: list[ToolEvent] = []
        head = _NAME.match(call.raw)
        if call.verdict == "pending" and head is not None:
            out += self._decide(call, json.loads(f'"{head.group(1)}"'))
        if call.call is None:
            return out
        if call.args_start is None:
            rest = _ARGUMENTS.match(call.raw, head.end()) if head is not None else None
            if rest is None:
                return out
            call.args_start = rest.end()
        text, whole = call.arguments_so_far()
        if text.startswith("{"):  # an object streams; anything else (a JSON string, null) waits to be whole
            out += self._send(call, text if whole else text.rstrip())
        return out

    def _decide(self, call: _Call, name: str) -> list[ToolEvent]:
        """A call names its function: stream it if it is an offered tool (and max_calls allows another)."""
        if name not in self.tools:
            call.verdict = "other"
            return []
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            call.verdict = "dropped"
            return []
        call.verdict, call.index = "call", len(self.calls)
        call.call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", name)
        self.calls.append(call.call)
        return [CallStart(call.index, call.call.id, name)]

    def _send(self, call: _Call, text: str) -> list[ToolEvent]:
        assert call.call is not None
        piece = text[call.sent:]
        if not piece:
            return []
        call.sent = len(text)
        call.call.arguments += piece
        return [CallArguments(call.index, piece)]

    def _close(self, call: _Call, complete: bool) -> list[ToolEvent]:
        """A call's end: its closing brace (complete), or the end of the reply."""
        out: list[ToolEvent] = []
        whole = _object(call.raw) if call.closed else None
        if call.verdict == "pending" and whole is not None and isinstance(whole.get("name"), str):
            out += self._decide(call, whole["name"])  # a call that names its function after its arguments
        if call.verdict == "dropped":
            self._after_call = True
            return out
        if call.call is None:  # no call of an offered tool
            if not call.opening and _call_shaped(call, whole):  # a bare call: withheld, as a marker's would be
                self._after_call = True
            else:
                self._emit(out, call.opening + call.raw)
            return out
        out += self._stream(call)
        if not call.call.arguments:
            out += self._send(call, _arguments_text(call, whole))
        if complete and call.closed:
            call.call.complete = True
            out.append(CallEnd(call.index))
            self._after_call = True
        return out


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _call_shaped(call: _Call, whole: dict[str, Any] | None) -> bool:
    """A call's JSON: a function's name and its arguments (written whole, or begun when the reply ended)."""
    if whole is not None:
        return isinstance(whole.get("name"), str) and any(k in whole for k in _ARGUMENT_KEYS)
    head = _NAME.match(call.raw)
    return head is not None and _ARGUMENTS.match(call.raw, head.end()) is not None


def _arguments_text(call: _Call, whole: dict[str, Any] | None) -> str:
    """The arguments of a call whose arguments did not stream (a JSON string, null, none, or given before the name),
    as JSON text; "{}" where a whole call has none. A call cut short (max_tokens, a barge-in) has what the model
    wrote of them, "" if nothing: never arguments it did not write (OpenAI returns the partial text too)."""
    if whole is not None:
        value = next((whole[k] for k in _ARGUMENT_KEYS if k in whole), None)
    else:
        text, _ = call.arguments_so_far()
        if not call.closed:
            return text
        try:
            value = json.loads(text) if text else None
        except ValueError:
            return text
    if value is None:
        return "{}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _repeats(arguments: str, call: ParsedCall) -> bool:
    """Whether `call`'s arguments say what `arguments` (an earlier call's JSON text) says; for a call cut short,
    whether they are the start of it."""
    if not call.complete:
        return arguments.startswith(call.arguments)
    try:
        return bool(json.loads(arguments) == json.loads(call.arguments))
    except ValueError:
        return arguments == call.arguments


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that may be the start of a marker."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if text.endswith(m[:n])),
               default=0)
