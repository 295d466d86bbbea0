"""The megakernel's weight layout: every layer's matrices stacked ([L, out, in]), Q, K and V rows in one matrix.

`pack_weights` packs bf16 (or float32 on the CPU) and hands back a ModelWeights made of views into the packed
tensors, so the reference decoder (the prefill) shares them and nothing is stored twice. `pack_fp8` packs the FP8
matrices and their per-row scales (service/model/fp8.py), `pack_int8` the int8 matrices and their per-block scales
(service/model/int8.py); the prefill then runs on the dequantized copy, which costs that copy's memory (2.5 GB for
Llama-3.2-1B) on top of the 1.24 GB (FP8; int8 1.32 GB) the decode steps stream.
"""

from __future__ import annotations

import torch

from kernels.kernel_args import INT8_BLOCK, PackedWeights
from service.model.config import ModelConfig
from service.model.quantized import QuantizedModel
from service.model.weights import Fp8Matrix, Int8Matrix, LayerWeights, ModelWeights

GROUPS = {"qkv": ("wq", "wk", "wv"), "o": ("wo",), "gate": ("w_gate",), "up": ("w_up",), "down": ("w_down",)}


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


def pack_fp8(config: ModelConfig, quantized: QuantizedModel[Fp8Matrix], device: torch.device,
             dtype: torch.dtype) -> PackedWeights:
    """FP8 matrices stacked like pack_weights' and their scales ([L, rows] float32; the LM head's [V]); the
    embedding table, norms and biases in `dtype`."""
    layers = quantized.layers

    def stack(parts: tuple[str, ...], scales: bool = False) -> torch.Tensor:
        per_layer = [torch.cat([(qs[p].scale if scales else qs[p].data) for p in parts]) for qs in layers]
        return _stack(per_layer, device, None)

    return _packed(config, quantized, device, dtype, {name: stack(parts) for name, parts in GROUPS.items()},
                   {name: stack(parts, scales=True) for name, parts in GROUPS.items()}
                   | {"lm_head": quantized.lm_head.scale.to(device).contiguous()})


def pack_int8(config: ModelConfig, quantized: QuantizedModel[Int8Matrix], device: torch.device,
              dtype: torch.dtype) -> PackedWeights:
    """Int8 matrices stacked like pack_weights' and their scales: float16 per block of 32 columns, block-major as the
    kernel reads them ([K / 32, L, rows]; the LM head's [K / 32, V]), or float32 per row as FP8's ([L, rows], [V]);
    the embedding table, norms and biases in `dtype`."""
    layers = quantized.layers
    head = quantized.lm_head
    per_row = head.scale.shape[1] == 1
    for m in [head, *(m for qs in layers for m in qs.values())]:
        if (m.scale.shape[1] == 1) != per_row or not (per_row or m.block == INT8_BLOCK):
            raise ValueError(f"the megakernel reads int8 blocks of {INT8_BLOCK} columns or rows, every matrix alike, "
                             f"not blocks of {m.block}")

    def stack(parts: tuple[str, ...]) -> torch.Tensor:
        return _stack([torch.cat([qs[p].data for p in parts]) for qs in layers], device, None)

    def scales(parts: tuple[str, ...]) -> torch.Tensor:
        per_layer = [torch.cat([qs[p].scale for p in parts]) for qs in layers]  # [rows, K / 32 or 1] each
        if per_row:
            return _stack([s[:, 0] for s in per_layer], device, None)
        return _stack(per_layer, device, None).permute(2, 0, 1).contiguous()

    head_scale = head.scale.to(device)[:, 0].contiguous() if per_row else head.scale.to(device).T.contiguous()
    return _packed(config, quantized, device, dtype, {name: stack(parts) for name, parts in GROUPS.items()},
                   {name: scales(parts) for name, parts in GROUPS.items()} | {"lm_head": head_scale})


def _packed(config: ModelConfig, quantized: QuantizedModel, device: torch.device, dtype: torch.dtype,
            matrices: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> PackedWeights:
    """PackedWeights of quantized matrices (and their scales) stacked per GROUPS; everything else in `dtype`."""
    deq = quantized.dequantized
    return PackedWeights(
        embed=deq.embed.to(device, dtype).contiguous(),
        wqkv=matrices["qkv"],
        bqkv=_stack([torch.cat([lw.bq, lw.bk, lw.bv]) for lw in deq.layers], device, dtype)  # type: ignore[list-item]
        if config.qkv_bias else None,
        wo=matrices["o"],
        w_gate=matrices["gate"],
        w_up=matrices["up"],
        w_down=matrices["down"],
        attn_norm=_stack([lw.attn_norm for lw in deq.layers], device, dtype),
        mlp_norm=_stack([lw.mlp_norm for lw in deq.layers], device, dtype),
        final_norm=deq.final_norm.to(device, dtype).contiguous(),
        lm_head=quantized.lm_head.data.to(device).contiguous(),
        scales=scales,
    )
