"""Prefix-cache block hashes: a hash chain over full KV blocks.

Owned by the KV cache manager (`kv_cache_manager.py`), which hashes a request's prompt once at
intake and one more block each time decoding fills a block; the block pool
(`block_pool.py`) keys its prefix cache by these digests.

A block's hash is ``sha256(parent_hash || msgpack(block_token_ids))``. The parent of a
request's first block is a *root* hash that carries the request's extra keys: every unsalted
request starts from the same root, and a request with a ``cache_salt`` starts from
``sha256(tag || salt)``, so salted requests never share blocks with unsalted ones or with
other salts. Parent digests have a fixed length and msgpack arrays are self-delimiting, so the
hashed byte string is an injective encoding of (parent, tokens).

Hash choice (measured on the development machine, AMD EPYC with SHA-NI, 512-token prompts,
best of 7): sha256 0.64 µs per 16-token block, blake2b(digest_size=16) 0.65 µs, i.e. no
measurable difference; encoding tokens with msgspec's msgpack is about 2x faster than
``array("i").tobytes()`` or ``struct.pack``. sha256 is kept: it is the standard
collision-resistant choice (256-bit digests, as vLLM's default ``sha256``), it costs nothing
extra on CPUs with SHA extensions, and it needs no new dependency. On CPUs without SHA
extensions blake2b would be the faster of the two; switching is a one-line change here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import msgspec

__all__ = ["ROOT_HASH", "hash_block", "hash_full_blocks", "root_hash"]

_sha256 = hashlib.sha256
_encode = msgspec.msgpack.Encoder().encode

#: Parent of the first block of every request without extra keys.
ROOT_HASH: bytes = _sha256(b"ringserve/prefix-cache/root/v1").digest()

_SALT_TAG = b"ringserve/prefix-cache/salt/v1\x00"


def root_hash(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block, carrying its extra keys.

    Args:
        cache_salt: the request's cache salt, or None.

    Returns:
        ROOT_HASH for an unsalted request, else a digest unique to the salt.
    """
    if cache_salt is None:
        return ROOT_HASH
    return _sha256(_SALT_TAG + cache_salt.encode("utf-8", "surrogatepass")).digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one full block given its parent's hash and its token ids."""
    return _sha256(parent + _encode(token_ids)).digest()


def hash_full_blocks(
    parent: bytes,
    token_ids: list[int],
    block_size: int,
    start_block: int = 0,
    end_block: int | None = None,
    extra_keys: Callable[[int, int], bytes] | None = None,
) -> list[bytes]:
    """Hash the full blocks `start_block..end_block-1` of `token_ids`, chaining from `parent`.

    Args:
        parent: the hash of block `start_block - 1` (or the root hash when 0).
        token_ids: the request's tokens (prompt, then outputs).
        block_size: tokens per block.
        start_block: the first block to hash.
        end_block: one past the last block to hash (default: every full block).
        extra_keys: positions `(start, end)` of a block -> bytes hashed with its tokens (the
            content hashes of the images it holds: `ringserve.gpu.multimodal.features.
            block_keys`); None: tokens only.

    Returns:
        One digest per block, in order.
    """
    hashes: list[bytes] = []
    append = hashes.append
    stop = len(token_ids) if end_block is None else min(len(token_ids), end_block * block_size)
    for i in range(start_block * block_size, stop - block_size + 1, block_size):
        data = parent + _encode(token_ids[i : i + block_size])
        if extra_keys is not None:
            data += extra_keys(i, i + block_size)
        parent = _sha256(data).digest()
        append(parent)
    return hashes
