"""Attention backends and their selection: the torch reference or the Triton kernels.

The attention block of each model (`ringserve.gpu.models.llama`) holds one backend and calls
`write_kv` then `attend` every layer. Default: Triton on CUDA, torch on CPU; the worker's
`attention_backend` argument ("auto", "torch", "triton") overrides.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from ringserve.gpu.attention import torch_ref
from ringserve.gpu.attention.metadata import AttentionMetadata

BackendName = Literal["auto", "torch", "triton"]


class AttentionBackend(Protocol):
    """Writes a step's keys/values into the paged cache and attends over it."""

    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store `key`/`value` [T, Hkv, D] at `slot_mapping` [T] (layout: see torch_ref)."""
        ...

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal paged attention of `query` [T, Hq, D]; returns [T, Hq, D]."""
        ...


class TorchAttentionBackend:
    """The torch reference path (`ringserve.gpu.attention.torch_ref`).

    One instance serves every layer of a model, so it keeps the gather plan of the step's
    metadata (`torch_ref.plan_attention`): the first layer builds it, the others reuse it.
    """

    name = "torch"

    def __init__(self) -> None:
        self._plan: tuple[AttentionMetadata, torch.Size, torch_ref.AttentionPlan] | None = None

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """See `AttentionBackend.write_kv`."""
        torch_ref.write_kv(key, value, kv_cache, slot_mapping)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """See `AttentionBackend.attend`."""
        return torch_ref.paged_attention(query, kv_cache, meta, scale, self._plan_for(meta, kv_cache))

    def _plan_for(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch_ref.AttentionPlan:
        cached = self._plan
        # Keyed by identity: the metadata is immutable and built afresh every step; holding it
        # keeps its id from being reused while the plan is cached.
        if cached is not None and cached[0] is meta and cached[1] == kv_cache.shape:
            return cached[2]
        plan = torch_ref.plan_attention(meta, kv_cache)
        self._plan = (meta, kv_cache.shape, plan)
        return plan


class TritonAttentionBackend:
    """The Triton kernels (`ringserve.gpu.attention.triton_kernels`)."""

    name = "triton"

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """See `AttentionBackend.write_kv`."""
        from ringserve.gpu.attention.triton_kernels import write_kv

        write_kv(key, value, kv_cache, slot_mapping)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """See `AttentionBackend.attend`."""
        from ringserve.gpu.attention.triton_kernels import paged_attention

        return paged_attention(query, kv_cache, meta, scale)


def select_backend(device: torch.device, choice: BackendName = "auto") -> AttentionBackend:
    """The backend for `device`: Triton on CUDA, torch elsewhere, unless `choice` says which.

    Raises:
        ValueError: an unknown choice.
    """
    if choice == "auto":
        choice = "triton" if device.type == "cuda" else "torch"
    if choice == "torch":
        return TorchAttentionBackend()
    if choice == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend: got {choice!r}, allowed: auto, torch, triton")
