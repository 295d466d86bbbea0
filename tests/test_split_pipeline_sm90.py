"""A split tile's merge after its stream's loop (MatvecTile.merge_after), compiled for the H100 (sm_90) on the CPU:
with the merge (its stores, a barrier, the acq_rel arrival) inside the loop at the tile's last chunk, Triton does not
pipeline the loop, and a split task's weights stream with no asynchronous copy at all; after it (the default since
s90), they do. FP8's 64-row launch splits down's K over 4 tasks (kernels/tiles.py, W8A8_DOWN); the numerics either
way are the interpreter's cases (`*-inside-*` with the merge inside, tests/test_megakernel_interpret.py)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("merge_after", [False, True])
def test_a_split_tasks_stream_is_pipelined_only_with_its_merge_after_the_loop(merge_after: bool) -> None:
    from bench.sm90_compile import capture_launch, compile_sm90, split_streams
    from kernels.megakernel import KernelConfig
    from kernels.tiles import default_tiles

    def tiles(rows: int) -> dict:
        return {op: t._replace(merge_after=merge_after) for op, t in default_tiles(True, rows, e4m3=True).items()}

    fn, args, kwargs = capture_launch("llama-3.2-1b", 64, "fp8", "default", KernelConfig(tiles=tiles))[0]
    copies = split_streams(compile_sm90(fn, args, dict(kwargs)).asm["ttgir"])
    assert len(copies) == 1  # down, the one split matvec of the 64-row FP8 launch
    assert (copies[0] > 0) == merge_after, copies
