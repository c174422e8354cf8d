"""KVCacheManager and block hashing: slots, lookahead, prefix lookups, the hash chain."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sched_fakes import _created_pools, check_no_leaks

from ringserve.engine.sched.block_hash import ROOT_HASH, hash_block, hash_full_blocks, root_hash
from ringserve.engine.sched.kv_cache_manager import KVCacheManager
from ringserve.engine.sched.request import Request
from ringserve.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    yield from check_no_leaks()


def manager(num_blocks: int = 11, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    kv = KVCacheManager(num_blocks, block_size, caching)
    _created_pools.append(kv.block_pool)
    return kv


def request(rid: str, tokens: list[int], salt: str | None = None, **sp: object) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8, **sp), max_model_len=1000, cache_salt=salt)  # type: ignore[arg-type]


# -- hashing (vLLM's test_kv_cache_utils scenarios) ---------------------------------------------


def test_hash_chain_depends_on_parent_and_tokens() -> None:
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert len(a) == 32
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(ROOT_HASH, [5, 6, 7, 8])


def test_hash_full_blocks_ignores_partial_tail_and_chains() -> None:
    tokens = list(range(10))
    hashes = hash_full_blocks(ROOT_HASH, tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(ROOT_HASH, tokens[:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    assert hash_full_blocks(hashes[0], tokens, 4, start_block=1) == hashes[1:]


def test_salt_is_an_extra_key_of_the_first_block() -> None:
    assert root_hash(None) == ROOT_HASH
    assert root_hash("a") != ROOT_HASH and root_hash("a") != root_hash("b")
    assert root_hash("a") == root_hash("a")


def test_decode_hashing_matches_prompt_hashing() -> None:
    kv = manager()
    req = request("r", list(range(6)))
    kv.hash_request(req)
    assert len(req.block_hashes) == 1
    req.all_token_ids.extend(range(6, 14))
    kv.hash_blocks(req, 2)
    assert len(req.block_hashes) == 2
    kv.hash_blocks(req, 5)  # only full blocks of known tokens
    assert req.block_hashes == hash_full_blocks(ROOT_HASH, list(range(14)), 4)
    assert len(req.block_hashes) == 3


def test_finished_request_registers_its_decoded_blocks() -> None:
    kv = manager(block_size=4)
    req = request("a", list(range(5)))
    kv.hash_request(req)
    assert kv.allocate_slots(req, 5) is not None
    req.num_computed_tokens = 5
    for token in range(5, 12):  # decode 7 more tokens: 12 positions computed
        req.all_token_ids.append(token)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    assert kv.block_pool.num_cached_blocks == 1  # only the prompt's full block so far
    kv.free(req)
    assert kv.block_pool.num_cached_blocks == 3
    hashes = hash_full_blocks(ROOT_HASH, list(range(12)), 4)
    assert all(kv.block_pool.get_cached_block(h) is not None for h in hashes)


# -- allocation ---------------------------------------------------------------------------------


def test_allocate_slots_grows_by_blocks_and_fails_without_change() -> None:
    kv = manager(num_blocks=5, block_size=4)  # 4 usable blocks
    req = request("a", list(range(10)))
    kv.hash_request(req)
    got = kv.allocate_slots(req, 10)
    assert got is not None and len(got) == 3
    req.num_computed_tokens = 10
    assert kv.allocate_slots(req, 2) == []  # fits in the third block
    other = request("b", list(range(100, 108)))
    assert kv.allocate_slots(other, 8) is None  # needs 2, 1 free
    assert not kv.has_blocks("b") or kv.get_block_ids("b") == []
    assert kv.block_pool.num_free_blocks == 1
    kv.free(req)
    kv.free(other)


def test_lookahead_slots() -> None:
    kv = manager(num_blocks=10, block_size=4)
    req = request("a", list(range(4)))
    kv.hash_request(req)
    got = kv.allocate_slots(req, 4, num_lookahead_tokens=5)
    assert got is not None and len(got) == 3
    kv.free(req)


def test_prefix_hit_capped_below_last_token() -> None:
    kv = manager(block_size=4)
    a = request("a", list(range(8)))
    kv.hash_request(a)
    assert kv.allocate_slots(a, 8) is not None
    b = request("b", list(range(8)))
    kv.hash_request(b)
    blocks, tokens = kv.get_computed_blocks(b)
    assert tokens == 4 and blocks == kv.get_block_ids("a")[:1]
    c = request("c", list(range(9)))
    kv.hash_request(c)
    blocks, tokens = kv.get_computed_blocks(c)
    assert tokens == 8 and blocks == kv.get_block_ids("a")
    got = kv.allocate_slots(c, 1, new_computed_blocks=blocks)
    assert got is not None and len(got) == 1
    assert kv.get_block_ids("c")[:2] == kv.get_block_ids("a")
    assert kv.block_pool.ref_cnt[blocks[0]] == 2
    kv.free(a)
    kv.free(c)


def test_prompt_logprobs_skip_cache_read() -> None:
    kv = manager(block_size=4)
    a = request("a", list(range(9)))
    kv.hash_request(a)
    assert kv.allocate_slots(a, 9) is not None
    b = request("b", list(range(9)), prompt_logprobs=1)
    kv.hash_request(b)
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.free(a)


def test_hits_on_free_blocks_count_against_capacity() -> None:
    kv = manager(num_blocks=4, block_size=4)  # 3 usable
    a = request("a", list(range(9)))
    kv.hash_request(a)
    assert kv.allocate_slots(a, 9) is not None
    kv.free(a)  # 2 cached free blocks + 1 uncached free block
    b = request("b", [*list(range(9)), 50, 51, 52, 53])
    kv.hash_request(b)
    blocks, tokens = kv.get_computed_blocks(b)
    assert tokens == 8
    # 2 hits (both free) + 3 new blocks > 3 free: refused, nothing touched.
    b.all_token_ids.extend([54, 55, 56])
    assert kv.allocate_slots(b, 8, new_computed_blocks=blocks) is None
    assert kv.block_pool.num_free_blocks == 3
    assert kv.allocate_slots(b, 4, new_computed_blocks=blocks) is not None
    assert kv.block_pool.num_free_blocks == 0
    kv.free(b)


def test_reset_prefix_cache_then_no_hits() -> None:
    kv = manager(block_size=4)
    a = request("a", list(range(9)))
    kv.hash_request(a)
    assert kv.allocate_slots(a, 9) is not None
    assert kv.reset_prefix_cache()
    b = request("b", list(range(9)))
    kv.hash_request(b)
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.free(a)
