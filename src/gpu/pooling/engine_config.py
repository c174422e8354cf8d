"""Which runner an engine serves, and what the pooling runner asks of the engine's settings.

Called at the edge (`EngineArgs.create_engine_config`) once the model is read: `--runner`,
`--convert` and the older `--task` choose between generation and pooling (auto: pooling for
encoders, `*ForSequenceClassification` and sentence-transformers layouts, as vLLM), the
pooler is resolved from `--pooler-config` and the checkpoint's files
(`ringserve.gpu.pooling.layout`), and `adjust` returns the engine settings a pooling model
needs: the longest input (sentence-transformers' `max_seq_length` unless `--max-model-len`
says otherwise; XLM-RoBERTa's positions start past its padding index), one context slot more
than that for the one token a pooling request asks of the scheduler's books and never
samples, no chunked prefill and no prefix cache for an encoder (its attention sees the whole
input at once), and no prefix cache for a decoder pooled over more than its last token.
No torch here: this runs in the frontend's process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringserve.config import CacheConfig, ModelConfig, PoolerConfig, SchedulerConfig
from ringserve.gpu.pooling.layout import (
    is_pooling_checkpoint,
    resolve_pooler_config,
    sentence_transformers_max_seq_length,
)

__all__ = ["CONVERTS", "RUNNERS", "TASKS", "PoolingSettings", "pooling_settings"]

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's older `--task` spellings: generate, or a pooling task and the convert it implies.
TASKS = {"auto": None, "generate": None, "embed": "embed", "embedding": "embed",
         "classify": "classify", "score": "classify", "reward": None}


@dataclass(frozen=True, slots=True)
class PoolingSettings:
    """A pooling runner's configuration and the engine settings it implies.

    Attributes:
        pooler: the resolved pooler.
        max_input_len: the longest input, in tokens (the model's length as users see it).
        model_config: the model, with `max_model_len` one past `max_input_len`.
    """

    pooler: PoolerConfig
    max_input_len: int
    model_config: ModelConfig

    def cache_config(self, cache: CacheConfig) -> CacheConfig:
        """`cache` with the prefix cache off where pooling cannot reuse it."""
        reuse = not self.pooler.encoder and self.pooler.pooling_type == "LAST"
        if cache.enable_prefix_caching and not reuse:
            return dataclasses.replace(cache, enable_prefix_caching=False)
        return cache

    def scheduler_config(self, sched: SchedulerConfig) -> SchedulerConfig:
        """`sched` with an encoder's inputs run whole: no chunked prefill, a budget that
        holds the longest input."""
        if not self.pooler.encoder:
            return sched
        budget = max(sched.max_num_batched_tokens, self.model_config.max_model_len)
        return dataclasses.replace(sched, enable_chunked_prefill=False,
                                   max_num_batched_tokens=budget,
                                   max_model_len=self.model_config.max_model_len,
                                   long_prefill_token_threshold=0)


def pooling_settings(model_config: ModelConfig, *, runner: str, convert: str, task: str | None,
                     override: str | dict[str, Any] | None,
                     user_max_model_len: int | None) -> PoolingSettings | None:
    """The pooling runner's settings, or None when the engine generates text.

    Args:
        model_config: the model as read (its `max_model_len` from the user or the config).
        runner: "auto", "generate" or "pooling".
        convert: "auto", "none", "embed" or "classify".
        task: vLLM's older `--task` (None or "auto": unset).
        override: `--pooler-config` (a dict, or its JSON text).
        user_max_model_len: `--max-model-len` as given (None: not given).

    Raises:
        ValueError: an unknown runner, convert or task; a pooling-only model asked to
            generate; a bad `--pooler-config` (naming `pooler_config.<key>`).
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner: got {runner!r}, allowed: {', '.join(RUNNERS)}")
    if convert not in CONVERTS:
        raise ValueError(f"convert: got {convert!r}, allowed: {', '.join(CONVERTS)}")
    if task is not None and task not in TASKS:
        raise ValueError(f"task: got {task!r}, allowed: {', '.join(TASKS)}")
    if task == "reward":
        raise ValueError("task: reward models are not supported (allowed: auto, generate, "
                         "embed, classify, score)")
    path = Path(model_config.model)
    arch = model_config.architecture
    task_convert = TASKS.get(task or "auto")
    wants_pooling = (runner == "pooling" or task_convert is not None
                     or convert in ("embed", "classify"))
    pooling_only = arch.endswith("ForSequenceClassification") or arch.endswith("Model")
    if runner == "generate" or task == "generate":
        if pooling_only:
            raise ValueError(f"runner: {arch} is a pooling model (embeddings, classification "
                             "and scores); it cannot generate text (use --runner pooling)")
        return None
    if not wants_pooling and not (runner == "auto" and is_pooling_checkpoint(path, arch)):
        return None
    chosen = convert if convert in ("embed", "classify") else task_convert
    pooler = resolve_pooler_config(path, model_config.hf_config, arch, convert=chosen,
                                   override=_parse_override(override))
    longest = _max_input_len(model_config, path, user_max_model_len)
    pooler = dataclasses.replace(pooler, max_input_len=longest)
    model_config = dataclasses.replace(model_config, max_model_len=longest + 1)
    if not pooler.encoder:
        if pooler.convert == "classify" and not arch.endswith("ForSequenceClassification"):
            raise ValueError(f"convert: classify needs a classification head; {arch} has none "
                             "(allowed: embed; a decoder classifier is a "
                             "*ForSequenceClassification checkpoint)")
        # A decoder embedder's LM head is never used: tied to the embeddings, the checkpoint
        # need not carry one (Qwen3-Embedding's does not).
        model_config = dataclasses.replace(
            model_config, hf_config={**model_config.hf_config, "tie_word_embeddings": True})
    return PoolingSettings(pooler=pooler, max_input_len=longest, model_config=model_config)


def _parse_override(override: str | dict[str, Any] | None) -> dict[str, Any] | None:
    if override is None or isinstance(override, dict):
        return override
    import json

    try:
        value = json.loads(override)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--pooler-config: not JSON ({exc.msg} at character {exc.pos}); "
                         'allowed: an object such as {"pooling_type": "MEAN", '
                         '"normalize": true}') from None
    if not isinstance(value, dict):
        raise ValueError("--pooler-config: allowed: a JSON object such as "
                         '{"pooling_type": "MEAN", "normalize": true}')
    return value


def _max_input_len(model_config: ModelConfig, path: Path,
                   user_max_model_len: int | None) -> int:
    """The longest input: the user's `--max-model-len`, else sentence-transformers'
    `max_seq_length`, never past the model's positions."""
    hf = model_config.hf_config
    positions = model_config.max_model_len
    if str(hf.get("model_type", "")).startswith("xlm-roberta") or "Roberta" in \
            model_config.architecture:
        # Positions start past the padding index (`padding_idx + 1`).
        positions = int(hf.get("max_position_embeddings", positions)) - \
            int(hf.get("pad_token_id", 1)) - 1
    if user_max_model_len is not None:
        if user_max_model_len > positions:
            raise ValueError(f"max_model_len: got {user_max_model_len}, allowed: 1..{positions} "
                             "(the model's positions)")
        return user_max_model_len
    seq = sentence_transformers_max_seq_length(path)
    if seq is None and (path / "modules.json").is_file():
        # sentence-transformers >= 6 keeps it as the tokenizer's `model_max_length`.
        seq = _tokenizer_max_length(path)
    return min(positions, seq) if seq else positions


def _tokenizer_max_length(path: Path) -> int | None:
    """`model_max_length` of the tokenizer config (None: absent, or transformers' "no
    limit" sentinel)."""
    import json

    try:
        value = json.loads((path / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value < 1 << 30:
        return value
    return None
