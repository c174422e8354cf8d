"""Vocabulary-parallel token embedding and LM head.

Each TP rank holds a contiguous slice of the vocabulary rows (the vocabulary is padded up to a
multiple of the world size). The embedding looks up the ids in its slice, zeroes the others and
all-reduces; the LM head computes logits for its slice and all-gathers them. Used by the model
code; the loader calls `load` with the full checkpoint matrix. At world size 1 both are a plain
`F.embedding` / `F.linear`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.checkpoint import gguf_codes
from ringserve.checkpoint.gguf_codes import GGUF_MODE, FileTensor
from ringserve.gpu.layers.linear import (
    apply_linear,
    check_shape,
    pack_weight,
    refresh_panel,
    repack,
)
from ringserve.gpu.layers.parallel import TPGroup
from ringserve.gpu.layers.quant import INT4_GROUP_SIZE, quantize
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.native.panel import PanelWeight


class VocabParallelEmbedding(nn.Module):
    """Embedding table split over the ranks by vocabulary rows.

    Args:
        num_embeddings: the vocabulary size.
        embedding_dim: the hidden size.
        tp: the tensor-parallel group.
        dtype: parameter dtype.
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, tp: TPGroup, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        padded = -(-num_embeddings // tp.world_size) * tp.world_size
        self.rows_per_rank = padded // tp.world_size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        # Untouched until loaded (only the padding rows are zeroed): rows that a quantized
        # LM head takes as a GGUF file's codes and that lookups read from its panels are never
        # written, and take no memory.
        weight = torch.empty(self.rows_per_rank, embedding_dim, dtype=dtype)
        weight[self.vocab_end - self.vocab_start:].zero_()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.embedding_dim = embedding_dim
        # Called after each `load` once the weights are processed: a tied LM head repacks its
        # panels from the new rows (a weight update loading a processed model).
        self.on_load: Callable[[], None] | None = None
        # A tied LM head's panels, which hold these rows: lookups read them there and the
        # embedding keeps no rows of its own (`read_from_panels`).
        self.panel_rows: PanelWeight | None = None
        # With `record_source` (a quantized LM head reads this matrix), `load` keeps the GGUF
        # tensor the matrix came from (`source`), whose codes the head may keep as they are.
        self.record_source = False
        self.source: FileTensor | None = None
        # With `record_source`, a deferred matrix (`gguf_codes.is_deferred`) is not copied
        # until someone needs its floats (`materialize`): the head may keep its codes.
        self._deferred: FileTensor | None = None

    def load(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Copy this rank's vocabulary rows from the full checkpoint matrix (reading from a
        tied head's panels: into the panels)."""
        del name, shard_id
        if self.panel_rows is not None:
            if self.panel_rows.format != "f32":  # a weight update goes by the staging copy
                raise RuntimeError("an embedding read from its LM head's "
                                   f"{self.panel_rows.format} panels loads through the head")
            self._load_into_panels(self.panel_rows, loaded)
            return
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        if self.record_source:
            self.source = gguf_codes.source_of(loaded)
        if self.record_source and gguf_codes.is_deferred(loaded):
            self._deferred = self.source
            return
        self._deferred = None
        rows = self.vocab_end - self.vocab_start
        self.weight.data[:rows].copy_(gguf_codes.floats(loaded).narrow(0, self.vocab_start, rows))
        if self.on_load is not None:
            self.on_load()

    def materialize(self) -> None:
        """Copy in the floats of a matrix loaded deferred (none: nothing to do)."""
        source, self._deferred = self._deferred, None
        if source is None or source.dequantized is None:
            return
        rows = self.vocab_end - self.vocab_start
        self.weight.data[:rows].copy_(source.dequantized().narrow(0, self.vocab_start, rows))

    def _load_into_panels(self, panels: PanelWeight, loaded: torch.Tensor) -> None:
        """This rank's vocabulary rows of the full matrix, packed straight into float32
        panels (a weight update: no plain copy is kept)."""
        library = panel_native.load_library()
        if library is None:  # panels are only made once the library has loaded
            raise RuntimeError("float32 panels without the CPU matmul library")
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        rows = self.vocab_end - self.vocab_start
        panel_native.pack_rows(library, loaded.narrow(0, self.vocab_start, rows), panels.data, 0)

    def read_from_panels(self, panels: PanelWeight) -> nn.Parameter:
        """Serve the lookups from a tied LM head's panels, which hold exactly these rows
        (float32; bf16 of a bf16 checkpoint; a GGUF file's own codes), and drop the rows: the
        matrix is in memory once, and a weight update writes it once. Returns the (empty)
        parameter that replaces the rows, for the head to share."""
        self.panel_rows = panels
        self.on_load = None
        self._deferred = None  # its floats are never needed: the panels hold them
        empty = nn.Parameter(torch.empty(0, self.embedding_dim, dtype=self.weight.dtype,
                                         device=self.weight.device), requires_grad=False)
        self.weight = empty
        return empty

    def untie(self, matrix: torch.Tensor) -> nn.Parameter:
        """Stop reading from the head's panels: keep this rank's rows of `matrix` (the full
        float matrix, e.g. a weight update's) as the embedding's own again. Returns the new
        parameter, for the head to share."""
        rows = self.vocab_end - self.vocab_start
        weight = torch.zeros(self.rows_per_rank, self.embedding_dim, dtype=torch.float32)
        weight[:rows].copy_(matrix.narrow(0, self.vocab_start, rows))
        self.panel_rows = None
        self.weight = nn.Parameter(weight, requires_grad=False)
        return self.weight

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        panels = self.panel_rows
        if panels is None:
            return F.embedding(ids, self.weight)
        if panels.format == "f32":
            # Row r of the matrix is column r % 16 of panel r // 16 ([P, hidden, 16]).
            return panels.data[ids // panel_native.PANEL, :, ids % panel_native.PANEL]
        library = panel_native.load_library()
        assert library is not None  # such panels are only read with the library loaded
        return panel_native.rows(library, panels, ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of `input_ids` [T] -> [T, hidden]."""
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(inside, input_ids - self.vocab_start, 0)
        out = self._lookup(local)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, split like the embedding.

    With tied embeddings the model shares the embedding's weight with this head. On CPU the
    head computes from float32 panels (`ringserve.gpu.native.panel`), else from a
    oneDNN-packed copy (`ringserve.gpu.layers.linear.repack`): it is the largest product of a
    decode step. With `quantization` it is quantized as the linear layers are (int8 / int4
    panels, `ringserve.gpu.layers.quant`), as llama.cpp quantizes its output matrix, keeping
    the codes of a GGUF matrix of that method as they are ("gguf": the method its GGUF type
    asks for, `gguf_codes.layer_method`). A tied embedding reads its lookups from the
    head's panels where they hold its exact values (float32; bf16 panels of a bf16
    checkpoint; every row a GGUF file's own codes), and keeps its float rows otherwise
    (`tie_panels`).
    """

    packed: torch.Tensor | None = None
    # The tied embedding that reads its rows from these (non-float32) panels, if any (in a
    # tuple: a module attribute would register it as this head's submodule).
    _reader: tuple[VocabParallelEmbedding, ...] = ()
    panel: PanelWeight | None = None
    rows_as_is = 0  # vocabulary rows whose panels hold the GGUF file's codes

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TPGroup,
                 dtype: torch.dtype, quantization: str | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, tp=tp, dtype=dtype)
        self.quantization = quantization
        self.record_source = quantization is not None

    def process_weights_after_loading(self, *, keep_weight: bool,
                                      tied_to: VocabParallelEmbedding | None = None) -> None:
        """Pack the loaded weight (once, after loading); drop the plain copy unless
        `keep_weight` (a tied head shares it with the embedding, `tied_to`, which loaded
        the matrix and holds its GGUF source: set its `record_source` before loading)."""
        weight = self.weight
        loader = self if tied_to is None else tied_to
        source, loader.source = loader.source, None
        by_type = self.quantization == GGUF_MODE
        if by_type:
            self.quantization = gguf_codes.layer_method([source.qtype if source else None])
        if self.quantization is not None:
            codes = (source.codes() if source is not None and weight.dtype == torch.float32
                     and source.method == self.quantization else None)
            rows = self.vocab_end - self.vocab_start
            as_is = [] if codes is None else [(0, codes.rows(self.vocab_start, rows))]
            del codes
            if not as_is:
                loader.materialize()
            # As the linears under "gguf": int8 rounded from a finer type, per group of 32.
            fine = (by_type and self.quantization == "int8"
                    and self.embedding_dim % INT4_GROUP_SIZE == 0)
            self.panel = quantize(weight.data, self.quantization, as_is, int8_groups=fine)
            self.rows_as_is = rows if as_is else 0
        else:
            loader.materialize()
            if (weight.device.type == "cpu" and weight.dtype == torch.float32
                    and panel_native.load_library() is not None):
                self.panel = panel_native.pack_f32(weight.data)
        if self.panel is not None:
            if not keep_weight:
                self.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype),
                                           requires_grad=False)
            return
        self.packed, self.weight = repack(self.weight, keep_weight=keep_weight)

    def load(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Copy this rank's vocabulary rows; once processed into float32 panels without a
        plain copy (an untied head), straight into the panels."""
        panel = self.panel
        if panel is None or panel.format != "f32" or self.weight.numel():
            super().load(name, loaded, shard_id)
            return
        self._load_into_panels(panel, loaded)

    def loads_in_place(self) -> bool:
        """Whether `load` after processing leaves the head serving the new weight (see
        `ringserve.gpu.layers.linear.loads_in_place`): float32 panels or a plain weight. A tied
        head's panels are written by the embedding's `load` (`tie_panels`)."""
        if self.panel is not None:
            return self.panel.format == "f32"
        return self.packed is None

    def tie_panels(self, embedding: VocabParallelEmbedding) -> None:
        """A head tied to `embedding`, with float32 panels: the embedding reads its rows
        from the panels and both drop the plain rows (`read_from_panels`; a float32
        embedding on the CPU), or else the panels are repacked from the rows each time the
        embedding is loaded again (after processing). With bf16 panels, or int8 / int4
        panels that hold every row as the GGUF file's codes, the embedding reads them too
        (the same values it holds: a 49152 x 576 float32 table is 113 MB); a weight update
        gives it float rows of its own again (`refresh_from`)."""
        panel = self.panel
        if panel is None:
            embedding.materialize()
            return
        readable = (embedding.weight.dtype == torch.float32
                    and embedding.weight.device.type == "cpu")
        if panel.format == "f32" and not readable:
            def repack() -> None:
                panel_native.to_panels(self.weight.data, out=panel.data)

            embedding.on_load = repack
            return
        if panel.format != "f32":
            exact = (panel.format == "bf16"
                     or self.rows_as_is == self.vocab_end - self.vocab_start)
            if not (exact and readable and panel_native.load_library() is not None):
                embedding.materialize()  # it keeps rows of its own
                return
            self._reader = (embedding,)
        self.weight = embedding.read_from_panels(panel)  # still one shared parameter

    def refresh_from(self, loaded: ParallelLMHead) -> None:
        """New weights in place from the same head of a just-loaded, unprocessed model (a
        weight update): the panels are rewritten (same tensors), a kept plain weight is
        copied, a oneDNN copy is made again."""
        if self.weight.numel():
            self.weight.data.copy_(loaded.weight.data)
        if self.panel is not None:
            refresh_panel(self.panel, loaded.weight.data, None, self.quantization)
            if self._reader:  # re-rounded panels: the lookups take float rows again
                self.weight = self._reader[0].untie(loaded.weight.data)
                self._reader, self.rows_as_is = (), 0
        elif self.packed is not None:
            self.packed = pack_weight(loaded.weight.data)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] (gathered from every rank) for hidden states [N, hidden]."""
        logits = self.tp.all_gather_last_dim(
            apply_linear(hidden, self.weight, self.packed, panel=self.panel))
        return logits[..., : self.num_embeddings]
