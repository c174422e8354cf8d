"""Per-request KV block tables over the block pool, with prefix-cache lookups.

Owned by the scheduler (`scheduler.py`), which asks it, for each request it wants to run,
which leading blocks are already cached (`get_computed_blocks`) and for slots for the tokens
it schedules (`allocate_slots`), and tells it when a request is preempted or finished
(`free`). It owns the block table of every running request and the prefix-cache statistics,
and hashes request tokens into the chain described in `block_hash.py`.

Prompt blocks are hashed at intake and registered in the prefix cache as soon as their slots
are allocated. A request scheduled later in the same step may therefore hit a block whose KV
the same step writes; like vLLM, this relies on the worker writing a layer's new KV for the
whole batch before that layer's attention reads it. Blocks filled by decoding are hashed and
registered when the request leaves the running set (finished, aborted or preempted), not in
the decode loop: the steady-state decode step then does no prefix-cache work at all (the
"0% hit rate costs < 1%" target), and those blocks only matter to later requests (follow-up
turns) and to the request itself when it resumes after a preemption.
"""

from __future__ import annotations

from ringserve.engine.sched.block_hash import hash_full_blocks, root_hash
from ringserve.engine.sched.block_pool import BlockPool
from ringserve.engine.sched.request import Request
from ringserve.gpu.multimodal.features import block_keys

__all__ = ["KVCacheManager", "PrefixCacheStats"]

# Returned when no block was added (never mutated by callers).
_NO_BLOCKS: list[int] = []


class PrefixCacheStats:
    """Prefix-cache lookups since the last `take()`: requests, queried and hit tokens."""

    __slots__ = ("hits", "queries", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.queries = 0
        self.hits = 0

    def take(self) -> tuple[int, int, int]:
        """(requests, queries, hits) since the last call, then reset."""
        out = (self.requests, self.queries, self.hits)
        self.requests = self.queries = self.hits = 0
        return out


class KVCacheManager:
    """Block tables of running requests, allocation with prefix hits, and prefix hashing.

    Args:
        num_blocks: blocks in the KV cache, the null block included.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests with a common prefix.
    """

    __slots__ = ("_blocks", "block_pool", "block_size", "enable_caching", "stats")

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: got {block_size}, allowed: >= 1")
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.stats = PrefixCacheStats()
        self._blocks: dict[str, list[int]] = {}

    # -- hashing -------------------------------------------------------------------------------

    def hash_request(self, request: Request) -> None:
        """Hash the full blocks of a new request's prompt (prefix caching on only)."""
        if self.enable_caching:
            request.block_hashes = hash_full_blocks(
                root_hash(request.cache_salt), request.all_token_ids, self.block_size,
                extra_keys=block_keys(request.mm_features) if request.mm_features else None,
            )

    def hash_blocks(self, request: Request, num_blocks: int) -> None:
        """Extend the request's block hashes to its first `num_blocks` full blocks."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else root_hash(request.cache_salt)
            hashes.extend(
                hash_full_blocks(
                    parent, request.all_token_ids, self.block_size, len(hashes), num_blocks,
                    block_keys(request.mm_features) if request.mm_features else None,
                )
            )

    # -- lookups and allocation ------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of the request's leading blocks found in the prefix cache.

        The hit is capped so at least the last known token is computed (its logits are
        needed), and is empty for requests that skip the cache read (prompt logprobs).

        Returns:
            (block ids, number of tokens they hold).
        """
        if not self.enable_caching or request.skip_prefix_cache_read:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.block_pool.get_cached_block
        hit: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit, len(hit) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup in the statistics."""
        if self.enable_caching and not request.skip_prefix_cache_read:
            stats = self.stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        new_computed_blocks: list[int] | None = None,
        cache_blocks: bool = True,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of a request (plus lookahead slots).

        Args:
            request: the request; `num_computed_tokens` counts tokens already holding slots.
            num_new_tokens: tokens to compute this step.
            num_lookahead_tokens: extra slots (speculative tokens).
            new_computed_blocks: prefix-cache hits from `get_computed_blocks` (new or resumed
                requests only); they join the request's block table ahead of the new blocks,
                and their tokens count as computed.
            cache_blocks: register the blocks this step fills in the prefix cache now; the
                scheduler passes False for running requests that a later preemption in the
                same step could take back, and calls `cache_blocks` once that is settled.

        Returns:
            The newly allocated block ids (hits excluded; a shared empty list, not to be
            mutated, when there are none), or None when the pool cannot supply them
            (nothing changes then).
        """
        blocks = self._blocks.get(request.request_id)
        bs = self.block_size
        if blocks is not None and not new_computed_blocks:
            total = request.num_computed_tokens + num_new_tokens
            if total + num_lookahead_tokens <= len(blocks) * bs:
                # Fast path (most decode steps): the last block still has room. Blocks that
                # filled meanwhile are registered on the next allocation or at `free`.
                return _NO_BLOCKS
        is_new = blocks is None
        if blocks is None:
            # Registered only once allocation succeeds: a refused request holds nothing.
            blocks = []
        num_computed = request.num_computed_tokens
        hits = new_computed_blocks or ()
        num_hits = len(hits)
        num_computed += num_hits * bs
        total = num_computed + num_new_tokens + num_lookahead_tokens
        num_new_blocks = (total + bs - 1) // bs - len(blocks) - num_hits
        pool = self.block_pool
        if num_new_blocks > 0 or num_hits:
            evictable = pool.num_evictable(hits) if num_hits else 0
            if max(num_new_blocks, 0) + evictable > pool.num_free_blocks:
                return None
            if num_hits:
                pool.touch(hits)
                blocks.extend(hits)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            blocks.extend(new_blocks)
        if is_new:
            self._blocks[request.request_id] = blocks
            request.num_cached_blocks = num_hits
        if self.enable_caching and cache_blocks:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_slots: int) -> None:
        """Register the request's full, hashed blocks within its first `num_slots` slots."""
        blocks = self._blocks.get(request.request_id)
        if self.enable_caching and blocks is not None:
            self._cache_full_blocks(request, blocks, num_slots)

    def _cache_full_blocks(self, request: Request, blocks: list[int], num_slots: int) -> None:
        # Only blocks already hashed (the prompt's, and those hashed when the request was
        # preempted) whose tokens are all known: with async scheduling the last scheduled
        # position may hold a sampled token the core has not received yet.
        tokens = request.num_tokens
        num_full = (num_slots if num_slots < tokens else tokens) // self.block_size
        num_hashed = len(request.block_hashes)
        if num_full > num_hashed:
            num_full = num_hashed
        num_cached = request.num_cached_blocks
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
            request.num_cached_blocks = num_full

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """Take back the prefix-cache entries of the request's blocks from the one holding
        token `num_tokens` on (a step that was scheduled but never run registered them, and
        their KV was not written: `Scheduler.rollback_step`)."""
        blocks = self._blocks.get(request.request_id)
        if blocks is None or not self.enable_caching:
            return
        first = num_tokens // self.block_size
        uncache = self.block_pool.uncache
        for k in range(first, min(request.num_cached_blocks, len(blocks))):
            uncache(blocks[k])
        if request.num_cached_blocks > first:
            request.num_cached_blocks = first

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so its tail is evicted before its head.

        With prefix caching, the full blocks it computed while decoding are hashed and
        registered first (once per request rather than once per filled block in the decode
        loop), so a follow-up turn, or the request itself after a preemption, can hit them.
        Call it before resetting the request's `num_computed_tokens`.
        """
        blocks = self._blocks.pop(request.request_id, None)
        if blocks is None:
            return
        if self.enable_caching:
            computed = request.num_computed_tokens
            tokens = request.num_tokens
            num_full = min(computed if computed < tokens else tokens, len(blocks) * self.block_size)
            num_full //= self.block_size
            if num_full > request.num_cached_blocks:
                self.hash_blocks(request, num_full)
                self.block_pool.cache_full_blocks(
                    blocks, request.block_hashes, request.num_cached_blocks, num_full
                )
        request.num_cached_blocks = 0
        self.block_pool.free_blocks(reversed(blocks))

    # -- queries -------------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list: do not mutate)."""
        return self._blocks.get(request_id, [])

    def has_blocks(self, request_id: str) -> bool:
        """True while the request holds blocks."""
        return request_id in self._blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return self.block_pool.usage

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (blocks in use stay with their requests)."""
        # Per-request counts of registered blocks stay as they are: blocks registered before
        # the reset stay unregistered, blocks that fill later are registered again.
        return self.block_pool.reset_prefix_cache()

    def take_stats(self) -> tuple[int, int, int]:
        """(requests, queried tokens, hit tokens) since the last call."""
        return self.stats.take()

    def check_invariants(self) -> None:
        """Raise AssertionError if the block tables and the pool disagree (tests)."""
        pool = self.block_pool
        pool.check_invariants()
        expected = [0] * pool.num_blocks
        expected[0] = 1
        for blocks in self._blocks.values():
            for block_id in blocks:
                expected[block_id] += 1
        if expected != pool.ref_cnt:
            diff = [i for i, (a, b) in enumerate(zip(expected, pool.ref_cnt, strict=True)) if a != b]
            raise AssertionError(f"ref counts disagree with block tables at blocks {diff[:10]}")
