"""The weight-transfer configuration: which transport carries a trainer's weights, and how big a
bucket is.

Built once at the edge (`--weight-transfer-config '{"backend": "shm"}'`, `LLM(...,
weight_transfer_config=...)`, or the trainer's `TrainerWeightTransferEngine(config, ...)`) by
:func:`parse_weight_transfer_config`, then passed down unchanged. Imports no torch: the engine's
configuration imports this module.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

BACKENDS = ("shm", "gloo", "nccl")
MIN_BUCKET_BYTES = 1 << 20
MAX_BUCKET_BYTES = 1 << 40

_ALLOWED = (f"allowed fields: backend ({', '.join(repr(b) for b in BACKENDS)}), "
            f"bucket_bytes (an int, {MIN_BUCKET_BYTES} <= bucket_bytes <= {MAX_BUCKET_BYTES})")


class WeightTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How weights travel from a trainer to the engine's workers.

    Attributes:
        backend: "shm" (trainer and engine on one host: shared-memory segments read in place),
            "gloo" (any hosts, CPU tensors over TCP) or "nccl" (CUDA devices).
        bucket_bytes: the bytes one bucket (one `update_weights` call) carries: the size of a
            shm segment, or of the packed buffer one gloo / nccl broadcast sends. A tensor
            larger than this travels alone in a bucket of its own size.
        snapshot: the engine keeps the last complete round on disk, so that a restart after
            a fault (`retry`) or a wake-up from sleep level 2 serves it
            (`ringserve.gpu.weights.snapshot`); costs one write of the round's bytes on TP
            rank 0. Off: those load the start-up checkpoint again.
    """

    backend: Literal["shm", "gloo", "nccl"] = "shm"
    bucket_bytes: Annotated[int, msgspec.Meta(ge=MIN_BUCKET_BYTES, le=MAX_BUCKET_BYTES)] = 256 << 20
    snapshot: bool = True


def parse_weight_transfer_config(
    text: str | dict[str, Any] | WeightTransferConfig | None,
) -> WeightTransferConfig | None:
    """The configuration from JSON text (the CLI flag's value) or a dict.

    Args:
        text: JSON such as ``'{"backend": "gloo", "bucket_bytes": 67108864}'``, a dict of the
            same fields, an existing config (returned as is), or None / "" (weight transfer
            off).

    Returns:
        The config, or None when `text` is None or blank.

    Raises:
        ValueError: not JSON, not an object, an unknown field or a bad value; the message names
            the field (msgspec's path, e.g. ``at `$.backend```) and what is allowed.
    """
    if text is None or isinstance(text, WeightTransferConfig):
        return text
    try:
        if isinstance(text, str):
            if not text.strip():
                return None
            return msgspec.json.decode(text, type=WeightTransferConfig)
        if isinstance(text, dict):
            return msgspec.convert(text, WeightTransferConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"weight transfer config: {exc}; {_ALLOWED}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"weight transfer config is not valid JSON ({exc}): {text!r}; "
                         f"expected an object such as '{{\"backend\": \"shm\"}}'") from None
    raise ValueError(f"weight transfer config: expected JSON text or a dict, got "
                     f"{type(text).__name__}; {_ALLOWED}")
