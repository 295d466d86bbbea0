"""`parley serve`: the engine process (service/engine_process.py) and a front end — uvicorn in this process — with a
graceful drain on SIGTERM (and on the first Ctrl-C).

uvicorn on its own closes at once on SIGTERM. Parley instead stops admitting (new requests get 503 in OpenAI's
shape, /health turns 503 so that the load balancer looks elsewhere), lets every admitted request finish and every
stream be written to its end, and only then tells uvicorn to exit, then stops the engine process; the process exits
0. A second signal forces the exit. When the engine process dies, every stream ends in an error, /health says why
(503) for ENGINE_GONE_GRACE_S, and the front end exits 1: an orchestrator restarts the whole server.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import threading
import time
from types import FrameType

import uvicorn

from service import engine_process
from service.api.app import MAX_BODY_BYTES, create_app
from service.api.engine_client import EngineClient
from service.api.state import ServerState, server_state
from service.config import ServeConfig
from service.engine import ipc

log = logging.getLogger("parley")

# Realtime frames up to this size reach the app, which answers one over 1 MiB with an `error` event (the socket stays
# open); only a larger one is refused by the WebSocket layer itself (close 1009, message too big).
WS_MAX_BYTES = 4 * MAX_BODY_BYTES
STREAMS_GRACE_S = 10.0  # after the engine drained: time for the last bytes of each stream to go out
ENGINE_GONE_GRACE_S = 2.0  # the engine process died: /health answers 503 (and why) this long, then the server exits


class ParleyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self._drain_thread: threading.Thread | None = None
        self.engine_gone = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread, between two bytecodes of the event loop: only flip flags and start a thread.
        if self._drain_thread is not None:  # a second signal: stop now
            self.force_exit = True
            self.should_exit = True
            return
        self.state.draining = True
        self._drain_thread = threading.Thread(target=self._drain, name="parley-drain", daemon=True)
        self._drain_thread.start()

    def _drain(self) -> None:
        client = self.state.client
        if client is not None:
            client.drain()
            s = client.status
            log.info("draining: no new requests; waiting for %d running and %d waiting (at most %.0f s)",
                     s.running if s else 0, s.waiting if s else 0, self.drain_timeout_s)
            t0 = time.monotonic()
            end = t0 + self.drain_timeout_s
            while not client.drained() and time.monotonic() < end:
                time.sleep(0.01)
            done = client.drained()
            self.state.wait_streams(STREAMS_GRACE_S)
            if done:
                log.info("drained in %.1f s", time.monotonic() - t0)
            else:
                log.warning("drain timed out after %.0f s; exiting with requests in flight", self.drain_timeout_s)
        self.should_exit = True

    def on_engine_gone(self, why: str) -> None:
        """The engine process died (on the event loop): exit after the grace, whatever is still open."""
        self.engine_gone = True

        def leave() -> None:
            self.should_exit = True

        asyncio.get_running_loop().call_later(ENGINE_GONE_GRACE_S, leave)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        client = self.state.client
        if self.started and client is not None:
            c, info = self.config, client.info
            gc.collect()
            gc.freeze()  # what start-up allocated stays out of every later collection's scan
            log.info("Parley listening on http://%s:%d — model %s, backend %s, device %s, %d slots, context %d "
                     "(engine process %d)", c.host, c.port, info.model_id, info.backend, info.device, info.max_batch,
                     info.max_context, info.pid)


def serve(cfg: ServeConfig) -> int:
    """Run `parley serve` until SIGTERM/SIGINT; the exit status."""
    check_port(cfg.host, cfg.port)  # before minutes of loading, not after
    log.info("loading %s (backend %s) for http://%s:%d ...", cfg.model, cfg.backend, cfg.host, cfg.port)
    addresses = ipc.Addresses.fresh()
    engine = engine_process.spawn(cfg, addresses, front_ends=1)
    try:
        server: ParleyServer | None = None

        async def connect() -> EngineClient:
            client = await EngineClient.connect(addresses, 0, exit_code=engine.poll)
            assert server is not None
            client.on_dead.append(server.on_engine_gone)
            return client

        app = create_app(connect)
        state = server_state(app)
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, workers=1, lifespan="on", log_config=None,
                                log_level=cfg.log_level, access_log=cfg.access_log, ws_max_size=WS_MAX_BYTES,
                                timeout_graceful_shutdown=None)
        server = ParleyServer(config, state, cfg.drain_timeout_s)
        server.run()
        if server.engine_gone:
            return 1
        return 0 if server.started else 1
    finally:
        engine_process.stop(engine)
        addresses.remove()


def check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise SystemExit(f"parley: cannot listen on {host}:{port}: {e.strerror or e}") from e
