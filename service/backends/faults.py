"""FaultInjectingDecoder: wraps a decoder to slow every step down or make one step raise, for tests of admission
and of fault handling against a real server (`--step-delay-ms`, `--fail-step`)."""

from __future__ import annotations

import time

import torch

from service.backends.decoder import DecodeOutput, Decoder


class InjectedFault(RuntimeError):
    pass


class FaultInjectingDecoder:
    def __init__(self, inner: Decoder, step_delay_s: float = 0.0, fail_step: int = 0) -> None:
        self.inner = inner
        self.step_delay_s = step_delay_s
        self.fail_step = fail_step
        self.steps = 0
        self.config, self.max_slots, self.max_context = inner.config, inner.max_slots, inner.max_context
        self.device, self.name = inner.device, inner.name

    def prefill(self, slot: int, token_ids: list[int], start_pos: int = 0) -> torch.Tensor:
        return self.inner.prefill(slot, token_ids, start_pos)

    def decode(self, slots: list[int], token_ids: list[int], positions: list[int]) -> DecodeOutput:
        self.steps += 1
        if self.steps == self.fail_step:
            raise InjectedFault(f"injected fault in decode step {self.steps}")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return self.inner.decode(slots, token_ids, positions)
