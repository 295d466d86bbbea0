"""The reference decoder: plain PyTorch over a static slot-based KV cache. float32 on the CPU, bf16 on a GPU.

It is the oracle the kernels are checked against and the CPU backend the service runs on. Its arithmetic
follows Hugging Face's Llama/Qwen2 modules step for step, so greedy output matches transformers token for token.

One function runs the model (`forward`, one `layer` at a time), gpt-fast style: tokens x [b, n, hidden] at
positions [b, n] of the KV slots [b]. Each layer writes the tokens' K/V at their positions, then every query
attends over cache positions [0, kv_len) through a mask built from the positions (a key at j is visible to a query
at p iff j <= p). A fresh prompt, a prompt on top of a cached prefix and a decode step are all that one function.
A fresh prompt (kv_len None) is the same attention among its own tokens, which a causal kernel computes faster
(flash attention: 0.19 ms against 0.57 for the masked one at 4,096 tokens of Llama-3.2-1B on the H100).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from service.backends.decoder import DecodeOutput, Draw, Fed, mask_logits
from service.model.config import ModelConfig
from service.model.weights import LayerWeights, ModelWeights

CPU_FEWEST_ROWS = 4  # on the CPU a product of fewer rows (but more than one) runs as this many, the rest zeros:
# PyTorch's float32 GEMM (MKL) is slower at 2-3 rows than at 4 (SmolLM2's LM head: 26 and 37 ms against 21 on a
# 2-core Xeon VM), and a 3-row decode step took 131-145 ms against a 4-row one's 82-110. The calibration, which
# holds more rows never faster, forecast the 3-row steps at the 4-row time: a strict-SLA burst whose three admitted
# requests decoded together came 3% past the SLA (bench/NOTES.md, s99). Padded, 3 rows take 88-90 ms.


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias): the one place where a weight multiplies (another weight format changes only this)."""
    rows = x.numel() // x.shape[-1]
    if x.device.type == "cpu" and 1 < rows < CPU_FEWEST_ROWS:
        padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, CPU_FEWEST_ROWS - rows))
        return F.linear(padded, weight, bias)[:rows].reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


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
    feeds = False  # the engine gives it the fed tokens as a device tensor

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
        # ~1k tokens), so every prefill replays a CUDA graph; one that cannot is counted here.
        self.slow_prefills = 0
        self.query_block_steps = 0  # (the megakernel's launch; none here)
        self.graph_prefill = self.device.type == "cuda"
        self._prefill_graphs: dict[tuple[int, int | None], torch.cuda.CUDAGraph] = {}
        if self.graph_prefill:
            with torch.inference_mode():
                self._capture_prefill_graphs()

    def prefill_buckets(self) -> list[int]:
        """The sizes a prefill's graphs are captured at, for its new tokens and for its cached length alike."""
        sizes, b = [], 16
        while b < self.max_context:
            sizes.append(b)
            b *= 2
        return [*sizes, self.max_context]

    def bucket(self, n: int) -> int:
        return next(b for b in self.prefill_buckets() if b >= n)

    def prefill_graph_buckets(self) -> list[int] | None:
        return self.prefill_buckets() if self.graph_prefill else None

    # -- the model ----------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                kv_len: int | None) -> torch.Tensor:
        """Every layer over x [b, n, hidden] at positions [b, n] of slots [b], attending over [0, kv_len); kv_len
        None: the tokens are their sequences from position 0, and attend among themselves."""
        mask = None
        if kv_len is not None:
            visible = torch.arange(kv_len, device=x.device) <= positions[..., None]  # [b, n, kv_len]
            mask = visible.unsqueeze(1)  # one mask for every head
        for lw, k_cache, v_cache in zip(self.weights.layers, self.cache.k, self.cache.v):
            x = self.layer(lw, k_cache, v_cache, x, positions, slots, mask)
        return x

    def layer(self, lw: LayerWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, x: torch.Tensor,
              positions: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One transformer block; writes the tokens' K/V into the layer's cache [slots, kv_heads, context, d]. mask
        [b, 1, n, kv_len]: which cached positions each token sees; None: the tokens see those before them."""
        c = self.config
        b, n, _ = x.shape
        h = rms_norm(x, lw.attn_norm, c.rms_norm_eps)
        q = linear(h, lw.wq, lw.bq).view(b, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = linear(h, lw.wk, lw.bk).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = linear(h, lw.wv, lw.bv).view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [b, 1, n, d/2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache[slots[:, None], :, positions] = k.transpose(1, 2)
        v_cache[slots[:, None], :, positions] = v.transpose(1, 2)
        if mask is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            kv_len = mask.shape[-1]
            attn = F.scaled_dot_product_attention(q, k_cache[slots, :, :kv_len], v_cache[slots, :, :kv_len],
                                                  attn_mask=mask, enable_gqa=True)
        x = x + linear(attn.transpose(1, 2).reshape(b, n, -1), lw.wo)
        h = rms_norm(x, lw.mlp_norm, c.rms_norm_eps)
        return x + linear(F.silu(linear(h, lw.w_gate)) * linear(h, lw.w_up), lw.w_down)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.weights.final_norm, self.config.rms_norm_eps)
        return linear(h, self.weights.lm_head).float()

    # -- the Decoder interface ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: list[int], start_pos: int = 0) -> torch.Tensor:
        n = len(token_ids)
        end = start_pos + n
        if n == 0 or start_pos < 0 or end > self.max_context:
            raise ValueError(f"prefill of {n} tokens at {start_pos} does not fit a context of {self.max_context}")
        # A graph pads the prompt to its bucket, and padding writes K/V past the prompt, clamped to the context's
        # last position: a prompt that ends on that position is replayed only if it needs no padding.
        if self.graph_prefill and (end < self.max_context or n == self.bucket(n)):
            return self._prefill_graphed(slot, token_ids, start_pos)
        if self.device.type == "cuda":
            self.slow_prefills += 1
        dev = self.device
        return self.prefill_tensors(torch.tensor([token_ids], device=dev), torch.tensor([slot], device=dev),
                                    torch.tensor([start_pos], device=dev), torch.tensor([n], device=dev),
                                    end if start_pos else None)

    def prefill_tensors(self, ids: torch.Tensor, slot: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
                        kv_len: int | None) -> torch.Tensor:
        """A prompt on device tensors only (what a CUDA graph captures): ids [1, m] at positions start.., of which
        the first `length` are real, in slot [1]; positions < start are cached, and attended over up to kv_len
        (None: start is 0). Returns the float32 logits [vocab] of the last real token. Tokens past `length` are
        padding: they come after the real ones, which never see them, and write K/V past the prompt (clamped to
        the last position), where each decode step writes before it reads."""
        m = ids.shape[1]
        positions = (start + torch.arange(m, device=ids.device)).clamp(max=self.max_context - 1)[None]
        x = self.forward(self.weights.embed[ids], positions, slot, kv_len)
        return self.logits(x[0].index_select(0, length - 1))[0]

    def _prefill_graphed(self, slot: int, token_ids: list[int], start_pos: int) -> torch.Tensor:
        n = len(token_ids)
        self._ids[0, :n] = torch.tensor(token_ids, dtype=torch.int64)
        self._slot.fill_(slot)
        self._start.fill_(start_pos)
        self._length.fill_(n)
        self._prefill_graphs[self.bucket(n), self.bucket(start_pos + n) if start_pos else None].replay()
        return self._out.clone()

    def _capture_prefill_graphs(self) -> None:
        """Every shape a prompt can take, now (a capture on a user's prompt costs ~50 ms): a fresh prompt's bucket,
        and each (new tokens, cached length) bucket pair. The graphs run one at a time, so they share one memory
        pool, one set of inputs (token ids, slot, start, length) and one output."""
        dev = self.device
        self._ids = torch.zeros(1, self.max_context, dtype=torch.int64, device=dev)
        self._slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self._start, self._length = torch.zeros_like(self._slot), torch.ones_like(self._slot)
        self._out = torch.zeros(self.config.vocab_size, dtype=torch.float32, device=dev)
        pool = torch.cuda.graph_pool_handle()
        buckets = self.prefill_buckets()
        for n, kv_len in [(n, None) for n in buckets] + [(n, kv) for kv in buckets for n in buckets if n <= kv]:
            args = (self._ids[:, :n], self._slot, self._start, self._length, kv_len)
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up outside the graph: kernel selection and workspaces
                self.prefill_tensors(*args)
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._out.copy_(self.prefill_tensors(*args))
            self._prefill_graphs[n, kv_len] = graph

    @torch.inference_mode()
    def copy_prefix(self, src_slot: int, dst_slot: int, n_tokens: int) -> None:
        """One strided device-to-device copy for K and one for V, every layer at once (~30 µs for 1,500 tokens of
        Llama-3.2-1B on the H100)."""
        if src_slot == dst_slot or not 0 <= n_tokens <= self.max_context:
            raise ValueError(f"cannot copy {n_tokens} positions from slot {src_slot} to slot {dst_slot}")
        for cache in (self.cache.k, self.cache.v):
            cache[:, dst_slot, :, :n_tokens] = cache[:, src_slot, :, :n_tokens]

    def draw(self, logits: torch.Tensor, draws: list[Draw], positions: list[int]) -> torch.Tensor:
        """Never called: this decoder does not draw tokens (draws_tokens is False); the engine samples."""
        raise NotImplementedError("the reference decoder does not draw tokens; the engine samples from its logits")

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int] | torch.Tensor | Fed, positions: list[int],
               draws: list[Draw] | None = None, sampled_rows: int | None = None,
               masks: dict[int, torch.Tensor] | None = None) -> DecodeOutput:
        """The Decoder's step; `draws` is not honoured here (draws_tokens is False): the engine samples. The rows of
        one slot (a prompt chunk) run as one sequence, attending causally among themselves; the other rows run as one
        batch of single tokens."""
        n = len(slots)
        if not slots or not n == len(token_ids) == len(positions):
            raise ValueError(f"decode of {len(slots)} slots, {len(token_ids)} tokens, {len(positions)} positions")
        kv_len = max(positions) + 1
        if kv_len > self.max_context or min(positions) < 0:
            raise ValueError(f"decode at positions {positions} does not fit a context of {self.max_context}")
        k = n if sampled_rows is None else sampled_rows
        if not 0 <= k <= n:
            raise ValueError(f"{k} sampled rows of {n}")
        dev = self.device
        if isinstance(token_ids, Fed):
            token_ids = token_ids.on_device()
        ids = token_ids.to(dev) if isinstance(token_ids, torch.Tensor) else torch.tensor(token_ids, device=dev)
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            by_slot.setdefault(s, []).append(i)
        singles = [rows[0] for rows in by_slot.values() if len(rows) == 1]
        runs = [sorted(rows, key=lambda i: positions[i]) for rows in by_slot.values() if len(rows) > 1]
        hidden = torch.empty(n, self.config.hidden_size, device=dev, dtype=self.dtype)
        if singles:
            at = torch.tensor(singles, device=dev)
            pos = torch.tensor([positions[i] for i in singles], device=dev)
            x = self.weights.embed[ids[at]].unsqueeze(1)  # [b, 1, hidden]
            hidden[at] = self.forward(x, pos[:, None], torch.tensor([slots[i] for i in singles], device=dev),
                                      max(positions[i] for i in singles) + 1)[:, 0]
        for rows in runs:
            at = torch.tensor(rows, device=dev)
            pos = torch.tensor([positions[i] for i in rows], device=dev)
            x = self.weights.embed[ids[at]].unsqueeze(0)  # [1, m, hidden]
            hidden[at] = self.forward(x, pos[None], torch.tensor([slots[rows[0]]], device=dev),
                                      positions[rows[-1]] + 1)[0]
        logits = mask_logits(self.logits(hidden[:k]), masks)
        return DecodeOutput(logits, logits.argmax(-1))

    def decode_tensors(self, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       kv_len: int) -> torch.Tensor:
        """The decode step on device tensors only (no host sync): x [b, 1, hidden] at positions [b] of slots [b];
        what a CUDA graph captures."""
        return self.logits(self.forward(x, positions[:, None], slots, kv_len)[:, 0])
