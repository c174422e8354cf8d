"""Attention backends and their selection: the torch reference, the CPU kernel or Triton.

The attention block of each model (`ringserve.gpu.models.llama`) holds one backend and calls
`write_kv` then `attend` every layer. Default: Triton on CUDA; on CPU the C decode kernel
(`cpu_native`) when it builds on this machine, else the torch reference. The worker's
`attention_backend` argument ("auto", "torch", "cpu", "triton") overrides, and so does
`RINGSERVE_ATTENTION_BACKEND` when that argument is "auto".

Every backend takes a layer's sliding window and logit soft-cap per `attend` call (Gemma 2
alternates windowed and global layers, so one backend instance sees both).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, Literal, Protocol, TypeVar, cast

import torch

from ringserve import envs
from ringserve.gpu.attention import cpu_native, torch_ref
from ringserve.gpu.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

BackendName = Literal["auto", "torch", "cpu", "triton"]
P = TypeVar("P")

_CPU_NEEDS = ("attention_backend 'cpu': needs the CPU device and a C compiler with OpenMP "
              "(see the log for why the kernel did not build)")


class AttentionBackend(Protocol):
    """Writes a step's keys/values into the paged cache and attends over it."""

    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store `key`/`value` [T, Hkv, D] at `slot_mapping` [T] (layout: see torch_ref)."""
        ...

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Causal paged attention of `query` [T, Hq, D]; returns [T, Hq, D].

        Args:
            sliding_window: a query at position p sees keys at positions
                p - sliding_window + 1 .. p only (transformers' convention); None: all.
            logits_soft_cap: scores become cap * tanh(scores / cap) before the softmax
                (Gemma 2); None: off.
        """
        ...


class StepPlans(Generic[P]):
    """The current step's plans, built by the first layer of each kind and reused by the rest.

    Keyed by the metadata's identity: it is immutable and built afresh every step; holding it
    keeps its id from being reused while the plans are cached. Within a step, one plan per
    cache shape and sliding window (a model may mix windowed and global layers).

    Args:
        build: makes the plan of a step's metadata for caches shaped like the given one and
            layers with the given sliding window.

    Attributes:
        entry: (metadata, cache shape, plan) of the plan last handed out.
    """

    def __init__(
        self, build: Callable[[AttentionMetadata, torch.Tensor, int | None], P]
    ) -> None:
        self._build = build
        self._step: AttentionMetadata | None = None
        self._plans: dict[tuple[torch.Size, int | None], P] = {}
        self.entry: tuple[AttentionMetadata, torch.Size, P] | None = None

    def get(self, meta: AttentionMetadata, kv_cache: torch.Tensor,
            sliding_window: int | None = None) -> P:
        """The plan of `meta` (built now unless this step's is cached)."""
        if self._step is not meta:
            self._step, self._plans = meta, {}
        key = (kv_cache.shape, sliding_window)
        if key not in self._plans:
            self._plans[key] = self._build(meta, kv_cache, sliding_window)
        plan = self._plans[key]
        if self.entry is None or self.entry[2] is not plan:
            self.entry = (meta, kv_cache.shape, plan)
        return plan


class TorchAttentionBackend:
    """The torch reference path (`ringserve.gpu.attention.torch_ref`).

    One instance serves every layer of a model, so it keeps the gather plan of the step's
    metadata (`torch_ref.plan_attention`): the first layer builds it, the others reuse it.
    """

    name = "torch"
    # Long prefills attend in this dtype (`torch_ref.attend_requests`); set by the model
    # runner for a bf16 checkpoint's bf16 panels on a CPU with native bf16.
    prefill_dtype: torch.dtype | None = None

    def __init__(self) -> None:
        self.plans = StepPlans(torch_ref.plan_attention)

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """See `AttentionBackend.write_kv`."""
        torch_ref.write_kv(key, value, kv_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """See `AttentionBackend.attend`.

        Raises:
            ValueError: a bad window or soft-cap (`torch_ref.check_options`).
        """
        torch_ref.check_options(sliding_window, logits_soft_cap)
        out = torch_ref.paged_attention(
            query, kv_cache, meta, scale, self.plans.get(meta, kv_cache, sliding_window),
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            prefill_dtype=self.prefill_dtype,
        )
        if meta.image_spans:
            torch_ref.attend_image_spans(query, kv_cache, meta, scale, out,
                                         sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
        return out


class CpuAttentionBackend(TorchAttentionBackend):
    """Decodes through the C kernel reading the paged cache in place (`cpu_native`, which
    applies the window and soft-cap itself); multi-token queries, and caches other than
    float32, through the torch reference.

    Like the torch backend, one instance serves every layer and keeps the step's plan.

    Args:
        kernel: the loaded kernel (`cpu_native.load_kernel`); None loads it now.

    Raises:
        ValueError: the kernel cannot be built here (no C compiler with OpenMP).
    """

    name = "cpu"

    def __init__(self, kernel: cpu_native.Kernel | None = None) -> None:
        super().__init__()
        kernel = kernel or cpu_native.load_kernel()
        if kernel is None:
            raise ValueError(_CPU_NEEDS)
        self.kernel = kernel
        # The kernel windows each decode itself: one decode plan serves every layer.
        self.decode_plans = StepPlans(lambda meta, cache, _window: cpu_native.plan_decodes(
            meta, cache))

    def attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """See `AttentionBackend.attend`.

        Raises:
            ValueError: a bad window or soft-cap (`torch_ref.check_options`), or shapes that
                do not fit the cache (`cpu_native.decode_attention`).
        """
        if (query.dtype != torch.float32 or kv_cache.dtype != torch.float32
                or query.device.type != "cpu" or not kv_cache.is_contiguous()):
            return super().attend(query, kv_cache, meta, scale, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap)
        torch_ref.check_options(sliding_window, logits_soft_cap)
        plan = self.decode_plans.get(meta, kv_cache)
        query = query.contiguous()
        out = torch.empty_like(query)
        cpu_native.decode_attention(self.kernel, query, kv_cache, plan, scale, out,
                                    sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap)
        torch_ref.attend_requests(query, kv_cache, meta, plan.requests, scale, out,
                                  sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                  prefill_dtype=self.prefill_dtype)
        if meta.image_spans:
            torch_ref.attend_image_spans(query, kv_cache, meta, scale, out,
                                         sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
        return out


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
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """See `AttentionBackend.attend`.

        Raises:
            ValueError: a bad window or soft-cap (`torch_ref.check_options`).
        """
        from ringserve.gpu.attention.triton_kernels import paged_attention

        out = paged_attention(query, kv_cache, meta, scale, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap)
        if meta.image_spans:
            torch_ref.attend_image_spans(query, kv_cache, meta, scale, out,
                                         sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap)
        return out


_warned_triton = False


def _warn_unmeasured_triton() -> None:
    """Say once per process that `auto` picked kernels never run on a GPU yet (checked only
    under the Triton interpreter) until the GPU bring-up measures them."""
    global _warned_triton
    if not _warned_triton:
        _warned_triton = True
        logger.warning("attention backend auto -> triton on CUDA: these Triton kernels are "
                       "checked only under TRITON_INTERPRET=1 and have not yet been run or "
                       "timed on a GPU; RINGSERVE_ATTENTION_BACKEND=torch uses the reference")


def select_backend(device: torch.device, choice: BackendName = "auto") -> AttentionBackend:
    """The backend for `device`, unless `choice` (or, when it is "auto",
    RINGSERVE_ATTENTION_BACKEND) says which: Triton on CUDA; on CPU the C kernel when it can
    be built here, else the torch reference.

    Raises:
        ValueError: an unknown choice, or "cpu" when the kernel cannot be built (no compiler)
            or the device is not the CPU.
    """
    if choice == "auto":
        choice = cast(BackendName, envs.attention_backend())
    if choice == "auto":
        if device.type == "cuda":
            choice = "triton"
            _warn_unmeasured_triton()
        else:
            choice = "cpu" if device.type == "cpu" and cpu_native.load_kernel() else "torch"
    if choice == "torch":
        return TorchAttentionBackend()
    if choice == "cpu":
        if device.type != "cpu":
            raise ValueError(_CPU_NEEDS)
        return CpuAttentionBackend()
    if choice == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend: got {choice!r}, allowed: auto, torch, cpu, triton")
