"""Shared fixtures: the embedded GGUF model (ours and the transformers oracle), each loaded once per session."""

from __future__ import annotations

import pytest
import torch

from service.model.loader import default_model_path, load_model


@pytest.fixture(scope="session")
def gguf_path():
    return default_model_path()


@pytest.fixture(scope="session")
def model():
    """Our load of the default model (SmolLM2-135M-Instruct Q4_1), dequantized to float32 on the CPU."""
    return load_model()


@pytest.fixture(scope="session")
def tokenizer(model):
    return model.tokenizer


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """The oracle: transformers' own load of the same GGUF file, float32 on the CPU."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    m = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is present (CI has none; run them on the GPU host)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
