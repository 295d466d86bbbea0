"""TextOutput: generated ids → text deltas, with stop sequences. Text that might be the start of a stop sequence is
held back until it is known not to be one, so a client never sees part of a stop string."""

from __future__ import annotations

from service.model.tokenizer import IncrementalDetokenizer


class TextOutput:
    def __init__(self, detokenizer: IncrementalDetokenizer, stop: tuple[str, ...] = ()) -> None:
        self._detok = detokenizer
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded, not yet sent
        self.stopped = False

    def add(self, token_id: int) -> str:
        """Text to send for this token (maybe ''); sets `stopped` when a stop sequence completes."""
        return self._release(self._detok.add(token_id), final=False)

    def finish(self) -> str:
        """Everything still held (trailing bytes of an unfinished character included)."""
        return self._release(self._detok.flush(), final=True)

    def _release(self, piece: str, final: bool) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        for s in self._stop:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                self._held = ""
                return text[:at]
        if final or not self._stop:
            self._held = ""
            return text
        keep = _longest_stop_prefix_suffix(text, self._stop)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
