"""/v1/realtime: one WebSocket per voice conversation, JSON events named after OpenAI's Realtime API.

client → server: session.update, response.create, response.cancel
server → client: session.created, session.updated, response.created, response.output_text.delta, response.done,
                 error (the socket stays open)

The socket owns one engine Session: every turn runs in the same KV slot, so a turn whose prompt extends the
previous one (the conversation so far + new messages) prefills only what it adds. The server keeps the
conversation: a turn's new messages and the assistant's reply join it when the turn completes (or, on barge-in,
with the part of the reply that was sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from service.api import prompts
from service.api.chunking import SentenceChunker
from service.api.errors import APIError, from_rejected, from_validation
from service.api.protocol import RealtimeResponseConfig, RealtimeSessionConfig
from service.api.state import ServerState
from service.api.streaming import EngineStream
from service.engine.engine import Rejected
from service.engine.kv_slots import Session
from service.engine.request import Delta

log = logging.getLogger("parley.realtime")
router = APIRouter()

MAX_EVENT_CHARS = 1 << 20  # as the HTTP body limit; larger frames (up to the server's ws_max_size) get an error
STATUS = {"stop": "completed", "length": "completed", "cancelled": "cancelled", "error": "failed"}


@dataclass
class Defaults:
    """The session's settings, the defaults of each response.create."""

    instructions: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    chunking: str = "none"

    def merged(self, cfg: RealtimeSessionConfig) -> Defaults:
        out = Defaults(**self.__dict__)
        for k, v in cfg.model_dump(exclude_unset=True).items():
            if k in ("id", "input", "model"):
                continue
            if k == "stop":
                v = [v] if isinstance(v, str) else list(v or [])
            if v is not None or k in ("instructions", "seed", "max_tokens"):
                setattr(out, k, v)
        return out


@dataclass
class ActiveResponse:
    id: str
    stream: EngineStream
    new_messages: list[dict[str, str]] | None
    st: ServerState
    task: asyncio.Task[None] | None = None
    _counted: bool = True

    def end(self) -> None:
        """Stop generating (if it still does) and stop counting it as in flight; idempotent."""
        self.stream.cancel()
        if self._counted:
            self._counted = False
            self.st.stream_ended()


@router.get("/v1/realtime", include_in_schema=False)
async def realtime_over_http() -> None:
    """A plain HTTP GET (no WebSocket upgrade): say what this endpoint speaks rather than 404."""
    raise APIError(426, "/v1/realtime speaks WebSocket: connect with an Upgrade: websocket request",
                   code="websocket_required", headers={"Upgrade": "websocket"})


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket) -> None:
    st: ServerState = ws.app.state.parley
    await ws.accept()
    try:
        st.ready()
    except APIError as e:
        await ws.send_json({"type": "error", "error": {"type": e.type, "code": e.code, "message": e.message}})
        await ws.close(code=1013)
        return
    await RealtimeConnection(ws, st).run()


class RealtimeConnection:
    def __init__(self, ws: WebSocket, st: ServerState) -> None:
        self.ws, self.st = ws, st
        self.engine = st.engine
        self.session: Session = self.engine.new_session()
        self.defaults = Defaults()
        self.conversation: list[dict[str, str]] = []
        self.active: ActiveResponse | None = None
        self._send_lock = asyncio.Lock()

    # -- the socket --------------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self.send({"type": "session.created", "session": self.session_info()})
            model = self.ws.query_params.get("model")
            if model and model != self.st.model_id:  # OpenAI's clients name the model in the URL
                await self.error("invalid_request_error", "model_not_found",
                                 f"the model {model!r} does not exist; this session serves {self.st.model_id!r}",
                                 param="model")
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
            self.engine.close_session(self.session)

    async def send(self, event: dict[str, Any]) -> None:
        if self.ws.application_state is not WebSocketState.CONNECTED:
            return
        async with self._send_lock:
            await self.ws.send_text(json.dumps(event, ensure_ascii=False, separators=(",", ":")))

    async def error(self, type: str, code: str | None, message: str, param: str | None = None,
                    event_type: str | None = None, **extra: Any) -> None:
        err: dict[str, Any] = {"type": type, "code": code, "message": message, "param": param}
        if event_type:
            err["event_type"] = event_type
        err.update(extra)
        await self.send({"type": "error", "error": err})

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
            elif kind == "response.cancel":
                await self.response_cancel(event)
            else:
                await self.error("invalid_request_error", "unknown_event_type", f"unknown event type {kind!r}",
                                 param="type", event_type=kind)
        except APIError as e:
            await self.error(e.type, e.code, e.message, param=e.param, event_type=kind)
        except ValidationError as e:
            err = from_validation(e)  # type: ignore[arg-type]
            where = "session" if kind == "session.update" else "response"
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
        self.check_model(cfg.model, "session.model")
        self.defaults = self.defaults.merged(cfg)
        await self.send({"type": "session.updated", "session": self.session_info()})

    async def response_create(self, event: dict[str, Any], received: float) -> None:
        if self.active is not None:
            raise APIError(400, f"response {self.active.id} is still in progress: cancel it or wait for its "
                                "response.done", code="conversation_already_has_active_response")
        cfg = RealtimeResponseConfig.model_validate(_object(event, "response"))
        self.check_model(cfg.model, "response.model")
        turn = self.defaults.merged(cfg)
        self.st.ready()  # 503-shaped error while draining
        tok = self.st.tokenizer
        new_messages: list[dict[str, str]] | None = None
        if isinstance(cfg.input, str):
            ids = await prompts.encode_text(tok, cfg.input, param="response.input")
            param = "response.input"
        else:
            new_messages = [m.for_template() for m in cfg.input]
            system = [{"role": "system", "content": turn.instructions}] if turn.instructions else []
            ids = await prompts.encode_messages(tok, system + self.conversation + new_messages,
                                                param="response.input")
            param = "response.input"
        ctx = self.st.max_context
        max_tokens = prompts.chat_max_tokens(turn.max_tokens, len(ids), ctx)
        prompts.check_prompt(ids, self.st.vocab_size, ctx, max_tokens, param=param)
        params = prompts.sampling_params(max_tokens, turn.temperature, turn.top_p, turn.top_k, tuple(turn.stop),
                                         turn.seed, turn.ignore_eos)
        rid = cfg.id or f"resp_{uuid.uuid4().hex[:20]}"
        try:
            stream = EngineStream(self.engine, ids, params, session=self.session, arrival=received)
        except Rejected as r:
            err = from_rejected(r)
            await self.error(err.type, err.code, err.message, event_type="response.create",
                             retry_after_ms=max(1, round(r.retry_after_s * 1000)), response_id=rid)
            return
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="invalid_prompt") from e
        self.st.stream_started()
        active = self.active = ActiveResponse(rid, stream, new_messages, self.st)
        try:
            await self.send({"type": "response.created", "response": {"id": rid, "status": "in_progress"}})
        except Exception:
            active.end()
            self.active = None
            raise
        active.task = asyncio.create_task(self._respond(active, chunking=turn.chunking == "sentence"))

    def check_model(self, model: str | None, param: str) -> None:
        if model and model != self.st.model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.st.model_id!r}",
                           param=param, code="model_not_found")

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

    # -- one response --------------------------------------------------------------------------------------
    async def _respond(self, active: ActiveResponse, chunking: bool) -> None:
        chunker = SentenceChunker() if chunking else None
        sent: list[str] = []
        last: Delta | None = None
        try:
            async for d in active.stream:
                last = d
                if d.finish_reason in ("cancelled", "error"):
                    break
                pieces = chunker.add(d.text) if chunker and d.text else ([d.text] if d.text else [])
                if d.finish_reason is not None and chunker is not None:
                    pieces += chunker.flush()
                for piece in pieces:
                    sent.append(piece)
                    await self.send({"type": "response.output_text.delta", "response_id": active.id,
                                     "delta": piece})
            assert last is not None and last.finish_reason is not None
            status = STATUS.get(last.finish_reason, "failed")
            text = "".join(sent)
            if status != "failed" and active.new_messages is not None:
                self.conversation += active.new_messages
                if text or status == "completed":
                    self.conversation.append({"role": "assistant", "content": text})
            self.active = None  # before response.done: the client may answer it with the next response.create
            if status == "failed":  # an error event too, for clients that only watch those
                await self.error("server_error", "engine_error", f"generation failed: {last.error or 'engine error'}",
                                 event_type="response.create", response_id=active.id)
            await self.send({"type": "response.done", "response": self._done(active.id, status, text, last)})
        except Exception:  # the socket went away mid-response: stop generating
            active.stream.cancel()
            if self.active is active:
                self.active = None
            if self.ws.application_state is WebSocketState.CONNECTED:
                log.exception("response %s failed", active.id)
        finally:
            active.end()

    def _done(self, rid: str, status: str, text: str, last: Delta) -> dict[str, Any]:
        out: dict[str, Any] = {"id": rid, "status": status, "output_text": text,
                               "finish_reason": last.finish_reason}
        if last.usage is not None:
            u = last.usage
            out["usage"] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                            "total_tokens": u.total_tokens, "cached_tokens": u.cached_tokens}
        if last.timings is not None:
            t = last.timings
            out["timings"] = {"queue_ms": t.queue_ms, "prefill_ms": t.prefill_ms, "ttft_ms": t.ttft_ms,
                              "ttf64_ms": t.ttfn_ms, "e2e_ms": t.e2e_ms}
        if status == "failed":
            out["status_details"] = {"type": "failed", "error": {"type": "server_error", "code": "engine_error",
                                                                 "message": last.error or "generation failed"}}
        return out

    async def _abort_active(self) -> None:
        active, self.active = self.active, None
        if active is None:
            return
        active.stream.cancel()
        if active.task is not None:
            active.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await active.task
        active.end()

    def session_info(self) -> dict[str, Any]:
        d = self.defaults
        return {"id": self.session.id, "object": "realtime.session", "model": self.st.model_id,
                "instructions": d.instructions, "max_tokens": d.max_tokens, "temperature": d.temperature,
                "top_p": d.top_p, "top_k": d.top_k, "stop": d.stop, "seed": d.seed, "ignore_eos": d.ignore_eos,
                "chunking": d.chunking, "max_context": self.st.max_context}


def _object(event: dict[str, Any], key: str) -> dict[str, Any]:
    value = event.get(key)
    if value is None:
        raise APIError(400, f"the event needs a `{key}` object", param=key, code="missing_required_parameter")
    if not isinstance(value, dict):
        raise APIError(400, f"`{key}` must be an object", param=key, code="invalid_value")
    return value
