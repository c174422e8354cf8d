"""A trainer's parameters kept in shared memory, which the ``shm`` transport sends without a
copy.

With an ordinary source the shm transport copies every tensor of a round into its bucket
segments (one pass over the weights on the trainer, beside the workers' own pass that loads
them). A trainer on the engine's host can skip its pass: :class:`SharedWeights` moves a
module's parameters into one shared-memory segment (each parameter's ``.data`` becomes a view
of it, so the optimizer goes on updating the same ``Parameter`` objects, in place, in shared
memory) and is itself the round's `WeightSource`. `ShmSender` lists the segment in
``init_info`` (every worker maps it once) and sends each bucket whose tensors all lie in it as
slots of that segment: the workers read the trainer's parameters where they are. This is the
CPU counterpart of vLLM's CUDA IPC weight transfer.

A parameter whose ``.data`` was replaced since (``module.to(...)``, a re-assignment) no longer
lies in the segment; its bucket is then copied as with any source, so sharing never sends a
stale tensor. As with any source, nothing may write the parameters while ``send_weights``
runs. :meth:`SharedWeights.close` moves the parameters back into private memory and unlinks
the segment (the engine's mappings stay valid until it drops them).

Layout: the parameters in ``named_parameters()`` order (a tied weight once), each at an offset
that is a multiple of :data:`~ringserve.weight_transfer.buckets.ALIGN`; the pages are
reserved and mapped up front, as the transport's own segments are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import TracebackType

import torch

from ringserve.shm.segment import Segment
from ringserve.weight_transfer.buckets import ALIGN, align_up, typed_view
from ringserve.weight_transfer.segments import create_segment
from ringserve.weight_transfer.source import ModuleWeightSource, TensorMeta, tensor_meta


class SharedWeights:
    """A module's parameters moved into one shared-memory segment; a `WeightSource` of them.

    Args:
        module: the trainer's model, on the CPU.
        names: as `ModuleWeightSource`'s: the name each parameter is sent as, or None to leave
            it out (it is then not moved either).

    Raises:
        ValueError: a parameter off the CPU (shared memory holds CPU tensors: a GPU trainer
            uses the nccl backend), or of a dtype weights cannot travel as.
        WeightTransportError: ``/dev/shm`` has no room for the parameters.
    """

    def __init__(self, module: torch.nn.Module, *,
                 names: Callable[[str], str | None] | None = None) -> None:
        self._source = ModuleWeightSource(module, names=names)
        params: list[tuple[str, torch.nn.Parameter]] = []
        seen: set[int] = set()
        for name, param in self._named(module, names):
            if param.device.type != "cpu":
                raise ValueError(f"SharedWeights: parameter {name!r} is on {param.device}; "
                                 "shared memory holds CPU tensors (a GPU trainer uses the "
                                 "nccl backend)")
            tensor_meta(name, param)  # a dtype that cannot travel raises here
            if id(param) not in seen:
                seen.add(id(param))
                params.append((name, param))
        offsets: list[int] = []
        end = 0
        for _, param in params:
            offsets.append(align_up(end))
            end = offsets[-1] + param.numel() * param.element_size()
        self.segment: Segment | None = create_segment("wt_shared", max(end, ALIGN))
        buffer = torch.frombuffer(self.segment.mapping, dtype=torch.uint8)
        self._base = buffer.data_ptr()
        self._size = self.segment.size
        self._params: list[torch.nn.Parameter] = []
        with torch.no_grad():
            for (_, param), offset in zip(params, offsets, strict=True):
                view = typed_view(buffer, offset, param.dtype, tuple(param.shape))
                view.copy_(param.data)
                param.data = view
                self._params.append(param)
        del buffer

    @staticmethod
    def _named(module: torch.nn.Module, names: Callable[[str], str | None] | None
               ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, param in module.named_parameters():
            if names is None or names(name) is not None:
                yield name, param

    @property
    def nbytes(self) -> int:
        """The segment's size (the parameters' bytes and their alignment)."""
        return self._size

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where `tensor`'s bytes start in the segment, or None when they do not all lie in it
        (closed, replaced ``.data``, a non-contiguous view, an offset off :data:`ALIGN`)."""
        if self.segment is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        offset = tensor.data_ptr() - self._base
        if offset < 0 or offset % ALIGN or offset + tensor.numel() * tensor.element_size() > \
                self._size:
            return None
        return offset

    def metadata(self) -> list[TensorMeta]:
        """Names, dtypes and shapes of the parameters sent."""
        return self._source.metadata()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._source)

    def close(self) -> None:
        """Move the parameters back into private memory and unlink the segment
        (idempotent)."""
        if self.segment is None:
            return
        with torch.no_grad():
            for param in self._params:
                if self.offset_of(param.data) is not None:
                    param.data = param.data.clone()
        segment, self.segment, self._params = self.segment, None, []
        segment.unlink()
        with contextlib.suppress(BufferError):  # a caller still views a parameter's old data
            segment.mapping.close()

    def __enter__(self) -> SharedWeights:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
