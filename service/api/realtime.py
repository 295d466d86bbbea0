"""/v1/realtime: one WebSocket per voice conversation, JSON events named after OpenAI's Realtime API.

client → server: session.update, conversation.item.create, response.create, response.cancel,
                 conversation.item.truncate
server → client: session.created, session.updated, conversation.item.created, response.created,
                 response.output_text.delta, response.output_item.added + response.function_call_arguments.delta/.done
                 (a tool call), response.done, conversation.item.truncated, error (the socket stays open)

The socket owns one engine Session: every turn runs in the same KV slot, so a turn whose prompt extends the
previous one (the conversation so far + new messages) prefills only what it adds. The server keeps the
conversation: a turn's new messages and the assistant's reply join it when the turn completes (or, on barge-in,
with the part of the reply that was sent; conversation.item.truncate then cuts it to what the caller heard:
truncation.py). An item a client adds with conversation.item.create (OpenAI's way: the transcript, or a tool's
output, then a bare response.create) joins it at once, or after the reply in progress. A turn is built as a chat
request's is (turn.py): tools, tool_choice and response_format (session.update or response.create) work as in chat
completions; a call the assistant made joins the conversation with its reply, and the client answers it with a `role:
"tool"` message in the next turn's input (or a function_call_output item). The reply's text is spoken: tool-protocol
markup never reaches output_text (reply.py). Every event sent is a model of realtime_events.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, cast

from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from service.api.auth import KEY_SUBPROTOCOL
from service.api.chunking import SentenceChunker
from service.api.engine_client import RemoteSession
from service.api.errors import APIError, from_rejected, from_unfinished, from_validation
from service.api.protocol import RealtimeItem, RealtimeResponseConfig, RealtimeSessionConfig
from service.api.realtime_events import (
    CallStatus,
    ErrorEvent,
    ErrorInfo,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    ItemCreated,
    ItemTruncated,
    MessageItem,
    Outcome,
    OutputItemAdded,
    OutputTextDelta,
    RealtimeError,
    RealtimeResponse,
    RealtimeUsage,
    ResponseCreated,
    ResponseDone,
    ResponseRef,
    ResponseTimings,
    ServerEvent,
    SessionCreated,
    SessionInfo,
    SessionUpdated,
    StatusDetails,
    session_info,
)
from service.api.reply import ReplyReader
from service.api.state import ServerState, server_state
from service.api.streaming import DeltaStream
from service.api.tool_parsers import CallArguments, CallEnd, CallStart, Content, ParsedCall, ToolEvent
from service.api.truncation import ReplyItem, Truncate
from service.api.turn import Conversation, Fields, TurnRequest, build_turn, check_schemas
from service.engine.engine import Rejected
from service.engine.kv_slots import Session
from service.engine.request import Delta, outcome_of

log = logging.getLogger("parley.realtime")
router = APIRouter()

MAX_EVENT_CHARS = 1 << 20  # as the HTTP body limit; larger frames (up to the server's ws_max_size) get an error
# what a response.create's refusals name; a max_tokens past the context is named `max_tokens`, as over HTTP
RESPONSE_FIELDS = Fields("response.input", prefix="response.")


@dataclass
class ActiveResponse:
    id: str
    stream: DeltaStream
    new_messages: list[dict[str, Any]] | None
    reader: ReplyReader  # calls and spoken content out of the reply
    task: asyncio.Task[None] | None = None
    prompt_tokens: int = 0
    call_items: dict[int, str] = field(default_factory=dict)  # a call's index → its item id
    spoke: bool = False  # content went out
    # where the calls' items start in `output`: after the message where the reply spoke before its first call, else
    # first (a reply of calls alone has no message item, as OpenAI sends it); None: no call yet
    call_offset: int | None = None


@router.get("/v1/realtime", include_in_schema=False)
async def realtime_over_http() -> None:
    """A plain HTTP GET (no WebSocket upgrade): say what this endpoint speaks rather than 404."""
    raise APIError(426, "/v1/realtime speaks WebSocket: connect with an Upgrade: websocket request",
                   code="websocket_required", headers={"Upgrade": "websocket"})


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    st = server_state(ws.app)
    await ws.accept(subprotocol=accepted_subprotocol(ws.scope.get("subprotocols", [])))
    try:
        st.ready()
    except APIError as e:
        await ws.send_text(ErrorEvent(error=RealtimeError(type=e.type, code=e.code, message=e.message))
                           .model_dump_json())
        await ws.close(code=1013)
        return
    await RealtimeConnection(ws, st).run()


def accepted_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to answer a handshake with: `realtime` where offered (OpenAI's browser clients offer it beside
    their key's, and a browser fails a handshake that offered subprotocols and got none back), else the first one
    offered that is not a key: a key is never echoed back."""
    if "realtime" in offered:
        return "realtime"
    return next((p for p in offered if not p.startswith(KEY_SUBPROTOCOL)), None)


class RealtimeConnection:
    def __init__(self, ws: WebSocket, st: ServerState) -> None:
        self.ws, self.st = ws, st
        self.session: Session | RemoteSession = st.new_session()
        self.settings = RealtimeSessionConfig()  # session.update changes them; each response.create starts there
        self.conversation: list[dict[str, Any]] = []
        self.added: list[dict[str, Any]] = []  # items created while a response ran: they join after its reply
        self.last_item: str | None = None  # the id of the item created last (the next one's previous_item_id)
        self.active: ActiveResponse | None = None
        self.replies: dict[str, ReplyItem] = {}  # item id → a reply the client may truncate
        self._send_lock = asyncio.Lock()

    # -- the socket --------------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self.send(SessionCreated(session=self.session_info()))
            try:
                self.st.check_model(self.ws.query_params.get("model"))  # OpenAI's clients name it in the URL
            except APIError as e:
                await self.error(e.type, e.code, e.message, param=e.param)
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                received = time.perf_counter()
                if message.get("text") is None:
                    await self.error("invalid_request_error", "binary_not_supported",
                                     "binary frames are not supported: send JSON text events")
                    continue
                if len(message["text"]) > MAX_EVENT_CHARS:
                    await self.error("invalid_request_error", "request_too_large",
                                     f"an event may be at most {MAX_EVENT_CHARS} characters")
                    continue
                await self.handle(message["text"], received)
        except WebSocketDisconnect:
            pass
        except Exception:  # a send to a socket that just went away, or a bug: either way this socket is done
            if self.ws.application_state is WebSocketState.CONNECTED:
                log.exception("realtime session %s failed", self.session.id)
        finally:
            await self._abort_active()
            self.st.close_session(self.session)

    async def send(self, event: ServerEvent) -> None:
        if self.ws.application_state is not WebSocketState.CONNECTED:
            return
        async with self._send_lock:
            await self.ws.send_text(event.model_dump_json())

    async def error(self, type: str, code: str | None, message: str, param: str | None = None,
                    event_type: str | None = None, response_id: str | None = None,
                    retry_after_ms: int | None = None) -> None:
        await self.send(ErrorEvent(error=RealtimeError(type=type, code=code, message=message, param=param,
                                                       event_type=event_type, response_id=response_id,
                                                       retry_after_ms=retry_after_ms)))

    # -- events ------------------------------------------------------------------------------------------
    async def handle(self, text: str, received: float) -> None:
        try:
            event = json.loads(text)
        except json.JSONDecodeError as e:
            await self.error("invalid_request_error", "invalid_json", f"the event is not valid JSON: {e}")
            return
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            await self.error("invalid_request_error", "invalid_event",
                             "an event must be a JSON object with a string `type`", param="type")
            return
        kind = event["type"]
        try:
            json.dumps(event, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # a \ud800 escape: not text; the tokenizer (and our replies) would choke on it
            await self.error("invalid_request_error", "invalid_encoding",
                             "the event holds a lone surrogate (\\ud800-\\udfff), which is not valid Unicode",
                             event_type=kind[:64].encode("utf-8", "replace").decode())
            return
        try:
            if kind == "session.update":
                await self.session_update(event)
            elif kind == "response.create":
                await self.response_create(event, received)
            elif kind == "conversation.item.create":
                await self.item_create(event)
            elif kind == "response.cancel":
                await self.response_cancel(event)
            elif kind == "conversation.item.truncate":
                await self.item_truncate(event)
            else:
                await self.error("invalid_request_error", "unknown_event_type", f"unknown event type {kind!r}",
                                 param="type", event_type=kind)
        except APIError as e:
            await self.error(e.type, e.code, e.message, param=e.param, event_type=kind)
        except ValidationError as e:
            err = from_validation(e)  # type: ignore[arg-type]
            where = {"session.update": "session", "conversation.item.create": "item"}.get(kind, "response")
            param = f"{where}.{err.param}" if err.param else where
            message = err.message.replace(f"{err.param}:", f"{param}:", 1) if err.param else err.message
            await self.error(err.type, err.code, message, param=param, event_type=kind)
        except WebSocketDisconnect:
            raise
        except Exception as e:  # a bug must not take the socket down: answer, log, and keep serving
            if self.ws.application_state is not WebSocketState.CONNECTED:
                raise
            log.exception("realtime event %s failed", kind)
            await self.error("server_error", "internal", f"internal error: {type(e).__name__}", event_type=kind)

    async def session_update(self, event: dict[str, Any]) -> None:
        cfg = RealtimeSessionConfig.model_validate(_object(event, "session"))
        self.st.check_model(cfg.model, "session.model")
        check_schemas(cfg, cfg.response_format, prefix="session.")  # refused now, not at every later turn
        self.settings = self.settings.updated(cfg)
        await self.send(SessionUpdated(session=self.session_info()))

    async def response_create(self, event: dict[str, Any], received: float) -> None:
        if self.active is not None:
            raise APIError(400, f"response {self.active.id} is still in progress: cancel it or wait for its "
                                "response.done", code="conversation_already_has_active_response")
        cfg = RealtimeResponseConfig.model_validate(_object(event, "response", optional=True))
        self.st.check_model(cfg.model, "response.model")
        settings = self.settings.updated(cfg)
        self.st.ready()  # 503-shaped error while draining
        new_messages: list[dict[str, Any]] | None = None
        if isinstance(cfg.input, str):  # a text prompt: no template, so no tools
            prompt: str | Conversation = cfg.input
        else:
            new_messages = [m.for_template() for m in cfg.input]
            if not new_messages and not self.conversation:
                raise APIError(400, "response.input is empty and the conversation holds nothing to reply to",
                               param="response.input", code="empty_input")
            system = [{"role": "system", "content": settings.instructions}] if settings.instructions else []
            prompt = Conversation(system + self.conversation + new_messages)
        turn = await build_turn(self.st, TurnRequest(
            prompt, settings, RESPONSE_FIELDS, spoken=True, max_tokens=settings.max_tokens, tools=settings,
            response_format=settings.response_format))
        rid = cfg.id or f"resp_{uuid.uuid4().hex[:20]}"
        try:
            stream = await turn.submit(self.st, received, session=self.session)
        except Rejected as r:
            err = from_rejected(r)
            await self.error(err.type, err.code, err.message, event_type="response.create", response_id=rid,
                             retry_after_ms=max(1, round(r.retry_after_s * 1000)))
            return
        # out of band: the conversation stays as it is (the items added since still join it, after the reply)
        joins = new_messages if cfg.conversation == "auto" else None
        reader = turn.reader()
        assert reader is not None  # a spoken turn
        active = self.active = ActiveResponse(rid, stream, joins, reader, prompt_tokens=len(turn.ids))
        try:
            await self.send(ResponseCreated(response=ResponseRef(id=rid)))
        except Exception:
            stream.close()
            self.active = None
            raise
        active.task = asyncio.create_task(self._respond(active, chunking=settings.chunking == "sentence"))

    async def response_cancel(self, event: dict[str, Any]) -> None:
        rid = event.get("response_id")
        if rid is not None and not isinstance(rid, str):
            raise APIError(400, "response_id must be a string", param="response_id", code="invalid_value")
        active = self.active
        if active is None or (rid is not None and rid != active.id):
            which = f"response {rid}" if rid else "response"
            raise APIError(400, f"there is no {which} in progress to cancel", param="response_id",
                           code="response_cancel_not_active")
        active.stream.cancel()  # the engine frees the slot before its next step; response.done follows

    async def item_create(self, event: dict[str, Any]) -> None:
        """An item the client adds to the conversation (a user's transcript, a tool's output): it joins at once, or,
        while a response runs, after that response's reply."""
        item = RealtimeItem.model_validate(_object(event, "item"))
        message = item.message().for_template()
        (self.conversation if self.active is None else self.added).append(message)
        previous, self.last_item = self.last_item, item.id or f"item_{uuid.uuid4().hex[:20]}"
        shown: dict[str, object] = {"id": self.last_item, "object": "realtime.item", "type": item.type,
                                    "status": "completed"}
        if item.type == "message":
            shown |= {"role": item.role, "content": [{"type": "input_text" if item.role != "assistant" else
                                                      "output_text", "text": message["content"]}]}
        else:
            shown |= {"call_id": item.call_id, "output": item.output}
        await self.send(ItemCreated(previous_item_id=previous, item=shown))

    async def item_truncate(self, event: dict[str, Any]) -> None:
        """The caller heard the reply only up to `text_end` characters: the conversation and the session's cached
        K/V keep only that."""
        cut = Truncate.parse(event)
        if self.active is not None:
            raise APIError(400, f"response {self.active.id} is still in progress: truncate after its response.done",
                           code="response_in_progress")
        reply = next((r for r in reversed(self.replies.values()) if cut.item_id in (r.id, r.response_id)), None)
        if reply is None:
            raise APIError(400, f"no assistant item {cut.item_id!r} to truncate", param="item_id",
                           code="item_not_found")
        if cut.text_end > len(reply.text):
            raise APIError(400, f"text_end {cut.text_end} is beyond the {len(reply.text)} characters of the reply",
                           param="text_end", code="text_end_out_of_range")
        self.st.truncate(self.session, reply.keep_tokens(cut.text_end))
        reply.truncate(cut.text_end)
        if reply.conversation_index is not None:  # its calls (separate items) stay
            self.conversation[reply.conversation_index] = {**self.conversation[reply.conversation_index],
                                                           "content": reply.text}
        await self.send(ItemTruncated(item_id=reply.id, text_end=cut.text_end))

    # -- one response --------------------------------------------------------------------------------------
    async def _respond(self, active: ActiveResponse, chunking: bool) -> None:
        chunker = SentenceChunker() if chunking else None
        sent: list[str] = []
        last: Delta | None = None
        reply = ReplyItem(active.id, active.prompt_tokens)

        async def say(pieces: list[str]) -> None:
            for piece in pieces:
                sent.append(piece)
                active.spoke = True
                await self.send(OutputTextDelta(response_id=active.id, delta=piece))

        try:
            async for d in active.stream:
                if active.reader.repeated:  # cut at a repeated call (below): a stop, not a cancel
                    d = replace(d, finish_reason=active.reader.finished(d.finish_reason))
                last = d
                if d.finish_reason in ("cancelled", "error"):
                    break
                events = active.reader.feed(d.text) + (active.reader.finish() if d.finish_reason else [])
                if active.reader.repeated:  # a call again: the model stutters; the reply ends here
                    active.stream.cancel()
                reply.add(replace(d, text="".join(e.text for e in events if isinstance(e, Content))))
                for e in events:
                    if isinstance(e, Content):
                        await say(chunker.add(e.text) if chunker else [e.text])
                    else:  # what was said before a call goes out before it
                        await say(chunker.flush() if chunker else [])
                        await self._call_event(active, e)
                if d.finish_reason is not None and chunker is not None:
                    await say(chunker.flush())
            assert last is not None and last.finish_reason is not None
            status = "incomplete" if last.finish_reason == "length" else cast(Outcome, outcome_of(last.finish_reason))
            text = "".join(sent)
            calls = active.reader.calls
            made = [c for c in calls if c.complete]  # a call cut short (a barge-in) stays out of the history
            if status != "failed" and active.new_messages is not None:
                self.conversation += active.new_messages
                if text or made or status == "completed":
                    reply.conversation_index = len(self.conversation)
                    self.conversation.append(_assistant_message(text, made))
            self.conversation += self.added  # the client's items are the conversation's, whatever the reply did
            self.added = []
            if status != "failed":
                reply.text = text
                self._keep(reply)
            self.active = None  # before response.done: the client may answer it with the next response.create
            failure = from_unfinished(last) if status == "failed" else None
            if failure is not None:  # an error event too, for clients that only watch those
                await self.error(failure.type, failure.code, failure.message, event_type="response.create",
                                 response_id=active.id)
            done = self._done(active.id, status, text, last, reply)
            if status != "failed" and calls:
                items: list[MessageItem | FunctionCallItem] = [
                    _call_item(active.call_items[i], c) for i, c in enumerate(calls)]
                done.output = done.output + items if active.call_offset else items + done.output * bool(text)
            await self.send(ResponseDone(response=done))
        except Exception:  # the socket went away mid-response: stop generating
            active.stream.cancel()
            if self.active is active:
                self.active = None
            if self.ws.application_state is WebSocketState.CONNECTED:
                log.exception("response %s failed", active.id)
        finally:
            active.stream.close()

    async def _call_event(self, active: ActiveResponse, event: ToolEvent) -> None:
        """A tool call as OpenAI's Realtime API streams it: its item added, its arguments in pieces, then whole.
        Its output_index counts the assistant message first where the reply spoke before its first call."""
        assert not isinstance(event, Content)
        call = active.reader.calls[event.index]
        if active.call_offset is None:
            active.call_offset = int(active.spoke)
        index = event.index + active.call_offset
        if isinstance(event, CallStart):
            item_id = active.call_items[event.index] = f"item_{uuid.uuid4().hex[:20]}"
            await self.send(OutputItemAdded(response_id=active.id, output_index=index,
                                            item=_call_item(item_id, call, status="in_progress")))
            return
        item_id = active.call_items[event.index]
        if isinstance(event, CallArguments):
            await self.send(FunctionCallArgumentsDelta(response_id=active.id, item_id=item_id,
                                                       output_index=index, call_id=call.id,
                                                       name=call.name, delta=event.text))
        elif isinstance(event, CallEnd):
            await self.send(FunctionCallArgumentsDone(response_id=active.id, item_id=item_id,
                                                      output_index=index, call_id=call.id,
                                                      name=call.name, arguments=call.arguments))

    def _keep(self, reply: ReplyItem) -> None:
        """Remember a reply for conversation.item.truncate: every one in the conversation, the last one outside it."""
        self.replies = {k: r for k, r in self.replies.items() if r.conversation_index is not None}
        self.replies[reply.id] = reply

    def _done(self, rid: str, status: Outcome, text: str, last: Delta, reply: ReplyItem) -> RealtimeResponse:
        failed = status == "failed"
        return RealtimeResponse(
            id=rid, status=status, output_text=text, output=[] if failed else [reply.output(status)],
            finish_reason=last.finish_reason, usage=None if last.usage is None else RealtimeUsage.of(last.usage),
            timings=None if last.timings is None else ResponseTimings.of(last.timings, self.st.sla_tokens),
            status_details=StatusDetails(error=ErrorInfo(type="server_error", code="engine_error",
                                                         message=last.error or "generation failed"))
            if failed else StatusDetails(type="incomplete", reason="max_output_tokens") if status == "incomplete"
            else None)

    async def _abort_active(self) -> None:
        active, self.active = self.active, None
        if active is None:
            return
        active.stream.cancel()
        if active.task is not None:
            active.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await active.task
        active.stream.close()

    def session_info(self) -> SessionInfo:
        return session_info(self.settings, id=self.session.id, model=self.st.model_id,
                            max_context=self.st.max_context)


def _assistant_message(text: str, calls: list[ParsedCall]) -> dict[str, Any]:
    """The assistant's turn as the conversation keeps it (ChatMessage.for_template's shape)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                            "arguments": c.arguments}}
                                 for c in calls]
    return message


def _call_item(item_id: str, call: ParsedCall, status: CallStatus | None = None) -> FunctionCallItem:
    """A tool call as an item: in response.output_item.added (in progress) and response.done's `output`."""
    return FunctionCallItem(id=item_id, status=status or ("completed" if call.complete else "incomplete"),
                            call_id=call.id, name=call.name, arguments=call.arguments)


def _object(event: dict[str, Any], key: str, optional: bool = False) -> dict[str, Any]:
    value = event.get(key)
    if value is None and optional:
        return {}
    if value is None:
        raise APIError(400, f"the event needs a `{key}` object", param=key, code="missing_required_parameter")
    if not isinstance(value, dict):
        raise APIError(400, f"`{key}` must be an object", param=key, code="invalid_value")
    return value
