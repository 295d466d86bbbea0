"""Shared fixtures: the embedded GGUF model (ours and the transformers oracle), each loaded once per session, and
`shared_server`, one `parley serve` of it on loopback for every module that talks to a live server."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from service.model.loader import default_model_path, load_model
from tests.server_support import Server, served, start_server

# Servers the tests start measure their own latency model: a calibration cached by another test (or a developer's
# server, on a busier moment) must not decide what they admit. Tests of the cache pass their own directory.
os.environ.setdefault("PARLEY_CALIBRATION_CACHE", "off")

SHARED_SERVER_SLOTS = 4
SHARED_SERVER_CONTEXT = 1024
SHARED_SERVER_WAITING = 4  # a burst of 16 finds the queue full (tests/test_loadtest_parley.py); nothing else waits


@pytest.fixture(autouse=True)
def torch_threads_restored() -> Iterator[None]:
    """A test that builds an engine in this process sets torch's CPU threads (service/runtime.py): the next test
    gets the process's own back."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The embedded SmolLM2-135M on the CPU: 4 slots, 1024 tokens of context, 4 waiting at most."""
    try:
        server = start_server(tmp_path_factory.mktemp("shared_server") / "parley.log",
                              "--max-batch", str(SHARED_SERVER_SLOTS), "--max-context", str(SHARED_SERVER_CONTEXT),
                              "--max-waiting", str(SHARED_SERVER_WAITING))
    except RuntimeError as e:
        pytest.fail(str(e))
    yield from served(server)


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only where CUDA is present (CI has none; run them on the GPU host)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
