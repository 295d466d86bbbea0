"""TokenConstraint: what a grammar plugs into a request (service/engine/grammar.py implements it)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch


class TokenConstraint(Protocol):
    """The tokens a grammar allows before each choice, as a bitmask on the host, and the token chosen, so that it can
    advance. Once the grammar is complete, it allows only end-of-sequence tokens: the request ends as any does at its
    EOS. The sampler applies the bitmasks of a step's constrained rows together, on the logits' device (masks.py)."""

    def ready(self) -> bool:
        """Whether allowed() would return without waiting (the next mask is computed off the engine thread)."""
        ...

    def allowed(self) -> torch.Tensor:
        """int32 [words] on the host: bit t % 32 of word t // 32 set where token t is allowed next (words past the
        tokenizer's vocabulary: none). Waits for the mask where it is not ready; raises where the grammar failed.
        The caller copies it before the next accept()."""
        ...

    def accept(self, token: int) -> None:
        """The token chosen next; raises if the grammar does not allow it."""
        ...

    @property
    def opening(self) -> bool:
        """Whether it holds the reply's opening only (lifted within a few tokens): admission's forecast counts the
        request as an unconstrained one."""
        ...

    def lifted(self) -> bool:
        """Whether it constrains nothing from here on (a grammar of a reply's opening, which has opened): the request
        drops it and its tokens are chosen as an unconstrained request's are."""
        ...


def bitmask(tokens: Iterable[int], vocab: int) -> torch.Tensor:
    """The allowed() mask of a set of tokens, for a vocabulary of `vocab`."""
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for t in tokens:
        words[t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # bit 31 is the int32's sign
