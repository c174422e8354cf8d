"""`ringserve serve` takes published `vllm serve` command lines: the recorded corpus, vLLM's
short flags and human-readable integers, `--config` YAML files, flags with no effect, refused
flags, VLLM_API_KEY and the exit statuses (2: flags, 1: the model directory)."""

from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from ringserve import envs
from ringserve.cli import exit_status, main, parse_command_line
from ringserve.engine.arg_utils import EngineArgs, human_readable_int, human_readable_int_or_auto
from ringserve.engine.errors import EngineStartupError
from ringserve.errors import ModelDirectoryError
from ringserve.http.cli_args import check_serve_args, settings_from_args
from ringserve.vllm_flags import NO_EFFECT, no_effect_lines

CORPUS = Path(__file__).parent / "data" / "vllm_serve_commands.txt"
_LAUNCHERS = (["vllm", "serve"], ["python", "-m", "vllm.entrypoints.openai.api_server"],
              ["python3", "-m", "vllm.entrypoints.openai.api_server"])


@dataclass
class Published:
    """One recorded command line."""

    source: str
    line: str
    expect_error: str | None

    def argv(self) -> list[str]:
        """The line as `ringserve serve` arguments (environment and `uv run` dropped)."""
        tokens = shlex.split(self.line)
        while tokens and ("=" in tokens[0] and not tokens[0].startswith("-")):
            tokens.pop(0)  # VAR=value before the command
        if tokens[:2] == ["uv", "run"]:
            tokens = tokens[2:]
        for launcher in _LAUNCHERS:
            if tokens[:len(launcher)] == launcher:
                return ["serve", *tokens[len(launcher):]]
        raise AssertionError(f"not a vllm serve command line: {self.line}")


def _corpus() -> list[Published]:
    entries: list[Published] = []
    source: str | None = None
    expect: str | None = None
    for raw in CORPUS.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("# source: "):
            source, expect = line.removeprefix("# source: "), None
        elif line.startswith("# expect-error: "):
            expect = line.removeprefix("# expect-error: ")
        elif line and not line.startswith("#"):
            assert source is not None, f"no source line before: {line}"
            entries.append(Published(source, line, expect))
            source = expect = None
    return entries


def _checked(argv: list[str]) -> argparse.Namespace:
    """Parse as `ringserve` does and run every flag check that needs no model."""
    ns = parse_command_line(argv)
    EngineArgs.from_cli_args(ns).verify()
    check_serve_args(ns)
    return ns


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of a command line that must fail (status 2)."""
    capsys.readouterr()
    try:
        _checked(argv)
    except SystemExit as exc:
        assert exc.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ringserve: error: "), lines
        return lines[0]
    except ValueError as exc:  # main prints it as one line and exits 2
        return f"ringserve: error: {exc}"
    raise AssertionError(f"accepted: {argv}")


def test_published_command_lines_parse(capsys: pytest.CaptureFixture[str]) -> None:
    entries = _corpus()
    assert all(e.source.startswith("https://") for e in entries)
    accepted = [e for e in entries if e.expect_error is None]
    assert len(accepted) >= 30, len(accepted)
    for entry in accepted:
        _checked(entry.argv())
    for entry in entries:
        if entry.expect_error is not None:
            line = _usage_error(entry.argv(), capsys)
            assert entry.expect_error in line, (entry.line, line)


def test_vllm_short_flags_and_spellings() -> None:
    ns = _checked(["serve", "m", "-tp", "4", "-dp", "2", "-pp", "1", "-asc", "2", "-O3",
                   "--max_model_len", "8k", "--served-model-name", "a", "b",
                   "--kv-cache-memory-bytes", "2G", "--disable-log-requests",
                   "--uvicorn-log-level", "warning", "--max-log-len", "100"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.tensor_parallel_size, args.data_parallel_size) == (4, 2)
    assert args.max_model_len == 8000 and args.kv_cache_memory == 2 << 30
    assert args.served_model_names() == ("a", "b")
    assert args.enable_log_requests is False
    assert ns.api_server_count == 2  # -asc is served now (issue 19)
    assert [line.split(" has ")[0] for line in no_effect_lines(ns)] == [
        "ringserve: --compilation-config", "ringserve: --max-log-len"]


def test_quantization_flag_takes_int8_and_int4() -> None:
    assert EngineArgs.from_cli_args(_checked(["serve", "m"])).quantization is None
    assert EngineArgs.from_cli_args(_checked(["serve", "m", "-q", "int8"])).quantization == "int8"
    ns = _checked(["serve", "m", "--quantization", "int4"])
    assert EngineArgs.from_cli_args(ns).quantization == "int4"


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1m", 1_000_000),
    ("1M", 1 << 20), ("2g", 2_000_000_000), ("1G", 1 << 30), (" 8k ", 8000)])
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


def test_human_readable_int_errors_and_auto(capsys: pytest.CaptureFixture[str]) -> None:
    assert human_readable_int_or_auto("auto") == human_readable_int_or_auto("-1") == -1
    for bad in ("2.5K", "32x", "k", "-5", ""):
        with pytest.raises(ValueError, match="not an integer"):
            human_readable_int(bad)
    line = _usage_error(["serve", "--max-model-len", "2.5K"], capsys)
    assert "--max-model-len" in line and "2.5k" in line


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_config_file_flags_and_cli_wins(tmp_path: Path) -> None:
    config = _write(tmp_path / "serve.yaml", """
model: from-file
port: 9000
max_model_len: 16k
served-model-name: [alpha, beta]
--enable-prefix-caching: false
enforce_eager: true
max-seq-len-to-capture: 8192
trust-remote-code: false
allowed-origins: ["https://a.example"]
override-generation-config: {temperature: 0.5}
seed: null
""")
    ns = _checked(["serve", "--config", config, "--port", "8001"])
    assert ns.port == 8001  # the command line wins
    assert ns.model == "from-file" and ns.max_model_len == 16_000
    assert ns.served_model_name == ["alpha", "beta"]
    assert ns.enable_prefix_caching is False
    assert ns.allowed_origins == [["https://a.example"]]
    assert ns.override_generation_config == '{"temperature": 0.5}'
    assert ns.enforce_eager is True
    assert [line.split(" has ")[0] for line in no_effect_lines(ns)] == [
        "ringserve: --max-seq-len-to-capture"]  # trust-remote-code: false is no request to note
    ns = _checked(["serve", "positional-model", f"--config={config}",
                   "--served-model-name", "gamma", "--enable-prefix-caching"])
    args = EngineArgs.from_cli_args(ns)
    assert args.model == "positional-model"  # as vLLM: MODEL on the command line wins
    assert args.served_model_names() == ("gamma",) and args.enable_prefix_caching is True


def test_config_file_errors_name_the_file(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.yaml")
    assert "--config " + missing + ": cannot read the file" in _usage_error(
        ["serve", "--config", missing], capsys)
    broken = _write(tmp_path / "broken.yaml", "port: [8000\n")
    assert f"--config {broken}: not valid YAML" in _usage_error(
        ["serve", "--config", broken], capsys)
    listed = _write(tmp_path / "list.yaml", "- port\n")
    assert f"--config {listed}: expected a mapping" in _usage_error(
        ["serve", "--config", listed], capsys)
    bad_value = _write(tmp_path / "bad.yaml", "port: eighty\n")
    line = _usage_error(["serve", "--config", bad_value], capsys)
    assert line.startswith(f"ringserve: error: --config {bad_value}: argument --port")
    unknown = _write(tmp_path / "unknown.yaml", "no-such-flag: 1\n")
    line = _usage_error(["serve", "--config", unknown], capsys)
    assert f"--config {unknown}: unrecognized arguments: --no-such-flag=1" in line
    refused = _write(tmp_path / "refused.yaml", "kv_cache_dtype: fp8\n")
    assert "--kv-cache-dtype fp8 is not supported" in _usage_error(
        ["serve", "--config", refused], capsys)


@pytest.mark.parametrize(("flags", "expected"), [
    (["--quantization", "awq"], "argument --quantization/-q: 'awq' is not supported: ringserve "
     "quantizes float weights at load (weight-only, CPU); supported: int8, int4"),
    (["-q", "fp8"], "argument --quantization/-q: 'fp8' is not supported"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported: the KV cache is kept "
     "in the model's dtype; supported: auto"),
    (["--pipeline-parallel-size", "2"], "supported: 1"),
    (["--speculative-model", "d"],
     "--speculative-model is not supported: vLLM replaced it with --speculative-config"),
    (["--max-loras", "two"], "argument --max-loras: invalid int value"),
    (["--tokenizer-mode", "mistral"], "supported: auto, hf"),
    (["--task", "transcription"], "argument --task: invalid choice: 'transcription'"),
    (["--runner", "draft"], "argument --runner: invalid choice: 'draft'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--distributed-executor-backend", "external_launcher"], "invalid choice"),
])
def test_refused_flags_exit_2_naming_them(flags: list[str], expected: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "m", *flags])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringserve: error: "), lines
    assert expected in lines[0]


def test_allowed_values_of_refusing_flags_pass() -> None:
    ns = _checked(["serve", "m", "--kv-cache-dtype", "auto", "--task", "generate",
                   "--tokenizer-mode", "auto", "-pp", "1", "--config-format", "hf"])
    assert not no_effect_lines(ns)


def test_every_no_effect_flag_is_one_line() -> None:
    for entry in NO_EFFECT:
        argv = ["serve", entry.flags[0], *(["1"] if entry.takes_value else [])]
        lines = no_effect_lines(_checked(argv))
        assert lines == [f"ringserve: {entry.flags[0]} has no effect here ({entry.reason})"]


@pytest.mark.slow
def test_model_directory_problem_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "no-config"
    empty.mkdir()
    with caplog.at_level(logging.INFO, logger="ringserve.cli"):
        status = main(["serve", str(empty), "--max-seq-len-to-capture", "8192", "--device",
                       "cpu"])
    assert status == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and str(empty) in lines[0] and "config.json" in lines[0], lines
    assert "Traceback" not in lines[0]
    notes = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert notes == ["ringserve: --max-seq-len-to-capture has no effect here (ringserve "
                     "captures decode steps by batch size (--cuda-graph-sizes); a captured "
                     "step reads any sequence length)"]


def test_exit_status_split() -> None:
    assert exit_status(ModelDirectoryError("/m: config.json is missing")) == 1
    assert exit_status(EngineStartupError(  # the loader's error, from an engine core
        "engine core failed to start: ModelDirectoryError: /m/model.safetensors: truncated")) == 1
    # An engine that failed to start for another reason is not a user mistake: 1 (issue 45).
    assert exit_status(EngineStartupError("engine core failed to start: RuntimeError: x")) == 1
    assert exit_status(EngineStartupError("engine core 0 exited with signal 9 before its "
                                          "handshake")) == 1
    # A setting the core found cannot work is the user's mistake: 2.
    assert exit_status(EngineStartupError(
        "engine core failed to start: ValueError: the KV cache gets 10 bytes but one block "
        "needs 4096")) == 2
    assert exit_status(ValueError("--port: got 70000")) == 2
    assert exit_status(OSError("cannot listen on 127.0.0.1:8000")) == 2


def test_bad_flag_value_exits_2_before_the_model_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path / "absent"), "--metrics-prefix", "9bad"]) == 2
    assert "--metrics-prefix: got '9bad'" in capsys.readouterr().err
    assert main(["serve", str(tmp_path / "absent"), "--root-path", "llm"]) == 2
    assert "--root-path: got 'llm'" in capsys.readouterr().err


def test_vllm_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RINGSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert envs.api_key() is None
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")
    assert envs.api_key() == "sk-vllm"
    monkeypatch.setenv("RINGSERVE_API_KEY", "sk-ringserve")
    assert envs.api_key() == "sk-ringserve"  # ringserve's own name wins


@pytest.mark.slow
def test_vllm_command_line_builds_the_configs(tiny_llama_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RINGSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")
    ns = _checked(["serve", str(tiny_llama_dir), "--max-model-len", "auto", "--device", "cpu",
                   "--served-model-name", "first", "second", "--kv-cache-memory-bytes", "16M",
                   "--root-path", "/llm/", "--allowed-origins", '["https://a.example"]',
                   "https://b.example", "--allow-credentials", "--metrics-prefix", "vllm",
                   "--timeout-keep-alive", "30"])
    engine_config = EngineArgs.from_cli_args(ns).create_engine_config()
    assert engine_config.model_config.max_model_len == 2048  # config.json's
    assert engine_config.model_config.served_model_name == "first"  # metrics use the first
    assert engine_config.cache_config.kv_cache_memory == 16 << 20
    settings = settings_from_args(ns, engine_config)
    assert settings.served_model_names == ("first", "second")
    assert settings.api_key == "sk-vllm"
    assert settings.root_path == "/llm"
    assert settings.allowed_origins == ("https://a.example", "https://b.example")
    assert settings.allowed_methods == settings.allowed_headers == ("*",)
    assert settings.allow_credentials and settings.metrics_prefix == "vllm"
    assert settings.timeout_keep_alive == 30.0  # hypercorn's keep_alive_timeout
