"""ServerState: what the handlers share — the engine once it is ready (the runtime in this process, or with
`--engine-process` the client of the engine process), whether the server drains, and the streams still being written
(a drain waits for them, not only for the engine). `server_state(app)` finds it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette

from service.api.delivery import DeliveryWatch
from service.api.engine_client import EngineClient, RemoteGrammar, RemoteSession, RemoteStream
from service.api.errors import APIError
from service.api.streaming import EngineStream
from service.engine.engine import Engine
from service.engine.kv_slots import Session
from service.engine.request import SamplingParams
from service.metrics import FrontEndMetrics
from service.model.tokenizer import Tokenizer
from service.runtime import Runtime

RETRY_AFTER = {"Retry-After": "5"}


@dataclass
class ServerState:
    runtime: Runtime | None = None  # the engine in this process (the default)
    client: EngineClient | None = None  # ...or the engine process's client (--engine-process)
    draining: bool = False
    failed: str | None = None  # why the runtime could not be built
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: FrontEndMetrics = field(default_factory=FrontEndMetrics)  # what the front end counts itself
    delivery: DeliveryWatch = field(default_factory=DeliveryWatch)  # how long tokens take to get here lately
    _streams: int = 0
    _streams_changed: threading.Condition = field(default_factory=threading.Condition)

    # -- readiness ----------------------------------------------------------------------------------------
    def _unavailable(self, look: bool = False) -> tuple[str, str, str] | None:
        """Why no request can be served now, as (error code, error message, /health status); None when ready.
        `look`: check the engine process now (/health), not only as the front end's watchdog last saw it."""
        rt, client = self.runtime, self.client
        if client is not None:
            why = client.unavailable(look)
            if why is None and self.draining:
                return "draining", "the server is shutting down", "draining"
            return why
        if rt is None:
            return "not_ready", self.failed or "the model is still loading", self.failed or "loading"
        if self.draining or not rt.engine.accepting:
            return "draining", "the server is shutting down", "draining"
        if not rt.engine.healthy():  # wedged or dead: an answer now beats a request that would wait forever
            return "engine_unhealthy", "the engine is not responding; this server should be restarted", \
                "engine unhealthy"
        return None

    def ready(self) -> None:
        """Nothing, or a 503 in OpenAI's shape while loading, draining, wedged or with the engine process gone."""
        why = self._unavailable()
        if why is not None:
            raise APIError(503, why[1], code=why[0], headers=dict(RETRY_AFTER))

    def loaded(self) -> None:
        """Nothing once the engine is up, also while draining (what it describes stays true); a 503 while loading."""
        if self.runtime is None and self.client is None:
            self.ready()

    def health(self) -> tuple[bool, str]:
        why = self._unavailable(look=True)
        return (True, "ok") if why is None else (False, why[2])

    def check_model(self, model: str | None, param: str = "model") -> None:
        """A request may name the served model, or none."""
        if model and model != self.model_id:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                           param=param, code="model_not_found")

    # -- the served model -----------------------------------------------------------------------------------
    @property
    def _runtime(self) -> Runtime:
        assert self.runtime is not None
        return self.runtime

    @property
    def engine(self) -> Engine | EngineClient:
        """What sessions are opened, truncated and closed with, and whose `eos` grammars end on."""
        return self.client if self.client is not None else self._runtime.engine

    @property
    def tokenizer(self) -> Tokenizer:
        return self.client.tokenizer if self.client is not None else self._runtime.model.tokenizer

    @property
    def model_id(self) -> str:
        return self.client.info.model_id if self.client is not None else self._runtime.model_id

    @property
    def max_context(self) -> int:
        return self.client.info.max_context if self.client is not None else self._runtime.max_context

    @property
    def vocab_size(self) -> int:
        return self.client.info.vocab_size if self.client is not None else self._runtime.model.config.vocab_size

    @property
    def sla_tokens(self) -> int:
        """N of the SLA's "token N within --sla-ms"."""
        return self.client.info.sla_tokens if self.client is not None else self._runtime.config.sla_tokens

    # -- realtime sessions (a conversation's pinned KV slot, in whichever process the engine runs) ---------------
    def new_session(self) -> Session | RemoteSession:
        return self.client.new_session() if self.client is not None else self._runtime.engine.new_session()

    def close_session(self, session: Session | RemoteSession) -> None:
        if isinstance(session, RemoteSession):
            self._client.close_session(session)
        else:
            self._runtime.engine.close_session(session)

    def truncate(self, session: Session | RemoteSession, keep_tokens: int) -> None:
        if isinstance(session, RemoteSession):
            self._client.truncate(session, keep_tokens)
        else:
            self._runtime.engine.truncate(session, keep_tokens)

    @property
    def _client(self) -> EngineClient:
        assert self.client is not None
        return self.client

    # -- streams in flight ----------------------------------------------------------------------------------
    async def open_stream(self, prompt_ids: list[int], params: SamplingParams, arrival: float,
                          session: Session | RemoteSession | None = None,
                          grammar: RemoteGrammar | None = None) -> EngineStream | RemoteStream:
        """The engine's submit, counted as a stream in flight until the stream is closed. What the engine raises
        propagates: Rejected (429, 503), ValueError for a prompt it cannot take, GrammarError for a `grammar` the
        engine process cannot compile (Turn.submit answers both). In this process the verdict comes at once; from
        the engine process, a round trip later."""
        stream: EngineStream | RemoteStream
        if self.client is not None:
            assert session is None or isinstance(session, RemoteSession)
            stream = await self.client.submit(prompt_ids, params, grammar, session=session, arrival=arrival,
                                              on_close=self._stream_closed, on_delivered=self._delivered,
                                              delivery_s=self.delivery.allowance())
        else:
            assert grammar is None and (session is None or isinstance(session, Session))
            stream = EngineStream(self._runtime.engine, prompt_ids, params, session=session, arrival=arrival,
                                  on_close=self._stream_closed, on_delivered=self._delivered,
                                  delivery_s=self.delivery.allowance())
        with self._streams_changed:
            self._streams += 1
        return stream

    def _delivered(self, seconds: float) -> None:
        self.metrics.token_delivery.observe(seconds)
        self.delivery.observe(seconds)

    def _stream_closed(self) -> None:
        with self._streams_changed:
            self._streams -= 1
            self._streams_changed.notify_all()

    def wait_streams(self, timeout_s: float) -> bool:
        """Block (off the event loop) until every stream is written to its end, at most timeout_s; whether so."""
        with self._streams_changed:
            return self._streams_changed.wait_for(lambda: self._streams == 0, timeout_s)


def server_state(app: Starlette) -> ServerState:
    return app.state.parley
