"""Backends: decoders behind the engine's Decoder interface. `reference` is PyTorch (CPU or GPU), the oracle;
`megakernel` is the Triton persistent kernel (GPU only)."""

from __future__ import annotations

import torch

from service.backends.decoder import Decoder
from service.model.config import ModelConfig
from service.model.weights import ModelWeights

BACKENDS = ("auto", "reference", "megakernel")


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
                 device: str | None = None) -> Decoder:
    backend = resolve_backend(backend)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if backend == "megakernel":
        if device == "cpu":
            raise ValueError("the megakernel backend needs a CUDA GPU; use --backend reference on the CPU")
        from service.backends.megakernel import MegakernelDecoder

        return MegakernelDecoder(config, weights, max_slots=max_slots, max_context=max_context, device=device)
    from service.backends.reference import ReferenceDecoder

    return ReferenceDecoder(config, weights, max_slots=max_slots, max_context=max_context, device=device)
