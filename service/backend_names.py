"""The decoder backends `parley serve --backend` can name, and the weight formats `--weights` can. A module of its
own, free of torch, so that the CLI (`parley --help`) states the choices without loading the model stack;
service.backends re-exports them."""

from __future__ import annotations

BACKENDS = ("auto", "reference", "megakernel")
# fp8: e4m3 matrices, a scale per output row (service/model/fp8.py); int8: int8 matrices, a scale per block of 32
# columns, GGUF's Q8_0; int8-row: int8 matrices, a scale per output row (service/model/int8.py)
WEIGHT_FORMATS = ("bf16", "fp8", "int8", "int8-row")
