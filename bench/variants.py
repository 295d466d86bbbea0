"""The megakernel's configurations the decode bench can time beside its default (`python -m bench decode --variants
NAME ...`), and that `python -m bench sm90-compile` compiles: each a function of whether the weights are FP8 (their
default tiles differ). bench/NOTES.md says what each measured."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernels.instructions import Op
from kernels.megakernel import MATVECS, KernelConfig, MatvecTile, default_tiles


def _tiles(fp8: bool, ops: tuple[Op, ...] = MATVECS, min_rows: int = 1, **change: Any
           ) -> Callable[[int], dict[Op, MatvecTile]]:
    """The default tiles of each launch's rows, with `change` applied to `ops` in launches of at least min_rows."""
    def table(rows: int) -> dict[Op, MatvecTile]:
        tiles = default_tiles(fp8, rows)
        if rows < min_rows:
            return tiles
        return {op: t._replace(**change) if op in ops else t for op, t in tiles.items()}

    return table


WIDE = 32  # the buckets whose default tiles differ (default_tiles)

# Kernel variants the bench can time beside the default (--variants NAME ...): each a function of whether the
# weights are FP8 (their default tiles differ). bench/NOTES.md says what each measured. The "w-" variants change
# only the wide buckets' tiles (32 and 64 rows).
VARIANTS: dict[str, Callable[[bool], KernelConfig]] = {
    "default": lambda fp8: KernelConfig(),
    # weights through the tensor-memory accelerator in every matvec (boxes of at most 256 columns)
    "tma": lambda fp8: KernelConfig(tiles=_tiles(fp8, tma=True, k_chunk=256, stages=6 if fp8 else 4)),
    "lm-pointers": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.LMHEAD,), tma=False)),
    "one-stream": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.OPROJ, Op.DOWN), k_halves=False)),
    # weights prefetched into L2 a task ahead instead of before each task's own wait
    "pf-ahead": lambda fp8: KernelConfig(prefetch_own=False, prefetch_ahead=1),
    "no-kv-prefetch": lambda fp8: KernelConfig(prefetch_kv=False),
    "pft2": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.GATEUP,), prefetch_tiles=2)),
    "st6": lambda fp8: KernelConfig(tiles=_tiles(fp8, stages=6)),
    "qkv8": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.QKV,), rows=8)),
    "bk2x": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.QKV, Op.OPROJ, Op.DOWN), k_chunk=1024 if fp8 else 512)),
    "invariant": lambda fp8: KernelConfig(batch_invariant=True),
    # attention splits of one 64-position chunk at least (default: 4): short contexts spread over several programs
    "split1": lambda fp8: KernelConfig(split_min_chunks=1),
    "split2": lambda fp8: KernelConfig(split_min_chunks=2),
    "split1-ch32": lambda fp8: KernelConfig(split_min_chunks=1, chunk=32),
    # attention waits for the whole QKV phase (one counter a phase), as before the per-KV-head counters
    "phase-counters": lambda fp8: KernelConfig(head_counters=False),
    # wide buckets: the 16-row buckets' tiles (16-row tiles, 4 k slices) over 128-column k chunks
    "w-narrow": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN), WIDE, rows=16,
                                                      k_slices=4)),
    # wide buckets: gate/up in 64-row tiles (one tile a program: the activation read once per task)
    "w-gateup64": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.GATEUP,), WIDE, rows=64, k_chunk=64)),
    # wide buckets: O and down in 32-row tiles (half as many tasks, each activation read feeds twice the rows)
    "w-od32": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.OPROJ, Op.DOWN), WIDE, rows=32)),
    # wide buckets: one k slice (the dot's M spreads over the warps already)
    "w-ks1": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN), WIDE, k_slices=1)),
    # wide buckets: 3 pipeline stages (shared memory for wider tiles)
    "w-st3": lambda fp8: KernelConfig(tiles=_tiles(fp8, (Op.QKV, Op.OPROJ, Op.GATEUP, Op.DOWN), WIDE, stages=3)),
}
