"""Random PEFT adapters for the tests (test support, like `ringserve.gpu.testing`: nothing in
the engine imports it): written by PEFT itself on a tiny model directory, with `lora_B` drawn
at random (PEFT starts it at zero, which would make every adapter a no-op), so PEFT on
transformers is the oracle.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ALL_TARGETS", "peft_adapter"]

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_adapter(base: Path, out: Path, *, r: int = 8, alpha: int = 16,
                 targets: Sequence[str] = ALL_TARGETS, seed: int = 0, use_rslora: bool = False,
                 rank_pattern: dict[str, int] | None = None,
                 alpha_pattern: dict[str, int] | None = None, scale: float = 0.05) -> Path:
    """A PEFT LoRA adapter for the model in `base`, saved (safetensors) in `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=use_rslora, rank_pattern=rank_pattern or {},
                        alpha_pattern=alpha_pattern or {}, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out
