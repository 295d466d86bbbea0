"""TokenConstraint: what a grammar plugs into a request (service/engine/grammar.py implements it)."""

from __future__ import annotations

from typing import Protocol

import torch


class TokenConstraint(Protocol):
    """The logits a grammar allows before each choice, and the token chosen, so that it can advance. Once the grammar
    is complete, `mask` allows only end-of-sequence tokens: the request ends as any does at its EOS."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits [vocab] → the same, with disallowed tokens at -inf."""
        ...

    def accept(self, token: int) -> None: ...
