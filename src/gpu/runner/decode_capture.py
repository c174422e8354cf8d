"""The captured decode step: a pure-decode batch runs every decoder layer in one call,
without per-op dispatch (`--enforce-eager` turns it off; `--cuda-graph-sizes` sets the ladder).

The model runner builds a `DecodeCapture` once the KV cache exists (start-up and wake-up) and
asks it, each step, whether it takes the step: every scheduled request decodes one token and
there are at most as many as the largest captured batch size. On CPU the step is the fused C
kernel (`decode_step.c`, in the library of `ringserve.gpu.native.panel`): its tables point at
the layers' panel weights (float32, int8 or int4), norms, rope table and KV caches, and one
call runs embedding -> layers -> final norm for the batch; the LM head and the sampler stay
with the runner. Python allocates nothing per layer: the activations live in one work buffer
made at capture time for the largest batch of the ladder.

What the C step covers is what the eager Llama stack (`ringserve.gpu.models.llama.LlamaModel`)
computes: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm) and Phi-3, sliding windows
included, and the mixtures of experts (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert:
router, top-k and the experts' panels in C too), at tensor-parallel size 1 without expert
parallelism, in float32 with the CPU attention backend. Any other model
or setting runs eagerly; `DecodeCapture.build` returns the reason, which the runner logs once.

On CPU a batch needs no fixed shape: a step of B decodes runs B rows, for any B up to the
largest captured size (a CUDA graph would run the smallest captured size >= B with padding
rows; CUDA-graph capture is not built yet).
"""

from __future__ import annotations

import ctypes
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ringserve.gpu.attention import cpu_native
from ringserve.gpu.layers.linear import ColumnParallelLinear, RowParallelLinear
from ringserve.gpu.layers.norm import RMSNorm
from ringserve.gpu.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from ringserve.gpu.models.moe import SparseMoeBlock
from ringserve.gpu.moe.cpu_experts import PackedExperts
from ringserve.gpu.native.panel import PanelWeight, RsWeight, pack_f32
from ringserve.gpu.runner.input_prep import StepInputs

_ptr = ctypes.c_void_p
_i64 = ctypes.c_int64


class _RsMoe(ctypes.Structure):
    _fields_ = [
        ("router", RsWeight), ("w13", _ptr), ("w2", _ptr), ("num_experts", _i64),
        ("top_k", _i64), ("renormalize", _i64), ("load", _ptr), ("shared_gate", _ptr),
        ("shared_inter", _i64),
    ]


class _RsLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", RsWeight), ("o", RsWeight), ("gate_up", RsWeight), ("down", RsWeight),
        ("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
        ("kv_cache", _ptr), ("window", _i64), ("moe", _ptr), ("lora", _ptr * 4),
    ]


class _RsModel(ctypes.Structure):
    _fields_ = [
        ("num_layers", _i64), ("hidden", _i64), ("num_heads", _i64), ("num_kv_heads", _i64),
        ("head_dim", _i64), ("intermediate", _i64), ("rotary_dim", _i64),
        ("max_position", _i64), ("num_slots", _i64), ("block_size", _i64), ("vocab", _i64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("cos_sin", _ptr), ("embedding", _ptr), ("final_norm", _ptr), ("layers", _ptr),
        ("embedding_rows", _ptr),
    ]


class _RsStep(ctypes.Structure):
    _fields_ = [
        ("n", _i64), ("token_ids", _ptr), ("positions", _ptr), ("slots", _ptr),
        ("tables", _ptr), ("max_blocks", _i64), ("lens", _ptr), ("max_len", _i64),
        ("out", _ptr), ("work", _ptr), ("nthreads", _i64), ("abort_flag", _ptr),
        ("aux_layers", _ptr), ("num_aux", _i64), ("aux_out", _ptr), ("row_slots", _ptr),
    ]


class StepAborted(Exception):
    """The step stopped between two layers: its abort flag was raised (a pause came,
    `ringserve.gpu.executor.step_hold`); nothing was sampled and the step is taken back."""


def abort_check(flag: int) -> Callable[[], None]:
    """What an eager forward runs between layers (`LlamaModel.between_layers`): raises
    `StepAborted` once the byte at address `flag` (the step-hold flag) is nonzero, so an eager
    step (a long prefill chunk) ends at the next layer as the captured one does."""
    byte = ctypes.c_ubyte.from_address(flag)

    def check() -> None:
        if byte.value:
            raise StepAborted("the eager step was ended by its abort flag")

    return check


@dataclass(frozen=True)
class CaptureInfo:
    """What was captured, for the start-up log and the tests.

    Attributes:
        sizes: the ladder of batch sizes.
        seconds: the time the capture took (its tables and buffers; the library was built or
            loaded from its cache when the weights were packed, and logged then).
        weight_formats: the panel formats of the linear layers ("f32", "int8", "int4").
    """

    sizes: tuple[int, ...]
    seconds: float
    weight_formats: tuple[str, ...]


class DecodeCapture:
    """The fused decode step of one model over its KV caches (build with `build`)."""

    def __init__(self, library: ctypes.CDLL, model: LlamaForCausalLM,
                 kv_caches: list[torch.Tensor], sizes: tuple[int, ...],
                 max_batch: int | None = None) -> None:
        stack = model.model
        assert isinstance(stack, LlamaModel)
        spec = model.spec
        first = _layers(stack)[0]
        attn = first.self_attn
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        self._library = library
        self._caches = kv_caches
        self._num_slots = num_blocks * block_size
        self._keep: list[object] = []
        layers = (_RsLayer * len(kv_caches))()
        formats: set[str] = set()
        for i, (layer, cache) in enumerate(zip(_layers(stack), kv_caches, strict=True)):
            weights = _panels(layer)
            formats.update(w.format for w in weights)
            self._keep.extend(weights)
            moe = self._moe(layer.mlp)
            structs = [w.struct for w in weights]
            structs += [RsWeight()] * (4 - len(structs))  # an MoE layer has no dense MLP
            a = layer.self_attn
            layers[i] = _RsLayer(
                *structs,
                _data(layer.input_layernorm), _data(layer.post_attention_layernorm),
                _data(a.q_norm) if a.q_norm is not None else None,
                _data(a.k_norm) if a.k_norm is not None else None,
                cache.data_ptr(), a.sliding_window or 0,
                ctypes.addressof(moe) if moe is not None else None,
            )
        self._layers = layers
        cos_sin = stack.rotary.cos_sin
        embed = stack.embed_tokens
        # A tied LM head's panels hold the rows (`VocabParallelEmbedding.read_from_panels`):
        # the step reads them from there, in whatever format the head has.
        rows = embed.panel_rows
        table = embed.weight if rows is None else rows.data
        self._model = _RsModel(
            len(kv_caches), spec.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            max(spec.intermediate_size, getattr(spec, "shared_expert_intermediate_size", 0)),
            stack.rotary.rotary_dim, cos_sin.shape[1], self._num_slots,
            block_size, embed.vocab_end - embed.vocab_start, first.input_layernorm.eps,
            attn.scale, cos_sin.data_ptr(), table.data_ptr(),
            _data(stack.norm), ctypes.addressof(layers),
            None if rows is None else ctypes.addressof(rows.struct),
        )
        self._keep.extend([cos_sin, table, rows])
        self.sizes = sizes
        self.max_batch = sizes[-1] if max_batch is None else min(sizes[-1], max_batch)
        floats = library.rs_step_work_floats(ctypes.byref(self._model), self.max_batch)
        self._work = torch.empty(floats, dtype=torch.float32)
        self._out = torch.empty(self.max_batch, spec.hidden_size, dtype=torch.float32)
        self._lora_keep: object = None
        self.lora_version = -1  # the LoRA slots' version the tables describe (-1: none)
        self.info = CaptureInfo(sizes, 0.0, tuple(sorted(formats)))

    def _moe(self, mlp: object) -> _RsMoe | None:
        """The C view of an MoE layer's router and experts (None for a dense MLP); what it
        points at is kept alive with the capture."""
        if not isinstance(mlp, SparseMoeBlock):
            return None
        experts = mlp.experts
        assert isinstance(experts.packed, PackedExperts)  # checked by _unsupported
        router = pack_f32(mlp.gate.weight.data)
        load = experts.load_counts  # the C step counts into the same tensor as the eager block
        if load is not None and (load.dtype != torch.int64 or not load.is_contiguous()):
            raise ValueError("expert-load counts must be a contiguous int64 tensor")
        gate = mlp.shared_expert_gate
        shared_gate = gate.weight.data.reshape(-1).contiguous() if gate is not None else None
        shared = mlp.shared_expert
        view = _RsMoe(router.struct, experts.packed.w13_array, experts.packed.w2_array,
                      experts.num_experts, mlp.top_k, int(mlp.renormalize),
                      load.data_ptr() if load is not None else None,
                      shared_gate.data_ptr() if shared_gate is not None else None,
                      shared.gate_up_proj.local_sizes[0] if shared is not None else 0)
        self._keep.extend([router, experts.packed, view, load, shared_gate])
        return view

    @classmethod
    def build(cls, library: ctypes.CDLL | None, model: LlamaForCausalLM,
              kv_caches: list[torch.Tensor], sizes: tuple[int, ...], *, backend: str,
              tp_size: int, max_batch: int | None = None) -> tuple[DecodeCapture | None, str]:
        """The capture for `model`, or (None, why it runs eagerly).

        Args:
            max_batch: the most decodes a step can have (max_num_seqs): the work buffer is
                sized for min(it, the largest of `sizes`).
        """
        start = time.perf_counter()
        reason = _unsupported(library, model, kv_caches, backend, tp_size)
        if reason or library is None:
            return None, reason or "no CPU matmul library"
        capture = cls(library, model, kv_caches, sizes, max_batch)
        capture.info = dataclasses.replace(capture.info, seconds=time.perf_counter() - start)
        return capture, ""

    def accepts(self, inputs: StepInputs) -> bool:
        """Whether this step is one the capture runs: only single-token decodes, at most
        `max_batch` of them."""
        return inputs.meta.max_query_len == 1 and 0 < len(inputs.req_ids) <= self.max_batch

    def run(self, inputs: StepInputs, abort_flag: int = 0) -> torch.Tensor:
        """The final hidden states [B, hidden] of the step's decodes (as the eager stack).

        Args:
            inputs: the step.
            abort_flag: the address of a byte read between layers (nonzero ends the step);
                0: never ends early.

        Raises:
            as `run_keeping`.
        """
        return self.run_keeping(inputs, abort_flag, ())[0]

    @property
    def num_layers(self) -> int:
        """The decoder layers the step runs."""
        return len(self._layers)

    def set_lora(self, tables: list[list[int | None]], keep: object, version: int) -> None:
        """Point every layer's projections (qkv, o, gate_up, down) at their LoRA slot tables
        (addresses of `rs_lora` arrays, None: no adapter touches it; built by
        `ringserve.gpu.lora.capture`), which `keep` keeps alive; `version` names what the
        slots held (`lora_version`)."""
        for layer, pointers in zip(self._layers, tables, strict=True):
            for k, pointer in enumerate(pointers):
                layer.lora[k] = pointer
        self._lora_keep = keep
        self.lora_version = version

    def run_keeping(self, inputs: StepInputs, abort_flag: int, layers: tuple[int, ...],
                    row_slots: np.ndarray | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run`, also keeping the residual stream entering each of `layers` (as
        `LlamaModel.aux_layers`): (hidden [B, hidden], those inputs concatenated in order
        [B, len(layers) * hidden], or None when `layers` is empty). `row_slots` (int64 [B],
        -1 for a base row): each decode's LoRA slot, whose delta the step adds (`set_lora`
        must have described the slots).

        Raises:
            StepAborted: the flag was raised during the step.
            ValueError: a decode's block, slot, position or token is outside the cache, the
                rope table or the vocabulary (a schedule the worker cannot run).
            MemoryError: the step's scratch buffer could not be allocated.
        """
        plan = cpu_native.plan_decodes(inputs.meta, self._caches[0])  # checks every block id
        n = len(inputs.req_ids)
        ids, positions = inputs.input_ids, inputs.positions
        slots = inputs.meta.slot_mapping
        kept = (torch.empty(n, len(layers), self._out.shape[1], dtype=self._out.dtype)
                if layers else None)
        wanted = np.asarray(layers, dtype=np.int64)
        step = _RsStep(
            n, ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            plan.tables.ctypes.data, plan.tables.shape[1], plan.lens.ctypes.data, plan.max_len,
            self._out.data_ptr(), self._work.data_ptr(), torch.get_num_threads(),
            abort_flag or None, wanted.ctypes.data if layers else None, len(layers),
            kept.data_ptr() if kept is not None else None,
            row_slots.ctypes.data if row_slots is not None else None,
        )
        status = self._library.rs_decode_step(ctypes.byref(self._model), ctypes.byref(step))
        if status == -3:
            raise StepAborted("the decode step was ended by its abort flag")
        if status == -2:
            raise ValueError("decode step: a token id, position or KV slot is out of range")
        if status != 0:
            raise MemoryError("decode step: the scratch buffer could not be allocated")
        return self._out[:n].clone(), kept.reshape(n, -1) if kept is not None else None


def _layers(stack: LlamaModel) -> list[LlamaDecoderLayer]:
    return [layer for layer in stack.layers if isinstance(layer, LlamaDecoderLayer)]


def _data(norm: RMSNorm) -> int:
    return int(norm.weight.data_ptr())


def _panels(layer: LlamaDecoderLayer) -> list[PanelWeight]:
    mlp = layer.mlp
    linears: tuple[ColumnParallelLinear | RowParallelLinear, ...] = (
        layer.self_attn.qkv_proj, layer.self_attn.o_proj)
    if isinstance(mlp, LlamaMLP):  # else an MoE block (`DecodeCapture._moe`)
        linears += (mlp.gate_up_proj, mlp.down_proj)
    elif isinstance(mlp, SparseMoeBlock) and mlp.shared_expert is not None:
        linears += (mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj)
    panels = [linear.panel for linear in linears]
    assert all(p is not None for p in panels)  # checked by _unsupported
    return [p for p in panels if p is not None]


def _moe_unsupported(mlp: object) -> str:
    """Why the C step cannot run this feed-forward block ("" for an MoE block it can)."""
    if not isinstance(mlp, SparseMoeBlock):
        return f"a {type(mlp).__name__} feed-forward layer"
    gate = mlp.shared_expert_gate
    if gate is not None and gate.weight.dtype != torch.float32:
        return "a shared-expert gate that is not float32"
    if mlp.experts.ep is not None:
        return "expert parallelism (the all-to-all runs in torch)"
    if not isinstance(mlp.experts.packed, PackedExperts):
        return "experts without panel weights"
    if mlp.gate.weight.dtype != torch.float32:
        return "a router that is not float32"
    return ""


def _unsupported(library: ctypes.CDLL | None, model: LlamaForCausalLM,
                 kv_caches: list[torch.Tensor], backend: str, tp_size: int) -> str:
    """Why the C step cannot run `model` ("" when it can)."""
    stack = model.model
    if library is None:
        return "the CPU matmul library is unavailable"
    if type(stack) is not LlamaModel:
        return f"{type(model).__name__} has its own layer structure"
    if tp_size != 1:
        return "tensor-parallel size > 1 (the all-reduce runs in torch)"
    if backend != "cpu":
        return f"the {backend} attention backend"
    layers = _layers(stack)
    if len(layers) != len(kv_caches) or not layers:
        return "a layer is not a Llama decoder layer"
    if stack.embed_tokens.weight.dtype != torch.float32 or any(
            c.dtype != torch.float32 or c.device.type != "cpu" or not c.is_contiguous()
            for c in kv_caches):
        return "the model or its KV cache is not float32 on the CPU"
    if stack.rotary.rotary_dim % 2 or not stack.embed_tokens.weight.is_contiguous():
        return "an odd rotary width"
    norms: list[RMSNorm | None] = [stack.norm]
    for layer in layers:
        a = layer.self_attn
        mlp = layer.mlp
        linears: list[object] = [a.qkv_proj, a.o_proj]
        if isinstance(mlp, LlamaMLP):
            linears += [mlp.gate_up_proj, mlp.down_proj]
        else:
            why = _moe_unsupported(mlp)
            if why:
                return why
            assert isinstance(mlp, SparseMoeBlock)
            if mlp.shared_expert is not None:
                linears += [mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj]
        if a.logits_soft_cap is not None:
            return "attention logit soft-capping"
        if any(getattr(lin, "panel", None) is None for lin in linears):
            return "a linear layer without panel weights"
        norms += [layer.input_layernorm, layer.post_attention_layernorm, a.q_norm, a.k_norm]
    eps = layers[0].input_layernorm.eps
    if any(n is not None and (type(n) is not RMSNorm or n.eps != eps) for n in norms):
        return "a norm other than the model's RMSNorm"
    return ""
