"""The torch reference for paged attention: the CPU path and the oracle for the Triton kernels.

KV cache layout (one tensor per layer, allocated by `ringserve.gpu.runner.kv_cache`):
`[2, num_blocks, block_size, num_kv_heads, head_dim]`; index 0 holds keys, 1 values. Token `p`
of a request lives in block `block_table[p // block_size]` at offset `p % block_size`, i.e. in
flat slot `block_id * block_size + offset` of the `[num_blocks * block_size, heads, dim]` view.

`write_kv` scatters the step's new keys/values into their slots; `paged_attention` computes
causal attention of the new queries over each request's whole cached sequence with
`scaled_dot_product_attention` (GQA without copying the KV heads).

Single-token queries (decodes) are batched: a Python-level call per request dominated decode
steps (~0.3 ms each on CPU). Every layer of a step reads the same block tables, so the gather
indices are worked out once per step (`plan_attention`, cached by the torch backend) and each
layer then pays one `index_select` (keys and values together, from the flat `[2 * slots,
heads * dim]` view) and one SDPA call per group. Groups are runs of decodes sorted by length,
padded to the group's longest sequence with a length mask, and capped so that one group's
gathered keys and values stay cache-sized: on CPU the gather and SDPA are memory-bound, and a
32-request gather (16 MB at 500 tokens each) spilled out of cache and cost ~1.5x more than the
same work in groups of ~4 MB (measured, 1 and 2 threads).

Multi-token queries (prefill chunks) go request by request (`_prefill`), always as 4-D
`[1, heads, rows, dim]` SDPA calls: on CPU torch runs its flash kernel (a blockwise online
softmax) only on 4-D input; 3-D input takes the math kernel, which materializes
`[heads, rows, keys]` scores. The flash kernel takes GQA (`enable_gqa`, KV heads not copied)
and a mask, but its `is_causal` is aligned top-left (row i sees keys 0..i), so only a fresh
prompt with no window and no soft-cap is a single causal call. A chunk after cached context
(row j sits at position context + j) or a windowed prompt goes by tiles of `_PREFILL_TILE`
query rows, each over only the keys its rows see (from its first row's window start to its
last row) with its own `[rows, keys]` mask: no mask is larger than a tile's, and the keys past
a tile are skipped as a causal kernel would skip them.

Per layer through `paged_attention`, SmolLM2-135M's shape (9 heads, 3 KV heads, dim 64), 2
threads, medians of 3 interleaved runs of the old 3-D calls and these (issue 48), in ms,
float32 / bfloat16: a fresh 512-token prompt 14.3 -> 4.0 / 8.4 -> 1.6; 2,048: 243 -> 33 /
263 -> 11; 4,096: 948 -> 115 / 1,117 -> 37; 8,000: 4,567 -> 415 / 4,684 -> 130; a 2,048-token
chunk after 2,048 of context 465 -> 109 / 506 -> 35. At its peak one layer's call on an
8,000-token prompt took 5.1 GiB more memory, now 47 MiB (float32, 18 MiB of it the result).
The masks cost a tiled chunk 15-35% over the same tiles unmasked (the 2,048 chunk: 90 vs 78
ms float32, 34 vs 25 bfloat16); an unmasked call over the context and a causal one over the
tile, merged by their log-sum-exps, ran 80 / 28 ms, but only torch's private flash op
(`_scaled_dot_product_flash_attention_for_cpu`) returns those, so it is not used.

Sliding window and logit soft-capping (Mistral, Gemma 2/3): a query at position p sees keys
p - sliding_window + 1 .. p (transformers' `sliding_window_overlay`). A windowed decode gathers
only its sequence's last `sliding_window` keys (so the plan depends on the window: the backend
keeps one per window value a step uses); a prefill chunk gathers from the first block its
earliest row sees and masks each row by its own position. Soft-capping
(`cap * tanh(scores / cap)` after the scale, before the softmax) has no SDPA form, so those
calls compute the scores explicitly, in float32; a soft-capped prefill goes by tiles of query
rows holding at most `_CAPPED_SCORES` scores (4,096 tokens: 1,541 -> 213 ms float32). With
both off (None) the code paths are the ones without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from ringserve.gpu.attention.metadata import AttentionMetadata
from ringserve.gpu.native.panel import MANY_ROWS

# A padded decode call costs about this many key positions (summed over its rows) of work in
# fixed overhead (its index_select, SDPA and copy-back calls); a group is split where the
# padding it would add is worth more than one more call. This and the byte cap below came from
# a sweep over the benchmark workload's replayed decode steps (256 vs 1024 keys, 1 to 8 MB and
# no cap): 256 keys and 4 MB were best or within noise of it, at 1 and 2 threads.
_CALL_COST_KEYS = 256

# Most bytes of keys plus values one decode group gathers (see the module docstring).
_GROUP_BYTES = 4 << 20

# Query rows per prefill tile (a chunk after earlier context or a windowed prompt; see the
# module docstring). Of 128, 256 and 512, 256 was fastest or within noise of it (a 4,096-token
# prompt and a 2,048 chunk after 2,048; 2 threads, float32 and bfloat16).
_PREFILL_TILE = 256
# Query rows from which `prefill_dtype` applies: the many-row GEMMs' threshold, so a chunk's
# attention and its linears switch together (shorter prefills and decodes stay float32).
PREFILL_CAST_ROWS = MANY_ROWS

# Most elements of one tile's mask ([rows, keys] bool, which SDPA turns into an additive mask
# of the query's dtype: 20 MB at float32): past 16 Ki keys, tiles get fewer rows.
_TILE_MASK = 4 << 20

# Most float32 scores one soft-capped prefill tile holds at once (8 MB; the softmax makes a
# second such buffer): the explicit path materializes [heads, rows, keys]. 8 and 16 MB ran
# within 6% of each other at 4,096 tokens; 16 MB took 61 MiB in all at 8,000.
_CAPPED_SCORES = 2 << 20


@dataclass(frozen=True)
class DecodeGroup:
    """One padded SDPA call over single-token queries of similar sequence length.

    Attributes:
        token_rows: int64 [G]: the query rows of the group's requests.
        kv_rows: int64 [2 * G * length]: rows of the flat `[2 * slots, heads * dim]` cache
            view to gather: the keys each request attends to (its whole sequence, or its last
            `sliding_window` positions) in sequence order, then values; padding positions
            read slot 0 and are masked.
        mask: bool [G, 1, 1, length]: the real key positions; None when every sequence of
            the group is `length` long.
        length: the most keys a request of the group attends to.
        whole_batch: the group holds every query row of the step, in order (the output is
            the SDPA result itself, no scatter).
    """

    token_rows: torch.Tensor
    kv_rows: torch.Tensor
    mask: torch.Tensor | None
    length: int
    whole_batch: bool


@dataclass(frozen=True)
class AttentionPlan:
    """One step's gather plan, shared by every layer (same block tables, same lengths).

    Attributes:
        groups: the batched decode calls.
        requests: (request index, its block ids as int64) for requests attended one by one
            (multi-token queries).
        sliding_window: the window the decode groups were gathered for (None: none).
    """

    groups: list[DecodeGroup]
    requests: list[tuple[int, torch.Tensor]]
    sliding_window: int | None = None


def check_options(sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """Raise unless the window and soft-cap are usable (None, or a positive finite value).

    Raises:
        ValueError: sliding_window < 1 (or not an int), or a soft-cap that is not finite > 0.
    """
    if sliding_window is not None and (
            isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
            or sliding_window < 1):
        raise ValueError(f"attention: sliding_window must be an int >= 1 or None, "
                         f"got {sliding_window!r}")
    if logits_soft_cap is not None and not 0.0 < logits_soft_cap < math.inf:
        raise ValueError(f"attention: logits_soft_cap must be a finite number > 0 or None, "
                         f"got {logits_soft_cap!r}")


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `key`/`value` [T, Hkv, D] into `kv_cache` at `slot_mapping` [T]."""
    heads, dim = kv_cache.shape[-2], kv_cache.shape[-1]
    kv_cache[0].view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def plan_attention(
    meta: AttentionMetadata, kv_cache: torch.Tensor, sliding_window: int | None = None
) -> AttentionPlan:
    """The gather plan of `meta` for caches shaped like `kv_cache` (any layer of the step)
    whose layers use `sliding_window` (a windowed decode gathers only the keys it sees).

    Built with numpy on host copies (a torch op costs a few microseconds of dispatch each,
    several times a numpy op on arrays this small).
    """
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    device = kv_cache.device
    qsl = np.asarray(meta.query_start_loc_cpu, dtype=np.int64)
    lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)
    query_lens = np.diff(qsl)
    table = meta.block_table.cpu().numpy()
    requests = request_blocks(table, lens, np.flatnonzero(query_lens > 1).tolist(), block_size,
                              device)
    decodes = np.flatnonzero(query_lens == 1).tolist()
    row_bytes = 2 * heads * dim * kv_cache.element_size()  # one position's key and value
    keys = meta.seq_lens_cpu  # keys each decode attends to
    if sliding_window is not None:
        keys = np.minimum(lens, sliding_window).tolist()
    groups = _length_groups(decodes, keys, max(1, _GROUP_BYTES // row_bytes))
    whole = len(decodes) == int(qsl[-1])  # every query row is a decode
    plans = [
        _decode_group(table, qsl, lens, rows, block_size, num_blocks * block_size, device,
                      sliding_window)
        for rows in groups
    ]
    if whole and len(plans) == 1:
        plans[0] = replace(plans[0], whole_batch=True)
    return AttentionPlan(groups=plans, requests=requests, sliding_window=sliding_window)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    plan: AttentionPlan | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    prefill_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention of the new queries [T, Hq, D] over each request's cached sequence.

    The cache must already hold this step's keys/values (`write_kv` first).

    Args:
        query: [T, Hq, D].
        kv_cache: this layer's cache.
        meta: the step's attention metadata.
        scale: the softmax scale.
        plan: `plan_attention(meta, kv_cache, sliding_window)`, when the caller keeps it
            across layers.
        sliding_window: a query at position p sees keys p - sliding_window + 1 .. p only.
        logits_soft_cap: scores become cap * tanh(scores / cap) before the softmax.
        prefill_dtype: a request of `PREFILL_CAST_ROWS` query rows or more attends in this
            dtype (`attend_requests`).

    Returns:
        [T, Hq, D] in the query's dtype.

    Raises:
        ValueError: a bad window or soft-cap (`check_options`), or a plan for another window.
    """
    check_options(sliding_window, logits_soft_cap)
    if plan is None:
        plan = plan_attention(meta, kv_cache, sliding_window)
    elif plan.sliding_window != sliding_window:
        raise ValueError(f"attention: a plan for sliding_window {plan.sliding_window} used "
                         f"with sliding_window {sliding_window}")
    cap = logits_soft_cap
    if len(plan.groups) == 1 and plan.groups[0].whole_batch:
        return _batched_decode(query, kv_cache, scale, plan.groups[0], cap)
    out = torch.empty_like(query)
    for group in plan.groups:
        out.index_copy_(0, group.token_rows, _batched_decode(query, kv_cache, scale, group, cap))
    attend_requests(query, kv_cache, meta, plan.requests, scale, out,
                    sliding_window=sliding_window, logits_soft_cap=cap,
                    prefill_dtype=prefill_dtype)
    return out


def request_blocks(table: np.ndarray, lens: np.ndarray, indices: list[int], block_size: int,
                   device: torch.device) -> list[tuple[int, torch.Tensor]]:
    """(request index, the block ids its sequence uses, int64) for each of `indices`."""
    return [(i, _tensor(table[i, : -(-int(lens[i]) // block_size)].astype(np.int64), device))
            for i in indices]


def attend_requests(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    requests: list[tuple[int, torch.Tensor]], scale: float,
                    out: torch.Tensor, *, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None,
                    prefill_dtype: torch.dtype | None = None) -> None:
    """Attend each of `requests` (multi-token queries) on its own, into its rows of `out`.

    Query row j of request i sits at position seq_lens[i] - query_len + j (`metadata`); with
    a window, keys before the earliest row's window are not read. With `prefill_dtype`, a
    request of `PREFILL_CAST_ROWS` rows or more attends with q, k and v in that dtype (a
    bf16 checkpoint's long prefill on a CPU with native bf16: torch's bf16 flash kernel,
    ~3x float32's), its output converted back.
    """
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    block_size = kv_cache.shape[2]
    for i, blocks in requests:
        seq_len, start, end = lens[i], qsl[i], qsl[i + 1]
        window = sliding_window
        if window is not None and window >= seq_len:
            window = None  # no row of this request reaches past its sequence's start
        first = 0  # the first block-aligned key position any row sees
        if window is not None:
            first = max(0, seq_len - (end - start) - window + 1) // block_size * block_size
        used = blocks[first // block_size:] if first else blocks
        k = kv_cache[0].index_select(0, used).flatten(0, 1)[:seq_len - first].transpose(0, 1)
        v = kv_cache[1].index_select(0, used).flatten(0, 1)[:seq_len - first].transpose(0, 1)
        q = query[start:end].transpose(0, 1)
        dtype = q.dtype
        if prefill_dtype is not None and end - start >= PREFILL_CAST_ROWS:
            dtype, q = prefill_dtype, q.to(prefill_dtype)
        _prefill(q[None], k.to(dtype)[None], v.to(dtype)[None], seq_len, scale,
                 out[start:end], window, logits_soft_cap)


def _length_groups(
    rows: list[int], lens: list[int], max_keys: int = 1 << 62
) -> list[list[int]]:
    """Split decode rows into groups of similar sequence length (less padding per call).

    A group also closes once its padded keys (rows x longest length) would pass `max_keys`.
    """
    order = sorted(rows, key=lambda i: lens[i])
    groups: list[list[int]] = [[]]
    for i in order:
        group = groups[-1]
        if group:
            # Work if i joins (everyone padded to lens[i]) vs. starting a new group.
            waste = (lens[i] - lens[group[-1]]) * len(group)
            if waste > _CALL_COST_KEYS or lens[i] * (len(group) + 1) > max_keys:
                groups.append([i])
                continue
        group.append(i)
    return [g for g in groups if g]


def _decode_group(
    table: np.ndarray, qsl: np.ndarray, lens: np.ndarray, rows: list[int], block_size: int,
    num_slots: int, device: torch.device, sliding_window: int | None = None,
) -> DecodeGroup:
    index = np.array(sorted(rows))  # query order: a group of the whole batch needs no scatter
    group_lens = lens[index]
    keys = group_lens if sliding_window is None else np.minimum(group_lens, sliding_window)
    length = int(keys.max())
    positions = np.arange(length)
    valid = positions < keys[:, None]  # [G, length]
    if sliding_window is not None:
        # A window ends at its sequence's end; columns past a shorter one read position 0.
        positions = np.where(valid, positions + (group_lens - keys)[:, None], 0)
    slots = table[index[:, None], positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    # Padding reads slot 0: block table entries past a request's end may be stale.
    slots[~valid] = 0
    flat = slots.ravel()
    mask = None
    if int(keys.min()) < length:
        mask = _tensor(valid, device)[:, None, None, :]
    return DecodeGroup(
        token_rows=_tensor(qsl[index], device),
        kv_rows=_tensor(np.concatenate((flat, flat + num_slots)), device),
        mask=mask,
        length=length,
        whole_batch=False,
    )


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


def _batched_decode(
    query: torch.Tensor, kv_cache: torch.Tensor, scale: float, group: DecodeGroup,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One SDPA call for a group of single-token queries; returns [G, Hq, D]."""
    heads, dim = kv_cache.shape[-2], kv_cache.shape[-1]
    num = group.token_rows.shape[0]
    kv = kv_cache.view(-1, heads * dim).index_select(0, group.kv_rows)
    kv = kv.view(2, num, group.length, heads, dim).transpose(2, 3)  # [2, G, Hkv, L, D]
    q = query if group.whole_batch else query.index_select(0, group.token_rows)
    if kv.dtype != q.dtype:
        kv = kv.to(q.dtype)
    if logits_soft_cap is not None:
        mask = None if group.mask is None else group.mask[:, 0]
        return _capped(q.unsqueeze(2), kv[0], kv[1], mask, scale, logits_soft_cap).squeeze(2)
    attn = F.scaled_dot_product_attention(
        q.unsqueeze(2), kv[0], kv[1], attn_mask=group.mask, scale=scale, enable_gqa=True
    )
    return attn.squeeze(2)


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float,
    out: torch.Tensor, sliding_window: int | None, logits_soft_cap: float | None,
) -> None:
    """Attention of q [1, Hq, n, D] (the sequence's last n positions) over k, v [1, Hkv, L, D]
    (its last L), written into out [n, Hq, D].

    A fresh prompt is one causal SDPA call; anything else goes by tiles of query rows, each
    over the keys its rows see (see the module docstring).
    """
    num_queries, num_keys = q.shape[2], k.shape[2]
    context = seq_len - num_queries  # the position of query row 0
    first = seq_len - num_keys  # the position of key 0
    if context == 0 and sliding_window is None and logits_soft_cap is None:
        out.copy_(F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1))
        return
    if logits_soft_cap is None:
        rows = max(1, min(_PREFILL_TILE, _TILE_MASK // num_keys))
    else:
        rows = max(1, _CAPPED_SCORES // (q.shape[1] * num_keys))
    for a in range(0, num_queries, rows):
        b = min(num_queries, a + rows)
        lo = 0  # the tile's first key (index into k), before which none of its rows looks
        if sliding_window is not None:
            lo = max(0, context + a - sliding_window + 1 - first)
        hi = context + b - first  # one past its last row's position
        mask = _tile_mask(context + a, context + b, first + lo, first + hi, sliding_window,
                          q.device)
        q_tile, k_tile, v_tile = q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi]
        if logits_soft_cap is None:
            attn = F.scaled_dot_product_attention(q_tile, k_tile, v_tile, attn_mask=mask,
                                                  scale=scale, enable_gqa=True)
        else:
            attn = _capped(q_tile, k_tile, v_tile, mask[None], scale, logits_soft_cap)
        out[a:b] = attn[0].transpose(0, 1)


def attend_image_spans(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, out: torch.Tensor, *, sliding_window: int | None = None,
                       logits_soft_cap: float | None = None) -> None:
    """Attend the rows of `meta.image_spans` again, into `out`: a row of an image sees
    what causal attention (in its window) shows it and every key of its own image, as
    transformers' Gemma 3 mask does (`or` of the two). Every backend's causal result is
    corrected this way; the spans are short (one image's tokens)."""
    qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    block_size = kv_cache.shape[2]
    for i, first, end in meta.image_spans:
        seq_len, start = lens[i], qsl[i]
        context = seq_len - (qsl[i + 1] - start)  # the position of the request's row 0
        rows = max(first, context)  # the image's first position computed this step
        blocks = meta.block_table[i, : -(-end // block_size)].to(torch.int64)
        k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:end].transpose(0, 1)
        v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:end].transpose(0, 1)
        q = query[start + rows - context: start + end - context].transpose(0, 1)
        mask = _tile_mask(rows, end, 0, end, sliding_window, query.device)
        mask[:, first:end] = True
        if logits_soft_cap is None:
            attn = F.scaled_dot_product_attention(q[None], k.to(q.dtype)[None],
                                                  v.to(q.dtype)[None], attn_mask=mask,
                                                  scale=scale, enable_gqa=True)
        else:
            attn = _capped(q[None], k.to(q.dtype)[None], v.to(q.dtype)[None], mask[None],
                           scale, logits_soft_cap)
        out[start + rows - context: start + end - context] = attn[0].transpose(0, 1)


def _tile_mask(row_start: int, row_end: int, key_start: int, key_end: int,
               sliding_window: int | None, device: torch.device) -> torch.Tensor:
    """bool [rows, keys]: True where the query at position row_start + i sees the key at
    position key_start + j (causal, and inside its window)."""
    rows = torch.arange(row_start, row_end, device=device)[:, None]
    cols = torch.arange(key_start, key_end, device=device)[None, :]
    mask = cols <= rows
    if sliding_window is not None:
        mask &= cols > rows - sliding_window
    return mask


def _capped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    scale: float, cap: float,
) -> torch.Tensor:
    """Soft-capped attention: q [B, Hq, n, D] over k, v [B, Hkv, L, D] where `mask`
    [B, n, L] (True: attend; None: all); returns [B, Hq, n, D] in v's dtype.

    Query head h reads kv head h // (Hq / Hkv), as SDPA's enable_gqa does; the scores are
    float32 from the matmul on, like transformers' eager Gemma 2 softmax.
    """
    batch, q_heads, num_queries, dim = q.shape
    kv_heads, num_keys = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    grouped = q.reshape(batch, kv_heads, group * num_queries, dim)
    # In place, the same operations as scores * scale, then tanh(scores / cap) * cap: one
    # scores-sized buffer instead of one per step.
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float()
    scores.mul_(scale).div_(cap).tanh_().mul_(cap)
    if mask is not None:
        scores = scores.view(batch, kv_heads, group, num_queries, num_keys)
        scores.masked_fill_(~mask[:, None, None], float("-inf"))
        scores = scores.view(batch, kv_heads, group * num_queries, num_keys)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, q_heads, num_queries, dim)
