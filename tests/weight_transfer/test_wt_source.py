"""Weight sources: metadata equal to what they yield, dtype names, re-iteration."""

from __future__ import annotations

import pytest
import torch

from ringserve.weight_transfer import (
    ModuleWeightSource,
    StateDictSource,
    TensorMeta,
    WeightSource,
    dtype_from_name,
    dtype_name,
    metadata_dict,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int8, torch.uint8, torch.int64, torch.bool,
                                   torch.float8_e4m3fn])
def test_dtype_names_round_trip(dtype: torch.dtype) -> None:
    name = dtype_name(dtype)
    assert not name.startswith("torch.")
    assert dtype_from_name(name) is dtype


def test_bad_dtype_names() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype 'torch\.float32'; allowed: float64, float32"):
        dtype_from_name("torch.float32")
    with pytest.raises(ValueError, match="allowed"):
        dtype_from_name(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be sent"):
        dtype_name(torch.complex64)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 4, bias=False))
    model[2].to(torch.bfloat16)
    model.register_buffer("step", torch.zeros(()))  # buffers are not sent
    return model


def _expected(module: torch.nn.Module) -> list[TensorMeta]:
    return [TensorMeta(n, str(p.dtype).removeprefix("torch."), tuple(p.shape))
            for n, p in module.named_parameters()]


def test_module_source_matches_named_parameters() -> None:
    model = _model()
    source = ModuleWeightSource(model)
    assert isinstance(source, WeightSource)
    assert source.metadata() == _expected(model)
    for _ in range(2):  # re-iterable
        pairs = list(source)
        assert [n for n, _ in pairs] == [n for n, _ in model.named_parameters()]
        for (name, tensor), (_, param) in zip(pairs, model.named_parameters(), strict=True):
            assert not tensor.requires_grad and tensor.device.type == "cpu"
            assert tensor.data_ptr() == param.data_ptr(), f"{name} was copied on the CPU"
            assert torch.equal(tensor, param)


def test_module_source_renames_and_skips() -> None:
    model = _model()
    source = ModuleWeightSource(model, names=lambda n: None if n.startswith("1.")
                                else "model." + n)
    names = [m.name for m in source.metadata()]
    assert names == ["model.0.weight", "model.0.bias", "model.2.weight"]
    assert [n for n, _ in source] == names


def test_state_dict_source_and_metadata_dict() -> None:
    tensors = {"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16),
               "c": torch.tensor(1.5)}
    source = StateDictSource(tensors)
    metas = source.metadata()
    assert metas == [TensorMeta("a", "float32", (2, 3)), TensorMeta("b", "bfloat16", (4,)),
                     TensorMeta("c", "float32", ())]
    assert [m.nbytes for m in metas] == [24, 8, 4]
    assert metadata_dict(metas) == {"names": ["a", "b", "c"],
                                    "dtype_names": ["float32", "bfloat16", "float32"],
                                    "shapes": [[2, 3], [4], []]}
    assert [n for n, _ in source] == [n for n, _ in source] == ["a", "b", "c"]


@pytest.mark.slow  # importing transformers takes seconds
def test_tiny_llama_source() -> None:
    # The model's own modules: importing the transformers package top-level costs seconds more.
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=128)
    model = llama.LlamaForCausalLM(config).to(torch.bfloat16)
    source = ModuleWeightSource(model)
    assert source.metadata() == _expected(model)
    assert metadata_dict(source.metadata())["names"] == [n for n, _ in model.named_parameters()]
    first = list(source)
    second = list(source)
    assert len(first) == len(second) == len(list(model.parameters()))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, second, strict=True))
    assert {t.dtype for _, t in first} == {torch.bfloat16}
