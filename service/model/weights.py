"""ModelWeights: one decoder's tensors under one naming, whatever file they came from (and Fp8Matrix, Int8Matrix: the
forms of a matrix a checkpoint ships in FP8 or in Q8_0).

Layout (PyTorch's F.linear convention, out × in): wq [q_size, hidden], wk/wv [kv_size, hidden],
wo [hidden, q_size], w_gate/w_up [ffn, hidden], w_down [hidden, ffn]. Q and K rows follow the
rotate-half RoPE layout that Hugging Face checkpoints use (GGUF's interleaved rows are undone on load).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass
class Fp8Matrix:
    """A matrix in FP8 (service/model/fp8.py makes them): W ≈ data.float() * scale[:, None], data float8_e4m3fn
    [rows, cols], scale float32 [rows]."""

    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)

    def to(self, device: torch.device | str) -> Fp8Matrix:
        return Fp8Matrix(self.data.to(device), self.scale.to(device, torch.float32))


@dataclass
class Int8Matrix:
    """A matrix in int8 blocks (service/model/int8.py makes them; GGUF's Q8_0): W ≈ data.float() * scale repeated
    over each block of `block` columns, data int8 [rows, cols], scale float16 [rows, cols / block]; or per row:
    scale float32 [rows, 1] (block = cols)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def block(self) -> int:
        return self.data.shape[1] // self.scale.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        rows, cols = self.data.shape
        w = self.data.float().reshape(rows, -1, self.block) * self.scale.float()[:, :, None]
        return w.reshape(rows, cols).to(dtype)

    def to(self, device: torch.device | str) -> Int8Matrix:
        return Int8Matrix(self.data.to(device), self.scale.to(device))


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype) -> LayerWeights:
        moved: dict[str, Any] = {
            f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device, dtype))
            for f in fields(self)
        }
        return LayerWeights(**moved)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied
    # a checkpoint shipped in FP8: its own matrices ("layers.{i}.wq", ..., "lm_head"), which the tensors above hold
    # dequantized
    fp8: dict[str, Fp8Matrix] | None = None
    # a GGUF file's Q8_0 matrices (same keys, and "embed"), kept as they are for the int8 weight format
    int8: dict[str, Int8Matrix] | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype) -> ModelWeights:
        tied = self.lm_head is self.embed
        embed = self.embed.to(device, dtype)
        return ModelWeights(
            embed=embed,
            layers=[layer.to(device, dtype) for layer in self.layers],
            final_norm=self.final_norm.to(device, dtype),
            lm_head=embed if tied else self.lm_head.to(device, dtype),
            fp8=None if self.fp8 is None else {k: m.to(device) for k, m in self.fp8.items()},
            int8=None if self.int8 is None else {k: m.to(device) for k, m in self.int8.items()},
        )

    def nbytes(self) -> int:
        """Bytes a decode step streams: every weight once (the tied head counted once, as the LM head)."""
        total = self.lm_head.numel() * self.lm_head.element_size() + self.final_norm.nbytes
        for layer in self.layers:
            total += sum(t.nbytes for t in vars(layer).values() if t is not None)
        return total
