"""`--speculative-config`: parsing, resolution against the target, and one clear error per
mistake, from `resolve_speculative_config`, `EngineArgs`, `LLM(...)` and the CLI."""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

import ringserve.gpu.spec_decode.config as spec_config
from ringserve.cli import main
from ringserve.config import EngineConfig, ModelConfig
from ringserve.engine.arg_utils import EngineArgs
from ringserve.errors import ModelDirectoryError
from ringserve.gpu.spec_decode.config import (
    SpecDecodeConfig,
    SpeculativeConfig,
    parse_speculative_config,
    resolve_speculative_config,
)


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> ModelConfig:
    return ModelConfig.from_model_dir(str(tiny_llama_dir), device="cpu")


def _resolve(value: Any, target: ModelConfig, tp: int = 1) -> SpecDecodeConfig | None:
    return resolve_speculative_config(value, target=target, tensor_parallel_size=tp)


# -- parsing ---------------------------------------------------------------------------------


def test_off_when_absent_or_blank(target: ModelConfig) -> None:
    assert parse_speculative_config(None) is None
    assert parse_speculative_config("  ") is None
    assert _resolve(None, target) is None
    assert _resolve("", target) is None


def test_ngram_defaults_are_vllms(target: ModelConfig) -> None:
    spec = _resolve('{"method": "ngram"}', target)
    assert spec == SpecDecodeConfig(method="ngram", num_speculative_tokens=4,
                                    prompt_lookup_min=5, prompt_lookup_max=5,
                                    draft_model_config=None, draft_tensor_parallel_size=1)
    assert not spec.uses_draft_model


@pytest.mark.parametrize(("given", "window"), [
    ({"prompt_lookup_max": 3}, (3, 3)),
    ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4)),
])
def test_ngram_window(given: dict[str, int], window: tuple[int, int],
                      target: ModelConfig) -> None:
    spec = _resolve({"method": "ngram", "num_speculative_tokens": 2, **given}, target)
    assert spec is not None and spec.num_speculative_tokens == 2
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == window


def test_per_batch_size_schedule_is_vllms_list(target: ModelConfig) -> None:
    schedule = [[17, 512, 0], [1, 8, 3], [9, 16, 1]]
    spec = _resolve({"method": "ngram", "num_speculative_tokens": 3,
                     "num_speculative_tokens_per_batch_size": schedule}, target)
    assert spec is not None and spec.per_batch_size == ((1, 3), (9, 1), (17, 0))


def test_struct_passes_through_and_is_frozen() -> None:
    spec = SpeculativeConfig(method="ngram")
    assert parse_speculative_config(spec) is spec
    with pytest.raises(AttributeError):
        spec.method = "draft_model"  # type: ignore[misc]


BATCH = "speculative_config.num_speculative_tokens_per_batch_size"


@pytest.mark.parametrize(("value", "start"), [
    ('{"method": "medusa"}', "speculative_config.method: got 'medusa', unknown method; "
     "allowed: ngram, draft_model, eagle, eagle3"),
    ('{"method": "eagle3"}', "speculative_config.model: required with method 'eagle3' (the "
     "EAGLE head's directory)"),
    ('{"method": "eagle", "model": "x", "quantization": "int4"}',
     "speculative_config.quantization: not used by method 'eagle'"),
    ('{"num_speculative_tokens": 2}', "speculative_config.method: required"),
    ('{"method": "ngram", "lookahead": 2}', "speculative_config: unknown key `lookahead`; "
     "allowed keys: method, "),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens: got 0, allowed: 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": 17}',
     "speculative_config.num_speculative_tokens: got 17, allowed: 1..16"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}',
     "speculative_config.num_speculative_tokens: Expected `int | null`, got `str`"),
    ('{"method": "ngram", "model": "/m"}',
     "speculative_config.model: not used by method 'ngram'"),
    ('{"method": "ngram", "quantization": "int4"}',
     "speculative_config.quantization: not used by method 'ngram'"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 1}',
     "speculative_config.draft_tensor_parallel_size: not used by method 'ngram'"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "speculative_config.prompt_lookup_min: got 4, allowed: <= prompt_lookup_max (2)"),
    ('{"method": "ngram", "prompt_lookup_max": 0}',
     "speculative_config.prompt_lookup_max: got 0, allowed: >= 1"),
    ('{"method": "draft_model"}', "speculative_config.model: required with method "
     "'draft_model'"),
    ('{"method": "draft_model", "model": "/m", "prompt_lookup_max": 3}',
     "speculative_config.prompt_lookup_max: not used by method 'draft_model'"),
    ('{"method": "draft_model", "model": "/m", "quantization": "gguf"}',
     "speculative_config.quantization: got 'gguf', allowed: None"),
    ('{"method": "draft_model", "model": "/m", "draft_tensor_parallel_size": 0}',
     "speculative_config.draft_tensor_parallel_size: got 0, allowed: >= 1"),
    ('{"method": "draft_model", "model": "/m", "max_model_len": 0}',
     "speculative_config.max_model_len: got 0, allowed: >= 1"),
    ('{"method": "ngram", "num_speculative_tokens_per_batch_size": [[2, 8, 1]]}',
     f"{BATCH}: the first range starts at batch 2, allowed: 1"),
    ('{"method": "ngram", "num_speculative_tokens_per_batch_size": [[1, 8, 5]]}',
     f"{BATCH}: got entry [1, 8, 5], allowed: k in 0..4"),
    ('{"method": "ngram", "num_speculative_tokens_per_batch_size": [[1, 8, 1], [4, 9, 0]]}',
     f"{BATCH}: got entry [4, 9, 0], allowed: batch-size ranges that do not overlap"),
    ('{"method": "ngram", "num_speculative_tokens_per_batch_size": [[1, 8, 1, 64, 2]]}',
     f"{BATCH}: got entry [1, 8, 1, 64, 2], allowed: [first_batch, last_batch, k]"),
    ('{"method": "ngram", "num_speculative_tokens_per_batch_size": []}',
     f"{BATCH}: got [], allowed"),
    ('{"method": "ngram", "num_speculative_tokens_per_batch_size": {"1": 2}}',
     f"{BATCH}: Expected `array | null`, got `object`"),
    ("{method: ngram}", "--speculative-config is not valid JSON"),
    ('["ngram"]', "speculative_config: Expected `object`, got `array`"),
])
def test_bad_input_names_the_key(value: str, start: str) -> None:
    for form in (value, _as_dict(value)):
        if form is None:
            continue
        with pytest.raises(ValueError) as info:
            parse_speculative_config(form)
        assert str(info.value).startswith(start), str(info.value)


def _as_dict(value: str) -> dict[str, Any] | None:
    try:
        decoded = json.loads(value)
    except json.JSONDecodeError:
        return None
    return decoded if isinstance(decoded, dict) else None


def test_wrong_type() -> None:
    with pytest.raises(ValueError, match=r"^speculative_config: expected JSON text or a dict"):
        parse_speculative_config(4)  # type: ignore[arg-type]


# -- resolution against the target -----------------------------------------------------------


def test_target_as_its_own_int4_draft(target: ModelConfig, tiny_llama_dir: Path,
                                      caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec_config, "_announced", set())
    with caplog.at_level(logging.INFO, logger=spec_config.__name__):
        spec = _resolve({"method": "draft_model", "model": str(tiny_llama_dir),
                         "quantization": "int4", "num_speculative_tokens": 3}, target)
    assert spec is not None and spec.uses_draft_model
    draft = spec.draft_model_config
    assert draft is not None and draft.quantization == "int4"
    assert draft.dtype == target.dtype and draft.max_model_len == target.max_model_len
    assert spec.num_speculative_tokens == 3 and spec.draft_tensor_parallel_size == 1
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (0, 0)
    lines = [r.getMessage() for r in caplog.records if r.name == spec_config.__name__]
    assert lines == [f"speculative decoding: draft_model {draft.weights} (int4 panels), "
                     f"3 draft tokens"]


@pytest.mark.parametrize(("target_tp", "draft_tp", "expected"), [
    (1, None, 1), (2, None, 2), (2, 1, 1), (2, 2, 2), (4, 1, 1),
])
def test_draft_tensor_parallel_size(target_tp: int, draft_tp: int | None, expected: int,
                                    target: ModelConfig, tiny_llama_dir: Path) -> None:
    spec = _resolve({"method": "draft_model", "model": str(tiny_llama_dir),
                     "draft_tensor_parallel_size": draft_tp}, target, tp=target_tp)
    assert spec is not None and spec.draft_tensor_parallel_size == expected


@pytest.mark.parametrize(("target_tp", "draft_tp"), [(1, 3), (1, 2), (4, 2)])
def test_draft_tensor_parallel_size_is_one_or_the_targets(
        target_tp: int, draft_tp: int, target: ModelConfig, tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError) as info:
        _resolve({"method": "draft_model", "model": str(tiny_llama_dir),
                  "draft_tensor_parallel_size": draft_tp}, target, tp=target_tp)
    assert str(info.value) == (
        f"speculative_config.draft_tensor_parallel_size: got {draft_tp}, allowed: 1 or the "
        f"target's tensor_parallel_size ({target_tp})")


def test_draft_max_model_len(target: ModelConfig, tiny_llama_dir: Path) -> None:
    spec = _resolve({"method": "draft_model", "model": str(tiny_llama_dir),
                     "max_model_len": 256}, target)
    assert spec is not None and spec.draft_model_config is not None
    assert spec.draft_model_config.max_model_len == 256
    with pytest.raises(ValueError, match=r"^speculative_config.max_model_len: got 4096, "
                                         r"allowed: 1..2048 \(the target's max_model_len\)"):
        _resolve({"method": "draft_model", "model": str(tiny_llama_dir),
                  "max_model_len": 4096}, target)


def test_draft_shorter_than_the_target(target: ModelConfig, tmp_path: Path,
                                       tiny_llama_dir: Path) -> None:
    draft = _copy(tiny_llama_dir, tmp_path / "short", config={"max_position_embeddings": 512})
    with pytest.raises(ValueError, match=r"^speculative_config.model: the draft .* is shorter "
                                         r"than the target's max_model_len 2048"):
        _resolve({"method": "draft_model", "model": str(draft)}, target)


def test_missing_draft_is_a_model_directory_error(target: ModelConfig, tmp_path: Path) -> None:
    with pytest.raises(ModelDirectoryError) as info:
        _resolve({"method": "draft_model", "model": str(tmp_path / "nope")}, target)
    assert str(info.value).startswith("speculative_config.model: ")
    assert str(tmp_path / "nope") in str(info.value)


def test_draft_quantization_follows_the_device(target: ModelConfig,
                                               tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"^speculative_config.quantization: int8 runs on CPU "
                                         r"only \(device is cuda\)"):
        resolve_speculative_config({"method": "draft_model", "model": str(tiny_llama_dir),
                                    "quantization": "int8"}, target=target,
                                   tensor_parallel_size=1, device="cuda")


def _copy(model: Path, to: Path, *, config: dict[str, Any] | None = None,
          tokenizer_config: dict[str, Any] | None = None) -> Path:
    shutil.copytree(model, to)
    for name, changes in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if changes:
            data = json.loads((to / name).read_text())
            data.update(changes)
            (to / name).write_text(json.dumps(data))
    return to


def test_draft_with_another_vocab_size(target: ModelConfig, tmp_path: Path,
                                       tiny_llama_dir: Path) -> None:
    draft = _copy(tiny_llama_dir, tmp_path / "d", config={"vocab_size": 8064})
    with pytest.raises(ValueError) as info:
        _resolve({"method": "draft_model", "model": str(draft)}, target)
    assert str(info.value) == (
        "speculative_config.model: the draft's vocabulary differs from the target's "
        "(vocab_size 8064 in the draft's config, 8000 in the target's); the draft must use "
        "the target's tokenizer")


def test_draft_with_other_token_texts(target: ModelConfig, tmp_path: Path,
                                      tiny_llama_dir: Path) -> None:
    draft = _copy(tiny_llama_dir, tmp_path / "d")
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    first, second = by_id[300], by_id[301]
    vocab[first], vocab[second] = 301, 300  # the two texts trade ids
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError) as info:
        _resolve({"method": "draft_model", "model": str(draft)}, target)
    message = str(info.value)
    assert message.startswith("speculative_config.model: the draft's vocabulary differs from "
                              "the target's (2 token ids have other texts, e.g. id 300 is "), \
        message


def test_draft_with_another_bos(target: ModelConfig, tmp_path: Path,
                                tiny_llama_dir: Path) -> None:
    draft = _copy(tiny_llama_dir, tmp_path / "d", tokenizer_config={"bos_token": "<|pad|>"})
    with pytest.raises(ValueError, match=r"^speculative_config.model: the draft's vocabulary "
                                         r"differs from the target's \(bos_token_id 2 in the "
                                         r"draft, 0 in the target\)"):
        _resolve({"method": "draft_model", "model": str(draft)}, target)


def test_copied_draft_has_the_same_vocabulary(target: ModelConfig, tmp_path: Path,
                                              tiny_llama_dir: Path) -> None:
    draft = _copy(tiny_llama_dir, tmp_path / "d")
    spec = _resolve({"method": "draft_model", "model": str(draft)}, target)
    assert spec is not None and spec.draft_model_config is not None
    assert spec.draft_model_config.model == str(draft)


# -- EngineArgs, the wire, LLM(...) -----------------------------------------------------------


def test_engine_config_carries_it_and_round_trips(tiny_llama_dir: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu",
                      speculative_config={"method": "draft_model", "model": str(tiny_llama_dir),
                                          "quantization": "int8",
                                          "num_speculative_tokens_per_batch_size": [[1, 4, 4],
                                                                                    [5, 64, 2]]})
    with caplog.at_level(logging.INFO, logger="ringserve.engine.arg_utils"):
        config = args.create_engine_config()
    spec = config.speculative_config
    assert spec is not None and spec.draft_model_config is not None
    assert spec.draft_model_config.quantization == "int8"
    assert spec.per_batch_size == ((1, 4), (5, 2))
    assert config.scheduler_config.async_scheduling is False
    assert any("synchronous scheduling" in r.getMessage() for r in caplog.records)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    assert wire == config


def test_speculation_off_keeps_async_scheduling(tiny_llama_dir: Path) -> None:
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu").create_engine_config()
    assert config.speculative_config is None and config.scheduler_config.async_scheduling
    ngram = EngineArgs(model=str(tiny_llama_dir), device="cpu", async_scheduling=False,
                       speculative_config='{"method": "ngram"}').create_engine_config()
    assert ngram.speculative_config is not None
    assert ngram.speculative_config.method == "ngram"


def test_engine_args_verify_names_the_key_before_reading_the_model(tmp_path: Path) -> None:
    args = EngineArgs(model=str(tmp_path / "no-model"),
                      speculative_config='{"method": "ngram", "num_speculative_tokens": 17}')
    with pytest.raises(ValueError) as info:
        args.verify()
    message = str(info.value)
    assert message.startswith("--speculative-config: speculative_config.")
    assert "speculative_config.num_speculative_tokens: got 17, allowed: 1..16" in message


def test_engine_args_missing_draft_stays_a_model_directory_error(tiny_llama_dir: Path,
                                                                 tmp_path: Path) -> None:
    args = EngineArgs(model=str(tiny_llama_dir), device="cpu",
                      speculative_config={"method": "draft_model",
                                          "model": str(tmp_path / "nope")})
    with pytest.raises(ModelDirectoryError, match=r"^speculative_config.model: "):
        args.create_engine_config()


def _children() -> set[int]:
    """This process's child processes (Linux /proc)."""
    me = str(os.getpid())
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            found.add(int(stat.parent.name))
    return found


@pytest.mark.parametrize(("value", "needle"), [
    ({"method": "eagle3"}, "speculative_config.model: required with method 'eagle3'"),
    ({"method": "ngram", "num_speculative_tokens": 0},
     "speculative_config.num_speculative_tokens: got 0"),
    ({"method": "draft_model", "model": "MODEL", "draft_tensor_parallel_size": 3},
     "speculative_config.draft_tensor_parallel_size: got 3"),
])
def test_llm_refuses_before_starting_anything(value: dict[str, Any], needle: str,
                                              tiny_llama_dir: Path) -> None:
    from ringserve import LLM

    value = {k: str(tiny_llama_dir) if v == "MODEL" else v for k, v in value.items()}
    before = _children()
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama_dir), device="cpu", speculative_config=value)
    assert info.value.__class__ is ValueError
    assert str(info.value).startswith("--speculative-config: speculative_config.")
    assert needle in str(info.value)
    assert _children() <= before


# -- the command line ------------------------------------------------------------------------


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    """`ringserve serve` in its own session; afterwards no process of that session is left."""
    proc = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "serve", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


SMALL = ("--device", "cpu", "--port", "0", "--kv-cache-memory", "16MiB")


def test_cli_bad_config_is_one_line_and_exit_two(tiny_llama_dir: Path) -> None:
    proc = _serve(str(tiny_llama_dir), *SMALL, "--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 17}')
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringserve: error: --speculative-config: speculative_config.")
    assert "speculative_config.num_speculative_tokens: got 17, allowed: 1..16" in lines[0]


@pytest.mark.slow  # a fresh interpreter reading the target
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_cli_missing_draft_exits_one(method: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    proc = _serve(str(tiny_llama_dir), *SMALL, "--speculative-config",
                  json.dumps({"method": method, "model": str(missing)}))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    # The target's start-up lines (its dtype) are INFO records; the rest is the error line.
    lines = [ln for ln in proc.stderr.strip().splitlines() if " INFO " not in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ringserve: error: speculative_config.model: ")
    assert str(missing) in lines[0]


@pytest.mark.parametrize("flags", [["--speculative-model", "/m"],
                                   ["--num-speculative-tokens", "4"]])
def test_vllm_removed_flags_point_at_speculative_config(
        flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "m", *flags])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"ringserve: error: {flags[0]} is not supported: vLLM replaced "
                               f"it with --speculative-config")


def test_cli_takes_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from ringserve.cli import parse_command_line

    ns = parse_command_line(["serve", "m", "--speculative-config", '{"method": "ngram"}'])
    assert EngineArgs.from_cli_args(ns).speculative_config == '{"method": "ngram"}'


def test_module_imports_no_torch() -> None:
    # ringserve.engine.arg_utils imports it: it must stay light (transformers only on use).
    tree = ast.parse(Path(spec_config.__file__).read_text())
    for node in tree.body:  # top level only
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            assert name.split(".")[0] not in ("torch", "transformers"), name
