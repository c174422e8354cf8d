"""The paged KV cache: its per-layer layout, its size per block, and its allocation.

Layout (one tensor per decoder layer): `[2, num_blocks, block_size, num_kv_heads, head_dim]`
in the model dtype, index 0 = keys, 1 = values. `num_kv_heads` is this TP rank's share. Block
ids come from the engine core's block pool (the scheduler); a request's token at position `p`
lives in block `block_table[p // block_size]`, offset `p % block_size`, i.e. flat slot
`block_id * block_size + p % block_size`, which is what the slot mapping carries. Blocks are
never zeroed between requests: attention only ever reads positions below a request's length.

The worker sizes the cache (`num_blocks_for_bytes`) and allocates it (`allocate_kv_cache`);
the model runner passes the per-layer tensors to the model each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.config import CacheConfig, ModelConfig
from ringserve.gpu.models.spec import TORCH_DTYPES


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one rank's KV cache, independent of the number of blocks.

    Attributes:
        num_layers: decoder layers (one cache tensor each).
        num_kv_heads: key/value heads on this rank.
        head_dim: the head size.
        block_size: tokens per block.
        dtype: the cache dtype (the model's).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, model: ModelConfig, cache: CacheConfig, tp_size: int = 1) -> KVCacheSpec:
        """The spec for `model` on one of `tp_size` ranks."""
        return cls(
            num_layers=model.num_hidden_layers,
            num_kv_heads=max(1, model.num_kv_heads // tp_size),
            head_dim=model.head_dim,
            block_size=cache.block_size,
            dtype=TORCH_DTYPES[model.dtype],
        )

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers (keys and values)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize
        return per_layer * self.num_layers

    def num_blocks_for_bytes(self, num_bytes: int) -> int:
        """How many whole blocks fit in `num_bytes`."""
        return max(0, num_bytes // self.bytes_per_block)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One zeroed `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer.

    Raises:
        ValueError: `num_blocks` < 1.
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks: got {num_blocks}, allowed: >= 1")
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
