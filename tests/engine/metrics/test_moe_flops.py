"""Analytic FLOPs of mixture-of-experts models count only the activated experts (router, top-k
experts, shared expert and its gate on the sparse layers; the dense MLP elsewhere), against
hand computations; the sparse-layer rule of `ringserve.moe_shape`; and the modules the engine
core and the frontend read it through import no torch."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ringserve import EngineArgs
from ringserve.engine.metrics.flops import ModelFlops
from ringserve.gpu.testing import tiny_model
from ringserve.moe_shape import MoeShape, moe_shape

SRC = Path(__file__).resolve().parents[3] / "src"

# The tiny MoE models: hidden 64, 4 query heads / 2 KV heads (of 16 unless said), dense
# MLP 128.
H, NQ, NKV, D, DENSE_I, VOCAB = 64, 4, 2, 16, 128, 8000
PROJECTIONS = 2 * H * NQ * D + 2 * H * 2 * NKV * D + 2 * NQ * D * H
DENSE_MLP = 3 * 2 * H * DENSE_I


def _flops(preset: str) -> ModelFlops:
    config = EngineArgs(model=str(tiny_model(preset)), device="cpu", max_model_len=256,
                        num_gpu_blocks_override=16).create_engine_config()
    return ModelFlops.from_config(config)


def test_qwen3_moe_counts_top_k_experts_on_sparse_layers_only() -> None:
    # 3 layers, layer 1 dense (mlp_only_layers); 8 experts of 64, top-2, no shared expert;
    # heads of 32.
    flops = _flops("qwen3moe")
    assert flops.moe is not None and flops.moe.sparse_layers == (0, 2)
    d = 32
    projections = 2 * H * NQ * d + 2 * H * 2 * NKV * d + 2 * NQ * d * H
    sparse = 2 * H * 8 + 2 * (3 * 2 * H * 64)
    per_token = 3 * projections + 1 * DENSE_MLP + 2 * sparse
    assert flops.dense_flops_per_token() == per_token == 3 * 49152 + 49152 + 2 * 50176
    assert flops.request_flops(5, 0) == (5 * per_token + 3 * 4 * NQ * d * (1 + 2 + 3 + 4 + 5)
                                         + 2 * H * VOCAB)


def test_qwen2_moe_adds_the_gated_shared_expert() -> None:
    # decoder_sparse_step 2: only layer 1 sparse; shared expert of 96 with its sigmoid gate.
    flops = _flops("qwen2moe")
    assert flops.moe is not None and flops.moe.sparse_layers == (1,)
    sparse = 2 * H * 8 + 2 * (3 * 2 * H * 48) + 3 * 2 * H * 96 + 2 * H
    assert flops.dense_flops_per_token() == 3 * PROJECTIONS + 2 * DENSE_MLP + sparse
    assert sparse == 74880


def test_mixtral_every_layer_sparse_with_intermediate_size_experts() -> None:
    # 2 layers, 4 experts of intermediate_size (128), top-2.
    flops = _flops("mixtral")
    assert flops.moe is not None and flops.moe.sparse_layers == (0, 1)
    sparse = 2 * H * 4 + 2 * (3 * 2 * H * DENSE_I)
    assert flops.dense_flops_per_token() == 2 * (PROJECTIONS + sparse)


def test_dense_model_unchanged(tiny_llama_dir: Path) -> None:
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", max_model_len=256,
                        num_gpu_blocks_override=16).create_engine_config()
    flops = ModelFlops.from_config(config)
    assert flops.moe is None
    assert flops.dense_flops_per_token() == 2 * (PROJECTIONS + DENSE_MLP)


def _qwen3(**extra: Any) -> dict[str, Any]:
    return {"num_experts_per_tok": 2, "moe_intermediate_size": 8, **extra}


def test_sparse_layer_rule_and_expert_count_keys() -> None:
    read = MoeShape.from_hf_config
    # transformers 5 writes num_local_experts for the Qwen families too.
    assert read(_qwen3(num_local_experts=4), "qwen3_moe", 4).num_experts == 4
    assert read(_qwen3(num_experts=6, num_local_experts=4), "qwen3_moe", 4).num_experts == 6
    step2 = read(_qwen3(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3]),
                 "qwen2_moe", 6)
    assert step2.sparse_layers == (1, 5) and step2.shared_expert_intermediate_size == 0
    # The shared expert is Qwen2-MoE's only.
    shared = _qwen3(num_experts=4, shared_expert_intermediate_size=16)
    assert read(shared, "qwen2_moe", 2).shared_expert_intermediate_size == 16
    assert read(shared, "qwen3_moe", 2).shared_expert_intermediate_size == 0
    mixtral = read({"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
                    "mlp_only_layers": [0]}, "mixtral", 3)
    assert mixtral.sparse_layers == (0, 1, 2) and mixtral.moe_intermediate_size == 32
    with pytest.raises(ValueError, match="num_experts_per_tok 5"):
        read(_qwen3(num_experts=4, num_experts_per_tok=5), "qwen3_moe", 2, "Qwen3MoeForCausalLM")


def test_moe_shape_of_a_model_config(tiny_llama_dir: Path) -> None:
    dense = EngineArgs(model=str(tiny_llama_dir), device="cpu").create_engine_config()
    assert moe_shape(dense.model_config) is None
    moe = EngineArgs(model=str(tiny_model("qwen3moe")), device="cpu").create_engine_config()
    shape = moe_shape(moe.model_config)
    assert shape is not None and (shape.num_experts, shape.top_k) == (8, 2)
    # mlp_only_layers decides which layers are sparse.
    other = dataclasses.replace(moe.model_config, hf_config={
        **moe.model_config.hf_config, "mlp_only_layers": [0, 1]})
    assert moe_shape(other) == dataclasses.replace(shape, sparse_layers=(2,))


def _imports(path: Path) -> set[str]:
    """The modules `path` imports at module level (imports inside functions run later, if
    ever)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)  # and its names, which may be modules themselves
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module_file(name: str) -> Path | None:
    """The source file of a `ringserve.*` module (None for other packages and names that
    are not modules)."""
    if name != "ringserve" and not name.startswith("ringserve."):
        return None
    base = SRC.joinpath(*name.split(".")[1:])
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return path if path.is_file() else None


@pytest.mark.parametrize("module", ["ringserve.moe_shape", "ringserve.engine.metrics.flops",
                                    "ringserve.engine.metrics.expert_load"])
def test_imports_no_torch(module: str) -> None:
    """Neither the module nor any ringserve module it imports (transitively; package
    `__init__` files aside) imports torch."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        path = _module_file(name)
        if name in seen or path is None or path.name == "__init__.py":
            continue
        seen.add(name)
        imported = _imports(path)
        assert not any(n == "torch" or n.startswith("torch.") for n in imported), name
        todo.extend(imported)
    assert module in seen
