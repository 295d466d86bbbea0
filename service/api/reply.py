"""A spoken reply as it streams: its tool calls read out (tool_parsers.py) and its content free of tool-protocol
markup, for the chat endpoint and the realtime WebSocket alike (/v1/completions streams raw text).

What reaches a listener must never be markup: a model told of tools may write a call where none may be made
(tool_choice "none"), name a tool it was not offered, echo a tool's result back in the `<tool_response>` block its
prompt showed it, or open Llama's `<|python_tag|>`. A call of an offered tool is parsed as a call; any other markup
is withheld — the block, from what opens it to what closes it (tool_formats.MARKUP; `<|python_tag|>` runs to the end
of the reply), and a closing tag on its own; the whitespace after either is withheld too where the content before
it already ends in whitespace (two lines around an echoed block read as two lines, not three).
"""

from __future__ import annotations

from service.api.tool_formats import MARKUP
from service.api.tool_parsers import Content, ParsedCall, ToolCallParser, ToolEvent, held_suffix

_OPENERS = {opener: closer for opener, closer in MARKUP}
_CLOSERS = tuple(closer for _, closer in MARKUP if closer is not None)
_MARKS = (*_OPENERS, *_CLOSERS)
_MARK_STARTS = frozenset(m[0] for m in _MARKS)  # ("<"): text without one holds no mark and no start of one
_NOT_IN_BLOCK = ""  # MarkupFilter._closer outside a block (a block's closer is never empty)
CUT_MARK_MIN = 2  # the reply ends in this much of a mark or more ("<t", "</tool_re"): withheld


class MarkupFilter:
    """Content's text in, the same text less tool-protocol markup out. Text that may be the start of a mark waits
    for what follows."""

    def __init__(self) -> None:
        self._pending = ""
        self._closer: str | None = _NOT_IN_BLOCK  # inside a block: what ends it (None: the end of the reply)
        self._after_mark = False  # a mark was just withheld: the whitespace after it may be too
        self._at_space = True  # what was let through so far ends in whitespace (or is nothing)

    def feed(self, text: str) -> str:
        self._pending += text
        return self._run(final=False)

    def finish(self) -> str:
        """The end of the reply: what was held back, unless it is markup."""
        out = self._run(final=True)
        self._pending, self._closer, self._after_mark, self._at_space = "", _NOT_IN_BLOCK, False, True
        return out

    def flush(self) -> str:
        """A call came between two pieces of content: what was held back as the possible start of a mark is content
        after all (inside a block, it is withheld; the block stays open)."""
        out, self._pending = self._pending, ""
        if self._closer != _NOT_IN_BLOCK:
            return ""
        self._let_through([], out)
        return out

    def _run(self, final: bool) -> str:
        out: list[str] = []
        while self._pending:
            if self._closer != _NOT_IN_BLOCK:
                if not self._skip_block(final):
                    break
                continue
            if self._after_mark:
                if self._at_space:
                    self._pending = self._pending.lstrip()
                    if not self._pending:
                        break
                self._after_mark = False
            if not any(c in self._pending for c in _MARK_STARTS):  # the common case, quickly
                self._let_through(out, self._pending)
                self._pending = ""
                break
            at, mark = min(((i, m) for m in _MARKS if (i := self._pending.find(m)) >= 0), default=(-1, ""))
            if at < 0:
                keep = held_suffix(self._pending, _MARKS)
                if final:  # a mark cut short by the reply's end (max_tokens) is markup all the same: "<tool_" is
                    keep = keep if keep >= CUT_MARK_MIN else 0  # no word; a lone "<" may be text
                self._let_through(out, self._pending[:len(self._pending) - keep])
                self._pending = "" if final else self._pending[len(self._pending) - keep:]
                break
            self._let_through(out, self._pending[:at])
            self._pending = self._pending[at + len(mark):]
            if mark in _OPENERS:
                self._closer = _OPENERS[mark]
            else:  # a closing tag on its own
                self._after_mark = True
        return "".join(out)

    def _let_through(self, out: list[str], text: str) -> None:
        if text:
            out.append(text)
            self._at_space = text[-1].isspace()

    def _skip_block(self, final: bool) -> bool:
        """Withhold the block's text up to its closer; whether it closed."""
        closer = self._closer
        at = -1 if closer is None else self._pending.find(closer)
        if closer is None or at < 0:
            keep = 0 if final or closer is None else held_suffix(self._pending, (closer,))
            self._pending = self._pending[len(self._pending) - keep:] if keep else ""
            return False
        self._pending = self._pending[at + len(closer):]
        self._closer, self._after_mark = _NOT_IN_BLOCK, True
        return True


class ReplyReader:
    """A spoken reply's text deltas in, events out: calls of the offered tools (`calls`: the turn's parser, None
    where the model was told of no tools) and content, markup withheld. Feed every delta, then finish."""

    def __init__(self, calls: ToolCallParser | None) -> None:
        self._parser = calls
        self._markup = MarkupFilter()

    @property
    def calls(self) -> list[ParsedCall]:
        """The calls read so far."""
        return self._parser.calls if self._parser is not None else []

    @property
    def repeated(self) -> bool:
        """A call came again (same function, same arguments): the model stutters, and would until max_tokens (greedy
        SmolLM2 under tool_choice "required" with parallel calls). The reply ends there: the caller cancels the
        generation and answers with the calls it has, as a reply that stopped (finished())."""
        return self._parser is not None and self._parser.repeated

    def finished(self, reason: str | None) -> str | None:
        """The reply's finish reason: one the caller cut at a repeated call stopped, it was not cancelled."""
        return "stop" if reason == "cancelled" and self.repeated else reason

    def feed(self, text: str) -> list[ToolEvent]:
        return self._spoken(self._parser.feed(text) if self._parser is not None else [Content(text)])

    def finish(self) -> list[ToolEvent]:
        events = self._spoken(self._parser.finish() if self._parser is not None else [])
        tail = self._markup.finish()
        return events + [Content(tail)] if tail else events

    def _spoken(self, events: list[ToolEvent]) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        for e in events:
            if isinstance(e, Content):
                text = self._markup.feed(e.text)
            else:  # a call: what content the filter held back was not the start of a mark
                text = self._markup.flush()
            if text:
                out.append(Content(text))
            if not isinstance(e, Content):
                out.append(e)
        return out
