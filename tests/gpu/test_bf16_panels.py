"""bf16 checkpoints on CPU (issue 48.3): the linears and the LM head keep the checkpoint's bf16
in bf16 panels (`panel_bf16.c`), the model computes in float32 around them (prefill chunks of
MANY_ROWS tokens and more: a bf16 GEMM where the CPU has native bf16).

The kernel against `F.linear` on the same (bf16-valued) weights at every tile height and
thread count, the fallback without the library, the layers' packing and refresh, and whole
models: greedy tokens and logprobs equal transformers run in float32 on the same bf16
checkpoint (what the panels compute: float32 products of the bf16 values), through the model
runner (chunked prefill, a prefix hit) and through `LLM` (the fused decode step). The AVX2
build against the AVX-512 one: test_gpu_linear.py's AVX-512 / AVX2 equality test [bf16].
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import assert_matches_hf, hf_greedy, make_runner, run_parity

from ringserve import SamplingParams
from ringserve.config import ModelConfig
from ringserve.engine.frontend.llm import LLM
from ringserve.gpu.layers import quant
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.testing import tiny_model

LIBRARY = panel_native.load_library()
needs_library = pytest.mark.skipif(LIBRARY is None, reason="no C compiler with OpenMP")


def _bf16_valued(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 [n, k] weight whose values are bf16 (as a bf16 checkpoint loads)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).to(torch.bfloat16).float()


@needs_library
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(16, 8), (40, 96), (100, 576), (7, 33)])
def test_bf16_kernel_matches_f_linear(n: int, k: int, threads: int) -> None:
    assert LIBRARY is not None
    weight = _bf16_valued(n, k, n * k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    panels = panel_native.pack_bf16(weight, bias)
    assert panels.format == "bf16" and panels.data.dtype == torch.bfloat16
    assert panels.data.shape == (panel_native.num_panels(n), k, 16)
    assert panels.nbytes() == panel_native.num_panels(n) * k * 16 * 2  # half of float32's
    assert torch.equal(panel_native.unpack_float(panels), weight)  # exact: no rounding
    gen = torch.Generator().manual_seed(2)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # every tile height (1 row; 2..8 rows; splits of 9..17) and row blocks of 48 (the
        # many-row hand-off: the test below)
        for rows in [*range(1, 18), 48, 64, 97]:
            x = torch.randn(rows, k, generator=gen)
            got = panel_native.linear(LIBRARY, x, panels)
            torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(old)


@needs_library
@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "no-bf16"])
def test_many_rows_go_to_a_bf16_gemm_where_the_cpu_has_bf16(
        native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """From MANY_ROWS rows on: with native bf16 a bf16 GEMM (rows rounded to bf16, the sums
    rounded to bf16: what transformers' bf16 matmul gives, bias added in float32); without
    it the float32 GEMM on the widened weight (float32 rounding only)."""
    assert LIBRARY is not None
    if native and not panel_native.native_bf16():
        pytest.skip("this CPU has no native bf16 (AVX512-BF16 / AMX-BF16)")
    monkeypatch.setattr(panel_native, "_native_bf16", [native])
    weight = _bf16_valued(100, 576, 11)
    bias = torch.randn(100, generator=torch.Generator().manual_seed(12))
    panels = panel_native.pack_bf16(weight, bias)
    x = torch.randn(panel_native.MANY_ROWS + 3, 576, generator=torch.Generator().manual_seed(13))
    got = panel_native.linear(LIBRARY, x, panels)
    assert got.dtype == torch.float32
    if native:
        want = F.linear(x.bfloat16(), weight.bfloat16()).float() + bias
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_bf16_panels_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C library cannot be built, the panels are widened and multiplied by torch."""
    weight = _bf16_valued(24, 64, 3)
    panels = panel_native.pack_bf16(weight)
    monkeypatch.setattr(panel_native, "load_library", lambda: None)
    x = torch.randn(3, 64)
    torch.testing.assert_close(quant.quantized_linear(x, panels), F.linear(x, weight))
    # bf16 activations come back as bf16 (the layers' contract for other dtypes)
    assert quant.quantized_linear(x.bfloat16(), panels).dtype == torch.bfloat16


def test_bf16_takes_no_gguf_codes_and_is_not_a_user_quantization() -> None:
    from ringserve.checkpoint.precision import BF16_WEIGHTS
    from ringserve.config import QUANTIZATION_METHODS

    assert BF16_WEIGHTS not in QUANTIZATION_METHODS  # --quantization bf16 stays refused
    with pytest.raises(ValueError, match="bf16 panels take no GGUF codes"):
        quant.quantize(torch.zeros(16, 32), BF16_WEIGHTS, [(0, object())])  # type: ignore[list-item]


@needs_library
def test_layers_pack_bf16_and_refresh_in_place() -> None:
    """A column layer (fused shards, bias) and a row layer keep bf16 panels and drop the
    float copy; a weight update rewrites the same panel tensor (the decode step's pointers)."""
    column = ColumnParallelLinear(32, [48, 16], bias=True, tp=TPGroup(), dtype=torch.float32,
                                  quantization="bf16")
    full = _bf16_valued(64, 32, 4)
    for shard, rows in enumerate(full.split([48, 16])):
        column.load("weight", rows, shard)
        column.load("bias", torch.arange(rows.shape[0], dtype=torch.float32), shard)
    column.process_weights_after_loading()
    assert column.panel is not None and column.panel.format == "bf16"
    assert column.weight.numel() == 0
    x = torch.randn(5, 32)
    bias = torch.cat([torch.arange(48.0), torch.arange(16.0)])
    torch.testing.assert_close(column(x), F.linear(x, full, bias), atol=1e-4, rtol=1e-5)

    row = RowParallelLinear(32, 24, bias=False, tp=TPGroup(), dtype=torch.float32,
                            quantization="bf16")
    row.load("weight", _bf16_valued(24, 32, 5))
    row.process_weights_after_loading()
    assert row.panel is not None
    data = row.panel.data
    fresh = RowParallelLinear(32, 24, bias=False, tp=TPGroup(), dtype=torch.float32,
                              quantization="bf16")
    new = _bf16_valued(24, 32, 6)
    fresh.load("weight", new)
    from ringserve.gpu.layers.linear import refresh_layer

    refresh_layer(row, fresh)
    assert row.panel.data is data
    torch.testing.assert_close(row(x), F.linear(x, new), atol=1e-4, rtol=1e-5)


# -- whole models -----------------------------------------------------------------------------

FAMILIES = ["llama", "qwen2", "gemma2", "qwen3moe"]  # plain, tied head, soft caps, MoE


def _bf16_checkpoint(family: str) -> Path:
    return tiny_model(family, dtype="bfloat16")


def test_auto_keeps_a_bf16_checkpoint_in_bf16_panels_on_cpu() -> None:
    config = ModelConfig.from_model_dir(str(_bf16_checkpoint("llama")))
    assert config.dtype == "float32" and config.weight_format == "bf16"
    assert config.quantization is None
    explicit = ModelConfig.from_model_dir(str(_bf16_checkpoint("llama")), dtype="float32")
    assert explicit.weight_format is None  # --dtype float32: float32 weights, as asked
    cuda = ModelConfig.from_model_dir(str(_bf16_checkpoint("llama")), device="cuda")
    assert cuda.weight_format is None and cuda.dtype == "bfloat16"
    f32 = ModelConfig.from_model_dir(str(tiny_model("llama")))
    assert f32.weight_format is None


@needs_library
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_checkpoint_matches_transformers_in_float32(family: str) -> None:
    """Greedy tokens equal transformers' float32 forward on the bf16 checkpoint, logprobs
    within 1e-4 (float32 rounding order), through chunked prefill and a prefix hit."""
    model_dir = _bf16_checkpoint(family)
    expected = hf_greedy(model_dir, 16)
    runner = make_runner(model_dir)
    layer = runner.model.model.layers[0]  # type: ignore[union-attr,index]
    assert layer.self_attn.qkv_proj.panel.format == "bf16"  # type: ignore[union-attr]
    assert runner.model.lm_head.panel.format == "bf16"  # type: ignore[union-attr]
    assert_matches_hf(run_parity(runner, 16), expected)


@pytest.mark.slow
@needs_library
@pytest.mark.parametrize("tp", [1, 2])
def test_llm_serves_a_bf16_checkpoint_token_exact_for_32_tokens(tp: int) -> None:
    """Through the engine (its fused decode step reads the bf16 panels; TP = 2: two workers,
    each with its shard's panels and its vocabulary rows of the tied head), 32 greedy tokens
    of each prompt equal transformers' float32 forward on the same bf16 checkpoint."""
    model_dir = _bf16_checkpoint("qwen2")  # tied LM head: its own bf16 panels
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 8000, (n,), generator=gen).tolist() for n in (3, 20, 41)]
    expected = []
    for prompt in prompts:
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                          min_new_tokens=32)
        expected.append(out[0, len(prompt):].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    executor = {"distributed_executor_backend": "mp"} if tp > 1 else {}
    with LLM(str(model_dir), device="cpu", kv_cache_memory=16 << 20, max_num_seqs=4,
             tensor_parallel_size=tp, **executor) as llm:  # type: ignore[arg-type]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected


# -- a tied embedding read from its LM head's panels -----------------------------------------


@needs_library
@pytest.mark.parametrize("method", ["f32", "bf16", "int8", "int8g", "int4"])
def test_panel_rows_are_the_values_the_kernel_multiplies_by(method: str) -> None:
    """`panel_native.rows` (rs_panel_rows) against the dequantized weight: row r of the
    product's weight, any format, with the last panel's padding lanes (n = 40)."""
    assert LIBRARY is not None
    n, k = 40, 96
    weight = _bf16_valued(n, k, 8)
    if method == "f32":
        panels, want = panel_native.pack_f32(weight), weight
    elif method == "bf16":
        panels, want = panel_native.pack_bf16(weight), weight
    else:
        q = quant.quantize_codes(weight, "int8" if method != "int4" else "int4",
                                 int8_groups=method == "int8g")
        panels, want = quant.pack(q), quant.dequantize(q)
    assert panels.format == method
    ids = torch.tensor([[0, 15, 16], [39, 7, 7]])
    got = panel_native.rows(LIBRARY, panels, ids)
    assert got.shape == (2, 3, k)
    torch.testing.assert_close(got, want[ids], atol=1e-6, rtol=1e-6)
    assert torch.equal(got, F.embedding(ids, want)) or method == "int4"  # int4: rounding order
    with pytest.raises(ValueError, match="ids outside"):
        panel_native.rows(LIBRARY, panels, torch.tensor([n]))


@needs_library
def test_tied_embedding_reads_bf16_panels_and_a_weight_update_unties_it() -> None:
    """A tied head on bf16 panels: the embedding keeps no rows and looks up the panels'
    (exact) values; a weight update (`refresh_from` a just-loaded head) rewrites the panels
    and gives the embedding float rows of its own again, with the new values."""
    from ringserve.gpu.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    def tied(matrix: torch.Tensor) -> tuple[VocabParallelEmbedding, ParallelLMHead]:
        embed = VocabParallelEmbedding(50, 64, tp=TPGroup(), dtype=torch.float32)
        head = ParallelLMHead(50, 64, tp=TPGroup(), dtype=torch.float32, quantization="bf16")
        head.weight = embed.weight
        embed.load("weight", matrix)
        return embed, head

    old, new = _bf16_valued(50, 64, 9), _bf16_valued(50, 64, 10)
    embed, head = tied(old)
    head.process_weights_after_loading(keep_weight=True, tied_to=embed)
    head.tie_panels(embed)
    assert embed.panel_rows is head.panel and embed.weight.numel() == 0
    ids = torch.tensor([3, 49, 0])
    assert torch.equal(embed(ids), old[ids])
    x = torch.randn(2, 64)
    torch.testing.assert_close(head.compute_logits(x), x @ old.T, atol=1e-4, rtol=1e-5)

    _, loaded = tied(new)
    head.refresh_from(loaded)
    assert embed.panel_rows is None and head.weight is embed.weight
    assert torch.equal(embed(ids), new[ids])
    torch.testing.assert_close(head.compute_logits(x), x @ new.T, atol=1e-4, rtol=1e-5)


# -- long prefills of a bf16 checkpoint on a CPU with native bf16 ------------------------------


def test_runner_sets_bf16_prefill_attention_only_for_bf16_panels_on_native_bf16(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for native in (True, False):
        monkeypatch.setattr(panel_native, "_native_bf16", [native])
        runner = make_runner(_bf16_checkpoint("llama"))
        assert runner.backend.prefill_dtype == (torch.bfloat16 if native else None)  # type: ignore[union-attr]
    monkeypatch.setattr(panel_native, "_native_bf16", [True])
    assert make_runner(tiny_model("llama")).backend.prefill_dtype is None  # type: ignore[union-attr]


@pytest.mark.parametrize("context", [0, 40])
def test_long_prefill_attends_in_the_prefill_dtype(context: int) -> None:
    """`attend_requests` with prefill_dtype bf16: a request of PREFILL_CAST_ROWS rows or more
    attends on bf16 q, k, v (SDPA run in bf16, converted back: a fresh prompt, and a chunk
    after context by tiles), a shorter one stays float32 (equal to no prefill_dtype)."""
    from ringserve.gpu.attention import torch_ref
    from ringserve.gpu.attention.metadata import AttentionMetadata

    heads, kv_heads, dim, block = 4, 2, 16, 16
    gen = torch.Generator().manual_seed(14)
    for rows in (torch_ref.PREFILL_CAST_ROWS, 24):
        seq = context + rows
        blocks = -(-seq // block)
        cache = torch.randn(2, blocks, block, kv_heads, dim, generator=gen)
        query = torch.randn(rows, heads, dim, generator=gen)
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(rows, dtype=torch.long),
            query_start_loc=torch.tensor([0, rows], dtype=torch.int32),
            seq_lens=torch.tensor([seq], dtype=torch.int32),
            block_table=torch.arange(blocks, dtype=torch.int32)[None],
            token_to_req=torch.zeros(rows, dtype=torch.int32), max_query_len=rows,
            max_seq_len=seq, query_start_loc_cpu=[0, rows], seq_lens_cpu=[seq])
        requests = [(0, torch.arange(blocks))]
        out32, out16 = torch.empty_like(query), torch.empty_like(query)
        torch_ref.attend_requests(query, cache, meta, requests, 0.25, out32)
        torch_ref.attend_requests(query, cache, meta, requests, 0.25, out16,
                                  prefill_dtype=torch.bfloat16)
        if rows < torch_ref.PREFILL_CAST_ROWS:
            assert torch.equal(out16, out32)
            continue
        k = cache[0].flatten(0, 1)[:seq].transpose(0, 1)
        v = cache[1].flatten(0, 1)[:seq].transpose(0, 1)
        mask = torch.arange(seq)[None, :] <= torch.arange(context, seq)[:, None]
        want = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None].bfloat16(), k[None].bfloat16(), v[None].bfloat16(),
            attn_mask=mask, scale=0.25, enable_gqa=True)[0].transpose(0, 1).float()
        torch.testing.assert_close(out16, want, atol=2e-2, rtol=2e-2)
        assert not torch.equal(out16, out32)  # it did run in bf16
        torch.testing.assert_close(out16, out32, atol=3e-2, rtol=3e-2)
