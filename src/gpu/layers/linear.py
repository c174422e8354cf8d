"""Tensor-parallel linear layers and their sharded weight loading.

`ColumnParallelLinear` splits the output features over the TP ranks (each rank holds a slice of
every logical sub-matrix, so fused projections such as q/k/v or gate/up stay fused per rank);
`RowParallelLinear` splits the input features and sums the partial products with an all-reduce.
The model code (`ringserve.gpu.models`) builds them; the loader (`ringserve.gpu.weights.loader`) feeds
each checkpoint tensor to `load(...)`, which narrows it to this rank's shard, so a full copy of
a parallel weight never lives on a rank longer than the copy itself.

After loading, `process_weights_after_loading` repacks float32 CPU weights into the panel
layout of the project's own matmul (`ringserve.gpu.native.panel`: panels of 16 output
channels, the bias folded in) and drops the plain copy. The fused decode step
(`ringserve.gpu.runner.decode_capture`) reads the same panels. Measured on the 2-core benchmark VM
(2 threads, weights streamed from DRAM): the 3072x576 gate/up projection at 1 row 10.3 ms per
30 layers against 17.2 ms for oneDNN's prepacked GEMM and 29 ms for MKL's `F.linear`; at 64
rows about even with oneDNN. Where the C library cannot be built, float32 CPU weights are
packed for oneDNN instead (`pack_weight`, as vLLM's CPU backend does). Results differ from
`F.linear` only by float32 rounding order (~1e-6 relative). Other devices and dtypes keep
`F.linear`.

A layer built with `quantization="int8"` or `"int4"` instead quantizes its loaded shard there
(`ringserve.gpu.layers.quant.quantize`: each TP rank quantizes what it holds) into int8 / int4
panels that the kernels read packed (`quantized_linear`); its float weight is dropped. Rows
loaded from a GGUF file's blocks of that method keep their codes. With `quantization="gguf"`
(a quantized GGUF file's default) each layer picks its method from the GGUF types of the
tensors it was loaded from (`ringserve.checkpoint.gguf_codes.layer_method`: int4 for Q4_*
codes, int8 for Q8_0 codes and for types without panels of their own, float for float
tensors) and keeps `quantization` as the method it picked.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.checkpoint import gguf_codes
from ringserve.checkpoint.gguf_codes import GGUF_MODE, BlockCodes, FileTensor
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.quant import INT4_GROUP_SIZE, check_method, quantize, quantized_linear
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.native.panel import PanelWeight

# The batch size oneDNN tunes the packed layout for; any number of rows works with it, and
# the speed measured the same for hints of 32 and 4096 (a hint of 1 was slower at 3+ rows).
_PACK_BATCH_HINT = 32


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a `[out, in]` weight, or None where `F.linear` stays.

    Packs float32 weights on CPU when torch has oneDNN (mkldnn); `apply_linear` uses them.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not (torch._C._has_mkldnn and torch._C._get_mkldnn_enabled()):
        return None
    # Private ops (inductor's CPU path uses them): fall back to F.linear if a torch lacks them.
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return None
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    return packed


def repack(weight: nn.Parameter, *, keep_weight: bool = False
           ) -> tuple[torch.Tensor | None, nn.Parameter]:
    """(the packed copy or None, the weight to keep) for a layer's loaded `weight`.

    Once packed, the plain weight is replaced by an empty placeholder unless `keep_weight`
    (a tied LM head shares it with the embedding).
    """
    packed = pack_weight(weight)
    if packed is None or keep_weight:
        return packed, weight
    return packed, nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)


def apply_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
                 bias: torch.Tensor | None = None, panel: PanelWeight | None = None
                 ) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: from the panels when the layer has them (their bias is
    folded in: `bias` is then not added again), else from the oneDNN copy `repack` made."""
    if panel is not None:
        return panel_forward(x, panel)
    if packed is None:
        return F.linear(x, weight, bias)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def panel_forward(x: torch.Tensor, panel: PanelWeight) -> torch.Tensor:
    """`x @ W^T + b` from a layer's panels (float32, bf16, int8 or int4)."""
    if panel.format != "f32":
        return quantized_linear(x, panel)
    library = panel_native.load_library()
    if library is None:  # panels are only made once the library has loaded
        raise RuntimeError("float32 panels without the CPU matmul library")
    return panel_native.linear(library, x, panel)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows split over the ranks; output stays sharded.

    Args:
        input_size: input features.
        output_sizes: the full row count of each fused sub-matrix (e.g. [q, k, v]); each is
            split evenly over the ranks.
        bias: whether the layer has a bias.
        tp: the tensor-parallel group.
        dtype: parameter dtype.
        shard_ranks: per sub-matrix, the number of distinct shards (defaults to the world
            size); a smaller value replicates that sub-matrix across groups of ranks (used for
            key/value heads when there are fewer KV heads than ranks).
        quantization: "int8" or "int4" to quantize the weight after loading; None: float.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        shard_ranks: list[int] | None = None,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.quantization = _checked_method(quantization)
        self.shard_ranks = shard_ranks or [tp.world_size] * len(output_sizes)
        self.local_sizes = [
            _divide(size, n, "output features") for size, n in zip(output_sizes, self.shard_ranks, strict=True)
        ]
        self.offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None
        self.panel: PanelWeight | None = None
        # The parts of the weight as loaded (their GGUF tensors, whose codes a quantized
        # layer keeps as they are); `rows_as_is` counts the rows that kept them.
        self._parts: list[_Part] = []
        self.rows_as_is = 0

    def process_weights_after_loading(self) -> None:
        """Pack the loaded weight for this device's fastest GEMM, or quantize it (see the
        module docstring).

        Call once, after every shard is loaded. Afterwards `load` writes float32 panels in
        place (a weight update's standby model, `loads_in_place`); a oneDNN or quantized
        layer cannot be loaded again.

        Raises:
            ValueError: the shard's shape or device does not suit the quantization method.
        """
        self.quantization, as_is, fine = _resolve(self)
        self.packed, self.panel, self.weight = _finish_weight(
            self.weight, self.bias, self.quantization, as_is, int8_groups=fine)
        self.rows_as_is = sum(b.codes.shape[0] for _, b in as_is)

    def _shard_index(self, shard_id: int) -> int:
        n = self.shard_ranks[shard_id]
        return self.tp.rank * n // self.tp.world_size

    def load(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Copy this rank's rows of sub-matrix `shard_id` from a full checkpoint tensor.

        Args:
            name: "weight" or "bias".
            loaded: the full (unsharded) checkpoint tensor of that sub-matrix.
            shard_id: which fused sub-matrix `loaded` is.
        """
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a bias for a layer built without one ({name})")
        size = self.local_sizes[shard_id]
        full = size * self.shard_ranks[shard_id]
        check_shape(loaded, (full, _weight_shape(self)[1]) if name == "weight" else (full,))
        start = self._shard_index(shard_id) * size
        if name == "weight" and _defers(self, loaded):
            # Its floats are made when the layer is processed, only if it does not keep the
            # codes (`_resolve`).
            self._parts.append(_Part(self.offsets[shard_id], start, size, False,
                                     gguf_codes.source_of(loaded), deferred=True))
            return
        src = gguf_codes.floats(loaded).narrow(0, start, size)
        if name == "weight" and _loads_into_panel(self):
            assert self.panel is not None
            panel_native.pack_rows(_library(), src, self.panel.data, self.offsets[shard_id])
            return
        param.data.narrow(0, self.offsets[shard_id], size).copy_(src)
        if name == "weight":
            self._parts.append(_Part(self.offsets[shard_id], start, size, False,
                                     _source(self, loaded)))
        if name == "bias":
            _sync_folded_bias(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the output features."""
        return apply_linear(x, self.weight, self.packed, self.bias, self.panel)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns split over the ranks and an all-reduce of the partials.

    The input must already be sharded on its last dimension (the output of a column-parallel
    layer); the bias is added once, after the reduction. `quantization` is as in
    `ColumnParallelLinear`.
    """

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool, tp: TPGroup, dtype: torch.dtype,
        quantization: str | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.quantization = _checked_method(quantization)
        self.local_in = _divide(input_size, tp.world_size, "input features")
        self.weight = nn.Parameter(
            torch.empty(output_size, self.local_in, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None
        self.panel: PanelWeight | None = None
        self._parts: list[_Part] = []  # as in ColumnParallelLinear
        self.rows_as_is = 0

    def process_weights_after_loading(self) -> None:
        """See `ColumnParallelLinear.process_weights_after_loading` (the bias is folded into
        the panels at world size 1 only: with more ranks it is added after the reduction)."""
        self.quantization, as_is, fine = _resolve(self)
        self.packed, self.panel, self.weight = _finish_weight(
            self.weight, self.bias if self.tp.world_size == 1 else None, self.quantization,
            as_is, int8_groups=fine)
        self.rows_as_is = sum(b.codes.shape[0] for _, b in as_is)

    def load(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Copy this rank's columns of the weight (or the whole bias)."""
        del shard_id
        out_features = _weight_shape(self)[0]
        if name == "bias":
            if self.bias is None:
                raise ValueError("checkpoint has a bias for a row-parallel layer built without one")
            check_shape(loaded, (out_features,))
            self.bias.data.copy_(loaded)
            _sync_folded_bias(self)
            return
        check_shape(loaded, (out_features, self.local_in * self.tp.world_size))
        start = self.tp.rank * self.local_in
        if _defers(self, loaded):  # as in ColumnParallelLinear.load
            self._parts = [_Part(0, start, self.local_in, True, gguf_codes.source_of(loaded),
                                 deferred=True)]
            return
        shard = gguf_codes.floats(loaded).narrow(1, start, self.local_in)
        if _loads_into_panel(self):
            assert self.panel is not None
            panel_native.pack_rows(_library(), shard, self.panel.data, 0)
            return
        self.weight.data.copy_(shard)
        self._parts = [_Part(0, start, self.local_in, True, _source(self, loaded))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full output, summed over the ranks."""
        partial = apply_linear(x, self.weight, self.packed, panel=self.panel)
        y = self.tp.all_reduce(partial)
        folded = self.panel is not None and self.panel.bias is not None
        return y if self.bias is None or folded else y + self.bias


def loads_in_place(layer: ColumnParallelLinear | RowParallelLinear) -> bool:
    """Whether `load` can run again after `process_weights_after_loading` and leave the layer
    serving the new weight (a weight update loading a standby model): float32 panels (written
    straight into by `load`) or a plain weight; not a oneDNN copy or quantized panels, which
    are derived from a plain weight the layer no longer keeps."""
    if layer.panel is not None:
        return layer.panel.format == "f32"
    return layer.packed is None


def _loads_into_panel(layer: ColumnParallelLinear | RowParallelLinear) -> bool:
    """A processed layer whose float32 panels are the only copy of its weight."""
    panel = layer.panel
    return panel is not None and panel.format == "f32" and layer.weight.numel() == 0


def _weight_shape(layer: ColumnParallelLinear | RowParallelLinear) -> tuple[int, int]:
    """(out, in) of this rank's weight, from the panels once they hold the only copy.

    Raises:
        ValueError: the weight was repacked (oneDNN) or quantized and cannot be loaded again.
    """
    panel = layer.panel
    if panel is not None and _loads_into_panel(layer):
        return panel.out_features, panel.in_features
    if layer.weight.dim() != 2:
        raise ValueError("the layer's weight was repacked after loading and cannot be loaded "
                         "again")
    return int(layer.weight.shape[0]), int(layer.weight.shape[1])


def _library() -> ctypes.CDLL:
    library = panel_native.load_library()
    if library is None:  # panels are only made once the library has loaded
        raise RuntimeError("float32 panels without the CPU matmul library")
    return library


def _sync_folded_bias(layer: ColumnParallelLinear | RowParallelLinear) -> None:
    """A processed layer's folded bias follows a newly loaded bias (it usually shares its
    storage; a converted copy does not)."""
    panel, bias = layer.panel, layer.bias
    if panel is not None and panel.bias is not None and bias is not None and (
            panel.bias.data_ptr() != bias.data_ptr()):
        panel.bias.copy_(bias.detach().float())


def check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    """Refuse a checkpoint tensor whose shape is not the parameter's full shape (`copy_`
    would broadcast a smaller one silently) or whose dtype is not a float type.

    Raises:
        ValueError: naming the shape (or dtype) found and the one expected.
    """
    if tuple(loaded.shape) != expected:
        raise ValueError(f"shape {list(loaded.shape)}, expected {list(expected)}")
    if not loaded.dtype.is_floating_point:
        raise ValueError(f"dtype {loaded.dtype}, expected a float type")


def _checked_method(quantization: str | None) -> str | None:
    if quantization is not None and quantization != GGUF_MODE:
        check_method(quantization)
    return quantization


@dataclass(frozen=True)
class _Part:
    """One loaded part of a layer's weight: `size` rows (or, `columns`, input features) of a
    checkpoint tensor from `start` on, at row `offset` of the layer's weight, and the GGUF
    tensor it was read from (None: not a GGUF file)."""

    offset: int
    start: int
    size: int
    columns: bool
    source: FileTensor | None
    deferred: bool = False  # its floats are not in the layer's weight (yet)

    def fill(self, weight: torch.Tensor) -> None:
        """Write this deferred part's floats into its rows (or columns) of `weight`."""
        assert self.source is not None and self.source.dequantized is not None
        values = self.source.dequantized()
        if self.columns:
            weight.copy_(values.narrow(1, self.start, self.size))
        else:
            weight.narrow(0, self.offset, self.size).copy_(values.narrow(0, self.start, self.size))

    def codes(self, method: str) -> BlockCodes | None:
        """This part's codes if its GGUF tensor holds codes of `method` (None: a shard of
        input features that splits a group of 32, or no such codes)."""
        if self.source is None or self.source.method != method:
            return None
        blocks = self.source.codes()
        if blocks is None:
            return None
        if self.columns:
            return blocks.columns(self.start, self.size)
        return blocks.rows(self.start, self.size)


def _source(layer: ColumnParallelLinear | RowParallelLinear, loaded: torch.Tensor
            ) -> FileTensor | None:
    """The GGUF tensor `loaded` came from, for a quantized layer (a float layer keeps none:
    the source holds the tensor's bytes until the layer is processed)."""
    return None if layer.quantization is None else gguf_codes.source_of(loaded)


def _defers(layer: ColumnParallelLinear | RowParallelLinear, loaded: torch.Tensor) -> bool:
    """Whether `layer` takes deferred tensor `loaded` (`gguf_codes.is_deferred`) without its
    floats: a quantized layer not yet processed (it may keep the codes); any other layer
    makes the floats at once."""
    return (gguf_codes.is_deferred(loaded) and layer.quantization is not None
            and layer.panel is None and layer.packed is None)


def _resolve(layer: ColumnParallelLinear | RowParallelLinear
             ) -> tuple[str | None, list[tuple[int, BlockCodes]], bool]:
    """(the layer's method, the rows that keep their GGUF codes, whether int8 rows without
    codes are rounded per group of 32) once every part is loaded; forgets the parts. Codes
    are kept by a float32 layer only (as they always were). A deferred part that does not
    keep its codes gets its floats now, one part at a time."""
    parts, layer._parts = layer._parts, []
    method, fine = layer.quantization, False
    if method == GGUF_MODE:
        method = gguf_codes.layer_method(p.source.qtype if p.source else None for p in parts)
        # Rounded from a finer source (Q6_K's scale per 16 inputs): a scale per group of 32.
        fine = method == "int8" and layer.weight.shape[1] % INT4_GROUP_SIZE == 0
    as_is: list[tuple[int, BlockCodes]] = []
    for part in parts:
        codes = (part.codes(method) if method is not None
                 and layer.weight.dtype == torch.float32 else None)
        if codes is not None:
            as_is.append((part.offset, codes))
        elif part.deferred:
            part.fill(layer.weight.data)
    return method, as_is, fine


def _finish_weight(weight: nn.Parameter, bias: nn.Parameter | None, quantization: str | None,
                   as_is: list[tuple[int, BlockCodes]] | None = None, *,
                   int8_groups: bool = False,
                   ) -> tuple[torch.Tensor | None, PanelWeight | None, nn.Parameter]:
    """(oneDNN's packed copy, the panels with `bias` folded in, the weight to keep) after
    loading: panels for a quantized layer (rows in `as_is` keep their GGUF codes, the others
    are rounded, int8 per group of 32 with `int8_groups`) and for float32 CPU weights when the
    C library loads, oneDNN's copy otherwise (the plain weight is dropped either way where
    possible)."""
    empty = nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False)
    if quantization is not None:
        panel = quantize(weight.data, quantization, as_is or (), int8_groups=int8_groups)
        return None, panel.with_bias(bias), empty
    if (weight.device.type == "cpu" and weight.dtype == torch.float32
            and panel_native.load_library() is not None):
        return None, panel_native.pack_f32(weight.data, bias), empty
    packed, kept = repack(weight)
    return packed, None, kept


def refresh_panel(panel: PanelWeight, weight: torch.Tensor, bias: torch.Tensor | None,
                  method: str | None) -> None:
    """Rewrite `panel` in place from a newly loaded plain `weight` (and the bias it folds):
    the same tensors, so the captured decode step's pointers stay valid."""
    if panel.format == "f32":
        panel_native.to_panels(weight.detach().float(), out=panel.data)
    elif panel.format == "bf16":
        panel_native.to_panels(weight.detach().to(torch.bfloat16), out=panel.data)
    else:
        grouped = panel.format == "int8g"  # int8 with a scale per 32 inputs
        fresh = quantize(weight.data, method or ("int8" if grouped else panel.format),
                         grouped=grouped)
        for mine, new in ((panel.data, fresh.data), (panel.scales, fresh.scales),
                          (panel.mins, fresh.mins)):
            if mine is not None and new is not None:
                mine.copy_(new)
    if panel.bias is not None and bias is not None:
        panel.bias.copy_(bias.detach().float())


def refresh_layer(layer: ColumnParallelLinear | RowParallelLinear,
                  loaded: ColumnParallelLinear | RowParallelLinear) -> None:
    """New weights for `layer` in place, from `loaded`: the same layer of a model whose
    weights were just loaded and not processed (a weight update's staging copy,
    `ringserve.gpu.weights.standby`)."""
    if loaded.bias is not None and layer.bias is not None:
        layer.bias.data.copy_(loaded.bias.data)
    if layer.panel is not None:
        refresh_panel(layer.panel, loaded.weight.data, loaded.bias, layer.quantization)
    elif layer.packed is not None:
        layer.packed = pack_weight(loaded.weight.data)
    else:
        layer.weight.data.copy_(loaded.weight.data)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"tensor_parallel_size: {parts} shards do not divide {what} ({total})")
    return total // parts
