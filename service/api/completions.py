"""POST /v1/completions and POST /v1/chat/completions: one path for both — a turn built (turn.py), submitted, then
its deltas streamed as SSE chunks or collected into one JSON answer. What tells the two endpoints apart (object
names, the shape of a choice, chat's first chunk, the answer's models, whether the reply is spoken content) is data:
an `Endpoint`. A chat reply goes through a ReplyReader (reply.py): tool calls streamed as `delta.tool_calls`, whole as
`message.tool_calls`, and tool-protocol markup never in `content`; /v1/completions streams the raw text.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.api.answers import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    Choice,
    Chunk,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionResponse,
    ErrorResponse,
    FunctionCallDelta,
    ToolCallDelta,
    UsageInfo,
)
from service.api.errors import error_body, from_unfinished
from service.api.prompts import DEFAULT_COMPLETION_MAX_TOKENS
from service.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FunctionCall,
    OpenAIRequest,
    ToolCall,
)
from service.api.reply import ReplyReader
from service.api.request_start import request_start, request_transit
from service.api.state import ServerState, server_state
from service.api.streaming import SSE_DONE, DeltaStream, SSEResponse, sse_event, until_disconnect
from service.api.tool_parsers import CallArguments, CallEnd, CallStart, Content, ToolEvent
from service.api.turn import CHAT_FIELDS, COMPLETION_FIELDS, Conversation, Fields, Turn, TurnRequest, build_turn
from service.engine.request import Delta

log = logging.getLogger("parley.api")
router = APIRouter()


@dataclass(frozen=True)
class Reply:
    """A whole answer: its text, and the tool calls read out of it (chat with tools)."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class Endpoint:
    """What tells the two HTTP endpoints apart."""

    id_prefix: str
    fields: Fields  # what a refusal names
    spoken: bool  # the reply is content (calls read, markup withheld), not raw text
    response: Callable[..., Completion]  # the answer without `stream`
    chunk: Callable[..., Chunk]  # a streamed chunk
    choice: Callable[[Reply, str | None], Choice]  # the answer's one choice, from the reply and the finish reason
    text: Callable[[str, str | None], ChunkChoice]  # a streamed chunk's choice, from a delta's text and finish
    prologue: ChunkChoice | None = None  # a first chunk's choice, before any text


COMPLETIONS = Endpoint(
    "cmpl", COMPLETION_FIELDS, False, CompletionResponse, CompletionChunk,
    choice=lambda reply, finish: CompletionChoice(text=reply.content, finish_reason=finish),
    text=lambda text, finish: CompletionChunkChoice(text=text, finish_reason=finish))
CHAT = Endpoint(
    "chatcmpl", CHAT_FIELDS, True, ChatCompletionResponse, ChatCompletionChunk,
    choice=lambda reply, finish: ChatChoice(message=ChatMessageOut(
        content=reply.content if reply.content or not reply.tool_calls else None,
        tool_calls=reply.tool_calls or None), finish_reason=finish),
    text=lambda text, finish: ChatChunkChoice(delta=ChatDelta(content=text if text or finish is None else None),
                                              finish_reason=finish),
    prologue=ChatChunkChoice(delta=ChatDelta(role="assistant", content="")))


def tool_call_delta(event: ToolEvent) -> ChatChunkChoice:
    """A chat chunk's choice for one event of the reply's reader, as OpenAI streams calls: the call's index, id, type
    and name first (arguments ""), then its arguments in pieces."""
    if isinstance(event, Content):
        return ChatChunkChoice(delta=ChatDelta(content=event.text))
    if isinstance(event, CallStart):
        call = ToolCallDelta(index=event.index, id=event.id, type="function",
                             function=FunctionCallDelta(name=event.name, arguments=""))
    else:
        assert isinstance(event, CallArguments)
        call = ToolCallDelta(index=event.index, function=FunctionCallDelta(arguments=event.text))
    return ChatChunkChoice(delta=ChatDelta(tool_calls=[call]))


def documented(endpoint: Endpoint) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI description of an endpoint's answers: JSON or, with `"stream": true`, SSE; and its errors."""
    err = {"model": ErrorResponse}
    return {
        200: {"model": endpoint.response, "content": {"text/event-stream": {"schema": {"type": "string"}}},
              "description": "the completion (JSON), or with `stream: true` Server-Sent Events ending in "
                             "`data: [DONE]`"},
        400: {**err, "description": "a bad field (`param` names it)"},
        404: {**err, "description": "an unknown model"},
        413: {**err, "description": "a body over 1 MiB"},
        429: {**err, "description": "refused by admission control (Retry-After, x-should-retry: false)"},
        500: {**err, "description": "the engine failed the generation"},
        503: {**err, "description": "loading, draining, or the engine is not responding"},
    }


@router.post("/v1/completions", response_model=None, responses=documented(COMPLETIONS))
async def completions(body: CompletionRequest, request: Request) -> Response:
    arrival = request_start(request)
    st = serving(request, body)
    turn = await build_turn(st, TurnRequest(
        body.prompt_input(), body, COMPLETIONS.fields, COMPLETIONS.spoken,
        max_tokens=body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS))
    return await answer(COMPLETIONS, body, turn, st, request, arrival)


@router.post("/v1/chat/completions", response_model=None, responses=documented(CHAT))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = request_start(request)
    st = serving(request, body)
    turn = await build_turn(st, TurnRequest(
        Conversation([m.for_template() for m in body.messages]), body, CHAT.fields, CHAT.spoken,
        max_tokens=body.requested_max_tokens, tools=body, response_format=body.response_format))
    return await answer(CHAT, body, turn, st, request, arrival)


@router.post("/v1/completions/render", response_model=None)
async def completions_render(body: CompletionRequest, request: Request) -> JSONResponse:
    """vLLM's render: the prompt's token ids as /v1/completions would submit them, nothing generated. vllm-router's
    cache-aware policy asks every replica for them to match prompts by prefix (deploy/README.md, "The router")."""
    st = serving(request, body)
    turn = await build_turn(st, TurnRequest(body.prompt_input(), body, COMPLETIONS.fields, COMPLETIONS.spoken,
                                            max_tokens=body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS))
    return JSONResponse([{"token_ids": turn.ids}])


@router.post("/v1/chat/completions/render", response_model=None)
async def chat_completions_render(body: ChatCompletionRequest, request: Request) -> JSONResponse:
    """vLLM's render for chat: the templated conversation's token ids, as /v1/chat/completions would submit them."""
    st = serving(request, body)
    turn = await build_turn(st, TurnRequest(
        Conversation([m.for_template() for m in body.messages]), body, CHAT.fields, CHAT.spoken,
        max_tokens=body.requested_max_tokens, tools=body, response_format=body.response_format))
    return JSONResponse({"token_ids": turn.ids})


def serving(request: Request, body: OpenAIRequest) -> ServerState:
    """The server's state, once it is ready and `body` names the model it serves (or none)."""
    st = server_state(request.app)
    st.ready()
    st.check_model(body.model)
    return st


async def answer(endpoint: Endpoint, body: OpenAIRequest, turn: Turn, st: ServerState, request: Request,
                 arrival: float) -> Response:
    """Submit now (so that a refusal is a plain 429 or 400), then stream (SSE) or collect (JSON) the answer."""
    transit = request_transit(request)
    if transit is not None:
        st.metrics.request_transit.observe(transit)
    stream = await turn.submit(st, arrival)
    answer = Answer(endpoint, f"{endpoint.id_prefix}-{uuid.uuid4().hex}", int(time.time()), st.model_id,
                    body.include_usage, turn.reader())
    if body.stream:
        # the stream is closed when the response ends, however it ends: a dropped stream frees its slot before the
        # next decode step
        return SSEResponse(answer.events(stream), on_close=stream.close)
    return JSONResponse((await answer.collect(stream, request)).model_dump())


@dataclass(frozen=True)
class Answer:
    """One request's answer in its endpoint's shape: SSE chunks as the deltas come, or the whole JSON."""

    endpoint: Endpoint
    id: str
    created: int
    model: str
    include_usage: bool
    reader: ReplyReader | None = None  # a spoken reply's text goes through it (chat)

    def chunk(self, choice: ChunkChoice | None, usage: UsageInfo | None = None) -> bytes:
        """A streamed chunk as an SSE event: one choice, or (the usage chunk) none. With include_usage every chunk
        has `usage`, null but on the last; without, none has the key."""
        c = self.endpoint.chunk(id=self.id, created=self.created, model=self.model,
                                choices=[] if choice is None else [choice], usage=usage)
        return sse_event(c.model_dump_json(exclude=None if self.include_usage else {"usage"}))

    def pieces(self, text: str, end: bool = False) -> list[ChunkChoice]:
        """The streamed choices for a delta's text (`end`: the last delta's)."""
        if self.reader is None:
            return [self.endpoint.text(text, None)] if text else []
        events = self.reader.feed(text) + (self.reader.finish() if end else [])
        return [tool_call_delta(e) for e in events if not isinstance(e, CallEnd)]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a reply that ended in calls."""
        return "tool_calls" if reason == "stop" and self.reader is not None and self.reader.calls else reason

    def finished(self, d: Delta, stream: DeltaStream) -> Delta:
        """A delta as the answer takes it: a stuttering reply (a call again) is cut there (its generation
        cancelled), and its end is a stop (ReplyReader.repeated)."""
        if self.reader is None or not self.reader.repeated:
            return d
        stream.cancel()
        return d if d.finish_reason is None else replace(d, finish_reason=self.reader.finished(d.finish_reason))

    async def events(self, stream: DeltaStream) -> AsyncIterator[bytes]:
        try:
            if self.endpoint.prologue is not None:
                yield self.chunk(self.endpoint.prologue)
            async for d in stream:
                d = self.finished(d, stream)
                if d.finish_reason is None:
                    for choice in self.pieces(d.text):
                        yield self.chunk(choice)
                    self.finished(d, stream)  # a stutter read in this delta: cut it now
                    continue
                failure = from_unfinished(d)
                if failure is not None:  # after the 200, a failure is a last event, a server_error
                    yield sse_event(error_body(failure.message, "server_error", None, failure.code).model_dump_json())
                    break
                if self.reader is None:
                    yield self.chunk(self.endpoint.text(d.text, d.finish_reason))
                else:
                    for choice in self.pieces(d.text, end=True):
                        yield self.chunk(choice)
                    yield self.chunk(self.endpoint.text("", self.finish_reason(d.finish_reason)))
                if self.include_usage and d.usage is not None:
                    yield self.chunk(None, UsageInfo.of(d.usage))
            yield SSE_DONE
        except Exception as e:  # after the first byte an error can only be a last event
            log.exception("stream %s failed", self.id)
            yield sse_event(error_body(f"internal error: {type(e).__name__}", "server_error", None,
                                       "internal").model_dump_json())
            yield SSE_DONE

    async def collect(self, stream: DeltaStream, request: Request) -> Completion:
        """The whole answer. A client that hangs up first cancels the generation."""

        async def cancel_on_disconnect() -> None:
            await until_disconnect(request.receive)
            stream.cancel()

        watcher = asyncio.create_task(cancel_on_disconnect())
        parts: list[str] = []  # raw text (/v1/completions), or the content read so far (chat)
        try:
            async for d in stream:
                d = self.finished(d, stream)
                if self.reader is None:
                    parts.append(d.text)
                else:  # read as it comes: a stutter is cut at once
                    events = self.reader.feed(d.text) + (self.reader.finish() if d.finish_reason else [])
                    parts += [e.text for e in events if isinstance(e, Content)]
                    d = self.finished(d, stream)
                last = d
        finally:
            watcher.cancel()
            stream.close()
        failure = from_unfinished(last)
        if failure is not None:
            try:
                raise failure
            finally:  # else this frame's local would hold the traceback that holds the frame: a reference cycle
                del failure
        assert last.usage is not None
        return self.endpoint.response(id=self.id, created=self.created, model=self.model,
                                      choices=[self.endpoint.choice(self.reply("".join(parts)),
                                                                    self.finish_reason(last.finish_reason))],
                                      usage=UsageInfo.of(last.usage))

    def reply(self, text: str) -> Reply:
        """The whole answer: its text (chat: the content read), and the calls read."""
        if self.reader is None:
            return Reply(text)
        return Reply(text, [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                            for c in self.reader.calls])
