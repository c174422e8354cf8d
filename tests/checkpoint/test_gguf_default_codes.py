"""A quantized GGUF file is served from its codes by default (issue 48, item 4), as vLLM serves
GGUF files: with no flags a Q4_1 file's linears and LM head load on int4 panels and a Q8_0
file's on int8 panels, each holding exactly the file's codes; a mixed file puts each layer on
the panels its tensors' types ask for (float tensors float); greedy output equals explicit
`--quantization int4`'s; the weights take about the file's bytes instead of 4x and more;
`--gguf-dequantize` gives the float32 model; one start-up line says what was chosen and why;
on CUDA (where the panels do not run) the default stays the dequantized model."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf_export import export_gguf

from ringserve.checkpoint import gguf_codes, precision
from ringserve.checkpoint.gguf_header import read_header
from ringserve.config import ModelConfig
from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.layers import quant
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.layers.vocab_embedding import ParallelLMHead
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.native.panel import PanelWeight
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.testing import tiny_model
from ringserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu"))  # runner_driver

Q = gguf.GGMLQuantizationType
LOGGER = "ringserve.checkpoint.precision"
needs_panels = pytest.mark.skipif(panel_native.load_library() is None,
                                  reason="no C compiler with OpenMP")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (untied head) as Q4_1 and Q8_0 (every 2-D weight), an F16 one, and a
    tied Qwen2 mixing types as llama-quantize's mixes do: Q4_1 linears, a Q5_0 v projection
    (no panels of its own) fused with Q4_1 q and k, an F16 down projection, a Q8_0 tied
    embedding / LM head."""
    out = tmp_path_factory.mktemp("gguf-default")
    llama = tiny_model("llama")
    return {
        "q4_1": export_gguf(llama, out / "llama-Q4_1.gguf", qtype=Q.Q4_1),
        "q8_0": export_gguf(llama, out / "llama-Q8_0.gguf", qtype=Q.Q8_0),
        "f16": export_gguf(llama, out / "llama-F16.gguf", qtype=Q.F16),
        "mixed": export_gguf(tiny_model("qwen2"), out / "qwen2-mixed.gguf", qtype=Q.Q4_1,
                             types={"blk.0.attn_v.weight": Q.Q5_0,
                                    "blk.1.ffn_down.weight": Q.F16,
                                    "token_embd.weight": Q.Q8_0}),
    }


@pytest.fixture(autouse=True)
def _fresh_announcements(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own start-up lines (they are logged once per process)."""
    monkeypatch.setattr(precision, "_announced", set())


def _runner(path: Path, backend: str = "torch", **flags: object) -> ModelRunner:
    config = EngineArgs(model=str(path), max_model_len=64, max_num_seqs=4, device="cpu",
                        block_size=8, **flags).create_engine_config()  # type: ignore[arg-type]
    runner = ModelRunner(config, torch.device("cpu"), attention_backend=backend)  # type: ignore[arg-type]
    runner.load_model()
    return runner


def _panels(runner: ModelRunner) -> dict[str, ColumnParallelLinear | RowParallelLinear
                                          | ParallelLMHead]:
    return {name: m for name, m in runner.model.named_modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear | ParallelLMHead)}


def _panel_bytes(runner: ModelRunner) -> int:
    total = 0
    for layer in _panels(runner).values():
        panel = layer.panel
        assert panel is not None
        total += panel.nbytes()
    return total


def _file_bytes(path: Path) -> int:
    """Bytes of the file's 2-D tensors that the panels hold (every one but the embedding of
    an untied model)."""
    return sum(int(t.n_bytes or 0) for t in read_header(path).tensors
               if len(t.shape) == 2 and t.name != "token_embd.weight")


@pytest.mark.slow
@needs_panels
@pytest.mark.parametrize(("name", "fmt"), [("q4_1", "int4"), ("q8_0", "int8g")])
def test_quantized_files_load_on_their_panels_with_no_flags(
        name: str, fmt: str, files: dict[str, Path]) -> None:
    """Every linear and the LM head hold the file's codes as they are: their panels
    dequantize bit for bit to the float model's weights from the same file."""
    runner, floats = _runner(files[name]), _runner(files[name], gguf_dequantize=True)
    assert runner.model_config.quantization == "gguf"
    assert floats.model_config.quantization is None
    layers, reference = _panels(runner), _panels(floats)
    assert layers.keys() == reference.keys() and "lm_head" in layers
    for layer_name, layer in layers.items():
        panel, want = layer.panel, reference[layer_name].panel
        assert panel is not None and panel.format == fmt, layer_name
        assert layer.rows_as_is == panel.out_features, layer_name
        assert want is not None and want.format == "f32", layer_name
        got = quant.dequantize(quant.unpack(panel))
        assert torch.equal(got, panel_native.unpack_f32(want)), layer_name


@pytest.mark.slow
@needs_panels
def test_the_weights_take_about_the_files_bytes(files: dict[str, Path]) -> None:
    """int4 panels hold a weight in 4 bits plus a float32 scale and min per 32 (0.75 bytes)
    against Q4_1's 0.625, and the padding of the last panel: within 1.3x of the file. The
    float model takes 4 bytes a weight (6.4x)."""
    path = files["q4_1"]
    coded, floats = _runner(path), _runner(path, gguf_dequantize=True)
    file_bytes = _file_bytes(path)
    assert _panel_bytes(coded) <= 1.3 * file_bytes, (_panel_bytes(coded), file_bytes)
    assert _panel_bytes(floats) >= 4 * file_bytes, (_panel_bytes(floats), file_bytes)


@pytest.mark.slow
@needs_panels
def test_a_mixed_file_puts_each_layer_on_the_panels_its_types_ask_for(
        files: dict[str, Path]) -> None:
    runner = _runner(files["mixed"])
    floats = _panels(_runner(files["mixed"], gguf_dequantize=True))
    layers = _panels(runner)
    formats = {name: (layer.panel.format if layer.panel is not None else None, layer.rows_as_is)
               for name, layer in layers.items()}
    qkv = runner.model_config.num_attention_heads * 16 + 2 * runner.model_config.num_kv_heads * 16
    assert formats == {
        # Q5_0 v fused with Q4_1 q and k: the most precise part's int8, every row rounded
        # (per group of 32, as Q5_0's own scales are).
        "model.layers.0.self_attn.qkv_proj": ("int8g", 0),
        "model.layers.0.self_attn.o_proj": ("int4", 64),
        "model.layers.0.mlp.gate_up_proj": ("int4", 256),
        "model.layers.0.mlp.down_proj": ("int4", 64),
        "model.layers.1.self_attn.qkv_proj": ("int4", qkv),
        "model.layers.1.self_attn.o_proj": ("int4", 64),
        "model.layers.1.mlp.gate_up_proj": ("int4", 256),
        "model.layers.1.mlp.down_proj": ("f32", 0),  # F16 in the file: float
        "lm_head": ("int8g", 8000),  # the tied Q8_0 embedding's codes
    }
    down, want = layers["model.layers.1.mlp.down_proj"].panel, floats[
        "model.layers.1.mlp.down_proj"].panel
    assert down is not None and want is not None
    assert torch.equal(panel_native.unpack_f32(down), panel_native.unpack_f32(want))
    qkv_panel, qkv_float = layers["model.layers.0.self_attn.qkv_proj"].panel, floats[
        "model.layers.0.self_attn.qkv_proj"].panel
    assert qkv_panel is not None and qkv_float is not None
    exact = panel_native.unpack_f32(qkv_float)
    step = exact.reshape(exact.shape[0], -1, 32).abs().amax(-1) / 127  # per group of 32
    error = (quant.dequantize(quant.unpack(qkv_panel)) - exact).abs().reshape(step.shape[0], -1, 32)
    assert bool((error <= step[..., None] / 2 + 1e-7).all())


@pytest.mark.slow
@needs_panels
def test_greedy_output_equals_explicit_int4(files: dict[str, Path]) -> None:
    """The default and `--quantization int4` hold the same codes (LM head included), so
    they generate the same tokens with the same logprobs, through the captured decode step."""
    from runner_driver import ToyScheduler

    outputs = []
    for flags in ({}, {"quantization": "int4"}):
        runner = _runner(files["q4_1"], backend="cpu", **flags)
        runner.initialize_kv_cache(64)
        assert runner.capture is not None, runner.capture_reason
        assert runner.capture.info.weight_formats == ("int4",)
        sched = ToyScheduler(runner, budget=16)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
        for i in range(3):
            sched.add(f"r{i}", [5 + i, 17, 99 + 7 * i, 4, 250, 31], greedy, 12)
        sched.run()
        outputs.append({rid: (req.output, [lp.logprobs[0] for lp in req.logprobs])
                        for rid, req in sched.done.items()})
    assert outputs[0] == outputs[1]


def test_dequantize_flag_and_its_conflicts(files: dict[str, Path]) -> None:
    path = str(files["q4_1"])
    assert ModelConfig.from_model_dir(path).quantization == "gguf"
    assert ModelConfig.from_model_dir(path, gguf_dequantize=True).quantization is None
    assert ModelConfig.from_model_dir(path, quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match="gguf_dequantize: asks for float weights, and "
                                         "quantization int4 for int4 panels"):
        ModelConfig.from_model_dir(path, quantization="int4", gguf_dequantize=True)
    # A float file has no codes: float32, as before, and nothing to dequantize.
    assert ModelConfig.from_model_dir(str(files["f16"])).quantization is None


def test_gguf_quantization_is_for_gguf_files(tiny_llama_dir: Path) -> None:
    """`--quantization gguf` (vLLM's name) is a GGUF file's default; a safetensors
    checkpoint has no codes to serve."""
    with pytest.raises(ValueError, match=r"quantization: gguf serves a GGUF file from its "
                                         r"codes; .* is not a GGUF file"):
        ModelConfig.from_model_dir(str(tiny_llama_dir), quantization="gguf")


def test_on_cuda_the_default_stays_the_dequantized_model(files: dict[str, Path],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The int4 / int8 panels are CPU kernels: on CUDA the file is dequantized, as before,
    and the start-up line says why (the config is read without a GPU)."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = ModelConfig.from_model_dir(str(files["q4_1"]), device="cuda")
    assert config.quantization is None and config.dtype == "float32"
    assert _info(caplog) == [
        "dtype float32 (the checkpoint's dtype (cuda)); weights float32, dequantized from the "
        "GGUF file's Q4_1 blocks: the int4 / int8 panels that serve a GGUF file from its "
        "codes run on CPU only (device cuda)"]
    with pytest.raises(ValueError, match="runs on CPU only"):
        ModelConfig.from_model_dir(str(files["q4_1"]), device="cuda", quantization="gguf")


def _info(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.INFO]


def test_the_startup_line_names_the_format_and_why_once(
        files: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(2):  # a second config in the same process logs nothing again
            ModelConfig.from_model_dir(str(files["q4_1"]))
        ModelConfig.from_model_dir(str(files["mixed"]))
        ModelConfig.from_model_dir(str(files["q4_1"]), gguf_dequantize=True)
        ModelConfig.from_model_dir(str(files["q4_1"]), quantization="int8")
        ModelConfig.from_model_dir(str(files["f16"]))
    default = ("a quantized GGUF file is served from its codes by default, as vLLM does "
               "(--gguf-dequantize for float weights)")
    assert _info(caplog) == [
        "dtype float32 (the checkpoint's dtype); weights int4 panels from the file's Q4_1 "
        "codes (14 tensors); the LM head on int4 panels from the file's Q4_1 codes; embedding "
        f"lookups and norms float32: {default}",
        "dtype float32 (the checkpoint's dtype); weights int4 panels from the file's Q4_1 "
        "codes (10 tensors); int8 panels rounded from Q4_1 (2 tensors, fused with a more "
        "precise part); int8 panels rounded from Q5_0 (1 tensor); float32 from F16 (1 tensor); "
        "the LM head on int8 panels from the file's Q8_0 codes; embedding lookups and norms "
        f"float32: {default}",
        "dtype float32 (the checkpoint's dtype); weights float32, dequantized from the GGUF "
        "file's Q4_1 blocks: --gguf-dequantize",
        "dtype float32 (the checkpoint's dtype); weights int8 panels rounded from Q4_1 (14 "
        "tensors); the LM head on int8 panels rounded from Q4_1; embedding lookups and norms "
        "float32: --quantization int8",
        "dtype float32 (the checkpoint's dtype); weights float32, from the GGUF file's F16 "
        "tensors",
    ]


def test_the_layer_rule() -> None:
    """Per tensor: Q4_* codes int4, Q8_0 int8, other quantized types int8 (rounded), floats
    float; a fused layer takes its most precise part's."""
    assert [gguf_codes.panel_method(t) for t in ("Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q6_K",
                                                 "Q5_0", "F16", "BF16", "F32", None)] == [
        "int4", "int4", "int4", "int8", "int8", "int8", None, None, None, None]
    assert gguf_codes.layer_method(["Q4_K", "Q4_K", "Q6_K"]) == "int8"
    assert gguf_codes.layer_method(["Q4_K", "Q4_K", "Q4_K"]) == "int4"
    assert gguf_codes.layer_method(["Q8_0", "F16"]) is None
    assert gguf_codes.layer_method([]) is None


def test_cli_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--gguf-dequantize"]))
    assert args.gguf_dequantize and args.quantization is None
    assert EngineArgs.from_cli_args(parser.parse_args(["-q", "gguf"])).quantization == "gguf"
    assert not EngineArgs.from_cli_args(parser.parse_args([])).gguf_dequantize


def test_panel_bytes_helper_counts_scales_and_mins() -> None:
    weight = torch.randn(20, 64, generator=torch.Generator().manual_seed(0))
    panel: PanelWeight = quant.quantize(weight, "int4")
    # 2 panels of 16 channels: 64 / 2 bytes of codes and 2 x 2 float32 per channel.
    assert panel.nbytes() == 2 * 16 * (32 + 2 * 2 * 4)


@pytest.mark.slow
@needs_panels
def test_a_tied_embedding_reads_the_heads_codes(files: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The mixed file's tied Q8_0 embedding: the LM head's int8g panels hold every row as the
    file's codes, so the lookups read them there and no float32 table is kept (the memory
    target: weights within 1.3x of the file). The products are the ones the dequantized
    table held: greedy tokens and logprobs through the captured decode step equal those of
    the same model keeping its float rows."""
    from runner_driver import ToyScheduler

    def run() -> tuple[ModelRunner, dict[str, object]]:
        runner = _runner(files["mixed"], backend="cpu")
        runner.initialize_kv_cache(64)
        assert runner.capture is not None, runner.capture_reason
        sched = ToyScheduler(runner, budget=16)
        greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)
        for i in range(3):
            sched.add(f"r{i}", [5 + i, 17, 99 + 7 * i, 4, 250, 31], greedy, 12)
        sched.run()
        return runner, {rid: (req.output, [lp.logprobs[0] for lp in req.logprobs])
                        for rid, req in sched.done.items()}

    runner, tied = run()
    embed, head = runner.model.model.embed_tokens, runner.model.lm_head  # type: ignore[union-attr]
    assert embed.panel_rows is head.panel and embed.weight.numel() == 0
    ids = torch.tensor([0, 1, 17, 7999])
    original = ParallelLMHead.tie_panels

    def float_rows(self: ParallelLMHead, embedding: object) -> None:
        if self.panel is not None and self.panel.format == "f32":
            original(self, embedding)  # type: ignore[arg-type]

    monkeypatch.setattr(ParallelLMHead, "tie_panels", float_rows)
    untied_runner, untied = run()
    untied_embed = untied_runner.model.model.embed_tokens  # type: ignore[union-attr]
    assert untied_embed.panel_rows is None and untied_embed.weight.numel() > 0
    assert torch.equal(embed(ids), untied_embed(ids))
    assert tied == untied
