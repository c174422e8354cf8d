"""A json / json_object constraint's JSON schema as a Python value, for every backend.

A leaf under the backends (`xgrammar_backend`, `guidance_backend`) and the frontend's check
(`validation`, which imports the backends), so none of them imports another for it.
"""

from __future__ import annotations

import json
from typing import Any

from ringserve.sampling_params import StructuredOutputsParams


def load_schema(params: StructuredOutputsParams) -> Any:
    """The JSON schema of a json / json_object constraint, as a Python value.

    Raises:
        ValueError: `json` is text that is not JSON, or not an object or a boolean.
    """
    if params.kind == "json_object":
        return {"type": "object"}
    value = params.json
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json: invalid JSON schema: not JSON: {exc}"
                             ) from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"structured_outputs.json: invalid JSON schema: got "
                         f"{type(value).__name__}, allowed: an object or a boolean")
    return value
