"""The compute dtype a checkpoint is served in and the start-up line that says why (issue 48,
item 4; `ringserve.checkpoint.precision`): `--dtype auto` serves a bf16 checkpoint on CPU,
native bf16 or not, with float32 compute around its weights kept in bf16 panels (item 3);
`--dtype bfloat16` on a CPU without native
bf16 serves with one warning naming the missing feature. The CPU's flags are injected
(`precision.cpu_flags`), so both branches run on any machine."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ringserve.checkpoint import precision
from ringserve.config import ModelConfig

NATIVE = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
PLAIN = frozenset({"avx2", "avx512f"})
LOGGER = "ringserve.checkpoint.precision"


@pytest.fixture(autouse=True)
def _fresh_announcements(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own lines (they are logged once per process)."""
    monkeypatch.setattr(precision, "_announced", set())


@pytest.fixture
def bf16_dir(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """The tiny Llama with a config.json that says bfloat16 (its dtype is all `auto` reads)."""
    out = tmp_path / "bf16"
    shutil.copytree(tiny_llama_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config))
    return out


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_cpu_flags_come_from_proc_cpuinfo(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n"
                   "flags\t\t: fpu avx2 avx512_bf16\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert precision.cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert precision.cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert precision.cpu_flags(tmp_path / "missing") == frozenset()
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert precision.native_bf16_features() == ("amx_bf16",)
    assert precision.cpu_has_native_bf16()
    monkeypatch.setattr(precision, "cpu_flags", lambda: PLAIN)
    assert not precision.cpu_has_native_bf16()


@pytest.mark.parametrize("flags", [NATIVE, PLAIN], ids=["native-bf16", "no-bf16"])
def test_auto_serves_a_bf16_checkpoint_in_float32_on_cpu(
        flags: frozenset[str], bf16_dir: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Native bf16 or not: float32 compute, the weights in bf16 panels (widening a bf16
    weight needs no bf16 instructions); one line says so."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = ModelConfig.from_model_dir(str(bf16_dir))
        ModelConfig.from_model_dir(str(bf16_dir))  # a second config: no second line
    assert config.dtype == "float32" and config.quantization is None
    assert config.weight_format == "bf16"
    [line] = _lines(caplog, logging.INFO)
    assert line == (
        "dtype float32 (--dtype auto computes in float32 on CPU around the checkpoint's "
        "bfloat16 weights, kept in bf16 panels: half the bytes a token reads, float32 "
        "products; --dtype bfloat16 for bf16 activations); weights bf16 panels for the "
        "linears and the LM head (the checkpoint's own bf16 values; a tied embedding reads "
        "its rows there); norms and the KV cache float32")
    assert not _lines(caplog, logging.WARNING)


def test_auto_on_cuda_keeps_the_checkpoints_dtype(bf16_dir: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = ModelConfig.from_model_dir(str(bf16_dir), device="cuda")
    assert config.dtype == "bfloat16"
    assert _lines(caplog, logging.INFO) == [
        "dtype bfloat16 (the checkpoint's dtype (cuda)); weights bfloat16"]


def test_bfloat16_without_native_bf16_serves_with_one_warning(
        bf16_dir: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_flags", lambda: PLAIN)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(2):
            config = ModelConfig.from_model_dir(str(bf16_dir), dtype="bfloat16")
    assert config.dtype == "bfloat16"
    [warning] = _lines(caplog, logging.WARNING)
    assert warning.startswith("--dtype bfloat16: this CPU lacks avx512_bf16 and amx_bf16 (no "
                              "native bf16 in /proc/cpuinfo)")
    assert "serving bf16 anyway" in warning
    assert _lines(caplog, logging.INFO) == [
        "dtype bfloat16 (--dtype bfloat16: bf16 activations and KV cache on torch's bf16 "
        "matmuls; --dtype auto keeps a bf16 checkpoint's weights in bf16 panels around "
        "float32 compute, 2-3x faster decode measured); weights bfloat16"]


def test_bfloat16_with_native_bf16_warns_nothing(bf16_dir: Path, caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "cpu_flags", lambda: NATIVE)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert ModelConfig.from_model_dir(str(bf16_dir), dtype="bfloat16").dtype == "bfloat16"
        # Not on CUDA either, whatever the CPU.
        monkeypatch.setattr(precision, "cpu_flags", lambda: PLAIN)
        ModelConfig.from_model_dir(str(bf16_dir), dtype="bfloat16", device="cuda")
    assert not _lines(caplog, logging.WARNING)


def test_float32_and_quantized_safetensors_lines(tiny_llama_dir: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        ModelConfig.from_model_dir(str(tiny_llama_dir))
        ModelConfig.from_model_dir(str(tiny_llama_dir), quantization="int8")
    assert _lines(caplog, logging.INFO) == [
        "dtype float32 (the checkpoint's dtype); weights float32",
        "dtype float32 (the checkpoint's dtype); weights int8 panels, rounded from the "
        "checkpoint's floats at load: --quantization int8",
    ]


def test_float16_checkpoint_runs_in_float32_on_cpu(bf16_dir: Path) -> None:
    config = json.loads((bf16_dir / "config.json").read_text())
    config["dtype"] = "float16"
    (bf16_dir / "config.json").write_text(json.dumps(config))
    dtype, why = precision.resolve_dtype("auto", config, "cpu")
    assert dtype == "float32" and "float16 in float32 on CPU" in why
    assert precision.resolve_dtype("auto", config, "cuda") == (
        "float16", "the checkpoint's dtype (cuda)")
    with pytest.raises(ValueError, match="dtype: got 'int8', allowed: auto, float32"):
        precision.resolve_dtype("int8", config, "cpu")
