"""API keys: who may call the model.

`--api-key` (one key, or several comma-separated) and `--api-key-file` (one a line, re-read on SIGHUP, so that a key
is rotated without a restart) set the keys. With a key set, every route but /health and /metrics (probes, Prometheus)
refuses a caller without a valid one: HTTP gets 401 in OpenAI's shape (code `invalid_api_key`) before the request
reaches the app (no body read, no route run, nothing submitted), and the WebSocket is refused at its handshake (an
HTTP 401, the socket never accepted). A caller sends its key as `Authorization: Bearer <key>` (the `openai` SDK's
`api_key`, Pipecat's and LiveKit's `api_key=`), or, on the WebSocket from a browser (which cannot set headers), as
the subprotocol `openai-insecure-api-key.<key>`, as OpenAI's realtime API takes it.

Keys are held as SHA-256 digests and a presented key's digest is compared with every one of them by
hmac.compare_digest, without stopping at a match: the time a check takes tells nothing of a key, not even its length.
No key appears in a log line, a metric or an error message. The check is the front end's (an ASGI middleware of the
HTTP app): wherever the engine runs, a refused caller never reaches it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import signal
import threading
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from pathlib import Path
from typing import Literal

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from service.api.errors import APIError
from service.config import ServeConfig

log = logging.getLogger("parley.auth")

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and Prometheus: never asked for a key
KEY_SUBPROTOCOL = "openai-insecure-api-key."  # a browser's realtime WebSocket carries its key in a subprotocol
# What a WebSocket subprotocol may hold (RFC 6455: an HTTP token, RFC 7230's tchar): a key with any other character
# works in the Authorization header but a browser cannot send it as a subprotocol.
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")

Verdict = Literal["ok", "missing", "invalid"]


class ApiKeyError(ValueError):
    """Keys that cannot be used: a file that cannot be read or holds no key, a key with a character no header can
    carry. The message names where, never a key."""


class ApiKeys:
    """The keys a caller may present: those of --api-key, fixed for the process's life, and those of --api-key-file,
    read again by `reload` (SIGHUP). None at all: no key is asked."""

    def __init__(self, keys: Iterable[str] = (), file: Path | None = None) -> None:
        given = list(keys)
        _check(given, "--api-key (PARLEY_API_KEY)")
        self.file = file
        self._fixed = tuple(_digest(k) for k in given)
        self._digests = self._fixed
        self._fixed_unsendable = _unsendable(given)
        self.unsendable_as_subprotocol = self._fixed_unsendable  # keys a browser cannot send (logged, not refused)
        if file is not None:
            self.reload()

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> ApiKeys:
        """--api-key and --api-key-file of `parley serve`."""
        return cls.from_settings(cfg.api_key.get_secret_value() if cfg.api_key is not None else None,
                                 cfg.api_key_file)

    @classmethod
    def from_settings(cls, api_key: str | None, api_key_file: str | None) -> ApiKeys:
        """From --api-key's value (comma-separated) and --api-key-file's path; empty values count as unset (a compose
        file passes an unset variable on as empty)."""
        keys = [k.strip() for k in (api_key or "").split(",")] if api_key and api_key.strip() else []
        if any(not k for k in keys):
            raise ApiKeyError("--api-key (PARLEY_API_KEY): an empty key between commas")
        return cls(keys, Path(api_key_file) if api_key_file and api_key_file.strip() else None)

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def reload(self) -> int:
        """Read --api-key-file again: its keys replace the file's earlier ones (--api-key's stay); how many keys are
        valid now. A file that cannot be read or holds no key raises ApiKeyError and changes nothing, so that a
        rotation gone wrong neither opens the server nor locks every caller out."""
        if self.file is None:
            return len(self)
        where = f"--api-key-file {self.file}"
        try:
            text = self.file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ApiKeyError(f"{where}: cannot be read ({type(e).__name__}: "
                              f"{getattr(e, 'strerror', None) or 'not UTF-8'})") from None
        keys = [line.strip() for line in text.splitlines()]
        keys = [k for k in keys if k and not k.startswith("#")]
        if not keys:
            raise ApiKeyError(f"{where}: holds no key (one a line; # starts a comment)")
        _check(keys, where)
        self.unsendable_as_subprotocol = self._fixed_unsendable + _unsendable(keys)
        self._digests = self._fixed + tuple(_digest(k) for k in keys)  # one assignment: a check sees old or new
        return len(self)

    def matches(self, key: bytes) -> bool:
        """Whether `key` is one of the keys: compared in constant time with every one of them."""
        presented = hashlib.sha256(key).digest()
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(presented, digest)
        return found

    def verdict(self, presented: list[bytes]) -> Verdict:
        """ok when a presented key is valid; else missing (none presented) or invalid."""
        if not presented:
            return "missing"
        return "ok" if any([self.matches(k) for k in presented]) else "invalid"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("ascii")).digest()


def _unsendable(keys: list[str]) -> int:
    return sum(1 for k in keys if not set(k) <= _TOKEN_CHARS)


def _check(keys: list[str], where: str) -> None:
    for i, key in enumerate(keys, 1):
        if not all("!" <= c <= "~" for c in key):
            raise ApiKeyError(f"{where}: key {i} holds a space or a character outside printable ASCII, which an "
                              "Authorization header cannot carry")


def presented_keys(scope: Scope) -> list[bytes]:
    """The keys a request presents: each `Authorization` header's (a Bearer token; any other scheme counts as a wrong
    key, an empty value as none), and on a WebSocket the `openai-insecure-api-key.<key>` subprotocols'."""
    keys: list[bytes] = []
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            key = token.strip() if scheme.lower() == b"bearer" else value.strip()
            if key:
                keys.append(key)
    if scope["type"] == "websocket":
        keys += [p[len(KEY_SUBPROTOCOL):].encode("utf-8", "replace") for p in scope.get("subprotocols", [])
                 if p.startswith(KEY_SUBPROTOCOL)]
    return keys


def refusal(verdict: Verdict, transport: str) -> APIError:
    """The 401 for a caller without a valid key, in OpenAI's shape; it quotes no key."""
    how = "as `Authorization: Bearer <key>`"
    if transport == "websocket":
        how += " or as the WebSocket subprotocol `openai-insecure-api-key.<key>`"
    message = ("this server requires an API key: send it " + how if verdict == "missing"
               else "incorrect API key provided: send one of this server's keys " + how)
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


RefusalCounter = Callable[[Verdict, str], None]  # (reason, transport)


class RequireApiKey:
    """Pure ASGI middleware, outermost: a call without a valid key is answered here, before the body limit, the
    routing and any body is read; a WebSocket before it is accepted. /health and /metrics pass."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, count_refusal: RefusalCounter) -> None:
        self.app, self.keys, self.count_refusal = app, keys, count_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = scope["type"]
        if transport not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        verdict = self.keys.verdict(presented_keys(scope))
        if verdict == "ok":
            await self.app(scope, receive, send)
            return
        self.count_refusal(verdict, transport)
        log.debug("refused %s %s: %s API key", transport, scope["path"], verdict)
        error = refusal(verdict, transport)
        if transport == "http":
            response = error.response()
            if _has_body(scope):  # unread: the connection cannot carry another request
                response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        ws = WebSocket(scope, receive, send)
        if "websocket.http.response" in scope.get("extensions", {}):
            _denied_handshake.set(True)
            await ws.send_denial_response(error.response())  # an HTTP 401 with the error as its body
        else:
            await ws.close(code=1008)  # policy violation: a server without the extension answers 403


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


def reload_on_sighup(keys: ApiKeys) -> None:
    """SIGHUP re-reads --api-key-file (off the signal handler, on a thread of its own); without one it is logged and
    ignored (SIGHUP's default would end the process). Call from the main thread."""

    def reload() -> None:
        if keys.file is None:
            log.info("SIGHUP: no --api-key-file to read again; the keys stay as they are")
            return
        try:
            n = keys.reload()
        except ApiKeyError as e:
            log.error("SIGHUP: %s; the %d key(s) in force stay", e, len(keys))
            return
        log.info("SIGHUP: read %s again: %d key(s) valid now", keys.file, n)
        if keys.unsendable_as_subprotocol:
            log.warning(_UNSENDABLE, keys.unsendable_as_subprotocol)

    signal.signal(signal.SIGHUP, lambda signum, frame: threading.Thread(
        target=reload, name="parley-api-keys", daemon=True).start())


_UNSENDABLE = ("%d API key(s) hold a character other than letters, digits and !#$%%&'*+-.^_`|~: a browser cannot "
               "send such a key as a WebSocket subprotocol (the Authorization header can)")


class RedactKeys(logging.Filter):
    """Keys out of every log line: at --log-level debug the WebSocket layer (the websockets library, logging as
    uvicorn.error) prints every handshake header, Authorization and Sec-WebSocket-Protocol included. An
    `Authorization:` header's value, a bearer token and a key subprotocol become `<redacted>`; the rest stays."""

    _SECRET = re.compile(r"(?i)(\bauthorization:\s*)[^\r\n]+|(\bbearer\s+|openai-insecure-api-key\.)[^\s,;'\"]+")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = self._SECRET.sub(lambda m: (m.group(1) or m.group(2)) + "<redacted>", message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


# Set in the connection's task when its handshake was answered with a 401: uvicorn's websockets-sansio protocol then
# logs that the app "returned without completing handshake" (uvicorn PR #3138, open), an ERROR on every refused key.
_denied_handshake: ContextVar[bool] = ContextVar("parley_denied_handshake", default=False)
_UNFINISHED_HANDSHAKE = "ASGI callable returned without completing handshake."


class QuietDeniedHandshakes(logging.Filter):
    """Drops uvicorn's handshake ERROR for a WebSocket this middleware refused with a 401 (the client got its answer;
    the refusal is counted and logged at debug); the same line for any other connection stays, a real fault."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "uvicorn.error" and record.msg == _UNFINISHED_HANDSHAKE and _denied_handshake.get())


def install_log_filters() -> None:
    """RedactKeys and QuietDeniedHandshakes on every handler of the root logger (where uvicorn's loggers and
    Parley's end up): a filter on a handler sees the records of every logger under it."""
    for handler in logging.getLogger().handlers:
        for kind in (RedactKeys, QuietDeniedHandshakes):
            if not any(isinstance(f, kind) for f in handler.filters):
                handler.addFilter(kind())


def announce(keys: ApiKeys, host: str, port: int) -> None:
    """One line at start-up on who may call: the number of keys (never a key), or, with none and an address other
    machines can reach, that anyone there can use the model."""
    if keys.required:
        source = f"; {keys.file} is read again on SIGHUP" if keys.file is not None else ""
        log.info("API key required on every route but /health and /metrics: %d key(s)%s", len(keys), source)
        if keys.unsendable_as_subprotocol:
            log.warning(_UNSENDABLE, keys.unsendable_as_subprotocol)
    elif not is_loopback(host):
        log.warning("no API key: anyone who can reach %s:%d can use the model (set --api-key or PARLEY_API_KEY)",
                    host, port)


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: it may well resolve to a public address
        return False
