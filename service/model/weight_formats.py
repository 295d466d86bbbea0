"""The 8-bit weight formats by name (`--weights`): each quantizes a model into a QuantizedModel (quantized.py)."""

from __future__ import annotations

import torch

from service.model import fp8, int8
from service.model.quantized import QuantizedModel
from service.model.weights import ModelWeights

FORMATS = ("fp8", "int8", "int8-row")


def quantize_model(weights: ModelWeights, weight_format: str, dtype: torch.dtype = torch.bfloat16) -> QuantizedModel:
    """The model in an 8-bit weight format: "fp8" (service/model/fp8.py), "int8" or "int8-row"
    (service/model/int8.py)."""
    if weight_format == "fp8":
        return fp8.quantize_model(weights, dtype)
    if weight_format in ("int8", "int8-row"):
        return int8.quantize_model(weights, dtype, int8.BLOCK if weight_format == "int8" else None)
    raise ValueError(f"{weight_format!r} is not an 8-bit weight format ({', '.join(FORMATS)})")
