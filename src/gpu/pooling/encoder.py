"""Bidirectional encoders: BERT and XLM-RoBERTa, bare (`BertModel`, `XLMRobertaModel`: the
backbone of sentence-transformers embedding models) or with their sequence-classification
head (cross-encoders and classifiers), loaded from Hugging Face checkpoints.

The pooling runner (`ringserve.gpu.pooling.encoder_runner`) builds one through
`model_class_for(architecture).from_config(config)`, feeds it checkpoint tensors through
`load_weights`, calls `forward` on a packed batch (several inputs back to back, no padding)
and `classify` on each input's first hidden state; `ringserve.gpu.pooling.pooler` pools the
rest. There is no KV cache: each input runs whole, attending to itself only, both ways.

Weights follow the checkpoints' layout (`embeddings.*`, `encoder.layer.N.*`, the head) with or
without the `bert.` / `roberta.` prefix; query, key and value are fused into one projection
so a layer runs one matmul for them over every token of the batch. Attention runs
`scaled_dot_product_attention` once per distinct input length (inputs of one length
together), so no input attends past its own tokens and none is padded. On CPU everything
computes in float32 whatever the configured dtype (bf16 weights are widened at load); other
devices compute in the configured dtype. `forward` returns float32 either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from ringserve.config import ModelConfig
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear, check_shape
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.pooling.layout import ENCODER_ARCHITECTURES, classifier_labels

__all__ = ["ENCODER_ARCHITECTURES", "EncoderModel", "model_class_for"]

# `hidden_act` -> the function (transformers' names; gelu_new, gelu_fast and
# gelu_pytorch_tanh are all the tanh approximation).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PREFIXES = ("bert.", "roberta.")
# Inside `encoder.layer.N.`: checkpoint module -> (this model's module, fused shard).
_LAYER_NAMES: dict[str, tuple[str, int]] = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", 0),
    "attention.output.LayerNorm": ("attn_norm", 0),
    "intermediate.dense": ("up", 0),
    "output.dense": ("down", 0),
    "output.LayerNorm": ("ffn_norm", 0),
}
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings.weight": "embeddings.word",
    "embeddings.position_embeddings.weight": "embeddings.position",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
}
# The classification head, per family: the same maths (tanh(dense(first token)), then a
# linear to the labels) under BERT's and RoBERTa's names.
_HEAD_NAMES = {
    "bert": {"pooler.dense": "head.dense", "classifier": "head.out"},
    "roberta": {"classifier.dense": "head.dense", "classifier.out_proj": "head.out"},
}
# architecture -> (family, has a classification head)
_FAMILIES = {
    "BertModel": ("bert", False),
    "BertForSequenceClassification": ("bert", True),
    "XLMRobertaModel": ("roberta", False),
    "XLMRobertaForSequenceClassification": ("roberta", True),
}


@dataclass(frozen=True, slots=True)
class EncoderSpec:
    """An encoder's shape, read from its `config.json`.

    Attributes:
        family: "bert" or "roberta" (checkpoint names of the head; RoBERTa's positions).
        position_offset: the first position id of every input (0 for BERT; XLM-RoBERTa's
            padding index + 1).
        num_labels: the classifier's labels (0: no classification head).
        dtype: the dtype the weights are kept and computed in.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    layer_norm_eps: float
    max_positions: int
    type_vocab_size: int
    position_offset: int
    num_labels: int
    dtype: torch.dtype

    @classmethod
    def from_hf(cls, architecture: str, hf: dict[str, Any], dtype: torch.dtype) -> EncoderSpec:
        """Read `config.json`; transformers' defaults where a key is absent.

        Raises:
            ValueError: not an encoder architecture, or a setting this encoder does not run
                (the activation, relative position embeddings, heads that do not divide
                the hidden size).
        """
        if architecture not in _FAMILIES:
            raise ValueError(f"architecture: {architecture} is not an encoder (allowed: "
                             f"{', '.join(ENCODER_ARCHITECTURES)})")
        family, head = _FAMILIES[architecture]
        act = str(hf.get("hidden_act", "gelu"))
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: got {act!r}, allowed: {', '.join(ACTIVATIONS)}")
        kind = hf.get("position_embedding_type") or "absolute"
        if kind != "absolute":
            raise ValueError(f"position_embedding_type: got {kind!r}, allowed: absolute")
        hidden, heads = int(hf.get("hidden_size", 768)), int(hf.get("num_attention_heads", 12))
        if hidden % heads:
            raise ValueError(f"num_attention_heads ({heads}) must divide hidden_size "
                             f"({hidden})")
        pad = hf.get("pad_token_id")
        return cls(
            family=family,
            vocab_size=int(hf.get("vocab_size", 30522)),
            hidden_size=hidden,
            num_layers=int(hf.get("num_hidden_layers", 12)),
            num_heads=heads,
            intermediate_size=int(hf.get("intermediate_size", 3072)),
            hidden_act=act,
            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            max_positions=int(hf.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            # RoBERTa numbers positions from padding_idx + 1 (its padding position is
            # padding_idx itself); transformers' default pad id for it is 1.
            position_offset=(int(1 if pad is None else pad) + 1) if family == "roberta" else 0,
            num_labels=len(classifier_labels(hf)) if head else 0,
            dtype=dtype,
        )


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension (checkpoint names `weight` / `bias`)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised `x`."""
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class Embeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm."""

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        h, dtype = spec.hidden_size, spec.dtype
        self.word = nn.Parameter(torch.empty(spec.vocab_size, h, dtype=dtype),
                                 requires_grad=False)
        self.position = nn.Parameter(torch.empty(spec.max_positions, h, dtype=dtype),
                                     requires_grad=False)
        self.token_type = nn.Parameter(torch.empty(spec.type_vocab_size, h, dtype=dtype),
                                       requires_grad=False)
        self.norm = LayerNorm(h, spec.layer_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """[T, H] embeddings of a packed batch."""
        x = F.embedding(input_ids, self.word) + F.embedding(positions, self.position)
        # Without token types every token is type 0: one row, broadcast.
        types = self.token_type[0] if token_type_ids is None else F.embedding(
            token_type_ids, self.token_type)
        return self.norm.forward(x + types)


@dataclass(frozen=True, slots=True)
class _LengthGroup:
    """The inputs of one length in a packed batch: `count` inputs of `length` tokens, at the
    rows `rows` ([count * length], input after input) or, for a lone input, from `start`."""

    length: int
    count: int
    start: int
    rows: torch.Tensor | None


def _length_groups(starts: npt.NDArray[np.int64], device: torch.device) -> list[_LengthGroup]:
    """Group a packed batch's inputs by length, so each group's attention is one batched
    `scaled_dot_product_attention` call with no padding."""
    lengths = np.diff(starts)
    groups: list[_LengthGroup] = []
    for length in np.unique(lengths).tolist():
        members = np.flatnonzero(lengths == length)
        if members.size == 1:
            groups.append(_LengthGroup(length, 1, int(starts[members[0]]), None))
            continue
        rows = (starts[members][:, None] + np.arange(length, dtype=np.int64)).reshape(-1)
        groups.append(_LengthGroup(length, int(members.size), 0,
                                   torch.from_numpy(rows).to(device)))
    return groups


class EncoderLayer(nn.Module):
    """One post-norm transformer layer: bidirectional self-attention, then the MLP, each
    followed by residual + LayerNorm."""

    def __init__(self, spec: EncoderSpec, tp: TPGroup) -> None:
        super().__init__()
        h, dtype, eps = spec.hidden_size, spec.dtype, spec.layer_norm_eps
        self.num_heads = spec.num_heads
        self.head_dim = h // spec.num_heads
        self.qkv = ColumnParallelLinear(h, [h, h, h], bias=True, tp=tp, dtype=dtype)
        self.attn_out = RowParallelLinear(h, h, bias=True, tp=tp, dtype=dtype)
        self.attn_norm = LayerNorm(h, eps, dtype)
        self.up = ColumnParallelLinear(h, [spec.intermediate_size], bias=True, tp=tp,
                                       dtype=dtype)
        self.down = RowParallelLinear(spec.intermediate_size, h, bias=True, tp=tp, dtype=dtype)
        self.ffn_norm = LayerNorm(h, eps, dtype)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor, groups: list[_LengthGroup]) -> torch.Tensor:
        """[T, H] -> [T, H] over a packed batch whose inputs `groups` describes."""
        context = self.attention(self.qkv.forward(x), groups)
        x = self.attn_norm.forward(self.attn_out.forward(context) + x)
        return self.ffn_norm.forward(self.down.forward(self.act(self.up.forward(x))) + x)

    def attention(self, qkv: torch.Tensor, groups: list[_LengthGroup]) -> torch.Tensor:
        """Each input's tokens attend to all of its own tokens and to no other input's."""
        tokens, hidden = qkv.shape[0], qkv.shape[1] // 3
        if len(groups) == 1:  # inputs of one length: already in order, no gather or scatter
            return self._attend(qkv, groups[0].count, groups[0].length)
        context = qkv.new_empty(tokens, hidden)
        for g in groups:
            if g.rows is None:
                context[g.start:g.start + g.length] = self._attend(
                    qkv[g.start:g.start + g.length], 1, g.length)
            else:
                context.index_copy_(0, g.rows, self._attend(qkv.index_select(0, g.rows),
                                                             g.count, g.length))
        return context

    def _attend(self, qkv: torch.Tensor, count: int, length: int) -> torch.Tensor:
        """Attention of `count` inputs of `length` tokens ([count * length, 3H] rows, input
        after input) -> [count * length, H]."""
        q, k, v = qkv.view(count, length, 3, self.num_heads, self.head_dim).permute(
            2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)  # [count, heads, length, head_dim]
        return out.transpose(1, 2).reshape(count * length, -1)


class ClassifierHead(nn.Module):
    """tanh(dense(first token)), then a linear layer to the labels: BERT's pooler +
    classifier and RoBERTa's classification head alike."""

    def __init__(self, spec: EncoderSpec, tp: TPGroup) -> None:
        super().__init__()
        h = spec.hidden_size
        self.dense = ColumnParallelLinear(h, [h], bias=True, tp=tp, dtype=spec.dtype)
        self.out = ColumnParallelLinear(h, [spec.num_labels], bias=True, tp=tp, dtype=spec.dtype)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        """[B, H] -> [B, num_labels] logits."""
        return self.out.forward(torch.tanh(self.dense.forward(first)))


class EncoderModel(nn.Module):
    """A BERT or XLM-RoBERTa encoder, with its classification head when the architecture has
    one.

    Attributes:
        num_labels: the classifier's labels (0: no classification head).
        hidden_size: the width of the hidden states `forward` returns.
        type_vocab_size: the token types the model knows (1 for XLM-RoBERTa: every token
            is type 0).
    """

    def __init__(self, spec: EncoderSpec) -> None:
        super().__init__()
        tp = TPGroup()
        self.spec = spec
        self.num_labels = spec.num_labels
        self.hidden_size = spec.hidden_size
        self.type_vocab_size = spec.type_vocab_size
        self.embeddings = Embeddings(spec)
        self.layers = nn.ModuleList(EncoderLayer(spec, tp) for _ in range(spec.num_layers))
        self.head = ClassifierHead(spec, tp) if spec.num_labels else None

    @classmethod
    def from_config(cls, config: ModelConfig) -> EncoderModel:
        """The model of `config.architecture`, its parameters uninitialised, on the current
        default device (`with torch.device(...)`): float32 on CPU, `config.dtype` elsewhere.

        Raises:
            ValueError: not an encoder architecture, or a setting it does not run.
        """
        on_cpu = torch.get_default_device().type == "cpu"
        dtype = torch.float32 if on_cpu else _DTYPES.get(config.dtype, torch.float32)
        return cls(EncoderSpec.from_hf(config.architecture, config.hf_config, dtype))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names, with or without the `bert.` /
        `roberta.` prefix; `LayerNorm.gamma` / `beta` as `weight` / `bias`) into the model.
        Tensors the model has no use for (`pooler.*` without a head, `position_ids`, a
        masked-LM head) are skipped. The tensors may be reused by the caller afterwards.

        Raises:
            ValueError: a tensor of the wrong shape or dtype (naming it), or one the model
                needs is missing (naming the first).
        """
        targets = self._targets()
        modules = dict(self.named_modules())
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            canonical = _canonical_name(name)
            if canonical not in targets:
                continue
            target, shard = targets[canonical]
            owner, _, leaf = target.rpartition(".")
            try:
                module = modules[owner]
                if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                    module.load(leaf, tensor, shard)
                else:
                    check_shape(tensor, tuple(params[target].shape))
                    params[target].data.copy_(tensor)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {name!r}: {exc}") from None
            loaded.add(canonical)
        missing = [n for n in targets if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors the "
                             f"{type(self).__name__} needs, first {missing[0]!r}")

    def _targets(self) -> dict[str, tuple[str, int]]:
        """Canonical checkpoint name -> (this model's parameter, fused shard), in order."""
        targets = {src: (dst, 0) for src, dst in _EMBEDDING_NAMES.items()}
        modules = {f"encoder.layer.{i}.{src}": (f"layers.{i}.{dst}", shard)
                   for i in range(self.spec.num_layers)
                   for src, (dst, shard) in _LAYER_NAMES.items()}
        if self.head is not None:
            modules.update({src: (dst, 0) for src, dst in _HEAD_NAMES[self.spec.family].items()})
        for src, (dst, shard) in modules.items():  # every linear and norm has a bias
            targets[f"{src}.weight"] = (f"{dst}.weight", shard)
            targets[f"{src}.bias"] = (f"{dst}.bias", shard)
        return targets

    def process_weights_after_loading(self) -> None:
        """Repack the linear layers for this device's fastest matmul (see
        `ringserve.gpu.layers.linear`)."""
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                module.process_weights_after_loading()

    def forward(self, input_ids: torch.Tensor, query_start_loc: npt.NDArray[Any],
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        """The last hidden state of a packed batch.

        Args:
            input_ids: int64 [T]: B inputs back to back, no padding.
            query_start_loc: int [B + 1] prefix sums of the inputs' lengths (host).
            token_type_ids: int64 [T] token types, or None (every token type 0).

        Returns:
            [T, H] float32.

        Raises:
            ValueError: `query_start_loc` does not cover `input_ids`, an input is empty, or
                one is longer than the model's positions.
        """
        starts = np.asarray(query_start_loc, dtype=np.int64)
        tokens = input_ids.shape[0]
        if starts.ndim != 1 or starts.size < 2 or starts[0] != 0 or starts[-1] != tokens:
            raise ValueError(f"query_start_loc must run from 0 to the {tokens} input ids; "
                             f"got {starts.tolist()[:8]}")
        lengths = np.diff(starts)
        longest = self.spec.max_positions - self.spec.position_offset
        if int(lengths.min()) < 1 or int(lengths.max()) > longest:
            raise ValueError(f"input lengths must be 1..{longest} tokens (the model's "
                             f"positions); got {int(lengths.min())}..{int(lengths.max())}")
        positions = np.arange(tokens, dtype=np.int64) - np.repeat(starts[:-1], lengths)
        device = input_ids.device
        x = self.embeddings.forward(
            input_ids, torch.from_numpy(positions + self.spec.position_offset).to(device),
            token_type_ids)
        groups = _length_groups(starts, device)
        for layer in self.layers:
            x = layer.forward(x, groups)
        return x.float()

    def classify(self, first_token_hidden: torch.Tensor) -> torch.Tensor:
        """The classification head's logits [B, num_labels] (float32) over each input's
        first hidden state [B, H].

        Raises:
            RuntimeError: the model has no classification head.
        """
        if self.head is None:
            raise RuntimeError(f"{self.spec.family} encoder without a classification head "
                               "cannot classify")
        return self.head.forward(first_token_hidden.to(self.spec.dtype)).float()


def model_class_for(architecture: str) -> type[EncoderModel] | None:
    """The model class of an encoder architecture (one of `ENCODER_ARCHITECTURES`), or None
    for any other architecture."""
    return EncoderModel if architecture in ENCODER_ARCHITECTURES else None


def _canonical_name(name: str) -> str:
    """A checkpoint name without the backbone's prefix, in today's LayerNorm names."""
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.endswith(".gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith(".beta"):
        name = name[: -len("beta")] + "bias"
    return name
