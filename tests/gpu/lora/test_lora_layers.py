"""The grouped LoRA math on the model's layers (issue 42, item 4): rows grouped by slot,
contiguous or scattered, against the plain formula; base rows bit-identical; the guards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import LoRARunner, make_runner

from ringserve.gpu.lora.adapter_config import AdapterConfig
from ringserve.gpu.lora.layers import LoRABatch, LoRASlots, install_lora
from ringserve.gpu.lora.weights import LoRAAdapter, LoRADelta
from ringserve.gpu.testing import tiny_model

CONFIG = AdapterConfig(path="-", r=2, lora_alpha=2.0, use_rslora=False, target_modules=("q_proj",),
                       rank_pattern={}, alpha_pattern={})


@pytest.fixture(scope="module")
def lr() -> LoRARunner:
    return make_runner(tiny_model("llama"), max_loras=2)


def random_adapter(seed: int, parts: list[tuple[int, int, int]], fan_in: int = 64,
                   key: tuple[int, str] = (0, "qkv_proj")) -> LoRAAdapter:
    """An adapter with one delta per (rank, offset, width) on layer `key`."""
    gen = torch.Generator().manual_seed(seed)
    deltas = [LoRADelta(torch.randn(r, fan_in, generator=gen), torch.randn(w, r, generator=gen),
                        off, w) for r, off, w in parts]
    return LoRAAdapter(CONFIG, {key: deltas})


def expected(x: torch.Tensor, base: torch.Tensor, slots: list[int],
             adapters: dict[int, LoRAAdapter]) -> torch.Tensor:
    out = base.clone()
    for row, slot in enumerate(slots):
        if slot >= 0:
            for d in adapters[slot].deltas[(0, "qkv_proj")]:
                out[row, d.offset:d.offset + d.width] += d.b @ (d.a @ x[row])
    return out


@pytest.mark.parametrize("slots", [[0, 0, 0, 0, 0], [-1, 1, 1, 0, -1], [1, -1, 0, 1, 0]],
                         ids=["one-adapter", "contiguous", "scattered"])
def test_rows_get_their_slots_delta(lr: LoRARunner, slots: list[int]) -> None:
    """q and v parts (k untouched) on slot 0, one whole-output delta on slot 1."""
    qkv = lr.runner.model.model.layers[0].self_attn.qkv_proj  # type: ignore[attr-defined]
    adapters = {0: random_adapter(0, [(2, 0, 64), (3, 96, 32)]),
                1: random_adapter(1, [(4, 0, 128)])}
    for slot, adapter in adapters.items():
        lr.slots.load(slot, adapter)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        lr.batch.set(None)
        base = qkv.forward(x)
        lr.batch.set(torch.tensor(slots))
        y = qkv.forward(x)
        lr.batch.set(None)
    want = expected(x, base, slots, adapters)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    for row, slot in enumerate(slots):
        if slot < 0:
            assert torch.equal(y[row], base[row])  # bit-identical
    if slots[0] == 0:  # slot 0's k columns are left alone
        assert torch.equal(y[:, 64:96], base[:, 64:96])


def test_no_lora_row_is_the_base(lr: LoRARunner) -> None:
    down = lr.runner.model.model.layers[1].mlp.down_proj  # type: ignore[attr-defined]
    lr.slots.load(0, random_adapter(3, [(2, 0, 64)], fan_in=128, key=(1, "down_proj")))
    x = torch.randn(3, 128)
    with torch.inference_mode():
        lr.batch.set(torch.tensor([-1, -1, -1]))
        assert not lr.batch.active
        y = down.forward(x)
        lr.batch.set(None)
        assert torch.equal(y, down.forward(x))
        assert torch.equal(y, type(down).forward(down, x))


def test_guards(lr: LoRARunner) -> None:
    qkv = lr.runner.model.model.layers[0].self_attn.qkv_proj  # type: ignore[attr-defined]
    lr.slots.clear(1)
    lr.batch.set(torch.tensor([1, 1]))
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"slot 1 holds no adapter"):
        qkv.forward(torch.zeros(2, 64))
    lr.batch.set(torch.tensor([0, 0, 0]))
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"has 3 rows but layers\.0"):
        qkv.forward(torch.zeros(2, 64))
    lr.batch.set(None)
    with pytest.raises(ValueError, match=r"slot 2 is out of range"):
        lr.slots.load(2, random_adapter(0, [(2, 0, 64)]))
    with pytest.raises(ValueError, match=r"^layers\.7\.qkv_proj: this model has no dense"):
        lr.slots.load(0, random_adapter(0, [(2, 0, 64)], key=(7, "qkv_proj")))
    with pytest.raises(ValueError, match=r"token_slots: expected int64"):
        lr.batch.set(torch.zeros(2, 2, dtype=torch.int64))


def test_moe_layers_take_no_delta(tmp_path: Path) -> None:
    """A mixture-of-experts layer has no dense MLP: its attention is wrapped, the experts not."""
    moe = make_runner(tiny_model("qwen3moe"), max_loras=1)
    with pytest.raises(ValueError, match=r"^layers\.0\.gate_up_proj: .*mixture-of-experts"):
        moe.slots.load(0, random_adapter(0, [(2, 0, 96)], key=(0, "gate_up_proj")))
    dense = moe.runner.model.model.layers[1].mlp  # type: ignore[attr-defined]
    assert "forward" in vars(dense.gate_up_proj)  # mlp_only_layers: [1] is dense


def test_install_again_rewraps_without_nesting(lr: LoRARunner) -> None:
    qkv = lr.runner.model.model.layers[0].self_attn.qkv_proj  # type: ignore[attr-defined]
    adapter = random_adapter(4, [(2, 0, 128)])
    lr.slots.load(0, adapter)
    x = torch.randn(2, 64)
    with torch.inference_mode():
        lr.batch.set(torch.tensor([0, -1]))
        once = qkv.forward(x)
        install_lora(lr.runner.model, lr.slots, lr.batch)
        twice = qkv.forward(x)
        lr.batch.set(None)
    assert torch.equal(once, twice)
    assert lr.slots.adapter(0) is adapter


def test_batch_groups() -> None:
    batch = LoRABatch()
    assert batch.groups is None
    batch.set(torch.tensor([-1, 2, 2, 0, 2, -1]))
    groups = batch.groups
    assert groups is not None and [s for s, _ in groups] == [0, 2]
    assert groups[0][1] == slice(3, 4)
    assert torch.equal(torch.as_tensor(groups[1][1]), torch.tensor([1, 2, 4]))
    with pytest.raises(ValueError, match=r"max_loras: 0"):
        LoRASlots(0)


SCATTERED = [-1, 0, 1, 2, 3, 4, 5, 6, 7, -1, 7, 6, 5, 4, 3, 2, 1, 0, -1, 3]
CONTIGUOUS = [-1, 0, 0, 1, 2, 2, 2, 3, 4, -1, 5, 5, 6, 7, 7, -1]


@pytest.fixture(scope="module")
def lr8() -> LoRARunner:
    return make_runner(tiny_model("llama"), max_loras=8)


@pytest.mark.parametrize("path", ["masked", "per-slot"])
@pytest.mark.parametrize("slots", [SCATTERED, CONTIGUOUS], ids=["scattered", "contiguous"])
def test_eight_slots_match_each_slot_alone(lr8: LoRARunner, slots: list[int], path: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with 8 slots (stacked shrink, per-row mask, stacked expand; or the per-slot
    loop) gives each row what its slot gives alone; base rows are bit-identical; a slot
    reloaded with another adapter is seen by the next step."""
    from ringserve.gpu.lora import layers

    if path == "per-slot":
        monkeypatch.setattr(layers, "_MASKED_MAX_WORK", 0)
        monkeypatch.setattr(layers, "_MASKED_MAX_WORK_CONTIGUOUS", 0)
    else:
        monkeypatch.setattr(layers, "_MASKED_MAX_WORK_CONTIGUOUS", 10**6)
    qkv = lr8.runner.model.model.layers[0].self_attn.qkv_proj  # type: ignore[attr-defined]
    parts = [[(2, 0, 64), (3, 96, 32)], [(4, 0, 128)], [(1, 64, 32)], [(5, 0, 64), (2, 64, 32)]]
    for slot in range(7):  # ranks and parts differ; slot 7 does not touch this layer
        lr8.slots.load(slot, random_adapter(10 + slot, parts[slot % 4]))
    lr8.slots.load(7, random_adapter(17, [(2, 0, 64)], fan_in=128, key=(1, "down_proj")))
    x = torch.randn(len(slots), 64, generator=torch.Generator().manual_seed(5))

    def forward(step: list[int] | None) -> torch.Tensor:
        with torch.inference_mode():
            lr8.batch.set(None if step is None else torch.tensor(step))
            try:
                return qkv.forward(x)
            finally:
                lr8.batch.set(None)

    def check() -> None:
        base, y = forward(None), forward(slots)
        for row, slot in enumerate(slots):
            if slot < 0:
                assert torch.equal(y[row], base[row])  # bit-identical
        for slot in range(8):
            alone = forward([s if s == slot else -1 for s in slots])
            rows = [r for r, s in enumerate(slots) if s == slot]
            torch.testing.assert_close(y[rows], alone[rows], atol=1e-5, rtol=1e-5)
        assert torch.equal(y[[r for r, s in enumerate(slots) if s == 7]],
                           base[[r for r, s in enumerate(slots) if s == 7]])

    check()
    lr8.slots.clear(2)
    lr8.slots.load(2, random_adapter(30, [(3, 32, 96)]))
    check()
    held = {s: a for s in range(7) if (a := lr8.slots.adapter(s)) is not None}
    want = expected(x, forward(None), [-1 if s == 7 else s for s in slots], held)
    torch.testing.assert_close(forward(slots), want, atol=1e-5, rtol=1e-5)
