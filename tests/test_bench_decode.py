"""The decode bench's correctness oracles, checked on the CPU (the bench itself runs on a GPU): which products a
launch runs W8A8, and that its float32 answer quantizes those products' activations as the bf16 oracle does."""

from __future__ import annotations

import contextlib

import torch

from bench.decode import static_cache_step, static_caches, w8a8_names
from bench.fp8_quality import W8A8_CHUNK, w8a8_of, w8a8_products
from bench.variants import VARIANTS
from service.backends.megakernel import MegakernelDecoder
from service.backends.reference import ReferenceDecoder
from service.model.synthetic import load_synthetic


def test_the_w8a8_products_are_those_the_launch_runs_w8a8() -> None:
    """FP8 from 16 rows: gate/up in groups of 256 columns, and with 16 sampled rows the LM head in groups of 64
    (kernels/tiles.py), from 32 rows down too where its K is long (the tiny model's is not: weight-only); fewer rows
    and bf16 weights run none; bench variant w-dn-a8-ks4 (its tiles unfitted) down from 32 rows."""
    config, weights, _ = load_synthetic("tiny", device="cpu", dtype=torch.float32, seed=0)
    fp8, down = ("w_gate:256", "w_up:256", "lm_head:64"), ("w_down:256",)
    for fmt, variant, at16, at32, at64 in (("bf16", None, (), (), ()), ("fp8", None, fp8, fp8, fp8),
                                           ("fp8", "w-dn-a8-ks4", fp8, fp8 + down, fp8 + down)):
        mk = MegakernelDecoder(config, weights, max_slots=16, max_context=256, device="cpu", dtype=torch.float32,
                               max_rows=64, max_batch=16, weight_format=fmt,
                               kernel_config=VARIANTS[variant](fmt) if variant else None)
        names = {b: set(w8a8_names(mk, b)) for b in mk.buckets}
        assert names == {1: set(), 2: set(), 4: set(), 8: set(), 16: set(at16), 32: set(at32),
                         64: set(at64)}, (fmt, variant)


def test_the_float32_answer_quantizes_what_the_reference_decoder_quantizes() -> None:
    """static_cache_step (the bench's float32 answer) over a copy of a reference decoder's cache gives the decoder's
    own next logits, with every W8A8 product's activations quantized alike; and quantizing moves them."""
    config, weights, _ = load_synthetic("tiny", device="cpu", dtype=torch.float32, seed=1)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (10,), generator=g).tolist()
    nxt = int(torch.randint(0, config.vocab_size, (1,), generator=g))
    pick = w8a8_of(weights, ("w_gate:16", "w_up:16", "lm_head:32"))

    def both(quantized: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ref = ReferenceDecoder(config, weights, 2, 64, "cpu", torch.float32)
        ref.prefill(0, prompt)
        ks, vs = static_caches(ref, 1, len(prompt) + 1, torch.float32)
        x = weights.embed[torch.tensor([nxt])].unsqueeze(1)
        with torch.inference_mode(), w8a8_products(W8A8_CHUNK, pick) if quantized else contextlib.nullcontext():
            exact = static_cache_step(config, weights, ref.cos, ref.sin, x, torch.tensor([len(prompt)]), ks, vs)
            own = ref.decode([0], [nxt], [len(prompt)]).logits.float()
        return exact[0], own[0]

    plain, plain_own = both(False)
    w8a8, w8a8_own = both(True)
    torch.testing.assert_close(plain, plain_own, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w8a8, w8a8_own, rtol=1e-4, atol=1e-4)
    assert (w8a8 - plain).norm() > 1e-3 * plain.norm()


def test_every_variant_builds_its_tiles_for_every_format_the_bench_times() -> None:
    """`bench decode --variants NAME --weights ...` takes any variant with any of its formats: each variant's
    configuration and tile table (every bucket, 1 to 64 rows) builds for each (bk2x once had no int8-row entry)."""
    from bench.decode import WEIGHT_FORMATS

    for name, variant in VARIANTS.items():
        for fmt in WEIGHT_FORMATS:
            tiles = variant(fmt).tiles
            if callable(tiles):
                for rows in (1, 2, 4, 8, 16, 32, 64):
                    assert tiles(rows), (name, fmt, rows)
