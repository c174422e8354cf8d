"""The draft-model proposer: a second, smaller (or more compressed) model drafts greedily.

The draft lives in the worker beside the target, with its own KV tensors over the same block
ids (a request's blocks hold the target's keys and values in the target's cache and the
draft's in the draft's; the scheduler reserves `k` lookahead slots so the draft's writes past
the verified tokens stay inside the request's blocks, and the worker sizes the pool for both:
`kv_bytes_per_block`). The target's own checkpoint with `quantization: int4` is the usual
draft: the same model over int4 panels, an eighth of float32's bytes per token.

After each step, for every request that sampled: the draft first computes the tokens it has
not seen (its prompt the first time, afterwards the tokens verified since its last proposal,
the bonus token included), then drafts `k` tokens one at a time, each the argmax of its
logits. Every forward is a batch of one-token queries where that fits the draft's captured
decode step (`ringserve.gpu.runner.decode_capture`), else the eager model. Only verified
positions count as computed: drafts that were rejected are overwritten the next time.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import torch

from ringserve.config import EngineConfig, ModelConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.runner.decode_capture import DecodeCapture
from ringserve.gpu.runner.input_prep import StepInputs, build_inputs
from ringserve.gpu.runner.kv_cache import KVCacheSpec, allocate_kv_cache
from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.spec_decode.verify import expand_queries
from ringserve.gpu.weights.loader import load_model

logger = logging.getLogger(__name__)


class DraftModelProposer:
    """Greedy drafts from a draft model (see the module docstring).

    Args:
        config: the engine configuration (its KV block size, capture sizes, batch limit).
        draft: the draft's model configuration.
        device: the worker's device.
        tp: the draft's tensor-parallel group (the target's, or a group of one).
        backend: the attention backend.
        max_drafts: the most drafts a request gets.
    """

    def __init__(self, config: EngineConfig, draft: ModelConfig, device: torch.device,
                 tp: TPGroup, backend: AttentionBackend, max_drafts: int) -> None:
        self.config = config
        self.draft = draft
        self.device = device
        self.tp = tp
        self.backend = backend
        self.max_drafts = max_drafts
        self.kv_spec = KVCacheSpec.from_config(draft, config.cache_config, tp.world_size)
        self.model: LlamaForCausalLM = load_model(draft, tp=tp, device=device, backend=backend)
        self.kv_caches: list[torch.Tensor] = []
        self.capture: DecodeCapture | None = None
        # request -> positions below this hold the draft's KV of verified tokens
        self.computed: dict[str, int] = {}

    @property
    def kv_bytes_per_block(self) -> int:
        """The draft's bytes per KV block (added to the target's when sizing the pool)."""
        return self.kv_spec.bytes_per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the draft's cache over the pool's `num_blocks` and capture its decode."""
        self.kv_caches = allocate_kv_cache(self.kv_spec, num_blocks, self.device)
        self.computed.clear()
        self.capture = None
        if self.config.compilation_config.enforce_eager:
            return
        library = panel_native.load_library() if self.device.type == "cpu" else None
        sched = self.config.scheduler_config
        self.capture, reason = DecodeCapture.build(
            library, self.model, self.kv_caches, self.config.compilation_config.capture_sizes,
            backend=self.backend.name, tp_size=self.tp.world_size,
            max_batch=sched.max_num_seqs * (1 + self.max_drafts))
        if self.capture is None:
            logger.info("the draft model's decodes run eagerly: %s", reason)

    def release_kv_cache(self) -> None:
        """Drop the draft's cache and what was computed into it (sleep)."""
        self.kv_caches = []
        self.capture = None
        self.computed.clear()

    feature_layers = None  # catches up from the tokens, not from the target's hidden states

    def observe(self, table: RequestTable, inputs: StepInputs, features: torch.Tensor) -> None:
        """Reads no hidden states (never called: `feature_layers` is None)."""

    def forget(self, req_ids: Iterable[str]) -> None:
        """Requests finished or preempted: their draft KV is no longer theirs."""
        for req_id in req_ids:
            self.computed.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, table: RequestTable, req_ids: list[str], slots: np.ndarray,
                k: list[int]) -> dict[str, list[int]]:
        """Up to `k[i]` greedy drafts for each request `req_ids[i]`."""
        bs = table.block_size
        ids: list[str] = []
        rows: list[int] = []
        want: list[int] = []
        for req_id, slot, wanted in zip(req_ids, slots.tolist(), k, strict=True):
            n = int(table.num_tokens[slot])
            # The draft writes positions up to n + k - 2 and the verify step reads up to
            # n - 1 + k: both inside the request's blocks and max_model_len (the draft's
            # own, which may be shorter, bounds the first).
            room = min(int(table.num_blocks[slot]) * bs - n + 1, table.max_model_len - n,
                       self.draft.max_model_len - n + 1)
            wanted = min(wanted, room)
            if wanted > 0:
                ids.append(req_id)
                rows.append(slot)
                want.append(wanted)
        if not ids:
            return {}
        slot_arr = np.asarray(rows, dtype=np.int64)
        n_tok = table.num_tokens[slot_arr].astype(np.int64)
        start = np.fromiter((min(self.computed.get(r, 0), int(n) - 1) for r, n in
                             zip(ids, n_tok.tolist(), strict=True)), dtype=np.int64, count=len(ids))
        drafts = [[t] for t in self._catch_up(table, ids, slot_arr, start, n_tok)]
        for req_id, n in zip(ids, n_tok.tolist(), strict=True):
            self.computed[req_id] = int(n)
        for j in range(1, max(want)):
            going = [i for i in range(len(ids)) if want[i] > j]
            self._next(table, ids, slot_arr, n_tok, drafts, going, j)
        return {req_id: d[:w] for req_id, d, w in zip(ids, drafts, want, strict=True)}

    def _catch_up(self, table: RequestTable, ids: list[str], slots: np.ndarray,
                  start: np.ndarray, n_tok: np.ndarray) -> list[int]:
        """Compute each request's tokens from `start` to its end; its first draft each."""
        num = n_tok - start
        split = np.ones(len(ids), dtype=bool)
        if self.capture is None or int(num.sum()) > self.capture.max_batch:
            split[:] = False
        q_req, q_computed, q_num = expand_queries(start, num, split)
        inputs = build_inputs(table, [ids[i] for i in q_req.tolist()], slots[q_req], q_computed,
                              q_num, self.device)
        hidden = self._forward(inputs)
        last = np.zeros(len(ids), dtype=np.int64)
        ends = inputs.query_start_loc[1:] - 1
        for q, i in enumerate(q_req.tolist()):
            last[i] = ends[q]  # the request's last query comes last
        return self._argmax(hidden, last)

    def _next(self, table: RequestTable, ids: list[str], slots: np.ndarray, n_tok: np.ndarray,
              drafts: list[list[int]], going: list[int], j: int) -> None:
        """Draft position `j` of the requests `going` (their draft `j - 1` is the input)."""
        sub = slots[going]
        position = n_tok[going] + (j - 1)
        saved = table.num_tokens[sub].copy()
        try:
            for i, pos in zip(going, position.tolist(), strict=True):
                table.token_ids[int(slots[i]), pos] = drafts[i][-1]
            table.num_tokens[sub] = position + 1
            inputs = build_inputs(table, [ids[i] for i in going], sub, position,
                                  np.ones(len(going), dtype=np.int64), self.device)
        finally:
            table.num_tokens[sub] = saved
        hidden = self._forward(inputs)
        tokens = self._argmax(hidden, inputs.query_start_loc[1:] - 1)
        for i, token in zip(going, tokens, strict=True):
            drafts[i].append(token)

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if self.capture is not None and self.capture.accepts(inputs):
            return self.capture.run(inputs)
        return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _argmax(self, hidden: torch.Tensor, rows: np.ndarray) -> list[int]:
        index = torch.from_numpy(rows.astype(np.int64)).to(hidden.device)
        logits = self.model.compute_logits(hidden[index])
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
