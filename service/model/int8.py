"""Int8 weights (weight-only: the activations stay bf16), in two layouts:

- "int8": GGUF's Q8_0, one float16 scale per block of 32 columns (along K), 1.0625 bytes a weight. A Q8_0 GGUF file
  keeps its own values and scales (ModelWeights.int8): the same format.
- "int8-row": one float32 scale per output row, 1 byte a weight; the kernel scales each row once, in its epilogue,
  where blocks cost a multiply per 32 columns of every output.

Why int8 and not e4m3: on the real SmolLM2 weights (bench/fp8_quality.py, bench/results/fp8-quality.md) e4m3 with a
scale per row costs +6.5% perplexity and per 32 columns still +2.1%: its 3 mantissa bits are the loss, not the
scale. Int8 per row costs +0.25%, int8 blocks +0.10% (float32 against bf16: +0.08%; the source weights are Q4_1
blocks of 32, which a block of int8 holds almost exactly).

Quantized as llama.cpp quantizes Q8_0 (bit for bit: tests/test_int8.py): d = absmax / 127 per block (or row),
data = w × (1 / d) rounded half away from zero, scale = d (float16 for blocks; a zero block: scale 0, data 0).
Dequantized = data × scale: what the reference decoder runs, and (but for the last bf16 rounding of each weight)
what the megakernel computes with.
"""

from __future__ import annotations

import torch

from service.model.quantized import LAYER_MATRICES, QuantizedModel, quantize_with
from service.model.weights import Int8Matrix, ModelWeights

__all__ = ["BLOCK", "LAYER_MATRICES", "Int8Matrix", "QuantizedModel", "activations_int8", "quantize",
           "quantize_model"]

BLOCK = 32  # columns per scale (Q8_0's)
INT8_MAX = 127


def quantize(w: torch.Tensor, block: int | None = BLOCK) -> Int8Matrix:
    """Per block of `block` columns of each row (a float16 scale), or per row (None: a float32 scale [rows, 1]):
    scale absmax / 127, the values rounded to int8 (float32 arithmetic in llama.cpp's order)."""
    rows, cols = w.shape
    size = block or cols
    if cols % size:
        raise ValueError(f"a matrix of {cols} columns does not split into int8 blocks of {block}")
    wb = w.float().reshape(rows, cols // size, size)
    d = wb.abs().amax(dim=2, keepdim=True) / INT8_MAX
    x = wb * torch.where(d > 0, 1 / torch.where(d > 0, d, 1.0), 0.0)
    data = (x.sign() * (x.abs() + 0.5).floor()).clamp(-INT8_MAX, INT8_MAX)
    return Int8Matrix(data.to(torch.int8).reshape(rows, cols), d[:, :, 0].to(torch.float16 if block else torch.float32))


def quantize_model(weights: ModelWeights, dtype: torch.dtype = torch.bfloat16, block: int | None = BLOCK
                   ) -> QuantizedModel[Int8Matrix]:
    """Every layer matrix and the LM head in int8 blocks (None: per row; a Q8_0 GGUF's own matrices where it has
    them and the blocks are theirs); the embedding table stays in `dtype` (it is looked up, not streamed). Norms and
    biases stay as they are."""
    own = (weights.int8 or {}) if block == BLOCK else {}
    return quantize_with(weights, dtype, lambda key, w: own[key] if key in own else quantize(w, block))


def activations_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """W8A8's activations for int8 weights as the megakernel's W8A8 tiles quantize them (MatvecTile.w8a8), dequantized:
    each row's runs of `group` columns (the tile's k chunk) scaled so that their absmax maps to 127, rounded half up
    to an integer and scaled back; a run of zeros stays zeros. What an oracle multiplies by the weights to match the
    kernel."""
    xf = x.float()
    cols = xf.shape[-1]
    g = torch.nn.functional.pad(xf, (0, -cols % group)).unflatten(-1, (-1, group))
    amax = g.abs().amax(dim=-1, keepdim=True)
    q = torch.floor(g * torch.where(amax > 0, INT8_MAX / amax, 1.0) + 0.5)
    return (q * (amax / INT8_MAX)).flatten(-2)[..., :cols].to(x.dtype)
