"""GGUF blocks loaded as they are under `--quantization int8` / `int4` (issue 17, item 4): the
block decoder against gguf-py's reference dequantizer (Q8_0, Q4_0, Q4_1, Q4_K), shards of the
codes, and a tiny Llama exported as Q8_0 / Q4_0 / Q4_1 whose panels hold exactly the file's
weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_export import export_gguf

from ringserve.checkpoint import gguf_codes
from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.layers import quant
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.testing import tiny_model

Q = gguf.GGMLQuantizationType


def _random_q4k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw Q4_K blocks with random codes and 6-bit scales and sane f16 d / dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(0.001, 0.01, (blocks.shape[0], 1)).astype(np.float16).view(
        np.uint8)
    blocks[:, 2:4] = rng.uniform(0.001, 0.01, (blocks.shape[0], 1)).astype(np.float16).view(
        np.uint8)
    return blocks.reshape(-1)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_decoded_codes_dequantize_exactly_as_gguf_py(qtype: gguf.GGMLQuantizationType) -> None:
    rows, cols = 6, 512
    if qtype == Q.Q4_K:  # gguf-py cannot quantize K-quants: random blocks
        raw = _random_q4k(rows, cols, 3)
    else:
        weight = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(weight, qtype).reshape(-1)
    blocks = gguf_codes.decode(raw, qtype.name, (rows, cols))
    assert blocks.scales.shape == (rows, cols // 32)
    if qtype == Q.Q8_0:
        assert blocks.method == "int8" and blocks.codes.dtype == torch.int8
        assert blocks.mins is None
    else:
        assert blocks.method == "int4" and blocks.codes.dtype == torch.uint8
        assert int(blocks.codes.max()) <= 15
        assert blocks.mins is not None and blocks.mins.shape == blocks.scales.shape
    want = gguf.quants.dequantize(raw.reshape(rows, -1), qtype)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.asarray(want, np.float32)))


def test_decode_refuses_other_types_and_sizes() -> None:
    with pytest.raises(ValueError, match="Q6_K blocks are kept as floats"):
        gguf_codes.decode(np.zeros(210, np.uint8), "Q6_K", (1, 256))
    with pytest.raises(ValueError, match="bytes of Q4_1"):
        gguf_codes.decode(np.zeros(19, np.uint8), "Q4_1", (1, 32))


def test_shards_of_the_codes() -> None:
    raw = gguf.quants.quantize(np.random.default_rng(2).standard_normal((8, 128)).astype(
        np.float32), Q.Q4_1).reshape(-1)
    blocks = gguf_codes.decode(raw, "Q4_1", (8, 128))
    full = blocks.dequantize()
    assert torch.equal(blocks.rows(2, 3).dequantize(), full[2:5])
    half = blocks.columns(64, 64)
    assert half is not None and torch.equal(half.dequantize(), full[:, 64:])
    assert blocks.columns(48, 64) is None  # a shard that splits a group of 32 keeps none


def _runner(path: Path, quantization: str | None, backend: str = "torch") -> ModelRunner:
    """The model of GGUF `path` with `quantization` (None: the float model, dequantized)."""
    config = EngineArgs(model=str(path), max_model_len=64, max_num_seqs=4, device="cpu",
                        quantization=quantization,
                        gguf_dequantize=quantization is None).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"), attention_backend=backend)  # type: ignore[arg-type]
    runner.load_model()
    return runner


def _linears(runner: ModelRunner) -> dict[str, ColumnParallelLinear | RowParallelLinear]:
    return {name: m for name, m in runner.model.named_modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear)}


@pytest.mark.skipif(panel_native.load_library() is None, reason="no C compiler with OpenMP")
@pytest.mark.parametrize(("qtype", "method", "fmt"), [
    (Q.Q4_0, "int4", "int4"), (Q.Q4_1, "int4", "int4"), (Q.Q8_0, "int8", "int8g")],
    ids=lambda v: getattr(v, "name", v))
def test_quantized_layers_keep_the_files_codes(qtype: gguf.GGMLQuantizationType, method: str,
                                               fmt: str, tmp_path: Path) -> None:
    """Every decoder linear of a quantized model from a file of the same method packs the
    file's codes: its panels dequantize bit for bit to the float model's weights from the
    same file (rounding the floats again moves Q4_0's weights, whose codes need not span
    0..15, and Q8_0's, whose scale is per 32 inputs, not per channel). The outputs of the
    layers agree to float32 rounding."""
    path = export_gguf(tiny_model("llama"), tmp_path / f"llama-{qtype.name}.gguf", qtype=qtype)
    floats, quantized = _runner(path, None), _runner(path, method)
    float_layers, layers = _linears(floats), _linears(quantized)
    assert float_layers.keys() == layers.keys() and float_layers
    for name, layer in layers.items():
        assert layer.panel is not None and layer.panel.format == fmt, name
        assert layer.rows_as_is == layer.panel.out_features, name
        reference = float_layers[name].panel
        assert reference is not None and reference.format == "f32"
        got = quant.dequantize(quant.unpack(layer.panel))
        assert torch.equal(got, panel_native.unpack_f32(reference)), name
    x = torch.randn(3, quantized.model_config.hidden_size,
                    generator=torch.Generator().manual_seed(0))
    for name, layer in layers.items():
        if layer.panel is not None and layer.panel.in_features == x.shape[1]:
            torch.testing.assert_close(layer(x), float_layers[name](x), atol=1e-4, rtol=1e-4)


def test_an_int8_layer_from_q8_0_takes_a_weight_update(tmp_path: Path) -> None:
    """New float weights for an int8 layer loaded from Q8_0 (an RL weight update) are rounded
    per channel into the same per-group panels, in place."""
    from ringserve.gpu.layers.linear import refresh_panel

    path = export_gguf(tiny_model("llama"), tmp_path / "llama-q8_0.gguf", qtype=Q.Q8_0)
    layer = _linears(_runner(path, "int8"))["model.layers.0.mlp.down_proj"]
    panel = layer.panel
    assert panel is not None and panel.format == "int8g"
    data, scales = panel.data.data_ptr(), panel.scales.data_ptr() if panel.scales is not None \
        else 0
    fresh = torch.randn(panel.out_features, panel.in_features,
                        generator=torch.Generator().manual_seed(1))
    refresh_panel(panel, fresh, None, "int8")
    assert panel.data.data_ptr() == data and panel.scales is not None
    assert panel.scales.data_ptr() == scales
    want = quant.dequantize(quant.quantize_codes(fresh, "int8"))
    assert torch.equal(quant.dequantize(quant.unpack(panel)), want)


@pytest.mark.slow
@pytest.mark.skipif(panel_native.load_library() is None, reason="no C compiler with OpenMP")
def test_a_q8_0_file_served_as_int8_decodes_alike_captured_and_eager(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM(file.gguf, quantization="int8")`: the captured decode step reads the int8g panels
    as the eager layers do (greedy tokens equal, logprobs to float32 rounding)."""
    from ringserve import LLM, SamplingParams

    path = export_gguf(tiny_model("llama"), tmp_path / "llama-q8_0.gguf", qtype=Q.Q8_0)
    runner = _runner(path, "int8", backend="cpu")
    runner.initialize_kv_cache(64)
    assert runner.capture is not None, runner.capture_reason
    assert "int8g" in runner.capture.info.weight_formats
    monkeypatch.setenv("RINGSERVE_HOME", str(tmp_path / "home"))  # the materialized directory
    prompts = [{"prompt_token_ids": [5 + i, 17, 99 + 7 * i, 4]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = []
    for eager in (False, True):
        with LLM(str(path), quantization="int8", enforce_eager=eager, device="cpu",
                 max_model_len=64, max_num_seqs=8, disable_log_stats=True) as llm:
            runs.append(llm.generate(prompts, params, use_tqdm=False))
    captured, eager_outs = runs
    for a, b in zip(captured, eager_outs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        got = [next(iter(p.values())).logprob for p in a.outputs[0].logprobs]
        want = [next(iter(p.values())).logprob for p in b.outputs[0].logprobs]
        np.testing.assert_allclose(got, want, atol=2e-4)


def _tp_rank(rank: int, path: str, port: int, out: str) -> None:
    """One of two gloo ranks: the int4 and the float model from the Q4_0 file, sharded; each
    rank writes, per linear, how many rows kept the file's codes, of how many, and whether
    its int4 shard dequantizes bit for bit to its float shard."""
    import json

    import torch.distributed as dist

    from ringserve.gpu.layers.parallel import init_tp_group

    torch.set_num_threads(1)
    tp = init_tp_group(rank, 2, backend="gloo", init_method=f"tcp://127.0.0.1:{port}")
    try:
        models = []
        for method in ("int4", None):
            config = EngineArgs(model=path, max_model_len=64, max_num_seqs=4, device="cpu",
                                quantization=method,
                                gguf_dequantize=method is None).create_engine_config()
            runner = ModelRunner(config, torch.device("cpu"), tp=tp, attention_backend="torch")
            runner.load_model()
            models.append(_linears(runner))
        kept = {}
        for name, layer in models[0].items():
            panel, reference = layer.panel, models[1][name].panel
            assert panel is not None and reference is not None
            same = torch.equal(quant.dequantize(quant.unpack(panel)),
                               panel_native.unpack_f32(reference))
            kept[name] = [layer.rows_as_is, panel.out_features, same]
        Path(f"{out}.{rank}").write_text(json.dumps(kept))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(panel_native.load_library() is None, reason="no C compiler with OpenMP")
def test_tensor_parallel_shards_keep_the_files_codes(tmp_path: Path) -> None:
    """At TP=2 every column shard (fused q/k/v and gate/up included) takes its rows of the
    codes and every row shard its columns (the splits fall on groups of 32 here)."""
    import json
    import socket

    import torch.multiprocessing as mp

    path = export_gguf(tiny_model("llama"), tmp_path / "llama-Q4_0.gguf", qtype=Q.Q4_0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    out = tmp_path / "kept.json"
    mp.spawn(_tp_rank, args=(str(path), port, str(out)), nprocs=2, join=True)
    for rank in (0, 1):
        kept = json.loads(Path(f"{out}.{rank}").read_text())
        assert kept and all(rows == total > 0 and same for rows, total, same in kept.values()), \
            (rank, kept)
