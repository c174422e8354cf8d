"""Per-request input checks the worker can make before a request touches the batch.

The engine core may call `validate_request` before scheduling (it raises a clear ValueError);
the model runner calls it again for every new request and fails only that request when it
does not pass, so one bad request never takes the batch or the worker down.
"""

from __future__ import annotations

import numpy as np

from ringserve.config import ModelConfig
from ringserve.sampling_params import SamplingParams


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, config: ModelConfig
) -> None:
    """Check a request against the model's limits.

    Raises:
        ValueError: an empty or too long prompt, a token id outside the vocabulary, or
            sampling parameters outside the model's limits (too many logprobs, ...).
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt_token_ids: got an empty prompt, allowed: at least one token")
    if n > config.max_model_len:
        raise ValueError(
            f"prompt_token_ids: got {n} tokens, allowed: at most max_model_len={config.max_model_len}"
        )
    ids = np.asarray(prompt_token_ids, dtype=np.int64)
    bad = ids[(ids < 0) | (ids >= config.vocab_size)]
    if bad.size:
        raise ValueError(
            f"prompt_token_ids: token id {int(bad[0])} is outside the vocabulary, "
            f"allowed: 0..{config.vocab_size - 1}"
        )
    params.verify_for_model(vocab_size=config.vocab_size, max_logprobs=config.max_logprobs)
