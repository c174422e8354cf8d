"""The CPU matmul library: weights in panels of 16 output channels (`panel.h`), read by the
float32 kernel (`panel_f32.c`), the bf16 one (`panel_bf16.c`: a bf16 checkpoint's weights
kept as they are, float32 products), the int8 / int4 kernels (`panel_quant.c`), the fused decode
step (`decode_step.c`) and the mixture-of-experts SwiGLU experts (`moe_cpu.c`), which are
built together into one shared object on first use.

The linear layers (`ringserve.gpu.layers.linear`, `ringserve.gpu.layers.quant`) keep a `PanelWeight` instead
of a plain or oneDNN-packed weight and call `linear`; the fused decode step
(`ringserve.gpu.runner.decode_capture`) hands the same weights to C. As the other C kernels
(`ringserve.gpu.native.build`), the library is compiled with `$CC` (else `cc`) as
`-O3 -march=native -fopenmp`, cached under `RINGSERVE_HOME/kernels/`, and runs on torch's
OpenMP threads. When it cannot be built, `load_library` logs why once and returns None; the
layers then keep torch's matmuls.

bf16 panels from `MANY_ROWS` rows on: on a CPU with native bf16 (AVX512-BF16 / AMX-BF16) a
bf16 GEMM on bf16-rounded rows (`_bf16_rows`: what prefill costs a bf16 model, ~3x faster
than float32 there), elsewhere the float32 GEMM on the widened weight; below `MANY_ROWS`
(decode) float32 products on the bf16 weights, always.

From `MANY_ROWS` (512) rows on (prefill), a float32 `linear` is torch's GEMM instead: `addmm`
(MKL) on W^T read out of the panels (`_many_rows`: a weight-sized copy in runs of 16 floats,
so the plain weight need not be kept); results differ by float32 rounding only. The kernel's
6 x 16 register tiles are AVX2; on the AVX-512 dev VM (2 threads, medians of 9 interleaved
calls, one weight) the read-out plus `addmm` against the kernel, in ms, SmolLM2-135M shapes:
qkv 960 x 576 at 512 rows 2.46 -> 1.95, at 2,048 9.77 -> 7.25; o 576 x 576 1.55 -> 1.28,
6.01 -> 4.40; gate/up 3072 x 576 8.34 -> 6.52, 34.1 -> 25.3; down 576 x 1536 4.01 -> 3.16,
16.0 -> 11.6; the 49152 x 576 LM head 404 -> 357 and 1,554 -> 1,002 (its read-out alone
costs ~90 ms). Even at 128-192 rows, ~10% ahead at 256; below 128 the kernel wins (the
read-out costs 0.1-0.5 ms). 512 leaves room for AVX2 hosts, where this is unmeasured (the
C kernel's 64-row figures put oneDNN and it about even).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ringserve.gpu.native import build as native_build

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
SOURCES = (_DIR / "panel_f32.c", _DIR / "panel_bf16.c", _DIR / "panel_pack.c",
           _DIR / "panel_quant.c", _DIR / "decode_step.c", _DIR / "cpu_decode.c",
           _DIR / "moe_cpu.c", _DIR / "grammar_mask.c")
HEADERS = (_DIR / "panel.h", _DIR / "fast_exp.h", _DIR / "cpu_decode.h", _DIR / "moe_cpu.h")

PANEL = 16  # output channels per panel (RS_PANEL)
INT4_GROUP = 32  # inputs per int4 scale / min (RS_INT4_GROUP)
FORMATS = {"f32": 0, "int8": 1, "int4": 2, "int8g": 3, "bf16": 4}
# Float formats: the many-row shapes go to torch's GEMM (`_many_rows`).
FLOAT_FORMATS = ("f32", "bf16")

# Rows from which a float32 `linear` goes to torch's GEMM instead (`_many_rows`): see the
# module docstring.
MANY_ROWS = 512

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []


class RsWeight(ctypes.Structure):
    """`rs_weight` of panel.h."""

    _fields_ = [
        ("format", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
        ("data", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("mins", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
    ]


@dataclass(eq=False)
class PanelWeight:
    """A linear layer's weight in the panel layout (see panel.h), with its bias.

    Attributes:
        format: "f32", "bf16" (the weights' bf16 bits, float32 products), "int8", "int4" or
            "int8g" (int8 with a scale per 32 inputs).
        out_features, in_features: n and k of the logical [n, k] weight.
        data: the panels (float32, bfloat16, int8 or uint8).
        scales: int8: float32 [P * 16]; int4, int8g: float32 [P, k / 32, 16]; f32: None.
        mins: int4: float32 [P, k / 32, 16]; otherwise None.
        bias: float32 [n] or None.
    """

    format: str
    out_features: int
    in_features: int
    data: torch.Tensor
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._struct: RsWeight | None = None

    @property
    def struct(self) -> RsWeight:
        """The C view (valid while this object, which holds the tensors, lives)."""
        if self._struct is None:
            self._struct = RsWeight(
                FORMATS[self.format], self.out_features, self.in_features,
                self.data.data_ptr(), _ptr(self.scales), _ptr(self.mins), _ptr(self.bias))
        return self._struct

    def with_bias(self, bias: torch.Tensor | None) -> PanelWeight:
        """The same panels with `bias` (float32 [n], contiguous) added by the kernel."""
        if bias is not None:
            bias = bias.detach().float().contiguous()
        return PanelWeight(self.format, self.out_features, self.in_features, self.data,
                           self.scales, self.mins, bias)

    def nbytes(self) -> int:
        """Bytes of the panels, scales and mins (what a matmul reads)."""
        return sum(t.numel() * t.element_size()
                   for t in (self.data, self.scales, self.mins) if t is not None)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def num_panels(n: int) -> int:
    """Panels of 16 channels that hold `n` outputs."""
    return -(-n // PANEL)


def to_panels(matrix: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[n, k] -> [P, k, 16] (rows padded with zeros to a multiple of 16), contiguous; into
    `out` (a [P, k, 16] tensor of the dtype, e.g. a layer's panels: new weights in place)
    when given.

    float32 with the library loaded: one pass of the C pack (`panel_pack.c`, about the speed
    of a copy); otherwise a strided torch copy of the full panels plus the zero-padded last
    panel."""
    n, k = matrix.shape
    full = n // PANEL
    if out is None:
        out = torch.empty(num_panels(n), k, PANEL, dtype=matrix.dtype)
    library = _loaded[0] if _loaded else None
    if library is not None and _packable(matrix, out):
        pack_rows(library, matrix, out, 0)
        if n % PANEL:
            out[full, :, n % PANEL:].zero_()
        return out
    if full:
        out[:full].copy_(matrix[: full * PANEL].view(full, PANEL, k).transpose(1, 2))
    if n % PANEL:
        tail = torch.zeros(PANEL, k, dtype=matrix.dtype)
        tail[: n % PANEL] = matrix[full * PANEL:]
        out[full].copy_(tail.t())
    return out


def _packable(matrix: torch.Tensor, panels: torch.Tensor) -> bool:
    return (matrix.dtype == torch.float32 and panels.dtype == torch.float32
            and matrix.device.type == "cpu" and panels.device.type == "cpu"
            and panels.is_contiguous() and (matrix.shape[1] <= 1 or matrix.stride(1) == 1))


def pack_rows(library: ctypes.CDLL, rows: torch.Tensor, panels: torch.Tensor,
              row0: int) -> None:
    """Write `rows` [m, k] as rows `row0` .. `row0 + m - 1` of the weight whose panels
    [P, k, 16] are `panels` (a weight update's tensor or a fused shard, straight into a
    layer's panels); every other row is left as it is. `rows` may be a strided view (a TP
    shard's columns) and of any float dtype (converted first).

    Raises:
        ValueError: the shapes do not fit.
    """
    m, k = rows.shape
    if (panels.dim() != 3 or panels.shape[1:] != (k, PANEL) or row0 < 0
            or (m and num_panels(row0 + m) > panels.shape[0])
            or panels.dtype != torch.float32 or not panels.is_contiguous()
            or panels.device.type != "cpu"):
        raise ValueError(f"pack_rows: rows {list(rows.shape)} at row {row0} into panels "
                         f"{panels.dtype} {list(panels.shape)}")
    if not _packable(rows, panels):
        rows = rows.to(torch.float32).contiguous()
    if not m or not k:
        return
    ld = rows.stride(0) if m > 1 else k
    batch: PackBatch | None = getattr(_batching, "batch", None)
    if batch is not None:
        batch.add(rows, panels, row0, ld)
        return
    if library.rs_pack_f32_rows(rows.data_ptr(), m, k, ld, panels.data_ptr(), row0,
                                torch.get_num_threads()):
        raise MemoryError("pack_rows: the panel index could not be allocated")


class _RsPackJob(ctypes.Structure):
    """`rs_pack_job` of panel.h."""

    _fields_ = [("src", ctypes.c_void_p), ("m", ctypes.c_int64), ("k", ctypes.c_int64),
                ("ld", ctypes.c_int64), ("panels", ctypes.c_void_p), ("row0", ctypes.c_int64)]


_batching = threading.local()


class PackBatch:
    """The `pack_rows` calls of one thread, held until `flush` runs them all in one parallel
    region (`rs_pack_f32_batch`): a weight update packs a bucket's ~100 tensors with one
    barrier instead of one per tensor, which on cores shared with the trainer's copy is the
    difference between a thread descheduled once and once per tensor. Made by
    `batched_packs`; the sources and panels stay referenced until flushed."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._library = library
        self._jobs: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []

    def add(self, rows: torch.Tensor, panels: torch.Tensor, row0: int, ld: int) -> None:
        """Queue one pack (checked and converted by `pack_rows`)."""
        self._jobs.append((rows, panels, row0, ld))

    def flush(self) -> None:
        """Run every queued pack; the panels hold the rows afterwards.

        Raises:
            MemoryError: the panel index could not be allocated (nothing was packed).
        """
        jobs, self._jobs = self._jobs, []
        if not jobs:
            return
        array = (_RsPackJob * len(jobs))(*[
            _RsPackJob(rows.data_ptr(), rows.shape[0], rows.shape[1], ld, panels.data_ptr(),
                       row0) for rows, panels, row0, ld in jobs])
        if self._library.rs_pack_f32_batch(array, len(jobs), torch.get_num_threads()):
            raise MemoryError("pack_rows: the panel index could not be allocated")

    def discard(self) -> None:
        """Drop the queued packs (an abandoned round)."""
        self._jobs = []


@contextlib.contextmanager
def batched_packs(library: ctypes.CDLL | None) -> Iterator[PackBatch | None]:
    """While open, `pack_rows` on this thread queues into the batch it yields (None: no
    library, nothing to batch); the caller flushes it before it reads the panels or lets the
    sources go. Queued packs left at exit are dropped."""
    if library is None:
        yield None
        return
    batch = PackBatch(library)
    previous = getattr(_batching, "batch", None)
    _batching.batch = batch
    try:
        yield batch
    finally:
        _batching.batch = previous
        batch.discard()


def pack_f32(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PanelWeight:
    """The float32 panels of a float `[n, k]` CPU weight."""
    n, k = weight.shape
    data = to_panels(weight.detach().float())
    return PanelWeight("f32", n, k, data).with_bias(bias)


def unpack_f32(weight: PanelWeight) -> torch.Tensor:
    """The plain float32 `[n, k]` weight back from its panels (tests, and a tied embedding)."""
    p, k, _ = weight.data.shape
    return weight.data.transpose(1, 2).reshape(p * PANEL, k)[: weight.out_features]


def pack_bf16(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PanelWeight:
    """The bf16 panels of a float `[n, k]` CPU weight (rounded to bf16 unless it is bf16
    already, or float32 holding bf16 values: then exact); the bias stays float32."""
    n, k = weight.shape
    data = to_panels(weight.detach().to(torch.bfloat16))
    return PanelWeight("bf16", n, k, data).with_bias(bias)


def unpack_float(weight: PanelWeight) -> torch.Tensor:
    """The float32 `[n, k]` weight of float32 or bf16 panels (a new tensor for bf16)."""
    if weight.format not in FLOAT_FORMATS:
        raise ValueError(f"{weight.format} panels hold codes, not floats")
    return unpack_f32(weight).float()


def rows(library: ctypes.CDLL, weight: PanelWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight as float32 `[len(ids), k]`, read out of its panels in any
    format (`rs_panel_rows`: the values the kernel multiplies by; the bias is not added). A
    tied embedding's lookups from its LM head's panels.

    Raises:
        ValueError: an id outside 0 .. n - 1.
    """
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= weight.out_features):
        raise ValueError(f"panel rows: ids outside 0..{weight.out_features - 1}")
    out = torch.empty(flat.numel(), weight.in_features, dtype=torch.float32)
    if flat.numel():
        library.rs_panel_rows(ctypes.byref(weight.struct), flat.data_ptr(), flat.numel(),
                              out.data_ptr(), torch.get_num_threads())
    return out.reshape(*ids.shape, weight.in_features)


def linear(library: ctypes.CDLL, x: torch.Tensor, weight: PanelWeight) -> torch.Tensor:
    """`x @ W^T + bias` for float32 `x` [..., k], on torch's thread count.

    Raises:
        ValueError: x is not float32 with k features.
    """
    k = weight.in_features
    if x.dtype != torch.float32 or x.shape[-1] != k:
        raise ValueError(f"panel linear: x {x.dtype} {list(x.shape)} for a weight of "
                         f"{weight.out_features} x {k}")
    rows = x.reshape(-1, k)
    if weight.format in FLOAT_FORMATS and rows.shape[0] >= MANY_ROWS:
        return _many_rows(rows, weight).reshape(*x.shape[:-1], weight.out_features)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32)
    if rows.shape[0]:
        library.rs_linear(ctypes.byref(weight.struct), rows.data_ptr(), rows.shape[0],
                          out.data_ptr(), torch.get_num_threads())
    return out.reshape(*x.shape[:-1], weight.out_features)


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 / AMX-BF16; read once)."""
    if not _native_bf16:
        from ringserve.checkpoint.precision import cpu_has_native_bf16

        _native_bf16.append(cpu_has_native_bf16())
    return _native_bf16[0]


_native_bf16: list[bool] = []


def _many_rows(rows: torch.Tensor, weight: PanelWeight) -> torch.Tensor:
    """`rows @ W^T + bias` by torch's GEMM (MKL) from float32 or bf16 panels: `[P, k, 16]`
    read out as float32 `W^T` `[k, P * 16]`, a copy in runs of 16 values (the plain weight is
    not kept; bf16 widens exactly on the way, so the GEMM is float32 on the bf16 weights)."""
    p, k, _ = weight.data.shape
    columns = weight.data.permute(1, 0, 2).reshape(k, p * PANEL)[:, : weight.out_features]
    if columns.dtype == torch.bfloat16 and native_bf16():
        return _bf16_rows(rows, columns.contiguous(), weight.bias)
    if columns.dtype != torch.float32:
        columns = columns.float()
    if weight.bias is None:
        return torch.mm(rows, columns)
    return torch.addmm(weight.bias, rows, columns)


def _bf16_rows(rows: torch.Tensor, columns: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """`rows @ columns + bias` as a bf16 GEMM (oneDNN on AMX / AVX512-BF16): the rows are
    rounded to bf16 and so is each product's float32 sum, as in any bf16 model's matmul; the
    result comes back as float32. 7x the float32 GEMM at 512 x 576 x 3072 on the AMX dev VM."""
    out = torch.mm(rows.to(torch.bfloat16), columns).float()
    if bias is not None:
        out += bias
    return out


def load_library() -> ctypes.CDLL | None:
    """The compiled library (built and cached on first use), or None when it cannot be had."""
    with _lock:
        if not _loaded:
            _loaded.append(_load())
        return _loaded[0]


def _load() -> ctypes.CDLL | None:
    cc = native_build.compiler()
    if cc is None:
        logger.warning("no C compiler (CC or cc): CPU matmuls use torch's kernels")
        return None
    start = time.perf_counter()
    try:
        library = native_build.build_library(SOURCES, "panel", cc, native_build.OPENMP_FLAGS,
                                             ["-lm"], headers=HEADERS)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("the CPU matmul library is unavailable (%s): CPU matmuls use torch's "
                       "kernels", exc)
        return None
    logger.info("CPU matmul and decode-step library %s ready in %.2f s (built on first use, "
                "then cached)", library._name, time.perf_counter() - start)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.rs_linear.argtypes = [ptr, ptr, i64, ptr, ctypes.c_int]
    library.rs_linear.restype = ctypes.c_int
    library.rs_pack_f32_rows.argtypes = [ptr, i64, i64, i64, ptr, i64, ctypes.c_int]
    library.rs_pack_f32_rows.restype = ctypes.c_int
    library.rs_pack_f32_batch.argtypes = [ptr, i64, ctypes.c_int]
    library.rs_pack_f32_batch.restype = ctypes.c_int
    library.rs_panel_rows.argtypes = [ptr, ptr, i64, ptr, ctypes.c_int]
    library.rs_panel_rows.restype = ctypes.c_int
    _declare_step(library)
    _declare_moe(library)
    library.rs_apply_bitmask.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ctypes.c_int]
    library.rs_apply_bitmask.restype = ctypes.c_int
    return library


def _declare_step(library: ctypes.CDLL) -> None:
    """The fused decode step's signature (decode_step.c)."""
    ptr = ctypes.c_void_p
    library.rs_decode_step.argtypes = [ptr, ptr]
    library.rs_decode_step.restype = ctypes.c_int
    library.rs_step_work_floats.argtypes = [ptr, ctypes.c_int64]
    library.rs_step_work_floats.restype = ctypes.c_int64


def _declare_moe(library: ctypes.CDLL) -> None:
    """The SwiGLU experts' signature (moe_cpu.c, called by ringserve.gpu.moe.cpu_experts)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.rs_moe_swiglu.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    library.rs_moe_swiglu.restype = ctypes.c_int
