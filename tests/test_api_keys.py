"""API keys (service/api/auth.py), as a user checks them against a real `parley serve` (the tiny synthetic model, a key
on the command line and a file of keys): every route but /health and /metrics refuses a missing or wrong key with a
401 in OpenAI's shape before any work, the realtime WebSocket at its handshake (header or browser subprotocol), the
openai SDK and parley-loadtest get in with the right key, a key rotated in the file takes effect on SIGHUP, refusals
are counted on /metrics by reason, and no key ever reaches the log or /metrics. Then the pieces on their own: the
start-up line, the key store's checks and errors."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.routing import APIRoute, APIWebSocketRoute
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from loadtest.cli import main as loadtest
from service.api.app import create_app
from service.api.auth import ApiKeys, RedactKeys, announce, is_loopback, presented_keys
from service.api.realtime import accepted_subprotocol
from tests.server_support import (
    Scrape,
    Server,
    assert_openai_error,
    free_port,
    poll,
    recv_event,
    scrape_metrics,
    served,
    tiny_server,
)

pytestmark = pytest.mark.slow

# Keys as `python -c "import secrets; print('sk-' + secrets.token_urlsafe(24))"` makes them; each run its own.
FIXED = "sk-fixed-" + secrets.token_urlsafe(16)  # --api-key: valid for the server's life
OLD = "sk-old-" + secrets.token_urlsafe(16)  # --api-key-file, until rotated
NEW = "sk-new-" + secrets.token_urlsafe(16)  # --api-key-file, after
WRONG = "sk-wrong-" + secrets.token_urlsafe(16)
OPEN_PATHS = {"/health", "/metrics"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(f"# the agents' keys, one a line\n{OLD}\n")
    return path


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, key_file: Path) -> Iterator[Server]:
    """A server that asks for a key: FIXED, and those of the file (OLD); everything logged (debug, access log), so
    that a key that reached a log line would be seen."""
    yield from served(tiny_server(tmp_path_factory.mktemp("keyed") / "parley.log", "--api-key", FIXED,
                                  "--api-key-file", str(key_file), "--log-level", "debug", "--access-log"))


def routes() -> list[tuple[str, str]]:
    """Every (method, path) the app serves, read off the app itself so that a route added later is checked too
    (a path parameter filled in)."""
    app = create_app(lambda: None)  # the routes only: the runtime is built in the lifespan, which never runs here
    out = []
    todo = list(app.routes)
    while todo:
        r = todo.pop(0)
        included = getattr(r, "original_router", None)  # an included APIRouter (FastAPI's wrapper of it)
        if included is not None:
            todo += included.routes
            continue
        path = r.path.replace("{model_id:path}", "synthetic:tiny")
        if isinstance(r, APIWebSocketRoute):
            out.append(("WS", path))
        elif isinstance(r, APIRoute) or hasattr(r, "methods"):
            out += [(m, path) for m in sorted(r.methods or ()) if m != "HEAD"]
    return out


def refusals(server: Server) -> dict[tuple[str, str], float]:
    m = scrape_metrics(server.base)
    return {(r, t): m.total("parley_api_key_refusals_total", reason=r, transport=t)
            for r in ("missing", "invalid") for t in ("http", "websocket")}


def assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 401, (r.request.method, r.request.url.path, r.status_code, r.text)
    assert r.headers["www-authenticate"] == "Bearer"
    assert_openai_error(r.json(), code="invalid_api_key", param=None, type="invalid_request_error")


# -- HTTP ---------------------------------------------------------------------------------------------------------
def test_every_route_but_health_and_metrics_refuses_a_missing_or_wrong_key(keyed: Server) -> None:
    served_routes = routes()
    http = [(m, p) for m, p in served_routes if m != "WS" and p not in OPEN_PATHS]
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
            ("GET", "/v1/latency_model"), ("GET", "/v1/realtime")} <= set(http), served_routes
    assert ("WS", "/v1/realtime") in served_routes
    before = refusals(keyed)
    with httpx.Client(base_url=keyed.base, timeout=30) as client:
        for method, path in [*http, ("GET", "/v1/no-such-route")]:
            assert_refused(client.request(method, path, json={"prompt": "hi"}))
            assert_refused(client.request(method, path, json={"prompt": "hi"}, headers=bearer(WRONG)))
            assert_refused(client.request(method, path, headers={"Authorization": f"Basic {FIXED}"}))
        # the right key gets through: what the route answers, not a 401
        assert client.get("/v1/models", headers=bearer(FIXED)).status_code == 200
        assert client.get("/v1/models", headers=bearer(OLD)).status_code == 200
        assert client.get("/v1/models", headers={"Authorization": f"bearer {FIXED}"}).status_code == 200
        assert client.get("/v1/latency_model", headers=bearer(FIXED)).status_code == 200
        assert client.get("/v1/realtime", headers=bearer(FIXED)).status_code == 426
        assert client.get("/v1/no-such-route", headers=bearer(FIXED)).status_code == 404
        assert client.get("/openapi.json", headers=bearer(FIXED)).status_code == 200
        for path in OPEN_PATHS:
            assert client.get(path).status_code == 200, path
    after = refusals(keyed)
    n = len(http) + 1
    assert after[("missing", "http")] - before[("missing", "http")] == n
    assert after[("invalid", "http")] - before[("invalid", "http")] == 2 * n
    assert after[("missing", "websocket")] == before[("missing", "websocket")]


def test_a_refused_call_does_no_work(keyed: Server) -> None:
    """Refused before the body is read or anything submitted: a 2 MiB body gets the 401, not the 413, and a refused
    completion leaves the engine's counters where they were."""
    before = scrape_metrics(keyed.base)
    with httpx.Client(base_url=keyed.base, timeout=60) as client:
        assert_refused(client.post("/v1/completions", content=b"x" * (2 << 20),
                                   headers={"Content-Type": "application/json"}))
        for _ in range(3):
            assert_refused(client.post("/v1/completions", headers=bearer(WRONG),
                                       json={"prompt": "Once upon a time", "max_tokens": 4}))
        ok = client.post("/v1/completions", headers=bearer(FIXED),
                         json={"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True})
        assert ok.status_code == 200, ok.text
    after = scrape_metrics(keyed.base)
    assert after.requests("completed") - before.requests("completed") == 1
    assert after.requests("rejected") == before.requests("rejected")
    assert after["parley_prompt_tokens_total"] - before["parley_prompt_tokens_total"] == \
        ok.json()["usage"]["prompt_tokens"]


def test_the_openai_sdk_with_the_right_key_and_a_wrong_one(keyed: Server) -> None:
    client = openai.OpenAI(base_url=f"{keyed.base}/v1", api_key=FIXED, timeout=60)  # default retries
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                            max_tokens=4, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    reply = client.completions.create(model=model, prompt="Hi", max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1

    before = refusals(keyed)
    wrong = openai.OpenAI(base_url=f"{keyed.base}/v1", api_key=WRONG, timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}], max_tokens=4)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    assert WRONG not in str(refused.value)
    # the SDK does not retry a 401: one refusal
    assert refusals(keyed)[("invalid", "http")] - before[("invalid", "http")] == 1


# -- the WebSocket ------------------------------------------------------------------------------------------------
async def _refused_handshake(url: str, **kwargs: object) -> dict:
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url, **kwargs):
            pass
    response = refused.value.response
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    return json.loads(bytes(response.body or b""))


async def _one_turn(url: str, **kwargs: object) -> tuple[str | None, dict]:
    async with connect(url, **kwargs) as ws:
        assert (await recv_event(ws))["type"] == "session.created"
        await ws.send(json.dumps({"type": "response.create", "response": {
            "input": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "ignore_eos": True}}))
        while (event := await recv_event(ws))["type"] != "response.done":
            assert event["type"] != "error", event
        return ws.subprotocol, event["response"]


def test_the_websocket_is_refused_at_its_handshake_without_the_right_key(keyed: Server) -> None:
    async def check() -> None:
        before = refusals(keyed)
        for kwargs in ({}, {"additional_headers": bearer(WRONG)},
                       {"subprotocols": ["realtime", f"openai-insecure-api-key.{WRONG}"]},
                       {"subprotocols": ["realtime"]}):
            body = await _refused_handshake(keyed.ws, **kwargs)
            assert_openai_error(body, code="invalid_api_key", param=None)
            assert "openai-insecure-api-key.<key>" in body["error"]["message"] and WRONG not in json.dumps(body)
        after = refusals(keyed)
        assert after[("missing", "websocket")] - before[("missing", "websocket")] == 2
        assert after[("invalid", "websocket")] - before[("invalid", "websocket")] == 2

        # the header, as a server-side client sends it
        protocol, response = await _one_turn(keyed.ws, additional_headers=bearer(FIXED))
        assert protocol is None and response["status"] == "incomplete"
        # a browser's subprotocols, as OpenAI's realtime clients send them: `realtime` is answered, the key never
        protocol, response = await _one_turn(
            keyed.ws, subprotocols=["realtime", f"openai-insecure-api-key.{OLD}", "openai-beta.realtime-v1"])
        assert protocol == "realtime" and response["status"] == "incomplete"
        protocol, _ = await _one_turn(keyed.ws, subprotocols=[f"openai-insecure-api-key.{FIXED}"])
        assert protocol is None

    asyncio.run(check())
    # a refusal is the client's answer, not the server's fault: no ERROR line for it (uvicorn's websockets-sansio
    # protocol logs one after every denial response)
    assert "without completing handshake" not in keyed.log.read_text(errors="replace")


# -- parley-loadtest ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint", ["chat", "realtime"])
def test_parley_loadtest_sends_the_key(tmp_path: Path, keyed: Server, monkeypatch: pytest.MonkeyPatch,
                                       endpoint: str) -> None:
    args = ["--url", keyed.base, "--quiet", "--warmup", "0", "--num-requests", "2", "--input-len", "4",
            "--output-len", "3", "--timeout", "60", "--endpoint", endpoint]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit, match="refused the API key"):
        loadtest(args)
    monkeypatch.setenv("OPENAI_API_KEY", FIXED)  # as the openai SDK reads it
    out = tmp_path / f"{endpoint}.json"
    assert loadtest([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["outcome"] for r in doc["runs"][0]["requests"]] == ["ok", "ok"]
    assert FIXED not in out.read_text()  # the report keeps no key
    monkeypatch.delenv("OPENAI_API_KEY")
    assert loadtest([*args, "--api-key", OLD, "--json", str(out)]) == 0
    assert [r["outcome"] for r in json.loads(out.read_text())["runs"][0]["requests"]] == ["ok", "ok"]


# -- rotation -----------------------------------------------------------------------------------------------------
def _status(server: Server, key: str) -> int:
    return httpx.get(f"{server.base}/v1/models", headers=bearer(key), timeout=30).status_code


def test_a_key_rotated_in_the_file_takes_effect_on_sighup(keyed: Server, key_file: Path) -> None:
    assert (_status(keyed, OLD), _status(keyed, NEW)) == (200, 401)
    key_file.write_text(f"{NEW}\n")
    assert (_status(keyed, OLD), _status(keyed, NEW)) == (200, 401), "the file is read again on SIGHUP only"
    os.kill(keyed.proc.pid, signal.SIGHUP)
    poll(lambda: (_status(keyed, OLD), _status(keyed, NEW)), lambda s: s == (401, 200), 30, "the rotated key")
    assert _status(keyed, FIXED) == 200  # --api-key's key stays

    # a rotation gone wrong (an empty file) changes nothing: the server is neither opened nor locked
    key_file.write_text("\n# nothing yet\n")
    os.kill(keyed.proc.pid, signal.SIGHUP)
    poll(lambda: "holds no key" in keyed.log.read_text(), bool, 30, "the refused reload logged")
    assert (_status(keyed, NEW), _status(keyed, WRONG)) == (200, 401)
    assert keyed.proc.poll() is None and keyed.health() == 200  # SIGHUP's default would have ended it
    assert "API key required on every route but /health and /metrics: 2 key(s)" in keyed.log.read_text()


def test_no_key_reaches_the_log_or_the_metrics(keyed: Server) -> None:
    """Last in the module: after every call above (debug logging, the access log), no key in any line."""
    text = keyed.log.read_text(errors="replace") + httpx.get(f"{keyed.base}/metrics", timeout=30).text
    assert "refused http /v1/completions: invalid API key" in text  # the debug lines are there...
    for key in (FIXED, OLD, NEW, WRONG):
        assert key not in text  # ...but no key
        assert key.split("-", 2)[2] not in text


# -- the pieces -----------------------------------------------------------------------------------------------------
def test_only_a_refused_handshake_loses_uvicorns_unfinished_handshake_error() -> None:
    """The ERROR uvicorn logs when an app returns without finishing a handshake is dropped for a connection the key
    check answered with a 401, and kept for any other: there it is a real fault."""
    import contextvars

    from service.api import auth

    def record(msg: str, name: str = "uvicorn.error") -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, None, None)

    quiet = auth.QuietDeniedHandshakes()
    unfinished = "ASGI callable returned without completing handshake."
    assert quiet.filter(record(unfinished))  # an app that forgot to accept: logged

    def refused() -> list[bool]:
        auth._denied_handshake.set(True)
        return [quiet.filter(record(unfinished)), quiet.filter(record("Exception in ASGI application\n")),
                quiet.filter(record(unfinished, name="parley.api"))]

    assert contextvars.copy_context().run(refused) == [False, True, True]
    assert quiet.filter(record(unfinished))  # the refusal's context stays its own connection's


def test_one_start_up_line_says_who_may_call(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.INFO, logger="parley.auth")
    announce(ApiKeys(), "127.0.0.1", 8000)
    announce(ApiKeys(), "localhost", 8000)
    announce(ApiKeys(), "::1", 8000)
    assert caplog.records == []  # on loopback, as before
    announce(ApiKeys(), "0.0.0.0", 8000)
    [line] = caplog.records
    assert line.levelno == logging.WARNING
    assert line.getMessage() == ("no API key: anyone who can reach 0.0.0.0:8000 can use the model (set --api-key or "
                                 "PARLEY_API_KEY)")
    caplog.clear()
    announce(ApiKeys([FIXED, OLD]), "0.0.0.0", 8000)
    [line] = caplog.records
    assert line.levelno == logging.INFO and "2 key(s)" in line.getMessage() and FIXED not in line.getMessage()
    assert [is_loopback(h) for h in ("127.0.0.2", "[::1]", "LOCALHOST", "10.0.0.5", "::", "parley.example.com")] == \
        [True, True, True, False, False, False]


def test_the_key_store(tmp_path: Path) -> None:
    keys = ApiKeys.from_settings(f" {FIXED} ,{OLD}", None)
    assert keys.required and len(keys) == 2
    assert keys.verdict([FIXED.encode()]) == keys.verdict([OLD.encode()]) == "ok"
    assert keys.verdict([]) == "missing" and keys.verdict([WRONG.encode(), b""]) == "invalid"
    assert keys.verdict([WRONG.encode(), OLD.encode()]) == "ok"
    assert keys.verdict([FIXED[:-1].encode()]) == keys.verdict([(FIXED + "x").encode()]) == "invalid"
    assert not ApiKeys.from_settings(None, None).required

    def scope(*headers: tuple[bytes, bytes], subprotocols: tuple[str, ...] = ()) -> dict:
        return {"type": "websocket" if subprotocols else "http", "headers": list(headers),
                "subprotocols": list(subprotocols)}

    redact = RedactKeys()
    for message, args, shown in [
            ("< %s: %s", ("authorization", f"Bearer {FIXED}"), "< authorization: <redacted>"),
            ("< %s: %s", ("Authorization", f"Basic {FIXED}"), "< Authorization: <redacted>"),
            ("< %s: %s", ("sec-websocket-protocol", f"realtime, openai-insecure-api-key.{FIXED}, x"),
             "< sec-websocket-protocol: realtime, openai-insecure-api-key.<redacted>, x"),
            ("headers %r", ([(b"authorization", f"Bearer {FIXED}".encode())],),
             "headers [(b'authorization', b'Bearer <redacted>')]"),
            ("a basic setup: %d slots", (8,), "a basic setup: 8 slots")]:
        record = logging.LogRecord("uvicorn.error", logging.DEBUG, __file__, 1, message, args, None)
        assert redact.filter(record) and record.getMessage() == shown

    assert presented_keys(scope((b"authorization", b"Bearer  k1 "))) == [b"k1"]
    assert presented_keys(scope((b"authorization", b""), (b"authorization", b"Bearer"))) == []
    assert presented_keys(scope((b"authorization", b"Basic abc"))) == [b"Basic abc"]
    assert presented_keys(scope(subprotocols=("realtime", "openai-insecure-api-key.k2"))) == [b"k2"]
    assert accepted_subprotocol(["openai-insecure-api-key.k2", "realtime"]) == "realtime"
    assert accepted_subprotocol(["openai-insecure-api-key.k2"]) is None
    assert accepted_subprotocol([]) is None


def test_variables_set_empty_ask_for_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """docker-compose.yml passes PARLEY_API_KEY and PARLEY_API_KEY_FILE on empty where the user set neither."""
    from service.cli import parse

    monkeypatch.setenv("PARLEY_API_KEY", "")
    monkeypatch.setenv("PARLEY_API_KEY_FILE", "")
    assert not ApiKeys.from_config(parse(["serve"])).required
    monkeypatch.setenv("PARLEY_API_KEY", f"{FIXED},{OLD}")
    cfg = parse(["serve"])
    assert len(ApiKeys.from_config(cfg)) == 2 and FIXED not in repr(cfg) and FIXED not in str(cfg)


@pytest.mark.parametrize("api_key,file_text,says", [
    ("sk-a,,sk-b", None, "--api-key (PARLEY_API_KEY): an empty key between commas"),
    ("sk-a b", None, "--api-key (PARLEY_API_KEY): key 1 holds a space"),
    ("sk-a,sk-é", None, "--api-key (PARLEY_API_KEY): key 2 holds a space or a character outside printable ASCII"),
    (None, "", "holds no key"),
    (None, "# only a comment\n\n", "holds no key"),
    (None, "sk-ok\nsk bad\n", "key 2 holds a space"),
    (None, None, "cannot be read (FileNotFoundError"),
])
def test_keys_that_cannot_be_used_stop_the_start_naming_where_not_the_key(tmp_path: Path, api_key: str | None,
                                                                          file_text: str | None, says: str) -> None:
    from service.api.server import serve
    from service.config import ServeConfig

    file = tmp_path / "keys"
    if file_text is not None:
        file.write_text(file_text)
    cfg = ServeConfig(api_key=api_key, api_key_file=None if api_key else str(file), port=free_port())
    with pytest.raises(SystemExit) as stopped:
        serve(cfg)  # before anything is loaded or listens
    message = str(stopped.value.code)
    assert message.startswith("parley: ") and says in message, message
    assert "sk-a" not in message and "sk-b" not in message and "sk-ok" not in message


def test_without_a_key_every_route_is_open_as_before(shared_server: Server) -> None:
    """A server started without a key (conftest's, on loopback) asks for none, and counts nothing."""
    r = httpx.get(f"{shared_server.base}/v1/models", headers=bearer(WRONG), timeout=30)
    assert r.status_code == 200
    m: Scrape = scrape_metrics(shared_server.base)
    assert m.total("parley_api_key_refusals_total") == 0
