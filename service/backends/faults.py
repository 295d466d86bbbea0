"""FaultInjectingDecoder: wraps a decoder to slow every step down, make one step raise, or make one step hang, for
tests of admission and of fault handling against a real server (`--step-delay-ms`, `--fail-step`, `--hang-step`)."""

from __future__ import annotations

import time

import torch

from service.backends.decoder import DecodeOutput, Decoder, Draw, Fed


class InjectedFault(RuntimeError):
    pass


HANG_S = 3600.0  # a hung step sleeps this long: far past any wedge timeout (the process is killed first)


class FaultInjectingDecoder:
    def __init__(self, inner: Decoder, step_delay_s: float = 0.0, fail_step: int = 0, hang_step: int = 0,
                 hang_s: float = HANG_S) -> None:
        self.inner = inner
        self.step_delay_s = step_delay_s
        self.fail_step = fail_step
        self.hang_step, self.hang_s = hang_step, hang_s
        self.armed = True  # faults count steps only while armed (a server arms them once it is warm)
        self.steps = 0
        self.config, self.max_slots, self.max_context = inner.config, inner.max_slots, inner.max_context
        self.device, self.name, self.draws_tokens = inner.device, inner.name, inner.draws_tokens
        self.feeds = getattr(inner, "feeds", False)
        self.max_rows = getattr(inner, "max_rows", None)

    def prefill(self, slot: int, token_ids: list[int], start_pos: int = 0) -> torch.Tensor:
        return self.inner.prefill(slot, token_ids, start_pos)

    @property
    def slow_prefills(self) -> int:
        return self.inner.slow_prefills

    @property
    def query_block_steps(self) -> int:
        return self.inner.query_block_steps

    def prefill_graph_buckets(self) -> list[int] | None:
        return self.inner.prefill_graph_buckets()

    def copy_prefix(self, src_slot: int, dst_slot: int, n_tokens: int) -> None:
        self.inner.copy_prefix(src_slot, dst_slot, n_tokens)

    def draw(self, logits: torch.Tensor, draws: list[Draw], positions: list[int]) -> torch.Tensor:
        return self.inner.draw(logits, draws, positions)

    def decode(self, slots: list[int], token_ids: list[int] | torch.Tensor | Fed, positions: list[int],
               draws: list[Draw] | None = None, sampled_rows: int | None = None,
               masks: dict[int, torch.Tensor] | None = None) -> DecodeOutput:
        if self.armed:
            self.steps += 1
        if self.armed and self.steps == self.fail_step:
            raise InjectedFault(f"injected fault in decode step {self.steps}")
        if self.armed and self.steps == self.hang_step:  # a wedged device: the engine thread never comes back
            time.sleep(self.hang_s)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return self.inner.decode(slots, token_ids, positions, draws, sampled_rows, masks)
