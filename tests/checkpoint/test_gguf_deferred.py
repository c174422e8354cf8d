"""A quantized GGUF loads from its codes without the float model (issue 45, item 4): the
tensors whose codes a layer keeps are read deferred (no float32 copy is made of them, nor is
the file's bytes held past the layer's packing), and the panels, the embedding's lookups and
the logits are bit for bit those of the float read that came before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf_export import export_gguf

from ringserve.checkpoint import gguf_codes, gguf_file
from ringserve.engine.arg_utils import EngineArgs
from ringserve.gpu.layers import quant
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.layers.vocab_embedding import ParallelLMHead
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.native.panel import PanelWeight
from ringserve.gpu.runner.model_runner import ModelRunner
from ringserve.gpu.testing import tiny_model

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama as Q4_1 and Q8_0, and a tied Qwen2 mixing Q4_1, Q5_0, F16 and a Q8_0
    embedding (as test_gguf_default_codes builds them)."""
    out = tmp_path_factory.mktemp("gguf-deferred")
    llama = tiny_model("llama")
    return {
        "q4_1": export_gguf(llama, out / "llama-Q4_1.gguf", qtype=Q.Q4_1),
        "q8_0": export_gguf(llama, out / "llama-Q8_0.gguf", qtype=Q.Q8_0),
        "mixed": export_gguf(tiny_model("qwen2"), out / "qwen2-mixed.gguf", qtype=Q.Q4_1,
                             types={"blk.0.attn_v.weight": Q.Q5_0,
                                    "blk.1.ffn_down.weight": Q.F16,
                                    "token_embd.weight": Q.Q8_0}),
    }


def _runner(path: Path, **flags: Any) -> ModelRunner:
    config = EngineArgs(model=str(path), max_model_len=64, max_num_seqs=4, device="cpu",
                        block_size=8, **flags).create_engine_config()
    runner = ModelRunner(config, torch.device("cpu"), attention_backend="torch")
    runner.load_model()
    return runner


def _float_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader reads every tensor's floats at once (the load path before deferral)."""
    original = gguf_file.iterate_gguf_weights

    def eager(path: Path, hf_config: dict[str, Any], *, deferred: bool = False
              ) -> Iterator[tuple[str, torch.Tensor]]:
        del deferred
        return original(path, hf_config)

    monkeypatch.setattr(gguf_file, "iterate_gguf_weights", eager)


def _tensors(panel: PanelWeight | None) -> list[torch.Tensor | None]:
    assert panel is not None
    return [panel.data, panel.scales, panel.mins, panel.bias]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.skipif(panel_native.load_library() is None, reason="no C compiler with OpenMP")
@pytest.mark.parametrize("name", ["q4_1", "q8_0", "mixed"])
@pytest.mark.parametrize("flags", [{}, {"quantization": "int4"}, {"quantization": "int8"}],
                         ids=["gguf", "int4", "int8"])
def test_the_deferred_load_equals_the_float_read(
        name: str, flags: dict[str, Any], files: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    deferred = _runner(files[name], **flags)
    with monkeypatch.context() as patch:
        _float_read(patch)
        eager = _runner(files[name], **flags)
    layers = {n: m for n, m in deferred.model.named_modules()
              if isinstance(m, ColumnParallelLinear | RowParallelLinear | ParallelLMHead)}
    reference = dict(eager.model.named_modules())
    for layer_name, layer in layers.items():
        want = reference[layer_name]
        assert isinstance(want, type(layer))
        assert layer.quantization == want.quantization, layer_name
        assert layer.rows_as_is == want.rows_as_is, layer_name
        assert layer.panel is not None and want.panel is not None, layer_name
        assert layer.panel.format == want.panel.format, layer_name
        for got, ref in zip(_tensors(layer.panel), _tensors(want.panel), strict=True):
            assert _same(got, ref), layer_name
    embed, want_embed = deferred.model.model.embed_tokens, eager.model.model.embed_tokens
    assert (embed.panel_rows is None) == (want_embed.panel_rows is None)
    ids = torch.arange(embed.num_embeddings)
    assert torch.equal(embed(ids), want_embed(ids))
    hidden = torch.randn(3, embed.embedding_dim, generator=torch.Generator().manual_seed(0))
    assert torch.equal(deferred.model.compute_logits(hidden), eager.model.compute_logits(hidden))


@pytest.mark.skipif(panel_native.load_library() is None, reason="no C compiler with OpenMP")
@pytest.mark.parametrize("name", ["q4_1", "q8_0"])
def test_code_tensors_are_never_dequantized(name: str, files: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Every 2-D tensor of these files holds codes its layer keeps (untied LM head too): no
    float32 copy of any of them is made while loading (only the embedding's table, which the
    lookups read as floats)."""
    shapes: list[tuple[int, ...]] = []
    original = gguf.quants.dequantize

    def counted(data: Any, qtype: Any) -> Any:
        out = original(data, qtype)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(gguf.quants, "dequantize", counted)
    runner = _runner(files[name])
    embed = runner.model.model.embed_tokens
    assert len(shapes) == 1 and shapes[0][0] == embed.num_embeddings, shapes
    assert all(layer.rows_as_is == layer.panel.out_features  # type: ignore[union-attr]
               for layer in runner.model.modules()
               if isinstance(layer, ColumnParallelLinear | RowParallelLinear | ParallelLMHead))


def _rounded_whole(weight: torch.Tensor, method: str, as_is: list[tuple[int, gguf_codes.BlockCodes]],
                   int8_groups: bool) -> PanelWeight:
    """`quant.quantize` as it was: the whole weight rounded, then the kept rows' codes written
    over it."""
    q = quant.quantize_codes(weight, method, int8_groups=int8_groups and method == "int8")
    if method == "int8" and q.scales.dim() == 1:
        scales = q.scales[:, None].expand(-1, weight.shape[1] // 32).contiguous()
        q = quant.QuantCodes("int8", q.codes, scales, None, 32)
    for row0, blocks in as_is:
        rows = blocks.codes.shape[0]
        q.codes[row0:row0 + rows] = blocks.codes.to(q.codes.dtype)
        q.scales[row0:row0 + rows] = blocks.scales.to(q.scales.dtype)
        if q.mins is not None and blocks.mins is not None:
            q.mins[row0:row0 + rows] = blocks.mins.to(q.mins.dtype)
    return quant.pack(q)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("int8_groups", [False, True])
@pytest.mark.parametrize("cover", ["all", "some"])
def test_packing_from_codes_equals_rounding_the_whole_weight(
        method: str, int8_groups: bool, cover: str) -> None:
    """Rows kept as codes are copied and only the others rounded (the kept rows' floats are
    never read): the same panels as rounding everything and writing the codes over it."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(50, 96, generator=gen)
    qtype = "Q8_0" if method == "int8" else "Q4_1"
    source = torch.randn(50, 96, generator=gen).numpy()
    blocks = gguf_codes.decode(gguf.quants.quantize(source, Q[qtype]).reshape(-1), qtype,
                               (50, 96))
    as_is = ([(0, blocks)] if cover == "all"
             else [(3, blocks.rows(3, 10)), (20, blocks.rows(20, 17))])
    want = _rounded_whole(weight, method, as_is, int8_groups)
    for row0, part in as_is:  # the kept rows' floats are never read
        weight[row0:row0 + part.codes.shape[0]] = float("nan")
    got = quant.quantize(weight, method, as_is, int8_groups=int8_groups)
    assert got.format == want.format
    for a, b in zip(_tensors(got), _tensors(want), strict=True):
        assert _same(a, b)
