"""The SwiGLU experts of an MoE layer on CPU through the project's C kernel (`moe_cpu.c`).

`PackedExperts` owns the experts' weights in the panel layout of the CPU matmul library
(`ringserve.gpu.native.panel`, `panel.h`): float32, or int8 / int4 (`ringserve.gpu.layers.quant`),
packed once from the stacked weights `w13` [E, 2I, H] (gate rows, then up rows) and `w2`
[E, H, I] the layer holds, with the C views of all experts prebuilt so that a call builds
nothing per expert. `forward` takes the rows already grouped by expert (`grouped.sort_by_expert`)
and computes what `grouped.grouped_swiglu` computes, in one C call and one OpenMP parallel
region on torch's threads; `refresh` writes new weights into the same panels (an RL weight
update), so the C views stay valid.

Measured on the 2-core AMD EPYC VM, 2 threads, loaded by other work (load average 1.0-1.5),
E=8, H=576, I=256, top-2, medians of 20 calls (an ad-hoc script, not kept): for 32 rows (16
tokens) 0.8-1.0 ms in float32 and 0.45 ms in int8 / int4, against 4.0-4.8 ms for both
`grouped._looped_swiglu` and `torch._grouped_mm` there; for 512 rows 5.4-5.8 ms (float32)
against 9.0-9.8 ms.
"""

from __future__ import annotations

import ctypes

import torch

from ringserve.gpu.layers import quant
from ringserve.gpu.native import panel as panel_native
from ringserve.gpu.native.panel import PanelWeight, RsWeight


def available() -> bool:
    """Whether the C library (and so `PackedExperts.forward`) can be had on this machine."""
    return panel_native.load_library() is not None


def _check_stacked(w13: torch.Tensor, w2: torch.Tensor) -> tuple[int, int, int]:
    """(E, H, I) of stacked expert weights.

    Raises:
        ValueError: not float CPU tensors of shapes [E, 2I, H] and [E, H, I].
    """
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dim() != 3 or not t.dtype.is_floating_point or t.device.type != "cpu":
            raise ValueError(f"moe cpu experts: {name} must be a 3-D float CPU tensor, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    experts, inter2, hidden = w13.shape
    if inter2 % 2 or experts < 1 or tuple(w2.shape) != (experts, hidden, inter2 // 2):
        raise ValueError(f"moe cpu experts: w13 {list(w13.shape)} and w2 {list(w2.shape)}: "
                         f"expected [E, 2I, H] and [E, H, I] with E >= 1")
    return experts, hidden, inter2 // 2


def _pack_one(weight: torch.Tensor, quantization: str | None) -> PanelWeight:
    weight = weight.detach()
    if quantization is None:
        return panel_native.pack_f32(weight.contiguous())
    return quant.quantize(weight, quantization)


def _structs(weights: list[PanelWeight]) -> ctypes.Array[RsWeight]:
    return (RsWeight * len(weights))(*[w.struct for w in weights])


class PackedExperts:
    """The panels of E SwiGLU experts and their C views (build with `pack`).

    Attributes:
        quantization: None (float32 panels), "int8" or "int4".
        num_experts, hidden_size, intermediate_size: E, H and I.
    """

    def __init__(self, w13: list[PanelWeight], w2: list[PanelWeight],
                 quantization: str | None, hidden_size: int, intermediate_size: int) -> None:
        """Use `pack`: this keeps already packed panels (E of each, all of one format)."""
        self.quantization = quantization
        self.num_experts = len(w13)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self._w13 = w13
        self._w2 = w2
        # The arrays copy each RsWeight, whose pointers stay valid while the panels live here.
        self._w13_structs = _structs(w13)
        self._w2_structs = _structs(w2)
        self._w13_address = ctypes.addressof(self._w13_structs)
        self._w2_address = ctypes.addressof(self._w2_structs)

    @classmethod
    def pack(cls, w13: torch.Tensor, w2: torch.Tensor,
             quantization: str | None = None) -> PackedExperts:
        """Pack stacked expert weights.

        Args:
            w13: [E, 2I, H] gate and up projections (any float dtype, CPU).
            w2: [E, H, I] down projections.
            quantization: None for float32 panels, or "int8" / "int4" (weight-only, as
                `ringserve.gpu.layers.quant`; int4 needs H and I in multiples of 32).

        Raises:
            ValueError: wrong shapes or dtypes, an unknown quantization, or int4 with H or I
                not a multiple of 32.
        """
        experts, hidden, inter = _check_stacked(w13, w2)
        if quantization is not None:
            quant.check_method(quantization)
        return cls([_pack_one(w13[e], quantization) for e in range(experts)],
                   [_pack_one(w2[e], quantization) for e in range(experts)],
                   quantization, hidden, inter)

    def refresh(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Write new weights (the shapes `pack` had) into the same panels, in place.

        Float32 panels are overwritten by one strided copy of each weight; int8 / int4
        weights are quantized again and their codes, scales and mins copied over the old
        ones. The panels keep their storage, so the C views (and any caller holding them)
        stay valid. Not to be called while a `forward` runs (it would read half-written
        weights).

        Raises:
            ValueError: shapes other than the packed ones, or not float CPU tensors.
        """
        shape = (self.num_experts, self.hidden_size, self.intermediate_size)
        if _check_stacked(w13, w2) != shape:
            raise ValueError(f"moe cpu experts refresh: w13 {list(w13.shape)} and w2 "
                             f"{list(w2.shape)} for experts packed as (E, H, I) = {shape}")
        for stacked, panels in ((w13, self._w13), (w2, self._w2)):
            for e, old in enumerate(panels):
                weight = stacked[e].detach()
                if self.quantization is None:
                    panel_native.to_panels(weight.contiguous(), out=old.data)
                    continue
                new = quant.quantize(weight, self.quantization)
                for dst, src in ((old.data, new.data), (old.scales, new.scales),
                                 (old.mins, new.mins)):
                    if dst is not None and src is not None:
                        dst.copy_(src)

    @property
    def w13_array(self) -> int:
        """The address of the experts' gate-up `rs_weight` array (valid while this lives)."""
        return self._w13_address

    @property
    def w2_array(self) -> int:
        """The address of the experts' down `rs_weight` array (valid while this lives)."""
        return self._w2_address

    def panels(self) -> list[PanelWeight]:
        """Every expert's gate-up then down panels (what a weight checksum covers)."""
        return [*self._w13, *self._w2]

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)) of each row by its expert, as `grouped_swiglu`.

        Args:
            rows: [P, H] float32 CPU activations, the rows of expert e contiguous and in
                expert order.
            counts: [E] int64 rows per expert (summing to P).

        Returns:
            [P, H] float32 expert outputs, row for row (no autograd).

        Raises:
            ValueError: rows or counts of the wrong dtype, shape or device, or counts
                negative or not summing to P.
            RuntimeError: the C library cannot be built here (see `available`).
        """
        hidden = self.hidden_size
        if (rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != hidden
                or rows.device.type != "cpu"):
            raise ValueError(f"moe cpu experts: rows must be float32 [P, {hidden}] on CPU, "
                             f"got {rows.dtype} {list(rows.shape)} on {rows.device}")
        if (counts.dtype != torch.int64 or tuple(counts.shape) != (self.num_experts,)
                or counts.device.type != "cpu"):
            raise ValueError(f"moe cpu experts: counts must be int64 [{self.num_experts}] on "
                             f"CPU, got {counts.dtype} {list(counts.shape)} on "
                             f"{counts.device}")
        library = panel_native.load_library()
        if library is None:
            raise RuntimeError("moe cpu experts: the C matmul library is unavailable on this "
                               "machine (see the log); check available() first")
        rows = rows.detach().contiguous()
        counts = counts.contiguous()
        num_rows = rows.shape[0]
        out = torch.empty(num_rows, hidden, dtype=torch.float32)
        work = torch.empty(num_rows, 2 * self.intermediate_size, dtype=torch.float32)
        rc = library.rs_moe_swiglu(self._w13_address, self._w2_address, self.num_experts,
                                   counts.data_ptr(), rows.data_ptr(), num_rows,
                                   work.data_ptr(), out.data_ptr(), torch.get_num_threads())
        if rc == -2:
            raise ValueError(f"moe cpu experts: counts {counts.tolist()} must be >= 0 and sum "
                             f"to the {num_rows} rows")
        if rc != 0:
            raise MemoryError("moe cpu experts: the kernel's scratch could not be allocated")
        return out

    def nbytes(self) -> int:
        """Bytes of all experts' panels, scales and mins (what a call reads at most)."""
        return sum(w.nbytes() for w in (*self._w13, *self._w2))
