"""ParleyServer: uvicorn, one worker, with a graceful drain on SIGTERM (and on the first Ctrl-C).

uvicorn on its own closes at once on SIGTERM. Parley instead stops admitting (new requests get 503 in OpenAI's
shape, /health turns 503 so that the load balancer looks elsewhere), lets every admitted request finish and every
stream be written to its end, and only then tells uvicorn to exit; the process exits 0. A second signal forces
the exit.

With `--engine-process` the engine runs in a process of its own (service/engine_process.py), started here before
uvicorn; the drain goes through it (Drain, then its heartbeat read until nothing runs), and it is stopped last. When
it dies, every stream ends in an error, /health says why (503) for ENGINE_GONE_GRACE_S, and the server exits 1: an
orchestrator restarts the whole server. It dies with this process (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from service.api.app import MAX_BODY_BYTES, create_app
from service.api.auth import ApiKeyError, ApiKeys, announce, install_log_filters, reload_on_sighup
from service.api.engine_client import EngineClient
from service.api.loop_lag import watch_loop_lag
from service.api.state import ServerState, server_state
from service.config import ServeConfig, engine_in_own_process, front_end_count
from service.runtime import build_engine, settle_process

if TYPE_CHECKING:
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
        self._lag_watch: asyncio.Task[None] | None = None  # service/api/loop_lag.py, from startup on

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
            self._drain_process(client)
        rt = self.state.runtime
        if rt is not None:
            engine = rt.engine
            engine.accepting = False
            s = engine.stats
            log.info("draining: no new requests; waiting for %d running and %d waiting (at most %.0f s)",
                     s.running, s.waiting, self.drain_timeout_s)
            t0 = time.monotonic()
            done = engine.drain(self.drain_timeout_s)
            self.state.wait_streams(STREAMS_GRACE_S)
            if done:
                log.info("drained in %.1f s", time.monotonic() - t0)
            else:
                log.warning("drain timed out after %.0f s; exiting with requests in flight", self.drain_timeout_s)
        self.should_exit = True

    def _drain_process(self, client: EngineClient) -> None:
        """The drain, the engine being in a process of its own: stop it admitting, then read its heartbeat."""
        client.drain()
        s = client.status
        log.info("draining: no new requests; waiting for %d running and %d waiting (at most %.0f s)",
                 s.running if s else 0, s.waiting if s else 0, self.drain_timeout_s)
        t0 = time.monotonic()
        end = t0 + self.drain_timeout_s
        time.sleep(0.1)  # a heartbeat sent after the Drain: before it, `accepting` may still read true
        while not client.drained() and time.monotonic() < end:
            time.sleep(0.01)
        done = client.drained()
        self.state.wait_streams(STREAMS_GRACE_S)
        if done:
            log.info("drained in %.1f s", time.monotonic() - t0)
        else:
            log.warning("drain timed out after %.0f s; exiting with requests in flight", self.drain_timeout_s)

    def on_engine_gone(self, why: str) -> None:
        """The engine process died (on the event loop): exit after the grace, whatever is still open."""
        self.engine_gone = True

        def leave() -> None:
            self.should_exit = True

        asyncio.get_running_loop().call_later(ENGINE_GONE_GRACE_S, leave)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        rt, client = self.state.runtime, self.state.client
        c = self.config
        if self.started and rt is not None:
            log.info("Parley listening on http://%s:%d — model %s, backend %s, device %s, %d slots, context %d",
                     c.host, c.port, rt.model_id, rt.backend, rt.device, rt.config.max_batch,
                     self.state.max_context)
        if self.started and client is not None:
            gc.collect()
            gc.freeze()  # what start-up allocated stays out of every later collection's scan
            i = client.info
            log.info("Parley listening on http://%s:%d — model %s, backend %s, device %s, %d slots, context %d "
                     "(engine process %d)", c.host, c.port, i.model_id, i.backend, i.device, i.max_batch,
                     i.max_context, i.pid)
        if self.started:
            self._lag_watch = asyncio.get_running_loop().create_task(watch_loop_lag(self.state.metrics.loop_lag))
            # uvicorn's "auto" takes uvloop and httptools (dependencies): with the engine in a process of its own,
            # httptools took the H100 host's way from a request's arrival to the engine from 1.15-1.23 ms to 0.90-0.92
            # and its first token from 3.2 to 3.0-3.1 ms (bench/NOTES.md, s86). The log says which ran.
            log.info("event loop %s, HTTP parser %s", type(asyncio.get_running_loop()).__module__.split(".")[0],
                     getattr(c.http_protocol_class, "__name__", c.http))


def serve(cfg: ServeConfig) -> int:
    """Run `parley serve` until SIGTERM/SIGINT; the exit status."""
    check_port(cfg.host, cfg.port)  # before minutes of loading, not after
    try:
        keys = ApiKeys.from_config(cfg)
    except ApiKeyError as e:
        raise SystemExit(f"parley: {e}") from None
    install_log_filters()
    announce(keys, cfg.host, cfg.port)
    reload_on_sighup(keys)
    log.info("loading %s (backend %s) for http://%s:%d ...", cfg.model, cfg.backend, cfg.host, cfg.port)
    cfg = cfg.model_copy(update={"api_workers": front_end_count(cfg)})  # settled here: every process reads it as set
    if engine_in_own_process(cfg):
        return serve_with_engine_process(cfg, keys)
    app = create_app(lambda: settle_process(build_engine(cfg)), api_keys=keys)
    state = server_state(app)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, workers=1, lifespan="on", log_config=None,
                            log_level=cfg.log_level, access_log=cfg.access_log, ws_max_size=WS_MAX_BYTES,
                            timeout_graceful_shutdown=None)
    server = ParleyServer(config, state, cfg.drain_timeout_s)
    server.run()
    if state.runtime is not None:  # the lifespan stops it; a forced exit skips the lifespan
        state.runtime.engine.stop()
    return 0 if server.started else 1


def serve_with_engine_process(cfg: ServeConfig, keys: ApiKeys) -> int:
    """`parley serve --engine-process`: the engine process, started first (it loads and warms while uvicorn waits in
    its lifespan for Ready), this process the front end; the engine process stopped last, however this ends. With
    `--api-workers` over 1, this process supervises that many front-end processes instead (front_ends.py)."""
    from service import engine_process  # zmq and the process's own imports: only in this mode
    from service.engine import ipc

    if front_end_count(cfg) > 1:
        from service.api.front_ends import serve_with_front_ends

        return serve_with_front_ends(cfg)
    addresses = ipc.Addresses.fresh()
    proc = engine_process.spawn(cfg, addresses)
    try:
        return run_front_end(cfg, keys, addresses, lambda: exit_status(proc), engine_pid=proc.pid)
    finally:
        engine_process.stop(proc)
        addresses.remove()


def run_front_end(cfg: ServeConfig, keys: ApiKeys, addresses: ipc.Addresses,
                  engine_exit: Callable[[], int | str | None], front_end: int = 0,
                  sockets: list[socket.socket] | None = None, engine_pid: int | None = None) -> int:
    """Serve HTTP and the realtime WebSocket as front end `front_end` of `cfg.api_workers`, on `sockets` (already
    listening; None: bind --host/--port), with the engine process at `addresses` (`engine_exit`: its exit status, or
    why it is gone, None while it runs; `engine_pid`: its process, whose exit a pidfd tells at once) until SIGTERM
    drains it or the engine dies; the exit status."""
    server: ParleyServer | None = None

    async def connect() -> EngineClient:
        client = await EngineClient.connect(addresses, exit_code=engine_exit, front_end=front_end,
                                            front_ends=front_end_count(cfg), engine_pid=engine_pid)
        assert server is not None
        client.on_dead.append(server.on_engine_gone)
        return client

    app = create_app(api_keys=keys, connect=connect)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, workers=1, lifespan="on", log_config=None,
                            log_level=cfg.log_level, access_log=cfg.access_log, ws_max_size=WS_MAX_BYTES,
                            timeout_graceful_shutdown=None)
    server = ParleyServer(config, server_state(app), cfg.drain_timeout_s)
    server.run(sockets=sockets)
    if server.engine_gone:
        return 1
    return 0 if server.started else 1


def exit_status(proc: subprocess.Popen[bytes]) -> int | None:
    return proc.poll()


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (SO_REUSEADDR), or SystemExit saying why it cannot be."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise SystemExit(f"parley: cannot listen on {host}:{port}: {e.strerror or e}") from e
    return s


def check_port(host: str, port: int) -> None:
    bound_socket(host, port).close()
