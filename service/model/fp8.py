"""FP8 weights: e4m3 matrices with one float32 scale per output row (weight-only; activations stay bf16).

Batch-1 decode streams every weight once a step, so half the bytes is nearly half the step. Scales are powers of
two chosen from each row's absolute maximum: e4m3 is a floating-point format, so a power-of-two scale loses
nothing but the top of the range (the row's largest value lands in [224, 448] instead of at 448), and every
dequantized weight, e4m3 value times power of two, is exactly a bf16 number. The reference decoder therefore runs
the very weights the kernel reads, dequantized, and stays the kernel's oracle.

A checkpoint already in FP8 (safetensors with float8_e4m3fn weights and a `weight_scale` per tensor or per row,
as published FP8 checkpoints store them) keeps its own values and scales (ModelWeights.fp8).
"""

from __future__ import annotations

import torch

from service.model.quantized import LAYER_MATRICES, QuantizedModel, quantize_with

# Fp8Matrix lives with the weights that hold it (weights.py); it is imported from here too (hf_checkpoint.py).
from service.model.weights import Fp8Matrix, ModelWeights

__all__ = ["E4M3_MAX", "LAYER_MATRICES", "Fp8Matrix", "QuantizedModel", "activations_e4m3", "from_checkpoint",
           "quantize", "quantize_model"]

E4M3_MAX = 448.0


def quantize(w: torch.Tensor) -> Fp8Matrix:
    """Per output row: scale = 2^ceil(log2(absmax / 448)), data = w / scale rounded to e4m3 (a zero row: scale 1)."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))), torch.ones_like(amax))
    data = (wf / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return Fp8Matrix(data, scale)


def activations_e4m3(x: torch.Tensor, group: int) -> torch.Tensor:
    """W8A8's activations as the megakernel's W8A8 tiles quantize them (MatvecTile.w8a8), dequantized: each row's
    runs of `group` columns (the tile's k chunk) scaled so that their absmax maps to 448, rounded to e4m3 (to nearest)
    and scaled back; a run of zeros stays zeros. What an oracle multiplies by the weights to match the kernel."""
    xf = x.float()
    cols = xf.shape[-1]
    g = torch.nn.functional.pad(xf, (0, -cols % group)).unflatten(-1, (-1, group))
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (g / scale).to(torch.float8_e4m3fn).float() * scale
    return q.flatten(-2)[..., :cols].to(x.dtype)


def from_checkpoint(data: torch.Tensor, weight_scale: torch.Tensor) -> Fp8Matrix:
    """A published FP8 matrix: float8_e4m3fn data and a scale per tensor ([] or [1]) or per row ([rows] or
    [rows, 1]); W = data * scale."""
    rows = data.shape[0]
    s = weight_scale.float().reshape(-1)
    if s.numel() == 1:
        s = s.expand(rows)
    elif s.numel() != rows:
        raise ValueError(f"weight_scale of {s.numel()} values for a matrix of {rows} rows: only per-tensor or "
                         "per-row (per-channel) scales are supported")
    return Fp8Matrix(data, s.contiguous())


def quantize_model(weights: ModelWeights, dtype: torch.dtype = torch.bfloat16) -> QuantizedModel[Fp8Matrix]:
    """Every layer matrix and the LM head in FP8 (the checkpoint's own where it ships FP8); the embedding table
    stays in `dtype` (it is looked up, not streamed). Norms and biases stay as they are."""
    own = weights.fp8 or {}
    return quantize_with(weights, dtype, lambda key, w: own[key] if key in own else quantize(w))
