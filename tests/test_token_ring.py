"""The steps' tokens on their way to the host through reused pinned buffers (service/engine/token_ring.py): every step
reads its own tokens, however many steps the ring has turned, and an engine streams the same tokens through it as
through torch's own copy."""

from __future__ import annotations

import queue

import pytest
import torch

from service.backends.reference import ReferenceDecoder
from service.engine.engine import Engine
from service.engine.request import Delta, SamplingParams
from service.engine.token_ring import RING, TokenRing
from service.model.loader import load_model


def test_a_ring_refuses_more_tokens_than_its_rows() -> None:
    with pytest.raises(ValueError, match="ring of 4 rows"):
        TokenRing(4).send(torch.arange(5))


@pytest.mark.gpu
def test_each_step_reads_its_own_tokens_as_the_ring_turns() -> None:
    ring = TokenRing(16)
    g = torch.Generator(device="cuda").manual_seed(7)
    in_flight: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
    for step in range(3 * RING + 1):
        n = 1 + step % 16
        dtype = torch.int64 if step % 3 else torch.int32  # argmax (int64) and the kernel's int32 tokens
        # a long kernel before the tokens, so that their copy is still queued when the next step's starts
        torch.cuda._sleep(200_000)
        chosen = torch.randint(0, 50_000, (n,), device="cuda", generator=g, dtype=dtype)
        host, ready = ring.send(chosen)
        in_flight.append((chosen, host, ready))
        if len(in_flight) == 2:  # the engine's pace: one step ahead, the one before read
            want, got, event = in_flight.pop(0)
            event.synchronize()
            assert got.dtype == want.dtype and got.tolist() == want.tolist()
    want, got, event = in_flight.pop()
    event.synchronize()
    assert got.tolist() == want.tolist()


@pytest.mark.gpu
def test_a_cuda_engine_streams_the_tokens_it_streams_without_the_ring() -> None:
    """The same requests, all waiting when the engine starts (so the same steps), through the ring and through
    torch's own copy to the host."""
    tiny = load_model("synthetic:tiny")
    prompts = [[5, 9, 2, 7], [11, 3], [4, 4, 4, 8, 1], [6]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for ring in (True, False):
        dec = ReferenceDecoder(tiny.config, tiny.weights, max_slots=4, max_context=64, device="cuda")
        eng = Engine(dec, tiny.tokenizer, eos_token_ids=())
        assert isinstance(eng._token_ring, TokenRing)
        if not ring:
            eng._token_ring = None
        sinks: list[queue.SimpleQueue[Delta]] = [queue.SimpleQueue() for _ in prompts]
        for p, q in zip(prompts, sinks):  # before the engine starts: its first step carries all of them
            eng.submit(p, params, q.put)
        eng.start()
        try:
            outputs.append([_tokens(q) for q in sinks])
        finally:
            eng.stop()
    assert all(len(o) == 12 for o in outputs[0])
    assert outputs[0] == outputs[1]


def _tokens(q: queue.SimpleQueue[Delta]) -> list[int]:
    out: list[int] = []
    while True:
        d = q.get(timeout=60)
        out += d.token_ids
        if d.finish_reason is not None:
            assert d.error is None
            return out
