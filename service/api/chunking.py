"""SentenceChunker: groups streamed text at clause boundaries for text-to-speech engines, which speak a clause
better than a token. A boundary is one of . ! ? ; : , followed by whitespace, or a newline; the text of a
response is never changed, only regrouped (joining the chunks gives the text back)."""

from __future__ import annotations

PUNCTUATION = frozenset(".!?;:,")


class SentenceChunker:
    def __init__(self, max_chars: int = 200) -> None:
        self.max_chars = max_chars  # a long run without a boundary goes out at a space anyway
        self._buf = ""

    def add(self, text: str) -> list[str]:
        """The chunks that are complete now ([] or one)."""
        self._buf += text
        cut = self._last_boundary()
        if cut == 0 and len(self._buf) > self.max_chars:
            cut = self._buf.rfind(" ") + 1 or len(self._buf)
        if cut == 0:
            return []
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return [out]

    def flush(self) -> list[str]:
        """Whatever is left, at the end of the response."""
        out, self._buf = self._buf, ""
        return [out] if out else []

    def _last_boundary(self) -> int:
        """The position just after the last complete boundary in the buffer (0 if none)."""
        b = self._buf
        for i in range(len(b) - 1, -1, -1):
            c = b[i]
            if c == "\n":
                return i + 1
            if c in PUNCTUATION and i + 1 < len(b) and b[i + 1].isspace():
                return i + 1
        return 0
