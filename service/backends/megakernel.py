"""The megakernel backend: one persistent Triton launch per decode step (kernels/), behind the Decoder interface.

Prefill stays in PyTorch (the ReferenceDecoder, compute-bound work that cuBLAS and SDPA do well), writing into
the same KV cache the kernel reads. The weights are packed once into the layer-stacked layout the kernel reads
(service/backends/packing.py); with bf16 weights the reference decoder sees views of those same tensors, with FP8
it runs on their dequantized copy.

Decode pads the batch to the next bucket (1, 2, 4, 8, 16) with rows that write into a spare scratch slot, and
on a GPU replays one CUDA graph per bucket.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from typing import TYPE_CHECKING

import torch

from service.backends.decoder import DecodeOutput, Draw
from service.backends.reference import ReferenceDecoder
from service.model.config import ModelConfig
from service.model.weights import ModelWeights

if TYPE_CHECKING:
    from kernels.instructions import ModelDims
    from kernels.megakernel import KernelConfig, PackedWeights


def megakernel_available() -> bool:
    """True where the megakernel can run: a CUDA device and an importable Triton. Cheap: compiles nothing."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


class MegakernelDecoder:
    name = "megakernel"
    draws_tokens = True  # temperature sampling runs inside the step (kernels/sampling.py)

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_slots: int = 8, max_context: int = 2048,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 num_programs: int | None = None, kernel_config: KernelConfig | None = None,
                 use_cuda_graphs: bool | None = None, weight_format: str = "bf16",
                 max_batch: int | None = None) -> None:
        from kernels.instructions import ModelDims
        from kernels.megakernel import Megakernel
        from service.backends.packing import pack_fp8, pack_weights
        from service.model.fp8 import quantize_model

        self.config = config
        self.max_slots = max_slots
        self.max_context = max_context
        self.device = torch.device(device)
        self.dtype = dtype
        self.weight_format = weight_format
        if weight_format == "fp8":
            quantized = quantize_model(weights, dtype)
            packed = pack_fp8(config, quantized, self.device, dtype)
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
        self._build_kernel(dims, packed, self.bucket_of(max_batch or max_slots, Megakernel.BUCKETS), num_programs,
                           kernel_config, use_cuda_graphs)

    def _build_kernel(self, dims: ModelDims, packed: PackedWeights, max_batch: int, num_programs: int | None,
                      kernel_config: KernelConfig | None, use_cuda_graphs: bool | None) -> None:
        from kernels.megakernel import Megakernel

        cache = self.reference.cache
        self.kernel = Megakernel(dims, packed, cache.k, cache.v, self.reference.cos, self.reference.sin,
                                 max_batch=max_batch, num_programs=num_programs, config=kernel_config)
        self.buckets = tuple(b for b in Megakernel.BUCKETS if b <= self.kernel.max_batch)
        self.use_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # one host buffer for the int32 input rows (tokens, slots, positions, the draw's three), one transfer
        n = self.kernel.bpad
        self._host = torch.zeros(6, n, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        # the last asynchronous copy out of _host; _host is not rewritten before it has run
        self._copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._inputs = torch.cat([torch.stack([self.kernel.tokens, self.kernel.slots, self.kernel.positions]),
                                  self.kernel.draw])
        self.kernel.tokens, self.kernel.slots, self.kernel.positions = self._inputs[:3].unbind(0)
        self.kernel.draw = self._inputs[3:]

    def with_kernel_config(self, kernel_config: KernelConfig, use_cuda_graphs: bool | None = None
                           ) -> MegakernelDecoder:
        """The same weights, cache and prefill under another kernel configuration (benchmarks compare variants
        without a copy of the model each)."""
        other = copy.copy(self)
        k = self.kernel
        other._build_kernel(k.dims, k.w, k.max_batch, k.num_programs, kernel_config, use_cuda_graphs)
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
        """The smallest bucket that holds n rows (the largest bucket for more: decode runs those in pieces)."""
        return next((b for b in buckets if b >= n), buckets[-1])

    @torch.inference_mode()
    def decode(self, slots: list[int], token_ids: list[int] | torch.Tensor, positions: list[int],
               draws: list[Draw] | None = None) -> DecodeOutput:
        n = len(slots)
        if not (n == len(token_ids) == len(positions)) or n == 0 or (draws is not None and len(draws) != n):
            raise ValueError("decode needs one slot, token and position (and draw, if any) per sequence")
        if max(positions) >= self.max_context or min(positions) < 0:
            raise ValueError(f"a position is outside the context of {self.max_context}")
        top = self.buckets[-1]
        if n > top:  # more sequences than the largest bucket: run it in pieces
            parts = [self.decode(slots[i:i + top], token_ids[i:i + top], positions[i:i + top],
                                 None if draws is None else draws[i:i + top])
                     for i in range(0, n, top)]
            sampled = [p.sampled for p in parts if p.sampled is not None]
            return DecodeOutput(torch.cat([p.logits for p in parts]), torch.cat([p.argmax for p in parts]),
                                None if draws is None else torch.cat(sampled))
        b = self.bucket(n)
        pad = b - n
        if self._copied is not None:
            self._copied.synchronize()
        on_device = isinstance(token_ids, torch.Tensor)  # the last step's argmax: never leaves the GPU
        if not on_device:
            self._host[0, :b] = torch.tensor(list(token_ids) + [0] * pad, dtype=torch.int32)
        self._host[1, :b] = torch.tensor(list(slots) + [self.scratch_slot] * pad, dtype=torch.int32)
        self._host[2, :b] = torch.tensor(list(positions) + [0] * pad, dtype=torch.int32)
        self._host[3:, :b] = 0  # padding rows and greedy requests: temperature 0
        if draws is not None:
            temps = torch.tensor([max(0.0, d.temperature) for d in draws], dtype=torch.float32)
            self._host[3, :n] = temps.view(torch.int32)
            from kernels.sampling import seed_words

            self._host[4:, :n] = seed_words(torch.tensor([d.seed for d in draws])).T
        self._inputs.copy_(self._host, non_blocking=True)
        if on_device:
            assert isinstance(token_ids, torch.Tensor)
            self.kernel.tokens[:n].copy_(token_ids)
        if self._copied is not None:
            self._copied.record()
        self.run_step(b)
        return DecodeOutput(self.kernel.logits[:n].clone(), self.kernel.argmax[:n].clone(),
                            None if draws is None else self.kernel.sampled[:n].clone())

    def draw(self, logits: torch.Tensor, draws: list[Draw], positions: list[int]) -> torch.Tensor:
        from kernels.sampling import draw

        dev = logits.device
        return draw(logits, torch.tensor([max(0.0, d.temperature) for d in draws], device=dev),
                    torch.tensor([d.seed for d in draws], dtype=torch.int64, device=dev),
                    torch.tensor(positions, dtype=torch.int32, device=dev))

    def run_step(self, bucket: int) -> None:
        """Run (or replay) the step of a bucket on whatever the input buffers hold."""
        if not self.use_graphs:
            self.kernel.step(bucket)
            return
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self.capture(bucket)
        graph.replay()

    def capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        # compile and warm up outside the graph (this also writes K/V rows, at the positions the inputs hold:
        # those of the step about to run, which it then rewrites identically)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.kernel.step(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.kernel.step(bucket)
        except RuntimeError:
            if not self.kernel.cfg.cooperative:
                raise
            # a driver that cannot capture a cooperative launch: one program per SM is resident anyway
            self.kernel.cfg = dataclasses.replace(self.kernel.cfg, cooperative=False)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.kernel.step(bucket)
        self._graphs[bucket] = graph
        self.check_errors()
        return graph

    def check_errors(self) -> None:
        if int(self.kernel.err.item()) != 0:
            raise RuntimeError("megakernel: a dependency wait timed out (schedule or residency bug)")
