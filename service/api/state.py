"""ServerState: what the handlers share — the runtime once it is built, whether the server drains, and how many
streams are still being written (a drain waits for them, not only for the engine)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from service.api.errors import APIError
from service.engine.engine import Engine
from service.model.tokenizer import Tokenizer
from service.runtime import Runtime


@dataclass
class ServerState:
    runtime: Runtime | None = None
    draining: bool = False
    failed: str | None = None  # why the runtime could not be built
    created: int = field(default_factory=lambda: int(time.time()))
    _inflight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- readiness ----------------------------------------------------------------------------------------
    def ready(self) -> Runtime:
        """The runtime, or a 503 in OpenAI's shape while loading or draining."""
        rt = self.runtime
        if rt is None:
            raise APIError(503, self.failed or "the model is still loading", code="not_ready",
                           headers={"Retry-After": "5"})
        if self.draining or not rt.engine.accepting:
            raise APIError(503, "the server is shutting down", code="draining", headers={"Retry-After": "5"})
        if not rt.engine.healthy():  # wedged or dead: an answer now beats a request that would wait forever
            raise APIError(503, "the engine is not responding; this server should be restarted",
                           code="engine_unhealthy", headers={"Retry-After": "5"})
        return rt

    def health(self) -> tuple[bool, str]:
        rt = self.runtime
        if rt is None:
            return False, self.failed or "loading"
        if self.draining or not rt.engine.accepting:
            return False, "draining"
        if not rt.engine.healthy():
            return False, "engine unhealthy"
        return True, "ok"

    # -- the served model -----------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        assert self.runtime is not None
        return self.runtime.engine

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.runtime is not None
        return self.runtime.model.tokenizer

    @property
    def model_id(self) -> str:
        assert self.runtime is not None
        return self.runtime.model_id

    @property
    def max_context(self) -> int:
        assert self.runtime is not None
        rt = self.runtime
        return min(rt.config.max_context, rt.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        assert self.runtime is not None
        return self.runtime.model.config.vocab_size

    # -- streams in flight ----------------------------------------------------------------------------------
    def stream_started(self) -> None:
        with self._lock:
            self._inflight += 1

    def stream_ended(self) -> None:
        with self._lock:
            self._inflight -= 1

    @property
    def inflight(self) -> int:
        return self._inflight

    async def wait_streams(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while self._inflight > 0 and time.monotonic() < end:
            await asyncio.sleep(0.02)
        return self._inflight == 0
