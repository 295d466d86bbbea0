"""The Decoder interface: what the engine needs from a backend (the PyTorch reference, the megakernel).

A decoder owns a static KV cache of `max_slots` × `max_context` positions. A sequence lives in one slot from
its prefill to its end; the engine, not the decoder, decides which slot is whose.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from service.model.config import ModelConfig


class DecodeOutput(NamedTuple):
    logits: torch.Tensor  # float32 [batch, vocab], for sampling with temperature/top-p/top-k
    argmax: torch.Tensor  # int64 [batch], the greedy token (the megakernel computes it in the same launch)


class Decoder(Protocol):
    config: ModelConfig
    max_slots: int
    max_context: int
    device: torch.device
    name: str

    def prefill(self, slot: int, token_ids: list[int], start_pos: int = 0) -> torch.Tensor:
        """Run `token_ids` at positions start_pos.. in `slot` (positions < start_pos are already cached),
        writing their K/V. Returns the float32 logits [vocab] of the last token."""
        ...

    def decode(self, slots: list[int], token_ids: list[int] | torch.Tensor, positions: list[int]) -> DecodeOutput:
        """One step for a batch of any size up to max_slots: token_ids[i] sits at positions[i] of slots[i].
        Writes its K/V; returns the logits and the greedy token of each sequence. Asynchronous on a GPU: nothing
        waits for the device. `token_ids` may be a device tensor (the previous step's argmax), so that a step
        can be launched before the last one's tokens reach the host."""
        ...
