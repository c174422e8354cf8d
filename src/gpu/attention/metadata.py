"""Attention metadata for one flat, unpadded batch (built by `ringserve.gpu.runner.input_prep`).

A step's batch is the concatenation of every scheduled request's new tokens (prefill chunks and
single decode tokens mixed). Request `i` owns query rows `query_start_loc[i]:query_start_loc[i+1]`;
its keys are the first `seq_lens[i]` tokens of its sequence, read from the paged KV cache
through row `i` of `block_table`. Its new tokens are the last ones of that sequence, so query row
`j` of request `i` sits at position `seq_lens[i] - query_len_i + j` and attends causally to keys
`0..` that position (with a sliding window, to the last `sliding_window` of them: every backend
masks each row of a prefill chunk by this position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Device tensors (and their host copies where the torch path loops) for one step.

    Attributes:
        slot_mapping: int64 [T]: the cache slot (block_id * block_size + offset) each new
            token's key/value is written to.
        query_start_loc: int32 [B + 1]: prefix sums of the per-request query lengths.
        seq_lens: int32 [B]: cached context + new tokens per request.
        block_table: int32 [B, max_blocks]: each request's KV blocks, in sequence order.
        token_to_req: int32 [T]: the batch row of each query token.
        max_query_len: the longest query in the batch.
        max_seq_len: the longest sequence in the batch.
        query_start_loc_cpu: host copy of `query_start_loc`.
        seq_lens_cpu: host copy of `seq_lens`.
        image_spans: (request index, first position, end position) of the images whose
            tokens attend to each other in both directions (Gemma 3), each ending inside its
            request's new tokens (its earlier positions may be cached: a prefix hit); the
            rows computed this step are corrected (`ringserve.gpu.multimodal`). Empty:
            causal everywhere.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    token_to_req: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    image_spans: tuple[tuple[int, int, int], ...] = ()
