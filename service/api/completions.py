"""POST /v1/completions and POST /v1/chat/completions: one path for both — the prompt's token ids, engine.submit,
then the deltas streamed as SSE chunks or collected into one JSON answer. What tells the two endpoints apart (object
names, the shape of a choice, chat's first chunk, the response model) is data: an `Endpoint`. A chat request with
tools or a response_format may follow a grammar (tools.py), and reads tool calls out of its reply (tool_parsers.py):
streamed as `delta.tool_calls`, whole as `message.tool_calls`."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from service.api import prompts
from service.api.errors import error_body, from_unfinished
from service.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    Choice,
    Completion,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    FunctionCall,
    OpenAIRequest,
    ToolCall,
    UsageInfo,
    usage_info,
)
from service.api.state import ServerState, server_state
from service.api.streaming import SSE_DONE, EngineStream, SSEResponse, sse_event, until_disconnect
from service.api.tool_parsers import CallArguments, CallEnd, CallStart, Content, ToolCallParser, ToolEvent
from service.api.tools import ChatTools
from service.engine.sampler import TokenConstraint

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
    chunk_object: str  # the `object` of each streamed chunk
    prompt_param: str  # the field a prompt the model cannot take is blamed on
    response: Callable[..., Completion]  # the answer without `stream`
    choice: Callable[[Reply, str | None], Choice]  # its one choice, from the reply and the finish reason
    delta: Callable[[str, str | None], dict[str, Any]]  # a streamed chunk's choice, from a delta's text and finish
    prologue: dict[str, Any] | None = None  # a first chunk's choice, before any text


COMPLETIONS = Endpoint(
    "cmpl", "text_completion", "prompt", CompletionResponse,
    choice=lambda reply, finish: CompletionChoice(text=reply.content, finish_reason=finish),
    delta=lambda text, finish: {"text": text, "finish_reason": finish})
CHAT = Endpoint(
    "chatcmpl", "chat.completion.chunk", "messages", ChatCompletionResponse,
    choice=lambda reply, finish: ChatChoice(message=ChatMessageOut(
        content=reply.content if reply.content or not reply.tool_calls else None,
        tool_calls=reply.tool_calls or None), finish_reason=finish),
    delta=lambda text, finish: {"delta": {"content": text} if text or finish is None else {},
                                "finish_reason": finish},
    prologue={"delta": {"role": "assistant", "content": ""}, "finish_reason": None})


def tool_call_delta(event: ToolEvent) -> dict[str, Any]:
    """A chat chunk's choice for one event of the reply's tool-call parser, as OpenAI streams calls: the call's
    index, id, type and name first (arguments ""), then its arguments in pieces."""
    if isinstance(event, Content):
        delta: dict[str, Any] = {"content": event.text}
    elif isinstance(event, CallStart):
        delta = {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                 "function": {"name": event.name, "arguments": ""}}]}
    else:
        assert isinstance(event, CallArguments)
        delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return {"delta": delta, "finish_reason": None}


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
    arrival = time.perf_counter()
    st = serving(request, body)
    prompt = body.prompt_input()
    ids = await prompts.encode_text(st.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    max_tokens = body.max_tokens or prompts.DEFAULT_COMPLETION_MAX_TOKENS
    return await generate(COMPLETIONS, body, ids, max_tokens, st, request, arrival)


@router.post("/v1/chat/completions", response_model=None, responses=documented(CHAT))
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.perf_counter()
    st = serving(request, body)
    tools = ChatTools.of(st.tokenizer, body)
    messages, template_tools = tools.template_input([m.for_template() for m in body.messages])
    ids = await prompts.encode_messages(st.tokenizer, messages, tools=template_tools)
    max_tokens = prompts.chat_max_tokens(body.requested_max_tokens, len(ids), st.max_context)
    grammar = tools.grammar(body.response_format.output_schema if body.response_format else None)
    constraint = None if grammar is None else await prompts.grammar_constraint(
        st.tokenizer, st.engine.eos, grammar, param="tools" if tools.required else "response_format")
    return await generate(CHAT, body, ids, max_tokens, st, request, arrival, constraint=constraint,
                          calls=tools.parser())


def serving(request: Request, body: OpenAIRequest) -> ServerState:
    """The server's state, once it is ready and `body` names the model it serves (or none)."""
    st = server_state(request.app)
    st.ready()
    st.check_model(body.model)
    return st


async def generate(endpoint: Endpoint, body: OpenAIRequest, ids: list[int], max_tokens: int, st: ServerState,
                   request: Request, arrival: float, constraint: TokenConstraint | None = None,
                   calls: ToolCallParser | None = None) -> Response:
    """Submit now (so that a refusal is a plain 429 or 400), then stream (SSE) or collect (JSON) the answer.
    `constraint`: a grammar the reply follows; `calls`: what reads tool calls out of it."""
    prompts.check_prompt(ids, st.vocab_size, st.max_context, max_tokens, param=endpoint.prompt_param)
    stream = st.open_stream(ids, prompts.sampling_params(body, max_tokens, constraint), arrival,
                            param=endpoint.prompt_param)
    answer = Answer(endpoint, f"{endpoint.id_prefix}-{uuid.uuid4().hex}", int(time.time()), st.model_id,
                    body.include_usage, calls)
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
    calls: ToolCallParser | None = None  # chat with tools: the reply's text goes through it

    def chunk(self, choice: dict[str, Any] | None, usage: UsageInfo | None = None) -> dict[str, Any]:
        """A streamed chunk: one choice, or (the usage chunk) none."""
        c: dict[str, Any] = {"id": self.id, "object": self.endpoint.chunk_object, "created": self.created,
                             "model": self.model,
                             "choices": [] if choice is None else [{"index": 0, **choice, "logprobs": None}]}
        if usage is not None or self.include_usage:
            c["usage"] = None if usage is None else usage.model_dump()
        return c

    def pieces(self, text: str, end: bool = False) -> list[dict[str, Any]]:
        """The streamed choices for a delta's text (`end`: the last delta's)."""
        if self.calls is None:
            return [self.endpoint.delta(text, None)] if text else []
        events = self.calls.feed(text) + (self.calls.finish() if end else [])
        return [tool_call_delta(e) for e in events if not isinstance(e, CallEnd)]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for a reply that ended in calls."""
        return "tool_calls" if reason == "stop" and self.calls is not None and self.calls.calls else reason

    async def events(self, stream: EngineStream) -> AsyncIterator[bytes]:
        try:
            if self.endpoint.prologue is not None:
                yield sse_event(self.chunk(self.endpoint.prologue))
            async for d in stream:
                if d.finish_reason is None:
                    for choice in self.pieces(d.text):
                        yield sse_event(self.chunk(choice))
                    continue
                failure = from_unfinished(d)
                if failure is not None:  # after the 200, a failure is a last event, a server_error
                    yield sse_event(error_body(failure.message, "server_error", None, failure.code))
                    break
                if self.calls is None:
                    yield sse_event(self.chunk(self.endpoint.delta(d.text, d.finish_reason)))
                else:
                    for choice in self.pieces(d.text, end=True):
                        yield sse_event(self.chunk(choice))
                    yield sse_event(self.chunk(self.endpoint.delta("", self.finish_reason(d.finish_reason))))
                if self.include_usage and d.usage is not None:
                    yield sse_event(self.chunk(None, usage_info(d.usage)))
            yield SSE_DONE
        except Exception as e:  # after the first byte an error can only be a last event
            log.exception("stream %s failed", self.id)
            yield sse_event(error_body(f"internal error: {type(e).__name__}", "server_error", None, "internal"))
            yield SSE_DONE

    async def collect(self, stream: EngineStream, request: Request) -> Completion:
        """The whole answer. A client that hangs up first cancels the generation."""

        async def cancel_on_disconnect() -> None:
            await until_disconnect(request.receive)
            stream.cancel()

        watcher = asyncio.create_task(cancel_on_disconnect())
        parts: list[str] = []
        try:
            async for d in stream:
                parts.append(d.text)
                last = d
        finally:
            watcher.cancel()
            stream.close()
        failure = from_unfinished(last)
        if failure is not None:
            raise failure
        assert last.usage is not None
        return self.endpoint.response(id=self.id, created=self.created, model=self.model,
                                      choices=[self.endpoint.choice(self.reply("".join(parts)),
                                                                    self.finish_reason(last.finish_reason))],
                                      usage=usage_info(last.usage))

    def reply(self, text: str) -> Reply:
        if self.calls is None:
            return Reply(text)
        events = self.calls.feed(text) + self.calls.finish()
        return Reply("".join(e.text for e in events if isinstance(e, Content)),
                     [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments or "{}"))
                      for c in self.calls.calls])
