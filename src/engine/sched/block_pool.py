"""The KV block pool: fixed-size blocks, reference counts, LRU free list and prefix cache.

Owned by the KV cache manager (`kv_cache_manager.py`), the only caller. Block ids index the
workers' KV cache tensors; this module only does the bookkeeping, in plain Python lists (no
per-block objects), so allocating, freeing and touching cost a few list operations each.

- Block 0 is the *null block*: never handed out, never freed (workers may use it as padding).
- A block is *in use* while its reference count is positive. At zero it sits in the free
  list, which is kept in eviction order (least recently freed first) by an `OrderedDict`:
  a C doubly linked list with O(1) append, O(1) pop from the front and O(1) removal by key.
- A free block may still hold a cached prefix (its hash is registered). A prefix hit on it
  (`touch`) takes it out of the free list again; allocation pops the front of the free list
  and evicts its hash. Callers free a request's blocks tail first, so a request's last blocks
  (the least shareable ones) are evicted before its first ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["NULL_BLOCK_ID", "BlockPool"]

NULL_BLOCK_ID = 0


class BlockPool:
    """Reference-counted KV blocks with an LRU free list and a hash -> block prefix cache.

    Args:
        num_blocks: blocks in the KV cache, the null block included (at least 2).
        enable_caching: keep a prefix cache of full blocks.

    Raises:
        ValueError: `num_blocks` is below 2.
    """

    __slots__ = ("_block_hash", "_cached", "_free", "enable_caching", "num_blocks", "ref_cnt")

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks: got {num_blocks}, allowed: >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        #: Reference count per block id; the null block holds a permanent reference.
        self.ref_cnt: list[int] = [0] * num_blocks
        self.ref_cnt[NULL_BLOCK_ID] = 1
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    # -- capacity ------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached or not): what `get_new_blocks` can hand out."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    # -- allocation ----------------------------------------------------------------------------

    def get_new_blocks(self, num: int) -> list[int]:
        """Take `num` blocks from the front of the free list, evicting their cached hashes.

        Raises:
            ValueError: fewer than `num` blocks are free (callers check first).
        """
        free = self._free
        if num > len(free):
            raise ValueError(f"cannot allocate {num} blocks: only {len(free)} free")
        ref_cnt = self.ref_cnt
        block_hash = self._block_hash
        popitem = free.popitem
        out: list[int] = []
        for _ in range(num):
            block_id = popitem(last=False)[0]
            h = block_hash[block_id]
            if h is not None:
                self._evict(block_id, h)
            ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def _evict(self, block_id: int, block_hash: bytes) -> None:
        self._block_hash[block_id] = None
        if self._cached.get(block_hash) == block_id:
            del self._cached[block_hash]

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order; unreferenced ones join the free list.

        Pass a request's blocks in reverse (tail first) so its tail is evicted first.
        """
        ref_cnt = self.ref_cnt
        free = self._free
        for block_id in block_ids:
            count = ref_cnt[block_id] - 1
            ref_cnt[block_id] = count
            if count == 0:
                free[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix hit), taking free ones off the free list."""
        ref_cnt = self.ref_cnt
        free = self._free
        for block_id in block_ids:
            if ref_cnt[block_id] == 0:
                del free[block_id]
            ref_cnt[block_id] += 1

    def num_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks are free now (touching them uses up free capacity)."""
        ref_cnt = self.ref_cnt
        return sum(1 for block_id in block_ids if ref_cnt[block_id] == 0)

    # -- prefix cache --------------------------------------------------------------------------

    def get_cached_block(self, block_hash: bytes) -> int | None:
        """The block holding this hash's contents, or None."""
        return self._cached.get(block_hash)

    def block_hash_of(self, block_id: int) -> bytes | None:
        """The hash a block is cached under, or None."""
        return self._block_hash[block_id]

    def cache_full_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[bytes], start: int, end: int
    ) -> None:
        """Register blocks `start..end-1` of a request (now full) under their hashes.

        A block that is already cached keeps its hash; a hash that is already cached keeps its
        first block (the newer duplicate stays private to its request).
        """
        if not self.enable_caching:
            return
        block_hash = self._block_hash
        cached = self._cached
        for i in range(start, end):
            block_id = block_ids[i]
            if block_hash[block_id] is None:
                h = block_hashes[i]
                if h not in cached:
                    cached[h] = block_id
                    block_hash[block_id] = h

    def uncache(self, block_id: int) -> None:
        """Forget a block's cached prefix, if it holds one (its KV was never written)."""
        h = self._block_hash[block_id]
        if h is not None:
            self._evict(block_id, h)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; blocks in use stay valid for their requests.

        Returns:
            True (resetting never has to wait for requests to finish).
        """
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        return True

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache."""
        return len(self._cached)

    # -- checks (tests) ------------------------------------------------------------------------

    def free_block_ids(self) -> list[int]:
        """The free list in eviction order (front = evicted first)."""
        return list(self._free)

    def check_invariants(self) -> None:
        """Raise AssertionError if the books disagree (for tests and debugging)."""
        free = self._free
        for block_id in range(1, self.num_blocks):
            count = self.ref_cnt[block_id]
            if count < 0:
                raise AssertionError(f"block {block_id}: negative ref count {count}")
            if (count == 0) != (block_id in free):
                raise AssertionError(f"block {block_id}: ref count {count}, in free list {block_id in free}")
        if NULL_BLOCK_ID in free or self.ref_cnt[NULL_BLOCK_ID] != 1:
            raise AssertionError("the null block was freed or allocated")
        for h, block_id in self._cached.items():
            if self._block_hash[block_id] != h:
                raise AssertionError(f"block {block_id}: cached under a hash it does not carry")
