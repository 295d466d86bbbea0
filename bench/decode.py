"""Decode-step benchmark: the megakernel against its peers and the memory-bandwidth floor, in one GPU run.

    python -m bench decode [--out bench/results] [--models llama-3.2-1b qwen2.5-1.5b smollm2-135m]
                           [--weights bf16 fp8 int8 int8-row] [--int8-models llama-3.2-1b] [--batches 1 8]
                           [--wide-batches 32 64] [--contexts 128 2048]
                           [--variants tma w-narrow ...] [--timeline default ...] [--timeline-rows 64] [--hf]
                           [--budget-s 400] [--tag NAME]

Times, per (model, weights, rows, context): the megakernel (median of CUDA-graph replays; each variant named, the
variants timed in turns, five rounds in a rotating order: identical kernels timed one after another read up to 2%
apart, bench/cuda_timing.time_in_turns);
the peers measured in the same run: the PyTorch reference decoder's step captured in a CUDA graph, the gpt-fast
recipe (the same arithmetic over a static cache of the context the step needs, compiled by Inductor in its
default mode and captured in a CUDA graph: the strongest peer an hour buys; --compiled-models/-batches), and with
--hf Hugging Face `generate` (eager, static cache). Wide steps (--wide-batches, for --wide-models) are 32 or 64
rows, each at the context, of which the first --sampled (16) go through the LM head: what a step of prompt rows
beside decode rows costs. The floor is the bytes a step must read (every weight once, in the weights' format, plus
the K/V of the context) over the streaming-read bandwidth measured in the same run. Before its time counts, each
variant's logits are checked against the float32 answer (the same model in float32 over the same cache): WRONG
where they stray further than max(0.05, 1.5x the bf16 reference decoder's own distance to it). Where a variant's
launch runs products W8A8 (e4m3 activations: FP8 from 16 rows), both oracles quantize those products' activations
alike (bench.fp8_quality.w8a8_products), as tests/test_megakernel_gpu.py does: two W8A8 computations stray far apart
on random weights, so against the weight-only answer every W8A8 step read WRONG. --timeline records,
for the named variants at --timeline-rows rows and --timeline-contexts contexts (128), when each task of the step
started, found its inputs ready and ended (globaltimer), summed per phase.
Unless --no-library-peer, also at every row count of bf16 and fp8 weights (bench/library_peer.py): the step's
matrices alone as cuBLAS bf16 / FP8 W8A8 `torch._scaled_mm` calls in one CUDA graph; it leaves out attention, norms
and sampling, so it is a lower bound for a library-built step.
Weights are synthetic (seeded random, the real shapes): decode cost does not depend on weight values.
Writes bench/results/decode-<device>[-TAG].json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.cuda_timing import events_ms, graph_of, time_graph, time_in_turns
from bench.fp8_quality import W8A8_CHUNK, w8a8_of, w8a8_products
from bench.library_peer import BACKEND as LIBRARY_PEER
from bench.library_peer import library_peer
from bench.variants import VARIANTS
from kernels import instructions as I
from kernels.instructions import Op
from kernels.query_blocks import uses_blocks
from service.backends import reference
from service.backends.megakernel import MegakernelDecoder
from service.backends.reference import ReferenceDecoder, apply_rope, rms_norm
from service.model.config import ModelConfig
from service.model.synthetic import load_synthetic
from service.model.weights import ModelWeights

LAYOUTS = ["decode", "mixed", "half", "prompt"]  # row_layout's


def bandwidth() -> dict[str, float]:
    """Streaming read (a float32-accumulated sum over 2 GiB of bf16) and device-to-device copy, in GB/s."""
    n = (2 << 30) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def read() -> None:
        x.sum(dtype=torch.float32)

    def copy() -> None:
        y.copy_(x)

    for _ in range(3):
        read()
        copy()
    read_ms = statistics.median(events_ms(read, 20))
    copy_ms = statistics.median(events_ms(copy, 20))
    nbytes = x.numel() * 2
    return {"read_GBps": nbytes / read_ms / 1e6, "copy_GBps": 2 * nbytes / copy_ms / 1e6}


def add(records: list[dict], common: dict, backend: str, res: dict, **extra: object) -> None:
    rec = {"backend": backend, **common, **res, **extra}
    rec["floor_over_step"] = rec["floor_ms"] / rec["step_ms"]
    records.append(rec)
    rounds = rec.get("round_medians_ms")
    spread = f", rounds {min(rounds):.4f}-{max(rounds):.4f}" if rounds else ""
    print(f"{rec['model']:24s} B={rec['batch']:2d} ctx={rec['context']:5d} {backend:22s} {rec['step_ms']:.4f} ms "
          f"(floor {rec['floor_ms']:.4f}, {100 * rec['floor_over_step']:.0f}%{spread})", flush=True)


def kv_bytes(c: ModelConfig, batch: int, context: int) -> int:
    return 2 * batch * c.num_layers * context * c.kv_size * 2


def hf_model(c: ModelConfig):  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM

    rs = None
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rs = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
              "high_freq_factor": s.high_freq_factor,
              "original_max_position_embeddings": s.original_max_position_embeddings}
    hc = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                     num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                     rope_theta=c.rope_theta, rope_scaling=rs, tie_word_embeddings=True,
                     max_position_embeddings=max(c.max_position_embeddings, 8192))
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(hc)
    finally:
        torch.set_default_dtype(torch.float32)
    return model.eval()


def hf_step_ms(model, batch: int, context: int, vocab: int, static: bool, new_tokens: int = 34) -> float:  # noqa: ANN001
    """Median interval between decode steps of `generate` (a logits processor stamps each step)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):  # noqa: ANN001, ANN204
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return scores

    ids = torch.randint(0, vocab, (batch, context), device="cuda")
    kw = {"cache_implementation": "static"} if static else {}
    for _ in range(2):  # the first call warms up (and, with the static cache, compiles)
        stamps.clear()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                           logits_processor=LogitsProcessorList([Stamp()]), **kw)
    gaps = [1e3 * (b - a) for a, b in zip(stamps[1:], stamps[2:])]
    return statistics.median(gaps)


def timeline(dec: MegakernelDecoder, batch: int, context: int, layout: str = "decode") -> dict:
    """Per-phase times of one step, from the kernel's globaltimer stamps (KernelConfig(profile=True)): for each
    phase, from the previous phase's last end to its own last end (`phase_us`), from that end to its first task
    finding its inputs ready (`ready_after_us`), and its tasks' mean time from ready to end (`task_us`). layout: the
    rows' (row_layout)."""
    k = dec.kernel
    k.tokens[:batch] = 1
    k.slots[:batch], k.positions[:batch] = row_layout(batch, context, layout, min(batch, dec.max_batch))
    k.fill_blocks(batch)
    one_lm = layout == "prompt"  # a step of prompt rows alone samples one row: as the server runs it
    for _ in range(3):
        k.step(batch, blocked(dec, batch), one_lm)
    torch.cuda.synchronize()
    s = k.schedule(batch, one_lm)
    assert k.prof is not None, "the decoder's kernel config must profile"
    prof = k.prof[: len(s.tasks)].cpu().double()
    t0 = prof[:, 0].min()
    ready, end = prof[:, 1] - t0, prof[:, 2] - t0
    keys = [(int(r[I.F_LAYER]), int(r[I.F_OP])) for r in s.tasks]
    order = [(0, Op.EMBED)] + [(layer, op) for layer in range(dec.config.num_layers) for op in I.LAYER_OPS] + \
        [(0, Op.LMHEAD), (0, Op.ARGMAX)]
    phases: dict[str, list[list[float]]] = {}
    prev_end = 0.0
    for layer, op in order:
        idx = [i for i, kk in enumerate(keys) if kk == (layer, int(op))]
        ph_end = end[idx].max().item()
        work = (end[idx] - ready[idx]).mean().item()
        phases.setdefault(op.name, []).append([(ph_end - prev_end) / 1e3, (ready[idx].min().item() - prev_end) / 1e3,
                                               work / 1e3])
        prev_end = ph_end
    out: dict[str, Any] = {"step_us": end.max().item() / 1e3, "tasks": len(s.tasks), "phases": {}}
    # every task of layer 1's attention and its neighbours, for reading a phase's stragglers: (op, program, start,
    # ready, end) in µs from the layer's first QKV start
    prog = torch.repeat_interleave(torch.arange(k.num_programs), (s.starts[1:] - s.starts[:-1]).long())
    mine = [i for i, kk in enumerate(keys) if kk[0] == 1 and kk[1] in (int(Op.QKV), int(Op.ATTN), int(Op.OPROJ))]
    t1 = prof[mine, 0].min()
    out["layer1_tasks"] = [[Op(keys[i][1]).name, int(prog[i]), round((prof[i, 0] - t1).item() / 1e3, 2),
                            round((prof[i, 1] - t1).item() / 1e3, 2), round((prof[i, 2] - t1).item() / 1e3, 2)]
                           for i in mine]
    for name, v in phases.items():
        t = torch.tensor(v)
        out["phases"][name] = {"count": len(v), "phase_us": t[:, 0].mean().item(), "sum_us": t[:, 0].sum().item(),
                               "ready_after_us": t[:, 1].mean().item(), "task_us": t[:, 2].mean().item()}
    return out


def static_cache_step(config: ModelConfig, weights: ModelWeights, cos: torch.Tensor, sin: torch.Tensor,
                      x: torch.Tensor, position: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]
                      ) -> torch.Tensor:
    """gpt-fast's decode step: every row of x [rows, 1, hidden] at `position` (a one-element tensor), over a static
    cache of one tensor per layer ([rows, kv heads, length, head_dim], rows = slots, written in place at the
    position), attending over all of it through a mask; the reference decoder's own layer arithmetic
    (service/backends/reference.py). Returns float32 logits [rows, vocab]. The same function in float32 is the
    exact answer the bench checks the kernel against (its products through reference.linear, which the W8A8 oracle
    patches)."""
    c = config
    b = x.shape[0]
    mask = (torch.arange(ks[0].shape[2], device=x.device) <= position)[None, None, None, :]
    cos_p, sin_p = cos[position][None, None], sin[position][None, None]  # [1, 1, 1, head_dim/2]
    for lw, kc, vc in zip(weights.layers, ks, vs):
        h = rms_norm(x, lw.attn_norm, c.rms_norm_eps)
        q = reference.linear(h, lw.wq, lw.bq).view(b, 1, c.num_heads, c.head_dim).transpose(1, 2)
        k = reference.linear(h, lw.wk, lw.bk).view(b, 1, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = reference.linear(h, lw.wv, lw.bv).view(b, 1, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos_p, sin_p), apply_rope(k, cos_p, sin_p)
        kc.index_copy_(2, position, k)
        vc.index_copy_(2, position, v)
        attn = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
        x = x + reference.linear(attn.transpose(1, 2).reshape(b, 1, -1), lw.wo)
        h = rms_norm(x, lw.mlp_norm, c.rms_norm_eps)
        x = x + reference.linear(F.silu(reference.linear(h, lw.w_gate)) * reference.linear(h, lw.w_up), lw.w_down)
    return reference.linear(rms_norm(x[:, 0], weights.final_norm, c.rms_norm_eps), weights.lm_head).float()


def static_caches(ref: ReferenceDecoder, rows: int, length: int, dtype: torch.dtype
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Slots [0, rows) of the decoder's cache, positions [0, length), as one tensor per layer (copies)."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        return t[:rows, :, :length].to(dtype).clone(memory_format=torch.contiguous_format)

    return [copy(t) for t in ref.cache.k], [copy(t) for t in ref.cache.v]


def row_layout(batch: int, context: int, layout: str, sampled: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots and positions of a timed step's rows. "decode": every row its own slot, at the context. "mixed": the
    first `sampled` rows decode (their own slots, at the context); the others are one prompt's chunk in slot
    `sampled`, at the positions just before the context (new tokens over a cached prefix: each row attends over
    the whole prefix, which per-row attention reads once per row). "half": the same with half the rows decoding.
    "prompt": every row one prompt's chunk in slot 0, its last row at the context (a step with no decode row)."""
    if layout == "decode":
        return (torch.arange(batch, device="cuda", dtype=torch.int32),
                torch.full((batch,), context, device="cuda", dtype=torch.int32))
    if layout == "prompt":
        return (torch.zeros(batch, device="cuda", dtype=torch.int32),
                torch.arange(context - batch + 1, context + 1, device="cuda", dtype=torch.int32))
    sampled = batch // 2 if layout == "half" else sampled
    n = batch - sampled
    slots = torch.cat([torch.arange(sampled), torch.full((n,), sampled)])
    positions = torch.cat([torch.full((sampled,), context), torch.arange(context - n, context)])
    return slots.to("cuda", torch.int32), positions.to("cuda", torch.int32)


# the weights of each matvec's products (bench.fp8_quality.w8a8_of's names)
OP_WEIGHTS = {Op.QKV: ("wq", "wk", "wv"), Op.OPROJ: ("wo",), Op.GATEUP: ("w_gate", "w_up"), Op.DOWN: ("w_down",),
              Op.LMHEAD: ("lm_head",)}


def w8a8_names(dec: MegakernelDecoder, batch: int) -> tuple[str, ...]:
    """The products a launch of `batch` rows runs W8A8, as w8a8_of names them: each weight with its activations'
    scale group, the tile's k chunk ("w_gate:256", "lm_head:64")."""
    return tuple(f"{n}:{t.k_chunk}" for op, t in dec.kernel.tiles(batch).items() if t.w8a8 for n in OP_WEIGHTS[op])


def check_logits(dec: MegakernelDecoder, tokens: torch.Tensor, context: int, f32: ModelWeights,
                 rows: int, w8a8: tuple[str, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """For the first `rows` rows of the step the bench times: the bf16 reference decoder's logits (its K/V rewritten
    at `context` as the kernel's step does) and the float32 answer (the same model in float32 over the same
    cache), to check each variant against before its time counts; with `w8a8` (w8a8_names) both quantize those
    products' activations as the W8A8 tiles do."""
    ref = dec.reference
    picks = [w8a8_of(w, w8a8) for w in (ref.weights, f32)]

    def pick(w: torch.Tensor) -> bool | int:  # either oracle's weights: the product's own group, or False
        return next((c for c in (p(w) for p in picks) if c is not False), False)

    quantized = w8a8_products(W8A8_CHUNK, pick) if w8a8 else contextlib.nullcontext()
    with torch.inference_mode(), quantized:
        x = ref.weights.embed[tokens[:rows].long()].unsqueeze(1)
        bf16 = ref.decode_tensors(x, torch.arange(rows, device="cuda"), torch.full((rows,), context, device="cuda"),
                                  context + 1).float()
        ks, vs = static_caches(ref, rows, context + 1, torch.float32)
        exact = static_cache_step(ref.config, f32, ref.cos, ref.sin, f32.embed[tokens[:rows].long()].unsqueeze(1),
                                  torch.tensor([context], device="cuda"), ks, vs)
    return bf16, exact


def blocked(dec: MegakernelDecoder, batch: int) -> bool:
    """Whether the bench runs a step of `batch` rows (their blocks filled) through the variant's query blocks' launch:
    wherever its rows may take it, whatever the positions' threshold (the bench times the launch itself; the decoder
    takes it only for steps that pay: kernels/query_blocks.py uses_blocks). A launch that runs blocks only
    (block_min_positions over 0) takes steps whose every row is in a block of several; one with the rows' own path
    too, any step with a block."""
    k = dec.kernel
    if not k.block_queries:
        return False
    return uses_blocks(k.blocks[:, :batch].tolist(), batch, 1 if k.cfg.block_min_positions > 0 else 0)


def rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """The worst row's relative L2 distance of x from y."""
    return ((x - y).norm(dim=-1) / y.norm(dim=-1)).max().item()


def compiled_peer(ref: ReferenceDecoder, tokens: torch.Tensor, context: int
                  ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The gpt-fast recipe on the reference decoder's weights: static_cache_step compiled by Inductor (default
    mode) over a static cache of the context the step needs (context + 1 positions, one tensor per layer, the
    rows' own slots), then captured in a CUDA graph; and the buffer each replay leaves its logits in. Issue 22's
    in-run peer (7.28 ms at every Llama shape) compiled ReferenceDecoder.decode_tensors over the whole allocated
    context: its K/V writes into views of the one layer-stacked cache made Inductor copy that whole cache (every
    slot, every position) every step (seen in Inductor's generated code on the CPU)."""
    batch = len(tokens)
    ks, vs = static_caches(ref, batch, context + 1, ref.dtype)
    x = ref.weights.embed[tokens.long()].unsqueeze(1)
    position = torch.tensor([context], device="cuda")
    step = torch.compile(static_cache_step, dynamic=False)
    c, w, cos, sin = ref.config, ref.weights, ref.cos, ref.sin
    logits = torch.empty(batch, c.vocab_size, device="cuda", dtype=torch.float32)
    with torch.inference_mode():
        for _ in range(3):
            step(c, w, cos, sin, x, position, ks, vs)
        torch.cuda.synchronize()
        return graph_of(lambda: logits.copy_(step(c, w, cos, sin, x, position, ks, vs))), logits


WEIGHT_FORMATS = ("bf16", "fp8", "int8", "int8-row")  # what --weights and --wide-weights take


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "qwen2.5-1.5b", "smollm2-135m"])
    formats = list(WEIGHT_FORMATS)
    ap.add_argument("--weights", nargs="+", default=formats, choices=formats)
    ap.add_argument("--int8-models", nargs="*", default=["llama-3.2-1b"],
                    help="models timed with int8 weights where --weights names int8 or int8-row (the default run "
                    "stays short)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--wide-batches", nargs="*", type=int, default=[32, 64],
                    help="row counts timed for --wide-models only (steps of prompt rows and decode rows)")
    ap.add_argument("--wide-models", nargs="*", default=["llama-3.2-1b"])
    ap.add_argument("--wide-weights", nargs="*", default=["bf16"], choices=formats)
    ap.add_argument("--sampled", type=int, default=16,
                    help="rows a step samples at most (max_batch): the LM head's rows in the wide steps")
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 2048])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    ap.add_argument("--timeline", nargs="*", default=[],
                    help="variants to profile per phase (--timeline-rows, --timeline-contexts)")
    ap.add_argument("--timeline-rows", nargs="+", type=int, default=[1], help="rows of the profiled steps")
    ap.add_argument("--timeline-contexts", nargs="+", type=int, default=[128],
                    help="contexts of the profiled steps (each at most the largest of --contexts)")
    ap.add_argument("--timeline-layouts", nargs="+", default=["decode"], choices=LAYOUTS,
                    help="row layouts of the profiled steps (row_layout)")
    ap.add_argument("--layouts", nargs="*", default=[], choices=["half", "prompt"],
                    help="row layouts timed beside decode (and mixed, past --sampled rows) at every row count over 1; "
                    "their variants are checked against the default's logits (the oracle reads decode rows only)")
    ap.add_argument("--timeline-models", nargs="*", default=None, help="models to profile (default: every model)")
    ap.add_argument("--timeline-weights", nargs="*", default=None, help="weights to profile (default: every format)")
    ap.add_argument("--no-peers", action="store_true", help="no reference, no compiled step (see --no-library-peer)")
    ap.add_argument("--no-library-peer", action="store_true", help="skip the step's matrices as library calls")
    ap.add_argument("--compiled-batches", nargs="*", type=int, default=[1, 8],
                    help="batches the compiled peer runs at (each batch and context is a torch.compile)")
    ap.add_argument("--compiled-models", nargs="*", default=["llama-3.2-1b"])
    ap.add_argument("--hf", action="store_true", help="also Hugging Face generate (eager, static cache)")
    ap.add_argument("--hf-static-budget-s", type=float, default=300.0)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new (model, weights) runs after this many seconds (what ran is saved)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--append", action="store_true",
                    help="add to the result files' records instead of replacing them (several runs, one table)")
    args = ap.parse_args()

    import triton

    t_start = time.time()
    # the bench never prefills: no prefill graphs (54 captures per decoder at this context)
    ReferenceDecoder._capture_prefill_graphs = lambda self: setattr(self, "graph_prefill", False)  # type: ignore
    dev_name = torch.cuda.get_device_name()
    bw = bandwidth()
    torch.cuda.empty_cache()
    print(f"{dev_name}: streaming read {bw['read_GBps']:.0f} GB/s, d2d copy {bw['copy_GBps']:.0f} GB/s", flush=True)
    records: list[dict] = []
    timelines: list[dict] = []
    skipped: list[str] = []
    max_ctx = max(args.contexts) + 64
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode-" + dev_name.replace(" ", "-") + (f"-{args.tag}" if args.tag else "")
    doc = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__, "bandwidth": bw,
           "note": "synthetic weights (seeded random, the real shapes): decode cost does not depend on weight values",
           "records": records, "timelines": timelines, "skipped": skipped}
    earlier = out / f"{stem}.json"
    if args.append and earlier.exists():  # each run's records carry the floor from its own bandwidth measurement
        old = json.loads(earlier.read_text())
        records += old["records"]
        timelines += old.get("timelines", [])

    def save() -> None:  # after every batch, so that a run cut short still leaves its numbers
        (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
        (out / f"{stem}.md").write_text(markdown(doc))

    for model_name in args.models:
        t_static = 0.0  # the static-cache budget is per model
        config, weights, _ = load_synthetic(model_name, device="cuda", dtype=torch.bfloat16)
        hf = None
        if args.hf:
            try:
                hf = hf_model(config)
            except Exception as e:  # noqa: BLE001
                print("hf model failed:", repr(e)[:300], flush=True)
        f32: ModelWeights | None = None  # the float32 answer's weights
        for fmt in args.weights:
            if args.budget_s is not None and time.time() - t_start > args.budget_s:
                skipped.append(f"{model_name} {fmt}")
                print(f"SKIPPED {model_name} {fmt}: past the {args.budget_s:.0f} s budget", flush=True)
                continue
            if fmt.startswith("int8") and model_name not in args.int8_models:
                continue
            eight_bit = fmt != "bf16"
            batches = args.batches + (args.wide_batches if model_name in args.wide_models and
                                      fmt in args.wide_weights else [])
            rows_max = max(batches)
            lib = {} if args.no_library_peer else library_peer(config, fmt, batches, args.sampled, args.reps)
            base = MegakernelDecoder(config, weights, max_slots=rows_max, max_context=max_ctx, weight_format=fmt,
                                     max_rows=rows_max, max_batch=min(args.sampled, rows_max))
            base.reference.cache.k.normal_()  # time on random K/V, never zeros
            base.reference.cache.v.normal_()
            # the float32 answer of the weights the kernel streams (with FP8 or int8, their dequantized values)
            f32 = None
            f32 = base.reference.weights.to("cuda", torch.float32)
            decoders = {v: base.with_kernel_config(VARIANTS[v](fmt)) for v in ["default", *args.variants]}
            wbytes = base.kernel.w.nbytes()
            profile = (args.timeline_models is None or model_name in args.timeline_models) and \
                (args.timeline_weights is None or fmt in args.timeline_weights)
            profiled = [(v, r, c, lay) for v in args.timeline for r in args.timeline_rows
                        for c in args.timeline_contexts for lay in args.timeline_layouts]
            for v, t_rows, t_ctx, t_lay in profiled if profile else []:
                rows = base.bucket(min(t_rows, rows_max))  # a bucket of rows this decoder has slots for
                dec = base.with_kernel_config(dataclasses.replace(VARIANTS[v](fmt), profile=True),
                                              use_cuda_graphs=False)
                tl_ = {"model": f"synthetic:{model_name}", "weights": fmt, "variant": v, "batch": rows,
                       "context": t_ctx, "layout": t_lay, **timeline(dec, rows, t_ctx, t_lay)}
                timelines.append(tl_)
                print(f"TIMELINE {model_name} {fmt} {v} B={rows} ctx={t_ctx} {t_lay}: {tl_['step_us']:.1f} us "
                      + ", ".join(f"{n} {p['phase_us']:.2f}" for n, p in tl_["phases"].items()), flush=True)
                del dec
            for batch in batches:
                sampled = min(batch, base.max_batch)  # rows with logits: the LM head's rows
                layouts = (["decode", "mixed"] if batch > sampled else ["decode"]) + \
                    [lay for lay in args.layouts if batch > 1]
                for context, layout in [(c, lay) for c in args.contexts for lay in layouts]:
                    row_slots, row_positions = row_layout(batch, context, layout, sampled)
                    # a step of prompt rows alone samples its last row only, in the launch whose LM head takes one
                    # row where the bucket has one (Megakernel.has_one_lm_row), as the server runs it
                    one_lm = layout == "prompt"
                    lm = 1 if one_lm else sampled
                    # distinct K/V
                    kv = kv_bytes(config, {"decode": batch, "mixed": sampled + 1, "half": batch // 2 + 1,
                                           "prompt": 1}[layout], context)
                    floor = (wbytes + kv) / (bw["read_GBps"] * 1e6)
                    common = {"model": f"synthetic:{model_name}", "weights": fmt, "batch": batch,
                              "sampled_rows": lm, "layout": layout, "context": context, "floor_ms": floor,
                              "weight_bytes": wbytes, "kv_bytes": kv}
                    tokens = torch.randint(0, config.vocab_size, (batch,), device="cuda", dtype=torch.int32)
                    # the oracles of each set of W8A8 products the variants run at this row count; () the weight-only
                    # one (the peers')
                    own_oracle = layout in ("decode", "mixed")  # else: the default variant's logits
                    oracles: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, float]] = {}
                    if own_oracle:
                        want, exact = check_logits(base, tokens, context, f32, sampled)
                        oracles[()] = (want, exact, rel_err(want, exact))
                    checked: dict[str, tuple[MegakernelDecoder, float, float, float]] = {}
                    for v, dec in decoders.items():
                        k = dec.kernel
                        k.tokens[:batch] = tokens
                        k.slots[:batch] = row_slots
                        k.positions[:batch] = row_positions
                        k.fill_blocks(batch)
                        try:  # a variant that does not compile at this shape (shared memory, registers) is no result
                            dec.run_step(batch, blocked(dec, batch), one_lm)
                            torch.cuda.synchronize()
                        except Exception as e:  # noqa: BLE001
                            print(f"   {v} at {batch} rows failed: {repr(e)[:300]}", flush=True)
                            continue
                        dec.check_errors()
                        # before timing: as close to the float32 answer as the bf16 reference decoder is (a broken
                        # variant is no result)
                        names = w8a8_names(dec, batch)
                        got = k.logits[:lm]
                        if not own_oracle:
                            if v == "default":
                                default_logits = got.clone()
                            oracles[names] = (default_logits, default_logits, 0.0)
                        elif names not in oracles:
                            want, exact = check_logits(base, tokens, context, f32, sampled, names)
                            oracles[names] = (want, exact, rel_err(want, exact))  # how far two correct ones stray
                        want, exact, ref_err = oracles[names]
                        checked[v] = (dec, rel_err(got, want), rel_err(got, exact), ref_err)
                    # every variant that ran, timed in turns (position and drift fall on each alike)
                    graphs = {v: c[0].graph(batch, blocked(c[0], batch), one_lm).replay for v, c in checked.items()}
                    timed = time_in_turns(graphs, args.reps)
                    for v, (dec, err, err32, ref_err) in checked.items():
                        k = dec.kernel
                        dec.check_errors()
                        name = "megakernel" if v == "default" else f"megakernel[{v}]"
                        add(records, common, name, timed[v], schedule=k.schedule(batch, one_lm).describe(),
                            rel_err_vs_reference=err, rel_err_vs_fp32=err32, reference_rel_err_vs_fp32=ref_err,
                            oracle_w8a8=list(w8a8_names(dec, batch)))
                        if err32 > max(0.05, 1.5 * ref_err):
                            print(f"   {name}: logits {err32:.3f} away from the float32 answer, the bf16 reference "
                                  f"{ref_err:.3f}: WRONG", flush=True)
                        if v == "default" and own_oracle:  # the same step, every row sampling at T=1 (in the kernel)
                            k.draw[0, :batch] = torch.ones(batch, device="cuda").view(torch.int32)
                            k.draw[1:3, :batch] = torch.randint(-2**31, 2**31 - 1, (2, batch), device="cuda",
                                                               dtype=torch.int32)
                            res = time_graph(dec.graph(batch), args.reps)
                            dec.check_errors()
                            k.draw.zero_()
                            add(records, common, f"{name}, sampling T=1", res)
                    if batch in lib and own_oracle:  # once per row count: it has no attention, so no context
                        add(records, common, LIBRARY_PEER, lib[batch])
                    if own_oracle and not args.no_peers and not eight_bit and batch in args.batches:
                        ref: ReferenceDecoder = base.reference
                        x = ref.weights.embed[torch.randint(0, config.vocab_size, (batch,), device="cuda")]
                        x = x.unsqueeze(1)
                        sl = torch.arange(batch, device="cuda")
                        ps = torch.full((batch,), context, device="cuda")
                        with torch.inference_mode():
                            g = graph_of(lambda: ref.decode_tensors(x, sl, ps, context + 1))  # noqa: B023
                        add(records, common, "reference-cudagraph", time_graph(g, args.reps))
                        del g
                        if batch in args.compiled_batches and model_name in args.compiled_models:
                            try:
                                g, logits = compiled_peer(ref, tokens, context)
                                res = time_graph(g, args.reps)
                                _, exact, ref_err = oracles[()]
                                peer_err = rel_err(logits[:sampled], exact)
                                add(records, common, "compiled-pytorch-cudagraph", res, rel_err_vs_fp32=peer_err)
                                if peer_err > max(0.05, 1.5 * ref_err):
                                    print(f"   compiled peer: logits {peer_err:.3f} from the float32 answer: WRONG",
                                          flush=True)
                                del g
                            except Exception as e:  # noqa: BLE001
                                print("compiled peer failed:", repr(e)[:500], flush=True)
                    if hf is not None and not eight_bit and batch in args.batches:
                        try:
                            ms = hf_step_ms(hf, batch, context, config.vocab_size, False)
                            add(records, common, "hf-generate-eager", {"step_ms": ms})
                        except Exception as e:  # noqa: BLE001
                            print("hf eager failed:", repr(e)[:300], flush=True)
                        if t_static < args.hf_static_budget_s / len(args.models):
                            t0 = time.time()
                            try:
                                ms = hf_step_ms(hf, batch, context, config.vocab_size, True)
                                add(records, common, "hf-generate-static", {"step_ms": ms})
                            except Exception as e:  # noqa: BLE001
                                print("hf static failed:", repr(e)[:300], flush=True)
                            t_static += time.time() - t0
                    save()
            del decoders, base
            torch.cuda.empty_cache()
        del weights, hf, f32
        torch.cuda.empty_cache()
    save()
    print(markdown(doc))
    print(f"decode bench: {time.time() - t_start:.0f} s", flush=True)


def markdown(doc: dict) -> str:
    recs = doc["records"]
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    keys = list(dict.fromkeys((r["model"], r["weights"], r["batch"], r["context"], r.get("layout", "decode"))
                              for r in recs))
    bw = doc["bandwidth"]
    lines = [
        f"# Decode step on {doc['device']}",
        "",
        f"torch {doc['torch']}, Triton {doc['triton']}. Bandwidth measured in the same run: streaming read "
        f"{bw['read_GBps']:.0f} GB/s, device-to-device copy {bw['copy_GBps']:.0f} GB/s (read + written).",
        "Weights are synthetic (seeded random, the real shapes): decode cost does not depend on weight values.",
        "Floor = (weights in their format + K/V of the context) / streaming-read bandwidth. Times in ms per decode "
        "step: the median of CUDA-graph replays (megakernel, reference, compiled PyTorch), or the median interval "
        "between steps of `generate` (Hugging Face). In brackets: floor / time. The peers run bf16 weights. Rows: "
        "the step's rows, each at the context, in its own slot (in brackets, those with logits where fewer: the LM "
        "head's rows); \"mixed\": those rows decode, the others are one prompt's chunk just before the context.",
        *([f"{LIBRARY_PEER}: the step's matrices alone (each layer's QKV, O, gate/up and down, the LM head over the "
           "sampled rows) as cuBLAS bf16 or FP8 W8A8 `torch._scaled_mm` calls (activations quantized per row in the "
           "graph, rows padded to 16), in the row's weights, chained in one CUDA graph; it leaves out attention, "
           "norms and sampling, so it is a lower bound for a library-built step (the same measurement at every "
           "context)."] if LIBRARY_PEER in backends else []),
        "",
        "| model | weights | rows | context | floor | " + " | ".join(backends) + " |",
        "| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in backends) + " |",
    ]
    for key in keys:
        row = {r["backend"]: r for r in recs
               if (r["model"], r["weights"], r["batch"], r["context"], r.get("layout", "decode")) == key}
        floor = next(iter(row.values()))["floor_ms"]
        cells = [f"{row[b]['step_ms']:.3f} ({100 * row[b]['floor_over_step']:.0f}%)" if b in row else "–"
                 for b in backends]
        sampled = next(iter(row.values())).get("sampled_rows", key[2])
        rows = f"{key[2]} ({sampled})" if sampled < key[2] else f"{key[2]}"
        rows += f" {key[4]}" if key[4] != "decode" else ""
        lines.append(f"| {key[0]} | {key[1]} | {rows} | {key[3]} | {floor:.3f} | " + " | ".join(cells) + " |")
    if doc.get("timelines"):
        lines += ["", "## Per-phase timeline (µs per phase, mean over layers)", "",
                  "| model | weights | variant | rows | context | step (µs, kernel-internal) | " +
                  " | ".join(o.name for o in Op) + " |",
                  "| --- | --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in Op) + " |"]
        for t in doc["timelines"]:
            cells = [f"{t['phases'][o.name]['phase_us']:.2f}" if o.name in t["phases"] else "–" for o in Op]
            lay = f" {t['layout']}" if t.get("layout", "decode") != "decode" else ""
            lines.append(f"| {t['model']} | {t['weights']} | {t['variant']} | {t['batch']}{lay} | "
                         f"{t.get('context', 128)} | {t['step_us']:.1f} | " + " | ".join(cells) + " |")
    if doc.get("skipped"):
        lines += ["", "Not run (past the call's budget): " + ", ".join(doc["skipped"]) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
