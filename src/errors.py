"""Errors shared by every layer that a user can cause or see.

Per-request errors (bad input, a request that cannot fit) are distinct from engine-fatal ones;
the engine package adds its own (`EngineDeadError`, `EngineGenerateError`) next to its code.
"""

from __future__ import annotations


class RingserveError(Exception):
    """Base class of ringserve's own errors."""


class ModelDirectoryError(RingserveError, ValueError):
    """A model or tokenizer directory is missing, incomplete or not supported.

    The message names the path and what is missing or wrong.
    """
