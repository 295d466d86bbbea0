"""The megakernel on a GPU against the reference decoder: the real (synthetic) shapes, teacher-forced steps at
contexts up to 4096, bf16, FP8 and int8 weights, fresh random weights and inputs every run (the seed is reported). A
float32 run of the reference decoder is the exact answer both bf16 computations are measured against; with 8-bit
weights both run the same quantized weights (the reference on their dequantized values). Then a mixed step of 64
rows (prompt chunks beside decode rows), batch invariance (a row's logits are the same bits alone and in any
bucket), and the real embedded SmolLM2 weights against transformers.

The whole file runs in about three minutes on an H100, most of it compiling one kernel per (shape, row bucket,
weight format): the cases are chosen so that they share compiles (bench/NOTES.md, "GPU suite"). The reference
decoders here prefill eagerly: capturing their prefill graphs (54 per decoder at a 4,096-token context) was most of
the file's time and is not what it tests."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.megakernel import KernelConfig

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

MAX_CONTEXT = 4096
STEPS = 24
TOL = 2e-2


@pytest.fixture(autouse=True)
def _eager_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    from service.backends.reference import ReferenceDecoder

    monkeypatch.setattr(ReferenceDecoder, "_capture_prefill_graphs",
                        lambda self: setattr(self, "graph_prefill", False))


def _rel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x - y).norm(dim=-1) / y.norm(dim=-1)


def _check(shape: str, batch: int, weight_format: str = "bf16", steps: int = STEPS, variant: str = "default",
           w8a8: tuple[str, ...] = ()) -> dict:
    """With `variant` a bench variant's kernel (bench/variants.py); with `w8a8` (matrix names) the oracles quantize
    those products' activations as the W8A8 tiles do (bench.fp8_quality.w8a8_products: e4m3, or int8 with int8-row
    weights)."""
    import contextlib

    from bench.fp8_quality import W8A8_CHUNK, w8a8_of, w8a8_products
    from bench.variants import VARIANTS
    from service.backends.megakernel import MegakernelDecoder
    from service.backends.reference import ReferenceDecoder
    from service.model import fp8, int8
    from service.model.synthetic import load_synthetic

    seed = int.from_bytes(os.urandom(4), "little")
    config, weights, _ = load_synthetic(shape, device="cuda", dtype=torch.bfloat16, seed=seed)
    max_slots = max(8, batch)
    mk = MegakernelDecoder(config, weights, max_slots=max_slots, max_context=MAX_CONTEXT, weight_format=weight_format,
                           kernel_config=VARIANTS[variant](weight_format))
    del weights
    # the oracles share the (read-only) weights and keep their own caches: the bf16 reference decoder, and the
    # same decoder in float32, which tells how far each bf16 computation is from the exact answer
    ref = ReferenceDecoder(config, mk.reference.weights, max_slots + 1, MAX_CONTEXT, "cuda", torch.bfloat16)
    f32 = ReferenceDecoder(config, mk.reference.weights.to("cuda", torch.float32), max_slots + 1, MAX_CONTEXT,
                           "cuda", torch.float32)
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(max_slots, generator=g)[:batch].tolist()
    # prompt lengths: one row ends near the end of the context, the others anywhere
    lens = [MAX_CONTEXT - steps - 1] + torch.randint(1, MAX_CONTEXT - steps, (batch - 1,), generator=g).tolist()
    for s, n in zip(slots, lens):
        ids = torch.randint(0, config.vocab_size, (n,), generator=g).tolist()
        for d in (ref, f32, mk):
            d.prefill(s, ids)
    pos = list(lens)
    picks = [w8a8_of(d.weights, w8a8) for d in (ref, f32)]

    def oracle() -> contextlib.AbstractContextManager:
        def pick(w: torch.Tensor) -> bool | int:  # either oracle's weights: True, the product's own chunk, or False
            return next((c for c in (p(w) for p in picks) if c is not False), False)

        act = int8.activations_int8 if weight_format == "int8-row" else fp8.activations_e4m3
        return w8a8_products(W8A8_CHUNK, pick, act) if w8a8 else contextlib.nullcontext()

    d_ref, e_mk, e_ref = [], [], []
    argmax_consistent, agree_mk, agree_ref = True, 0, 0
    for _ in range(steps):
        toks = torch.randint(0, config.vocab_size, (batch,), generator=g).tolist()  # teacher forcing
        with oracle():
            a, c = ref.decode(slots, toks, pos), f32.decode(slots, toks, pos)
        b = mk.decode(slots, toks, pos)
        assert torch.isfinite(b.logits).all()
        d_ref.append(_rel(b.logits, a.logits).max().item())
        e_mk.append(_rel(b.logits, c.logits).max().item())
        e_ref.append(_rel(a.logits, c.logits).max().item())
        argmax_consistent &= bool((b.argmax == b.logits.argmax(-1)).all())
        agree_mk += int((b.argmax == c.argmax).sum())
        agree_ref += int((a.argmax == c.argmax).sum())
        pos = [p + 1 for p in pos]
    mk.check_errors()
    t = torch.tensor([d_ref, e_mk, e_ref])
    return {"seed": seed, "worst_vs_ref": t[0].max().item(), "worst_mk_vs_fp32": t[1].max().item(),
            "worst_ref_vs_fp32": t[2].max().item(), "mean_mk_vs_fp32": t[1].mean().item(),
            "mean_ref_vs_fp32": t[2].mean().item(), "argmax_consistent": argmax_consistent,
            "argmax_agree_fp32_mk": agree_mk / (steps * batch), "argmax_agree_fp32_ref": agree_ref / (steps * batch)}


def _as_good_as_the_reference(r: dict) -> bool:
    """Within 2e-2 of the bf16 reference, or, where two bf16 computations of these random-weight models drift
    further apart than that (the reference's own distance to the float32 answer exceeds 2e-2 for the llama and
    qwen shapes), at least as close to the float32 answer as the bf16 reference is."""
    as_good = r["worst_mk_vs_fp32"] <= max(TOL, 1.2 * r["worst_ref_vs_fp32"]) and \
        r["mean_mk_vs_fp32"] <= max(TOL, 1.1 * r["mean_ref_vs_fp32"])
    return r["worst_vs_ref"] < TOL or as_good


# (shape, rows, weights): Llama at 8 rows in both formats (the invariance test below reuses their compiles), Qwen
# (QKV bias, 6 query heads a KV head, head_dim 128) at 8, SmolLM2 (hidden 576: ragged k chunks) at 1 row; int8
# (Q8_0 blocks) on Llama at 8 rows and on SmolLM2 at 1 (its ragged chunks: blocks past K masked), int8 with row
# scales on Llama at 8; the tiles fitted to a model's matrices and the GPU's programs (tiles.fit_to_programs):
# SmolLM2's QKV in runs of 8 rows (its bf16 and FP8 cases) and its FP8 gate/up in 16-row tiles (4 rows), Qwen's FP8
# gate/up in 32-row tiles at one row; bf16's wide down with K split over 4 tasks, pipelined: Qwen's 70 chunks in 5
# parts, SmolLM2's 12 in 4
CASES = [("llama-3.2-1b", 8, "bf16"), ("llama-3.2-1b", 8, "fp8"), ("qwen2.5-1.5b", 8, "bf16"),
         ("smollm2-135m", 1, "bf16"), ("llama-3.2-1b", 8, "int8"), ("smollm2-135m", 1, "int8"),
         ("llama-3.2-1b", 8, "int8-row"), ("smollm2-135m", 4, "fp8"), ("qwen2.5-1.5b", 1, "fp8"),
         ("qwen2.5-1.5b", 32, "bf16"), ("smollm2-135m", 32, "bf16")]


@pytest.mark.parametrize(("shape", "batch", "weight_format"), CASES)
def test_megakernel_matches_reference_on_gpu(shape: str, batch: int, weight_format: str) -> None:
    r = _check(shape, batch, weight_format)
    print(shape, batch, weight_format, r)
    assert _as_good_as_the_reference(r), r
    assert r["argmax_consistent"], r
    assert r["argmax_agree_fp32_mk"] >= r["argmax_agree_fp32_ref"] - 0.1, r


@pytest.mark.parametrize(("weight_format", "variant", "products", "rows", "shape"),
                         [("fp8", "default", "a8-gateup-lm64", 16, "llama-3.2-1b"),
                          ("fp8", "a8", "a8-gateup-lm", 16, "llama-3.2-1b"),
                          ("int8-row", "default", "a8-gateup-lm64", 16, "llama-3.2-1b"),
                          ("int8-row", "lm-weight-only", "a8-gateup", 16, "llama-3.2-1b"),
                          ("fp8", "default", "a8-gateup-down", 64, "llama-3.2-1b"),
                          ("fp8", "dn-weight-only", "a8-gateup", 64, "llama-3.2-1b"),
                          ("int8-row", "default", "a8-gateup", 64, "llama-3.2-1b"),
                          ("fp8", "default", "a8-gateup-lm64", 16, "qwen2.5-1.5b"),
                          ("fp8", "default", "a8-lm64", 16, "smollm2-135m")])
def test_w8a8_step_matches_its_oracle_on_gpu(weight_format: str, variant: str, products: str, rows: int,
                                             shape: str) -> None:
    """W8A8 against the reference decoders quantizing the same products' activations alike. At 16 rows FP8 (the
    default: gate/up in swapped tiles with e4m3 activations, wgmma e4m3 x e4m3, and the LM head alike over 64-column
    chunks; bench variant `a8`: the LM head's over 256); int8-row alike with int8 activations, wgmma int8 x int8
    summed in int32 (the default; `lm-weight-only`: gate/up alone). At 64 rows (every row sampled, the LM head
    weight-only) the 8-bit launches run 8 warps a program (KernelConfig.wide_warps_8bit), FP8's down W8A8 too, its K
    over 4 tasks (bench variant `dn-weight-only`: down weight-only, as before s82). FP8 at 16 rows splits down's K
    over 2 tasks (Qwen's 18 chunks, the last ragged: 2; SmolLM2's 3: 3), and SmolLM2's gate/up runs weight-only in
    16-row tiles there (tiles.fit_to_programs), its LM head W8A8. On these random-weight models two W8A8 computations
    stray far apart (the bf16 and float32 oracles ~0.18), so the kernel is held to be as close to the float32 oracle
    as the bf16 one is."""
    from bench.fp8_quality import W8A8

    r = _check(shape, rows, weight_format, steps=8, variant=variant, w8a8=W8A8[products])
    print("w8a8", r)
    assert _as_good_as_the_reference(r), r
    assert r["argmax_consistent"], r
    assert r["argmax_agree_fp32_mk"] >= r["argmax_agree_fp32_ref"] - 0.1, r


def test_megakernel_samples_from_the_softmax_on_gpu() -> None:
    """Sampling inside the step on the H100, at the Llama-3.2-1B shape, batch 8: every row's drawn token equals the
    Gumbel-max draw of the kernel's own logits (kernels.sampling.draw over whole rows), greedy rows keep the
    argmax, and over 4,000 draws with fresh seeds the tokens follow softmax(logits / T) (chi-square, 1e-6)."""
    import math

    from kernels.sampling import draw
    from service.backends.decoder import Draw
    from service.backends.megakernel import MegakernelDecoder
    from service.model.synthetic import load_synthetic

    seed = int.from_bytes(os.urandom(4), "little")
    config, weights, _ = load_synthetic("llama-3.2-1b", device="cuda", dtype=torch.bfloat16, seed=seed)
    mk = MegakernelDecoder(config, weights, max_slots=8, max_context=512)
    del weights
    g = torch.Generator().manual_seed(seed)
    slots = list(range(8))
    ids = torch.randint(0, config.vocab_size, (37,), generator=g).tolist()
    for s in slots:  # the same prompt everywhere: eight rows with the same logits
        mk.prefill(s, ids)
    toks, pos = [ids[-1]] * 8, [37] * 8
    logits = mk.decode(slots, toks, pos).logits[0].float()
    # a temperature at which the top token holds ~30% of the mass: a few dozen tokens carry most of it
    lo, hi = 1e-4, 10.0
    for _ in range(60):
        t = math.sqrt(lo * hi)
        lo, hi = (t, hi) if (logits / t).softmax(-1).max() > 0.3 else (lo, t)
    temp = math.sqrt(lo * hi)
    counts = torch.zeros(config.vocab_size, dtype=torch.float64)
    expected = torch.zeros(config.vocab_size, dtype=torch.float64, device="cuda")  # summed over the draws made
    exact = True
    n_steps = 500
    for step in range(n_steps):
        seeds = torch.randint(0, 2**62, (8,), generator=g).tolist()
        draws = [Draw(0.0 if (step == 0 and i == 0) else temp, s) for i, s in enumerate(seeds)]
        out = mk.decode(slots, toks, pos, draws)
        want = draw(out.logits, torch.tensor([d.temperature for d in draws], device="cuda"),
                    torch.tensor(seeds, device="cuda"), torch.tensor(pos, device="cuda"))
        exact &= bool((out.sampled == want).all())
        hot = 1 if step == 0 else 0  # row 0 of the first step is greedy
        if step == 0:
            assert int(out.sampled[0]) == int(out.argmax[0])
        counts += torch.bincount(out.sampled[hot:].cpu(), minlength=config.vocab_size).double()
        # each replay's own logits (the rows differ in nothing but their seeds)
        expected += (out.logits[hot:].double() / temp).softmax(-1).sum(0)
    mk.check_errors()
    assert exact, seed
    expected = expected.cpu()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(big.sum())
    limit = dof * (1 - 2 / (9 * dof) + 4.753 * math.sqrt(2 / (9 * dof))) ** 3
    print({"seed": seed, "temperature": temp, "chi2": chi2, "limit": limit, "dof": dof})
    assert chi2 < limit, (seed, chi2, limit, dof)


@pytest.mark.parametrize("weight_format", ["bf16", "fp8", "int8"])
def test_a_row_gets_the_same_bits_alone_and_in_any_bucket(weight_format: str) -> None:
    """Batch invariance (KernelConfig(batch_invariant=True), every step padded to max_rows = 8): a sequence's
    logits, and so its greedy tokens, are bit-for-bit the same whether it decodes alone or among 1, 3 or 7 other
    sequences, at a short context and at one that splits attention; two replays of the same step agree bit for bit
    (no atomics in the arithmetic); and a prompt's last logits are the same bits whether its 8 rows ran in one step
    or in two chunks of 4."""
    from kernels.megakernel import KernelConfig
    from service.backends.megakernel import MegakernelDecoder
    from service.model.synthetic import load_synthetic

    seed = int.from_bytes(os.urandom(4), "little")
    config, weights, _ = load_synthetic("llama-3.2-1b", device="cuda", dtype=torch.bfloat16, seed=seed)
    mk = MegakernelDecoder(config, weights, max_slots=8, max_context=MAX_CONTEXT, weight_format=weight_format,
                           kernel_config=KernelConfig(batch_invariant=True), max_rows=8)
    del weights
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (8,), generator=g).tolist()
    start = 2000  # on top of a cached prefix, copied into a second slot
    mk.prefill(0, torch.randint(0, config.vocab_size, (start,), generator=g).tolist())
    mk.copy_prefix(0, 1, start)
    positions = list(range(start, start + 8))
    one_step = mk.decode([0] * 8, prompt[7:] + prompt[:7], positions[7:] + positions[:7], sampled_rows=1).logits[0]
    mk.decode([1] * 4, prompt[:4], positions[:4], sampled_rows=0)
    chunked = mk.decode([1] * 4, prompt[7:] + prompt[4:7], positions[7:] + positions[4:7], sampled_rows=1).logits[0]
    assert torch.equal(one_step, chunked), (seed, "chunked", (one_step - chunked).abs().max().item())
    for n in (100, 3000):
        lens = [n] + torch.randint(1, MAX_CONTEXT - 8, (7,), generator=g).tolist()
        for s, m in enumerate(lens):
            mk.prefill(s, torch.randint(0, config.vocab_size, (m,), generator=g).tolist())
        tok = int(torch.randint(0, config.vocab_size, (1,), generator=g))
        others = torch.randint(0, config.vocab_size, (7,), generator=g).tolist()
        alone = mk.decode([0], [tok], [n]).logits[0]
        again = mk.decode([0], [tok], [n]).logits[0]
        assert torch.equal(alone, again), (seed, n, "a replay differs")
        for size in (2, 4, 8):
            batched = mk.decode(list(range(size)), [tok] + others[:size - 1], lens[:size]).logits[0]
            assert torch.equal(alone, batched), (seed, n, size, (alone - batched).abs().max().item())
    mk.check_errors()


@pytest.mark.parametrize("query_blocks", [False, True])
def test_mixed_64_row_step_matches_reference_on_gpu(query_blocks: bool) -> None:
    """A 64-row step at the Llama-3.2-1B shape (bf16): six decode rows at contexts up to 4,000, the 30 new tokens
    of a prompt on top of a 1,000-token cached prefix, and a fresh 28-token prompt; the 8 rows that need a token
    first (sampled_rows=8). Its logits, and those of the 8 decode steps after it (which attend over the K/V it
    wrote), as close to the float32 reference as the bf16 reference decoder running the same rows is. With
    query_blocks the step takes the query blocks' launch (made to here, beside decode rows: block_min_positions 0)."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    lens = [4000] + torch.randint(1, 3500, (5,), generator=g).tolist() + [1000, 0]  # slot 7: a fresh prompt
    r = _prompts_step(seed, lens, {6: 30, 7: 28}, KernelConfig(query_blocks=query_blocks, block_min_positions=0))
    assert r["blocks_launches"] == (1 if query_blocks else 0), r


def test_voice_turns_over_long_conversations_take_the_query_blocks_launch_on_gpu() -> None:
    """Two voice turns at once on an idle server: 22 and 18 new tokens over cached conversations of 2,000 and 1,500
    tokens, in one 40-row step with no decode row, ordered as the engine orders them (each prompt's last row first).
    The server's policy takes the query blocks' launch for it (KernelConfig defaults); its logits and the next 8
    steps' are as close to the float32 reference as the bf16 reference decoder's."""
    seed = int.from_bytes(os.urandom(4), "little")
    r = _prompts_step(seed, [2000, 1500], {0: 22, 1: 18}, KernelConfig(query_blocks=True))
    assert r["blocks_launches"] == 1, r


def _prompts_step(seed: int, lens: list[int], new: dict[int, int], kernel_config: KernelConfig) -> dict:
    """Slots 0.. prefilled to `lens`; one step of a decode row in each slot not in `new` and `new[slot]` new tokens
    of the others (the rows that need a token first), then 8 decode steps of every slot, on the megakernel, the bf16
    reference and the float32 one. Asserts the megakernel as good as the bf16 reference; returns the distances and
    how many steps took the query blocks' launch."""
    from service.backends.megakernel import MegakernelDecoder
    from service.backends.reference import ReferenceDecoder
    from service.model.synthetic import load_synthetic

    n = len(lens)
    config, weights, _ = load_synthetic("llama-3.2-1b", device="cuda", dtype=torch.bfloat16, seed=seed)
    mk = MegakernelDecoder(config, weights, max_slots=n, max_context=MAX_CONTEXT, max_batch=n, max_rows=64,
                           kernel_config=kernel_config)
    del weights
    ref = ReferenceDecoder(config, mk.reference.weights, n + 1, MAX_CONTEXT, "cuda", torch.bfloat16)
    f32 = ReferenceDecoder(config, mk.reference.weights.to("cuda", torch.float32), n + 1, MAX_CONTEXT, "cuda",
                           torch.float32)
    decoders = (mk, ref, f32)
    launches: list[bool] = []
    run_step = mk.run_step

    def counted(bucket: int, blocks: bool = False, one_lm: bool = False) -> None:
        launches.append(blocks)
        run_step(bucket, blocks, one_lm)

    mk.run_step = counted  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(seed)

    def ids(k: int) -> list[int]:
        return torch.randint(0, config.vocab_size, (k,), generator=g).tolist()

    for s, k in enumerate(lens):
        prompt = ids(k)
        for d in decoders:
            if prompt:
                d.prefill(s, prompt)
    chunks = {s: ids(k) for s, k in new.items()}
    rows = [(s, chunks[s][-1], lens[s] + new[s] - 1) if s in new else (s, ids(1)[0], lens[s]) for s in range(n)]
    rows += [(s, t, lens[s] + i) for s, c in chunks.items() for i, t in enumerate(c[:-1])]
    sl, tk, ps = (list(x) for x in zip(*rows))
    got = [mk.decode(sl, tk, ps, sampled_rows=n).logits]
    want = [ref.decode(sl, tk, ps).logits[:n]]
    exact = [f32.decode(sl, tk, ps).logits[:n]]
    pos = [lens[s] + new.get(s, 1) for s in range(n)]
    for _ in range(8):
        toks = ids(n)
        got.append(mk.decode(list(range(n)), toks, pos).logits)
        want.append(ref.decode(list(range(n)), toks, pos).logits)
        exact.append(f32.decode(list(range(n)), toks, pos).logits)
        pos = [p + 1 for p in pos]
    mk.check_errors()
    d_ref = torch.stack([_rel(a, b) for a, b in zip(got, want)])
    e_mk = torch.stack([_rel(a, c) for a, c in zip(got, exact)])
    e_ref = torch.stack([_rel(b, c) for b, c in zip(want, exact)])
    r = {"seed": seed, "rows": len(rows), "worst_vs_ref": d_ref.max().item(), "worst_mk_vs_fp32": e_mk.max().item(),
         "worst_ref_vs_fp32": e_ref.max().item(), "mean_mk_vs_fp32": e_mk.mean().item(),
         "mean_ref_vs_fp32": e_ref.mean().item(), "prompt_step_mk_vs_fp32": e_mk[0].max().item(),
         "prompt_step_ref_vs_fp32": e_ref[0].max().item(), "blocks_launches": launches.count(True)}
    print("prompts step", r)
    assert all(torch.isfinite(x).all() for x in got), r
    assert _as_good_as_the_reference(r), r
    return r


@pytest.mark.parametrize("rows", [28, 60])
@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_a_prompt_alone_samples_through_the_one_lm_row_launch_on_gpu(weight_format: str, rows: int) -> None:
    """A fresh prompt alone on a server's decoder (16 seats): its 28 or 60 rows, the last one first and the only one
    sampled, take the 32- or 64-row bucket's launch whose LM head takes one row (Megakernel.has_one_lm_row; at 64
    rows FP8's tail at 4 warps beside its layers' 8); the same step again with two rows sampled, the plain launch
    (every seat's row through the LM head: FP8's in W8A8). The one-row launch's logits are at least as close to the
    float32 answer as the plain launch's (bf16: the same greedy token, within 1e-2 of them)."""
    from service.backends.megakernel import MegakernelDecoder
    from service.backends.reference import ReferenceDecoder
    from service.model.synthetic import load_synthetic

    seed = int.from_bytes(os.urandom(4), "little")
    config, weights, _ = load_synthetic("llama-3.2-1b", device="cuda", dtype=torch.bfloat16, seed=seed)
    mk = MegakernelDecoder(config, weights, max_slots=16, max_context=MAX_CONTEXT, weight_format=weight_format,
                           max_batch=16, max_rows=64)
    del weights
    f32 = ReferenceDecoder(config, mk.reference.weights.to("cuda", torch.float32), 17, MAX_CONTEXT, "cuda",
                           torch.float32)
    launches: list[bool] = []
    run_step = mk.run_step

    def counted(bucket: int, blocks: bool = False, one_lm: bool = False) -> None:
        launches.append(one_lm and mk.kernel.has_one_lm_row(bucket))
        run_step(bucket, blocks, one_lm)

    mk.run_step = counted  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, config.vocab_size, (rows,), generator=g).tolist()
    tokens, positions = [prompt[-1], *prompt[:-1]], [rows - 1, *range(rows - 1)]
    one = mk.decode([0] * rows, tokens, positions, sampled_rows=1)
    one_logits, one_argmax = one.logits[:1].clone(), one.argmax[:1].clone()
    plain = mk.decode([0] * rows, tokens, positions, sampled_rows=2)  # the same step: its K/V rewritten alike
    exact = f32.decode([0] * rows, tokens, positions).logits[:1]
    mk.check_errors()
    assert launches == [True, False], launches
    e_one, e_plain = _rel(one_logits, exact).item(), _rel(plain.logits[:1], exact).item()
    r = {"seed": seed, "rows": rows, "one_vs_fp32": e_one, "plain_vs_fp32": e_plain,
         "one_vs_plain": _rel(one_logits, plain.logits[:1]).item()}
    print("one LM row", weight_format, r)
    assert torch.isfinite(one_logits).all() and bool((one_argmax == one_logits.argmax(-1)).all()), r
    assert e_one <= max(TOL, 1.2 * e_plain), r
    if weight_format == "bf16":
        assert r["one_vs_plain"] < 1e-2 and int(one_argmax) == int(plain.argmax[0]), r


def test_a_megakernel_engine_gathers_its_fed_rows_on_the_device() -> None:
    """On a GPU the engine launches each step before it has read the last one's tokens; the megakernel decoder takes
    the rows that feed on them (a Fed) and gathers their tokens within its own input copy: in order while the same
    requests decode, in an order of their own as requests end and a prompt's chunks ride beside them. Every request
    streams the same greedy tokens as from the same engine building the tokens with torch calls (the same requests,
    all waiting when it starts, so the same steps). The decoder is built as the server builds it, for steps wider
    than the rows they sample (16 rows, 4 sampled: the fed rows' buffer is as wide as the sampled rows), and the first
    step, with no decode row, carries 16 prompt rows (prefill_rows) where the others carry 4."""
    import queue

    from service.backends.megakernel import MegakernelDecoder
    from service.engine.engine import Engine
    from service.engine.request import Delta, SamplingParams
    from service.model.synthetic import load_synthetic

    seed = int.from_bytes(os.urandom(4), "little")
    config, weights, tok = load_synthetic("llama-3.2-1b", device="cuda", dtype=torch.bfloat16, seed=seed)
    dec = MegakernelDecoder(config, weights, max_slots=8, max_context=256, max_rows=16, max_batch=4)
    del weights
    dec.output_views = True  # as the server's decoder: the step before's tokens are the kernel's own buffer
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (3, 5, 2, 11)]
    lengths = (6, 13, 9, 17)
    streams = []
    for feeds in (True, False):
        eng = Engine(dec, tok, eos_token_ids=(), max_rows=4, max_batch=4, prefill_rows=16)
        assert eng.overlap and eng._decoder_feeds
        eng._decoder_feeds = feeds
        sinks: list[queue.SimpleQueue[Delta]] = [queue.SimpleQueue() for _ in prompts]
        for p, n, q in zip(prompts, lengths, sinks):
            eng.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), q.put)
        eng.start()
        try:
            streams.append([_greedy_tokens(q) for q in sinks])
        finally:
            eng.stop()
    assert [len(s) for s in streams[0]] == list(lengths), seed
    assert streams[0] == streams[1], seed
    dec.check_errors()


def _greedy_tokens(q) -> list[int]:
    out: list[int] = []
    while True:
        d = q.get(timeout=300)
        out += d.token_ids
        if d.finish_reason is not None:
            assert d.error is None, d.error
            return out


PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three colours.", "How many legs does a spider have?", "Say hello in Spanish.",
    "What is 12 times 12?", "Name a famous physicist.", "Give me a tip for a job interview.",
    "What does a barista do?",
]


def test_real_weights_greedy_text_against_transformers() -> None:
    """The embedded SmolLM2-135M GGUF (real weights): each prompt's 32 greedy tokens from the megakernel (bf16,
    batch-invariant) against transformers in float32 on the same file, as close as the bf16 reference decoder is;
    and every prompt decoded in one batch of 10 gets the same tokens as alone (what batch invariance promises).
    Without batch invariance (the engine's default) a row's sums depend on its bucket's tiles, and batched greedy
    text may part from the text alone where two tokens are close: reported, not asserted (7 of 10 the same on
    the H100 in issue 22's run)."""
    transformers = pytest.importorskip("transformers")
    from kernels.megakernel import KernelConfig
    from service.backends.megakernel import MegakernelDecoder
    from service.backends.reference import ReferenceDecoder
    from service.model.loader import default_model_path, load_model

    path = default_model_path()
    model = load_model(device="cuda", dtype=torch.bfloat16)
    ids = [model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    n_new = 32
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    want = []
    for p in ids:
        out = hf.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new)
        want.append(out[0, len(p):].tolist())
    n = len(PROMPTS)
    invariant = MegakernelDecoder(model.config, model.weights, max_slots=n, max_context=512, max_rows=16,
                                  kernel_config=KernelConfig(batch_invariant=True))
    mk = MegakernelDecoder(model.config, model.weights, max_slots=n, max_context=512, max_rows=16)
    ref = ReferenceDecoder(model.config, model.weights, n, 512, "cuda", torch.bfloat16)

    def greedy(dec, rows: list[int]) -> list[list[int]]:  # noqa: ANN001
        toks = [[int(dec.prefill(r, ids[r]).argmax())] for r in rows]
        for _ in range(n_new - 1):
            out = dec.decode(rows, [t[-1] for t in toks], [len(ids[r]) + len(t) - 1 for r, t in zip(rows, toks)])
            for t, a in zip(toks, out.argmax.tolist()):
                t.append(a)
        return toks

    def agreement(got: list[list[int]]) -> tuple[int, float]:
        same = sum(g == w for g, w in zip(got, want))
        prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), n_new) / n_new for g, w in zip(got, want)]
        return same, sum(prefix) / len(prefix)

    alone = [greedy(invariant, [r])[0] for r in range(n)]
    batched = greedy(invariant, list(range(n)))
    ref_alone = [greedy(ref, [r])[0] for r in range(n)]
    mk_same, mk_prefix = agreement(alone)
    ref_same, ref_prefix = agreement(ref_alone)
    same_batched = sum(a == b for a, b in zip(alone, batched))
    default_alone = [greedy(mk, [r])[0] for r in range(n)]
    default_batched = greedy(mk, list(range(n)))
    print({"megakernel_identical": mk_same, "megakernel_shared_prefix": mk_prefix, "reference_identical": ref_same,
           "reference_shared_prefix": ref_prefix, "invariant_same_alone_and_batched": same_batched,
           "default_same_alone_and_batched": sum(a == b for a, b in zip(default_alone, default_batched)),
           "default_identical_to_transformers": agreement(default_alone)[0], "prompts": n})
    invariant.check_errors()
    mk.check_errors()
    assert mk_same >= ref_same - 1 and mk_prefix >= ref_prefix - 0.1, (mk_same, mk_prefix, ref_same, ref_prefix)
    assert same_batched == n, (alone, batched)
