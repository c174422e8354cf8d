"""BlockPool: allocation, reference counts, LRU eviction order, prefix-cache registration."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sched_fakes import check_no_leaks, make_pool

from ringserve.engine.sched.block_pool import NULL_BLOCK_ID, BlockPool


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    yield from check_no_leaks()


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_allocate_and_free_counts_usage() -> None:
    pool = make_pool(11)
    assert pool.num_usable_blocks == 10 and pool.num_free_blocks == 10 and pool.usage == 0.0
    blocks = pool.get_new_blocks(4)
    assert NULL_BLOCK_ID not in blocks and len(set(blocks)) == 4
    assert all(pool.ref_cnt[b] == 1 for b in blocks)
    assert pool.num_free_blocks == 6 and pool.usage == pytest.approx(0.4)
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 10 and pool.usage == 0.0
    pool.check_invariants()


def test_null_block_is_never_handed_out() -> None:
    pool = make_pool(5)
    blocks = pool.get_new_blocks(4)
    assert sorted(blocks) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)


def test_too_few_blocks_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_freed_in_reverse_evicts_tail_first() -> None:
    pool = make_pool(9)
    a = pool.get_new_blocks(4)
    b = pool.get_new_blocks(4)
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert pool.free_block_ids() == a[::-1] + b[::-1]
    again = pool.get_new_blocks(3)
    assert again == a[::-1][:3]
    pool.free_blocks(again)


def test_touch_takes_free_block_off_the_free_list() -> None:
    pool = make_pool(5)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h(1), h(2)], 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4 and pool.num_evictable(blocks) == 2
    pool.touch(blocks)
    assert pool.num_free_blocks == 2 and all(pool.ref_cnt[b] == 1 for b in blocks)
    pool.touch(blocks[:1])
    assert pool.ref_cnt[blocks[0]] == 2
    pool.free_blocks(blocks[:1])
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4
    # A touched-then-freed block moves to the back of the LRU order.
    assert pool.free_block_ids()[-2:] == blocks[::-1]


def test_cache_full_blocks_and_eviction_on_reuse() -> None:
    pool = make_pool(4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [h(1), h(2), h(3)], 0, 2)
    assert pool.get_cached_block(h(1)) == blocks[0]
    assert pool.get_cached_block(h(2)) == blocks[1]
    assert pool.get_cached_block(h(3)) is None
    assert pool.num_cached_blocks == 2
    pool.free_blocks(reversed(blocks))
    # Reallocating evicts: the free list front is blocks[2] (uncached), then blocks[1].
    got = pool.get_new_blocks(2)
    assert got == [blocks[2], blocks[1]]
    assert pool.get_cached_block(h(2)) is None and pool.block_hash_of(blocks[1]) is None
    assert pool.get_cached_block(h(1)) == blocks[0]
    pool.free_blocks(got)
    pool.check_invariants()


def test_duplicate_hash_keeps_first_block() -> None:
    pool = make_pool(4)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [h(7)], 0, 1)
    pool.cache_full_blocks(b, [h(7)], 0, 1)
    assert pool.get_cached_block(h(7)) == a[0] and pool.block_hash_of(b[0]) is None
    pool.free_blocks(a + b)


def test_caching_disabled_registers_nothing() -> None:
    pool = make_pool(4, enable_caching=False)
    a = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [h(1)], 0, 1)
    assert pool.get_cached_block(h(1)) is None
    pool.free_blocks(a)


def test_reset_prefix_cache_keeps_blocks_in_use() -> None:
    pool = make_pool(6)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(a, [h(1), h(2)], 0, 2)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(b, [h(3)], 0, 1)
    pool.free_blocks(b)
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert all(pool.get_cached_block(h(i)) is None for i in (1, 2, 3))
    assert pool.ref_cnt[a[0]] == 1
    pool.free_blocks(reversed(a))
    pool.check_invariants()
