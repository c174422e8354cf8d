"""The runner choice and the engine settings pooling implies (`ringserve.gpu.pooling.engine_config`
through `EngineArgs.create_engine_config`): auto-detection, the flags' refusals, the model's
length, and the cache and scheduler settings of encoders and decoder embedders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringserve import EngineArgs
from ringserve.gpu.pooling.testing import cross_encoder, decoder_embedding_model, embedding_model
from ringserve.gpu.testing import tiny_model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pooling-config")
    return {
        "bert": embedding_model(root / "bert", max_seq_length=48),
        "cross": cross_encoder(root / "cross"),
        "last": decoder_embedding_model(root / "last", "lasttoken"),
        "mean": decoder_embedding_model(root / "mean", "mean"),
    }


def test_an_encoder_is_pooled_whole_with_no_prefix_cache(models: dict[str, Path]) -> None:
    config = EngineArgs(model=str(models["bert"])).create_engine_config()
    pooler = config.pooler_config
    assert pooler is not None and pooler.encoder and pooler.convert == "embed"
    assert (pooler.pooling_type, pooler.normalize) == ("MEAN", True)
    # sentence-transformers' max_seq_length is the longest input; the context has one slot
    # more for the token a pooling request books and never samples.
    assert pooler.max_input_len == 48
    assert config.model_config.max_model_len == 49
    assert not config.cache_config.enable_prefix_caching
    sched = config.scheduler_config
    assert not sched.enable_chunked_prefill and sched.max_num_batched_tokens >= 49


def test_max_model_len_sets_the_longest_input_within_the_positions(
        models: dict[str, Path]) -> None:
    config = EngineArgs(model=str(models["bert"]), max_model_len=100).create_engine_config()
    assert config.pooler_config is not None and config.pooler_config.max_input_len == 100
    with pytest.raises(ValueError, match="max_model_len"):
        EngineArgs(model=str(models["bert"]), max_model_len=1000).create_engine_config()


def test_a_cross_encoder_classifies(models: dict[str, Path]) -> None:
    config = EngineArgs(model=str(models["cross"])).create_engine_config()
    assert config.pooler_config is not None
    assert config.pooler_config.convert == "classify"
    config = EngineArgs(model=str(models["cross"]), task="score").create_engine_config()
    assert config.pooler_config is not None and config.pooler_config.convert == "classify"


def test_decoder_embedders_keep_chunked_prefill_and_the_prefix_cache_for_last_pooling(
        models: dict[str, Path]) -> None:
    last = EngineArgs(model=str(models["last"])).create_engine_config()
    assert last.pooler_config is not None and not last.pooler_config.encoder
    assert last.pooler_config.pooling_type == "LAST"
    assert last.cache_config.enable_prefix_caching
    assert last.scheduler_config.enable_chunked_prefill
    mean = EngineArgs(model=str(models["mean"])).create_engine_config()
    assert mean.pooler_config is not None and mean.pooler_config.pooling_type == "MEAN"
    # Every token's hidden state is pooled: a prefix-cache hit would skip some.
    assert not mean.cache_config.enable_prefix_caching


def test_pooler_config_overrides_the_model_files(models: dict[str, Path]) -> None:
    config = EngineArgs(model=str(models["bert"]), pooler_config=json.dumps(
        {"pooling_type": "cls", "normalize": False})).create_engine_config()
    assert config.pooler_config is not None
    assert (config.pooler_config.pooling_type, config.pooler_config.normalize) == ("CLS", False)


@pytest.mark.parametrize(("args", "message"), [
    ({"runner": "generate"}, "is a pooling model"),
    ({"task": "generate"}, "is a pooling model"),
    ({"runner": "sideways"}, "runner: got 'sideways'"),
    ({"convert": "reward"}, "convert: got 'reward'"),
    ({"pooler_config": "{not json"}, "--pooler-config: not JSON"),
    ({"pooler_config": '{"pooling_kind": "CLS"}'}, "pooler_config.pooling_kind"),
    ({"speculative_config": {"method": "ngram"}}, "cannot speculate"),
])
def test_bad_pooling_flags_name_themselves(models: dict[str, Path], args: dict[str, object],
                                           message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(models["bert"]), **args).create_engine_config()  # type: ignore[arg-type]


def test_a_causal_lm_generates_unless_asked_to_pool() -> None:
    model = str(tiny_model("qwen3"))
    assert EngineArgs(model=model).create_engine_config().pooler_config is None
    config = EngineArgs(model=model, runner="pooling").create_engine_config()
    assert config.pooler_config is not None and config.pooler_config.pooling_type == "LAST"
    with pytest.raises(ValueError, match="classif"):
        EngineArgs(model=model, convert="classify").create_engine_config()
