"""Backends: decoders behind the engine's Decoder interface. `reference` is PyTorch (CPU or GPU), the oracle;
`megakernel` is the Triton persistent kernel (GPU only)."""

from __future__ import annotations

import torch

from service.backend_names import BACKENDS, WEIGHT_FORMATS
from service.backends.decoder import Decoder
from service.model.config import ModelConfig
from service.model.weights import ModelWeights


def resolve_backend(backend: str) -> str:
    """`auto` is the megakernel where a GPU can run it, the reference decoder elsewhere."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend != "auto":
        return backend
    try:
        from service.backends.megakernel import megakernel_available
    except ImportError:
        return "reference"
    return "megakernel" if megakernel_available() else "reference"


def make_decoder(backend: str, config: ModelConfig, weights: ModelWeights, max_slots: int, max_context: int,
                 device: str | None = None, weight_format: str = "bf16", max_batch: int | None = None,
                 batch_invariant: bool = False, max_rows: int | None = None, query_blocks: bool = True) -> Decoder:
    """The backend's decoder over `max_slots` KV slots (cached conversations), decoding up to `max_batch` of them a
    step (the megakernel sizes its buffers by it, its KV cache by max_slots + a scratch slot). weight_format "fp8":
    the matrices in FP8 (e4m3, a scale per output row; service/model/fp8.py), "int8": in int8 blocks (a scale per 32
    columns, GGUF's Q8_0), "int8-row": in int8 with a scale per output row (service/model/int8.py): the megakernel
    streams them, the reference decoder runs their dequantized values (the same function, at bf16 bytes).
    batch_invariant: the megakernel pads every batch to the largest bucket, so a sequence's tokens never depend on
    the batch it ran in (costs the padding at small batches). max_rows: the rows a step carries at most (the
    megakernel's largest bucket; None: its own limit). query_blocks: the megakernel runs a step of prompts' rows over
    long contexts in its query blocks' launch (kernels/query_blocks.py)."""
    backend = resolve_backend(backend)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weight_format!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    if backend == "megakernel":
        if device == "cpu":
            raise ValueError("the megakernel backend needs a CUDA GPU; use --backend reference on the CPU")
        from kernels.megakernel import KernelConfig, Megakernel
        from service.backends.megakernel import MegakernelDecoder

        max_rows = None if max_rows is None else min(max_rows, Megakernel.BUCKETS[-1])

        return MegakernelDecoder(config, weights, max_slots=max_slots, max_context=max_context, device=device,
                                 weight_format=weight_format, max_batch=max_batch, max_rows=max_rows,
                                 kernel_config=KernelConfig(batch_invariant=batch_invariant,
                                                            query_blocks=query_blocks),
                                 output_views=True)  # the engine is done with a step's outputs before the next
    from service.backends.reference import ReferenceDecoder

    if weight_format != "bf16":
        from service.model.weight_formats import quantize_model

        weights = quantize_model(weights, weight_format, weights.embed.dtype).dequantized
    return ReferenceDecoder(config, weights, max_slots=max_slots, max_context=max_context, device=device)
