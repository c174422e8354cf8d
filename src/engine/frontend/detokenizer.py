"""Incremental detokenization and stop strings for one request (frontend side).

The output processor keeps one `IncrementalDetokenizer` per request and feeds it the token ids
each engine step produced. Only new tokens are decoded, never the whole sequence again:

* fast tokenizers (a `tokenizers.Tokenizer` backend) use `tokenizers.decoders.DecodeStream`,
  prefilled with the last prompt ids so the first output token decodes in context (a leading
  space is kept); context that decodes to U+FFFD is left out (the stream would hand it back as
  output text); if the stream rejects the prompt as a prefix ("invalid prefix"), it is rebuilt
  from the output tokens alone;
* other tokenizers use the prefix/read-offset method over `convert_ids_to_tokens` and
  `convert_tokens_to_string` (honouring `spaces_between_special_tokens`).

Either way, a character whose UTF-8 bytes are split across tokens is held back until complete,
so a delta never carries half a character (U+FFFD appears only if the final text has it).
Stop strings are checked on the new text plus an overlap (`stop_strings.py`), not before
`min_tokens` tokens, and a streaming delta holds back `max(len(stop)) - 1` characters. A
multi-token step (speculative decoding) with stop strings is checked token by token, so it ends
where one-token steps would have: the tokens after the stop are dropped.
"""

from __future__ import annotations

from typing import Any

from ringserve.engine.frontend.stop_strings import find_stop_string, holdback_chars
from ringserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, step by step, and checks stop strings.

    Create with `IncrementalDetokenizer.for_request`; call `update` with each step's new
    token ids, then `text_delta` / `output_text` to read text out.

    Attributes:
        output_text: the text decoded so far (truncated at a stop string once matched).
        token_ids: every output token id seen so far (up to the one that completed the stop
            string, once one matched).
        stop_reason: the stop string that matched, if any.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.output_text = ""
        self.token_ids: list[int] = []
        self.stop_reason: str | None = None
        self._stops = params.stop_strings
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._holdback = holdback_chars(self._stops) if self._stops else 0
        self._sent = 0  # characters of output_text already handed out as deltas

    @staticmethod
    def for_request(
        tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        """The right detokenizer for `tokenizer` (fast path when it has a Rust backend).

        Args:
            tokenizer: a transformers tokenizer (or None when `params.detokenize` is False).
            prompt_token_ids: the prompt, for context of the first output tokens.
            params: the request's sampling parameters.
        """
        if tokenizer is None or not params.detokenize:
            return IncrementalDetokenizer(params)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and params.spaces_between_special_tokens:
            return FastIncrementalDetokenizer(backend, prompt_token_ids, params)
        return SlowIncrementalDetokenizer(tokenizer, prompt_token_ids, params)

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Decode the new tokens and check stop strings on the new text.

        Args:
            new_token_ids: tokens sampled this step.
            stop_terminated: the engine stopped the request on the last of them (EOS or a
                stop token id); that token's text is left out unless the request includes
                stop strings in its output.

        Returns:
            The stop string that matched (the text is truncated at it), or None. In a
            multi-token step it matches at the first token that completes one, and only that
            many of `new_token_ids` join `token_ids`: the caller drops the rest.
        """
        if not new_token_ids or self.stop_reason is not None:
            return self.stop_reason
        if len(new_token_ids) > 1:
            return self._update_many(new_token_ids, stop_terminated)
        # One token: the common step, kept straight-line.
        token_id = new_token_ids[0]
        token_ids = self.token_ids
        token_ids.append(token_id)
        if stop_terminated and not self._include_stop:
            return None  # no new text, so no stop string can complete
        text = self._decode_next(token_id)
        if not text:
            return None
        self.output_text += text
        if not self._stops or len(token_ids) < self._min_tokens:
            return None
        match = find_stop_string(self.output_text, len(text), self._stops, self._include_stop)
        if match is not None:
            self.stop_reason, cut = match
            self.output_text = self.output_text[:cut]
        return self.stop_reason

    def _update_many(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """A multi-token step (speculative decoding).

        With stop strings, one token at a time: the request ends exactly where one-token steps
        would have ended it (`min_tokens` counts per token, the stop string that completes
        first wins) and the tokens after the one that completed it stay out of `token_ids`.
        """
        if self._stops:
            last = len(new_token_ids) - 1
            for i, token_id in enumerate(new_token_ids):
                if self.update([token_id], stop_terminated and i == last) is not None:
                    break
            return self.stop_reason
        to_decode = new_token_ids
        if stop_terminated and not self._include_stop:
            to_decode = new_token_ids[:-1]
        token_ids = self.token_ids
        for token_id in to_decode:
            # Appended one by one: a decode stream rebuilt mid-step must start from the tokens
            # before this one (FastIncrementalDetokenizer._step).
            token_ids.append(token_id)
            self.output_text += self._decode_next(token_id)
        if len(to_decode) < len(new_token_ids):
            token_ids.append(new_token_ids[-1])
        return None

    def finish(self) -> None:
        """Flush characters still waiting for more bytes (the request ended mid-character).

        Idempotent; `text_delta(True)` and `visible_text(True)` call it.
        """
        if self.stop_reason is None:
            self.output_text += self._flush()

    def text_delta(self, finished: bool) -> str:
        """Text not handed out yet; while running, the stop-string hold-back stays back."""
        if finished:
            self.finish()
        end = len(self.output_text)
        if not finished and self._holdback:
            end = max(self._sent, end - self._holdback)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta

    def visible_text(self, finished: bool) -> str:
        """The cumulative text a caller may see now (hold-back excluded while running)."""
        if finished:
            self.finish()
        if finished or not self._holdback:
            return self.output_text
        return self.output_text[: max(0, len(self.output_text) - self._holdback)]

    def _decode_next(self, token_id: int) -> str:
        return ""

    def _flush(self) -> str:
        return ""


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """`tokenizers.decoders.DecodeStream` over the tokenizer's Rust backend."""

    def __init__(self, backend: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        super().__init__(params)
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip_special = params.skip_special_tokens
        self._stream_cls = DecodeStream
        context = _clean_context(backend, prompt_token_ids, self._skip_special)
        self._stream = DecodeStream(ids=context, skip_special_tokens=self._skip_special)
        self._pending: list[int] = []  # tokens the stream has not turned into text yet

    def _flush(self) -> str:
        pending, self._pending = self._pending, []
        if not pending:
            return ""
        return str(self._backend.decode(pending, skip_special_tokens=self._skip_special))

    def _decode_next(self, token_id: int) -> str:
        chunk = self._step(token_id)
        if chunk is None:
            self._pending.append(token_id)
            return ""
        self._pending.clear()
        return chunk

    def _step(self, token_id: int) -> str | None:
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as exc:
            if "invalid prefix" not in str(exc).lower():
                raise
            # The prompt does not decode as a prefix of prompt + output: restart the stream
            # from the output tokens seen so far (minus this one), without the prompt.
            self._stream = self._stream_cls(ids=self.token_ids[:-1] if self.token_ids else None,
                                            skip_special_tokens=self._skip_special)
            chunk = self._stream.step(self._backend, token_id)
        return None if chunk is None else str(chunk)


# Prompt tokens kept as context for the first output tokens (enough for a leading space and
# for multi-token characters).
_CONTEXT = 6


def _clean_context(backend: Any, prompt_token_ids: list[int], skip_special: bool) -> list[int]:
    """The last few prompt tokens, shortened from the left until they decode without U+FFFD.

    A context whose text holds a replacement character (a prompt given as token ids that ends,
    or a window that starts, inside a multi-byte character) makes the decode stream hand that
    context text back with the first output token: the output would start with prompt text.
    """
    context = list(prompt_token_ids[-_CONTEXT:])
    while context and _REPLACEMENT in backend.decode(context, skip_special_tokens=skip_special):
        del context[0]
    return context


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """Prefix/read offsets over `convert_ids_to_tokens` + `convert_tokens_to_string`."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        super().__init__(params)
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._spaces = params.spaces_between_special_tokens
        self._special_ids = set(tokenizer.all_special_ids)
        context = prompt_token_ids[-_CONTEXT:]
        self._tokens: list[str] = self._to_tokens(context)
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def _to_tokens(self, ids: list[int]) -> list[str]:
        if self._skip_special:
            ids = [i for i in ids if i not in self._special_ids]
        return list(self._tokenizer.convert_ids_to_tokens(ids))

    def _to_string(self, tokens: list[str]) -> str:
        if not self._spaces:
            return str(self._tokenizer.convert_tokens_to_string(tokens))
        # As HF slow tokenizers do: special tokens stand apart, joined by spaces.
        specials = set(self._tokenizer.all_special_tokens)
        parts: list[str] = []
        run: list[str] = []
        for tok in tokens:
            if tok in specials:
                if run:
                    parts.append(self._tokenizer.convert_tokens_to_string(run))
                    run = []
                parts.append(tok)
            else:
                run.append(tok)
        if run:
            parts.append(self._tokenizer.convert_tokens_to_string(run))
        return " ".join(parts)

    def _decode_next(self, token_id: int) -> str:
        self._tokens.extend(self._to_tokens([token_id]))
        prefix = self._to_string(self._tokens[self._prefix_offset:self._read_offset])
        full = self._to_string(self._tokens[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            return full[len(prefix):]
        return ""

    def _flush(self) -> str:
        if self._read_offset >= len(self._tokens):
            return ""
        prefix = self._to_string(self._tokens[self._prefix_offset:self._read_offset])
        full = self._to_string(self._tokens[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return full[len(prefix):]
