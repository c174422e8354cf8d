"""The `Proposer` protocol every speculative method implements, and the factory the model
runner calls once its target model is loaded.

A proposer runs in the worker after each step's sampling, over the runner's request table
(each request's prompt and output so far, the step's tokens appended), and returns drafts
per request for the next step; the scheduler sends them back with that step, and the
rejection sampler (`ringserve.gpu.sample.rejection`) keeps the ones the target agrees with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
import torch

from ringserve.config import EngineConfig
from ringserve.gpu.attention.backend import AttentionBackend
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.models.llama import LlamaForCausalLM
from ringserve.gpu.runner.input_prep import StepInputs
from ringserve.gpu.runner.request_state import RequestTable


class Proposer(Protocol):
    """Drafts for the next step of each request that just sampled."""

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of KV cache the proposer keeps per block of the pool (0: none)."""
        ...

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The target's hidden states the proposer reads each step: the input of these
        layers (EAGLE-3), () for the final normed hidden states (EAGLE-1), None for none."""
        ...

    def observe(self, table: RequestTable, inputs: StepInputs, features: torch.Tensor) -> None:
        """A step's forward ran and was sampled: `features` [T, F] are the target's hidden
        states of its rows (`feature_layers`), `inputs` its batch. Called for every step
        that computed rows, before `propose`, only when `feature_layers` is not None."""
        ...

    def propose(self, table: RequestTable, req_ids: list[str], slots: np.ndarray,
                k: list[int]) -> dict[str, list[int]]:
        """Up to `k[i]` drafts for `req_ids[i]` (in table slot `slots[i]`); a request with
        none is absent."""
        ...

    def forget(self, req_ids: Iterable[str]) -> None:
        """The requests finished or were preempted (what was kept for them is dropped)."""
        ...

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """The pool has `num_blocks` blocks (the KV cache was allocated or reallocated)."""
        ...

    def release_kv_cache(self) -> None:
        """The KV cache was dropped (sleep): so is the proposer's, and what it kept."""
        ...


def make_proposer(config: EngineConfig, device: torch.device, tp: TPGroup,
                  backend: AttentionBackend,
                  target: Callable[[], LlamaForCausalLM]) -> Proposer | None:
    """The proposer `config.speculative_config` asks for (None: speculation is off);
    `target` returns the model being served (an EAGLE head reads its embedding, and its LM
    head where it has none of its own)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        from ringserve.gpu.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model" and spec.draft_model_config is not None:
        from ringserve.gpu.spec_decode.draft_model import DraftModelProposer

        draft_tp = tp if spec.draft_tensor_parallel_size == tp.world_size else TPGroup()
        return DraftModelProposer(config, spec.draft_model_config, device, draft_tp, backend,
                                  spec.num_speculative_tokens)
    if spec.method in ("eagle", "eagle3") and spec.draft_head_dir is not None:
        from ringserve.gpu.spec_decode.eagle import EagleProposer

        return EagleProposer(config, spec.method, spec.draft_head_dir, device, backend,
                             spec.num_speculative_tokens, target)
    raise ValueError(f"speculative_config.method: {spec.method!r} has no proposer here")
