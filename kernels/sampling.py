"""Sampling inside the kernel: the Gumbel-max trick on the LM head's logits, keyed by (seed, position, token id).

argmax_v(logits[v] / T + G[v]) with G[v] i.i.d. Gumbel(0, 1) is a draw from softmax(logits / T), so the LM-head
tasks can sample with the same tile-wise (max, argmax) reduction they already run for greedy decoding: no
softmax, no sort, no second pass over the vocabulary, no launch after the step. The noise is Philox (Triton's
counter-based generator) on the counter (token id, position, seed low, seed high) under one fixed key: a row's
draw depends only on its request's seed and position, never on the batch it ran in or on the step's other rows,
so a seeded request reproduces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PHILOX_KEY = tl.constexpr(0x5EED5EED)


@triton.jit
def gumbel_perturb(logits, cols, temperature, seed_lo, seed_hi, position):
    """logits [R, C] float32 for the token ids cols [C]; temperature, seed_lo, seed_hi, position [R] (int32 seeds).
    Rows with temperature > 0 become logits / T + Gumbel noise; other rows (greedy) come back unchanged."""
    zero = tl.zeros(logits.shape, tl.int32)  # four int32 counters per element (Philox-4x32)
    r, _, _, _ = tl.philox(PHILOX_KEY, cols.to(tl.int32)[None, :] + zero, position.to(tl.int32)[:, None] + zero,
                           seed_lo.to(tl.int32)[:, None] + zero, seed_hi.to(tl.int32)[:, None] + zero)
    u = tl.uint_to_uniform_float(r)  # [0, 1): u = 0 gives -inf, a token never drawn (p = 2^-31)
    g = -tl.log(-tl.log(u))
    hot = temperature > 0
    inv_t = 1.0 / tl.where(hot, temperature, 1.0)
    return tl.where(hot[:, None], logits * inv_t[:, None] + g, logits)


@triton.jit
def gumbel_best(logits, cols, temperature, seed_lo, seed_hi, position, n_cols):
    """Per row of a block: the largest perturbed score and, of equal ones, the first column (int32)."""
    sc = gumbel_perturb(logits, cols, temperature, seed_lo, seed_hi, position)
    mx = tl.max(sc, axis=1)
    return mx, tl.min(tl.where(sc == mx[:, None], cols[None, :], n_cols), axis=1).to(tl.int32)


def seed_words(seeds: torch.Tensor) -> torch.Tensor:
    """Seeds (int64, in [0, 2^63)) as the int32 words the kernels read: [n, 2], (low, high) per row."""
    return seeds.to(torch.int64).contiguous().view(torch.int32).view(-1, 2)



@triton.jit
def _draw_rows(logits_ptr, n_rows, n_cols, temp_ptr, words_ptr, pos_ptr, best_v_ptr, best_i_ptr, n_blocks,
               RB: tl.constexpr, BC: tl.constexpr):
    """The (max, argmax) of the perturbed scores of RB rows over one block of BC columns."""
    rr = tl.program_id(0) * RB + tl.arange(0, RB)
    blk = tl.program_id(1)
    live = rr < n_rows
    temperature = tl.load(temp_ptr + rr, mask=live, other=0.0)
    seed_lo = tl.load(words_ptr + 2 * rr, mask=live, other=0)
    seed_hi = tl.load(words_ptr + 2 * rr + 1, mask=live, other=0)
    position = tl.load(pos_ptr + rr, mask=live, other=0)
    rc = blk * BC + tl.arange(0, BC)
    m = live[:, None] & (rc[None, :] < n_cols)
    lg = tl.load(logits_ptr + rr.to(tl.int64)[:, None] * n_cols + rc[None, :], mask=m, other=float("-inf"))
    mx, idx = gumbel_best(lg, rc, temperature, seed_lo, seed_hi, position, n_cols)
    tl.store(best_v_ptr + rr * n_blocks + blk, mx, mask=live)
    tl.store(best_i_ptr + rr * n_blocks + blk, idx, mask=live)


def draw(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The same draw over whole rows of ready logits ([rows, vocab] float32; temperature [rows], 0 for greedy;
    seeds int64 in [0, 2^63) [rows]; positions [rows]): int64 tokens. What the megakernel's LM head computes tile
    by tile. Blocks of columns run side by side (one program for a 128k vocabulary took 5 ms); the first block holding
    the best score wins, so equal scores resolve to the first column, as in the kernel."""
    rows, cols = logits.shape
    words = seed_words(seeds)
    rb = min(16, triton.next_power_of_2(rows))
    bc = max(16, min(1024, triton.next_power_of_2(cols), 8192 // rb))
    n_blocks = triton.cdiv(cols, bc)
    best_v = torch.empty(rows, n_blocks, dtype=torch.float32, device=logits.device)
    best_i = torch.empty(rows, n_blocks, dtype=torch.int32, device=logits.device)
    _draw_rows[(triton.cdiv(rows, rb), n_blocks)](
        logits.float().contiguous(), rows, cols, temperature.float().contiguous(), words,
        positions.to(torch.int32).contiguous(), best_v, best_i, n_blocks, RB=rb, BC=bc)
    return best_i.gather(1, best_v.argmax(1, keepdim=True))[:, 0].long()
