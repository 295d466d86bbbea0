"""The fresh-prompt prefill that a GPU captures per length bucket gives what the eager prefill gives, padding and
all: the logits of the last real token and the K/V of every real position."""

import pytest
import torch

from service.backends.reference import ReferenceDecoder
from service.model.loader import load_model


@pytest.mark.parametrize("n", [1, 7, 16])
def test_padded_fresh_prefill_matches_eager(n):
    m = load_model("synthetic:tiny")
    d = ReferenceDecoder(m.config, m.weights, max_slots=3, max_context=64)
    ids = torch.randint(0, m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    eager = d.prefill(2, ids)
    k, v = d.cache.k[:, 2, :, :n].clone(), d.cache.v[:, 2, :, :n].clone()
    d.cache.k.normal_()
    d.cache.v.normal_()
    padded = torch.tensor([ids + [3] * (32 - n)])
    out = d._prefill_fresh(padded, torch.tensor([2]), torch.tensor([n - 1]))
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d.cache.k[:, 2, :, :n], k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d.cache.v[:, 2, :, :n], v, rtol=1e-5, atol=1e-5)
    # and decoding on from there agrees with decoding on from the eager prefill
    nxt = int(eager.argmax())
    after = d.decode([2], [nxt], [n]).logits[0]
    d.prefill(2, ids)
    torch.testing.assert_close(d.decode([2], [nxt], [n]).logits[0], after, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_graphed_prefill_matches_eager_on_gpu():
    m = load_model("synthetic:smollm2-135m", device="cuda", dtype=torch.bfloat16)
    d = ReferenceDecoder(m.config, m.weights, max_slots=2, max_context=512)
    for n in (5, 33, 300):
        ids = torch.randint(0, m.config.vocab_size, (n,)).tolist()
        d.graph_prefill = True
        graphed = d.prefill(1, ids)
        k = d.cache.k[:, 1, :, :n].clone()
        d.graph_prefill = False
        eager = d.prefill(1, ids)
        assert (graphed - eager).norm() / eager.norm() < 1e-2
        assert (d.cache.k[:, 1, :, :n].float() - k.float()).norm() / k.float().norm() < 1e-2
