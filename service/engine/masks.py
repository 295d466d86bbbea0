"""StepMasks: the grammar masks of a step's constrained rows, collected when the step is launched (computed off the
engine thread beforehand: grammar.py; the engine waits for one only where it is not ready, counted in `waits`).
A decoder that masks inside its step (the megakernel's LM head: Decoder.decode's `masks`) takes them as they are;
for one that does not, apply() masks the step's logits in one go, whatever their number: the bitmasks stacked on
the host in a pinned buffer, one copy to the device, one expansion to a bool mask, one masked_fill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from service.engine.constraint import TokenConstraint

STAGING_BUFFERS = 4  # pinned buffers the masks go through, in turn (a step in flight still copies from one)


@dataclass
class Masked:
    """A step's logits with its constrained rows masked, and what went wrong or waited on the way."""

    logits: torch.Tensor | None
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # row → its grammar's bitmask (int32 words, host)
    errors: dict[int, Exception] = field(default_factory=dict)  # rows whose mask failed: they fail when read
    waits: int = 0  # masks not ready when the step was launched
    wait_s: float = 0.0  # how long the engine thread waited for them


class StepMasks:
    """Owns the pinned staging buffers (reused, in turn: allocating pinned memory each step can stall the host) and
    the bit pattern the expansion ANDs with."""

    def __init__(self, buffers: int = STAGING_BUFFERS) -> None:
        self._buffers = buffers
        self._staging: list[torch.Tensor] = []
        self._masked_rows: list[list[int]] = []  # per buffer, the rows holding a mask (the others allow everything)
        self._at = 0
        self._bits: dict[torch.device, torch.Tensor] = {}

    def _buffer(self, rows: int, words: int, dev: torch.device) -> tuple[torch.Tensor, list[int]]:
        """A staging buffer of `rows` rows allowing every token, and the list to note its masked rows in."""
        if not self._staging or self._staging[0].shape[0] < rows or self._staging[0].shape[1] != words:
            # a step still in flight may copy from the old buffers: pinned memory is kept until its copy has run
            self._staging = [torch.full((max(rows, 16), words), -1, dtype=torch.int32, pin_memory=dev.type == "cuda")
                             for _ in range(self._buffers)]
            self._masked_rows = [[] for _ in range(self._buffers)]
        self._at = (self._at + 1) % self._buffers
        staged, masked = self._staging[self._at].numpy(), self._masked_rows[self._at]
        staged[masked] = -1  # what this buffer's last step masked, reset (not the whole buffer: a memset per step)
        masked.clear()
        return self._staging[self._at][:rows], masked

    def _bit(self, dev: torch.device) -> torch.Tensor:
        if dev not in self._bits:
            self._bits[dev] = torch.tensor([1 << i if i < 31 else -(1 << 31) for i in range(32)], dtype=torch.int32,
                                           device=dev)
        return self._bits[dev]

    def collect(self, constrained: dict[int, TokenConstraint]) -> Masked:
        """Each constrained row's mask (row → its constraint), read from the host (waiting only for one not computed
        yet), in `masks`; a row whose mask fails, or allows nothing, is in `errors` instead. What a decoder that
        masks inside its step takes (Decoder.decode's `masks`); `logits` is left unset."""
        out = Masked(None)
        for i, constraint in constrained.items():
            waited = not constraint.ready()
            t0 = time.perf_counter() if waited else 0.0
            try:
                allowed = constraint.allowed()
            except Exception as e:  # this row alone: it fails when read
                out.errors[i] = e
                continue
            finally:
                if waited:
                    out.waits += 1
                    out.wait_s += time.perf_counter() - t0
            if not allowed.any():
                out.errors[i] = ValueError("the grammar allows no token here")
                continue
            out.masks[i] = allowed
        return out

    def apply(self, logits: torch.Tensor, collected: Masked | dict[int, TokenConstraint]) -> Masked:
        """`logits` [rows, vocab] with the tokens each collected mask (or each constraint's, row → constraint) does
        not allow at -inf, without waiting for the device (a decoder that does not mask inside its step); the other
        rows are left as they are."""
        if not isinstance(collected, Masked):
            collected = self.collect(collected)
        rows, vocab = logits.shape
        words = (vocab + 31) // 32
        host, masked_rows = self._buffer(rows, words, logits.device)
        staged = host.numpy()
        for i, allowed in collected.masks.items():
            masked_rows.append(i)
            a = allowed.numpy()
            n = min(a.shape[0], words)
            staged[i] = 0
            staged[i, :n] = a[:n]
        for i in collected.errors:  # a failed row is read as an error, whatever its logits say
            masked_rows.append(i)
            staged[i] = 0
        dev = host.to(logits.device, non_blocking=True)
        blocked = (dev[:, :, None] & self._bit(logits.device)) == 0
        collected.logits = logits.masked_fill(blocked.view(rows, words * 32)[:, :vocab], float("-inf"))
        return collected
