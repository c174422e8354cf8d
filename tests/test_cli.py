"""`ringserve` command line: help, demo-model, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ringserve.cli import main


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ringserve.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_help_lists_commands() -> None:
    proc = _run("--help")
    assert proc.returncode == 0
    assert "demo-model" in proc.stdout and "bench" in proc.stdout


@pytest.mark.slow
def test_demo_model_writes_a_loadable_directory(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    proc = _run("demo-model", str(target), "--preset", "llama")
    assert proc.returncode == 0, proc.stderr
    for name in ("config.json", "model.safetensors", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json"):
        assert (target / name).is_file(), name
    again = _run("demo-model", str(target))
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"ringserve: error: {target} exists and is not empty; pass a new or empty directory"
    ]
    assert "Traceback" not in again.stderr


def test_bad_flag_is_one_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo-model", "/tmp/x", "--preset", "gpt5"])
    assert info.value.code == 2
    assert "invalid choice: 'gpt5'" in capsys.readouterr().err
