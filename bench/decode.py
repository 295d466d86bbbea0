"""Decode-step benchmark: the megakernel against its peers and the memory-bandwidth floor, in one GPU run.

    python bench/decode.py [--out bench/results] [--models llama-3.2-1b qwen2.5-1.5b smollm2-135m]
                           [--weights bf16 fp8] [--batches 1 8] [--contexts 128 2048] [--variants tma pfown ...]
                           [--timeline default tma ...] [--hf] [--tag NAME]

Times, per (model, weights, batch, context): the megakernel (median of CUDA-graph replays; each variant named);
the peers measured in the same run: the PyTorch reference decoder's step captured in a CUDA graph, the same step
compiled by Inductor (torch.compile, default mode) and captured in a CUDA graph (the gpt-fast recipe, the
strongest peer an hour buys), and with --hf Hugging Face `generate` (eager, static cache). The floor is the bytes a
step must read (every weight once, in the weights' format, plus the K/V of the context) over the streaming-read
bandwidth measured in the same run. --timeline records, for the named variants at batch 1 and context 128, when
each task of the step started, found its inputs ready and ended (globaltimer), summed per phase.
Weights are synthetic (seeded random, the real shapes): decode cost does not depend on weight values.
Writes bench/results/decode-<device>[-TAG].json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import instructions as I  # noqa: E402
from kernels.instructions import Op  # noqa: E402
from kernels.megakernel import MATVECS, KernelConfig, MatvecTile, default_tiles  # noqa: E402
from service.backends.megakernel import MegakernelDecoder  # noqa: E402
from service.backends.reference import ReferenceDecoder  # noqa: E402
from service.model.config import ModelConfig  # noqa: E402
from service.model.synthetic import load_synthetic  # noqa: E402


def _tiles(fp8: bool, ops: tuple[Op, ...] = MATVECS, **change: object) -> dict[Op, MatvecTile]:
    tiles = default_tiles(fp8)
    return {op: dataclasses.replace(t, **change) if op in ops else t for op, t in tiles.items()}


# Kernel variants the bench can time beside the default (--variants NAME ...): each a function of whether the
# weights are FP8 (their default tiles differ). bench/NOTES.md says what each measured.
VARIANTS: dict[str, Callable[[bool], KernelConfig]] = {
    "default": lambda fp8: KernelConfig(),
    # weights through the tensor-memory accelerator in every matvec (boxes of at most 256 columns)
    "tma": lambda fp8: KernelConfig(tiles=_tiles(fp8, tma=True, k_chunk=256, stages=6 if fp8 else 4)),
    "lm-pointers": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.LMHEAD,), tma=False)),
    "one-stream": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.OPROJ, Op.DOWN), k_halves=False)),
    # weights prefetched into L2 a task ahead instead of before each task's own wait
    "pf-ahead": lambda fp8: KernelConfig(prefetch_own=False, prefetch_ahead=1),
    "no-kv-prefetch": lambda fp8: KernelConfig(prefetch_kv=False),
    "pft2": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.GATEUP,), prefetch_tiles=2)),
    "st6": lambda fp8: KernelConfig(tiles=_tiles(fp8, stages=6)),
    "qkv8": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.QKV,), rows=8)),
    "bk2x": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.QKV, Op.OPROJ, Op.DOWN), k_chunk=1024 if fp8 else 512)),
    "invariant": lambda fp8: KernelConfig(batch_invariant=True),
}


def events_ms(fn, reps: int) -> list[float]:  # noqa: ANN001
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


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


def graph_of(fn) -> torch.cuda.CUDAGraph:  # noqa: ANN001
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph(g: torch.cuda.CUDAGraph, reps: int) -> dict[str, float]:
    for _ in range(20):
        g.replay()
    per = events_ms(g.replay, reps)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return {"step_ms": statistics.median(per), "step_ms_min": min(per),
            "step_ms_back_to_back": a.elapsed_time(b) / reps}


def add(records: list[dict], common: dict, backend: str, res: dict, **extra: object) -> None:
    rec = {"backend": backend, **common, **res, **extra}
    rec["floor_over_step"] = rec["floor_ms"] / rec["step_ms"]
    records.append(rec)
    print(f"{rec['model']:24s} B={rec['batch']:2d} ctx={rec['context']:5d} {backend:22s} {rec['step_ms']:.4f} ms "
          f"(floor {rec['floor_ms']:.4f}, {100 * rec['floor_over_step']:.0f}%)", flush=True)


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


def timeline(dec: MegakernelDecoder, batch: int, context: int) -> dict:
    """Per-phase times of one step, from the kernel's globaltimer stamps (KernelConfig(profile=True)): for each
    phase, from the previous phase's last end to its own last end (`phase_us`), from that end to its first task
    finding its inputs ready (`ready_after_us`), and its tasks' mean time from ready to end (`task_us`)."""
    k = dec.kernel
    k.tokens[:batch] = 1
    k.slots[:batch] = torch.arange(batch, device="cuda", dtype=torch.int32)
    k.positions[:batch] = context
    for _ in range(3):
        k.step(batch)
    torch.cuda.synchronize()
    s = k.schedule(batch)
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
    out = {"step_us": end.max().item() / 1e3, "tasks": len(s.tasks), "phases": {}}
    for name, v in phases.items():
        t = torch.tensor(v)
        out["phases"][name] = {"count": len(v), "phase_us": t[:, 0].mean().item(), "sum_us": t[:, 0].sum().item(),
                               "ready_after_us": t[:, 1].mean().item(), "task_us": t[:, 2].mean().item()}
    return out


def check_logits(dec: MegakernelDecoder, tokens: torch.Tensor, context: int) -> torch.Tensor:
    """The reference decoder's logits for the step the bench times (its K/V rewritten at `context` as the kernel's
    step does), to check each variant against before its time counts."""
    batch = len(tokens)
    ref = dec.reference
    with torch.inference_mode():
        x = ref.weights.embed[tokens.long()].unsqueeze(1)
        return ref.decode_tensors(x, torch.arange(batch, device="cuda"), torch.full((batch,), context, device="cuda"),
                                  context + 1).float()


def compiled_peer(ref: ReferenceDecoder, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                  kv_len: int) -> torch.cuda.CUDAGraph:
    """The reference step compiled by Inductor (default mode) and captured in a CUDA graph: gpt-fast's recipe."""
    step = torch.compile(ref.decode_tensors, dynamic=False)
    with torch.inference_mode():
        for _ in range(3):
            step(x, slots, positions, kv_len)
        torch.cuda.synchronize()
        return graph_of(lambda: step(x, slots, positions, kv_len))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "qwen2.5-1.5b", "smollm2-135m"])
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 2048])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    ap.add_argument("--timeline", nargs="*", default=[], help="variants to profile per phase (B=1, context 128)")
    ap.add_argument("--no-peers", action="store_true", help="the megakernel only (no reference, no compiled step)")
    ap.add_argument("--compiled-batches", nargs="*", type=int, default=None,
                    help="batches the compiled peer runs at (default: every batch; each is a torch.compile)")
    ap.add_argument("--hf", action="store_true", help="also Hugging Face generate (eager, static cache)")
    ap.add_argument("--hf-static-budget-s", type=float, default=300.0)
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--append", action="store_true",
                    help="add to the result files' records instead of replacing them (several runs, one table)")
    args = ap.parse_args()

    import triton

    dev_name = torch.cuda.get_device_name()
    bw = bandwidth()
    torch.cuda.empty_cache()
    print(f"{dev_name}: streaming read {bw['read_GBps']:.0f} GB/s, d2d copy {bw['copy_GBps']:.0f} GB/s", flush=True)
    records: list[dict] = []
    timelines: list[dict] = []
    max_ctx = max(args.contexts) + 64
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode-" + dev_name.replace(" ", "-") + (f"-{args.tag}" if args.tag else "")
    doc = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__, "bandwidth": bw,
           "note": "synthetic weights (seeded random, the real shapes): decode cost does not depend on weight values",
           "records": records, "timelines": timelines}
    earlier = out / f"{stem}.json"
    if args.append and earlier.exists():  # each run's records carry the floor from its own bandwidth measurement
        old = json.loads(earlier.read_text())
        records += old["records"]
        timelines += old.get("timelines", [])

    def save() -> None:  # after every model, so that a run cut short still leaves its numbers
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
        for fmt in args.weights:
            fp8 = fmt == "fp8"
            base = MegakernelDecoder(config, weights, max_slots=max(args.batches), max_context=max_ctx,
                                     weight_format=fmt)
            base.reference.cache.k.normal_()  # time on random K/V, never zeros
            base.reference.cache.v.normal_()
            decoders = {v: base.with_kernel_config(VARIANTS[v](fp8)) for v in ["default", *args.variants]}
            wbytes = base.kernel.w.nbytes()
            for v in args.timeline:
                dec = base.with_kernel_config(dataclasses.replace(VARIANTS[v](fp8), profile=True),
                                              use_cuda_graphs=False)
                tl_ = {"model": f"synthetic:{model_name}", "weights": fmt, "variant": v, "batch": 1, "context": 128,
                       **timeline(dec, 1, 128)}
                timelines.append(tl_)
                print(f"TIMELINE {model_name} {fmt} {v}: {tl_['step_us']:.1f} us " + ", ".join(
                    f"{n} {p['phase_us']:.2f}" for n, p in tl_["phases"].items()), flush=True)
                del dec
            for batch in args.batches:
                for context in args.contexts:
                    floor = (wbytes + kv_bytes(config, batch, context)) / (bw["read_GBps"] * 1e6)
                    common = {"model": f"synthetic:{model_name}", "weights": fmt, "batch": batch,
                              "context": context, "floor_ms": floor, "weight_bytes": wbytes,
                              "kv_bytes": kv_bytes(config, batch, context)}
                    tokens = torch.randint(0, config.vocab_size, (batch,), device="cuda", dtype=torch.int32)
                    want = check_logits(base, tokens, context)
                    for v, dec in decoders.items():
                        k = dec.kernel
                        k.tokens[:batch] = tokens
                        k.slots[:batch] = torch.arange(batch, device="cuda", dtype=torch.int32)
                        k.positions[:batch] = context
                        dec.run_step(batch)
                        torch.cuda.synchronize()
                        dec.check_errors()
                        # before timing: the same logits as the reference decoder's (a broken variant is no result)
                        err = ((k.logits[:batch] - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
                        res = time_graph(dec._graphs[batch], args.reps)
                        dec.check_errors()
                        name = "megakernel" if v == "default" else f"megakernel[{v}]"
                        add(records, common, name, res, schedule=k.schedule(batch).describe(), rel_err_vs_reference=err)
                        if err > 0.05:
                            print(f"   {name}: logits {err:.3f} away from the reference decoder's: WRONG", flush=True)
                        if v == "default":  # the same step with every row sampling at temperature 1 (in the kernel)
                            k.draw[0, :batch] = torch.ones(batch, device="cuda").view(torch.int32)
                            k.draw[1:, :batch] = torch.randint(-2**31, 2**31 - 1, (2, batch), device="cuda",
                                                               dtype=torch.int32)
                            res = time_graph(dec._graphs[batch], args.reps)
                            dec.check_errors()
                            k.draw.zero_()
                            add(records, common, f"{name}, sampling T=1", res)
                    if not args.no_peers and not fp8:
                        ref: ReferenceDecoder = base.reference
                        x = ref.weights.embed[torch.randint(0, config.vocab_size, (batch,), device="cuda")]
                        x = x.unsqueeze(1)
                        sl = torch.arange(batch, device="cuda")
                        ps = torch.full((batch,), context, device="cuda")
                        with torch.inference_mode():
                            g = graph_of(lambda: ref.decode_tensors(x, sl, ps, context + 1))  # noqa: B023
                        add(records, common, "reference-cudagraph", time_graph(g, args.reps))
                        del g
                        if args.compiled_batches is None or batch in args.compiled_batches:
                            try:  # gpt-fast's static cache: attend over all of it, masked (one compile per batch)
                                g = compiled_peer(ref, x, sl, ps, max_ctx)
                                add(records, common, "compiled-pytorch-cudagraph", time_graph(g, args.reps))
                                del g
                            except Exception as e:  # noqa: BLE001
                                print("compiled peer failed:", repr(e)[:500], flush=True)
                    if hf is not None and not fp8:
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
        del weights, hf
        torch.cuda.empty_cache()
    save()
    print(markdown(doc))


def markdown(doc: dict) -> str:
    recs = doc["records"]
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    keys = list(dict.fromkeys((r["model"], r["weights"], r["batch"], r["context"]) for r in recs))
    bw = doc["bandwidth"]
    lines = [
        f"# Decode step on {doc['device']}",
        "",
        f"torch {doc['torch']}, Triton {doc['triton']}. Bandwidth measured in the same run: streaming read "
        f"{bw['read_GBps']:.0f} GB/s, device-to-device copy {bw['copy_GBps']:.0f} GB/s (read + written).",
        "Weights are synthetic (seeded random, the real shapes): decode cost does not depend on weight values.",
        "Floor = (weights in their format + K/V of the context) / streaming-read bandwidth. Times in ms per decode "
        "step: the median of CUDA-graph replays (megakernel, reference, compiled PyTorch), or the median interval "
        "between steps of `generate` (Hugging Face). In brackets: floor / time. The peers run bf16 weights.",
        "",
        "| model | weights | batch | context | floor | " + " | ".join(backends) + " |",
        "| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in backends) + " |",
    ]
    for key in keys:
        row = {r["backend"]: r for r in recs if (r["model"], r["weights"], r["batch"], r["context"]) == key}
        floor = next(iter(row.values()))["floor_ms"]
        cells = [f"{row[b]['step_ms']:.3f} ({100 * row[b]['floor_over_step']:.0f}%)" if b in row else "–"
                 for b in backends]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {floor:.3f} | " + " | ".join(cells) + " |")
    if doc.get("timelines"):
        lines += ["", "## Per-phase timeline (batch 1, context 128; µs per phase, mean over layers)", "",
                  "| model | weights | variant | step (µs, kernel-internal) | " +
                  " | ".join(o.name for o in Op) + " |",
                  "| --- | --- | --- | ---: | " + " | ".join("---:" for _ in Op) + " |"]
        for t in doc["timelines"]:
            cells = [f"{t['phases'][o.name]['phase_us']:.2f}" if o.name in t["phases"] else "–" for o in Op]
            lines.append(f"| {t['model']} | {t['weights']} | {t['variant']} | {t['step_us']:.1f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
