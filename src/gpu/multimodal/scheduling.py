"""The scheduler's books for images: when each image's encoder runs, and what the workers'
encoder cache holds.

The scheduler (`ringserve.engine.sched.scheduler`) asks `EncoderBooks.fit` for every request
with images it is about to schedule: given the chunk of prompt positions it would compute,
`fit` returns how much of it can run this step. An image whose rows the chunk needs must be in
the workers' encoder cache, or be encoded this step within the step's encoder budget
(`max_num_encoder_input_tokens`, in embedding rows) and the cache's room (`encoder_cache_size`,
rows); otherwise the chunk stops before the image. A family whose image tokens attend to each
other both ways (Gemma 3: `no_split`) never has a chunk end inside an image.

The books mirror the workers' cache exactly: an entry is added when its encode is scheduled,
and dropped only by the books, which send the drop in the step's `free_encoder_ids` (the
workers apply drops, then encodes, then the forward, in step order). An entry is pinned while a
request still has positions of that image to compute; unpinned entries stay for other requests
with the same image and are dropped oldest first when room is needed.

No torch and no I/O: tested as a plain object.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from ringserve.config import MultiModalConfig
from ringserve.gpu.multimodal.features import ImageFeature, check_features


class _Req(Protocol):
    """What the books read of a scheduler request."""

    request_id: str
    mm_features: list[ImageFeature] | None


class EncoderBooks:
    """The encoder budget per step and the workers' encoder cache, for one engine core.

    Args:
        cache_size: rows the workers' encoder cache holds (`--encoder-cache-size`).
        budget: rows the encoder may produce in one step (`max_num_encoder_input_tokens`).
        no_split: the family's images are never split across steps (bidirectional image
            attention).
    """

    def __init__(self, cache_size: int, budget: int, no_split: bool) -> None:
        if cache_size < 1 or budget < 1:
            raise ValueError(f"encoder cache size {cache_size} and budget {budget} must be >= 1")
        self.cache_size = cache_size
        self.budget = budget
        self.no_split = no_split
        # identifier -> rows, in least recently used order.
        self._cached: OrderedDict[str, int] = OrderedDict()
        self._pins: dict[str, set[str]] = {}  # identifier -> requests that still need it
        self._used = 0
        self._to_free: list[str] = []
        self._step_budget = budget
        self._step_encodes: dict[str, list[int]] = {}

    # -- per step ---------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Reset the step's encoder budget (the scheduler calls this before scheduling)."""
        self._step_budget = self.budget
        self._step_encodes = {}

    def take_step(self) -> tuple[dict[str, list[int]], list[str]]:
        """The step's encodes (request id -> image indices) and the entries to drop first."""
        encodes, self._step_encodes = self._step_encodes, {}
        freed, self._to_free = self._to_free, []
        return encodes, freed

    def fit(self, req: _Req, start: int, n: int) -> int:
        """How many of the `n` positions from `start` the request can compute this step.

        Images the kept chunk needs are pinned, and encoded this step where the workers'
        cache lacks them; images the request has passed are unpinned.
        """
        features = req.mm_features
        if not features:
            return n
        end = start + n
        rid = req.request_id
        for index, feature in enumerate(features):
            if feature.end <= start:
                self._unpin(feature.identifier, rid)
                continue
            if feature.offset >= end:
                break
            if self.no_split and feature.end > end:
                return max(feature.offset - start, 0) if feature.offset > start else 0
            if not self._ready(feature, rid, index):
                return max(feature.offset - start, 0)
        return n

    def _ready(self, feature: ImageFeature, rid: str, index: int) -> bool:
        """Pin the image for `rid`, scheduling its encode when the cache lacks it; False
        when neither the step's budget nor the cache's room allow it."""
        key = feature.identifier
        if key in self._cached:
            self._cached.move_to_end(key)
            self._pins.setdefault(key, set()).add(rid)
            return True
        rows = feature.num_embeds
        if rows > self._step_budget or not self._make_room(rows):
            return False
        self._step_budget -= rows
        self._cached[key] = rows
        self._used += rows
        self._pins.setdefault(key, set()).add(rid)
        self._step_encodes.setdefault(rid, []).append(index)
        return True

    def _make_room(self, rows: int) -> bool:
        if self._used + rows <= self.cache_size:
            return True
        evictable = [k for k in self._cached if not self._pins.get(k)]
        free = self.cache_size - self._used + sum(self._cached[k] for k in evictable)
        if free < rows:
            return False
        for key in evictable:  # least recently used first
            if self._used + rows <= self.cache_size:
                break
            self._used -= self._cached.pop(key)
            self._pins.pop(key, None)
            self._to_free.append(key)
        return True

    def cancel(self, req: _Req) -> None:
        """Take back the encodes `fit` scheduled this step for a request that is not
        scheduled after all (no KV room): the workers never see them."""
        indices = self._step_encodes.pop(req.request_id, None)
        features = req.mm_features or []
        for index in indices or ():
            key = features[index].identifier
            rows = self._cached.pop(key, 0)
            self._used -= rows
            self._step_budget += rows
            self._pins.pop(key, None)

    # -- request life ------------------------------------------------------------------------------

    def release(self, req: _Req) -> None:
        """Unpin every image of a request that finished or was preempted."""
        for feature in req.mm_features or ():
            self._unpin(feature.identifier, req.request_id)

    def _unpin(self, key: str, rid: str) -> None:
        pins = self._pins.get(key)
        if pins is not None:
            pins.discard(rid)

    def reset(self) -> None:
        """Forget every entry (a fault: the workers may have been restarted); the next step
        tells workers that kept their cache to drop it all (unknown entries are ignored)."""
        self._to_free = [*self._to_free, *self._cached]
        self._cached.clear()
        self._pins.clear()
        self._used = 0
        self._step_encodes = {}

    @property
    def usage(self) -> float:
        """The cache's rows in use, 0..1."""
        return self._used / self.cache_size

    def problem(self, features: list[ImageFeature], num_prompt_tokens: int,
                max_num_batched_tokens: int) -> str | None:
        """Why a request's images can never be scheduled, or None (the scheduler's admission
        check)."""
        try:
            check_features(features, num_prompt_tokens)
        except ValueError as exc:
            return str(exc)
        return self.check(features, max_num_batched_tokens)

    def check(self, features: list[ImageFeature], max_num_batched_tokens: int) -> str | None:
        """Why images can never be scheduled (their sizes against the budgets), or None."""
        for i, feature in enumerate(features):
            if feature.num_embeds > min(self.budget, self.cache_size):
                return (f"image {i} needs {feature.num_embeds} encoder rows, more than the "
                        f"encoder budget ({self.budget}) or cache ({self.cache_size}) hold")
            if self.no_split and feature.length > max_num_batched_tokens:
                return (f"image {i} spans {feature.length} tokens, more than "
                        f"max_num_batched_tokens ({max_num_batched_tokens}); this model's "
                        "images are computed in one step")
        return None


def encoder_books(config: MultiModalConfig | None) -> EncoderBooks | None:
    """The books for a vision-language model's engine core (None: text only)."""
    if config is None:
        return None
    return EncoderBooks(config.encoder_cache_size, config.max_num_encoder_input_tokens,
                        config.no_split)
