"""Persistent per-request state of the model runner, updated from SchedulerOutput diffs.

`RequestTable` owns one slot per running request: rows of preallocated numpy arrays (token ids,
counts, block table, scalar sampling parameters) that input preparation and sampling metadata
gather from with vectorised indexing. `RequestState` keeps what outlives a slot: the sampling
parameters, the seeded generator and the per-request sparse sampling inputs (logit bias,
allowed ids, bad-word ids), so a preempted request resumes with the same random stream.

Only the model runner talks to this module: it applies each step's diff (`apply_new`,
`apply_cached`, `finish`, `preempt`) and appends the sampled tokens (`append_token`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ringserve.gpu.wire import CachedRequestData, NewRequestData
from ringserve.sampling_params import SamplingParams

NO_LOGPROBS = -2  # sentinel in the num_logprobs / num_prompt_logprobs columns


@dataclass
class RequestState:
    """What the worker keeps about a request from its arrival until it finishes.

    Attributes:
        req_id: the request.
        params: its sampling parameters.
        num_prompt_tokens: prompt length.
        generator: the seeded generator (None unless `params.seed` is set).
        stop_token_ids: ids masked while fewer than `min_tokens` were generated.
        bad_words_ids: tokenised bad words (each a token-id sequence).
        slot: its row in the table, or -1 while preempted.
    """

    req_id: str
    params: SamplingParams
    num_prompt_tokens: int
    generator: torch.Generator | None
    stop_token_ids: list[int]
    bad_words_ids: list[list[int]] = field(default_factory=list)
    slot: int = -1


class RequestTable:
    """Slot arrays for up to `max_num_reqs` running requests.

    Args:
        max_num_reqs: the most requests in one batch (max_num_seqs).
        max_model_len: the longest sequence.
        block_size: tokens per KV block.
        eos_token_ids: ids masked (with stop_token_ids) under min_tokens.
        device: where seeded generators live.
        tokenize: turns a bad word into its token-id sequences (only called for requests with bad_words).
    """

    def __init__(
        self,
        *,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        tokenize: Callable[[str], list[list[int]]] | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.tokenize = tokenize
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition = np.ones(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int32)
        self.num_prompt_logprobs = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int32)
        # logit_bias, allowed_token_ids or bad_words: the per-request (sparse) sampling inputs
        self.has_sparse = np.zeros(max_num_reqs, dtype=np.bool_)
        self.requests: dict[str, RequestState] = {}
        self.req_at_slot: list[RequestState | None] = [None] * max_num_reqs
        self._free_slots = list(range(max_num_reqs - 1, -1, -1))

    # -- diffs from the scheduler ------------------------------------------------------------

    def apply_new(self, new: NewRequestData) -> None:
        """Admit a request seen for the first time (state, then a slot).

        Raises:
            ValueError: the request id is already held, or the batch has no free slot.
        """
        if new.req_id in self.requests:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        stops = [] if params.ignore_eos else list(self.eos_token_ids)
        stops += params.stop_token_ids or []
        state = RequestState(
            req_id=new.req_id, params=params, num_prompt_tokens=len(new.prompt_token_ids),
            generator=generator, stop_token_ids=sorted(set(stops)),
            bad_words_ids=self._bad_words_ids(params.bad_words or []),
        )
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        self.requests[new.req_id] = state
        self._place(state, tokens, new.block_ids, new.num_computed_tokens)

    def apply_cached(self, cached: CachedRequestData) -> None:
        """Apply a scheduled request's diff (new blocks, computed count, or a resume).

        Raises:
            KeyError: the request is unknown.
        """
        state = self.requests[cached.req_id]
        if cached.resumed_from_preemption:
            if state.slot >= 0:
                self._release(state)
            self._place(state, cached.all_token_ids, cached.new_block_ids, cached.num_computed_tokens)
            return
        slot = state.slot
        for tok in cached.new_token_ids:
            self.append_token(slot, tok)
        self._append_blocks(slot, cached.new_block_ids)
        self.num_computed[slot] = cached.num_computed_tokens

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        if not words:
            return []
        if self.tokenize is None:
            raise ValueError("bad_words: this worker has no tokenizer to encode them")
        return [ids for word in words for ids in self.tokenize(word) if ids]

    def finish(self, req_id: str) -> None:
        """Drop a finished or aborted request (unknown ids are ignored)."""
        state = self.requests.pop(req_id, None)
        if state is not None and state.slot >= 0:
            self._release(state)

    def preempt(self, req_id: str) -> None:
        """Free a preempted request's slot; its state waits for the resume."""
        state = self.requests.get(req_id)
        if state is not None and state.slot >= 0:
            self._release(state)

    def append_token(self, slot: int, token: int) -> None:
        """Append a sampled token to the request in `slot`."""
        n = int(self.num_tokens[slot])
        if n < self.max_model_len:
            self.token_ids[slot, n] = token
            self.num_tokens[slot] = n + 1

    # -- slots ---------------------------------------------------------------------------------

    def slot_of(self, req_id: str) -> int:
        """The slot of a running request (-1 while preempted).

        Raises:
            KeyError: the request is unknown.
        """
        return self.requests[req_id].slot

    def _place(self, state: RequestState, tokens: list[int], blocks: list[int], computed: int) -> None:
        if not self._free_slots:
            raise ValueError("no free slot: more running requests than max_num_seqs")
        if len(tokens) > self.max_model_len:
            raise ValueError(f"request {state.req_id!r}: {len(tokens)} tokens > max_model_len")
        slot = self._free_slots.pop()
        state.slot = slot
        self.req_at_slot[slot] = state
        self.token_ids[slot, : len(tokens)] = tokens
        self.num_tokens[slot] = len(tokens)
        self.num_prompt_tokens[slot] = state.num_prompt_tokens
        self.num_computed[slot] = computed
        self.num_blocks[slot] = 0
        self._append_blocks(slot, blocks)
        self._set_params(slot, state.params)

    def _append_blocks(self, slot: int, blocks: list[int]) -> None:
        start = int(self.num_blocks[slot])
        if start + len(blocks) > self.block_table.shape[1]:
            raise ValueError(f"slot {slot}: block table longer than max_model_len allows")
        self.block_table[slot, start : start + len(blocks)] = blocks
        self.num_blocks[slot] = start + len(blocks)

    def _set_params(self, slot: int, p: SamplingParams) -> None:
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k if p.top_k > 0 else 0
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.repetition[slot] = p.repetition_penalty
        self.min_tokens[slot] = p.min_tokens
        self.num_logprobs[slot] = NO_LOGPROBS if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[slot] = NO_LOGPROBS if p.prompt_logprobs is None else p.prompt_logprobs
        self.has_sparse[slot] = bool(p.logit_bias or p.allowed_token_ids or p.bad_words)

    def _release(self, state: RequestState) -> None:
        self.req_at_slot[state.slot] = None
        self._free_slots.append(state.slot)
        state.slot = -1
