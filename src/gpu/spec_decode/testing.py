"""Random-weight EAGLE heads in their published layouts, for tests and benchmarks.

`tiny_eagle_head(target_dir, out_dir, method="eagle3")` writes what an EAGLE-3 head on the
Hub holds (a `config.json` naming `LlamaForCausalLMEagle3` with `draft_vocab_size` and
`eagle_config`, and `model.safetensors` with `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`,
`t2d`); `method="eagle"` an EAGLE-1 head (`layers.0.*` without the first input norm, `fc`
over `[embedding, hidden]` with a bias, the target's LM head). The weights are random: the
drafts they propose are rarely accepted, which is what greedy-equality tests want to survive.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def tiny_eagle_head(target_dir: Path, out_dir: Path, *, method: str = "eagle3",
                    draft_vocab_size: int | None = 512, aux_layer_ids: list[int] | None = None,
                    num_layers: int = 1, seed: int = 0, own_embedding: bool = False) -> Path:
    """Write a random head for the target in `target_dir` into `out_dir`; returns `out_dir`.

    Args:
        method: "eagle3" or "eagle".
        draft_vocab_size: EAGLE-3's draft vocabulary (None: the target's whole vocabulary,
            and no `d2t`).
        aux_layer_ids: EAGLE-3's target layers (written into `eagle_config`); None: the
            config says nothing and the default applies.
        num_layers: the head's decoder layers.
        own_embedding: ship `embed_tokens.weight` (otherwise the target's is used).
    """
    target = json.loads((target_dir / "config.json").read_text())
    hidden = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    kv_heads = int(target.get("num_key_value_heads") or heads)
    head_dim = int(target.get("head_dim") or hidden // heads)
    vocab = int(target["vocab_size"])
    inter = 2 * hidden
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        return 1.0 + rand(hidden, std=0.1)

    eagle3 = method == "eagle3"
    tensors: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        prefix = "midlayer" if eagle3 and num_layers == 1 else f"layers.{i}"
        width = 2 * hidden if eagle3 and i == 0 else hidden
        tensors[f"{prefix}.self_attn.q_proj.weight"] = rand(heads * head_dim, width)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = rand(kv_heads * head_dim, width)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = rand(kv_heads * head_dim, width)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        tensors[f"{prefix}.mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[f"{prefix}.mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[f"{prefix}.mlp.down_proj.weight"] = rand(hidden, inter)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = norm()
        if eagle3 or i > 0:
            tensors[f"{prefix}.input_layernorm.weight"] = norm()
        if eagle3 and i == 0:
            tensors[f"{prefix}.hidden_norm.weight"] = norm()
    config: dict[str, object] = {
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": inter, "num_hidden_layers": num_layers,
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)), "vocab_size": vocab,
        "max_position_embeddings": int(target.get("max_position_embeddings", 2048)),
        "rope_theta": float(target.get("rope_theta", 10000.0)), "model_type": "llama",
        "torch_dtype": "float32",
    }
    if eagle3:
        tensors["fc.weight"] = rand(hidden, 3 * hidden)
        tensors["norm.weight"] = norm()
        draft = draft_vocab_size or vocab
        tensors["lm_head.weight"] = rand(draft, hidden, std=0.3)
        if draft_vocab_size is not None:
            chosen = torch.randperm(vocab, generator=gen)[:draft].sort().values
            tensors["d2t"] = chosen - torch.arange(draft)
            t2d = torch.zeros(vocab, dtype=torch.bool)
            t2d[chosen] = True
            tensors["t2d"] = t2d
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft,
                      target_hidden_size=hidden)
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    else:
        tensors["fc.weight"] = rand(hidden, 2 * hidden)
        tensors["fc.bias"] = rand(hidden)
        config.update(architectures=["EagleLlamaForCausalLM"])
    if own_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, hidden, std=0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir
