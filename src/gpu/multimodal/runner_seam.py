"""The model runner's seam for images: the worker's encoder cache, and what a step with image
positions hands the model.

`ModelRunner` owns one `ImageSeam` for a vision-language model and calls it at two points:

- `apply_diff(scheduler_output)`, with the step's bookkeeping (also for a step a pause skips,
  so the scheduler's books stay true): keeps each new request's images (arrays included) until
  it finishes, drops the encoder-cache entries the scheduler freed, and runs the vision encoder
  for the images the scheduler scheduled (`encoder_inputs`), once per image.
- `prepare(inputs)`, after the flat batch is built: the rows of the step's image positions and
  the encoder output that replaces their embeddings (`LlamaModel.embed_rows`), M-RoPE positions
  for Qwen2-VL (three streams for image tokens, text positions shifted by the request's delta),
  and Gemma 3's image spans for the attention (`AttentionMetadata.image_spans`). A step it
  changes runs eagerly (the captured decode step reads plain token ids and positions).

The encoder cache maps an image's identifier to its rows; the scheduler's books
(`ringserve.gpu.multimodal.scheduling`) decide what it holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ringserve.gpu.multimodal.families import VisionFamily
from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.gpu.multimodal.vision import VisionEncoder
from ringserve.gpu.runner.input_prep import StepInputs
from ringserve.gpu.runner.request_state import RequestTable
from ringserve.gpu.wire import SchedulerOutput


@dataclass
class _Images:
    """A request's images, and its M-RoPE positions (Qwen2-VL) once known."""

    features: list[ImageFeature]
    mrope: np.ndarray[Any, Any] | None = None  # int64 [3, prompt length]
    delta: int = 0  # position shift of every token past the prompt


class ImageSeam:
    """Images in the worker (see the module docstring).

    Args:
        family: the model's vision family.
        hf_config: the checkpoint's config (the image token id, the merge size).
        device: the worker's device.
    """

    def __init__(self, family: VisionFamily, hf_config: dict[str, Any],
                 device: torch.device) -> None:
        self.family = family
        self.image_token_id = family.embed_token_id(hf_config)
        vision = hf_config.get("vision_config") or {}
        self.merge_size = int(vision.get("spatial_merge_size", 1))
        self.device = device
        self.vision: VisionEncoder | None = None
        self.images: dict[str, _Images] = {}
        self.cache: dict[str, torch.Tensor] = {}

    def attach(self, vision: VisionEncoder, *, fresh: bool = False) -> None:
        """Encode with `vision` (the loaded model's tower) from now on; `fresh` (new
        weights) drops the encoder cache too, whose rows the old tower computed (the core's
        books are reset with the KV it invalidates)."""
        self.vision = vision
        if fresh:
            self.cache.clear()

    # -- bookkeeping -----------------------------------------------------------------------------

    def apply_diff(self, so: SchedulerOutput, errors: dict[str, str]) -> None:
        """Take the step's new images, drops and encodes (see the module docstring); a
        request whose image cannot be encoded gets its message in `errors`."""
        for rid in so.finished_req_ids:
            self.images.pop(rid, None)
        for new in so.scheduled_new_reqs:
            if new.mm_features:
                images = _Images(list(new.mm_features))
                if self.family.mrope:
                    images.mrope, images.delta = mrope_positions(
                        new.prompt_token_ids, images.features, self.merge_size)
                self.images[new.req_id] = images
        for key in so.free_encoder_ids:
            self.cache.pop(key, None)
        for rid, indices in so.encoder_inputs.items():
            entry = self.images.get(rid)
            for index in indices:
                if entry is None or index >= len(entry.features):
                    errors[rid] = f"image {index} of request {rid!r} is unknown to the worker"
                    break
                feature = entry.features[index]
                if feature.identifier not in self.cache:
                    try:
                        self.cache[feature.identifier] = self._encode(feature)
                    except (ValueError, RuntimeError, KeyError) as exc:
                        errors[rid] = f"image {index} could not be encoded: {exc}"
                        break

    def _encode(self, feature: ImageFeature) -> torch.Tensor:
        if self.vision is None:
            raise RuntimeError("the vision encoder is not loaded")
        # The arrays are read-only views of the step's frames: copied once here.
        data = {k: torch.from_numpy(np.array(v)).to(self.device) for k, v in feature.data.items()}
        rows = self.vision.encode(data)
        if rows.shape[0] != feature.num_embeds:
            raise ValueError(f"the encoder gave {rows.shape[0]} rows, the prompt holds "
                             f"{feature.num_embeds} image tokens")
        return rows

    # -- one step ------------------------------------------------------------------------------

    def prepare(self, inputs: StepInputs, table: RequestTable,
                errors: dict[str, str]) -> tuple[StepInputs, tuple[torch.Tensor, torch.Tensor]
                                                 | None, bool]:
        """The step's inputs with M-RoPE positions and image spans, the embedding rows to
        replace (None: no image position this step), and whether the step must run eagerly
        (image rows, three-stream positions or image spans). A request whose image rows are
        not in the cache gets its message in `errors` (its rows keep their token
        embeddings)."""
        qsl = inputs.query_start_loc
        positions = inputs.positions_np.copy() if self.family.mrope else inputs.positions_np
        index: list[np.ndarray[Any, Any]] = []
        rows: list[torch.Tensor] = []
        spans: list[tuple[int, int, int]] = []
        mrope: np.ndarray[Any, Any] | None = None
        shifted = False
        for b, rid in enumerate(inputs.req_ids):
            entry = self.images.get(rid)
            if entry is None:
                continue
            lo, hi = int(qsl[b]), int(qsl[b + 1])
            start, end = int(positions[lo]), int(positions[hi - 1]) + 1
            if entry.mrope is not None:
                mrope, shifted = self._mrope(entry, mrope, positions, lo, hi, start, end, shifted)
            slot = int(inputs.slots[b])
            for feature in entry.features:
                a, z = max(start, feature.offset), min(end, feature.end)
                if a >= z:
                    continue
                if self.family.no_split:
                    spans.append((b, feature.offset, feature.end))
                cached = self.cache.get(feature.identifier)
                if cached is None:
                    errors[rid] = f"image at position {feature.offset} is not encoded"
                    break
                tokens = table.token_ids[slot, feature.offset:z]
                is_row = tokens == self.image_token_id
                order = np.cumsum(is_row) - 1  # row of the image for each position
                keep = np.flatnonzero(is_row[a - feature.offset:]) + a - feature.offset
                index.append(lo + (keep + feature.offset - start))
                rows.append(cached[torch.from_numpy(order[keep]).to(cached.device)])
        if mrope is not None or shifted:
            pos = mrope if mrope is not None else positions
            inputs = dataclasses.replace(inputs, positions=torch.from_numpy(
                np.ascontiguousarray(pos)).to(self.device))
        if spans:
            inputs = dataclasses.replace(inputs, meta=dataclasses.replace(
                inputs.meta, image_spans=tuple(spans)))
        eager = mrope is not None or bool(spans) or bool(index)
        if not index:
            return inputs, None, eager
        flat = torch.from_numpy(np.concatenate(index)).to(self.device)
        return inputs, (flat, torch.cat(rows)), eager

    @staticmethod
    def _mrope(entry: _Images, mrope: np.ndarray[Any, Any] | None,
               positions: np.ndarray[Any, Any], lo: int, hi: int, start: int, end: int,
               shifted: bool) -> tuple[np.ndarray[Any, Any] | None, bool]:
        """M-RoPE positions of one request's rows: three streams while the step holds
        prompt positions, else the positions shifted by the request's delta."""
        assert entry.mrope is not None
        prompt = entry.mrope.shape[1]
        if start < prompt:
            if mrope is None:  # the first request with prompt rows: every row in 3 streams
                mrope = np.broadcast_to(positions, (3, positions.shape[0])).copy()
            pos = np.arange(start, end)
            inside = pos < prompt
            mrope[:, lo:hi][:, inside] = entry.mrope[:, pos[inside]]
            mrope[:, lo:hi][:, ~inside] = pos[~inside] + entry.delta
            return mrope, shifted
        if entry.delta:
            positions[lo:hi] += entry.delta  # host copy: rebuilt into the device tensor
            if mrope is not None:
                mrope[:, lo:hi] += entry.delta
            return mrope, True
        return mrope, shifted


def mrope_positions(token_ids: list[int], features: list[ImageFeature],
                    merge_size: int) -> tuple[np.ndarray[Any, Any], int]:
    """Qwen2-VL's positions of a prompt: text counts up by one; an image's tokens take
    (temporal, row, column) offsets from the position where it starts, and the text after
    it resumes past its larger side (transformers' `get_rope_index`). Returns the [3, n]
    positions and the delta later tokens are shifted by (their position minus their index).
    """
    n = len(token_ids)
    out = np.empty((3, n), dtype=np.int64)
    cursor = current = 0
    for feature in features:
        text = feature.offset - cursor
        out[:, cursor:feature.offset] = np.arange(current, current + text)
        current += text
        grid = feature.data.get("image_grid_thw")
        if grid is None:
            raise ValueError("an M-RoPE image needs its image_grid_thw")
        t, h, w = (int(x) for x in np.asarray(grid).reshape(-1)[:3])
        h, w = h // merge_size, w // merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        count = t * h * w
        if count != feature.length:
            raise ValueError(f"an image of grid {t}x{h}x{w} spans {feature.length} tokens")
        out[0, feature.offset:feature.end] = tt.reshape(-1) + current
        out[1, feature.offset:feature.end] = hh.reshape(-1) + current
        out[2, feature.offset:feature.end] = ww.reshape(-1) + current
        current += max(h, w)
        cursor = feature.end
    out[:, cursor:] = np.arange(current, current + n - cursor)
    delta = int(out.max()) + 1 - n if n else 0
    return out, delta
