"""Helpers for the grammar-backend tests: backends built once per tokenizer, a generate-by-mask
loop over random allowed tokens, and the one-token-at-a-time reference bitmask."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from ringserve.engine.structured.backend import allocate_bitmask, create_backend

VOCAB = 8000


@functools.cache
def tokenizer(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


@functools.cache
def backend(name: str, model_dir: Path, vocab_size: int = VOCAB) -> Any:
    return create_backend(name, tokenizer(model_dir), vocab_size)


@functools.cache
def token_bytes(model_dir: Path) -> list[bytes]:
    """Each token's bytes as the grammar sees them."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer(model_dir), vocab_size=VOCAB)
    return list(info.decoded_vocab)


def allowed(bitmask_row: torch.Tensor) -> list[int]:
    """The token ids whose bit is set in one bitmask row."""
    words = bitmask_row.to(torch.int64) & 0xFFFFFFFF
    bits = (words.unsqueeze(-1) >> torch.arange(32)) & 1
    return torch.nonzero(bits.reshape(-1)).reshape(-1).tolist()


_CLOSERS = (b'"', b"}", b"]", b")")


def generate(be: Any, compiled: Any, model_dir: Path, rng: random.Random, *,
             free_steps: int = 8, max_steps: int = 300,
             check_end: Callable[[str], None] | None = None) -> str:
    """Random allowed tokens until EOS is taken (always once allowed after `free_steps`);
    then prefer closing tokens and a token after which EOS is allowed, so it ends.

    `check_end(text)` runs whenever EOS is allowed (the grammar says the text may end).
    Returns the text (strict UTF-8) of the accepted tokens; the matcher must terminate.
    """
    eos = tokenizer(model_dir).eos_token_id
    vocab = token_bytes(model_dir)
    matcher = be.matcher(compiled)
    mask = allocate_bitmask(1, be.vocab_size)
    scratch = allocate_bitmask(1, be.vocab_size)
    out: list[int] = []
    for step in range(max_steps):
        mask.fill_(-1)
        matcher.fill_bitmask(mask, 0)
        ids = allowed(mask[0])
        assert ids, f"no token allowed after {out}"
        assert max(ids) < min(be.vocab_size, len(vocab))
        text = b"".join(vocab[t] for t in out)
        if eos in ids:
            decoded = text.decode("utf-8")  # strict: a complete match is whole characters
            if check_end is not None:
                check_end(decoded)
            if step >= free_steps or len(ids) == 1 or rng.random() < 0.2:
                assert matcher.accept_token(eos)
                assert matcher.is_terminated()
                return decoded
        ids = [t for t in ids if t != eos]
        token = rng.choice(ids) if step < free_steps else _finishing(matcher, ids, vocab, scratch,
                                                                    eos, rng)
        assert not matcher.is_terminated()
        assert matcher.accept_token(token), token
        out.append(token)
    raise AssertionError(f"no end within {max_steps} tokens: {b''.join(vocab[t] for t in out)!r}")


def _finishing(matcher: Any, ids: list[int], vocab: list[bytes], scratch: torch.Tensor,
               eos: int, rng: random.Random) -> int:
    # Closing a string first, then a bracket, ends any JSON; the exact one-byte token first.
    for closer in _CLOSERS:
        exact = [t for t in ids if vocab[t] == closer]
        if exact:
            ids = exact
            break
    else:
        for closer in _CLOSERS:
            closing = [t for t in ids if closer in vocab[t]]
            if closing:
                ids = closing
                break
    for token in rng.sample(ids, min(len(ids), 12)):
        assert matcher.accept_token(token)
        scratch.fill_(-1)
        matcher.fill_bitmask(scratch, 0)
        matcher.rollback(1)
        if (int(scratch[0, eos // 32]) >> (eos % 32)) & 1:
            return token
    return rng.choice(ids)


def reference_mask(be: Any, compiled: Any, prefix: list[int], vocab_size: int) -> torch.Tensor:
    """The slow reference: a fresh matcher of the backend (for xgrammar an `xgr.GrammarMatcher`)
    stepped one token at a time through `prefix`, then offered every token in turn; a token's
    bit is set when the matcher accepts it."""
    mask = torch.zeros((1, (vocab_size + 31) // 32), dtype=torch.int64)
    base = be.matcher(compiled)
    for token in prefix:
        assert base.accept_token(token)
    for token in range(vocab_size):
        if base.accept_token(token):
            base.rollback(1)
            mask[0, token // 32] |= 1 << (token % 32)
    return mask.to(torch.int32)
