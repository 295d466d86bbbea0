"""The megakernel's weight layout: every layer's matrices stacked ([L, out, in]), Q, K and V rows in one matrix.

`pack_weights` packs bf16 (or float32 on the CPU) and hands back a ModelWeights made of views into the packed
tensors, so the reference decoder (the prefill) shares them and nothing is stored twice. `pack_fp8` packs the FP8
matrices and their per-row scales (service/model/fp8.py); the prefill then runs on the dequantized copy, which
costs that copy's memory (2.5 GB for Llama-3.2-1B) on top of the 1.24 GB the decode steps stream.
"""

from __future__ import annotations

import torch

from kernels.megakernel import PackedWeights
from service.model.config import ModelConfig
from service.model.fp8 import QuantizedModel
from service.model.weights import LayerWeights, ModelWeights


def _stack(ts: list[torch.Tensor], device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.stack([t.to(device, dtype) for t in ts]).contiguous()


def pack_weights(config: ModelConfig, weights: ModelWeights, device: torch.device,
                 dtype: torch.dtype) -> tuple[PackedWeights, ModelWeights]:
    """The kernel's layer-stacked tensors, and a ModelWeights made of views into them (for the prefill)."""
    c = config
    q, kv = c.q_size, c.kv_size
    layers = weights.layers

    def stack(ts: list[torch.Tensor]) -> torch.Tensor:
        return _stack(ts, device, dtype)

    packed = PackedWeights(
        embed=weights.embed.to(device, dtype).contiguous(),
        wqkv=stack([torch.cat([lw.wq, lw.wk, lw.wv]) for lw in layers]),
        bqkv=stack([torch.cat([lw.bq, lw.bk, lw.bv]) for lw in layers]) if c.qkv_bias else None,  # type: ignore[list-item]
        wo=stack([lw.wo for lw in layers]),
        w_gate=stack([lw.w_gate for lw in layers]),
        w_up=stack([lw.w_up for lw in layers]),
        w_down=stack([lw.w_down for lw in layers]),
        attn_norm=stack([lw.attn_norm for lw in layers]),
        mlp_norm=stack([lw.mlp_norm for lw in layers]),
        final_norm=weights.final_norm.to(device, dtype).contiguous(),
        lm_head=torch.empty(0),
    )
    tied = weights.lm_head is weights.embed
    packed.lm_head = packed.embed if tied else weights.lm_head.to(device, dtype).contiguous()
    views = ModelWeights(
        embed=packed.embed,
        layers=[
            LayerWeights(
                attn_norm=packed.attn_norm[i], wq=packed.wqkv[i, :q], wk=packed.wqkv[i, q:q + kv],
                wv=packed.wqkv[i, q + kv:], wo=packed.wo[i], mlp_norm=packed.mlp_norm[i], w_gate=packed.w_gate[i],
                w_up=packed.w_up[i], w_down=packed.w_down[i],
                bq=packed.bqkv[i, :q] if packed.bqkv is not None else None,
                bk=packed.bqkv[i, q:q + kv] if packed.bqkv is not None else None,
                bv=packed.bqkv[i, q + kv:] if packed.bqkv is not None else None,
            )
            for i in range(c.num_layers)
        ],
        final_norm=packed.final_norm,
        lm_head=packed.lm_head,
    )
    return packed, views


def pack_fp8(config: ModelConfig, quantized: QuantizedModel, device: torch.device,
             dtype: torch.dtype) -> PackedWeights:
    """FP8 matrices stacked like pack_weights' and their scales ([L, rows] float32; the LM head's [V]); the
    embedding table, norms and biases in `dtype`."""
    deq = quantized.dequantized
    layers = quantized.layers

    def stack(name: str, parts: tuple[str, ...], scales: bool = False) -> torch.Tensor:
        per_layer = [torch.cat([(qs[p].scale if scales else qs[p].data) for p in parts]) for qs in layers]
        return _stack(per_layer, device, None)

    groups = {"qkv": ("wq", "wk", "wv"), "o": ("wo",), "gate": ("w_gate",), "up": ("w_up",), "down": ("w_down",)}
    return PackedWeights(
        embed=deq.embed.to(device, dtype).contiguous(),
        wqkv=stack("qkv", groups["qkv"]),
        bqkv=_stack([torch.cat([lw.bq, lw.bk, lw.bv]) for lw in deq.layers], device, dtype)  # type: ignore[list-item]
        if config.qkv_bias else None,
        wo=stack("o", groups["o"]),
        w_gate=stack("gate", groups["gate"]),
        w_up=stack("up", groups["up"]),
        w_down=stack("down", groups["down"]),
        attn_norm=_stack([lw.attn_norm for lw in deq.layers], device, dtype),
        mlp_norm=_stack([lw.mlp_norm for lw in deq.layers], device, dtype),
        final_norm=deq.final_norm.to(device, dtype).contiguous(),
        lm_head=quantized.lm_head.data.to(device).contiguous(),
        scales={name: stack(name, parts, scales=True) for name, parts in groups.items()}
        | {"lm_head": quantized.lm_head.scale.to(device).contiguous()},
    )
