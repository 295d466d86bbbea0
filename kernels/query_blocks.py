"""Which rows of a step attend together: the query blocks (KernelConfig.query_blocks), computed on the host.

Rows of one slot at consecutive positions (a prompt's chunk) attend over the same keys and values. A run is such rows
side by side in the step, and the row that holds its next position where that row stands alone elsewhere in the
step (the engine puts a chunk's last row, the one that samples, first). A run is cut into blocks of at most
`rows_per_block` rows, as even as they go (no block of one row where the run has two), whose query heads fill one tile
of the kernel's attention (kernels/attention.py): a block reads its keys and values once for all its rows. A block's
rows are side by side in the step but for its last, the tail, which may stand elsewhere. A decode row is a block of
one.

The kernel reads, per row, its block's first row, its rows, the position of its last row, the row's index in its
block and the block's tail row: each attention task finds its block in one round trip of independent loads.

The blocks' path runs in a launch of its own (KernelConfig.query_blocks), which pays where every row of a step is in a
block of several attending over a long context (a voice turn's prompt over its conversation: a decode row's task, on
its own, takes as long as before and the step waits for it) and costs elsewhere (its registers spill the other
phases'): uses_blocks says which steps take it.
"""

from __future__ import annotations

BLOCK_FIELDS = 5  # first row, rows, last position, index in the block, tail row


def query_blocks(slots: list[int], positions: list[int], rows_per_block: int) -> list[list[int]]:
    """Each row's [first row of its block, rows in its block, position of the block's last row, the row's index in
    its block, the block's tail row], field by field."""
    n = len(slots)
    runs: list[list[int]] = []
    for i in range(n):
        r = runs[-1] if runs else None
        if r is not None and slots[i] == slots[r[-1]] and positions[i] == positions[r[-1]] + 1:
            r.append(i)
        else:
            runs.append([i])
    alone = {(slots[r[0]], positions[r[0]]): k for k, r in enumerate(runs) if len(r) == 1}
    taken: set[int] = set()
    for r in runs:
        k = alone.get((slots[r[-1]], positions[r[-1]] + 1)) if len(r) > 1 else None
        if k is not None and k not in taken:
            taken.add(k)
            r.append(runs[k][0])
    out = [[0] * n for _ in range(BLOCK_FIELDS)]
    for k, r in enumerate(runs):
        if k in taken:
            continue
        count = -(-len(r) // rows_per_block)
        start = 0
        for b in range(count):
            block = r[start:start + len(r) // count + (1 if b < len(r) % count else 0)]
            start += len(block)
            for j, row in enumerate(block):
                for f, v in enumerate((block[0], len(block), positions[block[-1]], j, block[-1])):
                    out[f][row] = v
    return out


def uses_blocks(blocks: list[list[int]], rows: int, min_positions: int) -> bool:
    """Whether a step takes the blocks' launch: each of its first `rows` rows (the step's own, not its padding) is in a
    block of several, and they attend over min_positions positions or more, summed (what per-row attention would read
    once a row). min_positions 0: every step with a block of several rows (how the tests run the path beside decode
    rows)."""
    sizes, last = blocks[1][:rows], blocks[2][:rows]
    if min_positions <= 0:
        return max(sizes) > 1
    return min(sizes) > 1 and sum(last) + rows >= min_positions
