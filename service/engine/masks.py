"""StepMasks: the grammar masks of a step's constrained rows applied to its logits in one go, whatever their number:
their bitmasks stacked on the host in a pinned buffer, one copy to the device, one expansion to a bool mask, one
masked_fill over the step's logits. The masks themselves are computed off the engine thread (grammar.py); the engine
waits for one only where it is not ready when its step is launched (counted: `waits`).
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

    logits: torch.Tensor
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

    def apply(self, logits: torch.Tensor, constrained: dict[int, TokenConstraint]) -> Masked:
        """`logits` [rows, vocab] with the tokens each constrained row's mask (row → its constraint) does not allow at
        -inf, without waiting for the device; the other rows are left as they are. A row whose mask fails, or allows
        nothing, is in `errors`."""
        rows, vocab = logits.shape
        words = (vocab + 31) // 32
        host, masked_rows = self._buffer(rows, words, logits.device)
        staged = host.numpy()
        out = Masked(logits)
        for i, constraint in constrained.items():
            masked_rows.append(i)
            staged[i] = 0
            waited = not constraint.ready()
            t0 = time.perf_counter() if waited else 0.0
            try:
                allowed = constraint.allowed().numpy()
            except Exception as e:  # this row alone: it fails when read
                out.errors[i] = e
                continue
            finally:
                if waited:
                    out.waits += 1
                    out.wait_s += time.perf_counter() - t0
            n = min(allowed.shape[0], words)
            staged[i, :n] = allowed[:n]
            if not staged[i].any():
                out.errors[i] = ValueError("the grammar allows no token here")
        dev = host.to(logits.device, non_blocking=True)
        blocked = (dev[:, :, None] & self._bit(logits.device)) == 0
        out.logits = logits.masked_fill(blocked.view(rows, words * 32)[:, :vocab], float("-inf"))
        return out
