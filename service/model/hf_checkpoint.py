"""Load a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json): Llama-3.x, SmolLM2, Qwen2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from service.model.config import ModelConfig, ModelError, RopeScaling
from service.model.fp8 import Fp8Matrix, from_checkpoint
from service.model.tokenizer import Tokenizer, tokenizer_from_hf_dir
from service.model.weights import LayerWeights, ModelWeights

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def config_from_hf(cfg: dict[str, Any], name: str) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelError(f"{name}: architecture {archs or cfg.get('model_type')} is not supported "
                         f"(supported: {sorted(ARCHITECTURES)})")
    # Llama's attention_bias also puts a bias on o_proj, and mlp_bias on the MLP: weights Parley has no place for.
    if arch == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise ModelError(f"{name}: Llama with attention_bias/mlp_bias is not supported")
    if cfg.get("use_sliding_window"):
        raise ModelError(f"{name}: sliding-window attention is not supported")
    scaling = None
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if rs and rs.get("rope_type", rs.get("type")) == "llama3":
        scaling = RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
        raise ModelError(f"{name}: rope scaling {rs.get('rope_type', rs.get('type'))!r} is not supported")
    theta = cfg.get("rope_theta") or (rs or {}).get("rope_theta") or 10000.0
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    heads = int(cfg["num_attention_heads"])
    return ModelConfig(
        name=name,
        architecture=arch,
        hidden_size=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_hf_dir(path: str | Path) -> tuple[ModelConfig, ModelWeights, Tokenizer]:
    path = Path(path)
    if not path.is_dir():
        raise ModelError(f"model directory not found: {path}")
    for needed in ("config.json", "tokenizer.json"):
        if not (path / needed).is_file():
            raise ModelError(f"{path}: {needed} is missing")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"{path}: no *.safetensors weights")
    config = config_from_hf(json.loads((path / "config.json").read_text()), path.name)

    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(shard))
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ModelError(f"{path}: tensor {name!r} is missing")
        return tensors[name]

    fp8: dict[str, Fp8Matrix] = {}

    def matrix(name: str, key: str) -> torch.Tensor:
        """A linear layer's weight; one stored in FP8 (with its `weight_scale`) is kept as such in `fp8` and
        returned dequantized."""
        w = take(name)
        if w.dtype != torch.float8_e4m3fn:
            return w
        try:
            fp8[key] = from_checkpoint(w, take(name.removesuffix("weight") + "weight_scale"))
        except ValueError as e:
            raise ModelError(f"{path}: {name}: {e}") from e
        return fp8[key].dequantize(torch.float32)

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        bias = (lambda n, p=p: take(p + f"self_attn.{n}_proj.bias")) if config.qkv_bias else (lambda n: None)
        layers.append(
            LayerWeights(
                attn_norm=take(p + "input_layernorm.weight"),
                wq=matrix(p + "self_attn.q_proj.weight", p + "wq"),
                wk=matrix(p + "self_attn.k_proj.weight", p + "wk"),
                wv=matrix(p + "self_attn.v_proj.weight", p + "wv"),
                wo=matrix(p + "self_attn.o_proj.weight", p + "wo"),
                mlp_norm=take(p + "post_attention_layernorm.weight"),
                w_gate=matrix(p + "mlp.gate_proj.weight", p + "w_gate"),
                w_up=matrix(p + "mlp.up_proj.weight", p + "w_up"),
                w_down=matrix(p + "mlp.down_proj.weight", p + "w_down"),
                bq=bias("q"),
                bk=bias("k"),
                bv=bias("v"),
            )
        )
    embed = take("embed_tokens.weight")
    tied = config.tie_word_embeddings or "lm_head.weight" not in tensors
    weights = ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=take("norm.weight"),
        lm_head=embed if tied else matrix("lm_head.weight", "lm_head"),
        fp8=fp8 or None,
    )
    return config, weights, tokenizer_from_hf_dir(path)
