"""Chat messages with images: image parts in, the template's `{"type": "image"}` parts and the
rendered prompt out.

A conversation's image parts become `{"type": "image"}` in a list content (the form Hugging
Face chat templates read; they write the family's placeholder for it) and an `ImageRef` each,
in order, named by its location (`messages[0].content[1]`). `check_images`, `load_part` and
`render_prompt` then check the count, load and preprocess each image and expand the
placeholders into the images' tokens; every failure is an `ImagePartError` (a ValueError) whose
message starts with the part's location.

Shared by `LLM.chat` (`dict_conversation`: vLLM's part forms as plain dicts, run inline) and
the HTTP chat routes (`ringserve.http.chat_template` converts the request's parts;
`ringserve.http.chat_images` runs `load_part` and `render_prompt` in the renderer's threads).
Everything here blocks; no trio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PIL import Image

from ringserve.engine.frontend.multimodal.processors import ProcessedImage
from ringserve.engine.frontend.multimodal.renderer import ImageRenderer
from ringserve.gpu.multimodal.features import ImageFeature

# vLLM's forms of an image part in `LLM.chat`: the part type and the key holding the image.
_DICT_IMAGE_KEYS = {"image_url": "image_url", "image": "image", "image_pil": "image_pil"}


def image_part() -> dict[str, Any]:
    """The template's image part (a fresh dict: templates may annotate what they get)."""
    return {"type": "image"}


@dataclass(frozen=True)
class ImageRef:
    """One image of a conversation.

    Attributes:
        where: its location in the request, e.g. `messages[0].content[1]`.
        source: an image URL (data:, file://, http(s)://) or a PIL image.
    """

    where: str
    source: str | Image.Image


class ImagePartError(ValueError):
    """An image part that cannot be used; the message starts with its location.

    Args:
        where: the part's location (`messages[0].content[1]`).
        reason: what is wrong with it.
    """

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


def check_images(renderer: ImageRenderer | None, refs: list[ImageRef],
                 model: str) -> ImageRenderer:
    """The renderer, once the model takes images and the prompt is within the image limit.

    Raises:
        ImagePartError: a text-only model (naming the first image part), or more images
            than `--limit-mm-per-prompt` (naming the first one over the limit).
    """
    if renderer is None:
        raise ImagePartError(refs[0].where, f"model {model} takes text only")
    try:
        renderer.check_count(len(refs))
    except ValueError as exc:
        raise ImagePartError(refs[renderer.config.limit_per_prompt].where, str(exc)) from None
    return renderer


def load_part(renderer: ImageRenderer, ref: ImageRef) -> ProcessedImage:
    """One image loaded under the media policy and preprocessed (blocking).

    Raises:
        ImagePartError: the URL cannot be used, the bytes are not an image, or the processor
            rejects it.
    """
    try:
        return renderer.load_processed(ref.source)
    except ValueError as exc:  # MediaError included
        raise ImagePartError(ref.where, str(exc)) from None


def render_prompt(renderer: ImageRenderer, text: str, images: list[ProcessedImage], *,
                  add_special_tokens: bool) -> tuple[list[int], list[ImageFeature]]:
    """The rendered chat prompt's token ids with each placeholder expanded, and the images'
    features (blocking: tokenization).

    Raises:
        ValueError: the template wrote a different number of placeholders than there are
            images (a template that ignores image parts, or a placeholder typed in the text).
    """
    try:
        return renderer.render_text(text, images, add_special_tokens=add_special_tokens)
    except ValueError as exc:
        raise ValueError(f"messages: the chat template's output does not match the images: "
                         f"{exc}") from None


def dict_conversation(conversation: list[dict[str, Any]],
                      prefix: str = "messages") -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """`LLM.chat`'s conversation for the template, and its images in order.

    Image parts take vLLM's forms: `{"type": "image_url", "image_url": {"url": URL}}` (or
    the URL string itself), `{"type": "image", "image": IMAGE}` and
    `{"type": "image_pil", "image_pil": IMAGE}`, where IMAGE is a PIL image or a URL. A
    message without image parts is kept as given; in one with images each image part becomes
    `{"type": "image"}` and every other part is kept.

    Args:
        prefix: the location of the conversation's messages in errors (`messages`, or
            `messages[k]` for the k-th of several conversations).

    Raises:
        ImagePartError: an image part without its image.
    """
    refs: list[ImageRef] = []
    out: list[dict[str, Any]] = []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        parts: list[Any] = []
        for j, part in enumerate(content):
            if not _is_image(part):
                parts.append(part)
                continue
            where = f"{prefix}[{i}].content[{j}]"
            refs.append(ImageRef(where, _dict_source(part, where)))
            parts.append(image_part())
        out.append({**message, "content": parts})
    return out, refs


def _is_image(part: object) -> bool:
    return isinstance(part, dict) and part.get("type") in _DICT_IMAGE_KEYS


def _dict_source(part: dict[str, Any], where: str) -> str | Image.Image:
    kind = str(part["type"])
    value = part.get(_DICT_IMAGE_KEYS[kind])
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if isinstance(value, str | Image.Image):
        return value
    form = ("{'url': URL}" if kind == "image_url" else "a PIL image or an image URL")
    raise ImagePartError(where, f"a part of type {kind!r} needs its image under {kind!r} "
                         f"({form}); got {type(value).__name__}")
