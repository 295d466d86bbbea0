"""The reference decoder: plain PyTorch over a static slot-based KV cache. float32 on the CPU, bf16 on a GPU.

It is the oracle the kernels are checked against and the CPU backend the service runs on. Its arithmetic
follows Hugging Face's Llama/Qwen2 modules step for step, so greedy output matches transformers token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.backends.decoder import DecodeOutput, Draw
from service.model.config import ModelConfig
from service.model.weights import LayerWeights, ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, head_dim]; cos/sin [n, head_dim/2] (float32), rotate-half layout."""
    cos = torch.cat([cos, cos], -1).to(x.dtype)
    sin = torch.cat([sin, sin], -1).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class KVCache:
    """K and V for every layer and slot: [layers, slots, kv_heads, max_context, head_dim]."""

    def __init__(self, config: ModelConfig, max_slots: int, max_context: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (config.num_layers, max_slots, config.num_kv_heads, max_context, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)


class ReferenceDecoder:
    name = "reference"
    draws_tokens = False

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_slots: int = 8, max_context: int = 2048,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        self.device = torch.device(device or weights.embed.device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.config = config
        self.weights = weights.to(self.device, self.dtype)
        self.max_slots = max_slots
        self.max_context = max_context
        self.cache = KVCache(config, max_slots, max_context, self.device, self.dtype)
        cos, sin = config.rope_tables(max_context)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        # On a GPU an eager prefill is launch-bound (~40 kernels a layer: 12 ms for Llama-1B at any length up to
        # ~1k tokens), so a fresh prompt runs as a CUDA graph captured per power-of-two length bucket.
        self.graph_prefill = self.device.type == "cuda"
        self._prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, ...]] = {}
        self._graph_pool = None
        if self.graph_prefill:  # all buckets now: a capture on a user's first prompt of a length costs ~50 ms
            with torch.inference_mode():
                for bucket in self.prefill_buckets():
                    self._capture_prefill(bucket)

    def prefill_buckets(self) -> list[int]:
        sizes, b = [], 16
        while b < self.max_context:
            sizes.append(b)
            b *= 2
        return [*sizes, self.max_context]

    # -- one layer, for n new tokens of each of b sequences -------------------------------------------
    def _qkv(self, lw: LayerWeights, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [b, n, hidden], pos [b, n] → q [b, heads, n, d], k/v [b, kv_heads, n, d] (RoPE applied)."""
        c = self.config
        b, n, _ = x.shape
        h = rms_norm(x, lw.attn_norm, c.rms_norm_eps)
        q = F.linear(h, lw.wq, lw.bq).view(b, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = F.linear(h, lw.wk, lw.bk).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = F.linear(h, lw.wv, lw.bv).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [b, 1, n, d/2]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, lw.mlp_norm, self.config.rms_norm_eps)
        return x + F.linear(F.silu(F.linear(h, lw.w_gate)) * F.linear(h, lw.w_up), lw.w_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.weights.final_norm, self.config.rms_norm_eps)
        return F.linear(h, self.weights.lm_head).float()

    # -- the Decoder interface ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], start_pos: int = 0) -> torch.Tensor:
        n = len(token_ids)
        end = start_pos + n
        if n == 0 or end > self.max_context:
            raise ValueError(f"prefill of {n} tokens at {start_pos} does not fit a context of {self.max_context}")
        if self.graph_prefill and start_pos == 0:
            return self._prefill_graphed(slot, token_ids)
        ids = torch.tensor([token_ids], device=self.device)
        pos = torch.arange(start_pos, end, device=self.device).unsqueeze(0)
        x = self.weights.embed[ids]
        # The new tokens see every cached position and the new ones up to themselves.
        mask = None
        if start_pos:
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(diagonal=start_pos)
        for i, lw in enumerate(self.weights.layers):
            q, k, v = self._qkv(lw, x, pos)
            self.cache.k[i, slot, :, start_pos:end] = k[0]
            self.cache.v[i, slot, :, start_pos:end] = v[0]
            keys, vals = self.cache.k[i, slot : slot + 1, :, :end], self.cache.v[i, slot : slot + 1, :, :end]
            attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, is_causal=mask is None,
                                                  enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(1, n, -1), lw.wo)
            x = self._mlp(lw, x)
        return self._logits(x[:, -1])[0]

    def _prefill_fresh(self, ids: torch.Tensor, slot: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """A prompt from position 0 on device tensors only (capturable): ids [1, n], slot and last [1]. Tokens past
        `last` are padding: causal attention keeps them from the real ones, and the K/V they leave in the slot
        lie beyond the sequence, where each decode step writes before it reads."""
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device).unsqueeze(0)
        x = self.weights.embed[ids]
        for i, lw in enumerate(self.weights.layers):
            q, k, v = self._qkv(lw, x, pos)
            self.cache.k[i, slot, :, :n] = k
            self.cache.v[i, slot, :, :n] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(1, n, -1), lw.wo)
            x = self._mlp(lw, x)
        return self._logits(x.index_select(1, last)[:, 0])[0]

    def _prefill_graphed(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        n = len(token_ids)
        bucket = next(b for b in self.prefill_buckets() if b >= n)
        if bucket not in self._prefill_graphs:
            self._capture_prefill(bucket)
        graph, ids, slot_t, last, out = self._prefill_graphs[bucket]
        ids[0, :n] = torch.tensor(token_ids, dtype=torch.int64)
        slot_t.fill_(slot)
        last.fill_(n - 1)
        graph.replay()
        return out.clone()

    def _capture_prefill(self, bucket: int) -> None:
        ids = torch.zeros(1, bucket, dtype=torch.int64, device=self.device)
        slot = torch.zeros(1, dtype=torch.int64, device=self.device)
        last = torch.zeros(1, dtype=torch.int64, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the graph: kernel selection and workspaces
            self._prefill_fresh(ids, slot, last)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._prefill_fresh(ids, slot, last)
        self._prefill_graphs[bucket] = (graph, ids, slot, last, out)

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int] | torch.Tensor, positions: list[int],
               draws: list[Draw] | None = None) -> DecodeOutput:
        """The Decoder's step; `draws` is not honoured here (draws_tokens is False): the engine samples."""
        if not slots or not len(slots) == len(token_ids) == len(positions):
            raise ValueError(f"decode of {len(slots)} slots, {len(token_ids)} tokens, {len(positions)} positions")
        kv_len = max(positions) + 1
        if kv_len > self.max_context or min(positions) < 0:
            raise ValueError(f"decode at positions {positions} does not fit a context of {self.max_context}")
        dev = self.device
        slot_t = torch.tensor(slots, device=dev)
        pos_t = torch.tensor(positions, device=dev)
        ids = token_ids.to(dev) if isinstance(token_ids, torch.Tensor) else torch.tensor(token_ids, device=dev)
        x = self.weights.embed[ids].unsqueeze(1)  # [b, 1, hidden]
        logits = self.decode_tensors(x, slot_t, pos_t, kv_len)
        return DecodeOutput(logits, logits.argmax(-1))

    def decode_tensors(self, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       kv_len: int) -> torch.Tensor:
        """The decode step on device tensors only (no host sync): what a CUDA graph captures."""
        b = x.shape[0]
        visible = torch.arange(kv_len, device=x.device)[None, :] <= positions[:, None]  # [b, kv_len]
        mask = visible[:, None, None, :]
        for i, lw in enumerate(self.weights.layers):
            q, k, v = self._qkv(lw, x, positions[:, None])
            self.cache.k[i, slots, :, positions] = k[:, :, 0]
            self.cache.v[i, slots, :, positions] = v[:, :, 0]
            keys, vals = self.cache.k[i, slots, :, :kv_len], self.cache.v[i, slots, :, :kv_len]
            attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)
            x = x + F.linear(attn.transpose(1, 2).reshape(b, 1, -1), lw.wo)
            x = self._mlp(lw, x)
        return self._logits(x[:, 0])
