"""Per-request input checks the worker makes before a request touches the batch.

The frontend and the scheduler's admission have already refused bad requests by the same
rules (the prompt length is `ringserve.prompt_length`'s everywhere); this is the worker's own
line of defence against a peer that skipped them. The model runner calls `validate_request`
for every new request and fails only that request when it does not pass, so one bad request
never takes the batch or the worker down.
"""

from __future__ import annotations

import numpy as np

from ringserve.config import ModelConfig
from ringserve.prompt_length import check_prompt_length
from ringserve.sampling_params import SamplingParams


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, config: ModelConfig
) -> None:
    """Check a request against the model's limits.

    Raises:
        ValueError: an empty prompt or one that leaves no room for a generated token
            (`ringserve.prompt_length`), a token id outside the vocabulary, or sampling
            parameters outside the model's limits (too many logprobs, ...).
    """
    check_prompt_length(len(prompt_token_ids), config.max_model_len)
    ids = np.asarray(prompt_token_ids, dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise ValueError(
            f"prompt_token_ids: token id {int(bad[0])} is outside the vocabulary, "
            f"allowed: 0..{config.vocab_size - 1}"
        )
    params.verify_for_model(vocab_size=config.vocab_size, max_logprobs=config.max_logprobs)
