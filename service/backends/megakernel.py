"""The megakernel backend: one persistent Triton launch per step (kernels/), behind the Decoder interface.

A step is a list of rows (slot, token, position): decode rows beside the rows of new prompts (several rows of one
sequence at consecutive positions attend causally among themselves, over the slot's cached K/V). The rows that
need a token (decode rows, the last row of each prompt) come first; only those go through the LM head and the
sampling (`sampled_rows`), at most `max_batch` of them a step.

Prefill also stays available in PyTorch (the ReferenceDecoder, compute-bound work that cuBLAS and SDPA do well),
writing into the same KV cache the kernel reads. The weights are packed once into the layer-stacked layout the
kernel reads (service/backends/packing.py); with bf16 weights the reference decoder sees views of those same
tensors, with FP8 or int8 it runs on their dequantized copy.

A step pads its rows to the next bucket (1, 2, 4, ..., 64) with rows that write into a spare scratch slot, and
on a GPU replays one CUDA graph per bucket.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kernels.query_blocks import BLOCK_FIELDS, query_blocks, uses_blocks
from service.backends.decoder import DecodeOutput, Draw, Fed
from service.backends.reference import ReferenceDecoder
from service.model.config import ModelConfig
from service.model.weights import ModelWeights

if TYPE_CHECKING:
    from kernels.instructions import ModelDims
    from kernels.kernel_args import PackedWeights
    from kernels.megakernel import KernelConfig


def megakernel_available() -> bool:
    """True where the megakernel can run: a CUDA device and an importable Triton. Cheap: compiles nothing."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


class MegakernelDecoder:
    name = "megakernel"
    draws_tokens = True  # temperature sampling runs inside the step (kernels/sampling.py)
    feeds = True  # a Fed's rows and sources ride in the inputs' one transfer; two device calls gather the tokens
    # Called in decode() between the host's preparation and the step's first GPU work (the input copy): where the
    # engine's LoopClock starts the step, so that host time spent before it while the GPU waits reads as idle, not
    # as the step's GPU time
    before_launch: Callable[[], None] | None = None

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_slots: int = 8, max_context: int = 2048,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 num_programs: int | None = None, kernel_config: KernelConfig | None = None,
                 use_cuda_graphs: bool | None = None, weight_format: str = "bf16",
                 max_batch: int | None = None, max_rows: int | None = None, output_views: bool = False) -> None:
        """max_batch: rows a step samples at most (its decode batch; default max_slots); max_rows: rows a step
        carries at most, prompt rows included (default and limit: the largest bucket, 64). With
        kernel_config.batch_invariant every step pads to max_rows. output_views: decode() returns the kernel's own
        output buffers, valid until its next call, not copies of them: for a caller that enqueues all it does with a
        step's outputs before the next step (the engine: its choice of tokens and their copy to the host), which
        saves three copies a step (the logits' [rows, vocab] among them) and their launches."""
        self.output_views = output_views
        from kernels.instructions import ModelDims
        from kernels.megakernel import Megakernel
        from service.backends.packing import pack_fp8, pack_int8, pack_weights
        from service.model.weight_formats import quantize_model

        self.config = config
        self.max_slots = max_slots
        self.max_context = max_context
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_format = weight_format
        if weight_format != "bf16":
            quantized = quantize_model(weights, weight_format, dtype)
            packed = (pack_fp8 if weight_format == "fp8" else pack_int8)(config, quantized, self.device, dtype)
            views = quantized.dequantized.to(self.device, dtype)
        else:
            packed, views = pack_weights(config, weights, self.device, dtype)
        # one slot more than asked: the scratch slot that padding rows write into
        self.reference = ReferenceDecoder(config, views, max_slots + 1, max_context, self.device, dtype)
        self.scratch_slot = max_slots
        dims = ModelDims(
            hidden=config.hidden_size, num_layers=config.num_layers, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, ffn=config.intermediate_size,
            vocab=config.vocab_size, rms_eps=config.rms_norm_eps, qkv_bias=config.qkv_bias,
        )
        top = Megakernel.BUCKETS[-1]
        rows = top if max_rows is None else max_rows
        if not 1 <= rows <= top:
            raise ValueError(f"max_rows must be within 1..{top}, not {max_rows}")
        self._build_kernel(dims, packed, rows, min(max_batch or max_slots, rows), num_programs, kernel_config,
                           use_cuda_graphs)

    def _build_kernel(self, dims: ModelDims, packed: PackedWeights, max_rows: int, max_sampled: int,
                      num_programs: int | None, kernel_config: KernelConfig | None,
                      use_cuda_graphs: bool | None) -> None:
        from kernels.megakernel import Megakernel

        cache = self.reference.cache
        self.kernel = Megakernel(dims, packed, cache.k, cache.v, self.reference.cos, self.reference.sin,
                                 max_rows=max_rows, max_sampled=max_sampled, num_programs=num_programs,
                                 config=kernel_config)
        self.max_rows, self.max_batch = self.kernel.max_rows, self.kernel.max_sampled
        self.buckets = tuple(b for b in Megakernel.BUCKETS if b <= self.kernel.bpad)
        self.use_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        # (bucket, query blocks' launch, one LM row: Megakernel.has_one_lm_row)
        self._graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        # one host buffer for the int32 input rows (tokens, slots, positions, the draw's four; a Fed's rows and their
        # sources), one transfer
        n = self.kernel.bpad
        pinned = self.device.type == "cuda"
        self._host = torch.zeros(9 + BLOCK_FIELDS, n, dtype=torch.int32, pin_memory=pinned)
        self._host_rows = self._host.numpy()  # the same memory: numpy fills it from lists 3x faster than torch
        self._host_masks = torch.zeros(self.kernel.masks.shape, dtype=torch.int32, pin_memory=pinned)
        # the last asynchronous copy out of _host; _host is not rewritten before it has run
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        # the last decode's host time in its parts (the engine's slow-iteration log): the wait for that copy, and what
        # came after the step's start (its copies and launch); the rest of decode is the rows' preparation
        self.decode_phases: dict[str, float] = {}
        self._inputs = torch.cat([torch.stack([self.kernel.tokens, self.kernel.slots, self.kernel.positions]),
                                  self.kernel.draw, torch.zeros_like(self.kernel.draw[:2]), self.kernel.blocks])
        self.kernel.tokens, self.kernel.slots, self.kernel.positions = self._inputs[:3].unbind(0)
        self.kernel.draw = self._inputs[3:7]
        self.kernel.blocks = self._inputs[9:]  # each row's query block (kernels/query_blocks.py)
        self._block_rows = self.kernel.block_rows
        self._block_min = self.kernel.cfg.block_min_positions
        # the buckets whose steps may take the blocks' launch: their graphs are captured with the plain ones
        self._block_buckets = {b for b in self.buckets if b > 1 and b * self.max_context >= self._block_min} \
            if self._block_rows else set()
        self.query_block_steps = 0  # steps that took it: parley_query_block_steps_total
        # the buckets with a launch whose LM head takes one row (Megakernel.has_one_lm_row): worked out once, not on
        # each step's host path
        self._one_lm_buckets = {b for b in self.buckets if self.kernel.has_one_lm_row(b)}
        # a Fed's rows and sources, padded with its first pair: fed rows are decode rows, at most the sampled rows of a
        # step, so as wide as those (not as the widest step: 2 x 64 list entries a step cost host time for nothing)
        fed = self.kernel.spad
        self._fed_rows, self._fed_sources = self._inputs[7, :fed], self._inputs[8, :fed]
        # views made once: a slice is a torch call, tens of microseconds of the engine thread's time per step on the
        # H200 host under load
        self._tokens_of = [self.kernel.tokens[:k] for k in range(n + 1)]
        k = self.kernel
        self._outputs_of = [(k.logits[:m], k.argmax[:m], k.sampled[:m]) for m in range(k.logits.shape[0] + 1)]

    def with_kernel_config(self, kernel_config: KernelConfig, use_cuda_graphs: bool | None = None
                           ) -> MegakernelDecoder:
        """The same weights, cache and prefill under another kernel configuration (benchmarks compare variants
        without a copy of the model each)."""
        other = copy.copy(self)
        k = self.kernel
        other._build_kernel(k.dims, k.w, k.max_rows, k.max_sampled, k.num_programs, kernel_config, use_cuda_graphs)
        return other

    # -- the Decoder interface ------------------------------------------------------------------------
    def prefill(self, slot: int, token_ids: list[int], start_pos: int = 0) -> torch.Tensor:
        return self.reference.prefill(slot, token_ids, start_pos)

    @property
    def slow_prefills(self) -> int:
        return self.reference.slow_prefills

    def prefill_graph_buckets(self) -> list[int] | None:
        return self.reference.prefill_graph_buckets()

    def copy_prefix(self, src_slot: int, dst_slot: int, n_tokens: int) -> None:
        self.reference.copy_prefix(src_slot, dst_slot, n_tokens)  # the kernel reads the same cache

    def bucket(self, n: int) -> int:
        return self.bucket_of(n, self.buckets)

    @staticmethod
    def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
        """The smallest bucket that holds n rows."""
        return next(b for b in buckets if b >= n)

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int] | torch.Tensor | Fed, positions: list[int],
               draws: list[Draw] | None = None, sampled_rows: int | None = None,
               masks: dict[int, torch.Tensor] | None = None) -> DecodeOutput:
        """One step of rows (slots[i], token_ids[i], positions[i]): decode rows and prompt rows alike, several rows
        of a slot at consecutive positions attending causally among themselves. The first `sampled_rows` rows
        (None: all) get logits, a greedy token and, with `draws` (one per row, or per sampled row), a drawn one;
        the others only write their K/V. At most max_rows rows, at most max_batch of them sampled. `masks` (sampled
        row → the tokens its grammar allows, a bit each) apply inside the step: the kernel's LM head puts the
        disallowed logits at -inf before its argmax and its draw."""
        n = len(slots)
        if not (n == len(token_ids) == len(positions)) or n == 0:
            raise ValueError("decode needs one slot, token and position per row")
        if n > self.max_rows:
            raise ValueError(f"a step carries at most {self.max_rows} rows, not {n}")
        m = n if sampled_rows is None else sampled_rows
        if not 0 <= m <= n:
            raise ValueError(f"sampled_rows must be within 0..{n}, not {sampled_rows}")
        if m > self.max_batch:
            raise ValueError(f"a step samples at most {self.max_batch} rows (max_batch), not {m}")
        if draws is not None and len(draws) not in (n, m):
            raise ValueError(f"{len(draws)} draws for {n} rows of which {m} sample")
        if masks and not all(0 <= i < m for i in masks):
            raise ValueError(f"masks for rows {sorted(masks)}, of which {m} sample")
        top = max(positions)
        if top >= self.max_context or min(positions) < 0:
            raise ValueError(f"a position is outside the context of {self.max_context}")
        b = self.bucket(n)
        pad = b - n
        t0 = time.perf_counter()
        if self._copied is not None:
            self._copied.synchronize()
        t1 = time.perf_counter()
        on_device = isinstance(token_ids, torch.Tensor)  # the last step's tokens: never leave the GPU
        fed: Fed | None = None
        listed: list[int] = []  # the tokens from the host
        if isinstance(token_ids, Fed):
            fed, listed = token_ids, token_ids.tokens
        elif not isinstance(token_ids, torch.Tensor):
            listed = token_ids
        gather = fed is not None and not fed.in_order()
        # the input rows in one tensor from one list (one torch call, not five: each is microseconds of host time in
        # a loop whose host time per step is what the GPU waits for); padding rows, rows that do not sample and
        # greedy requests: temperature 0
        zeros = [0] * b
        rows = [zeros if on_device else [*listed, *zeros[:pad]], [*slots, *[self.scratch_slot] * pad],
                [*positions, *zeros[:pad]], zeros, zeros, zeros, zeros]
        if draws is not None and m > 0:
            rest = zeros[m:]
            rows[3] = [*struct.unpack(f"<{m}i", struct.pack(f"<{m}f", *(max(0.0, d.temperature) for d in draws[:m]))),
                       *rest]
            # each seed's int64 as its two int32 words (low, high), as kernels.sampling.seed_words views them
            halves = struct.unpack(f"<{2 * m}i", struct.pack(f"<{m}q", *(d.seed for d in draws[:m])))
            rows[4], rows[5] = [*halves[0::2], *rest], [*halves[1::2], *rest]
        self._host_rows[:7, :b] = rows
        blocks = False
        # the query blocks' launch (kernels/query_blocks.py): a step whose every row is in a block of several has each
        # of its slots twice at least, and its rows read no more than n x (top + 1) positions. Cheap tests first:
        # computing the blocks takes 8-36 us of host time at 16-64 rows, and a short prompt alone (a fresh request's
        # first token) never takes the launch
        if b in self._block_buckets and (self._block_min <= 0 or (
                2 * len(set(slots)) <= n and n * (top + 1) >= self._block_min)):
            found = query_blocks(rows[1], rows[2], self._block_rows)  # (padding rows: blocks of their own)
            self._host_rows[9:, :b] = found
            blocks = uses_blocks(found, n, self._block_min)
            self.query_block_steps += blocks
        if fed is not None and gather:  # the fed rows and their sources, padded with the first pair (written twice)
            width = self.kernel.spad
            self._host_rows[7:9, :width] = [[*fed.rows, *fed.rows[:1] * (width - len(fed.rows))],
                                           [*fed.sources, *fed.sources[:1] * (width - len(fed.sources))]]
        if masks:
            words = self._host_masks.shape[1]
            for i, allowed in masks.items():
                k = min(words, allowed.numel())
                self._host_masks[i, :k] = allowed[:k]
                self._host_masks[i, k:] = 0
                self._host[6, i] = 1
        if self.before_launch is not None:
            self.before_launch()
        t2 = time.perf_counter()
        if masks:
            self.kernel.masks[:m].copy_(self._host_masks[:m], non_blocking=True)
        self._inputs.copy_(self._host, non_blocking=True)
        if on_device:
            assert isinstance(token_ids, torch.Tensor)
            self._tokens_of[n].copy_(token_ids)
        elif fed is not None and not gather:  # every row its own row's token: one copy, as a tensor of tokens
            self._tokens_of[n].copy_(fed.chosen)
        elif fed is not None:
            chosen = fed.chosen.index_select(0, self._fed_sources)
            self.kernel.tokens.index_put_((self._fed_rows,), chosen.to(self.kernel.tokens.dtype))
        if self._copied is not None:
            self._copied.record()
        # one row samples at most (a prompt alone, a voice turn's new tokens): the bucket's launch whose LM head takes
        # one row, where it has one
        self.run_step(b, blocks, m <= 1 and b in self._one_lm_buckets)
        self.decode_phases = {"input wait": t1 - t0, "launch": time.perf_counter() - t2}
        logits, argmax, sampled = self._outputs_of[m]
        if self.output_views:
            return DecodeOutput(logits, argmax, None if draws is None else sampled)
        return DecodeOutput(logits.clone(), argmax.clone(), None if draws is None else sampled.clone())

    def draw(self, logits: torch.Tensor, draws: list[Draw], positions: list[int]) -> torch.Tensor:
        from kernels.sampling import draw

        dev = logits.device
        return draw(logits, torch.tensor([max(0.0, d.temperature) for d in draws], device=dev),
                    torch.tensor([d.seed for d in draws], dtype=torch.int64, device=dev),
                    torch.tensor(positions, dtype=torch.int32, device=dev))

    def run_step(self, bucket: int, blocks: bool = False, one_lm: bool = False) -> None:
        """Run (or replay) the step of a bucket on whatever the input buffers hold; blocks: the query blocks' launch
        (the inputs' blocks rows then say each row's block); one_lm: the launch whose LM head takes the first row
        only (where the bucket has one: Megakernel.has_one_lm_row)."""
        one_lm = one_lm and bucket in self._one_lm_buckets
        if not self.use_graphs:
            self.kernel.step(bucket, blocks, one_lm)
            return
        self.graph(bucket, blocks, one_lm).replay()

    def graph(self, bucket: int, blocks: bool = False, one_lm: bool = False) -> torch.cuda.CUDAGraph:
        """The bucket's captured step (captured now if it is not yet; every launch of a bucket with its plain one,
        the blocks' and the one LM row's, so that the warm-up that runs every bucket compiles them all)."""
        one_lm = one_lm and bucket in self._one_lm_buckets
        if (bucket, blocks, one_lm) not in self._graphs:
            ones = (False, True) if bucket in self._one_lm_buckets else (False,)
            for b in (False, True) if bucket in self._block_buckets else (blocks,):
                for one in ones:
                    if b and not blocks:  # the capture runs the step once: its rows' blocks, not a past step's
                        self.kernel.fill_blocks(bucket)
                    self.capture(bucket, b, one)
        return self._graphs[bucket, blocks, one_lm]

    def capture(self, bucket: int, blocks: bool = False, one_lm: bool = False) -> torch.cuda.CUDAGraph:
        # compile and warm up outside the graph (this also writes K/V rows, at the positions the inputs hold:
        # those of the step about to run, which it then rewrites identically)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.kernel.step(bucket, blocks, one_lm)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.kernel.step(bucket, blocks, one_lm)
        except RuntimeError:
            if not self.kernel.cfg.cooperative:
                raise
            # a driver that cannot capture a cooperative launch: one program per SM is resident anyway
            self.kernel.cfg = dataclasses.replace(self.kernel.cfg, cooperative=False)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.kernel.step(bucket, blocks, one_lm)
        self._graphs[bucket, blocks, one_lm] = graph
        self.check_errors()
        return graph

    def check_errors(self) -> None:
        if int(self.kernel.err.item()) != 0:
            raise RuntimeError("megakernel: a dependency wait timed out (schedule or residency bug)")
