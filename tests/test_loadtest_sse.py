"""The loadtest reads an event stream's lines where the SSE specification ends them (CRLF, LF, CR) and nowhere else:
a server whose JSON leaves U+2028, U+2029 or U+0085 raw (pydantic and serde write them so) must not have its reply
counted as failed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from aiohttp import web
from aiohttp.test_utils import TestServer

from loadtest.clients import ClientPool, Target, http_turn
from loadtest.record import RequestRecord
from loadtest.sse import event_lines

BREAKS = "a\u2028b\u0085c\u2029d"


async def chunked(*parts: bytes) -> AsyncIterator[bytes]:
    for p in parts:
        yield p


def lines_of(*parts: bytes) -> list[str]:
    async def collect() -> list[str]:
        return [line async for line in event_lines(chunked(*parts))]
    return asyncio.run(collect())


def test_lines_end_at_crlf_lf_and_cr_only_wherever_the_chunks_break() -> None:
    data = f'data: {{"t": "{BREAKS}"}}'.encode()
    stream = data + b"\r\n\r\n" + data + b"\n\n" + data + b"\r\rdata: [DONE]"
    want = [data.decode(), "", data.decode(), "", data.decode(), "", "data: [DONE]"]
    assert lines_of(stream) == want
    for cut in range(1, len(stream)):  # every split of the bytes into two chunks, a CRLF's and a UTF-8 char's too
        assert lines_of(stream[:cut], stream[cut:]) == want, cut
    assert lines_of(b"data: x\r") == ["data: x"]  # a last line ended by a lone CR
    assert lines_of(b"data: x\r", b"\n", b"data: y") == ["data: x", "data: y"]


def test_a_reply_with_unicode_line_breaks_is_read_whole() -> None:
    """A streamed completion whose text holds the three breaks raw, sent one byte at a time: ok, all its tokens."""
    texts = ["Hi", f" {BREAKS}", " there"]
    events = [json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": None}]}, ensure_ascii=False)
              for t in texts]
    events.append(json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}))
    body = "".join(f"data: {e}\n\n" for e in events).encode() + b"data: [DONE]\n\n"

    async def one_byte_at_a_time(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(len(body)):
            await resp.write(body[i:i + 1])
        await resp.write_eof()
        return resp

    async def turn() -> RequestRecord:
        app = web.Application()
        app.router.add_post("/v1/completions", one_byte_at_a_time)
        async with TestServer(app) as server:
            target = Target(url=str(server.make_url("/")), model="m")  # a base URL typed with its slash
            async with ClientPool(target) as pool:
                rec = RequestRecord(session=0, turn=0, endpoint="completions", kind="turn", start_s=0.0)
                return await http_turn(pool.take(), target, [{"role": "user", "content": "hello"}], 3, rec)

    rec = asyncio.run(turn())
    assert rec.outcome == "ok" and rec.error is None, rec.error
    assert rec.text == "".join(texts) and len(rec.token_times_s) == 3 and rec.output_tokens == 3
