"""TokenRing: each step's chosen tokens on their way to the host, through pinned buffers and CUDA events reused in
turn.

`tensor.to("cpu", non_blocking=True)` takes a pinned block from torch's caching host allocator and a new event every
step: on the H200 that line was 4.9% of the engine thread's samples under load (bench/NOTES.md "8-bit gate/up in
wider tiles"), host time between two steps that the GPU waits for once the step is as short as FP8's. A buffer is
written again only RING steps later; the engine reads every step's tokens before it launches the step after the next
(it runs one step ahead), so a buffer is always read before it is reused.
"""

from __future__ import annotations

import torch

RING = 4


class TokenRing:
    def __init__(self, rows: int, ring: int = RING) -> None:
        self.rows = rows
        self.ring = ring
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}  # made on first use, per dtype (int32 or int64)
        self._events: list[torch.cuda.Event] = []
        self._at = -1

    def send(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start the copy of `chosen` (1-D, on a CUDA device, at most `rows` long) to the host: the host tensor it
        lands in, and the event that fires once it is there."""
        n = chosen.numel()
        if n > self.rows:
            raise ValueError(f"{n} tokens for a ring of {self.rows} rows")
        if not self._events:
            self._events = [torch.cuda.Event() for _ in range(self.ring)]
        buffers = self._buffers.get(chosen.dtype)
        if buffers is None:
            buffers = self._buffers[chosen.dtype] = [torch.empty(self.rows, dtype=chosen.dtype, pin_memory=True)
                                                     for _ in range(self.ring)]
        self._at = (self._at + 1) % self.ring
        host, ready = buffers[self._at][:n], self._events[self._at]
        host.copy_(chosen, non_blocking=True)
        ready.record()
        return host, ready
