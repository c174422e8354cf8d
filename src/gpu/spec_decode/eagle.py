"""The EAGLE proposer: a small head that drafts from the target's own hidden states.

EAGLE's draft at position `p` reads the target's hidden state at `p` and the token at `p + 1`,
and predicts the token at `p + 2` (`eagle_head` has the two head layouts). So the head's KV
cache, like a draft model's, holds one entry per position of the request (its own tensors over
the same block ids; the scheduler reserves `k` lookahead slots for the positions it drafts
past the verified tokens), and it is brought up to date from the target's hidden states of
each step, which exist only during that step:

- `observe` (after every step that computed rows, once they are sampled): for each row whose
  next token is known (a prompt chunk's rows; a decode's or verify step's rows up to the last
  accepted token, the rejected drafts' rows excluded), one forward of the head over
  (token at `p + 1`, the target's hidden state at `p`) writes the head's KV at `p`. The last
  such row of a request that has just sampled (`p = n - 2` for `n` tokens) gives its first
  draft and the stream the next draft step starts from; they are kept until `propose`.
- `propose`: the first draft, then `k - 1` more, each a one-token step of the head at the
  next position over the previous draft and the stream it left.

Positions a request took from the prefix cache were never computed for it: their head KV is
whatever the request that computed the blocks wrote there (the head's entries live in the same
blocks), which is what vLLM does too; it can only change which drafts are proposed, never the
output, which the target verifies. Rows of the head's forward are a few per request per step
(a prompt chunk: all its rows, one pass of a one-layer head).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import numpy as np
import torch

from ringserve.config import EngineConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.runner.input_prep import StepInputs, build_inputs
from ringserve.gpu.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.spec_decode.eagle_config import EagleHeadConfig
from ringserve.gpu.spec_decode.eagle_head import EagleHead, load_eagle_head

logger = logging.getLogger(__name__)


class EagleProposer:
    """Drafts from an EAGLE head (see the module docstring).

    Args:
        config: the engine configuration.
        method: "eagle" or "eagle3".
        head_dir: the head's directory.
        device: the worker's device.
        backend: the attention backend.
        max_drafts: the most drafts a request gets.
        target: returns the target model being served (a weight update swaps it).
    """

    def __init__(self, config: EngineConfig, method: str, head_dir: str, device: torch.device,
                 backend: AttentionBackend, max_drafts: int,
                 target: Callable[[], LlamaForCausalLM]) -> None:
        self.config = config
        self.device = device
        self.max_drafts = max_drafts
        model = target()
        head = EagleHeadConfig.read(method, head_dir, config.model_config)
        if head.aux_layer_ids and not hasattr(model.model, "aux_layers"):
            raise ValueError(f"speculative_config.method: {method!r} reads the target's layer "
                             f"inputs, which {type(model).__name__} does not keep")
        self.head: EagleHead = load_eagle_head(head, config.model_config, target, backend,
                                               device)
        self.feature_layers: tuple[int, ...] = head.aux_layer_ids
        self.kv_spec = KVCacheSpec(num_layers=head.num_layers, num_kv_heads=head.num_kv_heads,
                                   head_dim=head.head_dim,
                                   block_size=config.cache_config.block_size,
                                   dtype=model.spec.dtype)
        self.kv_caches: list[torch.Tensor] = []
        # request -> (its token count when observed, first draft's output row, its stream row)
        self._ready: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}
        logger.info("EAGLE head %s: %s", method, head_dir)

    @property
    def kv_bytes_per_block(self) -> int:
        """The head's bytes per KV block (added to the target's when sizing the pool)."""
        return self.kv_spec.bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the head's cache over the pool's `num_blocks`."""
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        self._ready.clear()

    def release_kv_cache(self) -> None:
        """Drop the head's cache (sleep)."""
        self.kv_caches = []
        self._ready.clear()

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests finished or were preempted."""
        for req_id in req_ids:
            self._ready.pop(req_id, None)

    @torch.inference_mode()
    def observe(self, table: RequestTable, inputs: StepInputs, features: torch.Tensor) -> None:
        """Write the head's KV for the step's rows whose next token is known (see the module
        docstring); keep the first draft's rows of the requests that have just sampled."""
        self._ready.clear()
        row_slot = np.repeat(inputs.slots, inputs.num_scheduled)
        row_pos = inputs.positions_np
        known = row_pos + 1 < table.num_tokens[row_slot]
        if not known.any():
            return
        flat = np.flatnonzero(known)
        # One query per request over its known rows: a request's rows are consecutive in the
        # batch (one query, or a verify step's queries in position order), and the known ones
        # are a run of them (a prompt chunk's, or the accepted part of a verify run).
        slot_of = row_slot[flat]
        first = np.flatnonzero(np.r_[True, slot_of[1:] != slot_of[:-1]])
        slots = slot_of[first]
        starts = row_pos[flat[first]]
        counts = np.diff(np.r_[first, flat.size])
        name = dict(zip(inputs.slots.tolist(), inputs.req_ids, strict=True))
        ids = [name[s] for s in slots.tolist()]
        step = build_inputs(table, ids, slots, starts, counts, self.device)
        next_tokens = table.token_ids[row_slot[flat], row_pos[flat] + 1]
        index = torch.from_numpy(flat).to(features.device)
        out, stream = self.head.forward(
            torch.from_numpy(next_tokens.astype(np.int64)).to(self.device), step.positions,
            features[index], self.kv_caches, step.meta, project=True)
        ends = step.query_start_loc[1:] - 1
        for i, (req_id, slot) in enumerate(zip(ids, slots.tolist(), strict=True)):
            n = int(table.num_tokens[slot])
            if int(starts[i] + counts[i]) == n - 1:  # caught up to the last token: it drafts
                self._ready[req_id] = (n, out[int(ends[i])], stream[int(ends[i])])

    @torch.inference_mode()
    def propose(self, table: RequestTable, req_ids: list[str], slots: np.ndarray,
                k: list[int]) -> dict[str, list[int]]:
        """Up to `k[i]` greedy drafts for each request `req_ids[i]` that `observe` left
        ready."""
        bs = table.block_size
        ids: list[str] = []
        rows: list[int] = []
        want: list[int] = []
        outs: list[torch.Tensor] = []
        streams: list[torch.Tensor] = []
        for req_id, slot, wanted in zip(req_ids, slots.tolist(), k, strict=True):
            ready = self._ready.get(req_id)
            n = int(table.num_tokens[slot])
            if ready is None or ready[0] != n:
                continue
            # The head writes positions up to n + k - 3 and the verify step reads up to
            # n - 1 + k: both inside the request's blocks and max_model_len.
            room = min(int(table.num_blocks[slot]) * bs - n + 1, table.max_model_len - n)
            wanted = min(wanted, room)
            if wanted > 0:
                ids.append(req_id)
                rows.append(slot)
                want.append(wanted)
                outs.append(ready[1])
                streams.append(ready[2])
        if not ids:
            return {}
        first = self.head.draft_tokens(torch.stack(outs)).tolist()
        drafts = [[int(t)] for t in first]
        stream = torch.stack(streams)
        slot_arr = np.asarray(rows, dtype=np.int64)
        n_tok = table.num_tokens[slot_arr].astype(np.int64)
        for j in range(1, max(want)):
            going = [i for i in range(len(ids)) if want[i] > j]
            stream = self._next(table, ids, slot_arr, n_tok, drafts, going, stream, j)
        return {req_id: d[:w] for req_id, d, w in zip(ids, drafts, want, strict=True)}

    def _next(self, table: RequestTable, ids: list[str], slots: np.ndarray, n_tok: np.ndarray,
              drafts: list[list[int]], going: list[int], stream: torch.Tensor,
              j: int) -> torch.Tensor:
        """Draft `j` of the requests `going`: the head at position `n - 2 + j` over draft
        `j - 1` and the stream its step left. Returns the streams of all requests (those
        not going keep theirs)."""
        sub = slots[going]
        position = n_tok[going] + (j - 2)
        saved = table.num_tokens[sub].copy()
        try:
            table.num_tokens[sub] = np.maximum(saved, position + 1)
            inputs = build_inputs(table, [ids[i] for i in going], sub, position,
                                  np.ones(len(going), dtype=np.int64), self.device)
        finally:
            table.num_tokens[sub] = saved
        tokens = torch.tensor([drafts[i][-1] for i in going], dtype=torch.int64,
                              device=self.device)
        index = torch.tensor(going, dtype=torch.int64, device=stream.device)
        out, new = self.head.forward(tokens, inputs.positions, stream[index], self.kv_caches,
                                     inputs.meta, project=False)
        for i, token in zip(going, self.head.draft_tokens(out).tolist(), strict=True):
            drafts[i].append(int(token))
        stream = stream.clone()
        stream[index] = new
        return stream
