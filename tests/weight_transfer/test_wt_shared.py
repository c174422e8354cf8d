"""`SharedWeights`: a trainer's parameters in shared memory, sent by the shm transport with
nothing copied; a parameter moved out of it falls back to a copied bucket; close() gives the
parameters back in private memory and leaves no segment."""

from __future__ import annotations

import os

import pytest
import torch
from wt_peer import FakeEngine, digests

from ringserve.shm.segment import SHM_DIR
from ringserve.weight_transfer import (
    SharedWeights,
    TrainerWeightTransferEngine,
    WeightTransferConfig,
)

CONFIG = WeightTransferConfig("shm", bucket_bytes=1 << 16)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 48), torch.nn.Linear(48, 96),
                                torch.nn.LayerNorm(96), torch.nn.Linear(96, 48),
                                torch.nn.Linear(48, 300, bias=False),
                                torch.nn.Linear(3, 5).to(torch.bfloat16))  # odd sizes, bf16
    model[4].weight = model[0].weight  # tied: one tensor, sent once
    return model


def _forward(model: torch.nn.Module) -> torch.Tensor:
    hidden = model[0](torch.tensor([1, 2]))
    for layer in model[1:5]:
        hidden = layer(hidden)
    return hidden.sum()


def _params(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


def test_parameters_move_in_and_out_unchanged() -> None:
    model = _model()
    before = _params(model)
    objects = [id(p) for p in model.parameters()]
    with SharedWeights(model) as shared:
        assert shared.segment is not None and os.path.exists(os.path.join(SHM_DIR,
                                                                           shared.segment.name))
        assert [id(p) for p in model.parameters()] == objects  # the same Parameter objects
        for (name, old), (_, new) in zip(before, model.named_parameters(), strict=True):
            assert torch.equal(old, new), name
            assert shared.offset_of(new) is not None and shared.offset_of(new) % 64 == 0
        assert [m.name for m in shared.metadata()] == [n for n, _ in before]
        # An optimiser step updates the shared pages in place.
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        _forward(model).backward()
        opt.step()
        assert all(shared.offset_of(p) is not None for p in model.parameters())
        stepped = _params(model)
        name = shared.segment.name
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    assert shared.offset_of(model[1].weight) is None
    for (n, old), (_, new) in zip(stepped, model.named_parameters(), strict=True):
        assert torch.equal(old, new), n  # private again, same values
    model[1].weight.data.add_(1)  # still usable
    shared.close()  # idempotent


def test_rounds_are_sent_in_place() -> None:
    model = _model()
    engine = FakeEngine(CONFIG, num_workers=2, hold_s=0.002)
    with SharedWeights(model) as shared, \
            TrainerWeightTransferEngine(CONFIG, engine, timeout_s=5) as trainer:
        trainer.trainer_init(shared)
        assert shared.segment is not None
        shared_name = shared.segment.name
        assert engine.init_infos[-1]["segments"][-1] == shared_name
        for step in range(3):
            engine.update_infos.clear()
            trainer.send_weights()
            assert engine.received[-1] == digests(model.named_parameters())
            assert len(engine.update_infos) > 1
            assert {info["segment"] for info in engine.update_infos} == {shared_name}
            for info in engine.update_infos:
                for slot in info["tensors"]:
                    param = model.get_parameter(slot["name"])
                    assert slot["offset"] == shared.offset_of(param)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.5 + step)
        # A parameter whose data moved out of the segment: its bucket is copied, the rest not.
        model[1].weight.data = torch.randn(96, 48)
        engine.update_infos.clear()
        trainer.send_weights()
        assert engine.received[-1] == digests(model.named_parameters())
        segments = [info["segment"] for info in engine.update_infos]
        assert shared_name in segments and any(s != shared_name for s in segments)
        copied = [slot["name"] for info in engine.update_infos if info["segment"] != shared_name
                  for slot in info["tensors"]]
        assert "1.weight" in copied
    engine.close()


def test_a_closed_share_falls_back_to_copies() -> None:
    model = _model()
    engine = FakeEngine(CONFIG)
    shared = SharedWeights(model)
    with TrainerWeightTransferEngine(CONFIG, engine, timeout_s=5) as trainer:
        trainer.trainer_init(shared)
        shared_name = shared.segment.name if shared.segment is not None else ""
        shared.close()
        engine.update_infos.clear()
        trainer.send_weights()
        assert engine.received[-1] == digests(model.named_parameters())
        assert shared_name not in {info["segment"] for info in engine.update_infos}
    engine.close()


def test_names_leave_parameters_out_and_off_cpu_is_refused() -> None:
    model = _model()
    with SharedWeights(model, names=lambda n: None if n.startswith("5.") else f"m.{n}") as shared:
        assert [m.name for m in shared.metadata()] == [
            f"m.{n}" for n, _ in model.named_parameters() if not n.startswith("5.")]
        assert shared.offset_of(model[5].weight) is None  # left where it was
        assert shared.offset_of(model[1].weight) is not None
    with pytest.raises(ValueError, match="is on meta"):
        SharedWeights(torch.nn.Linear(2, 2, device="meta"))
