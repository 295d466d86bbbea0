"""ModelConfig: the shape of a Llama-family decoder (Llama-3.x, SmolLM2, Qwen2.5), whatever it was loaded from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class ModelError(ValueError):
    """A model cannot be loaded: a wrong path, an unknown architecture, a missing file. The message names it."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3's `llama3` frequency scaling (config.json `rope_scaling`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str  # "llama" or "qwen2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * f + 2 * h
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse frequencies (float32, [head_dim/2]), with `llama3` scaling applied when configured."""
        d = self.head_dim
        # float32 as Hugging Face computes it, so that the oracle comparison is exact to the last bit we can
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        s = self.rope_scaling
        if s is None:
            return inv
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        mid = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)

    def rope_tables(self, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, float32 [max_positions, head_dim/2], for the rotate-half RoPE layout."""
        pos = torch.arange(max_positions, dtype=torch.float32)
        ang = torch.outer(pos, self.rope_inv_freq().float())
        return ang.cos(), ang.sin()
