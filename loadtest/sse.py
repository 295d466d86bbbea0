"""The lines of a Server-Sent Events stream, split where the SSE specification splits them and nowhere else.

A line reader such as httpx's `aiter_lines` splits text as `str.splitlines` does, at U+0085, U+2028 and U+2029 too;
JSON leaves those raw inside strings, so a server that writes them unescaped (any pydantic or serde JSON) has an
event cut in two and the reply counted as failed. The specification's line ends are CRLF, LF and CR alone.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator

LINE_END = re.compile(rb"\r\n|\r|\n")


async def event_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """Each line of the stream whose bytes arrive as `chunks` (a response body as it comes), without its end."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        # a CR at the end may be the first half of a CRLF: it waits for the next chunk
        hold = pending.endswith(b"\r")
        *lines, pending = LINE_END.split(pending[:-1] if hold else pending)
        if hold:
            pending += b"\r"
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    if pending:  # the last line, with no end or a lone CR
        yield pending.removesuffix(b"\r").decode("utf-8", errors="replace")
