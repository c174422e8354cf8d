"""Input preparation: from the request table and one step's schedule to flat device tensors.

Called by the model runner once per step. Everything is computed with vectorised numpy over
the scheduled requests (no Python loop over tokens): per-token request index by `np.repeat`,
positions from each request's computed count, input ids and KV slots gathered from the table's
token array and block table. Requests whose known tokens are all computed after this step
sample a token; the others (prompt chunks before the last) do not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ringserve.gpu.attention.metadata import AttentionMetadata
from ringserve.gpu.runner.request_state import RequestTable


@dataclass(frozen=True)
class StepInputs:
    """One step's flat batch.

    Attributes:
        req_ids: the scheduled requests, in batch order.
        slots: int64 [B]: their table slots.
        num_scheduled: int32 [B]: new tokens per request.
        query_start_loc: int64 [B + 1] host prefix sums of `num_scheduled`.
        positions_np: int64 [T] host positions of the new tokens.
        input_ids: int64 [T] device token ids.
        positions: int64 [T] device positions.
        meta: the attention metadata.
        samples: bool [B]: which requests sample a token this step.
        logits_indices: int64 [S] device rows of the hidden states to sample from.
    """

    req_ids: list[str]
    slots: np.ndarray
    num_scheduled: np.ndarray
    query_start_loc: np.ndarray
    positions_np: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    samples: np.ndarray
    logits_indices: torch.Tensor


def prepare_inputs(
    table: RequestTable, req_ids: list[str], num_scheduled: np.ndarray, device: torch.device
) -> StepInputs:
    """Build the flat batch for `req_ids` with `num_scheduled` new tokens each.

    Raises:
        ValueError: the schedule asks for tokens the worker does not know, or positions
            past a request's block table (a scheduler/worker disagreement).
    """
    slots = np.fromiter((table.slot_of(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
    computed = table.num_computed[slots].astype(np.int64)
    return build_inputs(table, req_ids, slots, computed, num_scheduled, device)


def build_inputs(
    table: RequestTable, req_ids: list[str], slots: np.ndarray, computed: np.ndarray,
    num_scheduled: np.ndarray, device: torch.device,
) -> StepInputs:
    """The flat batch of queries `i` over `slots[i]`'s tokens `computed[i]` ..
    `computed[i] + num_scheduled[i]` (`prepare_inputs` with the computed counts given: a
    speculative verify step lays each draft position out as a query of its own,
    `ringserve.gpu.spec_decode.verify`). `req_ids` names each query (repeats allowed).

    Raises:
        ValueError: as `prepare_inputs`.
    """
    num_scheduled = num_scheduled.astype(np.int32)
    seq_lens = computed + num_scheduled
    _check_schedule(table, req_ids, slots, seq_lens)
    qsl = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=qsl[1:])
    total = int(qsl[-1])
    req_index = np.repeat(np.arange(len(req_ids)), num_scheduled)
    positions = computed[req_index] + (np.arange(total) - qsl[:-1][req_index])
    token_slots = slots[req_index]
    input_ids = table.token_ids[token_slots, positions]
    bs = table.block_size
    slot_mapping = table.block_table[token_slots, positions // bs].astype(np.int64) * bs + positions % bs
    max_seq_len = int(seq_lens.max())
    block_table = table.block_table[slots, : -(-max_seq_len // bs)]
    samples = seq_lens >= table.num_tokens[slots]
    meta = AttentionMetadata(
        slot_mapping=_dev(slot_mapping, device),
        query_start_loc=_dev(qsl.astype(np.int32), device),
        seq_lens=_dev(seq_lens.astype(np.int32), device),
        block_table=_dev(block_table, device),
        token_to_req=_dev(req_index.astype(np.int32), device),
        max_query_len=int(num_scheduled.max()),
        max_seq_len=max_seq_len,
        query_start_loc_cpu=qsl.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return StepInputs(
        req_ids=req_ids,
        slots=slots,
        num_scheduled=num_scheduled,
        query_start_loc=qsl,
        positions_np=positions,
        input_ids=_dev(input_ids.astype(np.int64), device),
        positions=_dev(positions, device),
        meta=meta,
        samples=samples,
        logits_indices=_dev(qsl[1:][samples] - 1, device),
    )


def _check_schedule(
    table: RequestTable, req_ids: list[str], slots: np.ndarray, seq_lens: np.ndarray
) -> None:
    over_tokens = seq_lens > table.num_tokens[slots]
    over_blocks = seq_lens > table.num_blocks[slots].astype(np.int64) * table.block_size
    bad = np.flatnonzero(over_tokens | over_blocks)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"request {req_ids[i]!r}: scheduled up to position {int(seq_lens[i])} but the worker "
            f"knows {int(table.num_tokens[slots[i]])} tokens and "
            f"{int(table.num_blocks[slots[i]])} blocks of {table.block_size}"
        )


def _dev(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(device, non_blocking=True) if device.type != "cpu" else tensor
