"""Which of a launch's ops the megakernel calls as functions of their own and which it inlines into its task loop
(KernelConfig.call_min_rows, call_min_rows_8bit, call_attention_max_rows): the launches as Megakernel.step makes
them, captured on the CPU (nothing compiles)."""

from __future__ import annotations

import pytest

from bench.sm90_compile import capture_launch
from kernels.attention import attention
from kernels.matvec import matvec
from kernels.megakernel import attention_call, matvec_call


def _layers_launch(batch: int, weights: str) -> dict:
    launches = capture_launch("smollm2-135m", batch, weights, "default")
    return launches[0][2]  # the layers' launch (the LM head's tail is launched after it)


@pytest.mark.parametrize(("batch", "weights", "matvec_fn", "attention_fn"), [
    (1, "bf16", matvec, attention),  # bf16 under 16 rows: inlined (a call cost 0.4-1.4% a step there)
    (8, "bf16", matvec, attention),
    (16, "bf16", matvec_call, attention_call),
    (64, "bf16", matvec_call, attention),  # from 32 rows attention stays inlined
    (1, "fp8", matvec_call, attention_call),  # 8-bit: called from one row
    (16, "fp8", matvec_call, attention_call),
    (64, "fp8", matvec_call, attention),
])
def test_a_launch_calls_its_ops_by_its_rows_and_format(batch: int, weights: str, matvec_fn: object,
                                                         attention_fn: object) -> None:
    kwargs = _layers_launch(batch, weights)
    assert kwargs["MATVEC"] is matvec_fn
    assert kwargs["ATTENTION"] is attention_fn
