"""conversation.item.truncate on the realtime WebSocket: after a barge-in the caller heard only part of a reply.

OpenAI's Realtime API names the cut in milliseconds of audio (`audio_end_ms`); Parley is text-only, so the client
names it in characters of the reply text (`text_end`, counted as Python counts a string: Unicode code points).
The conversation then keeps the first `text_end` characters of the reply, and the session's cached K/V keep the
turn's prompt and the reply tokens whose text lies within them. A `ReplyItem` remembers, for one reply, which of
its tokens had produced how many characters.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from service.api.errors import APIError
from service.api.realtime_events import MessageItem, OutputText
from service.engine.request import Delta


@dataclass
class ReplyItem:
    """One reply as an assistant item of the conversation (response.done's `output[0]`)."""

    response_id: str
    prompt_tokens: int  # the turn's prompt, all of it in the session's cache once the reply started
    conversation_index: int | None = None  # where it sits in the conversation; None: a text prompt's reply
    text: str = ""  # as the client received it (and as truncated since)
    id: str = field(default_factory=lambda: f"item_{uuid.uuid4().hex[:20]}")
    _ends: list[tuple[int, int]] = field(default_factory=list)  # (characters, tokens) at the end of each delta
    _chars: int = 0
    _tokens: int = 0

    def add(self, delta: Delta) -> None:
        """A generated delta. A token whose text is still held back (half a character, a possible stop string)
        counts with the delta whose text it produced."""
        self._tokens += len(delta.token_ids)
        if delta.text:
            self._chars += len(delta.text)
            self._ends.append((self._chars, self._tokens))

    def keep_tokens(self, text_end: int) -> int:
        """The session's tokens that produced the conversation up to `text_end` characters of this reply."""
        return self.prompt_tokens + max((tokens for chars, tokens in self._ends if chars <= text_end), default=0)

    def truncate(self, text_end: int) -> None:
        self.text = self.text[:text_end]
        self._ends = [(chars, tokens) for chars, tokens in self._ends if chars <= text_end]

    def output(self, status: str) -> MessageItem:
        """The item as OpenAI's response.done lists it in `output`."""
        return MessageItem(id=self.id, status="completed" if status == "completed" else "incomplete",
                           content=[OutputText(text=self.text)])


@dataclass(frozen=True)
class Truncate:
    """A conversation.item.truncate event: {item_id (the item's id or its response's), content_index: 0,
    text_end}."""

    item_id: str
    text_end: int

    @classmethod
    def parse(cls, event: dict[str, Any]) -> Truncate:
        item_id, index, text_end = event.get("item_id"), event.get("content_index", 0), event.get("text_end")
        if not isinstance(item_id, str) or not item_id:
            raise APIError(400, "item_id must name the assistant item (or its response)", param="item_id",
                           code="missing_required_parameter" if item_id is None else "invalid_value")
        if not _is_int(index) or index != 0:
            raise APIError(400, "content_index must be 0: a reply has one text part", param="content_index",
                           code="invalid_value")
        if text_end is None:
            raise APIError(400, "text_end (characters of the reply that were heard) is required; Parley is "
                                "text-only, so audio_end_ms is not supported", param="text_end",
                           code="missing_required_parameter")
        if not _is_int(text_end) or text_end < 0:
            raise APIError(400, "text_end must be an integer >= 0", param="text_end", code="invalid_value")
        return cls(item_id, text_end)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON true is no index
