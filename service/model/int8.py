"""Int8 weights in GGUF's Q8_0 layout: int8 values with one float16 scale per block of 32 columns (along K), the
activations staying bf16 (weight-only).

Why blocks and not e4m3: on the real SmolLM2 weights (bench/fp8_quality.py) e4m3 with a scale per row costs +6.5%
perplexity, its 3 mantissa bits being the loss, not the scale; int8 with a scale per 32 values costs nothing
measurable (the source weights are Q4_1 blocks of 32, so a block of int8 holds them almost exactly) for 1.0625
bytes a weight. A Q8_0 GGUF file keeps its own values and scales (ModelWeights.int8): the same format.

Per block, as llama.cpp quantizes Q8_0 (bit for bit: tests/test_int8.py): d = absmax / 127, data = w × (1 / d)
rounded half away from zero, scale = float16(d) (a zero block: scale 0, data 0). Dequantized = data × scale: what
the reference decoder runs, and (but for the last bf16 rounding of each weight) what the megakernel computes with.
"""

from __future__ import annotations

import torch

from service.model.quantized import LAYER_MATRICES, QuantizedModel, quantize_with
from service.model.weights import Int8Matrix, ModelWeights

__all__ = ["BLOCK", "LAYER_MATRICES", "Int8Matrix", "QuantizedModel", "quantize", "quantize_model"]

BLOCK = 32  # columns per scale (Q8_0's)
INT8_MAX = 127


def quantize(w: torch.Tensor, block: int = BLOCK) -> Int8Matrix:
    """Per block of `block` columns of each row: a float16 scale absmax / 127, the values rounded to int8 (float32
    arithmetic in llama.cpp's order)."""
    rows, cols = w.shape
    if cols % block:
        raise ValueError(f"a matrix of {cols} columns does not split into int8 blocks of {block}")
    wb = w.float().reshape(rows, cols // block, block)
    d = wb.abs().amax(dim=2, keepdim=True) / INT8_MAX
    x = wb * torch.where(d > 0, 1 / torch.where(d > 0, d, 1.0), 0.0)
    data = (x.sign() * (x.abs() + 0.5).floor()).clamp(-INT8_MAX, INT8_MAX)
    return Int8Matrix(data.to(torch.int8).reshape(rows, cols), d[:, :, 0].to(torch.float16))


def quantize_model(weights: ModelWeights, dtype: torch.dtype = torch.bfloat16) -> QuantizedModel[Int8Matrix]:
    """Every layer matrix and the LM head in int8 blocks (a Q8_0 GGUF's own where it has them); the embedding table
    stays in `dtype` (it is looked up, not streamed). Norms and biases stay as they are."""
    own = weights.int8 or {}
    return quantize_with(weights, dtype, lambda key, w: own[key] if key in own else quantize(w))
