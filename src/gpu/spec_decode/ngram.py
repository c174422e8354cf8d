"""The n-gram proposer (prompt lookup): drafts copied from the request's own tokens.

For a request whose last `n` tokens (`prompt_lookup_max` >= n >= `prompt_lookup_min`, longest
first) also occur earlier in its prompt or output, the tokens that followed their latest
earlier occurrence are the drafts (up to `k`). Editing and retrieval answers repeat long runs
of their prompt, where most drafts are accepted; a request with no match gets none. Runs in
the worker over the runner's token table, after each step's sampling; no model, no KV.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ringserve.gpu.runner.request_state import RequestTable


class NgramProposer:
    """Prompt-lookup drafts (see the module docstring).

    Args:
        min_n: the shortest suffix matched (`prompt_lookup_min`).
        max_n: the longest (`prompt_lookup_max`).
    """

    kv_bytes_per_block = 0
    feature_layers = None  # reads no hidden states

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, table: RequestTable, req_ids: list[str], slots: np.ndarray,
                k: list[int]) -> dict[str, list[int]]:
        """Up to `k[i]` drafts for each request `req_ids[i]` (absent: no match)."""
        out: dict[str, list[int]] = {}
        for req_id, slot, want in zip(req_ids, slots.tolist(), k, strict=True):
            if want <= 0:
                continue
            tokens = table.token_ids[slot, : int(table.num_tokens[slot])]
            drafts = propose_ngram(tokens, self.min_n, self.max_n, want)
            if drafts:
                out[req_id] = drafts
        return out

    def observe(self, table: RequestTable, inputs: object, features: object) -> None:
        """Reads no hidden states (never called: `feature_layers` is None)."""

    def forget(self, req_ids: Iterable[str]) -> None:
        """Nothing is kept per request."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """No KV cache."""

    def release_kv_cache(self) -> None:
        """No KV cache."""


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-`k` tokens that followed the latest earlier occurrence of the longest
    suffix of `tokens` of `max_n` .. `min_n` tokens; [] when none occurs earlier."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    last = tokens[-1]
    # Candidate ends: earlier positions holding the last token (the suffix itself excluded).
    ends = np.flatnonzero(tokens[:-1] == last)
    if ends.size == 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = ends - (n - 1)
        starts = starts[starts >= 0]
        if starts.size == 0:
            continue
        match = np.ones(starts.size, dtype=bool)
        for offset in range(n - 1):
            match &= tokens[starts + offset] == tokens[length - n + offset]
        hits = starts[match]
        if hits.size:
            follow = int(hits[-1]) + n
            return [int(t) for t in tokens[follow: follow + k]]
    return []
