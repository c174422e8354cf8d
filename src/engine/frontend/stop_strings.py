"""Stop-string matching on incrementally detokenized text.

Pure string logic used by the detokenizer (frontend side): only the newly decoded characters,
plus an overlap of `max(len(stop)) - 1` characters before them, are searched, so each step costs
O(new text) rather than O(whole text). While a request streams, the same number of trailing
characters is held back, because they could still become the start of a stop string.
"""

from __future__ import annotations


def find_stop_string(
    text: str, num_new_chars: int, stops: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find the earliest stop string that ends inside the last `num_new_chars` characters.

    Args:
        text: the whole output text so far (new characters included).
        num_new_chars: how many characters at the end of `text` are new this step.
        stops: the stop strings (non-empty).
        include_in_output: keep the stop string in the output when it matches.

    Returns:
        None, or (the matched stop string, the length to truncate `text` to).
    """
    if not stops or num_new_chars <= 0:
        return None
    best: tuple[str, int] | None = None
    best_start = len(text) + 1
    new_start = len(text) - num_new_chars
    for stop in stops:
        # A match must end inside the new text, so it can start at most len(stop) - 1 before it.
        search_from = max(0, new_start - len(stop) + 1)
        idx = text.find(stop, search_from)
        if idx != -1 and idx < best_start:
            best_start = idx
            best = (stop, idx + len(stop) if include_in_output else idx)
    return best


def holdback_chars(stops: list[str]) -> int:
    """Characters to keep back from a stream so a partial stop string is never emitted."""
    return max((len(s) for s in stops), default=1) - 1
