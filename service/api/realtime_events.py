"""What the realtime WebSocket sends, as pydantic models: one per server event, named after OpenAI's Realtime API
(its `type` first), and the items and usage they carry. realtime.py sends them (`model_dump_json`); what clients
send is protocol.py's RealtimeSessionConfig and RealtimeResponseConfig.

Parley's own models, as for HTTP (answers.py says why): these events are Parley's text-only dialect of the
Realtime API (a reply's text in `output_text`, `timings`, `cached_tokens`, `text_end`), which the SDK's types do not
describe.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_serializer

from service.api.protocol import SESSION_SETTINGS, RealtimeSessionConfig
from service.engine.request import Timings, Usage

# how a response ended: engine.request.outcome_of, and "incomplete" for a reply cut by max_tokens (OpenAI's name)
Outcome = Literal["completed", "incomplete", "cancelled", "failed"]
CallStatus = Literal["in_progress", "completed", "incomplete"]


def _none(value: object) -> bool:
    return value is None


class RealtimeUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the cache (the session's last turn, or another's)

    @classmethod
    def of(cls, u: Usage) -> RealtimeUsage:
        return cls(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                   total_tokens=u.prompt_tokens + u.completion_tokens, cached_tokens=u.cached_tokens)


class ResponseTimings(BaseModel):
    """Where a response's time went, in ms; the time to the SLA's token is named for the server's N (`ttf64_ms`)."""

    queue_ms: float | None
    prefill_ms: float | None
    ttft_ms: float | None
    ttfn_ms: float | None
    e2e_ms: float | None
    n: int

    @classmethod
    def of(cls, t: Timings, n: int) -> ResponseTimings:
        return cls(queue_ms=t.queue_ms, prefill_ms=t.prefill_ms, ttft_ms=t.ttft_ms, ttfn_ms=t.ttfn_ms,
                   e2e_ms=t.e2e_ms, n=n)

    @model_serializer
    def _named_for_n(self) -> dict[str, float | None]:
        return {"queue_ms": self.queue_ms, "prefill_ms": self.prefill_ms, "ttft_ms": self.ttft_ms,
                f"ttf{self.n}_ms": self.ttfn_ms, "e2e_ms": self.e2e_ms}


# -- items -----------------------------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str


class MessageItem(BaseModel):
    """The assistant's reply (response.done's `output[0]`)."""

    id: str
    object: Literal["realtime.item"] = "realtime.item"
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    """A tool call the assistant made (OpenAI's function_call item)."""

    id: str
    object: Literal["realtime.item"] = "realtime.item"
    type: Literal["function_call"] = "function_call"
    status: CallStatus
    call_id: str
    name: str
    arguments: str  # JSON text


# -- the session and a response --------------------------------------------------------------------------------------
class SessionInfo(RealtimeSessionConfig):
    """session.created's and session.updated's `session`: the settings every response.create starts from, and what
    the socket serves."""

    id: str
    object: Literal["realtime.session"] = "realtime.session"
    model: str  # the served model's id (a client's settings may leave it out)
    max_context: int


class ResponseRef(BaseModel):
    id: str
    status: Literal["in_progress"] = "in_progress"


class ErrorInfo(BaseModel):
    type: str
    code: str | None
    message: str


class StatusDetails(BaseModel):
    """Why a response failed (`error`) or is incomplete (`reason`: "max_output_tokens", as OpenAI says)."""

    type: Literal["failed", "incomplete"] = "failed"
    error: ErrorInfo | None = Field(default=None, exclude_if=_none)
    reason: str | None = Field(default=None, exclude_if=_none)


class RealtimeResponse(BaseModel):
    """response.done's `response`: how it ended, the reply's text, its items, usage and timings."""

    id: str
    status: Outcome
    output_text: str
    output: list[MessageItem | FunctionCallItem]
    finish_reason: str | None
    usage: RealtimeUsage | None = Field(default=None, exclude_if=_none)
    timings: ResponseTimings | None = Field(default=None, exclude_if=_none)
    status_details: StatusDetails | None = Field(default=None, exclude_if=_none)


class RealtimeError(BaseModel):
    """An error event's `error`: OpenAI's fields, the client event that caused it, and for a refused response its id
    and when to retry."""

    type: str
    code: str | None
    message: str
    param: str | None = None
    event_type: str | None = Field(default=None, exclude_if=_none)
    response_id: str | None = Field(default=None, exclude_if=_none)
    retry_after_ms: int | None = Field(default=None, exclude_if=_none)


# -- events -----------------------------------------------------------------------------------------------------------
class SessionCreated(BaseModel):
    type: Literal["session.created"] = "session.created"
    session: SessionInfo


class SessionUpdated(BaseModel):
    type: Literal["session.updated"] = "session.updated"
    session: SessionInfo


class ResponseCreated(BaseModel):
    type: Literal["response.created"] = "response.created"
    response: ResponseRef


class OutputTextDelta(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    response_id: str
    delta: str


class OutputItemAdded(BaseModel):
    """A tool call begins. Its output_index counts the assistant message first where the reply spoke before its first
    call (a reply of calls alone has no message item)."""

    type: Literal["response.output_item.added"] = "response.output_item.added"
    response_id: str
    output_index: int
    item: FunctionCallItem


class FunctionCallEvent(BaseModel):
    """What every event of a tool call's arguments names: the call, its item, and where the item is in `output`."""

    response_id: str
    item_id: str
    output_index: int
    call_id: str
    name: str


class FunctionCallArgumentsDelta(FunctionCallEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class FunctionCallArgumentsDone(FunctionCallEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    arguments: str


class ResponseDone(BaseModel):
    type: Literal["response.done"] = "response.done"
    response: RealtimeResponse


class ItemCreated(BaseModel):
    """conversation.item.create's answer: the item as the conversation holds it, with its id."""

    type: Literal["conversation.item.created"] = "conversation.item.created"
    previous_item_id: str | None = None
    item: dict[str, object]


class ItemTruncated(BaseModel):
    type: Literal["conversation.item.truncated"] = "conversation.item.truncated"
    item_id: str
    content_index: int = 0
    text_end: int


class ErrorEvent(BaseModel):
    type: Literal["error"] = "error"
    error: RealtimeError


ServerEvent = (SessionCreated | SessionUpdated | ResponseCreated | OutputTextDelta | OutputItemAdded
               | FunctionCallArgumentsDelta | FunctionCallArgumentsDone | ResponseDone | ItemCreated | ItemTruncated
               | ErrorEvent)


def session_info(settings: RealtimeSessionConfig, id: str, model: str, max_context: int) -> SessionInfo:
    """The settings as a session event shows them, and what the socket serves."""
    chosen = {k: getattr(settings, k) for k in SESSION_SETTINGS}
    return SessionInfo.model_construct(**chosen, id=id, model=model, max_context=max_context)
