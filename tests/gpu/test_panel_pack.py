"""The C pack into panels (`panel_pack.c`): `to_panels` and `pack_rows` equal the torch
transposing copy for every shape (partial panels, k not a multiple of 8, strided and bf16
sources), and layers processed into panels load again straight into them (a weight update's
standby model) to the panels a fresh load packs."""

from __future__ import annotations

import pytest
import torch

from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear, loads_in_place
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from ringserve.gpu.native import panel as panel_native

LIBRARY = panel_native.load_library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no C compiler with OpenMP")


def _reference(matrix: torch.Tensor) -> torch.Tensor:
    n, k = matrix.shape
    padded = torch.zeros(panel_native.num_panels(n) * 16, k)
    padded[:n] = matrix
    return padded.view(-1, 16, k).transpose(1, 2).contiguous()


@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 8), (16, 16), (17, 13), (48, 40), (960, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_to_panels_equals_the_torch_transpose(n: int, k: int, threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        matrix = torch.randn(n, k)
        out = torch.full((panel_native.num_panels(n), k, 16), float("nan"))
        assert torch.equal(panel_native.to_panels(matrix, out=out), _reference(matrix))
        assert torch.equal(panel_native.to_panels(matrix), _reference(matrix))
    finally:
        torch.set_num_threads(previous)


def test_pack_rows_writes_only_its_rows() -> None:
    assert LIBRARY is not None
    n, k = 50, 24
    full = torch.randn(n, k)
    panels = torch.full((panel_native.num_panels(n), k, 16), 7.0)
    for start, stop in ((0, 5), (5, 21), (21, 37), (37, 50)):  # shards across panel edges
        panel_native.pack_rows(LIBRARY, full[start:stop], panels, start)
    expected = _reference(full)
    assert torch.equal(panels.transpose(1, 2).reshape(-1, k)[:n], full)
    # The padding lanes of the last panel were never written.
    assert torch.all(panels[-1, :, n % 16:] == 7.0)
    assert torch.equal(panels[:-1], expected[:-1])


def test_pack_rows_strided_and_converted_sources() -> None:
    assert LIBRARY is not None
    wide = torch.randn(32, 70)
    panels = torch.empty(2, 35, 16)
    panel_native.pack_rows(LIBRARY, wide[:, 35:], panels, 0)  # a row-parallel shard's columns
    assert torch.equal(panels, _reference(wide[:, 35:]))
    half = torch.randn(32, 35).to(torch.bfloat16)
    panel_native.pack_rows(LIBRARY, half, panels, 0)
    assert torch.equal(panels, _reference(half.float()))
    with pytest.raises(ValueError, match="pack_rows"):
        panel_native.pack_rows(LIBRARY, wide[:, :10], panels, 0)
    with pytest.raises(ValueError, match="pack_rows"):
        panel_native.pack_rows(LIBRARY, wide[:, :35], panels, 17)


def _loaded_column(sizes: list[int], k: int, weights: list[torch.Tensor],
                   bias: list[torch.Tensor]) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(k, sizes, bias=True, tp=TPGroup(), dtype=torch.float32)
    for shard, (w, b) in enumerate(zip(weights, bias, strict=True)):
        layer.load("weight", w, shard)
        layer.load("bias", b, shard)
    return layer


def test_processed_layers_load_again_into_their_panels() -> None:
    sizes, k = [24, 8, 9], 20  # fused shards that do not start on a multiple of 16
    first = ([torch.randn(s, k) for s in sizes], [torch.randn(s) for s in sizes])
    second = ([torch.randn(s, k) for s in sizes], [torch.randn(s) for s in sizes])
    layer = _loaded_column(sizes, k, *first)
    layer.process_weights_after_loading()
    assert loads_in_place(layer) and layer.weight.numel() == 0
    for shard, (w, b) in enumerate(zip(*second, strict=True)):
        layer.load("weight", w, shard)
        layer.load("bias", b, shard)
    fresh = _loaded_column(sizes, k, *second)
    fresh.process_weights_after_loading()
    assert layer.panel is not None and fresh.panel is not None
    assert torch.equal(layer.panel.data, fresh.panel.data)
    assert layer.panel.bias is not None and fresh.panel.bias is not None
    assert torch.equal(layer.panel.bias, fresh.panel.bias)
    x = torch.randn(3, k)
    assert torch.equal(layer.forward(x), fresh.forward(x))

    row = RowParallelLinear(k, 33, bias=True, tp=TPGroup(), dtype=torch.float32)
    row.load("weight", torch.randn(33, k))
    row.load("bias", torch.randn(33))
    row.process_weights_after_loading()
    weight, bias = torch.randn(33, k), torch.randn(33)
    row.load("weight", weight)
    row.load("bias", bias)
    assert row.panel is not None and row.panel.bias is not None
    assert torch.equal(row.panel.data, panel_native.to_panels(weight))
    assert torch.equal(row.panel.bias, bias)


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_loads_again_into_its_panels(tied: bool) -> None:
    embedding = VocabParallelEmbedding(40, 24, tp=TPGroup(), dtype=torch.float32)
    head = ParallelLMHead(40, 24, tp=TPGroup(), dtype=torch.float32)
    if tied:
        head.weight = embedding.weight
    (embedding if tied else head).load("weight", torch.randn(40, 24))
    head.process_weights_after_loading(keep_weight=tied)
    if tied:
        head.tie_panels(embedding)
    assert head.loads_in_place()
    new = torch.randn(40, 24)
    (embedding if tied else head).load("weight", new)
    assert head.panel is not None
    assert torch.equal(head.panel.data, panel_native.to_panels(new))
    if tied:  # the rows live in the head's panels only; lookups read them there
        assert embedding.weight.numel() == 0 and head.weight is embedding.weight
        ids = torch.tensor([0, 17, 39, 17, 5])
        assert torch.equal(embedding(ids), new[ids])


def test_repacked_layers_do_not_load_again() -> None:
    layer = ColumnParallelLinear(32, [32], bias=False, tp=TPGroup(), dtype=torch.float32,
                                 quantization="int8")
    layer.load("weight", torch.randn(32, 32))
    layer.process_weights_after_loading()
    assert not loads_in_place(layer)
    with pytest.raises(ValueError, match="cannot be loaded again"):
        layer.load("weight", torch.randn(32, 32))


def test_batched_packs_run_at_flush_in_one_region() -> None:
    assert LIBRARY is not None
    full = torch.randn(40, 24)
    panels = torch.zeros(3, 24, 16)
    with panel_native.batched_packs(LIBRARY) as batch:
        assert batch is not None
        for start, stop in ((0, 7), (7, 30), (30, 40)):
            panel_native.pack_rows(LIBRARY, full[start:stop], panels, start)
        assert torch.all(panels == 0)  # queued, not run
        batch.flush()
        assert torch.equal(panels, _reference(full))
        panel_native.pack_rows(LIBRARY, torch.ones(40, 24), panels, 0)
    # Packs queued when the batch closes are dropped; outside it they run at once.
    assert torch.equal(panels, _reference(full))
    panel_native.pack_rows(LIBRARY, torch.ones(40, 24), panels, 0)
    assert torch.equal(panels, _reference(torch.ones(40, 24)))
