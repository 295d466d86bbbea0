"""Running a step ahead (a GPU engine): the next decode step is launched before the last one's tokens reach the host,
fed the tokens chosen on the device, so that the host's work per token (streaming, detokenizing, bookkeeping) hides
behind the kernel.

Each row of a launched step is real (a request's token at its next position) or void. After a step S, while the
batch stays the same, a request's row of the next step is
- the token chosen for it on the device in S, at the position after S's: most rows;
- void, at the position after S's, when its next choice needs its token of S on the host first (a grammar: it
  lags, sampler.py). The row is fed a dummy token (its last one); the K/V it writes are rewritten by the request's
  next real row before any real row reads them (both decoders write a row's K/V at its position before its
  attention reads the cache);
- its token of the step before S, on the host by now, at the position its void row of S wrote, when that row was
  void.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.request import Request
from service.engine.sampler import StepTokens


@dataclass
class Rows:
    """What a decode step is fed: a token (host ints, or a device tensor) and a position per row; void rows."""

    tokens: list[int] | torch.Tensor
    positions: list[int]
    void: list[bool]


@dataclass
class Step:
    """A launched decode step whose tokens have not been read back yet."""

    batch: list[Request]
    rows: Rows
    tokens: StepTokens
    t0: float


def from_host(batch: list[Request]) -> Rows:
    """A step fed from the host: each request's last token at its next position."""
    return Rows([r.output_ids[-1] for r in batch], [r.kv_len for r in batch], [False] * len(batch))


def after(step: Step, needs_host: Callable[[Request], bool]) -> Rows:
    """The rows of the step after `step`, launched before `step`'s tokens are read (the same batch)."""
    host: dict[int, int] = {}  # rows fed from the host: a lagging request's token, or a void row's dummy
    positions, void = [], []
    for i, req in enumerate(step.batch):
        was_void, pos = step.rows.void[i], step.rows.positions[i]
        lagging = not was_void and needs_host(req)
        if was_void or lagging:
            host[i] = req.output_ids[-1]
        positions.append(pos if was_void else pos + 1)
        void.append(lagging)
    return Rows(step.tokens.feed(host), positions, void)
