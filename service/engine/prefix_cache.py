"""PrefixCache: for every KV slot, the token ids whose K/V it holds, and an index that finds the slots holding the
longest prefix of a prompt.

A slot's tokens are cut into blocks of BLOCK_TOKENS; each full block gets a chained hash (the hash of the block's
tokens and of the previous block's hash), so a block's hash stands for the whole prefix up to its end. The index maps
each hash to the slots holding that prefix. A lookup hashes the prompt once (block_hashes, ~65 µs for 4,000 tokens),
finds by bisection the deepest block some slot shares (a chain shared to block k is shared to every block before
it), and extends each such slot's match token by token into the next block. Whoever uses a match confirms it with
one exact comparison (holds: ~12 µs for 4,000 tokens): that is what guards against hash collisions (Python's hash of
ints is no secret, so a client could craft one), and a slot is never taken to hold tokens it does not hold.

Not thread-safe on its own: KVSlots serializes every call.
"""

from __future__ import annotations

from collections.abc import Sequence

BLOCK_TOKENS = 16


def block_hashes(tokens: Sequence[int], known: Sequence[int] = ()) -> list[int]:
    """The chained hashes of every full block of `tokens`; `known`: those of its first blocks, already computed."""
    hashes = list(known)
    prev = hashes[-1] if hashes else 0
    for start in range(len(hashes) * BLOCK_TOKENS, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        prev = hash((prev, tuple(tokens[start:start + BLOCK_TOKENS])))
        hashes.append(prev)
    return hashes


class PrefixCache:
    def __init__(self, num_slots: int) -> None:
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._hashes: list[list[int]] = [[] for _ in range(num_slots)]
        self._index: dict[int, set[int]] = {}  # block-chain hash → slots holding that prefix

    def tokens(self, slot: int) -> list[int]:
        """The tokens whose K/V `slot` holds, from position 0 (do not modify)."""
        return self._tokens[slot]

    # -- lookups ------------------------------------------------------------------------------------------
    def matches(self, prompt: list[int], blocks: Sequence[int]) -> dict[int, int]:
        """The slots sharing the most full blocks with `prompt` (its block_hashes: `blocks`), each with the length of
        the prefix it shares as the hashes say (holds() confirms it). Empty when no slot shares a whole block."""
        lo, hi = 0, len(blocks)  # the deepest shared block: blocks[:lo] are in the index
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in self._index:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return {}
        return {s: self._extend(s, prompt, lo * BLOCK_TOKENS) for s in self._index[blocks[lo - 1]]}

    def holds(self, slot: int, prompt: list[int], n: int) -> bool:
        """Whether `slot` holds the first `n` tokens of `prompt`, exactly."""
        return self._tokens[slot][:n] == prompt[:n]

    def common_prefix(self, slot: int, prompt: list[int], blocks: Sequence[int]) -> int:
        """How many leading tokens of `prompt` `slot` holds, exactly."""
        hashes = self._hashes[slot]
        lo, hi = 0, min(len(hashes), len(blocks))  # the blocks whose chains agree: hashes[:lo]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] == blocks[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        n = lo * BLOCK_TOKENS
        return self._extend(slot, prompt, n if self.holds(slot, prompt, n) else 0)  # else a hash collision

    def _extend(self, slot: int, prompt: list[int], n: int) -> int:
        """n, and as many tokens after it as `slot` and `prompt` share."""
        tokens = self._tokens[slot]
        end = min(len(tokens), len(prompt))
        while n < end and tokens[n] == prompt[n]:
            n += 1
        return n

    # -- what a slot holds --------------------------------------------------------------------------------
    def set(self, slot: int, tokens: list[int], keep: int, blocks: Sequence[int] = ()) -> None:
        """`slot` now holds `tokens`, of which the first `keep` it held already. `blocks`: block_hashes of a prefix
        of `tokens`, where the caller has them (a prompt's), so they need not be computed again."""
        kept = min(keep, len(tokens)) // BLOCK_TOKENS
        self._drop(slot, kept)
        known = blocks if len(blocks) > kept else self._hashes[slot][:kept]
        self._tokens[slot] = tokens
        self._add(slot, block_hashes(tokens, known[: len(tokens) // BLOCK_TOKENS]))

    def truncate(self, slot: int, n: int) -> None:
        """`slot` keeps its first `n` tokens."""
        if n < len(self._tokens[slot]):
            self.set(slot, self._tokens[slot][:n], n)

    def copy(self, src: int, dst: int, n: int) -> None:
        """`dst` now holds the first `n` tokens of `src` (their K/V are copied over)."""
        self._drop(dst, 0)
        self._tokens[dst] = self._tokens[src][:n]
        self._add(dst, self._hashes[src][: n // BLOCK_TOKENS])

    def _drop(self, slot: int, kept_blocks: int) -> None:
        hashes = self._hashes[slot]
        for h in hashes[kept_blocks:]:
            holders = self._index.get(h)
            if holders is not None:
                holders.discard(slot)
                if not holders:
                    del self._index[h]
        del hashes[kept_blocks:]

    def _add(self, slot: int, hashes: list[int]) -> None:
        for h in hashes[len(self._hashes[slot]):]:
            self._index.setdefault(h, set()).add(slot)
        self._hashes[slot] = hashes
