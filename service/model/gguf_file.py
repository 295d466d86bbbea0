"""Load a Llama-family model from a GGUF file with the `gguf` package: metadata, tokenizer, dequantized tensors (and
the Q8_0 matrices as they are, for the int8 weight format: ModelWeights.int8)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from service.model.config import ModelConfig, ModelError, RopeScaling
from service.model.tokenizer import Tokenizer
from service.model.weights import Int8Matrix, LayerWeights, ModelWeights

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# How each vocabulary's merges were learned to split text (llama.cpp's `tokenizer.ggml.pre`).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":  # single digits, then GPT-2's split
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), "isolated"), byte_level])
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_SPLIT), "isolated"), byte_level])
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _tokenizer(reader: GGUFReader, path: Path) -> Tokenizer:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', is)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    hf.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    hf.decoder = decoders.ByteLevel()
    # 3 = control tokens (<|im_start|>, ...): matched whole and never split.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3])
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    if bos is not None and _field(reader, "tokenizer.ggml.add_bos_token", False):
        hf.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    return Tokenizer(
        hf,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token=bos,
        eos_token=tokens[eos_id] if eos_id is not None else None,
    )


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp stores Q/K rows interleaved for its RoPE; bring them back to rotate-half order."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama3_scaling(config: ModelConfig, factors: torch.Tensor, original: int, path: Path) -> RopeScaling:
    """llama.cpp stores Llama-3.x's `llama3` RoPE scaling as a tensor of per-frequency divisors (rope_freqs),
    not as metadata: recover the parameters (Llama-3's low 1, high 4) and insist that they reproduce it."""
    factors = factors.float().flatten()
    scaling = RopeScaling(float(factors.max()), 1.0, 4.0, original)
    if factors.numel() != config.head_dim // 2 or not torch.allclose(
        config.rope_inv_freq() / factors, replace(config, rope_scaling=scaling).rope_inv_freq(), rtol=1e-5, atol=0
    ):
        raise ModelError(f"{path}: rope_freqs.weight is not `llama3` RoPE scaling (factor {scaling.factor}, "
                         f"low 1, high 4, original {original}); it is not supported")
    return scaling


def _q8_0(raw: np.ndarray, rows: int) -> Int8Matrix:
    """A Q8_0 tensor's bytes as they are: per block of 32 values, a float16 scale then 32 int8."""
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, -1, 34)
    scale = torch.from_numpy(blocks[:, :, :2].copy().view(np.float16)[:, :, 0])
    data = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8).reshape(rows, -1))
    return Int8Matrix(data, scale)


def load_gguf(path: str | Path) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises bare ValueError/struct errors on a bad file
        raise ModelError(f"{path}: not a readable GGUF file ({e})") from e
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(f"{path}: architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")

    tensors: dict[str, torch.Tensor] = {}
    q8_0: dict[str, Int8Matrix] = {}
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only memory-mapped file
            arr = arr.copy()
        tensors[t.name] = torch.from_numpy(arr)
        if t.tensor_type == GGMLQuantizationType.Q8_0 and len(shape) == 2:
            q8_0[t.name] = _q8_0(t.data, shape[0])

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden, n_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    n_kv = int(meta("attention.head_count_kv", n_heads))
    tokenizer = _tokenizer(reader, path)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = {eos} if eos is not None else set()
    for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        if (i := tokenizer.hf.token_to_id(special)) is not None:
            eos_ids.add(i)
    config = ModelConfig(
        name=_field(reader, "general.name") or path.stem,
        architecture=arch,
        hidden_size=hidden,
        num_layers=int(meta("block_count")),
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=int(meta("attention.key_length", hidden // n_heads)),
        intermediate_size=int(meta("feed_forward_length")),
        vocab_size=tensors["token_embd.weight"].shape[0],
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(sorted(eos_ids)),
    )
    if meta("rope.scaling.type") not in (None, "none"):
        raise ModelError(f"{path}: GGUF RoPE scaling {meta('rope.scaling.type')!r} is not supported")
    if "rope_freqs.weight" in tensors:  # Llama-3.x: without it every position past a few hundred is wrong
        original = int(meta("rope.scaling.original_context_length", 8192))
        config = replace(config, rope_scaling=_llama3_scaling(config, tensors["rope_freqs.weight"], original, path))

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ModelError(f"{path}: tensor {name!r} is missing")
        return tensors[name]

    permute = arch == "llama"  # llama.cpp's converter interleaves Q/K rows for Llama only
    int8: dict[str, Int8Matrix] = {}  # the Q8_0 matrices, under ModelWeights.int8's keys
    names = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output", "w_gate": "ffn_gate",
             "w_up": "ffn_up", "w_down": "ffn_down"}
    layers = []
    for i in range(config.num_layers):
        p = f"blk.{i}."
        for key, name in names.items():
            if (m := q8_0.get(f"{p}{name}.weight")) is not None:
                if permute and key in ("wq", "wk"):
                    heads = n_heads if key == "wq" else n_kv
                    m = Int8Matrix(_unpermute_rope_rows(m.data, heads), _unpermute_rope_rows(m.scale, heads))
                int8[f"layers.{i}.{key}"] = m
        wq, wk = take(p + "attn_q.weight"), take(p + "attn_k.weight")
        if permute:
            wq, wk = _unpermute_rope_rows(wq, n_heads), _unpermute_rope_rows(wk, n_kv)
        layers.append(
            LayerWeights(
                attn_norm=take(p + "attn_norm.weight"),
                wq=wq,
                wk=wk,
                wv=take(p + "attn_v.weight"),
                wo=take(p + "attn_output.weight"),
                mlp_norm=take(p + "ffn_norm.weight"),
                w_gate=take(p + "ffn_gate.weight"),
                w_up=take(p + "ffn_up.weight"),
                w_down=take(p + "ffn_down.weight"),
                bq=tensors.get(p + "attn_q.bias"),
                bk=tensors.get(p + "attn_k.bias"),
                bv=tensors.get(p + "attn_v.bias"),
            )
        )
    embed = take("token_embd.weight")
    head = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    if head in q8_0:
        int8["lm_head"] = q8_0[head]
    weights = ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=take("output_norm.weight"),
        lm_head=embed if config.tie_word_embeddings else take("output.weight"),
        int8=int8 or None,
    )
    return config, weights, tokenizer
