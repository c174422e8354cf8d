"""An EAGLE head's configuration, read from its directory and checked against the target.

EAGLE heads (`method: "eagle"` for EAGLE-1/2, `"eagle3"` for EAGLE-3) are published as small
Hugging Face directories: a `config.json` in Llama's keys plus a few of EAGLE's own, and
safetensors weights named as the EAGLE authors' training code saves them (EAGLE-3:
`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` / `t2d`; EAGLE-1: `layers.0.*`, `fc`, and maybe
`embed_tokens`). Read once by the frontend's resolver (`config.resolve_speculative_config`),
so a missing or mismatched head fails before any process starts, and again by the worker that
builds the head (`eagle_head`). Imports no torch.

What is checked against the target: the head's `hidden_size` (and EAGLE-3's
`target_hidden_size`, when given) must be the target's, since the head concatenates the
target's token embeddings and hidden states; its `vocab_size` must be the target's; the
EAGLE-3 draft vocabulary (`draft_vocab_size`) must not be larger; the target layers whose
hidden states EAGLE-3 reads (`eagle_config.eagle_aux_hidden_state_layer_ids`, by default
vLLM's `(2, L // 2, L - 3)` for a target of `L` layers) must exist.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringserve.config import ModelConfig
from ringserve.errors import ModelDirectoryError

KEY = "speculative_config.model"


@dataclass(frozen=True)
class EagleHeadConfig:
    """The head's shape and options.

    Attributes:
        method: "eagle" or "eagle3".
        directory: the head's directory.
        hf: its config.json.
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size:
            the head's decoder shape.
        rms_norm_eps: its norms' epsilon.
        vocab_size: the target's vocabulary (the head's `vocab_size`).
        draft_vocab_size: EAGLE-3's own (smaller) output vocabulary; `vocab_size` for EAGLE-1.
        aux_layer_ids: EAGLE-3: the target layers whose input hidden states (the residual
            stream entering the layer) the head reads, concatenated in this order; EAGLE-1:
            empty (it reads the target's final normed hidden states).
        norm_before_residual: EAGLE-3's option: the residual stream starts from the normed
            hidden states rather than the raw ones.
    """

    method: str
    directory: str
    hf: dict[str, Any]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool

    @classmethod
    def read(cls, method: str, directory: str, target: ModelConfig) -> EagleHeadConfig:
        """Read and check the head in `directory` for `target`.

        Raises:
            ModelDirectoryError: no such directory, an unreadable config.json, or no
                safetensors weights (the message starts with `speculative_config.model`).
            ValueError: a head that does not fit the target or the method (the message
                names the key).
        """
        path = Path(directory)
        if not path.is_dir():
            raise ModelDirectoryError(f"{KEY}: the EAGLE head {directory} is not a directory")
        try:
            hf = json.loads((path / "config.json").read_text())
            if not isinstance(hf, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            raise ModelDirectoryError(f"{KEY}: the EAGLE head's {path / 'config.json'} is "
                                      f"unreadable ({exc})") from None
        if not any(path.glob("*.safetensors")):
            found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            raise ModelDirectoryError(
                f"{KEY}: the EAGLE head {directory} has no *.safetensors weights"
                + (f" (only pickled {', '.join(found)}: ringserve loads safetensors only, since "
                   f"loading a pickle runs code from the file; convert it once with "
                   f"safetensors.torch.save_file(torch.load(FILE), 'model.safetensors'))"
                   if found else ""))
        _check_architecture(method, hf, directory)
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            kv_heads = int(hf.get("num_key_value_heads") or heads)
            head_dim = int(hf.get("head_dim") or hidden // heads)
            layers = int(hf.get("num_hidden_layers") or 1)
            inter = int(hf["intermediate_size"])
            vocab = int(hf.get("vocab_size") or target.vocab_size)
            draft_vocab = int(hf.get("draft_vocab_size") or vocab)
            eps = float(hf.get("rms_norm_eps", 1e-6))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{KEY}: the EAGLE head's config.json lacks or garbles {exc} "
                             f"({directory})") from None
        if hidden != target.hidden_size:
            raise ValueError(f"{KEY}: the EAGLE head's hidden_size is {hidden}, the target's "
                             f"{target.hidden_size}; a head must be trained for the target "
                             f"({directory})")
        target_hidden = hf.get("target_hidden_size")
        if target_hidden is not None and int(target_hidden) != target.hidden_size:
            raise ValueError(f"{KEY}: the EAGLE head's target_hidden_size is {target_hidden}, "
                             f"the target's hidden_size {target.hidden_size} ({directory})")
        if vocab != target.vocab_size:
            raise ValueError(f"{KEY}: the EAGLE head's vocab_size is {vocab}, the target's "
                             f"{target.vocab_size} ({directory})")
        if not 1 <= draft_vocab <= vocab:
            raise ValueError(f"{KEY}: the EAGLE head's draft_vocab_size is {draft_vocab}, "
                             f"allowed: 1..{vocab} (the vocab_size) ({directory})")
        if layers < 1 or heads < 1 or kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"{KEY}: the EAGLE head's num_hidden_layers / num_attention_heads "
                             f"/ num_key_value_heads ({layers} / {heads} / {kv_heads}) do not "
                             f"make a decoder ({directory})")
        aux = _aux_layer_ids(method, hf, target.num_hidden_layers, directory)
        return cls(method=method, directory=str(path), hf=hf, hidden_size=hidden,
                   num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   intermediate_size=inter, rms_norm_eps=eps, vocab_size=vocab,
                   draft_vocab_size=draft_vocab if method == "eagle3" else vocab,
                   aux_layer_ids=aux, norm_before_residual=bool(hf.get("norm_before_residual")))


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default EAGLE-3 layers for a target of `num_layers` layers."""
    return (2, num_layers // 2, num_layers - 3)


def _check_architecture(method: str, hf: dict[str, Any], directory: str) -> None:
    names = [str(a) for a in hf.get("architectures") or []]
    eagle3 = any("eagle3" in name.lower() for name in names)
    if method == "eagle3" and names and not eagle3:
        raise ValueError(f"speculative_config.method: 'eagle3', but the head in {directory} "
                         f"is a {', '.join(names)} (an EAGLE-3 head names an Eagle3 "
                         f"architecture, e.g. LlamaForCausalLMEagle3); use method 'eagle' for "
                         f"an EAGLE-1/2 head")
    if method == "eagle" and eagle3:
        raise ValueError(f"speculative_config.method: 'eagle', but the head in {directory} is "
                         f"an EAGLE-3 head ({', '.join(names)}); use method 'eagle3'")


def _aux_layer_ids(method: str, hf: dict[str, Any], num_layers: int,
                   directory: str) -> tuple[int, ...]:
    if method != "eagle3":
        return ()
    eagle = hf.get("eagle_config") or {}
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state") is False:
        raise ValueError(f"{KEY}: the EAGLE-3 head in {directory} reads no auxiliary hidden "
                         f"states (eagle_config.use_aux_hidden_state: false), which ringserve "
                         f"does not support")
    given = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    ids = tuple(int(i) for i in given) if given else default_aux_layer_ids(num_layers)
    if len(ids) != 3 or any(not 0 <= i < num_layers for i in ids):
        where = "eagle_config.eagle_aux_hidden_state_layer_ids" if given else \
            "the default layers (2, L // 2, L - 3)"
        raise ValueError(f"{KEY}: the EAGLE-3 head reads target layers {list(ids)} "
                         f"({where}), allowed: three of 0..{num_layers - 1} (the target has "
                         f"{num_layers} layers); set eagle_config.eagle_aux_hidden_state_"
                         f"layer_ids in the head's config.json ({directory})")
    return ids
