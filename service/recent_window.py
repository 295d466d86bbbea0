"""RecentWindow: the last `size` values of a stream, kept in arrival order and sorted, so that a quantile or the median
of the recent ones is one index (the admission guard's scores per load level, the GPU's recent step times)."""

from __future__ import annotations

import bisect
from collections import deque


class RecentWindow:
    def __init__(self, size: int) -> None:
        self.order: deque[float] = deque()
        self.ranked: list[float] = []
        self.size = size

    def add(self, value: float) -> None:
        self.order.append(value)
        bisect.insort(self.ranked, value)
        if len(self.order) > self.size:
            del self.ranked[bisect.bisect_left(self.ranked, self.order.popleft())]

    def median(self) -> float:
        """The middle value (the mean of the two middle ones for an even count); the window must not be empty."""
        mid = len(self.ranked) // 2
        return self.ranked[mid] if len(self.ranked) % 2 else (self.ranked[mid - 1] + self.ranked[mid]) / 2

    def __len__(self) -> int:
        return len(self.ranked)
