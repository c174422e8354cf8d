"""A chat request's images, rendered into its prompt off the event loop.

`render_chat_images(ctx, text, images, ...)` takes the prompt text the chat template wrote (one
placeholder per image part) and the images `ringserve.http.chat_template.chat_conversation`
collected, checks the model takes images and the count (`--limit-mm-per-prompt`), loads and
preprocesses each image in the renderer's threads (`AsyncLLM.render_limiter`: a slow fetch or a
large image never blocks the event loop, and requests take turns on the threads image by
image), and expands the placeholders into the images' tokens. The token ids are the expanded
ones, so the job's prompt length (`usage.prompt_tokens`, admission, the context check) counts
every image token.

Every bad part is a 400 whose message starts with its location (`messages[0].content[1]: not
an image Pillow can read: ...`). Called by `/v1/chat/completions` (`ringserve.http.chat`) and
the agents' turns (`ringserve.http.agents.turn`), which rename the locations to their own
(`input[0].content[1]`).
"""

from __future__ import annotations

from collections.abc import Mapping

import trio

from ringserve.engine.frontend.multimodal.chat_parts import (
    ImagePartError,
    ImageRef,
    check_images,
    load_part,
    render_prompt,
)
from ringserve.gpu.multimodal.features import ImageFeature
from ringserve.http.context import AppContext
from ringserve.http.errors import bad_request


async def render_chat_images(ctx: AppContext, text: str, images: list[ImageRef], *,
                             add_special_tokens: bool, param: str = "messages",
                             locations: Mapping[str, str] | None = None,
                             ) -> tuple[list[int], list[ImageFeature]]:
    """The prompt's token ids with its images expanded, and the images' features.

    Args:
        text: the rendered chat prompt (the template's placeholders in it).
        images: the conversation's images, in order.
        add_special_tokens: the request's `add_special_tokens`.
        param: the error's `param`.
        locations: the caller's names for the chat locations (an agents' route:
            `messages[1].content[0]` -> `input[0].content[1]`); unnamed ones are kept.

    Raises:
        APIError: 400 for a text-only model, too many images, an image that cannot be loaded
            or preprocessed, or placeholders that do not match the images.
    """
    engine = ctx.engine
    names = locations or {}

    def rename(exc: ImagePartError) -> Exception:
        return bad_request(f"{names.get(exc.where, exc.where)}: {exc.reason}", param)

    try:
        renderer = check_images(engine.input_processor.renderer, images,
                                ctx.settings.served_model_name)
        processed = [await trio.to_thread.run_sync(load_part, renderer, ref,
                                                   limiter=engine.render_limiter)
                     for ref in images]
    except ImagePartError as exc:
        raise rename(exc) from None

    def render() -> tuple[list[int], list[ImageFeature]]:
        return render_prompt(renderer, text, processed, add_special_tokens=add_special_tokens)

    try:
        return await trio.to_thread.run_sync(render, limiter=engine.render_limiter)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None
