"""The reference decoder's one forward, on fresh random weights each run: a prompt on top of a cached prefix gives
what a fresh prefill of the whole prompt gives, and the padded shapes a GPU captures as graphs give what the eager
prefill gives, without ever touching the K/V of a real position."""

import os

import pytest
import torch

from service.backends.reference import ReferenceDecoder
from service.model.synthetic import load_synthetic

CONTEXT = 128


@pytest.fixture(scope="module")
def tiny():
    seed = int.from_bytes(os.urandom(4), "little")
    config, weights, _ = load_synthetic("tiny", seed=seed)
    weights.embed.mul_(50)  # random weights at std 0.02 give near-uniform logits; these give a clear argmax
    return config, weights, seed


def decoder(tiny, slots=3):
    config, weights, _ = tiny
    return ReferenceDecoder(config, weights, max_slots=slots, max_context=CONTEXT)


def prompt(tiny, n, salt=0):
    config, _, seed = tiny
    g = torch.Generator().manual_seed(seed + 7919 * n + salt)
    return torch.randint(0, config.vocab_size, (n,), generator=g).tolist()


def assert_same(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("cut", [1, 5, 16, 40, 99])
def test_continuation_prefill_matches_a_fresh_prefill(tiny, cut):
    """prefill(prefix) then prefill(rest, start_pos=len(prefix)) in another slot: the same logits as one fresh
    prefill of the whole prompt, the same K/V at every position, and the same next decode step."""
    ids = prompt(tiny, 100)
    d = decoder(tiny)
    fresh = d.prefill(0, ids)
    d.prefill(1, ids[:cut])
    continued = d.prefill(1, ids[cut:], start_pos=cut)
    assert_same(continued, fresh, "logits")
    assert_same(d.cache.k[:, 1, :, :100], d.cache.k[:, 0, :, :100], "K")
    assert_same(d.cache.v[:, 1, :, :100], d.cache.v[:, 0, :, :100], "V")
    step = d.decode([0, 1], [int(fresh.argmax())] * 2, [100, 100]).logits
    assert_same(step[1], step[0], "the next step")


@pytest.mark.parametrize("start, n", [(0, 1), (0, 7), (0, 16), (3, 5), (20, 12), (60, 40), (110, 10), (125, 2)])
def test_padded_prefill_matches_eager_and_never_clobbers_real_kv(tiny, start, n):
    """The shapes a GPU graph runs: the new tokens padded to their bucket, attending over the cached length's bucket
    (and a fresh prompt among its own tokens alone), with the slot, start and real length as tensors. The logits are
    the eager prefill's; the prefix's K/V stay as they were, the prompt's are the eager prefill's, and padding
    writes only past the prompt (clamped to the last position of the context), in its own slot alone."""
    ids = prompt(tiny, start + n)
    d = decoder(tiny)
    if start:
        d.prefill(2, ids[:start])
    eager = d.prefill(2, ids[start:], start_pos=start)
    k, v = d.cache.k.clone(), d.cache.v.clone()
    new_b, kv_b = d.bucket(n), d.bucket(start + n)
    assert new_b >= n and kv_b >= start + n and new_b <= kv_b <= CONTEXT
    stale = prompt(tiny, new_b, salt=1)  # the graph's token buffer holds an earlier prompt past this one
    padded = torch.tensor([ids[start:] + stale[n:]])
    for kv_len in [kv_b] + ([None] if start == 0 else []):
        d.cache.k.copy_(k)
        d.cache.v.copy_(v)
        d.cache.k[:, 2, :, start + n:].normal_()  # what earlier prompts left past this one
        d.cache.v[:, 2, :, start + n:].normal_()
        before_k, before_v = d.cache.k.clone(), d.cache.v.clone()
        with torch.inference_mode():
            out = d.prefill_tensors(padded, torch.tensor([2]), torch.tensor([start]), torch.tensor([n]), kv_len)
        assert_same(out, eager, f"logits over {kv_len}")
        assert_same(d.cache.k[:, :, :, :start + n], k[:, :, :, :start + n], "K up to the prompt's end")
        assert_same(d.cache.v[:, :, :, :start + n], v[:, :, :, :start + n], "V up to the prompt's end")
        others = [s for s in range(3) if s != 2]
        assert torch.equal(d.cache.k[:, others], before_k[:, others])
        assert torch.equal(d.cache.v[:, others], before_v[:, others])
        written = min(start + new_b, CONTEXT)  # padding wrote [start + n, written) and nothing past it
        assert torch.equal(d.cache.k[:, 2, :, written:], before_k[:, 2, :, written:])
    # and decoding on from here agrees with decoding on from the eager prefill
    nxt, pos = int(eager.argmax()), start + n
    if pos < CONTEXT:
        after = d.decode([2], [nxt], [pos]).logits[0]
        d.cache.k.copy_(k)
        d.cache.v.copy_(v)
        assert_same(d.decode([2], [nxt], [pos]).logits[0], after, "the next step")


def test_every_prompt_shape_has_a_bucket_pair(tiny):
    """The graphs captured at start-up: a fresh prompt's bucket, and (new tokens, cached length) bucket pairs with
    new <= cached, both powers of two from 16 (the context as the last); every prompt maps to one of them."""
    d = decoder(tiny)
    buckets = d.prefill_buckets()
    assert buckets == [16, 32, 64, 128]
    pairs = {(n, kv) for kv in buckets for n in buckets if n <= kv}
    assert len(pairs) == 10
    for start in range(1, CONTEXT):
        for n in range(1, CONTEXT - start + 1):
            assert (d.bucket(n), d.bucket(start + n)) in pairs
    assert {d.bucket(n) for n in range(1, CONTEXT + 1)} == set(buckets)  # fresh prompts: one graph a bucket
    assert ReferenceDecoder(tiny[0], tiny[1], max_slots=1, max_context=8192).prefill_buckets()[-1] == 8192
    assert len(ReferenceDecoder(tiny[0], tiny[1], max_slots=1, max_context=1000).prefill_buckets()) == 7  # ..512, 1000


def test_the_cpu_prefills_eagerly_and_counts_no_slow_path(tiny):
    d = decoder(tiny)
    d.prefill(0, prompt(tiny, 10))
    d.prefill(0, prompt(tiny, 5), start_pos=10)
    assert not d.graph_prefill and d.slow_prefills == 0


@pytest.mark.gpu
def test_graphed_prefill_matches_eager_on_gpu():
    """Fresh and continued prompts replay the graphs captured at construction: the logits and K/V of the eager
    path, the prefix untouched, and no slow path, except a padded prompt that would end on the context's last
    position (its padding would land on it): that one runs eagerly and is counted."""
    config, weights, _ = load_synthetic("smollm2-135m", device="cuda", dtype=torch.bfloat16, num_layers=4)
    d = ReferenceDecoder(config, weights, max_slots=2, max_context=512)
    assert len(d._prefill_graphs) == 6 + 21  # buckets 16 ... 512: fresh, and 6 × 7 / 2 (new, cached) pairs
    for start, n in ((0, 5), (0, 33), (0, 300), (40, 1), (77, 100), (300, 211), (480, 31)):
        ids = torch.randint(0, config.vocab_size, (start + n,)).tolist()
        if start:
            d.prefill(1, ids[:start])
        prefix, slow = d.cache.k[:, 1, :, :start].clone(), d.slow_prefills
        graphed = d.prefill(1, ids[start:], start)
        k = d.cache.k[:, 1, :, :start + n].clone()
        assert d.slow_prefills == slow
        assert torch.equal(d.cache.k[:, 1, :, :start], prefix)
        d.graph_prefill = False
        eager = d.prefill(1, ids[start:], start)  # counted: an eager prefill on a GPU is the slow path
        d.graph_prefill = True
        assert d.slow_prefills == slow + 1
        assert (graphed - eager).norm() / eager.norm() < 1e-2
        assert (d.cache.k[:, 1, :, :start + n].float() - k.float()).norm() / k.float().norm() < 1e-2
    slow = d.slow_prefills
    d.prefill(1, list(range(3)), start_pos=509)  # ends on position 511, padded to 16: eager
    assert d.slow_prefills == slow + 1
    d.prefill(1, list(range(16)), start_pos=496)  # ends there too but pads nothing: graphed
    assert d.slow_prefills == slow + 1


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_a_product_of_a_few_rows_padded_on_the_cpu_is_each_rows_own(rows):
    """On the CPU a product of 2-3 rows runs padded to CPU_FEWEST_ROWS (MKL is slower at 2-3 rows than at 4): each
    row still gets its own product (fresh random rows, weight and bias), in the input's shape."""
    from service.backends.reference import CPU_FEWEST_ROWS, linear

    x, w, b = torch.randn(rows, 1, 96), torch.randn(160, 96), torch.randn(160)
    out = linear(x, w, b)
    assert out.shape == (rows, 1, 160) and 1 < CPU_FEWEST_ROWS
    assert_same(out, torch.stack([torch.nn.functional.linear(x[i], w, b) for i in range(rows)]), f"{rows} rows")
    assert_same(linear(x[:, 0], w), x[:, 0] @ w.T, f"{rows} rows, no bias, 2-D")
