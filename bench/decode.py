"""Decode-step benchmark: the megakernel against its peers and the memory-bandwidth floor, in one GPU run.

    python bench/decode.py [--out bench/results] [--models llama-3.2-1b smollm2-135m] [--batches 1 8]
                           [--contexts 128 2048] [--skip-hf] [--variants pf0 pf2 ...]

Times, per (model, batch, context): the megakernel (median of CUDA-graph replays); the PyTorch reference decoder's
`decode_tensors` captured in a CUDA graph; Hugging Face transformers `generate`, eager (dynamic cache) and with the
static cache (which transformers compiles), as the median interval between decode steps. The floor is the bytes a
step must read (every weight once, plus the K/V of the context) over the streaming-read bandwidth measured here.
Weights are synthetic (seeded random, the real shapes): decode cost does not depend on weight values.
Writes bench/results/decode-<device>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.megakernel import KernelConfig  # noqa: E402
from service.backends.megakernel import MegakernelDecoder  # noqa: E402
from service.backends.reference import ReferenceDecoder  # noqa: E402
from service.model.config import ModelConfig  # noqa: E402
from service.model.synthetic import load_synthetic  # noqa: E402

VARIANTS: dict[str, KernelConfig] = {
    "default": KernelConfig(),
    "pf0": KernelConfig(prefetch_ahead=0),
    "pf2": KernelConfig(prefetch_ahead=2),
    "pfbig": KernelConfig(prefetch_bytes=256 << 10),
    "bk512": KernelConfig(bk_mv=512),
    "bk128": KernelConfig(bk_mv=128, bk_gu=128),
    "st3": KernelConfig(num_stages=3),
    "st6": KernelConfig(num_stages=6),
    "bn8": KernelConfig(bn_mv=8),
    "bn32": KernelConfig(bn_mv=32),
    "ch128": KernelConfig(chunk=128),
    "w8": KernelConfig(num_warps=8),
    "w4p2": KernelConfig(programs_per_sm=2),
    "noncoop": KernelConfig(cooperative=False),
    "bp16": KernelConfig(min_rows=16),
    "sm1": KernelConfig(split_min_chunks=1),
    "sm8": KernelConfig(split_min_chunks=8),
    "ks1": KernelConfig(k_split=1, k_split_lm=1),
    "ks2": KernelConfig(k_split=2),
    "lm4": KernelConfig(k_split_lm=4),
    "w8ks8": KernelConfig(num_warps=8, k_split=8, k_split_lm=4),
    "bp1st6": KernelConfig(min_rows=1, num_stages=6),
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "smollm2-135m"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--contexts", nargs="+", type=int, default=[128, 2048])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--hf-static-budget-s", type=float, default=300.0)
    args = ap.parse_args()

    import triton

    dev_name = torch.cuda.get_device_name()
    bw = bandwidth()
    torch.cuda.empty_cache()
    print(f"{dev_name}: streaming read {bw['read_GBps']:.0f} GB/s, d2d copy {bw['copy_GBps']:.0f} GB/s", flush=True)
    records: list[dict] = []
    max_ctx = max(args.contexts) + 64
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode-" + dev_name.replace(" ", "-")
    doc = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__, "bandwidth": bw,
           "note": "synthetic weights (seeded random, the real shapes): decode cost does not depend on weight values",
           "records": records}

    def save() -> None:  # after every model, so that a run cut short still leaves its numbers
        (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
        (out / f"{stem}.md").write_text(markdown(doc))

    for model_name in args.models:
        t_static = 0.0  # the static-cache budget is per model
        config, weights, _ = load_synthetic(model_name, device="cuda", dtype=torch.bfloat16)
        wbytes = weights.nbytes()
        decoders = {}
        for v in ["default", *args.variants]:
            decoders[v] = MegakernelDecoder(config, weights, max_slots=max(args.batches), max_context=max_ctx,
                                            kernel_config=VARIANTS[v])
        del weights
        base = decoders["default"]
        for dec in decoders.values():  # time on random K/V, never zeros
            dec.reference.cache.k.normal_()
            dec.reference.cache.v.normal_()
        hf = None
        if not args.skip_hf:
            try:
                hf = hf_model(config)
            except Exception as e:  # noqa: BLE001
                print("hf model failed:", repr(e)[:300], flush=True)
        for batch in args.batches:
            for context in args.contexts:
                floor = (wbytes + kv_bytes(config, batch, context)) / (bw["read_GBps"] * 1e6)
                common = {"model": f"synthetic:{model_name}", "batch": batch, "context": context,
                          "floor_ms": floor, "weight_bytes": wbytes, "kv_bytes": kv_bytes(config, batch, context)}

                for v, dec in decoders.items():
                    k = dec.kernel
                    k.tokens[:batch] = torch.randint(0, config.vocab_size, (batch,), device="cuda", dtype=torch.int32)
                    k.slots[:batch] = torch.arange(batch, device="cuda", dtype=torch.int32)
                    k.positions[:batch] = context
                    dec.run_step(batch)
                    torch.cuda.synchronize()
                    dec.check_errors()
                    res = time_graph(dec._graphs[batch], args.reps)
                    dec.check_errors()
                    name = "megakernel" if v == "default" else f"megakernel[{v}]"
                    add(records, common, name, res, schedule=k.schedule(batch).describe())
                    # the same step with every row sampling at temperature 1 (inside the kernel)
                    k.draw[0, :batch] = torch.ones(batch, device="cuda").view(torch.int32)
                    k.draw[1:, :batch] = torch.randint(-2**31, 2**31 - 1, (2, batch), device="cuda",
                                                       dtype=torch.int32)
                    res = time_graph(dec._graphs[batch], args.reps)
                    dec.check_errors()
                    k.draw.zero_()
                    add(records, common, f"{name}, sampling T=1", res)
                if not args.skip_reference:
                    ref: ReferenceDecoder = base.reference
                    x = ref.weights.embed[torch.randint(0, config.vocab_size, (batch,), device="cuda")].unsqueeze(1)
                    sl = torch.arange(batch, device="cuda")
                    ps = torch.full((batch,), context, device="cuda")
                    with torch.inference_mode():
                        g = graph_of(lambda: ref.decode_tensors(x, sl, ps, context + 1))  # noqa: B023
                    add(records, common, "reference-cudagraph", time_graph(g, args.reps))
                    del g
                if hf is not None:
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
                    else:
                        print("hf static: skipped (time budget)", flush=True)
            save()
        del decoders, base, hf
        torch.cuda.empty_cache()
    save()
    print(markdown(doc))


def markdown(doc: dict) -> str:
    recs = doc["records"]
    backends = list(dict.fromkeys(r["backend"] for r in recs))
    keys = list(dict.fromkeys((r["model"], r["batch"], r["context"]) for r in recs))
    bw = doc["bandwidth"]
    lines = [
        f"# Decode step on {doc['device']}",
        "",
        f"torch {doc['torch']}, Triton {doc['triton']}. Bandwidth measured in the same run: streaming read "
        f"{bw['read_GBps']:.0f} GB/s, device-to-device copy {bw['copy_GBps']:.0f} GB/s (read + written).",
        "Weights are synthetic (seeded random, the real shapes): decode cost does not depend on weight values.",
        "Floor = (weights + K/V of the context) / streaming-read bandwidth. Times in ms per decode step: the "
        "median of CUDA-graph replays (megakernel, reference), or the median interval between steps of "
        "`generate` (Hugging Face). In brackets: floor / time.",
        "",
        "| model | batch | context | floor | " + " | ".join(backends) + " |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in backends) + " |",
    ]
    for key in keys:
        row = {r["backend"]: r for r in recs if (r["model"], r["batch"], r["context"]) == key}
        floor = next(iter(row.values()))["floor_ms"]
        cells = [f"{row[b]['step_ms']:.3f} ({100 * row[b]['floor_over_step']:.0f}%)" if b in row else "–"
                 for b in backends]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {floor:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
