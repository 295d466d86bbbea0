"""The Decoder interface: what the engine needs from a backend (the PyTorch reference, the megakernel).

A decoder owns a static KV cache of `max_slots` × `max_context` positions. A sequence lives in one slot from
its prefill to its end; the engine, not the decoder, decides which slot is whose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from service.model.config import ModelConfig


class DecodeOutput(NamedTuple):
    logits: torch.Tensor  # float32 [batch, vocab], for sampling with temperature/top-p/top-k
    argmax: torch.Tensor  # int64 [batch], the greedy token (the megakernel computes it in the same launch)
    sampled: torch.Tensor | None = None  # int64 [batch], each row's token drawn as `draws` asked (None: not asked,
    # or a decoder that does not draw; the engine then samples from `logits`)


@dataclass
class Fed:
    """A step's tokens where some rows take the token the step before chose, still on the device (the engine launches
    a step before it has read the last one's tokens): `tokens` each row's token from the host (a placeholder where
    fed), `rows` the fed rows and `sources` the row of `chosen` (the step before's tokens) each takes. A decoder that
    `feeds` gathers them on the device itself (the megakernel: within its input copy); the engine builds a device
    tensor of the tokens for one that does not."""

    tokens: list[int]
    rows: list[int]
    sources: list[int]
    chosen: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def on_device(self) -> torch.Tensor:
        """The rows' tokens as one tensor on `chosen`'s device (for a decoder that does not feed)."""
        tokens = torch.tensor(self.tokens, dtype=self.chosen.dtype).to(self.chosen.device, non_blocking=True)
        rows = torch.tensor(self.rows, dtype=torch.int64).to(self.chosen.device, non_blocking=True)
        sources = torch.tensor(self.sources, dtype=torch.int64).to(self.chosen.device, non_blocking=True)
        return tokens.index_copy(0, rows, self.chosen.index_select(0, sources))

    def in_order(self) -> bool:
        """Every row takes the token its own row chose, and nothing else is in `chosen`."""
        n = len(self.tokens)
        return len(self.rows) == n == len(self.chosen) and self.rows == self.sources == list(range(n))


class Draw(NamedTuple):
    """How a row's next token is drawn inside the decode step: from softmax(logits / temperature) (0: greedy),
    with noise keyed by (seed, position, token id), so a request's draws depend on its seed and nothing else."""

    temperature: float
    seed: int  # in [0, 2^63), as Request.draw_seed


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

    @property
    def slow_prefills(self) -> int:
        """Prefills that took a slow path (on a GPU: eager, not a captured graph): parley_prefill_slow_path_total."""
        ...

    @property
    def query_block_steps(self) -> int:
        """Decode steps run in the megakernel's query-blocks launch (kernels/query_blocks.py; 0 elsewhere):
        parley_query_block_steps_total."""
        ...

    def prefill_graph_buckets(self) -> list[int] | None:
        """The sizes prefill graphs pad to, new tokens and cached length alike (GPU: a prefill's cost steps at them,
        and admission's latency model is measured at them); None where prefill runs eagerly, its cost growing
        smoothly with both."""
        ...

    def copy_prefix(self, src_slot: int, dst_slot: int, n_tokens: int) -> None:
        """Copy the K/V of positions [0, n_tokens) of `src_slot`, every layer, into `dst_slot` (a prefix that two
        requests share, where the slot holding it must keep it). Asynchronous on a GPU, ordered before the next
        prefill or step."""
        ...

    draws_tokens: bool  # whether decode() honours `draws` (returns `sampled`) and draw() exists
    feeds: bool  # whether decode() takes a Fed and gathers its fed rows' tokens on the device itself

    def decode(self, slots: list[int], token_ids: list[int] | torch.Tensor | Fed, positions: list[int],
               draws: list[Draw] | None = None, sampled_rows: int | None = None,
               masks: dict[int, torch.Tensor] | None = None) -> DecodeOutput:
        """One step over rows: token_ids[i] sits at positions[i] of slots[i]. Several rows may share a slot (a prompt
        chunk at consecutive positions). Every row writes its K/V before any row's attention reads positions
        [0, positions[i]] of its slot, so the rows of one slot attend causally among themselves (and a row may rewrite
        a position an earlier step wrote). Returns, for rows [0, sampled_rows) (None: every row), the logits and the
        greedy token, and where the decoder draws tokens and `draws` is given (one per such row), each one's drawn
        token; the other rows' logits are never computed. Asynchronous on a GPU: nothing waits for the device.
        `token_ids` may be a device tensor (tokens chosen by the step before), so that a step can be launched before
        the last one's tokens reach the host, or a Fed: the rows that take those tokens. `masks`: sampled row → the
        tokens its grammar allows (int32 words on the host, a bit per token, bit t % 32 of word t // 32); that row's
        logits, greedy token and draw see only those (the others at -inf)."""
        ...

    def draw(self, logits: torch.Tensor, draws: list[Draw], positions: list[int]) -> torch.Tensor:
        """Where draws_tokens: the draw decode() makes, over given float32 logits [n, vocab] (a prefill's last
        ones) for tokens at `positions`; int64 [n] on the device."""
        ...


def mask_logits(logits: torch.Tensor, masks: dict[int, torch.Tensor] | None) -> torch.Tensor:
    """`logits` [rows, vocab] with each masked row's disallowed tokens at -inf (see Decoder.decode's `masks`); a
    token past a mask's words is disallowed."""
    if not masks:
        return logits
    rows, vocab = logits.shape
    words = (vocab + 31) // 32
    bits = torch.full((rows, words), -1, dtype=torch.int32)
    for i, allowed in masks.items():
        n = min(words, allowed.numel())
        bits[i] = 0
        bits[i, :n] = allowed[:n]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed_t = ((bits[:, :, None] >> shifts) & 1).bool().view(rows, words * 32)[:, :vocab]
    return logits.masked_fill(~allowed_t.to(logits.device, non_blocking=True), float("-inf"))
