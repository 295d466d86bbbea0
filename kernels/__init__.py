"""Triton kernels: the decode-step megakernel and the in-kernel sampling. Nothing here imports the service.

instructions.py  the instruction set and the schedule, built on the host
megakernel.py    the kernel's entry (one persistent launch a step, a task at a time) and Megakernel, which launches it
kernel_args.py   what the kernel takes: the packed weights (PackedWeights) and the NamedTuples
tiles.py         how each matvec streams its weights (MatvecTile) and the default tiles of a launch
matvec.py        the matrix path: QKV (with RoPE, the K/V append), O projection, gate/up, down, LM head; the norms
attention.py     flash-decoding over the KV cache, split by position; a prompt chunk's rows in query blocks
query_blocks.py  which rows of a step attend together (on the host)
lm_head.py       the LM head's (max, argmax) partials, greedy and drawn, and the Argmax task that reduces them
sync.py          the waits on dependency counters, reads through L2, prefetches into L2
sampling.py      the Gumbel-max draw (Philox noise) the LM head runs, and the same draw over ready logits
"""

from __future__ import annotations

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's interpreter runs the kernels (the CPU tests)


def _interpreter_numpy2_shim() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with int() of a one-element array, which numpy ≥ 2.4
    refuses (a loop bound loaded from memory then fails). Patch that one conversion, for the interpreter only."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_parley_shim", False):
        return

    def patched(tensor, scope):  # noqa: ANN001, ANN202
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._parley_shim = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if INTERPRET:
    _interpreter_numpy2_shim()
