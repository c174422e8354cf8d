"""The SigLIP vision transformer that Gemma 3 and Idefics3 / SmolVLM share, and the strict
checkpoint loading both of their encoders use.

`ringserve.gpu.multimodal.gemma3_vision` and `ringserve.gpu.multimodal.idefics3_vision` build a
`SiglipVisionTransformer` from the checkpoint's `vision_config` and put their projector on top;
nothing else talks to this module. Submodules carry transformers' names (`embeddings.*`,
`encoder.layers.N.*`, `post_layernorm.*`) so checkpoint tensors load without renaming.

The two families differ only in position ids: Gemma 3 feeds fixed-size square images and adds
the position table in order; Idefics3 feeds tiles with a pixel mask and buckets each real patch's
fractional coordinate into the table (NaViT's "Patch n' Pack"), so a tile smaller than the
table still spans all of it. Attention then ignores padded patches as keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# `hidden_act` -> the function; every SigLIP checkpoint uses the tanh approximation, which
# transformers spells three ways.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class SiglipSpec:
    """The shape of a SigLIP vision tower, read from a checkpoint's `vision_config`."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, Any],
                defaults: Mapping[str, Any]) -> SiglipSpec:
        """Read `vision_config`, taking a key it omits from `defaults` (the family's
        transformers config defaults: published `config.json` files leave some out).

        Raises:
            ValueError: a setting this tower does not run.
        """
        merged = {**defaults, **vision_config}
        spec = cls(hidden_size=int(merged["hidden_size"]),
                   intermediate_size=int(merged["intermediate_size"]),
                   num_layers=int(merged["num_hidden_layers"]),
                   num_heads=int(merged["num_attention_heads"]),
                   num_channels=int(merged["num_channels"]),
                   image_size=_square(merged["image_size"], "image_size"),
                   patch_size=_square(merged["patch_size"], "patch_size"),
                   layer_norm_eps=float(merged["layer_norm_eps"]),
                   hidden_act=str(merged["hidden_act"]))
        if spec.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {spec.hidden_act!r} is not supported; "
                             f"supported: {sorted(_ACTIVATIONS)}")
        if spec.hidden_size % spec.num_heads:
            raise ValueError(f"vision_config.hidden_size {spec.hidden_size} is not a multiple of "
                             f"num_attention_heads {spec.num_heads}")
        return spec

    @property
    def patches_per_side(self) -> int:
        """Side of the learned position table (patches along one edge of a full image)."""
        return self.image_size // self.patch_size


def _square(value: object, key: str) -> int:
    """An int size, or a [n, n] pair of equal ints (transformers allows both)."""
    if isinstance(value, list | tuple) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    if not isinstance(value, int):
        raise ValueError(f"vision_config.{key} {value!r}: only square sizes are supported")
    return value


class SiglipEmbeddings(nn.Module):
    """Patch embedding (a strided conv) plus a learned position per patch."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(spec.num_channels, spec.hidden_size,
                                         kernel_size=spec.patch_size, stride=spec.patch_size)
        self.position_embedding = nn.Embedding(spec.patches_per_side ** 2, spec.hidden_size)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """[n, C, H, W] pixels and [n, patches] (or [patches]) position ids -> [n, patches,
        hidden], patches in row-major order."""
        patches: torch.Tensor = self.patch_embedding(
            pixel_values.to(self.patch_embedding.weight.dtype))
        positions: torch.Tensor = self.position_embedding(position_ids)
        return patches.flatten(2).transpose(1, 2) + positions


def bucketed_position_ids(patch_mask: torch.Tensor, patches_per_side: int) -> torch.Tensor:
    """Idefics3's position ids for tiles with padding: [n, rows, cols] bool (True for a patch
    holding any real pixel) -> [n, rows * cols].

    Each real patch's fractional coordinate (index / real patches along that axis) is bucketed
    into the `patches_per_side` grid of the position table; padded patches get id 0. The float32
    arithmetic follows transformers' `Idefics3VisionEmbeddings` step for step, since a coordinate
    on a bucket boundary lands on either side depending on rounding.
    """
    n, rows, cols = patch_mask.shape
    device = patch_mask.device
    boundaries = torch.arange(1 / patches_per_side, 1.0, 1 / patches_per_side,
                              dtype=torch.float32, device=device)
    real_rows = patch_mask[:, :, 0].sum(dim=1).to(torch.float32)
    real_cols = patch_mask[:, 0, :].sum(dim=1).to(torch.float32)
    step_h, step_w = 1.0 / real_rows, 1.0 / real_cols
    frac_h = torch.arange(rows, dtype=torch.float32, device=device)[None, :] * step_h[:, None]
    frac_w = torch.arange(cols, dtype=torch.float32, device=device)[None, :] * step_w[:, None]
    bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
    bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
    ids = (bucket_h[:, :, None] * patches_per_side + bucket_w[:, None, :]).reshape(n, -1)
    return torch.where(patch_mask.reshape(n, -1), ids, torch.zeros_like(ids))


class SiglipAttention(nn.Module):
    """Bidirectional multi-head self-attention over one image's (or tile's) patches."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_heads
        self.k_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.v_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.q_proj = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.out_proj = nn.Linear(spec.hidden_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """[n, seq, hidden] -> same; `key_mask` [n, 1, 1, seq] bool (True: attend) or None."""
        n, seq, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, seq, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                             heads(self.v_proj(x)), attn_mask=key_mask)
        projected: torch.Tensor = self.out_proj(out.transpose(1, 2).reshape(n, seq, hidden))
        return projected


class SiglipMLP(nn.Module):
    """fc1, GELU, fc2."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., hidden]."""
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class SiglipEncoderLayer(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.self_attn = SiglipAttention(spec)
        self.layer_norm2 = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.mlp = SiglipMLP(spec)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """[n, seq, hidden] -> same."""
        attended: torch.Tensor = self.self_attn(self.layer_norm1(x), key_mask)
        x = x + attended
        mixed: torch.Tensor = self.mlp(self.layer_norm2(x))
        return x + mixed


class SiglipEncoder(nn.Module):
    """The stack of encoder layers (`encoder.layers.N` in checkpoints)."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(spec) for _ in range(spec.num_layers))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """[n, seq, hidden] -> same."""
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


class SiglipVisionTransformer(nn.Module):
    """Embeddings, encoder and the final LayerNorm: pixels in, one hidden state per patch out
    (transformers' `last_hidden_state`; the attention-pooling head is not part of it)."""

    def __init__(self, spec: SiglipSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = SiglipEmbeddings(spec)
        self.encoder = SiglipEncoder(spec)
        self.post_layernorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor,
                patch_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[n, C, H, W] -> [n, (H / patch) * (W / patch), hidden].

        Without `patch_mask` every patch is real and position ids run in order, which needs
        H = W = image_size (Gemma 3). With it ([n, H / patch, W / patch] bool, True for a patch
        holding any real pixel) position ids are bucketed and padded patches are not attended
        to, though they still get hidden states (Idefics3 keeps them, as transformers does).
        """
        if patch_mask is None:
            positions = torch.arange(self.spec.patches_per_side ** 2, device=pixel_values.device)
            key_mask = None
        else:
            positions = bucketed_position_ids(patch_mask, self.spec.patches_per_side)
            # No mask at all when nothing is padded, so SDPA may pick its fused kernels.
            key_mask = None if bool(patch_mask.all()) else patch_mask.reshape(
                patch_mask.shape[0], 1, 1, -1)
        x = self.embeddings(pixel_values, positions)
        out: torch.Tensor = self.post_layernorm(self.encoder(x, key_mask))
        return out


def build_on(module_factory: Callable[[], nn.Module], dtype: torch.dtype,
             device: torch.device) -> nn.Module:
    """Build a module without initialising its parameters (on the meta device, then given
    uninitialised storage on `device`): `load_weights` fills every one or refuses."""
    with torch.device("meta"):
        module = module_factory()
    return module.to(dtype).to_empty(device=device)


def load_strict(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                canonical: Callable[[str], str | None]) -> None:
    """Copy checkpoint tensors into `module`'s parameters, all or refuse.

    Args:
        module: the encoder.
        weights: (checkpoint name, tensor) pairs.
        canonical: checkpoint name -> the parameter name in `module`, or None for a tensor that
            is known and deliberately unused (skipped).

    Raises:
        ValueError: a name matches no parameter, a tensor's shape or dtype does not fit, or a
            parameter got no tensor (naming the first missing).
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target = canonical(name)
        if target is None:
            continue
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                             f"{type(module).__name__}")
        if tuple(tensor.shape) != tuple(param.shape) or not tensor.dtype.is_floating_point:
            raise ValueError(f"checkpoint tensor {name!r}: {tensor.dtype} {list(tensor.shape)}, "
                             f"expected a float tensor of shape {list(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(target)
    missing = [name for name in params if name not in loaded]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors {type(module).__name__} "
                         f"needs, first {missing[0]!r}")
