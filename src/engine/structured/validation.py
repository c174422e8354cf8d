"""The frontend's check of a request's constraint: a 400 naming the field before anything
reaches the engine core.

`check_structured_outputs` builds the backend's grammar without a tokenizer (xgrammar's
`xgr.Grammar.from_*`, llguidance's `LLMatcher.validate_grammar`) and raises ValueError naming
the field and why. Results (valid or the error) are kept in a small LRU keyed by
`StructuredOutputsParams.key()`, since clients repeat the same schema; a hit costs a dict
lookup. The backends' modules are imported on first use (importing xgrammar takes a while).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from ringserve.sampling_params import StructuredOutputsParams

__all__ = ["check_structured_outputs"]

# Distinct (backend, constraint) results remembered.
_CACHE_SIZE = 512
_cache: OrderedDict[tuple[Any, ...], str | None] = OrderedDict()
_lock = threading.Lock()


def _check(params: StructuredOutputsParams, backend: str) -> None:
    if backend == "guidance":
        from ringserve.engine.structured.guidance_backend import validate

        validate(params)
    else:
        from ringserve.engine.structured.xgrammar_backend import xgrammar_grammar

        xgrammar_grammar(params)


def check_structured_outputs(params: StructuredOutputsParams, backend: str = "xgrammar") -> None:
    """Check that `backend` can enforce `params`, without a tokenizer.

    Args:
        params: the request's constraint.
        backend: "xgrammar" (or "auto", the same) or "guidance".

    Raises:
        ValueError: an invalid spec or one the backend cannot enforce; the message names the
            field (`structured_outputs.json: invalid JSON schema: ...`).
    """
    if backend == "auto":
        backend = "xgrammar"
    if backend not in ("xgrammar", "guidance"):
        raise ValueError(f"structured outputs backend: got {backend!r}, allowed: xgrammar, "
                         "guidance, auto")
    key = (backend, *params.key())
    with _lock:
        hit = key in _cache
        error = _cache.get(key)
        if hit:
            _cache.move_to_end(key)
    if not hit:
        try:
            _check(params, backend)
            error = None
        except ValueError as exc:
            error = str(exc)
        with _lock:
            _cache[key] = error
            if len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    if error is not None:
        raise ValueError(error)
