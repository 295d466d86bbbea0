"""A model whose matrices are stored quantized (FP8: service/model/fp8.py; int8: service/model/int8.py): the
quantized matrices of every layer and the LM head, and the model they dequantize to (the reference decoder's). The
formats build on this; weight_formats.py picks one by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Generic, Protocol, TypeVar

import torch

from service.model.weights import ModelWeights

LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


class Dequantizable(Protocol):
    def dequantize(self, dtype: torch.dtype = ...) -> torch.Tensor: ...


M = TypeVar("M", bound=Dequantizable)


@dataclass
class QuantizedModel(Generic[M]):
    """The quantized matrices of every layer and the LM head, and the model they dequantize to (the reference's)."""

    layers: list[dict[str, M]]
    lm_head: M
    dequantized: ModelWeights


def quantize_with(weights: ModelWeights, dtype: torch.dtype, quantize: Callable[[str, torch.Tensor], M]
                  ) -> QuantizedModel[M]:
    """Every layer matrix and the LM head through `quantize(key, w)` (key "layers.{i}.wq", ..., "lm_head"); the
    embedding table stays in `dtype` (it is looked up, not streamed). Norms and biases stay as they are."""
    layers = [{name: quantize(f"layers.{i}.{name}", getattr(lw, name)) for name in LAYER_MATRICES}
              for i, lw in enumerate(weights.layers)]
    lm_head = quantize("lm_head", weights.lm_head)
    deq_layers = [replace(lw, **{name: m.dequantize(dtype) for name, m in qs.items()})
                  for lw, qs in zip(weights.layers, layers)]
    dequantized = ModelWeights(embed=weights.embed.to(dtype), layers=[lw.to(lw.wq.device, dtype) for lw in deq_layers],
                               final_norm=weights.final_norm.to(dtype), lm_head=lm_head.dequantize(dtype))
    return QuantizedModel(layers, lm_head, dequantized)
