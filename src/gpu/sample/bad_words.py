"""Bad words to token-id sequences, with vLLM's rules.

Each bad word is encoded without special tokens as written (leading whitespace stripped) and
once more with a leading space (the form a word takes in the middle of text) when that gives a
different first token and the same length. The sampler bans a sequence's last token when the
output already ends with the rest of it. The request table calls the encoder once per request
that has bad words; the model runner builds it from the model's tokenizer on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def bad_words_encoder(tokenizer_dir: str) -> Callable[[str], list[list[int]]]:
    """An encoder using the tokenizer in `tokenizer_dir` (loaded on the first call)."""
    loaded: list[Any] = []

    def encode(word: str) -> list[list[int]]:
        if not loaded:
            from transformers import AutoTokenizer

            loaded.append(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True))
        return encode_bad_word(loaded[0], word)

    return encode


def encode_bad_word(tokenizer: Any, word: str) -> list[list[int]]:
    """The token-id sequences that spell `word` at the start and in the middle of text."""
    plain: list[int] = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
    sequences = [plain] if plain else []
    spaced: list[int] = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
    if plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
        sequences.append(spaced)
    return sequences
